"""CC12M's person-name substitution: names of people in kept alt-texts become ``<PERSON>``.

CC12M ran a named-entity recogniser (Google Cloud Natural Language) and replaced every Person entity,
for privacy. ``person_substitution: nlp`` does the same with the run's NLP pipeline
(:mod:`openalign.data.filters.nlp`, e.g. spaCy's ``en_core_web_sm``): every PERSON entity becomes
``<PERSON>``. Any other ``str -> str`` callable also works, named in the rules as
``person_substitution: package.module:function`` or passed to :func:`filter_corpus` directly. Either way it
is applied to the distinct alt-texts of the kept rows, in batches, and the report counts the rows changed.

:func:`demo_person_names` is only a demonstration: a capitalised first name from a short built-in list,
with up to two capitalised words after it, is replaced. It misses most names and it will replace some
words that are not names ("Rose Garden"); do not use it for privacy.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import cast

PERSON_TOKEN = "<PERSON>"
PersonHook = Callable[[str], str]

# Demo gazetteer, one string so it stays short; split at import.
_DEMO_FIRST_NAMES_TEXT = (
    "Aaron Adam Alan Albert Alex Alice Amanda Amy Andrew Angela Anna Anthony Barbara Ben Brian Carl Carol "
    "Catherine Charles Chris Christopher Daniel David Deborah Dennis Donald Donna Dorothy Edward Elizabeth "
    "Emily Emma Eric Frank Gary George Grace Gregory Hannah Harry Helen Henry Jack Jacob James Jane Jason "
    "Jennifer Jessica John Joseph Joshua Karen Kate Kevin Larry Laura Linda Lisa Margaret Maria Mark Mary "
    "Matthew Michael Michelle Nancy Nicholas Olivia Patricia Paul Peter Rachel Richard Robert Ryan Sam Sandra "
    "Sarah Scott Sophia Steven Susan Thomas Timothy Tom William"
)
_DEMO_FIRST_NAMES = tuple(_DEMO_FIRST_NAMES_TEXT.split(" "))
_DEMO_PATTERN = re.compile(r"\b(?:" + "|".join(_DEMO_FIRST_NAMES) + r")(?:\s+[A-Z][a-z]+(?:-[A-Z][a-z]+)?){0,2}\b")


def demo_person_names(text: str) -> str:
    """Demonstration only: replace ``<first name from a short list> [Capitalised [Capitalised]]`` by <PERSON>."""
    return _DEMO_PATTERN.sub(PERSON_TOKEN, text)


def resolve_person_hook(spec: str | PersonHook | None) -> PersonHook | str | None:
    """``None``, a callable, ``"nlp"`` (kept as is: the NLP pipeline's PERSON entities), ``"demo"``, or
    ``"package.module:function"`` naming a ``str -> str`` callable."""
    if spec is None or callable(spec) or spec == "nlp":
        return spec
    if spec == "demo":
        return demo_person_names
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"person_substitution must be 'nlp', 'demo' or 'package.module:function', got '{spec}'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"person_substitution: cannot import module '{module_name}': {err}") from err
    hook = getattr(module, attr, None)
    if not callable(hook):
        raise ValueError(f"person_substitution: '{spec}' is not a callable")
    return cast("Callable[[str], str]", hook)
