"""Prompt templates and ImageNet class lists shipped as package data (``openalign/eval/data``).

- ``imagenet_templates.txt``: the 80 prompts CLIP introduced and ALIGN reuses for ImageNet zero-shot
  classification ("a bad photo of a {}.", "itap of my {}.", ...).
- ``imagenet_classes.tsv``: the 1000 ILSVRC-2012 classes in their standard order (sorted WordNet ids),
  each with a readable name: the synset's first WordNet lemma, except where two classes share it (the
  bird and the machine called "crane", the dog breed and the sweater "cardigan", the two "maillot"
  garments), which get a distinguishing name. The WordNet lemmas are kept in the last column.
- ``imagenet_r_wnids.txt`` / ``imagenet_a_wnids.txt``: the 200-class subsets of ImageNet-R and
  ImageNet-A, in ImageNet order.
- ``flowers102_classes.txt`` / ``pets_classes.txt`` / ``imagenet_clip_classes.txt``: CLIP's published
  class names of Oxford Flowers-102, Oxford-IIIT Pets and ImageNet (as CLIP_benchmark ships them), in the
  label order of the released annotations; Flowers' release has no names file at all. The ``imagenet``
  dataset spec names its classes with CLIP's list; class folders read with layout ``imagenet`` keep
  ``imagenet_classes.tsv``'s names.
- ``vtab1k_classes.json``: CLIP's names for the VTAB-1k tasks whose label order they follow, keyed by the
  task folder of the VTAB-1k releases (``caltech101``, ``eurosat``, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

SINGLE_TEMPLATE = "a photo of a {}."  # the paper's no-ensemble baseline prompt
SUBSETS = ("imagenet", "imagenet-r", "imagenet-a", "imagenet-v2")


def _data(name: str) -> str:
    return resources.files("openalign.eval").joinpath("data").joinpath(name).read_text(encoding="utf-8")


@dataclass(frozen=True)
class ImageNetClass:
    index: int  # position in the 1000-way ImageNet label space
    wnid: str  # WordNet id, the folder name of ImageNet's train/val layout
    name: str  # the readable name prompts are built from
    lemmas: str  # all WordNet lemmas of the synset, comma separated


@cache
def imagenet_classes() -> tuple[ImageNetClass, ...]:
    """The 1000 ImageNet classes in label order."""
    rows = []
    for line in _data("imagenet_classes.tsv").splitlines():
        if line and not line.startswith("#"):
            index, wnid, name, lemmas = line.split("\t")
            rows.append(ImageNetClass(int(index), wnid, name, lemmas))
    return tuple(rows)


def imagenet_classnames() -> list[str]:
    return [c.name for c in imagenet_classes()]


def imagenet_wnids() -> list[str]:
    return [c.wnid for c in imagenet_classes()]


@cache
def subset_indices(subset: str) -> tuple[int, ...]:
    """Indices into the 1000 ImageNet classes that a benchmark uses: all of them, or ImageNet-R/-A's 200."""
    if subset in ("imagenet", "imagenet-v2"):
        return tuple(range(1000))
    if subset not in ("imagenet-r", "imagenet-a"):
        raise ValueError(f"unknown ImageNet subset {subset!r}; valid: {', '.join(SUBSETS)}")
    position = {w: i for i, w in enumerate(imagenet_wnids())}
    wnids = _data(f"{subset.replace('-', '_')}_wnids.txt").split()
    return tuple(position[w] for w in wnids)


def imagenet_templates() -> list[str]:
    """The 80 ImageNet prompt templates, each with one ``{}`` for the class name."""
    return [t for t in _data("imagenet_templates.txt").splitlines() if t.strip()]


def load_templates(spec: str = "imagenet") -> list[str]:
    """Templates by name (``imagenet``: the 80 prompts; ``single``: "a photo of a {}.") or from a text file
    with one template per line, each holding exactly one ``{}``."""
    if spec == "imagenet":
        return imagenet_templates()
    if spec == "single":
        return [SINGLE_TEMPLATE]
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"{spec}: no such templates file (or use 'imagenet' or 'single')")
    templates = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not templates:
        raise ValueError(f"{spec}: the templates file is empty")
    for n, template in enumerate(templates, 1):
        if template.count("{}") != 1:
            raise ValueError(f"{spec}:{n}: template {template!r} must contain exactly one '{{}}'")
    return templates


SHIPPED_CLASSNAMES = {
    "flowers102": "flowers102_classes.txt",
    "pets": "pets_classes.txt",
    "imagenet": "imagenet_clip_classes.txt",
}


@cache
def shipped_classnames(dataset: str) -> tuple[str, ...]:
    """CLIP's class names of ``flowers102``, ``pets`` or ``imagenet``, in label order."""
    if dataset not in SHIPPED_CLASSNAMES:
        raise ValueError(f"no shipped class names for {dataset!r}; shipped: {', '.join(SHIPPED_CLASSNAMES)}")
    return tuple(line.strip() for line in _data(SHIPPED_CLASSNAMES[dataset]).splitlines() if line.strip())


@cache
def vtab1k_classnames() -> dict[str, tuple[str, ...]]:
    """CLIP's class names of the VTAB-1k tasks that have them, by task folder name."""
    return {task: tuple(names) for task, names in json.loads(_data("vtab1k_classes.json")).items()}
