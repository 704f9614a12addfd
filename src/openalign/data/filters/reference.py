"""The alt-text filter in plain Python: the specification the DuckDB and Spark engines are tested against.

One small predicate per funnel line, each beside the words of the paper it implements (ALIGN: Jia et al.
2021, §3; CC12M: Changpinyo et al. 2021, §2.2); a predicate is true when its rule removes the row.
:func:`run_reference` takes what ``run_duckdb`` and ``run_spark`` take (the staged input and its plan) and
returns what they report, with the rows they write. It holds the table in memory and judges one row at a
time: it is for reading and for tests, not for corpora.

The filter, in four steps (:func:`apply_filter`):

1. **Validity.** A row that cannot be judged is removed by the first validity predicate that rejects it.
2. **Counts over the raw corpus.** Every row that passed step 1, before any rule removes anything, so that
   the rules do not depend on each other (ALIGN counts n-grams "from the raw dataset"). Counts are of
   occurrences: a word twice in one alt-text counts twice, and a row repeated in the input counts each time.
3. **Rules**, in funnel order (``plan.steps``: the rules switched on whose input exists): a row is removed
   by the first that rejects it. The order only decides which rule a row rejected by several is counted
   under.
4. **The text pass** over the distinct alt-texts still kept (an NLP pipeline or a hook): the POS rule, then
   people's names replaced in the kept alt-texts (a transformation: the rows changed are counted).

Words are :func:`~openalign.data.filters.rules.tokenize`'s; an alt-text's identity is its words joined by
single spaces, so case, punctuation at word edges and spacing do not tell two alt-texts apart.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from openalign.data.filters.inputs import TEXT_ERROR_COLUMN, StagedInput
from openalign.data.filters.plan import EngineResult, FilterPlan
from openalign.data.filters.rules import WHITESPACE, FilterRules, frequent_threshold, ngrams, paired_words, tokenize

# --------------------------------------------------------------------------------------------------
# What the rules read from a row


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?inf(inity)?|nan", re.IGNORECASE | re.ASCII)


def number(value: Any) -> float | None:
    """A size or score as the engines read it (SQL's CAST to DOUBLE): a number, or text that is a decimal
    number (``640``, `` 2.5e2 ``, ``inf``, ``nan``) between ASCII whitespace. Anything else is none."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip(WHITESPACE)
        return float(text) if _NUMBER.fullmatch(text) else None
    return float(value)


def image_identity(raw: dict[str, Any], plan: FilterPlan, index: int) -> str:
    """Which image a row shows: its ``sha256`` when present and non-empty, else its ``url``, else its ``key``;
    a row with none of them is an image of its own."""
    for prefix, column in plan.identity:
        value = raw.get(column)
        if value is not None and str(value) != "":
            return prefix + str(value)
    return f"row:{index}"


@dataclass
class Row:
    """A row that passed validity, as the rules read it."""

    image: str  # image_identity
    text: str  # the alt-text as written
    words: list[str]  # tokenize(text)
    width: float | None  # the size columns of the plan (original_width/height for img2dataset output)
    height: float | None
    unsafe: float | None  # the user's unsafe score
    format: str | None  # the image's format, normalised while staging (jpeg, png, ...)
    tag_words: list[str]  # the distinct words of the image's tags (staging's tag_words)

    @property
    def norm(self) -> str:
        return " ".join(self.words)


@dataclass
class Corpus:
    """What the rules count over the raw corpus (step 2), and the text pass's verdicts (step 4)."""

    texts_per_image: Counter[str]  # rows per image identity
    images_per_text: dict[str, set[str]]  # distinct image identities per alt-text identity
    words: Counter[str]  # occurrences of each word
    ngrams: Counter[str]  # occurrences of each n-gram: words, and bigrams at rare_ngram_order 2
    frequent_min_count: int  # the count an n-gram needs to be among the vocab_top_k most frequent (0: any)
    pos_ok: dict[str, bool] = field(default_factory=dict)  # alt-text -> it has every required_pos group


# --------------------------------------------------------------------------------------------------
# Validity: rows that cannot be judged, in funnel order (raw staged row -> removed)


def download_failed(raw: dict[str, Any], plan: FilterPlan) -> bool:
    """img2dataset's ``status`` is not ``success`` (a failed download or resize, or none): no image to judge."""
    status = raw.get(plan.status or "")
    return status is None or str(status) != "success"


def non_utf8_text(raw: dict[str, Any], plan: FilterPlan) -> bool:
    """The alt-text was not valid UTF-8 (staging set it null and said so in its hidden column)."""
    return raw.get(TEXT_ERROR_COLUMN) is not None


def missing_text(raw: dict[str, Any], plan: FilterPlan) -> bool:
    """The alt-text is null."""
    return raw.get(plan.text) is None


def empty_text(raw: dict[str, Any], plan: FilterPlan) -> bool:
    """The alt-text is empty or only ASCII whitespace."""
    return str(raw[plan.text]).strip(WHITESPACE) == ""


def bad_size(raw: dict[str, Any], plan: FilterPlan) -> bool:
    """Width or height missing, not a number, not finite or ≤ 0 (checked only when a size rule is on)."""
    sizes = (number(raw.get(plan.width or "")), number(raw.get(plan.height or "")))
    return not all(v is not None and math.isfinite(v) and v > 0 for v in sizes)


def bad_unsafe_score(raw: dict[str, Any], plan: FilterPlan) -> bool:
    """An unsafe score is given but is not a number (or is NaN); a row without one is fine."""
    given = raw.get(plan.unsafe or "")
    score = number(given)
    return given is not None and (score is None or math.isnan(score))


VALIDITY: dict[str, Callable[[dict[str, Any], FilterPlan], bool]] = {
    "download_failed": download_failed,
    "non_utf8_text": non_utf8_text,
    "missing_text": missing_text,
    "empty_text": empty_text,
    "bad_size": bad_size,
    "bad_unsafe_score": bad_unsafe_score,
}


# --------------------------------------------------------------------------------------------------
# The rules, in funnel order (row, rules, corpus counts -> removed)


def unsafe(row: Row, rules: FilterRules, corpus: Corpus) -> bool:
    """ALIGN: "we remove pornographic images"; CC12M: "exclude images that trigger pornography detectors".
    The detector is the user's: its score (LAION's ``punsafe``, 0-1) above ``max_unsafe``; no score: kept."""
    return row.unsafe is not None and row.unsafe > rules.max_unsafe  # type: ignore[operator]


def small_image(row: Row, rules: FilterRules, corpus: Corpus) -> bool:
    """ALIGN: "keep only images whose shorter dimension is larger than 200 pixels"; CC12M: "size greater
    than 400 pixels"."""
    return min(row.width, row.height) <= rules.min_shorter_side  # type: ignore[operator, type-var]


def aspect_ratio(row: Row, rules: FilterRules, corpus: Corpus) -> bool:
    """ALIGN: "aspect ratio is smaller than 3"; CC12M: "the maximum ratio of larger to smaller dimension to
    2.5" (that ratio is kept: ``aspect_ratio_inclusive``)."""
    ratio = max(row.width, row.height) / min(row.width, row.height)  # type: ignore[type-var, operator]
    limit = rules.max_aspect_ratio
    return ratio > limit if rules.aspect_ratio_inclusive else ratio >= limit  # type: ignore[operator]


def image_format(row: Row, rules: FilterRules, corpus: Corpus) -> bool:
    """CC12M: "We still keep only JPEG images". The format is the input's format column, else sniffed from
    the image's bytes (never its file name); an image without one is removed."""
    return row.format not in (rules.image_formats or [])


def image_text_count(row: Row, rules: FilterRules, corpus: Corpus) -> bool:
    """ALIGN: "Images with more than 1000 associated alt-texts are discarded"."""
    return corpus.texts_per_image[row.image] > rules.max_texts_per_image  # type: ignore[operator]


def shared_text(row: Row, rules: FilterRules, corpus: Corpus) -> bool:
    """ALIGN: "We exclude alt-texts that are shared by more than 10 images" (distinct images)."""
    return len(corpus.images_per_text[row.norm]) > rules.max_images_per_text  # type: ignore[operator]


def rare_ngram(row: Row, rules: FilterRules, corpus: Corpus) -> bool:
    """ALIGN: "discard alt-texts that contain any rare token (outside of 100 million most frequent unigrams
    and bigrams from the raw dataset)". Words and bigrams are ranked together by count, ties at the cut all
    kept (:func:`~openalign.data.filters.rules.frequent_threshold`)."""
    grams = ngrams(row.words, rules.rare_ngram_order)
    return any(corpus.ngrams[g] < corpus.frequent_min_count for g in grams)


def rare_word(row: Row, rules: FilterRules, corpus: Corpus) -> bool:
    """CC12M: "the threshold for counting a word type as rare is increased from 5 to 20": a word seen fewer
    than ``min_word_count`` times."""
    return any(corpus.words[w] < rules.min_word_count for w in row.words)  # type: ignore[operator]


def too_few_words(row: Row, rules: FilterRules, corpus: Corpus) -> bool:
    """ALIGN: "too short (<3 unigrams)"; CC12M: "text between 3 and 256 words". Each character of a script
    written without spaces counts as a word (the larger count a dictionary could give: it keeps the row)."""
    return len(row.words) < rules.min_words  # type: ignore[operator]


def too_many_words(row: Row, rules: FilterRules, corpus: Corpus) -> bool:
    """ALIGN: "too long (>20 unigrams)"; CC12M: "between 3 and 256 words". Characters of scripts written
    without spaces count two to a word (:func:`~openalign.data.filters.rules.paired_words`: the smaller count)."""
    return len(paired_words(row.words)) > rules.max_words  # type: ignore[operator]


def repeated_words(row: Row, rules: FilterRules, corpus: Corpus) -> bool:
    """CC12M: "We set the maximum fraction of word repetition allowed to 0.2": (words - distinct words) /
    words, over paired words."""
    words = paired_words(row.words)
    return bool(words) and (len(words) - len(set(words))) / len(words) > rules.max_repeated_fraction  # type: ignore[operator]


def tag_overlap(row: Row, rules: FilterRules, corpus: Corpus) -> bool:
    """CC12M keeps CC3M's image-text filter "intact": "the number of image tags (as predicted by Google Cloud
    Vision APIs) that overlap with the existing text". Here fewer than ``min_tag_overlap`` distinct words of
    the image's tags (a tags column or a tagger) are words of the alt-text."""
    return len(set(row.tag_words) & set(row.words)) < rules.min_tag_overlap  # type: ignore[operator]


def missing_pos(row: Row, rules: FilterRules, corpus: Corpus) -> bool:
    """CC12M: "We still discard candidates with no noun or no determiner, but permit ones without
    prepositions": some ``required_pos`` group has no token of the alt-text (tags from the NLP pipeline)."""
    return not corpus.pos_ok[row.text]


RULES: dict[str, Callable[[Row, FilterRules, Corpus], bool]] = {
    "unsafe": unsafe,
    "small_image": small_image,
    "aspect_ratio": aspect_ratio,
    "image_format": image_format,
    "image_text_count": image_text_count,
    "shared_text": shared_text,
    "rare_ngram": rare_ngram,
    "rare_word": rare_word,
    "too_few_words": too_few_words,
    "too_many_words": too_many_words,
    "repeated_words": repeated_words,
    "tag_overlap": tag_overlap,
    "missing_pos": missing_pos,
}


# --------------------------------------------------------------------------------------------------
# The whole filter


@dataclass
class Reference:
    """The filter's outcome: each row's reason, the rows an engine writes, and what it reports."""

    reasons: list[str | None]  # per input row: the funnel line that removed it; None: kept
    kept: list[dict[str, Any]]  # the rows written, in input order, with the input's columns
    result: EngineResult


def read_rows(staged: StagedInput) -> list[dict[str, Any]]:
    """The staged table's rows in input order (its files one after another, columns united by name)."""
    import pyarrow.parquet as pq

    return [row for path in staged.paths for row in pq.read_table(path).to_pylist()]


def run_reference(staged: StagedInput, plan: FilterPlan) -> Reference:
    """What ``run_duckdb(staged, plan, ...)`` and ``run_spark(staged, plan, ...)`` keep and report."""
    return apply_filter(read_rows(staged), plan, staged.columns)


def apply_filter(raws: list[dict[str, Any]], plan: FilterPlan, columns: list[str]) -> Reference:
    """The filter of ``plan`` on staged rows ``raws``; the kept rows have ``columns``."""
    rules = plan.rules
    reasons: list[str | None] = [None] * len(raws)
    rows: dict[int, Row] = {}
    # 1. Validity
    for i, raw in enumerate(raws):
        reasons[i] = next((step for step in plan.steps if step in VALIDITY and VALIDITY[step](raw, plan)), None)
        if reasons[i] is None:
            rows[i] = _row(raw, plan, i)
    # 2. Counts over the raw corpus
    corpus = _count(list(rows.values()), rules)
    # 3. The rules, but the text pass's
    content = [step for step in plan.steps if step in RULES and step != "missing_pos"]
    for i, row in rows.items():
        reasons[i] = next((step for step in content if RULES[step](row, rules, corpus)), None)
    # 4. The text pass over the distinct alt-texts still kept
    kept = [i for i in rows if reasons[i] is None]
    person: dict[str, str] = {}
    if plan.annotator is not None:
        texts = sorted({rows[i].text for i in kept})
        ok, changed = plan.annotator(texts)
        corpus.pos_ok, person = dict(zip(texts, ok, strict=True)), dict(zip(texts, changed, strict=True))
        if "missing_pos" in plan.steps:
            for i in kept:
                reasons[i] = "missing_pos" if missing_pos(rows[i], rules, corpus) else None
            kept = [i for i in kept if reasons[i] is None]
    out = [{c: raws[i].get(c) for c in columns} for i in kept]
    transformed = {}
    if plan.annotator is not None and plan.annotator.person is not None:
        for i, written in zip(kept, out, strict=True):
            written[plan.text] = person[rows[i].text]
        transformed["person_substitution"] = sum(person[rows[i].text] != rows[i].text for i in kept)
    removed = dict(Counter(r for r in reasons if r is not None))
    result = EngineResult(len(raws), removed, len(out), _stats(corpus, rules), transformed)
    return Reference(reasons, out, result)


def _row(raw: dict[str, Any], plan: FilterPlan, index: int) -> Row:
    def read(column: str | None) -> Any:
        return raw.get(column) if column is not None else None

    tags = read(plan.tag_words)
    return Row(
        image=image_identity(raw, plan, index),
        text=raw[plan.text],
        words=tokenize(raw[plan.text]),
        width=number(read(plan.width)),
        height=number(read(plan.height)),
        unsafe=number(read(plan.unsafe)),
        format=read(plan.image_format),
        tag_words=tags.split(" ") if tags else [],
    )


def _count(rows: list[Row], rules: FilterRules) -> Corpus:
    images_per_text: dict[str, set[str]] = defaultdict(set)
    words: Counter[str] = Counter()
    grams: Counter[str] = Counter()
    for row in rows:
        images_per_text[row.norm].add(row.image)
        words.update(row.words)
        grams.update(ngrams(row.words, rules.rare_ngram_order))
    top_k = rules.vocab_top_k
    threshold = frequent_threshold(Counter(grams.values()), top_k) if top_k is not None else 0
    return Corpus(Counter(row.image for row in rows), images_per_text, words, grams, threshold)


def _stats(corpus: Corpus, rules: FilterRules) -> dict[str, int]:
    """The corpus statistics the engines report beside the funnel."""
    stats = {"distinct_images": len(corpus.texts_per_image), "distinct_texts": len(corpus.images_per_text)}
    if rules.vocab_top_k is not None or rules.min_word_count is not None:
        stats["distinct_words"] = len(corpus.words)
    if rules.vocab_top_k is not None:
        stats["distinct_ngrams"] = len(corpus.ngrams)
        stats["frequent_min_count"] = corpus.frequent_min_count
        stats["rare_ngrams"] = sum(1 for n in corpus.ngrams.values() if n < corpus.frequent_min_count)
    if rules.min_word_count is not None:
        stats["rare_words"] = sum(1 for n in corpus.words.values() if n < rules.min_word_count)
    return stats
