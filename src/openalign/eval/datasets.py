"""Loaders for evaluation sets in the formats they are distributed in.

Retrieval: the Karpathy-split JSON of Flickr30K / MSCOCO (``dataset_flickr30k.json``, ``dataset_coco.json``)
plus an image root; CLIP_benchmark-style WebDataset tars (an image and a ``txt`` member with one caption per
line); a CSV of (image, caption) rows grouped by image. Classification: ImageNet-style class folders
(WordNet ids, readable names, or ImageNet-V2's ``0..999``) and WebDataset tars with a ``cls`` member.

Evaluation is strict where training is lenient: a missing image file, an unreadable image or a caption
without an image is an error naming it, because dropping it would silently change the denominator and
the number would no longer be comparable with anyone else's. Images are opened lazily, in order, so a
50K-image set never sits in memory; an image file or shard member over ``max_file_bytes`` (the ``max_file_mb``
option every task takes) is an error naming it, never read.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Sequence
from pathlib import Path

from openalign.data.sources import (
    CAPTION_MEMBER,
    DEFAULT_MAX_ANNOTATION_BYTES,
    DEFAULT_MAX_FILE_BYTES,
    check_annotation,
    expand_urls,
    read_annotation_json,
    scan_folder,
)
from openalign.eval.sets import (
    ClassificationSet,
    ImageSource,
    RetrievalSet,
    read_classnames,
    read_shards,
    required_image_member,
    resolve_images,
)
from openalign.eval.templates import SUBSETS, imagenet_classes, subset_indices

LAYOUTS = ("auto", "names", "wnids", "indices", *SUBSETS)
_WNID = re.compile(r"^n\d{8}$")


def _expand(spec: str) -> list[str]:
    urls = expand_urls(spec)
    missing = [u for u in urls if not u.startswith("pipe:") and not Path(u).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{missing[0]}: no such shard" + (f" ({len(missing)} missing)" if len(missing) > 1 else "")
        )
    return urls


# --------------------------------------------------------------------------------------------------
# Retrieval


def load_karpathy(
    path: str | Path,
    image_root: str | Path,
    split: str = "test",
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_annotation_bytes: int = DEFAULT_MAX_ANNOTATION_BYTES,
) -> RetrievalSet:
    """Flickr30K / MSCOCO from Karpathy's split JSON: ``images[]`` with ``split``, ``filename``, optional
    ``filepath`` (COCO's ``val2014``) and ``sentences[].raw``. Images are looked up as
    ``root/filepath/filename``, then ``root/filename``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such Karpathy split file")
    data = read_annotation_json(path, max_bytes=max_annotation_bytes)
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise ValueError(f"{path}: expected a Karpathy split file with an 'images' list")
    root = Path(image_root)
    if not root.is_dir():
        raise FileNotFoundError(f"{image_root}: no such image directory")
    entries = [im for im in data["images"] if im.get("split") == split]
    if not entries:
        splits: dict[str, int] = {}
        for im in data["images"]:
            splits[str(im.get("split"))] = splits.get(str(im.get("split")), 0) + 1
        have = ", ".join(f"{k} ({v})" for k, v in sorted(splits.items())) or "none"
        raise ValueError(f"{path}: no images in split {split!r}; splits present: {have}")
    candidates, captions, ids = [], [], []
    for i, im in enumerate(entries):
        if "filename" not in im:
            raise ValueError(f"{path}: image entry {im.get('imgid', i)} has no 'filename'")
        sub = im.get("filepath") or ""
        candidates.append([root / sub / im["filename"], root / im["filename"]] if sub else [root / im["filename"]])
        sentences = im.get("sentences") or []
        if not sentences:
            raise ValueError(f"{path}: image {im['filename']} has no sentences")
        for s in sentences:
            raw = s.get("raw") if isinstance(s, dict) else None
            if raw is None and isinstance(s, dict) and s.get("tokens"):
                raw = " ".join(s["tokens"])
            if raw is None:
                raise ValueError(
                    f"{path}: sentence {s.get('sentid') if isinstance(s, dict) else s!r} has no 'raw' text"
                )
            captions.append(str(raw).strip())
            ids.append(i)
    files = resolve_images(candidates, str(path))
    name = str(data.get("dataset") or path.stem.removeprefix("dataset_"))
    return RetrievalSet(ImageSource.from_files(files, max_bytes=max_file_bytes), captions, ids, name=name)


def load_coco_captions(
    path: str | Path,
    image_root: str | Path,
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_annotation_bytes: int = DEFAULT_MAX_ANNOTATION_BYTES,
) -> RetrievalSet:
    """A COCO-style caption file (``captions_val2014.json``, nocaps): ``images[]`` with ``id`` and
    ``file_name``, ``annotations[]`` with ``image_id`` and ``caption``. An annotation whose ``image_id``
    matches no image is an error naming the id."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such caption file")
    data = read_annotation_json(path, max_bytes=max_annotation_bytes)
    if not isinstance(data, dict) or not isinstance(data.get("annotations"), list):
        raise ValueError(f"{path}: expected COCO captions with 'images' and 'annotations' lists")
    root = Path(image_root)
    if not root.is_dir():
        raise FileNotFoundError(f"{image_root}: no such image directory")
    images = data.get("images") or []
    if not images:
        raise ValueError(f"{path}: the 'images' list is empty")
    position = {im["id"]: i for i, im in enumerate(images)}
    captions, ids = [], []
    for ann in data["annotations"]:
        if ann.get("image_id") not in position:
            raise ValueError(
                f"{path}: caption {ann.get('id')} refers to image_id {ann.get('image_id')!r}, which is not in 'images'"
            )
        captions.append(str(ann.get("caption", "")).strip())
        ids.append(position[ann["image_id"]])
    files = resolve_images([[root / im["file_name"]] for im in images], str(path))
    return RetrievalSet(ImageSource.from_files(files, max_bytes=max_file_bytes), captions, ids, name=path.stem)


def load_retrieval_wds(spec: str, *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> RetrievalSet:
    """CLIP_benchmark-style WebDataset retrieval shards: per sample an image and a ``txt`` member holding
    that image's captions, one per line."""
    urls = _expand(spec)
    keys: list[tuple[str, str]] = []
    captions: list[str] = []
    ids: list[int] = []
    for sample in read_shards(urls, max_file_bytes):
        where = f"{sample['__url__']}:{sample['__key__']}"
        required_image_member(sample)
        if CAPTION_MEMBER not in sample:
            raise ValueError(f"{where}: sample has no '{CAPTION_MEMBER}' captions")
        text = sample[CAPTION_MEMBER].decode("utf-8", "replace")
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if not lines:
            raise ValueError(f"{where}: the '{CAPTION_MEMBER}' member holds no caption")
        for line in lines:
            captions.append(line)
            ids.append(len(keys))
        keys.append((sample["__url__"], sample["__key__"]))
    name = Path(urls[0]).parent.name or "wds"
    return RetrievalSet(ImageSource.from_shards(urls, keys, max_bytes=max_file_bytes), captions, ids, name=name)


_IMAGE_COLUMNS = ("image", "filepath", "image_path", "filename", "file", "path", "url")
_CAPTION_COLUMNS = ("caption", "text", "title", "sentence", "raw")


def _pick_column(fields: Sequence[str], choices: Sequence[str], what: str, path: Path) -> str:
    lower = {f.lower().strip(): f for f in fields}
    for c in choices:
        if c in lower:
            return lower[c]
    raise ValueError(f"{path}: no {what} column (looked for {', '.join(choices)}; found {', '.join(fields)})")


def load_retrieval_csv(
    path: str | Path,
    image_root: str | Path | None = None,
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_annotation_bytes: int = DEFAULT_MAX_ANNOTATION_BYTES,
) -> RetrievalSet:
    """A CSV (``.tsv``: tab-separated) with a header, an image column (``image``, ``filepath``, ...) and a
    caption column (``caption``, ``text``, ...); rows of the same image are its captions. Relative image
    paths are resolved against ``image_root``, by default the CSV's directory."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such CSV file")
    check_annotation(path, max_bytes=max_annotation_bytes)  # its rows are kept in memory
    root = Path(image_root) if image_root else path.parent
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        if not reader.fieldnames:
            raise ValueError(f"{path}: empty CSV (a header row is required)")
        image_col = _pick_column(reader.fieldnames, _IMAGE_COLUMNS, "image", path)
        caption_col = _pick_column(reader.fieldnames, _CAPTION_COLUMNS, "caption", path)
        order: dict[str, int] = {}
        captions, ids = [], []
        for line, row in enumerate(reader, 2):
            image, caption = (row.get(image_col) or "").strip(), (row.get(caption_col) or "").strip()
            if not image or not caption:
                raise ValueError(f"{path}:{line}: empty {'image' if not image else 'caption'} field")
            ids.append(order.setdefault(image, len(order)))
            captions.append(caption)
    if not order:
        raise ValueError(f"{path}: no rows")
    files = resolve_images([[root / p] for p in order], str(path))
    return RetrievalSet(ImageSource.from_files(files, max_bytes=max_file_bytes), captions, ids, name=path.stem)


def load_retrieval(
    spec: str,
    images: str | Path | None = None,
    split: str = "test",
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_annotation_bytes: int = DEFAULT_MAX_ANNOTATION_BYTES,
) -> RetrievalSet:
    """``karpathy:FILE.json`` or ``coco:captions.json`` (both need ``images``), ``csv:FILE`` or
    ``wds:SHARDS``; without a prefix the format follows the suffix (.json: Karpathy, .csv/.tsv, .tar)."""
    kind, _, rest = spec.partition(":")
    if kind not in ("karpathy", "coco", "csv", "wds") or not rest:
        kind, rest = "", spec
        suffix = Path(spec).suffix.lower()
        kind = {".json": "karpathy", ".csv": "csv", ".tsv": "csv"}.get(suffix, "wds" if ".tar" in spec else "")
        if not kind:
            raise ValueError(f"cannot tell the format of retrieval dataset {spec!r}; prefix karpathy:, csv: or wds:")
    if kind in ("karpathy", "coco"):
        if images is None:
            raise ValueError(f"a {kind} caption file needs the image root directory (images) for {rest}")
        if kind == "karpathy":
            return load_karpathy(
                rest, images, split, max_file_bytes=max_file_bytes, max_annotation_bytes=max_annotation_bytes
            )
        return load_coco_captions(
            rest, images, max_file_bytes=max_file_bytes, max_annotation_bytes=max_annotation_bytes
        )
    if kind == "csv":
        return load_retrieval_csv(
            rest, images, max_file_bytes=max_file_bytes, max_annotation_bytes=max_annotation_bytes
        )
    return load_retrieval_wds(rest, max_file_bytes=max_file_bytes)


# --------------------------------------------------------------------------------------------------
# Classification


def _imagenet_subset(subset: str) -> tuple[list[str], list[str]]:
    classes = imagenet_classes()
    chosen = [classes[i] for i in subset_indices(subset)]
    ids = [str(c.index) for c in chosen] if subset == "imagenet-v2" else [c.wnid for c in chosen]
    return ids, [c.name for c in chosen]


def _detect_layout(folders: list[str], classnames: list[str] | None, root: Path) -> str:
    if all(f.isdigit() for f in folders):
        if classnames is None:
            raise ValueError(
                f"{root}: class folders are numbers; pass the class names file, or layout imagenet-v2 for ImageNet-V2"
            )
        return "indices"
    if all(_WNID.match(f) for f in folders):
        return "wnids"
    return "names"


def load_class_folders(
    root: str | Path,
    layout: str = "auto",
    classnames: str | Path | None = None,
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_annotation_bytes: int = DEFAULT_MAX_ANNOTATION_BYTES,
) -> ClassificationSet:
    """Images in one folder per class.

    ``layout``: ``names`` (folder names are the class names, ``_`` read as a space; sorted),
    ``wnids`` (WordNet-id folders named from the ImageNet list; sorted), ``indices`` (folders ``0..N-1``
    indexing the class names file), ``imagenet`` / ``imagenet-r`` / ``imagenet-a`` (the benchmark's fixed
    1000 or 200 WordNet-id classes; a missing folder is a class without samples), ``imagenet-v2`` (folders
    ``0..999``), or ``auto`` (numbers: indices; WordNet ids: wnids; anything else: names). A class names
    file (one per line, in label order) replaces the names.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such class-folder directory")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise ValueError(f"{root}: no class folders")
    names_file = read_classnames(classnames, max_annotation_bytes=max_annotation_bytes) if classnames else None
    if layout == "auto":
        layout = _detect_layout(folders, names_file, root)

    if layout in SUBSETS:
        class_ids, names = _imagenet_subset(layout)
        known = set(class_ids)
        stray = [f for f in folders if f not in known]
        if stray:
            raise ValueError(f"{root / stray[0]}: folder is not a class of {layout} ({len(stray)} such folders)")
    elif layout == "indices":
        if names_file is None:
            raise ValueError(f"{root}: layout 'indices' needs a class names file")
        bad = [f for f in folders if not f.isdigit() or int(f) >= len(names_file)]
        if bad:
            raise ValueError(f"{root / bad[0]}: folder is not a class index below {len(names_file)}")
        class_ids, names = [str(i) for i in range(len(names_file))], list(names_file)
    elif layout == "wnids":
        lookup = {c.wnid: c.name for c in imagenet_classes()}
        unknown = [f for f in folders if f not in lookup]
        if unknown and names_file is None:
            raise ValueError(f"{root / unknown[0]}: not an ImageNet WordNet id; pass a class names file")
        class_ids, names = folders, [lookup.get(f, f) for f in folders]
    else:
        class_ids, names = folders, [f.replace("_", " ") for f in folders]
    if names_file is not None and layout != "indices":
        if len(names_file) != len(class_ids):
            raise ValueError(f"{classnames}: {len(names_file)} class names for {len(class_ids)} classes in {root}")
        names = list(names_file)

    index = {cid: i for i, cid in enumerate(class_ids)}
    present = set(folders)
    files, labels, skipped = [], [], []
    for cid in class_ids:
        if cid not in present:
            continue
        scan = scan_folder(root / cid)  # the same images every other stage reads from a folder
        files += scan.images
        labels += [index[cid]] * len(scan.images)
        skipped += [str(p) for p in scan.other]
    name = _subset_name(layout, class_ids) or root.name
    images = ImageSource.from_files(files, max_bytes=max_file_bytes)
    return ClassificationSet(name, names, class_ids, labels, images, skipped)


def _subset_name(layout: str, class_ids: list[str]) -> str | None:
    if layout in SUBSETS:
        return layout
    if layout == "wnids":
        for subset in ("imagenet", "imagenet-r", "imagenet-a"):
            if class_ids == _imagenet_subset(subset)[0]:
                return subset
    return None


def load_classification_wds(
    spec: str,
    classnames: str | Path | None = None,
    layout: str = "auto",
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_annotation_bytes: int = DEFAULT_MAX_ANNOTATION_BYTES,
) -> ClassificationSet:
    """WebDataset shards whose samples hold an image and ``cls`` (the label as text). Class names come from
    ``classnames`` (one per line), from a ``classnames.txt`` beside the shards, or, with layout imagenet /
    imagenet-r / imagenet-a / imagenet-v2, from the ImageNet list (``cls`` indexing that benchmark's classes)."""
    urls = _expand(spec)
    beside = Path(urls[0]).parent / "classnames.txt"
    if classnames:
        names = read_classnames(classnames, max_annotation_bytes=max_annotation_bytes)
        class_ids = [str(i) for i in range(len(names))]
    elif layout in SUBSETS:
        class_ids, names = _imagenet_subset(layout)
    elif beside.is_file():
        names = read_classnames(beside, max_annotation_bytes=max_annotation_bytes)
        class_ids = [str(i) for i in range(len(names))]
    else:
        raise ValueError(f"{spec}: WebDataset classification needs a class names file (or layout imagenet)")
    keys, labels = [], []
    for sample in read_shards(urls, max_file_bytes):
        where = f"{sample['__url__']}:{sample['__key__']}"
        required_image_member(sample)
        raw = sample.get("cls")
        if raw is None:
            raise ValueError(f"{where}: sample has no 'cls' label")
        try:
            label = int(raw.decode().strip())
        except ValueError:
            raise ValueError(f"{where}: 'cls' is not an integer: {raw[:20]!r}") from None
        if not 0 <= label < len(names):
            raise ValueError(f"{where}: label {label} is outside the {len(names)} classes")
        keys.append((sample["__url__"], sample["__key__"]))
        labels.append(label)
    name = layout if layout in SUBSETS else (Path(urls[0]).parent.name or "wds")
    images = ImageSource.from_shards(urls, keys, max_bytes=max_file_bytes)
    return ClassificationSet(name, names, class_ids, labels, images)


def load_classification(
    spec: str,
    layout: str = "auto",
    classnames: str | Path | None = None,
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_annotation_bytes: int = DEFAULT_MAX_ANNOTATION_BYTES,
) -> ClassificationSet:
    """``wds:SHARDS`` or a ``.tar`` spec: WebDataset; ``NAME:DIR[:SPLIT]`` (``flowers102``, ``pets``, ``cars``,
    ``food101``, ``imagenet``, ``vtab1k``; see ``openalign.eval.released``): a dataset in its released
    layout; otherwise a directory of class folders."""
    from openalign.eval.released import load_released, parse_spec

    if parse_spec(spec) is not None:
        if layout != "auto":
            raise ValueError(f"{spec}: layout {layout!r} applies to class folders, not to a dataset spec")
        return load_released(spec, classnames, max_file_bytes=max_file_bytes, max_annotation_bytes=max_annotation_bytes)
    limits = {"max_file_bytes": max_file_bytes, "max_annotation_bytes": max_annotation_bytes}
    if spec.startswith("wds:"):
        return load_classification_wds(spec[4:], classnames, layout, **limits)
    if ".tar" in spec and not Path(spec).is_dir():
        return load_classification_wds(spec, classnames, layout, **limits)
    return load_class_folders(spec, layout, classnames, **limits)
