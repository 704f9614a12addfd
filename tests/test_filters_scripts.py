"""Word counting for scripts written without spaces (Chinese, Japanese, Thai): one segmentation, the same in
the Python reference, DuckDB and Spark, so the word rules no longer drop such alt-texts wholesale."""

from __future__ import annotations

import random

import pyarrow.parquet as pq
import pytest

from openalign.data.filters import filter_corpus, load_rules, tokenize
from openalign.data.filters.rules import paired_words, segment
from test_filters import OFF, assert_duckdb_normalises_as_tokenize, row, run, write_rows

# Pieces of every kind the segmentation treats differently: ideographs, kana (with a voicing mark written
# separately), Thai letters with their vowel and tone marks, CJK punctuation, ASCII words and punctuation.
PIECES = ["猫", "白", "い", "ソ", "ー", "か\u3099", "แ", "ม", "นั่", "ง", "。", "、", "「", "」", "・", "\uff01"]
PIECES += ["a", "Z", " ", "  ", "\t", "!", "-", ".", "é", "\u00a0", "\u0e31", "𠀀", "〇", "ｶ"]

ZH = "一只白色的猫坐在沙发上"  # "a white cat sits on the sofa": 11 characters, no spaces
JA = "白い猫がソファーに座っている"  # the same in Japanese
TH = "แมวสีขาวนั่งบนโซฟา"  # and in Thai


def random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12))) for _ in range(n)]


def test_segmentation_counts_characters_of_scripts_without_spaces():
    assert tokenize(ZH) == list(ZH)
    assert tokenize("白い猫。「ソファー」") == ["白", "い", "猫", "ソ", "フ", "ァ", "ー"]  # punctuation separates
    # A Thai mark stays on its letter: แมว สี ขาว -> letters and letter+mark units
    assert tokenize("สีขาว") == ["สี", "ข", "า", "ว"]
    assert tokenize("iPhone 15 ケース!") == ["iphone", "15", "ケ", "ー", "ス"]
    # ASCII text is untouched by the segmentation step
    assert segment("a red car, e-mail") == "a red car, e-mail"
    assert tokenize("e-mail 1920x1080 ...") == ["e-mail", "1920x1080"]


def test_duckdb_segmentation_matches_python_tokenize():
    texts = [*random_texts(3000, 0), ZH, JA, TH, "猫!", "!猫", "a猫b", "ัก", "กั่"]
    assert_duckdb_normalises_as_tokenize(texts)


def test_chinese_japanese_and_thai_pass_the_word_count_while_too_short_ones_are_dropped(tmp_path):
    rules = load_rules("cc12m", **{**OFF, "min_word_count": None, "max_repeated_fraction": None, "min_words": 3})
    rows = [row(0, ZH), row(1, JA), row(2, TH), row(3, "猫"), row(4, "ねこ"), row(5, "แมว"), row(6, "白猫。")]
    rows.append(row(7, "白猫。黑"))  # exactly three words, the punctuation between them not one
    report, kept = run(tmp_path, rows, rules)
    # Before the segmentation each of these was one "word" and all eight were too_few_words.
    assert kept == [0, 1, 2, 5, 7] and report.removed["too_few_words"] == 3
    # the repetition rule counts paired words: 猫猫猫猫 is 猫猫 猫猫, one of two repeated
    rep = load_rules("cc12m", **{**OFF, "min_word_count": None, "max_repeated_fraction": 0.2})
    assert run(tmp_path, [row(0, "猫猫猫猫"), row(1, "黑猫白狗")], rep, "rep")[1] == [1]


ZH21 = "我和我的朋友们在公园里的湖边看见了一只白色"  # 21 characters, about 11 words
FRIEND_DOG = "我的朋友和我的狗"  # "my friend and my dog": 我 and 的 twice, no word repeated
TH32 = "แมวสีขาวนอนหลับอยู่บนโซฟาในห้องนั่งเล่น"  # "a white cat sleeps on the sofa in the living room"


def test_long_and_repeated_word_rules_count_paired_characters():
    assert len(ZH21) == len(tokenize(ZH21)) == 21 and len(paired_words(tokenize(ZH21))) == 11
    assert paired_words(tokenize(FRIEND_DOG)) == ["我的", "朋友", "和我", "的狗"]
    assert paired_words(tokenize("猫猫猫猫猫")) == ["猫猫", "猫猫", "猫"]
    assert paired_words(tokenize("a 猫, b 白猫。黑 สีขาว")) == ["a", "猫", "b", "白猫", "黑สี", "ขา", "ว"]
    assert paired_words(tokenize("a red car")) == ["a", "red", "car"] and paired_words([]) == []


@pytest.mark.parametrize("engine", ["duckdb", pytest.param("spark", marks=pytest.mark.slow)])
def test_scripts_without_spaces_are_not_too_many_or_repeated_words_per_character(tmp_path, engine, request):
    """ALIGN's 20-word cap keeps a 21-character Chinese caption; CC12M's repetition rule keeps
    我的朋友和我的狗 and a Thai caption, and still drops genuinely repeated captions in any script."""
    kw = {"engine": engine, "spark": request.getfixturevalue("spark") if engine == "spark" else None}
    long = ZH21 + "的狗坐在沙发上的角落里休息了一个下午里面"  # 40 characters: 20 paired words, 41: 21
    rows = [row(0, ZH21), row(1, long[:40]), row(2, long[:41]), row(3, " ".join(["car"] * 21)), row(4, "白猫。黑")]
    report, kept = run(tmp_path, rows, load_rules("align", **{**OFF, "min_words": 3, "max_words": 20}), "align", **kw)
    assert kept == [0, 1, 4] and report.removed["too_many_words"] == 2
    rep = load_rules("cc12m", **{**OFF, "min_word_count": None})
    rows = [
        row(0, FRIEND_DOG),
        row(1, TH32),
        row(2, "猫猫猫猫猫猫"),
        row(3, "便宜便宜便宜便宜"),
        row(4, "dog dog dog cat"),
    ]
    rows += [row(5, "ดีดีดีดีดีดี"), row(6, "a big dog")]
    report, kept = run(tmp_path, rows, rep, "cc12m", **kw)
    assert kept == [0, 1, 6] and report.removed["repeated_words"] == 4


def test_rare_ngrams_are_counted_over_characters(tmp_path):
    # 白猫 x3 and 黑狗 once: 白, 猫 and the bigram 白 猫 are frequent at K = 3; 黑, 狗, 黑 狗 are rare
    rows = [row(0, "白猫"), row(1, "白猫"), row(2, "白猫。"), row(3, "黑狗")]
    report, kept = run(tmp_path, rows, load_rules("align", **{**OFF, "vocab_top_k": 3}))
    assert kept == [0, 1, 2] and report.removed["rare_ngram"] == 1
    assert report.stats["distinct_ngrams"] == 6


@pytest.mark.slow
def test_spark_segments_like_duckdb(tmp_path, spark):
    from test_filters import kept_ids

    texts = [*random_texts(300, 1), ZH, JA, TH]
    rows = [row(i, t) for i, t in enumerate(texts)]
    rules = load_rules("cc12m", **{**OFF, "min_word_count": 2, "min_words": 2, "max_words": 8})
    src = write_rows(tmp_path / "in.parquet", rows)
    duck = filter_corpus(src, tmp_path / "duck.parquet", rules)
    from openalign.data.filters.spark_engine import norm_column

    sprk = filter_corpus(src, tmp_path / "spark.parquet", rules, engine="spark", spark=spark)
    assert kept_ids(tmp_path / "duck.parquet") == kept_ids(tmp_path / "spark.parquet")
    assert duck.steps == sprk.steps and duck.stats == sprk.stats
    frame = spark.read.parquet(str(src))
    frame = frame.select("id", norm_column(frame["caption"]).alias("n"))
    got = {r["id"]: r["n"] for r in frame.collect()}
    for i, text in enumerate(texts):
        if text is not None:
            assert got[i] == " ".join(tokenize(text)), repr(text)
    assert pq.read_table(tmp_path / "spark.parquet").num_rows == duck.rows_out
