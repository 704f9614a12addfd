"""Text analysis for CC12M's text rules: tokens, coarse part-of-speech tags and PERSON spans.

CC3M and CC12M ran Google Cloud Natural Language over every alt-text: its part-of-speech tags drive the
"no noun or no determiner" rule and its Person entities the ``<PERSON>`` substitution. Here any backend
with ``analyze(texts) -> list[Analysis]`` stands in; :class:`SpacyBackend` runs any installed spaCy pipeline
(``en_core_web_sm``, or a pipeline saved with ``nlp.to_disk``) over batches with ``nlp.pipe``.

POS tags are Universal POS (NOUN, PROPN, DET, ADP, ...), which is what spaCy's ``token.pos_`` gives and what
Google's API tags map onto. Entities labelled ``PERSON`` (English pipelines) or ``PER`` (many multilingual
ones) are people.

:func:`load_backend` keeps one loaded backend per process and spec, so the Spark engine loads a pipeline
once per executor process (inside its partition function) and never ships a model with a row.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

PERSON_LABELS = frozenset({"PERSON", "PER"})
NOUN_TAGS = "NOUN|PROPN"  # Google's NOUN tag covers proper nouns too (as an attribute), UD splits them
INSTALL_HINT = "install a pipeline with `python -m spacy download en_core_web_sm` or give the path of a saved one"


@dataclass(frozen=True)
class Analysis:
    """One alt-text: its tokens, each token's Universal POS tag, and the character spans of people's names."""

    tokens: tuple[str, ...]
    pos: tuple[str, ...]
    persons: tuple[tuple[int, int], ...] = ()  # (start, end) character offsets, in order, not overlapping


class NLPBackend(Protocol):
    def analyze(self, texts: Sequence[str]) -> list[Analysis]: ...


class NLPError(ValueError):
    """A pipeline that cannot be loaded; the message is one line saying how to get one."""


class SpacyBackend:
    """A spaCy pipeline by package name (``en_core_web_sm``) or path (a folder written by ``nlp.to_disk``)."""

    def __init__(self, spec: str, batch_size: int = 256) -> None:
        try:
            import spacy
        except ImportError:
            raise NLPError("the NLP rules need spaCy: pip install 'openalign[nlp]', then " + INSTALL_HINT) from None
        try:
            # Only what the rules read: the parser and the lemmatizer are the slow parts of most pipelines.
            self.nlp = spacy.load(spec, exclude=["parser", "lemmatizer"])
        except (OSError, ValueError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise NLPError(f"cannot load spaCy pipeline '{spec}' ({first[:160]}); {INSTALL_HINT}") from None
        self.spec = spec
        self.batch_size = batch_size

    def components(self) -> str:
        """The pipeline's components, for messages: ``tok2vec, ner`` or ``none (a blank pipeline)``."""
        return ", ".join(self.nlp.pipe_names) or "none (a blank pipeline)"

    def finds_entities(self) -> bool:
        """Whether some component sets ``doc.ents`` (``ner``, ``entity_ruler`` or one declaring as much)."""
        return any("doc.ents" in self.nlp.get_pipe_meta(name).assigns for name in self.nlp.pipe_names)

    def analyze(self, texts: Sequence[str]) -> list[Analysis]:
        out = []
        for doc in self.nlp.pipe(texts, batch_size=self.batch_size):
            persons = tuple((e.start_char, e.end_char) for e in doc.ents if e.label_ in PERSON_LABELS)
            out.append(Analysis(tuple(t.text for t in doc), tuple(t.pos_ for t in doc), persons))
        return out


@functools.lru_cache(maxsize=4)
def load_backend(spec: str, batch_size: int = 256) -> NLPBackend:
    """The backend for ``spec``, loaded once per process."""
    return SpacyBackend(spec, batch_size)


def parse_required_pos(groups: Sequence[str]) -> list[frozenset[str]]:
    """``["NOUN|PROPN", "DET"]``: each group is a set of tags of which the alt-text needs at least one."""
    parsed = [frozenset(t.strip().upper() for t in g.split("|") if t.strip()) for g in groups]
    if not parsed or not all(parsed):
        raise ValueError(f"required_pos needs non-empty groups of tags like ['NOUN|PROPN', 'DET'], got {list(groups)}")
    return parsed


def has_required_pos(analysis: Analysis, groups: Sequence[frozenset[str]]) -> bool:
    """Whether every group has at least one of its tags among the alt-text's tokens."""
    tags = set(analysis.pos)
    return all(tags & group for group in groups)


def substitute_persons(text: str, analysis: Analysis, token: str) -> str:
    """``text`` with every PERSON span replaced by ``token``."""
    pieces, last = [], 0
    for start, end in analysis.persons:
        pieces += [text[last:start], token]
        last = end
    return "".join(pieces) + text[last:]


@dataclass(frozen=True)
class TextAnnotator:
    """What the engines run over batches of distinct alt-texts: the POS check and the person substitution.

    Holds only names and small settings (a spec string, not a pipeline), so Spark ships it to executors
    cheaply and each executor loads the pipeline once (:func:`load_backend`)."""

    nlp: str | None  # spaCy pipeline name or path; needed when required_pos is set or person is "nlp"
    required_pos: tuple[str, ...] | None
    person: str | Callable[[str], str] | None  # "nlp": the pipeline's PERSON spans; or a str -> str hook
    person_token: str = "<PERSON>"
    batch_size: int = 256

    def __call__(self, texts: Sequence[str]) -> tuple[list[bool], list[str]]:
        """(passes the POS rule, text after person substitution) for each text."""
        analyses: list[Analysis] | None = None
        if self.nlp is not None and (self.required_pos is not None or self.person == "nlp"):
            analyses = load_backend(self.nlp, self.batch_size).analyze(list(texts))
        if self.required_pos is not None and analyses is not None:
            groups = parse_required_pos(self.required_pos)
            ok = [has_required_pos(a, groups) for a in analyses]
        else:
            ok = [True] * len(texts)
        if self.person == "nlp" and analyses is not None:
            changed = [substitute_persons(t, a, self.person_token) for t, a in zip(texts, analyses, strict=True)]
        elif callable(self.person):
            changed = [self.person(t) for t in texts]
        else:
            changed = list(texts)
        return ok, changed


# Words any part-of-speech tagger tags: a pipeline that leaves all of them untagged has no tagger.
POS_PROBE = "A dog runs on the beach with a red ball."


def check_backend(spec: str, *, pos: bool = False, persons: bool = False) -> None:
    """Load ``spec`` now, so that a missing pipeline is an error before the run, not in a Spark task; and
    refuse one that cannot do what the run asks of it (``pos``: tag parts of speech for the missing_pos rule;
    ``persons``: find people for the ``<PERSON>`` substitution), which would otherwise remove every row or
    change none."""
    backend: Any = load_backend(spec)
    probe = backend.analyze([POS_PROBE])[0]
    components = backend.components() if hasattr(backend, "components") else "?"
    if pos and not any(probe.pos):
        names = set(backend.nlp.pipe_names) if hasattr(backend, "nlp") else set()
        # A tagger alone sets fine-grained tags (Token.tag_); the coarse ones the rule reads come from a
        # morphologizer or an attribute_ruler's tag map.
        why = (
            f"its components ({components}) set no coarse tag (Token.pos_): a tagger needs an attribute_ruler "
            "mapping its tags, or a morphologizer"
            if names & {"tagger", "morphologizer"}
            else f"no tagger or morphologizer; components: {components}"
        )
        raise NLPError(
            f"spaCy pipeline '{spec}' tags no parts of speech ({why}), so the missing_pos rule (required_pos) "
            f"cannot run; {INSTALL_HINT}"
        )
    if persons and not probe.persons and hasattr(backend, "finds_entities") and not backend.finds_entities():
        raise NLPError(
            f"spaCy pipeline '{spec}' finds no named entities (no ner or entity_ruler; components: "
            f"{components}), so person_names nlp (<PERSON> substitution) cannot run; {INSTALL_HINT}"
        )
