"""The alt-text filter rules of ALIGN (Jia et al. 2021, §3) and of CC12M (Changpinyo et al. 2021, §2.2) as
data, and the tokenisation every engine shares.

A rule set is one typed dataclass, :class:`FilterRules`: every rule has a field, and setting that field to
``null`` switches the rule off. Two presets ship: ``align`` (the paper's defaults) and ``cc12m`` (the relaxed
unimodal filters of Conceptual 12M). A YAML file may start from either (``preset: cc12m``) and override any
field. The funnel's lines are ``VALIDITY_STEPS`` (rows that cannot be judged), then ``RULE_STEPS``.

What each rule does, exactly, is :mod:`openalign.data.filters.reference`: one plain-Python predicate per rule
beside the paper's words, and the whole filter, which the DuckDB and Spark engines are tested against.

**Words** (:func:`tokenize`): the alt-text is lowercased; every character of a script written without spaces
(Chinese, Japanese, Thai, Lao: ``SEGMENTED_RANGES``) becomes a word of its own with the combining marks after
it, as BERT's tokenizer sets CJK ideographs apart, and CJK punctuation separates words; then the text is
split on runs of ASCII whitespace, each piece stripped of ASCII punctuation at both ends, and empty pieces
dropped. "Red car!" and "red  car" are ``["red", "car"]``; "e-mail" and "1920x1080" are one word each;
"白い猫。" is ``["白", "い", "猫"]``. A bigram is two adjacent words joined by one space. The count rules
``too_many_words`` and ``repeated_words`` join such single characters two by two (:func:`paired_words`).
Punctuation, whitespace and those ranges are spelt out once, here, and each engine builds its regular
expressions from them.
"""

from __future__ import annotations

import itertools
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openalign.config import ConfigError, from_dict, load_yaml, merge, to_dict

# Punctuation and whitespace are spelled out once, here, so that every engine strips and splits alike.
PUNCTUATION = string.punctuation
WHITESPACE = " \t\n\x0b\f\r"
TEXT_COLUMN_CANDIDATES = ("caption", "alt", "alt_text", "text", "TEXT")

# Funnel lines in order: input validity first, then the rules. Each name is also a ``reason``.
VALIDITY_STEPS = (
    "malformed_row",
    "download_failed",
    "non_utf8_text",
    "missing_text",
    "empty_text",
    "bad_size",
    "bad_unsafe_score",
)
RULE_STEPS = (
    "unsafe",
    "small_image",
    "aspect_ratio",
    "image_format",
    "image_text_count",
    "shared_text",
    "rare_ngram",
    "rare_word",
    "too_few_words",
    "too_many_words",
    "repeated_words",
    "tag_overlap",
    "missing_pos",
)
STEP_DESCRIPTIONS = {
    "malformed_row": "input record that does not parse (or a JSON alt-text that is not text)",
    "download_failed": "img2dataset status is not success",
    "non_utf8_text": "alt-text is not valid UTF-8",
    "missing_text": "alt-text is null",
    "empty_text": "alt-text is empty or only whitespace",
    "bad_size": "width/height missing, non-numeric, not finite or <= 0",
    "bad_unsafe_score": "unsafe score present but not a number",
    "unsafe": "unsafe score > max_unsafe",
    "small_image": "shorter side <= min_shorter_side px",
    "aspect_ratio": "aspect ratio beyond max_aspect_ratio",
    "image_text_count": "image has > max_texts_per_image alt-texts",
    "shared_text": "alt-text shared by > max_images_per_text images",
    "rare_ngram": "n-gram outside the vocab_top_k most frequent",
    "rare_word": "word seen < min_word_count times",
    "too_few_words": "fewer than min_words words",
    "too_many_words": "more than max_words words",
    "repeated_words": "repeated-word fraction > max_repeated_fraction",
    "image_format": "image format not in image_formats (sniffed from the bytes)",
    "tag_overlap": "fewer than min_tag_overlap image-tag words in the alt-text",
    "missing_pos": "a required_pos group has no token (no noun or no determiner)",
}
# Transformations: rows changed, not removed (reported beside the funnel).
TRANSFORM_DESCRIPTIONS = {"person_substitution": "people's names replaced by <PERSON>"}


@dataclass
class ColumnNames:
    """Input column names. ``text`` ``null`` autodetects the first of caption, alt, alt_text, text, TEXT."""

    text: str | None = None
    url: str = "url"  # the image's URL: its identity when there is no sha256
    key: str = "key"  # the row's key: the image identity when there is neither sha256 nor url
    sha256: str = "sha256"  # image content hash: the image identity when present
    width: str = "width"  # image width (px)
    height: str = "height"  # image height (px)
    # The crawled image's sizes (img2dataset's width/height are after its resize); used when both exist
    original_width: str | None = "original_width"
    original_height: str | None = "original_height"
    status: str | None = "status"  # img2dataset's download status: rows not "success" are dropped
    unsafe: str = "punsafe"  # the user's unsafe-content probability (0-1), e.g. LAION's punsafe
    image_format: str = "format"  # the image's encoding (jpeg, png, image/jpeg, ...); else sniffed from the bytes
    tags: str = "tags"  # the image's tags (a list, or one string split at , ; |) for the tag-overlap rule


@dataclass
class FilterRules:
    """One rule set. ``null`` switches a rule off; :mod:`openalign.data.filters.reference` gives each rule's
    exact semantics."""

    name: str = "align"  # the rule set's name in the report
    columns: ColumnNames = field(default_factory=ColumnNames)
    max_unsafe: float | None = 0.5  # drop rows whose unsafe score is > this
    min_shorter_side: int | None = 200  # keep images whose shorter side is > this (px)
    max_aspect_ratio: float | None = 3.0  # keep longer/shorter < this (≤ with aspect_ratio_inclusive)
    aspect_ratio_inclusive: bool = False  # true: a ratio of exactly max_aspect_ratio is kept (CC12M)
    max_texts_per_image: int | None = 1000  # drop images with more rows (alt-texts) than this
    max_images_per_text: int | None = 10  # drop alt-texts shared by more distinct images than this
    vocab_top_k: int | None = 100_000_000  # K most frequent n-grams of the raw corpus form the vocabulary
    rare_ngram_order: int = 2  # 1: words only; 2: words and bigrams (ranked and checked together)
    min_word_count: int | None = None  # a word seen fewer times than this in the raw corpus is rare
    min_words: int | None = 3  # drop alt-texts with fewer words than this
    max_words: int | None = 20  # drop alt-texts with more words than this
    max_repeated_fraction: float | None = None  # (words - distinct words) / words must be ≤ this
    image_formats: list[str] | None = None  # keep only images encoded in these formats (CC12M: jpeg)
    min_tag_overlap: int | None = None  # words of the image's tags that must be words of the alt-text
    # Universal POS groups the alt-text needs a token of each (CC12M: a noun and a determiner); needs --nlp
    required_pos: list[str] | None = None
    # After filtering: "nlp" (the NLP pipeline's PERSON entities), "demo" (a short built-in list of first
    # names, a demonstration only) or "package.module:function" (str -> str)
    person_substitution: str | None = None

    def active_rules(self) -> list[str]:
        """The rule steps this configuration switches on (validity steps are always on)."""
        on = {
            "unsafe": self.max_unsafe is not None,
            "small_image": self.min_shorter_side is not None,
            "aspect_ratio": self.max_aspect_ratio is not None,
            "image_text_count": self.max_texts_per_image is not None,
            "shared_text": self.max_images_per_text is not None,
            "rare_ngram": self.vocab_top_k is not None,
            "rare_word": self.min_word_count is not None,
            "too_few_words": self.min_words is not None,
            "too_many_words": self.max_words is not None,
            "repeated_words": self.max_repeated_fraction is not None,
            "image_format": self.image_formats is not None,
            "tag_overlap": self.min_tag_overlap is not None,
            "missing_pos": self.required_pos is not None,
        }
        return [step for step in RULE_STEPS if on[step]]

    @property
    def uses_sizes(self) -> bool:
        return self.min_shorter_side is not None or self.max_aspect_ratio is not None

    @property
    def uses_identity(self) -> bool:
        return self.max_texts_per_image is not None or self.max_images_per_text is not None


PRESETS: dict[str, dict[str, Any]] = {
    # ALIGN §3: image filters (porn, shorter side > 200, aspect < 3, > 1000 alt-texts) and text filters
    # (shared by > 10 images, rare tokens outside the 100M most frequent uni+bigrams, < 3 or > 20 unigrams).
    "align": {},
    # CC12M §2.2: CC3M's unimodal filters relaxed: larger/smaller side ≤ 2.5, both sides > 400 px,
    # 3-256 words, word repetition ≤ 0.2, a word type is rare under 20 occurrences. ALIGN's sharing
    # and frequency-rank rules are not part of it.
    "cc12m": {
        "name": "cc12m",
        "min_shorter_side": 400,
        "max_aspect_ratio": 2.5,
        "aspect_ratio_inclusive": True,
        "max_texts_per_image": None,
        "max_images_per_text": None,
        "vocab_top_k": None,
        "min_word_count": 20,
        "min_words": 3,
        "max_words": 256,
        "max_repeated_fraction": 0.2,
        # "We still keep only JPEG images", "discard candidates with no noun or no determiner, but permit
        # ones without prepositions", the image-text (tag overlap) filter "intact", and people's names
        # replaced by <PERSON>. Each needs something the input may not have (image bytes or a format column,
        # image tags or a tagger, an NLP pipeline); without it the rule is skipped and the report says so.
        "image_formats": ["jpeg"],
        "min_tag_overlap": 1,
        "required_pos": ["NOUN|PROPN", "DET"],
        "person_substitution": "nlp",
    },
}


def validate_rules(rules: FilterRules) -> FilterRules:
    """Cross-field checks; raises ConfigError naming the field."""
    positive = ("min_shorter_side", "max_texts_per_image", "max_images_per_text", "vocab_top_k", "min_word_count")
    for name in positive:
        value = getattr(rules, name)
        if value is not None and value < (0 if name == "min_shorter_side" else 1):
            raise ConfigError(f"{name} must be {'≥ 0' if name == 'min_shorter_side' else 'positive'}, got {value}")
    if rules.max_aspect_ratio is not None and rules.max_aspect_ratio < 1:
        raise ConfigError(f"max_aspect_ratio must be ≥ 1 (longer side / shorter side), got {rules.max_aspect_ratio}")
    if rules.rare_ngram_order not in (1, 2):
        raise ConfigError(f"rare_ngram_order must be 1 or 2, got {rules.rare_ngram_order}")
    for name in ("min_words", "max_words"):
        value = getattr(rules, name)
        if value is not None and value < 0:
            raise ConfigError(f"{name} must be ≥ 0, got {value}")
    if rules.min_words is not None and rules.max_words is not None and rules.min_words > rules.max_words:
        raise ConfigError(f"min_words {rules.min_words} is larger than max_words {rules.max_words}")
    if rules.max_repeated_fraction is not None and not 0 <= rules.max_repeated_fraction <= 1:
        raise ConfigError(f"max_repeated_fraction must be in [0, 1], got {rules.max_repeated_fraction}")
    if rules.max_unsafe is not None and rules.max_unsafe != rules.max_unsafe:
        raise ConfigError("max_unsafe must be a number, got NaN")
    if rules.min_tag_overlap is not None and rules.min_tag_overlap < 1:
        raise ConfigError(f"min_tag_overlap must be positive, got {rules.min_tag_overlap}")
    if rules.image_formats is not None:
        if not rules.image_formats or not all(isinstance(f, str) and f.strip() for f in rules.image_formats):
            raise ConfigError(f"image_formats must be a non-empty list of formats, got {rules.image_formats}")
        rules.image_formats = sorted({normalise_format(f) or "" for f in rules.image_formats})
    if rules.required_pos is not None:
        groups = [frozenset(t for t in str(g).upper().split("|") if t.strip()) for g in rules.required_pos]
        if not groups or not all(groups):
            example = "['NOUN|PROPN', 'DET']"
            raise ConfigError(f"required_pos must be groups of POS tags like {example}, got {rules.required_pos}")
    return rules


_FORMAT_ALIASES = {"jpg": "jpeg", "jpe": "jpeg", "jfif": "jpeg", "pjpeg": "jpeg", "tif": "tiff", "x-ms-bmp": "bmp"}


def normalise_format(value: object) -> str | None:
    """An image format name as the rules compare it: ``JPG``, ``.jpeg``, ``image/jpeg`` are all ``jpeg``."""
    if value is None:
        return None
    name = str(value).strip().lower().removeprefix("image/").lstrip(".")
    return _FORMAT_ALIASES.get(name, name) or None


def load_rules(spec: str | Path | dict[str, Any] | FilterRules = "align", **overrides: Any) -> FilterRules:
    """A rule set from a preset name (``align``, ``cc12m``), a YAML file, a mapping or a FilterRules.

    A YAML file or mapping may name a starting preset with ``preset:`` (default ``align``) and set any
    field; unknown keys are an error naming the valid ones. Keyword overrides use the same field names
    (nested as ``columns={"text": "alt"}`` or dotted ``**{"columns.text": "alt"}``).
    """
    if isinstance(spec, FilterRules):
        data: dict[str, Any] = to_dict(spec)
    elif isinstance(spec, dict):
        data = _from_preset(dict(spec))
    elif str(spec) in PRESETS:
        data = dict(PRESETS[str(spec)])
    elif Path(spec).suffix.lower() in (".yaml", ".yml", ".json"):
        if not Path(spec).is_file():
            raise FileNotFoundError(f"rules file not found: {spec}")
        data = _from_preset(load_yaml(spec))
        data.setdefault("name", Path(spec).stem)
    else:
        raise ConfigError(f"unknown rules '{spec}'; use {', '.join(PRESETS)} or a YAML file")
    return validate_rules(from_dict(FilterRules, merge(data, overrides)))


def _from_preset(data: dict[str, Any]) -> dict[str, Any]:
    preset = data.pop("preset", "align")
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset '{preset}'; valid presets: {', '.join(PRESETS)}")
    return merge(dict(PRESETS[preset]), data)


# --------------------------------------------------------------------------------------------------
# The tokenisation, in plain Python: the reference the SQL engines are tested against.

_SPLIT_TABLE = str.maketrans({c: " " for c in WHITESPACE})

# Scripts written without spaces between words. Each character (with the combining marks that follow it) is
# one word: BERT's tokenizer, which ALIGN's text tower reads, already sets every CJK ideograph apart the same
# way, so a word here is the unit the model sees; kana and Thai/Lao get the same treatment because a
# dictionary segmenter per language would make the rules depend on which one is installed. Spelled as code
# point ranges, not Unicode script properties, so that Python, RE2 (DuckDB) and Java (Spark) match exactly the
# same characters whatever Unicode version each ships.
SEGMENTED_RANGES: tuple[tuple[int, int], ...] = (
    (0x0E01, 0x0E30),
    (0x0E32, 0x0E33),
    (0x0E3F, 0x0E46),
    (0x0E4F, 0x0E5B),  # Thai letters, digits, signs
    (0x0E81, 0x0EB0),
    (0x0EB2, 0x0EB3),
    (0x0EBD, 0x0EC6),
    (0x0ED0, 0x0EDF),  # Lao
    (0x2E80, 0x2FDF),  # CJK and Kangxi radicals
    (0x3005, 0x3007),
    (0x3021, 0x3029),
    (0x3038, 0x303B),  # 々 〆 〇, Hangzhou numerals
    (0x3041, 0x3096),
    (0x309D, 0x309F),  # Hiragana
    (0x30A1, 0x30FA),
    (0x30FC, 0x30FF),
    (0x31F0, 0x31FF),  # Katakana (30FB ・ is a separator)
    (0x3400, 0x4DBF),
    (0x4E00, 0x9FFF),
    (0xF900, 0xFAFF),  # CJK ideographs
    (0xFF66, 0xFF9F),  # half-width Katakana
    (0x20000, 0x2FA1F),
    (0x30000, 0x323AF),  # CJK ideographs, supplementary planes
)
# Combining marks stay with the character before them (Thai and Lao vowel and tone marks, kana voicing marks).
SEGMENT_MARK_RANGES: tuple[tuple[int, int], ...] = (
    (0x0E31, 0x0E31),
    (0x0E34, 0x0E3A),
    (0x0E47, 0x0E4E),
    (0x0EB1, 0x0EB1),
    (0x0EB4, 0x0EBC),
    (0x0EC8, 0x0ECE),
    (0x3099, 0x309A),
)
# CJK punctuation separates words the way whitespace does (。、「」・ and the full-width ASCII signs).
CJK_SEPARATOR_RANGES: tuple[tuple[int, int], ...] = (
    (0x3000, 0x3004), (0x3008, 0x3020), (0x3030, 0x3030), (0x303D, 0x303F), (0x30FB, 0x30FB),
    (0xFF01, 0xFF0F), (0xFF1A, 0xFF20), (0xFF3B, 0xFF40), (0xFF5B, 0xFF65),
)  # fmt: skip


def regex_class(ranges: tuple[tuple[int, int], ...], flavour: str) -> str:
    """A character class of ``ranges`` in ``flavour`` ``python``, ``re2`` or ``java`` escapes."""

    def one(cp: int) -> str:
        if flavour == "python":
            return f"\\U{cp:08x}"
        return f"\\x{{{cp:x}}}"

    return "[" + "".join(one(a) if a == b else f"{one(a)}-{one(b)}" for a, b in ranges) + "]"


def segment_patterns(flavour: str) -> tuple[str, str, str]:
    """(any character segmentation touches, one segmented unit, one CJK separator) for a regex flavour."""
    chars = regex_class(SEGMENTED_RANGES, flavour)
    marks = regex_class(SEGMENT_MARK_RANGES, flavour)
    seps = regex_class(CJK_SEPARATOR_RANGES, flavour)
    touched = regex_class(SEGMENTED_RANGES + SEGMENT_MARK_RANGES + CJK_SEPARATOR_RANGES, flavour)
    return touched, f"{chars}{marks}*", seps


_SEGMENT_ANY_PY, _SEGMENT_UNIT_PY, _CJK_SEPARATOR_PY = (re.compile(p) for p in segment_patterns("python"))


def pair_pattern(flavour: str) -> str:
    """Two adjacent single-character words of a script without spaces in a normalised alt-text (its words
    joined by single spaces), as groups 1 and 2: replacing every match, left to right, by the two joined
    gives :func:`paired_words`. In the normal form every such character (with its marks) is a word of its
    own, so a match never starts or ends inside a longer word."""
    _, unit, _ = segment_patterns(flavour)
    return f"({unit}) ({unit})"


_PAIR_PY = re.compile(pair_pattern("python"))


def paired_words(words: list[str]) -> list[str]:
    """The words ``too_many_words`` and ``repeated_words`` count: ``words`` (from :func:`tokenize`) with
    adjacent single characters of scripts without spaces joined two by two, left to right (adjacent as
    words: punctuation or spaces that stood between them in the alt-text do not keep them apart).

    Without a dictionary, n such characters are between n/2 words (Chinese words average about two
    characters) and n, and each count rule takes the bound that keeps the row: ``too_few_words`` counts
    every character, these two count pairs. A 21-character Chinese caption is 11 words, not too many;
    我的朋友和我的狗 is 我的 朋友 和我 的狗, none repeated, while 猫猫猫猫 is 猫猫 猫猫, one of two repeated."""
    joined = " ".join(words)
    if not words or not _SEGMENT_ANY_PY.search(joined):
        return list(words)
    return _PAIR_PY.sub(r"\1\2", joined).split(" ")


def tokenize(text: str) -> list[str]:
    """Words of an alt-text: lowercase, segment the scripts written without spaces (see ``segment``), split
    on ASCII whitespace, strip ASCII punctuation at both ends."""
    words = (piece.strip(PUNCTUATION) for piece in segment(text.lower()).translate(_SPLIT_TABLE).split(" "))
    return [w for w in words if w]


def segment(text: str) -> str:
    """``text`` with every character of a script written without spaces set apart by spaces, and CJK
    punctuation turned into spaces (the first step of :func:`tokenize`; ASCII text comes back unchanged)."""
    if not _SEGMENT_ANY_PY.search(text):
        return text
    return _SEGMENT_UNIT_PY.sub(r" \g<0> ", _CJK_SEPARATOR_PY.sub(" ", text))


def ngrams(words: list[str], order: int) -> list[str]:
    """Words, plus adjacent pairs joined by a space when ``order`` is 2."""
    if order == 1:
        return list(words)
    return [*words, *(f"{a} {b}" for a, b in itertools.pairwise(words))]


def frequent_threshold(count_histogram: dict[int, int], top_k: int) -> int:
    """The smallest count an n-gram needs to be among the ``top_k`` most frequent, ties kept.

    ``count_histogram`` maps an occurrence count to how many distinct n-grams have it. An n-gram is
    frequent when fewer than ``top_k`` n-grams are strictly more frequent, i.e. when its count is at
    least the ``top_k``-th largest count. Returns 0 (nothing is rare) when there are ≤ ``top_k`` n-grams.
    """
    seen = 0
    for count in sorted(count_histogram, reverse=True):
        seen += count_histogram[count]
        if seen >= top_k:
            return count
    return 0
