"""The ALIGN / CC12M alt-text filters: each rule on hand-built rows, DuckDB against the specification
(openalign.data.filters.reference; generated corpora in test_filters_reference.py), Spark against DuckDB, the
funnel arithmetic, every input format end to end, and bad input."""

from __future__ import annotations

import itertools
import json
import random
import string
import tempfile
from collections import Counter
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from openalign.cli import main
from openalign.config import ConfigError
from openalign.data.filters import (
    FunnelReport,
    demo_person_names,
    filter_corpus,
    frequent_threshold,
    load_rules,
    resolve_person_hook,
    tokenize,
)
from openalign.data.filters.duckdb_engine import norm_sql
from openalign.data.filters.pipeline import prepare
from openalign.data.filters.reference import run_reference

WS = " \t\n\x0b\f\r"


# --------------------------------------------------------------------------------------------------
# Helpers; openalign.data.filters.reference is the specification the engines are checked against.


def write_rows(path: Path, rows: list[dict], schema: pa.Schema | None = None) -> Path:
    names = list(dict.fromkeys(k for r in rows for k in r))  # from_pylist alone takes the first row's keys
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in names} for r in rows], schema=schema), path)
    return path


def reference_filter(tmp_path: Path, rows: list[dict], rules) -> list[str | None]:
    """The reason each row is removed (None: kept) by the specification, given what an engine is given."""
    work = Path(tempfile.mkdtemp(dir=tmp_path))
    staged, plan = prepare(write_rows(work / "in.parquet", rows), rules, work)
    return run_reference(staged, plan).reasons


def kept_ids(path: Path) -> list:
    return sorted(pq.read_table(path).column("id").to_pylist())


def nonzero(report: FunnelReport) -> dict[str, int]:
    return {k: v for k, v in report.removed.items() if v}


def run(tmp_path: Path, rows: list[dict], rules, name: str = "out", **kw) -> tuple[FunnelReport, list]:
    src = write_rows(tmp_path / f"{name}_in.parquet", rows)
    report = filter_corpus(src, tmp_path / f"{name}.parquet", rules, **kw)
    return report, kept_ids(tmp_path / f"{name}.parquet")


OFF = dict(
    max_unsafe=None,
    min_shorter_side=None,
    max_aspect_ratio=None,
    max_texts_per_image=None,
    max_images_per_text=None,
    vocab_top_k=None,
    min_words=None,
    max_words=None,
)


def row(i: int, caption: str | None = "a red car", w: object = 640, h: object = 480, **extra) -> dict:
    return {"id": i, "url": f"http://x/{i}.jpg", "caption": caption, "width": w, "height": h, **extra}


# --------------------------------------------------------------------------------------------------
# Tokenisation and the vocabulary cut


def test_tokenize_documented_examples():
    assert tokenize("Red car!") == tokenize("red  car") == ["red", "car"]
    assert tokenize("e-mail 1920x1080 ...") == ["e-mail", "1920x1080"]
    assert tokenize("  \t(Hello), WORLD!!\n!!! ") == ["hello", "world"]
    assert tokenize("") == [] and tokenize("!?") == []


def test_duckdb_normalisation_matches_python_tokenize():
    rng = random.Random(0)
    alphabet = "ab Z" + string.punctuation + WS + "éÄ\u00a0\u2028ß"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14))) for _ in range(3000)]
    texts += ["Red car!", " !a! ", "a !! b", "a!b! c", "!!", "x\u2028!", "e-mail", "'quoted' \"words\""]
    # Separator runs of every shape: a single space (left alone), longer runs, runs at the ends, punctuation
    # inside a word (kept), and whitespace that is not ASCII (not a separator).
    texts += ["a b", "a  b", "a\tb", "a ,b", "a, b", "a ,, b", "-a-", " a", "a ", "(a)", "a .", ". a", "a.b", " ", ""]
    texts += ["a\u00a0b", "\u00a0a\u00a0", "a-b c-d", ",a, b,", "a\x0bb", "A\r\nB", "..a..b..", "a .b. c"]
    assert_duckdb_normalises_as_tokenize(texts)


def assert_duckdb_normalises_as_tokenize(texts: list[str]) -> None:
    """DuckDB's normalisation SQL gives each text the words Python's ``tokenize`` gives it, space-joined."""
    con = duckdb.connect()
    con.execute("CREATE TABLE t (i INTEGER, s VARCHAR)")
    con.executemany("INSERT INTO t VALUES (?, ?)", list(enumerate(texts)))
    got = dict(con.execute(f"SELECT i, {norm_sql('s')} FROM t").fetchall())
    for i, text in enumerate(texts):
        assert got[i] == " ".join(tokenize(text)), repr(text)


def test_frequent_threshold_keeps_ties():
    hist = {10: 1, 5: 3, 2: 4}  # counts 10, 5, 5, 5, 2, 2, 2, 2
    assert frequent_threshold(hist, 1) == 10
    assert frequent_threshold(hist, 2) == 5  # the 2nd largest is 5: all three 5s are frequent
    assert frequent_threshold(hist, 4) == 5
    assert frequent_threshold(hist, 5) == 2
    assert frequent_threshold(hist, 8) == 2
    assert frequent_threshold(hist, 9) == 0  # fewer n-grams than K: nothing is rare


# --------------------------------------------------------------------------------------------------
# Each rule on hand-built rows


def test_image_size_rules(tmp_path):
    rows = [row(0, w=201, h=300), row(1, w=200, h=300), row(2, w=300, h=200), row(3, w=5000, h=201)]
    rules = load_rules("align", **{**OFF, "min_shorter_side": 200})
    assert run(tmp_path, rows, rules)[1] == [0, 3]
    rows = [row(0, w=299, h=100), row(1, w=300, h=100), row(2, w=100, h=301), row(3, w=100, h=100)]
    report, kept = run(tmp_path, rows, load_rules("align", **{**OFF, "max_aspect_ratio": 3.0}), "aspect")
    assert kept == [0, 3] and report.removed["aspect_ratio"] == 2
    rows = [row(0, w=250, h=100), row(1, w=251, h=100), row(2, w=100, h=250)]
    cc = load_rules("cc12m", **{**OFF, "min_word_count": None, "max_repeated_fraction": None, "max_aspect_ratio": 2.5})
    assert run(tmp_path, rows, cc, "cc")[1] == [0, 2]  # CC12M keeps ratio <= 2.5


@pytest.mark.parametrize("engine", ["duckdb", pytest.param("spark", marks=pytest.mark.slow)])
def test_unsafe_rule_and_bad_scores(tmp_path, request, engine):
    """A score that is not a number is bad_unsafe_score on both engines (Spark's isnan(NULL) is false)."""
    rows = [
        row(0, punsafe="0.5"),
        row(1, punsafe="0.51"),
        row(2, punsafe=None),
        row(3, punsafe="n/a"),
        row(4, punsafe="nan"),
    ]
    report, kept = run(tmp_path, rows, load_rules("align", **{**OFF, "max_unsafe": 0.5}), **engine_kw(request, engine))
    assert kept == [0, 2]
    assert report.removed["unsafe"] == 1 and report.removed["bad_unsafe_score"] == 2
    # Without the column the rule is skipped, and the report says why.
    report, kept = run(tmp_path, [row(0), row(1)], load_rules("align", **{**OFF, "max_unsafe": 0.5}), "nocol")
    assert kept == [0, 1] and "unsafe" in report.skipped and "unsafe" not in report.removed


def test_texts_per_image_counts_rows_of_the_same_image_identity(tmp_path):
    rows = [row(i, url="http://a.jpg") for i in range(3)]  # 3 alt-texts for image a
    rows += [row(3 + i, url="http://b.jpg") for i in range(2)]  # 2 for image b
    # c and d are different urls of the same bytes: sha256 decides the identity
    rows += [row(5, url="http://c.jpg", sha256="s1"), row(6, url="http://d.jpg", sha256="s1"), row(7, sha256="s1")]
    rows += [row(8, url="http://e.jpg", sha256=""), row(9, url="http://e.jpg", sha256=None)]  # empty hash: url
    report, kept = run(tmp_path, rows, load_rules("align", **{**OFF, "max_texts_per_image": 2}))
    assert kept == [3, 4, 8, 9]
    assert report.removed["image_text_count"] == 6


def test_shared_text_counts_distinct_images_of_the_normalised_text(tmp_path):
    rows = [row(0, "Photo!"), row(1, "photo"), row(2, " PHOTO ")]  # 3 images share one alt-text
    rows += [row(3, "alt img", url="http://same"), row(4, "alt img", url="http://same"), row(5, "alt img")]
    rows += [row(6, "a unique caption")]
    report, kept = run(tmp_path, rows, load_rules("align", **{**OFF, "max_images_per_text": 2}))
    assert kept == [3, 4, 5, 6]  # "alt img" is on 2 distinct images only
    assert nonzero(report) == {"shared_text": 3}


def test_rare_ngrams_outside_the_top_k(tmp_path):
    # "a b" x3 (case and punctuation normalise away), "a c", "b d": unigrams a 4, b 4, c 1, d 1;
    # bigrams "a b" 3, "a c" 1, "b d" 1; so 7 distinct n-grams with counts 4, 4, 3, 1, 1, 1, 1
    rows = [row(0, "a b"), row(1, "a b"), row(2, "A, b!"), row(3, "a c"), row(4, "b d")]
    # K = 3: a, b, "a b" are frequent; c, d, "a c", "b d" are rare
    report, kept = run(tmp_path, rows, load_rules("align", **{**OFF, "vocab_top_k": 3}))
    assert kept == [0, 1, 2] and report.removed["rare_ngram"] == 2
    assert report.stats["distinct_ngrams"] == 7 and report.stats["frequent_min_count"] == 3
    # K = 2 cuts "a b" (count 3) too; K = 1 cuts inside the tie at 4, and both tied words stay frequent
    assert run(tmp_path, rows, load_rules("align", **{**OFF, "vocab_top_k": 2}), "k2")[1] == []
    report, kept = run(tmp_path, rows, load_rules("align", **{**OFF, "vocab_top_k": 1}), "k1")
    assert kept == [] and report.stats["frequent_min_count"] == 4
    # K = 7 or more: nothing is rare
    assert run(tmp_path, rows, load_rules("align", **{**OFF, "vocab_top_k": 7}), "k7")[1] == [0, 1, 2, 3, 4]
    # Unigrams only (counts 4, 4, 1, 1): at K = 2 only c and d are rare
    uni = load_rules("align", **{**OFF, "vocab_top_k": 2, "rare_ngram_order": 1})
    assert run(tmp_path, rows, uni, "uni")[1] == [0, 1, 2]
    # Counted over the raw corpus: rows later removed by another rule still count
    rows2 = [row(0, "x y", w=10), row(1, "x y", w=10), row(2, "x y"), row(3, "q r")]
    rules = load_rules("align", **{**OFF, "vocab_top_k": 3, "min_shorter_side": 200})
    report, kept = run(tmp_path, rows2, rules, "raw")
    # (after small_image every n-gram would be seen once, and nothing would be rare)
    assert kept == [2] and nonzero(report) == {"small_image": 2, "rare_ngram": 1}


def test_cc12m_word_rules(tmp_path):
    rules = load_rules("cc12m", **{**OFF, "min_word_count": 2, "min_words": 3, "max_words": 5})
    rows = [
        row(0, "one two three"),
        row(1, "one two three"),
        row(2, "one two rare"),  # "rare" occurs once
        row(3, "one two"),  # too few
        row(4, "one two three one two three"),  # 6 words: too many
    ]
    report, kept = run(tmp_path, rows, rules)
    assert kept == [0, 1]
    assert report.removed["rare_word"] == 1 and report.removed["too_few_words"] == 1
    assert report.removed["too_many_words"] == 1
    rep = load_rules("cc12m", **{**OFF, "min_word_count": None, "max_repeated_fraction": 0.2})
    rows = [row(0, "a a b c d"), row(1, "a a b c"), row(2, "a b c")]  # repeated 1/5 = 0.2, 1/4, 0
    assert run(tmp_path, rows, rep, "rep")[1] == [0, 2]


def test_bad_rows_get_their_own_funnel_lines(tmp_path):
    rows = [row(0), row(1, None), row(2, " \t\n"), row(3, w="abc"), row(4, w="0"), row(5, h="inf"), row(6, w=None)]
    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("url", pa.string()),
            ("caption", pa.string()),
            ("width", pa.string()),
            ("height", pa.string()),
        ]
    )
    src = write_rows(
        tmp_path / "bad.parquet", [{**r, "width": _s(r["width"]), "height": _s(r["height"])} for r in rows], schema
    )
    report = filter_corpus(src, tmp_path / "bad_out.parquet", load_rules("align", **{**OFF, "min_shorter_side": 200}))
    assert nonzero(report) == {"missing_text": 1, "empty_text": 1, "bad_size": 4}
    assert report.rows_in == 7 and report.rows_out == 1


def test_empty_text_is_only_ascii_whitespace(tmp_path):
    rows = [row(0, " \t\n\x0b\f\r"), row(1, "\u00a0"), row(2, "\u2028 "), row(3, ""), row(4, " ! ")]
    report, kept = run(tmp_path, rows, load_rules("align", **OFF))
    assert kept == [1, 2, 4] and nonzero(report) == {"empty_text": 2}
    assert [why for why in reference_filter(tmp_path, rows, load_rules("align", **OFF))] == [
        "empty_text",
        None,
        None,
        "empty_text",
        None,
    ]


def zipf_corpus(n: int, seed: int) -> list[dict]:
    """Captions drawn from a skewed vocabulary, a fifth of them repeating an earlier caption, so n-grams
    range from very common to seen once, and rare ones are spread over one text or several."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(120)]
    weights = [1.0 / (i + 1) for i in range(len(vocab))]
    rows: list[dict] = []
    for i in range(n):
        if rows and rng.random() < 0.2:
            caption = rng.choice(rows)["caption"]
        else:
            words = rng.choices(vocab, weights, k=rng.randint(1, 7))
            caption = " ".join(w.upper() + "!" if rng.random() < 0.1 else w for w in words)
        rows.append(row(i, caption, url=f"http://img/{i}.jpg"))
    return rows


def _rare_split(rows: list[dict], top_k: int) -> tuple[int, int]:
    """How many (word, successor) pairs of the distinct texts are rare and in more than one place, and how
    many are not rare: the two sides the DuckDB engine can build its rare-text join on."""
    texts = Counter(" ".join(tokenize(r["caption"])) for r in rows)
    counts: Counter = Counter()
    for text, n in texts.items():
        ws = text.split(" ") if text else []
        for g in ws + [f"{a} {b}" for a, b in itertools.pairwise(ws)]:
            counts[g] += n
    ranked = sorted(counts.values(), reverse=True)
    threshold = ranked[top_k - 1] if len(ranked) > top_k else 0
    places: Counter = Counter()
    for text in texts:
        ws = text.split(" ") if text else []
        places.update(zip(ws, [*ws[1:], ""], strict=True))
    rare = {p: counts[p[0]] < threshold or (p[1] != "" and counts[f"{p[0]} {p[1]}"] < threshold) for p in places}
    return sum(1 for p in places if rare[p] and places[p] > 1), sum(1 for p in places if not rare[p])


def test_rare_ngram_texts_match_the_reference_whichever_side_the_join_builds_on(tmp_path):
    rows = zipf_corpus(1500, seed=3)
    sides = set()
    for top_k in (5, 30, 150, 400, 600, 5000):
        rules = load_rules("align", **{**OFF, "vocab_top_k": top_k})
        report, kept = run(tmp_path, rows, rules, f"k{top_k}")
        expected = reference_filter(tmp_path, rows, rules)
        assert kept == [r["id"] for r, why in zip(rows, expected, strict=True) if why is None], top_k
        assert report.removed.get("rare_ngram", 0) == expected.count("rare_ngram"), top_k
        repeated_rare, common = _rare_split(rows, top_k)
        if repeated_rare:
            sides.add("rare" if repeated_rare <= common else "common")
    assert sides == {"rare", "common"}


def test_binary_parquet_captions_are_decoded_and_invalid_utf8_counted(tmp_path):
    captions = pa.array([b"a red car", b"caf\xe9 au lait", None], pa.binary())
    table = pa.table({"id": [0, 1, 2], "url": ["a", "b", "c"], "caption": captions})
    pq.write_table(table, tmp_path / "b.parquet")
    report = filter_corpus(tmp_path / "b.parquet", tmp_path / "b_out.parquet", load_rules("align", **OFF))
    assert nonzero(report) == {"non_utf8_text": 1, "missing_text": 1}
    out = pq.read_table(tmp_path / "b_out.parquet")
    assert out.column("caption").to_pylist() == ["a red car"] and out.column_names == ["id", "url", "caption"]


@pytest.mark.parametrize("engine", ["duckdb", pytest.param("spark", marks=pytest.mark.slow)])
def test_invalid_utf8_in_parquet_string_columns_is_counted_not_fatal(tmp_path, request, engine):
    """A string column whose writer did not check UTF-8: the row with such an alt-text is removed and counted
    as non_utf8_text (as for JSONL, CSV and binary columns); such bytes in another column become U+FFFD."""

    def unchecked(values: list[bytes]) -> pa.Array:
        return pa.array(values, pa.binary()).view(pa.string())

    captions = unchecked([b"a red car", b"caf\xe9 au lait", b"a blue bike", b"a green tree"])
    urls = unchecked([b"http://x/0", b"http://x/1", b"http://x/\xff2", b"http://x/3"])
    table = pa.table({"id": [0, 1, 2, 3], "url": urls, "caption": captions})
    pq.write_table(table, tmp_path / "s.parquet")
    pq.write_table(pa.table({"id": [4], "url": ["http://x/4"], "caption": ["a big boat"]}), tmp_path / "t.parquet")
    spark = request.getfixturevalue("spark") if engine == "spark" else None
    out = tmp_path / "out.parquet"
    report = filter_corpus(tmp_path / "*.parquet", out, load_rules("align", **OFF), engine=engine, spark=spark)
    assert nonzero(report) == {"non_utf8_text": 1} and report.rows_in == 5 and report.rows_out == 4
    got = sorted(pq.read_table(out).to_pylist(), key=lambda r: r["id"])
    assert [r["caption"] for r in got] == ["a red car", "a blue bike", "a green tree", "a big boat"]
    assert got[1]["url"] == "http://x/\ufffd2" and got[0]["url"] == "http://x/0"


def _s(v: object) -> str | None:
    return None if v is None else str(v)


# --------------------------------------------------------------------------------------------------
# DuckDB against the reference on a random corpus where every rule has work


def random_corpus(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    vocab = ["red", "car", "Dog", "the", "a", "on", "grass", "blue", "sky", "photo", "img", "x1", "zeta", "q"]
    rows = []
    for i in range(n):
        k = rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 9])
        words = [rng.choice(vocab) + rng.choice(["", "", "", ",", "!", "..."]) for _ in range(k)]
        caption = rng.choice([" ", "  ", "\t"]).join(words)
        if rng.random() < 0.05:
            caption = rng.choice([None, "", "   "])
        elif rng.random() < 0.1:
            caption = rng.choice(["1920x1080", "alt img", "Alt IMG!"])
        rows.append(
            {
                "id": i,
                "url": f"http://img/{rng.randint(0, n // 3)}.jpg",
                "sha256": rng.choice([None, None, None, f"h{rng.randint(0, 5)}"]),
                "caption": caption,
                "width": rng.choice([None, 0, 150, 199, 200, 201, 300, 450, 600, 900]),
                "height": rng.choice([150, 200, 201, 300, 450, 600, 900]),
                "punsafe": rng.choice([None, 0.0, 0.1, 0.5, 0.7, float("nan")]),
            }
        )
    return rows


EVERYTHING_ON = {
    "max_texts_per_image": 4,
    "max_images_per_text": 3,
    "vocab_top_k": 25,
    "min_words": 2,
    "max_words": 6,
    "min_word_count": 3,
    "max_repeated_fraction": 0.3,
}


@pytest.mark.parametrize("preset", ["align", "cc12m"])
def test_duckdb_matches_reference(tmp_path, preset):
    rows = random_corpus(600)
    rules = load_rules(preset, **EVERYTHING_ON)
    report, kept = run(tmp_path, rows, rules)
    expected = reference_filter(tmp_path, rows, rules)
    assert kept == [r["id"] for r, why in zip(rows, expected, strict=True) if why is None]
    counts = Counter(why for why in expected if why is not None)
    assert nonzero(report) == dict(counts)
    assert len([v for v in report.removed.values() if v]) >= 8  # most rules have something to remove
    assert report.rows_in == len(rows) == report.rows_out + sum(report.removed.values())


# --------------------------------------------------------------------------------------------------
# Spark keeps the same rows (one session for the whole run, conftest's `spark`: Spark starts slowly)


@pytest.mark.slow
def test_spark_and_duckdb_keep_identical_rows(tmp_path, spark):
    rows = random_corpus(400, seed=1)
    rules = load_rules("align", **EVERYTHING_ON)
    src = write_rows(tmp_path / "in.parquet", rows)
    duck = filter_corpus(src, tmp_path / "duck.parquet", rules)
    sprk = filter_corpus(src, tmp_path / "spark.parquet", rules, engine="spark", spark=spark)
    assert kept_ids(tmp_path / "duck.parquet") == kept_ids(tmp_path / "spark.parquet")
    assert duck.steps == sprk.steps and duck.rows_out == sprk.rows_out and duck.stats == sprk.stats
    assert set(pq.read_table(tmp_path / "spark.parquet").column_names) == set(rows[0])


# --------------------------------------------------------------------------------------------------
# Funnel arithmetic, config loading, person names


def test_funnel_must_add_up():
    report = FunnelReport(rows_in=10, steps=[("missing_text", 2), ("too_few_words", 3)], rows_out=5)
    d = report.to_dict()
    assert [s["remaining"] for s in d["steps"]] == [8, 5] and d["rows_out"] == 5
    assert "too_few_words" in report.table()
    with pytest.raises(RuntimeError, match="does not add up"):
        FunnelReport(rows_in=10, steps=[("missing_text", 2)], rows_out=7)


def test_load_rules(tmp_path):
    assert load_rules("align").max_words == 20 and load_rules("align").vocab_top_k == 100_000_000
    cc = load_rules("cc12m")
    assert (cc.max_aspect_ratio, cc.aspect_ratio_inclusive, cc.max_words, cc.min_word_count) == (2.5, True, 256, 20)
    assert cc.max_repeated_fraction == 0.2 and cc.max_images_per_text is None
    path = tmp_path / "r.yaml"
    path.write_text("preset: cc12m\nmax_words: 30\ncolumns:\n  text: alt\nmin_word_count: null\n")
    r = load_rules(path)
    assert (r.max_words, r.columns.text, r.min_word_count, r.min_words, r.name) == (30, "alt", None, 3, "cc12m")
    with pytest.raises(ConfigError, match="unknown config key 'max_wrods'"):
        load_rules("align", max_wrods=3)
    with pytest.raises(ConfigError, match="min_words 5 is larger than max_words 4"):
        load_rules("align", min_words=5, max_words=4)
    with pytest.raises(ConfigError, match="unknown rules"):
        load_rules("laion")


def test_person_names_hook(tmp_path):
    assert demo_person_names("Emma Watson at the premiere") == "<PERSON> at the premiere"
    assert demo_person_names("a red car") == "a red car"
    assert resolve_person_hook("string:capwords")("a b") == "A B"
    with pytest.raises(ValueError, match="module:function"):
        resolve_person_hook("nocolon")
    rows = [row(0, "John Smith walks a dog"), row(1, "John Smith walks a dog"), row(2, "a dog walks")]
    rules = load_rules("align", **{**OFF, "max_images_per_text": 2})
    src = write_rows(tmp_path / "p.parquet", rows)
    filter_corpus(src, tmp_path / "p_out.parquet", rules, person_hook="demo")
    out = pq.read_table(tmp_path / "p_out.parquet").column("caption").to_pylist()
    assert out == ["<PERSON> walks a dog", "<PERSON> walks a dog", "a dog walks"]


# --------------------------------------------------------------------------------------------------
# Inputs and outputs, end to end through the CLI


def cli_rows() -> list[dict]:
    return [
        {"key": "000", "url": "http://a", "caption": "a red car on the road", "width": 640, "height": 480},
        {"key": "001", "url": "http://b", "caption": "tiny", "width": 640, "height": 480},
        {"key": "002", "url": "http://c", "caption": "a blue sky over the sea", "width": 100, "height": 480},
        {"key": "003", "url": "http://d", "caption": "a dog on green grass", "width": 800, "height": 600},
    ]


def check_cli_report(report_path: Path, rows_in: int) -> dict:
    report = json.loads(report_path.read_text())
    assert report["rows_in"] == rows_in == report["rows_out"] + sum(s["removed"] for s in report["steps"])
    return report


def test_cli_parquet_to_parquet(tmp_path, capsys):
    src = write_rows(tmp_path / "in.parquet", cli_rows())
    out, rep = tmp_path / "out.parquet", tmp_path / "funnel.json"
    assert main(["filter", str(src), str(out), "--report", str(rep), "--quiet"]) == 0
    table = pq.read_table(out)
    assert table.column_names == ["key", "url", "caption", "width", "height"]
    assert table.column("key").to_pylist() == ["000", "003"]
    assert table.schema.field("width").type == pa.int64()
    report = check_cli_report(rep, 4)
    assert {s["step"]: s["removed"] for s in report["steps"]}["small_image"] == 1
    assert "rows out" in capsys.readouterr().out
    assert main(["filter", str(src), str(out), "--quiet"]) == 2  # exists, no --overwrite
    assert "exists" in capsys.readouterr().err


def test_cli_csv_with_bad_lines_to_csv(tmp_path, capsys):
    lines = [
        b"key,url,caption,width,height",
        b"000,http://a,a red car on the road,640,480",
        b'001,http://b,"a quoted, caption here",640,480',
        b"002,http://c,caf\xe9 latte art photo,640,480",  # latin-1, not UTF-8
        b"003,http://d,a dog on green grass,n/a,480",
        b"004,http://e,too,many,fields,here",
        b"005,http://f,,640,480",
    ]
    src = tmp_path / "in.csv"
    src.write_bytes(b"\n".join(lines) + b"\n")
    out, rep = tmp_path / "out.csv", tmp_path / "funnel.json"
    # By default a row that does not parse stops the run, naming its line, before anything is written.
    assert main(["filter", str(src), str(out), "--report", str(rep), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "line 6: 6 fields where the header has 5" in err and err.count("\n") == 1
    assert not out.exists() and not rep.exists()
    args = ["filter", str(src), str(out), "--report", str(rep), "--quiet", "--max-malformed-rows", "1"]
    assert main(args) == 0
    text = out.read_text()
    assert text.splitlines()[0] == "key,url,caption,width,height"
    assert "a red car on the road" in text and "a quoted, caption here" in text and "dog" not in text
    report = check_cli_report(rep, 6)
    removed = {s["step"]: s["removed"] for s in report["steps"]}
    assert removed["malformed_row"] == 1 and removed["non_utf8_text"] == 1
    assert removed["bad_size"] == 1 and removed["empty_text"] == 1
    assert report["input_errors"] == [f"malformed_row: {src}: line 6: 6 fields where the header has 5"]


def test_cli_jsonl_to_jsonl_with_cc12m(tmp_path):
    rows = [{**r, "width": 900, "height": 700, "extra": {"nested": i}} for i, r in enumerate(cli_rows())]
    lines = [json.dumps(r).encode() for r in rows]
    lines.append(b"{not json")
    lines.append(b'{"key": "009", "url": "http://z", "caption": "bad \xff bytes here", "width": 900, "height": 700}')
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    out, rep = tmp_path / "out.jsonl", tmp_path / "funnel.json"
    args = ["filter", str(src), str(out), "--rules", "cc12m", "--set", "min_word_count=null", "--report", str(rep)]
    assert main([*args, "--quiet"]) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["key"] for g in got] == ["000", "002", "003"]
    assert got[0]["width"] == 900 and "extra" in got[0]
    removed = {s["step"]: s["removed"] for s in check_cli_report(rep, 6)["steps"]}
    assert removed["malformed_row"] == 1 and removed["non_utf8_text"] == 1 and removed["too_few_words"] == 1


def test_cli_webdataset_shards(tmp_path):
    from PIL import Image

    from openalign.data.shards import write_shards

    samples = []
    for r in cli_rows():
        image = Image.new("RGB", (r["width"] // 20, r["height"] // 20), (200, 10, 10))
        meta = {
            "url": r["url"],
            "width": r["width"],
            "height": r["height"],
            "punsafe": 0.9 if r["key"] == "003" else 0.1,
        }
        samples.append({"key": r["key"], "jpg": image, "txt": r["caption"], "json": meta})
    write_shards(samples, tmp_path / "shards", samples_per_shard=2)
    out, rep = tmp_path / "out.parquet", tmp_path / "funnel.json"
    spec = str(tmp_path / "shards" / "{00000..00001}.tar")
    assert main(["filter", spec, str(out), "--report", str(rep), "--quiet"]) == 0
    table = pq.read_table(out)
    assert table.column("key").to_pylist() == ["000"]  # 001 too short, 002 small, 003 unsafe
    assert {"url", "caption", "width", "height", "punsafe"} <= set(table.column_names)
    removed = {s["step"]: s["removed"] for s in check_cli_report(rep, 4)["steps"]}
    assert removed["unsafe"] == 1 and removed["small_image"] == 1 and removed["too_few_words"] == 1


def test_missing_columns_are_named(tmp_path, capsys):
    src = write_rows(tmp_path / "in.parquet", [{"url": "u", "caption": "a b c", "w": 1}])
    assert main(["filter", str(src), str(tmp_path / "o.parquet"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("openalign filter: error:") and "'width'" in err and "'height'" in err
    src = write_rows(tmp_path / "in2.parquet", [{"url": "u", "alt_txt": "a b c"}])
    with pytest.raises(ValueError, match="no alt-text column"):
        filter_corpus(src, tmp_path / "o2.parquet", load_rules("align", **OFF))
    with pytest.raises(ValueError, match="no text column 'alt'"):
        filter_corpus(src, tmp_path / "o2.parquet", load_rules("align", **OFF, columns={"text": "alt"}))


# --------------------------------------------------------------------------------------------------
# Strict tables: no row disappears inside another, and a column of the wrong type is named. Both engines
# read the same staged table, so each case runs on both.

ENGINES = ["duckdb", pytest.param("spark", marks=pytest.mark.slow)]


def crawl_csv(path: Path, n: int, captions: dict[int, str]) -> Path:
    """``n`` rows written by hand (bad quoting stays bad); row i is on line i + 2."""
    rows = [f"{i:05d},http://x/{i}.jpg,{captions.get(i, f'a red car number {i}')},640,480" for i in range(n)]
    path.write_text("\n".join(["key,url,caption,width,height", *rows]) + "\n")
    return path


def engine_kw(request: pytest.FixtureRequest, engine: str) -> dict:
    return {"engine": engine, "spark": request.getfixturevalue("spark") if engine == "spark" else None}


def kept_keys(path: Path) -> list[str]:
    return sorted(pq.read_table(path).column("key").to_pylist())


@pytest.mark.parametrize("engine", ["duckdb", "spark"])  # the input is refused before an engine starts
def test_a_stray_quote_stops_the_run_naming_its_line(tmp_path, capsys, engine):
    src = crawl_csv(tmp_path / "crawl.csv", 300, {4: '"a stray quote opens here'})
    out, rep = tmp_path / "out.parquet", tmp_path / "funnel.json"
    assert main(["filter", str(src), str(out), "--report", str(rep), "--engine", engine, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("openalign filter: error:") and err.count("\n") == 1
    assert f"{src}: line 6: a quoted value opened on this line is never closed" in err and "--max-malformed-rows" in err
    assert not out.exists() and not rep.exists()


@pytest.mark.parametrize("engine", ENGINES)
def test_malformed_rows_within_the_allowance_are_counted_and_every_other_row_is_read(tmp_path, request, engine):
    rules, kw = load_rules("align", **OFF), engine_kw(request, engine)
    unclosed = crawl_csv(tmp_path / "unclosed.csv", 300, {4: '"a stray quote opens here'})
    # a second bad quote (an unquoted inch mark before a comma) closes the first 195 rows later
    paired = crawl_csv(tmp_path / "paired.csv", 300, {4: '"a stray quote opens here', 199: 'a vinyl record 12"'})
    for src in (unclosed, paired):
        out = tmp_path / f"{src.stem}_out.parquet"
        report = filter_corpus(src, out, rules, max_malformed_rows=1, **kw)
        assert report.rows_in == 300 and report.removed["malformed_row"] == 1 and report.rows_out == 299
        assert kept_keys(out) == [f"{i:05d}" for i in range(300) if i != 4]
        assert len(report.input_errors) == 1 and report.input_errors[0].startswith(f"malformed_row: {src}: line 6: ")
    with pytest.raises(ValueError, match=r"paired\.csv: line 6: a quoted value runs from this line to line 201"):
        filter_corpus(paired, tmp_path / "strict.parquet", rules, **kw)
    # The allowance is a ceiling over the whole input: a second malformed row is the error, named.
    twice = crawl_csv(tmp_path / "twice.csv", 300, {4: '"a stray quote', 250: "too,many"})
    with pytest.raises(ValueError, match=r"twice\.csv: line 252: 6 fields where the header has 5 \(malformed row 2"):
        filter_corpus(twice, tmp_path / "twice.parquet", rules, max_malformed_rows=1, **kw)
    assert not (tmp_path / "twice.parquet").exists() and not (tmp_path / "strict.parquet").exists()


@pytest.mark.parametrize("fmt", ["csv", "tsv"])
def test_quoted_delimiters_newlines_and_quotes_read_every_row(tmp_path, fmt):
    import csv

    captions = [
        "a red car, parked outside",
        "two lines:\nthe second, with a comma",
        "three\nshort\nlines",
        'she said "hello", then left',
        'a 5" screen, 12" wide',
        "a tab\tinside",
    ]
    rows = [{"key": f"{i:05d}", "url": f"http://x/{i}", "caption": captions[i % 6], "w": "640"} for i in range(300)]
    src = tmp_path / f"in.{fmt}"
    with open(src, "w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]), delimiter="\t" if fmt == "tsv" else ",", lineterminator="\r\n")
        writer.writeheader()
        writer.writerows(rows)
        f.write("\r\n")  # a blank line is not a record
    report = filter_corpus(src, tmp_path / "out.parquet", load_rules("align", **OFF))
    assert report.rows_in == 300 == report.rows_out and report.removed["malformed_row"] == 0
    assert pq.read_table(tmp_path / "out.parquet").to_pylist() == rows


@pytest.mark.parametrize("engine", ["duckdb", "spark"])  # refused before an engine starts
@pytest.mark.parametrize(
    ("column", "values", "held"),
    [
        ("caption", pa.array([1, 2, 3]), "int64"),
        ("caption", pa.array([["a red", "car"], ["a dog"], []]), "list<"),
        ("width", pa.array([[640], [480], [1]]), "list<"),
    ],
    ids=["int_caption", "list_caption", "list_width"],
)
def test_a_column_of_the_wrong_type_is_named(tmp_path, capsys, engine, column, values, held):
    columns = {"url": ["a", "b", "c"], "caption": ["a red car"] * 3, "width": [640] * 3, "height": [480] * 3}
    table = pa.table({**columns, column: values})
    pq.write_table(table, tmp_path / "in.parquet")
    out = tmp_path / "out.parquet"
    assert main(["filter", str(tmp_path / "in.parquet"), str(out), "--engine", engine, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"column '{column}' holds {held}" in err and not out.exists()


def test_json_lines_that_do_not_parse_are_skipped_and_counted_with_their_reason(tmp_path):
    good = {"key": "0", "url": "http://a", "caption": "a red car on the road", "width": 640, "height": 480}
    lines = [json.dumps(good), "{not json", "[1, 2]", json.dumps({**good, "key": "3", "caption": 1920})]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    report = filter_corpus(src, tmp_path / "out.parquet", load_rules("align", **OFF))
    assert report.rows_in == 4 and report.removed["malformed_row"] == 3 and report.rows_out == 1
    assert report.input_errors == [
        f"bad_json: {src}: line 2",
        f"not_an_object: {src}: line 3: a JSON list",
        f"caption_not_text: {src}: line 4: 'caption' holds int",
    ]
    # A key that never holds text is not an alt-text column: named, not cast.
    src.write_text("\n".join(json.dumps({**good, "caption": i}) for i in range(3)) + "\n")
    with pytest.raises(ValueError, match="column 'caption' holds int values, not text"):
        filter_corpus(src, tmp_path / "out2.parquet", load_rules("align", **OFF))


# --------------------------------------------------------------------------------------------------
# img2dataset metadata: width/height are its resized copy's, original_* the crawl's; status is its verdict


def img2dataset_rows() -> list[dict]:
    def r(i, caption, ow, oh, status="success"):
        size = 256 if status == "success" else None
        return {"key": f"{i:03d}", "url": f"http://x/{i}", "caption": caption, "width": size, "height": size,
                "original_width": ow, "original_height": oh, "status": status}  # fmt: skip

    rows = [r(i, f"a small red car number {i}", 120, 90) for i in range(40)]  # resized up to 256x256
    rows += [r(i, f"a large blue boat number {i}", 1200, 900) for i in range(40, 60)]
    rows += [r(i, None, None, None, "failed_to_download") for i in range(60, 70)]
    rows += [r(70, "a photo that failed to resize", 800, 600, "failed_to_resize")]
    rows += [r(71, "a photo without a status", 800, 600, None)]
    return rows


@pytest.mark.parametrize("engine", ENGINES)
def test_img2dataset_sizes_are_the_originals_and_failed_downloads_have_their_own_line(tmp_path, request, engine):
    rows = img2dataset_rows()
    rules, kw = (
        load_rules("align", **{**OFF, "min_shorter_side": 200, "max_aspect_ratio": 3.0}),
        engine_kw(request, engine),
    )
    src = write_rows(tmp_path / "in.parquet", rows)
    report = filter_corpus(src, tmp_path / "out.parquet", rules, **kw)
    # Failed rows (null caption and sizes) are download_failed before anything else could claim them.
    assert report.steps[0] == ("download_failed", 12) and nonzero(report) == {"download_failed": 12, "small_image": 40}
    assert kept_keys(tmp_path / "out.parquet") == [f"{i:03d}" for i in range(40, 60)]
    assert report.meta["size_columns"] == ["original_width", "original_height"]
    assert "sizes from original_width x original_height" in report.table()
    # Without the originals, width/height are the sizes there are (and the resized 256x256 pass).
    plain = [{k: v for k, v in r.items() if not k.startswith("original_")} for r in rows]
    src = write_rows(tmp_path / "plain.parquet", plain)
    report = filter_corpus(src, tmp_path / "plain_out.parquet", rules, **kw)
    assert nonzero(report) == {"download_failed": 12} and report.meta["size_columns"] == ["width", "height"]


def test_bench_pandas_baseline_keeps_the_same_rows(tmp_path, capsys):
    from openalign.bench.filter import run_filter_bench

    result = run_filter_bench(3000, 1500, top_k=300, work_dir=str(tmp_path))
    assert result["parity"] is True
    removed = {s["step"]: s["removed"] for s in result["funnel"]["steps"]}
    assert removed["rare_ngram"] > 0 and removed["shared_text"] > 0  # the baseline had every rule to match
    out = capsys.readouterr().out
    assert "duckdb / pandas rows/s" in out and "identical rows" in out
