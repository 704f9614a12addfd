"""What a filter run will do on one input: resolved column names, the funnel steps, and what it skips.

Both engines execute the same plan, so a rule that is skipped (its column absent) or a required column
that is missing is decided once, here, with the same message for both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from openalign.data.filters.images import IMAGE_FORMAT_COLUMN, TAG_WORDS_COLUMN
from openalign.data.filters.inputs import StagedInput
from openalign.data.filters.nlp import TextAnnotator
from openalign.data.filters.person import PersonHook
from openalign.data.filters.rules import VALIDITY_STEPS, FilterRules


@dataclass
class FilterPlan:
    rules: FilterRules
    text: str
    width: str | None  # set when a size rule is on: original_width when the input has it, else width
    height: str | None
    status: str | None  # img2dataset's status column, when the input has one
    unsafe: str | None  # set when the unsafe rule is on and its column exists
    identity: list[tuple[str, str]]  # (prefix, column) in precedence order: sha256, url, key
    has_text_error_column: bool
    steps: list[str]  # funnel lines the engine reports, in order (malformed_row is counted while staging)
    skipped: dict[str, str] = field(default_factory=dict)  # rule -> why it did not run
    image_format: str | None = None  # the staged format column, when the image_format rule runs
    tag_words: str | None = None  # the staged tag-words column, when the tag_overlap rule runs
    # The text pass over the kept rows (POS rule, person substitution), when one runs
    annotator: TextAnnotator | None = None


def build_plan(
    staged: StagedInput,
    rules: FilterRules,
    nlp: str | None = None,
    person: PersonHook | str | None = None,
    nlp_batch_size: int = 256,
) -> FilterPlan:
    """Check the input has what the rules need; raises ValueError naming every missing column.
    ``nlp``: the NLP pipeline (name or path) for the POS rule and ``person == "nlp"``; ``person``: the
    person substitution (``"nlp"`` or a ``str -> str`` hook)."""
    cols, names = staged.columns, rules.columns
    missing: dict[str, list[str]] = {}
    width, height = names.width, names.height
    if names.original_width in cols and names.original_height in cols:
        # img2dataset's width/height are its resized copy's; the rules are about the crawled image.
        width, height = names.original_width, names.original_height
    if rules.uses_sizes:
        needers = [n for n in ("min_shorter_side", "max_aspect_ratio") if getattr(rules, n) is not None]
        for col in (width, height):
            if col not in cols:
                missing.setdefault(col, []).extend(needers)
    identity = [(f"{c}:", getattr(names, c)) for c in ("sha256", "url", "key") if getattr(names, c) in cols]
    if rules.uses_identity and not identity:
        needers = [n for n in ("max_texts_per_image", "max_images_per_text") if getattr(rules, n) is not None]
        missing.setdefault(f"{names.url}' or '{names.key}' or '{names.sha256}", []).extend(needers)
    if missing:
        parts = [f"'{col}' (needed by {', '.join(sorted(set(by)))})" for col, by in missing.items()]
        raise ValueError(f"input is missing column(s) {'; '.join(parts)}; columns present: {', '.join(cols)}")
    skipped: dict[str, str] = {}
    unsafe = None
    if rules.max_unsafe is not None:
        if names.unsafe in cols:
            unsafe = names.unsafe
        else:
            skipped["unsafe"] = f"no unsafe-score column '{names.unsafe}' in the input"
    image_format = IMAGE_FORMAT_COLUMN if IMAGE_FORMAT_COLUMN in staged.hidden else None
    if rules.image_formats is not None and image_format is None:
        skipped["image_format"] = f"no format column '{names.image_format}' and no images to sniff in the input"
    tag_words = TAG_WORDS_COLUMN if TAG_WORDS_COLUMN in staged.hidden else None
    if rules.min_tag_overlap is not None and tag_words is None:
        skipped["tag_overlap"] = f"no image tags: no '{names.tags}' column and no tagger (--tagger CKPT)"
    no_nlp = "no NLP pipeline (--nlp en_core_web_sm after `python -m spacy download en_core_web_sm`, or a path)"
    if rules.required_pos is not None and nlp is None:
        skipped["missing_pos"] = no_nlp
    if person == "nlp" and nlp is None:
        skipped["person_substitution"] = no_nlp
        person = None
    required_pos = tuple(rules.required_pos) if rules.required_pos is not None and nlp is not None else None
    annotator = None
    if required_pos is not None or person is not None:
        annotator = TextAnnotator(nlp, required_pos, person, batch_size=nlp_batch_size)
    status = names.status if names.status in cols else None
    validity = [s for s in VALIDITY_STEPS if s != "malformed_row"]
    if status is None:
        validity.remove("download_failed")
    if not staged.has_text_error_column:
        validity.remove("non_utf8_text")
    if not rules.uses_sizes:
        validity.remove("bad_size")
    if unsafe is None:
        validity.remove("bad_unsafe_score")
    steps = validity + [s for s in rules.active_rules() if s not in skipped]
    return FilterPlan(
        rules=rules,
        text=staged.text_column,
        width=width if rules.uses_sizes else None,
        height=height if rules.uses_sizes else None,
        status=status,
        unsafe=unsafe,
        identity=identity,
        has_text_error_column=staged.has_text_error_column,
        steps=steps,
        skipped=skipped,
        image_format=image_format,
        tag_words=tag_words,
        annotator=annotator,
    )


@dataclass
class EngineResult:
    """What an engine reports back: the funnel counts and the corpus statistics behind them."""

    source_rows: int  # rows the engine read (the staged table)
    removed: dict[str, int]  # reason -> rows removed for it
    rows_written: int  # rows in the output, counted from what was written
    stats: dict[str, int] = field(default_factory=dict)
    transformed: dict[str, int] = field(default_factory=dict)  # transformation -> rows of the output it changed
