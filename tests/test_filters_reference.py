"""The DuckDB and Spark engines against the plain-Python specification (openalign.data.filters.reference), on
corpora generated to sit on every rule's edges: sizes at and beside the thresholds, aspect ratios of exactly
the limit, scores equal to the limit, words seen just often enough, alt-texts shared by just enough images,
images with just enough alt-texts, repeated words, scripts without spaces, unreadable sizes and scores."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, Phase, example, find, given, note, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from openalign.config import to_dict
from openalign.data.filters import demo_person_names, load_rules, tokenize
from openalign.data.filters.duckdb_engine import run_duckdb
from openalign.data.filters.pipeline import prepare
from openalign.data.filters.plan import EngineResult, FilterPlan
from openalign.data.filters.reference import Reference, number, run_reference
from openalign.data.filters.rules import FilterRules

# --------------------------------------------------------------------------------------------------
# Generated corpora

# Words of every kind the tokeniser treats apart: case, punctuation at the edges and inside, digits, scripts
# without spaces (a character is a word; two count as one for the long and repeated rules), people's names.
WORDS = ["red", "car", "Dog", "the", "a", "on", "grass", "sky", "x1", "e-mail", "John", "Emma", "猫", "白い", "สี"]
EDGES = ["", "", "", "!", ",", "...", "(", "'"]
SEPARATORS = [" ", " ", "  ", "\t", "\n", " - "]
# Boilerplate and odd alt-texts: shared by many images, no words at all, only whitespace, null.
SPECIAL = ["1920x1080", "alt img", "Alt IMG!", "!!", "猫猫猫猫", "我的朋友和我的狗", "John Smith walks a dog"]
SPECIAL += ["a red car, a red car", "the dog on the grass", "Sky sky SKY!", "", " \t", None]  # fmt: skip
UNSPACED = ["猫", "猫", "白", "い", "犬", "の", "。", "สี", "ข", " "]
SIZES = [1, 99, 100, 101, 120, 199, 200, 201, 250, 299, 300, 301, 400, 401, 600, 750, 900]  # ratios 2.5, 3 exact
FINE_SIZES = [480, 512, 640, 800]  # pass every size rule, so that the later rules get rows to judge
SCORES = [0.0, 0.1, 0.5, 0.7, 1.0]
FORMATS = ["jpg", "JPEG", "image/jpeg", "png", "webp", "", None]
TAGS = ["red, car", "dog|grass", "猫;sky", '["a", "the"]', "", "Sky", None]


@st.composite
def captions(draw: st.DrawFn) -> str | None:
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return draw(st.sampled_from(SPECIAL))
    if kind == 1:  # written without spaces: n characters are n words, or about n/2 for the long and repeated rules
        return "".join(draw(st.lists(st.sampled_from(UNSPACED), min_size=1, max_size=14)))
    words = draw(st.lists(st.sampled_from(WORDS), max_size=9))
    cased = [w.upper() if draw(st.booleans()) and draw(st.booleans()) else w for w in words]
    edged = [draw(st.sampled_from(EDGES)) + w + draw(st.sampled_from(EDGES)) for w in cased]
    return "".join(w + draw(st.sampled_from(SEPARATORS)) for w in edged).rstrip(" ") if edged else "a"


@st.composite
def rule_sets(draw: st.DrawFn) -> FilterRules:
    """A rule set whose thresholds are small enough for a few dozen rows to reach, each rule sometimes off."""

    def maybe(values: list[Any]) -> Any:  # mostly off, so that rows reach the later rules too
        return None if draw(st.integers(0, 9)) < 6 else draw(st.sampled_from(values))

    min_words = maybe([0, 1, 2, 3])
    fields = {
        "max_unsafe": maybe([0.0, 0.5, 0.7]),
        "min_shorter_side": maybe([0, 100, 200, 300]),
        "max_aspect_ratio": maybe([1.0, 2.5, 3.0]),
        "aspect_ratio_inclusive": draw(st.booleans()),
        "max_texts_per_image": maybe([1, 2, 3]),
        "max_images_per_text": maybe([1, 2, 3]),
        "vocab_top_k": maybe([1, 3, 10, 30]),
        "rare_ngram_order": draw(st.sampled_from([1, 2])),
        "min_word_count": maybe([1, 2, 3]),
        "min_words": min_words,
        "max_words": maybe([n + (min_words or 0) for n in (0, 3, 6)]),
        "max_repeated_fraction": maybe([0.0, 0.2, 0.25, 1 / 3, 0.5]),
        "image_formats": maybe([["jpeg"], ["jpeg", "png"]]),
        "min_tag_overlap": maybe([1, 2]),
        "required_pos": maybe([["NOUN|PROPN", "DET"]]),
        "person_substitution": maybe(["demo", "nlp"]),
    }
    return load_rules(draw(st.sampled_from(["align", "cc12m"])), **fields)


@st.composite
def corpora(draw: st.DrawFn) -> tuple[FilterRules, pa.Table]:
    """A rule set and a table for it. Alt-texts come from a small pool (so they repeat across images) and
    images from a few urls and hashes (so they carry several alt-texts); sizes and scores sit on the edges,
    as numbers or as text; the optional columns (img2dataset's, format, tags, unsafe) come and go."""
    rules = draw(rule_sets())
    n = draw(st.integers(1, 30))
    pool = draw(st.lists(captions(), min_size=1, max_size=6))
    size_type = draw(st.sampled_from([pa.int64(), pa.float64(), pa.string()]))
    score_type = draw(st.sampled_from([pa.float64(), pa.string()]))
    bad_sizes = {
        pa.int64(): [None, 0, -5],
        pa.float64(): [None, 0.0, math.nan, math.inf],
        pa.string(): [None, "", "n/a", "1,5"],
    }
    bad_scores = {pa.float64(): [None, math.nan], pa.string(): [None, "n/a", "nan", ""]}

    def size() -> Any:
        what = draw(st.integers(0, 19))
        if what == 0:
            return draw(st.sampled_from(bad_sizes[size_type]))
        v = draw(st.sampled_from(SIZES if what < 10 else FINE_SIZES))
        if size_type == pa.string():
            return draw(st.sampled_from([str(v), f" {v} ", f"{v}.0", f"{v / 100}e2"]))
        return float(v) if size_type == pa.float64() else v

    def score() -> Any:
        if draw(st.integers(0, 5)) == 0:
            return draw(st.sampled_from(bad_scores[score_type]))
        v = draw(st.sampled_from(SCORES))
        return draw(st.sampled_from([str(v), f"{v} "])) if score_type == pa.string() else v

    optional = draw(st.sets(st.sampled_from(["status", "original", "sha256", "key", "punsafe", "format", "tags"])))
    # A rule's column mostly there when the rule is on (else the rule is skipped, which is tested too).
    for name, on in (("punsafe", rules.max_unsafe), ("format", rules.image_formats), ("tags", rules.min_tag_overlap)):
        if on is not None and draw(st.integers(0, 3)):
            optional.add(name)
    columns: dict[str, tuple[pa.DataType, list[Any]]] = {"id": (pa.int64(), list(range(n)))}
    columns["caption"] = (
        pa.string(),
        [draw(st.sampled_from(pool)) if draw(st.booleans()) else draw(captions()) for _ in range(n)],
    )
    urls = [f"http://img/{k}.jpg" for k in range(draw(st.integers(1, 6)))] + ["", None]
    columns["url"] = (pa.string(), [draw(st.sampled_from(urls)) for _ in range(n)])
    columns["width"] = (size_type, [size() for _ in range(n)])
    columns["height"] = (size_type, [size() for _ in range(n)])
    picks = {
        "status": (pa.string(), ["success"] * 12 + ["failed_to_download", None]),
        "sha256": (pa.string(), ["h0", "h1", "h2", "", None]),
        "key": (pa.string(), ["k0", "k1", "k2", None]),
        "format": (pa.string(), FORMATS),
        "tags": (pa.string(), TAGS),
    }
    for name in optional:
        if name == "original":
            columns["original_width"] = (size_type, [size() for _ in range(n)])
            columns["original_height"] = (size_type, [size() for _ in range(n)])
        elif name == "punsafe":
            columns["punsafe"] = (score_type, [score() for _ in range(n)])
        else:
            kind, values = picks[name]
            columns[name] = (kind, [draw(st.sampled_from(values)) for _ in range(n)])
    schema = pa.schema([(name, kind) for name, (kind, _) in columns.items()])
    return rules, pa.table({name: values for name, (_, values) in columns.items()}, schema=schema)


# --------------------------------------------------------------------------------------------------
# Running an engine and the reference on the same staged input


@dataclasses.dataclass(frozen=True)
class WordTagger:
    """Stands in for an NLP pipeline (the text pass): an alt-text has its parts of speech when it has the
    word "the", and people's names are demo_person_names's."""

    required_pos: tuple[str, ...] | None
    person: Any

    def __call__(self, texts: list[str]) -> tuple[list[bool], list[str]]:
        ok = [self.required_pos is None or "the" in tokenize(t) for t in texts]
        return ok, [demo_person_names(t) if self.person is not None else t for t in texts]


def staged_plan(work: Path, rules: FilterRules, table: pa.Table, text_pass: bool) -> tuple[Any, FilterPlan]:
    """What an engine is given for ``table`` under ``rules``. With ``text_pass`` the POS rule and the
    person names run on WordTagger; without, rules that need an NLP pipeline are skipped and "demo" names
    still run."""
    pq.write_table(table, work / "in.parquet")
    person = {"demo": demo_person_names, "nlp": "nlp"}.get(rules.person_substitution or "")
    staged, plan = prepare(work / "in.parquet", rules, work, person=person, nlp="tagger" if text_pass else None)
    if plan.annotator is not None:
        tagger = WordTagger(plan.annotator.required_pos, plan.annotator.person) if text_pass else plan.annotator
        plan = dataclasses.replace(plan, annotator=tagger)  # type: ignore[arg-type]
    return staged, plan


def comparable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with NaN spelt out, so that equal rows compare equal."""
    return [{k: "NaN" if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()} for r in rows]


def assert_same(got: EngineResult, written: list[dict[str, Any]], ref: Reference) -> None:
    note(f"reference: {ref.reasons}")
    assert got.removed == ref.result.removed
    assert comparable(written) == comparable(ref.kept)
    assert (got.source_rows, got.rows_written) == (ref.result.source_rows, ref.result.rows_written)
    assert got.stats == ref.result.stats
    assert got.transformed == ref.result.transformed


# --------------------------------------------------------------------------------------------------
# The engines against the reference

NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate]


def only(rules: dict[str, Any], captions: list[str]) -> tuple[FilterRules, pa.Table]:
    """The rules given (every other one off) on one row per caption."""
    off = {f: None for f in ("max_unsafe", "min_shorter_side", "max_aspect_ratio", "max_texts_per_image",
                             "max_images_per_text", "vocab_top_k", "min_words", "max_words")}  # fmt: skip
    ids, urls = list(range(len(captions))), [f"http://img/{i}.jpg" for i in range(len(captions))]
    return load_rules("align", **{**off, **rules}), pa.table({"id": ids, "caption": captions, "url": urls})


# Rows whose fate turns on counting characters of scripts without spaces two to a word: 8 characters are 4
# words (kept at 5, too many if each were a word); 我的 朋友 和我 的狗 has no word repeated (1 of 4 would be).
PAIRED = only({"max_words": 5}, ["猫猫猫猫猫猫猫猫", "白い犬の猫白い犬の猫白い犬", "a red car"])
REPEATED = only({"max_repeated_fraction": 0.2}, ["我的朋友和我的狗", "猫猫猫猫", "a a red car"])


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(corpus=corpora(), text_pass=st.booleans())
@example(corpus=PAIRED, text_pass=False)
@example(corpus=REPEATED, text_pass=False)
def test_duckdb_engine_is_the_reference(corpus: tuple[FilterRules, pa.Table], text_pass: bool) -> None:
    rules, table = corpus
    note(f"rules: {to_dict(rules)}\nrows: {table.to_pylist()}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        staged, plan = staged_plan(work, rules, table, text_pass)
        got = run_duckdb(staged, plan, work / "out.parquet", "parquet", work / "duckdb")
        assert_same(got, pq.read_table(work / "out.parquet").to_pylist(), run_reference(staged, plan))


@pytest.mark.slow
# Not shrunk: each Spark run takes seconds, and the failing corpus is printed as it was generated.
@settings(max_examples=3, deadline=None, database=None, phases=NO_SHRINK, suppress_health_check=list(HealthCheck))
@given(corpus=corpora())
@example(corpus=PAIRED)
@example(corpus=REPEATED)
def test_spark_engine_is_the_reference(spark: Any, corpus: tuple[FilterRules, pa.Table]) -> None:
    from openalign.data.filters.spark_engine import run_spark

    rules, table = corpus
    note(f"rules: {to_dict(rules)}\nrows: {table.to_pylist()}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        staged, plan = staged_plan(work, rules, table, text_pass=False)
        got = run_spark(staged, plan, work / "out.parquet", "parquet", spark)
        written = sorted(pq.read_table(work / "out.parquet").to_pylist(), key=lambda r: r["id"])
        assert_same(got, written, run_reference(staged, plan))


def test_numbers_are_read_as_the_engines_cast_them() -> None:
    assert [number(v) for v in ("640", " 2.5e2 ", "\t5.\n", ".5", "+1E3", "-Infinity", 7, 2.5)] == [
        640.0, 250.0, 5.0, 0.5, 1000.0, -math.inf, 7.0, 2.5,
    ]  # fmt: skip
    assert math.isnan(number("NaN") or 0.0)
    assert [number(v) for v in (None, "", "n/a", "1,5", "0x10", "5\u00a0", "５")] == [None] * 7


def test_the_generated_corpora_reach_every_rule() -> None:
    """Every funnel line removes rows of some generated corpus: hypothesis draws corpora until every line has
    removed some row, so that this checks the strategies whatever order a hypothesis version draws them in."""
    lines = [
        "download_failed", "missing_text", "empty_text", "bad_size", "bad_unsafe_score", "unsafe", "small_image",
        "aspect_ratio", "image_format", "image_text_count", "shared_text", "rare_ngram", "rare_word",
        "too_few_words", "too_many_words", "repeated_words", "tag_overlap", "missing_pos",
    ]  # fmt: skip
    search = settings(
        max_examples=2000, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip

    seen: set[str] = set()

    def reaches_every_line(example: tuple[tuple[FilterRules, pa.Table], bool]) -> bool:
        (rules, table), text_pass = example
        with tempfile.TemporaryDirectory() as tmp:
            staged, plan = staged_plan(Path(tmp), rules, table, text_pass)
            seen.update(r for r in run_reference(staged, plan).reasons if r is not None)
        return seen >= set(lines)

    with contextlib.suppress(NoSuchExample):
        find(st.tuples(corpora(), st.booleans()), reaches_every_line, settings=search)
    assert sorted(set(lines) - seen) == []
