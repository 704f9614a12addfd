"""Transfer datasets in the layouts they are released in, named by a spec ``NAME:DIR[:SPLIT]``.

- ``flowers102:DIR[:SPLIT]``: ``jpg/image_NNNNN.jpg``, ``imagelabels.mat`` (``labels``), ``setid.mat``
  (``trnid``, ``valid``, ``tstid``); splits test (default), train, val, trainval.
- ``pets:DIR[:SPLIT]``: ``images/STEM.jpg``, ``annotations/trainval.txt`` and ``test.txt`` (lines
  ``STEM CLASS-ID SPECIES BREED-ID``); splits test, trainval (``train`` names it too).
- ``cars:DIR[:SPLIT]``: the devkit (``devkit/cars_meta.mat``, ``devkit/cars_train_annos.mat``,
  ``cars_test_annos_withlabels.mat``, images in ``cars_train/`` and ``cars_test/``), or the single-file
  release (``cars_annos.mat`` with its ``test`` flags, images in ``car_ims/``); splits test, train.
- ``food101:DIR[:SPLIT]``: ``images/CLASS/ID.jpg``, ``meta/classes.txt``, ``meta/train.txt`` / ``test.txt``
  (lines ``CLASS/ID``), ``meta/labels.txt`` for readable names; splits test, train.
- ``imagenet:DIR[:SPLIT]``: ``train/WNID/`` (or Kaggle's ``ILSVRC/Data/CLS-LOC/train``); ``val/`` as WNID
  folders, or flat ``ILSVRC2012_val_*.JPEG`` labelled by the devkit's
  ``ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt`` (with ``meta.mat`` beside it) or by
  ``LOC_val_solution.csv`` (which must label every flat image in the folder); splits val, train.
- ``vtab1k:DIR/TASK[:SPLIT]``: the VTAB-1k list files ``train800.txt``, ``val200.txt``,
  ``train800val200.txt``, ``test.txt`` (lines ``PATH LABEL``, paths relative to the task folder); splits
  test, train800val200, train800, val200. A label must be below the task's number of classes, or, for a task
  without a shipped class list (the labels are its names), below ``MAX_VTAB_CLASSES`` (100,000).

CLIP_benchmark's names ``flowers``, ``cars``, ``imagenet1k`` (and ``pets``, ``food101``) are accepted too.
Labels in the ``.mat`` files and list files are 1-based, as released (VTAB-1k's are 0-based); every class
keeps its released index as its id, so a train and a test split line up class by class. Class names are
CLIP's published lists where they exist (Flowers, Pets, ImageNet, some VTAB tasks),
otherwise the release's own (Cars' ``class_names``, Food-101's ``labels.txt``); ``classnames`` replaces them.

Every metadata file is read through ``read_annotation`` (within ``max_annotation_bytes``), and a file
that is missing, unreadable, lacks a variable or holds a bad label is a one-line error naming it; so is a
listed image that is not on disk. Every listed image must lie inside the dataset folder once symlinks are
resolved, as a table's image paths must lie inside its image root (``ImageRoot``): an annotation naming an
absolute path, a ``..`` escape or a symlink pointing out is an error naming the row that lists it; so is
an image listed twice in one split (a released list never repeats one, so a repeat is a damaged file that
would count the image twice).
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openalign.data.sources import (
    DEFAULT_MAX_ANNOTATION_BYTES,
    DEFAULT_MAX_FILE_BYTES,
    BadInput,
    ImageRoot,
    is_image_file,
    read_annotation,
    scan_folder,
)
from openalign.eval.sets import ClassificationSet, ImageSource, read_classnames, resolve_images

# Spec names, CLIP_benchmark's names for the same datasets among them (flowers, cars, imagenet1k, pets, food101).
ALIASES = {
    "flowers102": "flowers102",
    "flowers": "flowers102",
    "pets": "pets",
    "cars": "cars",
    "food101": "food101",
    "imagenet": "imagenet",
    "imagenet1k": "imagenet",
    "vtab1k": "vtab1k",
}
SPLITS: dict[str, tuple[str, ...]] = {
    "flowers102": ("test", "train", "val", "trainval"),
    "pets": ("test", "trainval", "train"),
    "cars": ("test", "train"),
    "food101": ("test", "train"),
    "imagenet": ("val", "train"),
    "vtab1k": ("test", "train800val200", "train800", "val200"),
}
_VAL_NAME = re.compile(r"^ILSVRC2012_val_(\d{8})$")
_LABEL = re.compile(r"^[0-9]+$")  # a VTAB-1k label: ASCII digits only (str.isdigit takes "²" and other digits)
# The most classes a VTAB-1k task folder may have (labels 0 .. MAX_VTAB_CLASSES - 1). A task without a shipped
# class list has as many classes as its largest label needs, and every class costs a name, a classifier row and
# a column of every score matrix, so a mistyped label (30000000) would otherwise allocate gigabytes. The 19 tasks
# have at most 397 classes; 100,000 leaves room for any custom task (ImageNet-21k has 21,843).
MAX_VTAB_CLASSES = 100_000


@dataclass(frozen=True)
class DatasetSpec:
    name: str  # the layout, after aliases
    root: Path
    split: str


def parse_spec(spec: str) -> DatasetSpec | None:
    """The dataset a ``NAME:DIR[:SPLIT]`` spec names, or None when ``spec`` does not start with a known NAME.
    A last ``:PART`` holding no path separator is the split."""
    name, sep, rest = spec.partition(":")
    if not sep or name.lower() not in ALIASES:
        return None
    layout = ALIASES[name.lower()]
    head, sep, tail = rest.rpartition(":")
    if sep and tail and "/" not in tail and os.sep not in tail:
        directory, split = head, tail
    else:
        directory, split = rest, SPLITS[layout][0]
    if not directory:
        raise ValueError(f"{spec}: no directory; write {name}:DIR[:SPLIT]")
    if layout == "pets" and split == "train":
        split = "trainval"  # the release has no separate train list
    if split not in SPLITS[layout]:
        raise ValueError(f"{spec}: unknown split {split!r} for {layout}; valid: {', '.join(SPLITS[layout])}")
    return DatasetSpec(layout, Path(directory), split)


def load_released(
    spec: str,
    classnames: str | Path | None = None,
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_annotation_bytes: int = DEFAULT_MAX_ANNOTATION_BYTES,
) -> ClassificationSet:
    """The labelled images of one split of a released dataset (see the module docstring)."""
    parsed = parse_spec(spec)
    if parsed is None:
        raise ValueError(f"{spec}: not a dataset spec; names: {', '.join(sorted(ALIASES))}")
    # Absolute once here: the readers list files under the folder and a relative one would be joined twice.
    root = parsed.root.absolute()
    if not root.is_dir():
        raise FileNotFoundError(f"{parsed.root}: no such {parsed.name} directory")
    reader = _LAYOUTS[parsed.name]
    read = reader(root, parsed.split, max_annotation_bytes)  # the lists and .mat files
    name, names = read.name, read.classnames
    if classnames:
        override = read_classnames(classnames, max_annotation_bytes=max_annotation_bytes)
        if len(override) != len(names):
            raise ValueError(f"{classnames}: {len(override)} class names for the {len(names)} classes of {name}")
        names = override
    paths = resolve_images([[f] for f in _confined(root, read)], read.listed_in)
    images = ImageSource.from_files(paths, max_bytes=max_file_bytes)
    return ClassificationSet(name, list(names), list(read.class_ids), read.labels, images, read.skipped)


@dataclass
class Read:
    """One split as a layout reads it, before its images are checked."""

    name: str  # the dataset's name in reports
    classnames: Sequence[str]
    class_ids: Sequence[str]  # the released class numbers (or folders), shared by every split
    files: list[Path]
    labels: list[int]
    listed_in: str  # the file that lists the images, named when one is missing
    skipped: list[str] = field(default_factory=list)  # non-image files in class folders
    rows: list[str] = field(default_factory=list)  # where each file is listed ("FILE:LINE"), named in errors

    def row(self, i: int) -> str:
        return self.rows[i] if i < len(self.rows) else self.listed_in


def _confined(root: Path, read: Read) -> list[Path]:
    """Every listed file resolved (symlinks included) inside the dataset folder, as a table's image paths are
    kept inside its image root (``ImageRoot``): an absolute path, a ``..`` escape or a symlink pointing out is
    an error naming the row that lists it, and so is a file listed a second time."""
    images = ImageRoot(root)
    out: list[Path] = []
    first: dict[Path, int] = {}
    for i, file in enumerate(read.files):
        try:
            resolved = images.resolve(str(file))
        except BadInput as err:
            detail = err.detail.replace("outside the image root", "outside the dataset folder")
            raise ValueError(f"{read.row(i)}: {detail}") from None
        seen = first.setdefault(resolved, i)
        if seen != i:
            raise ValueError(
                f"{read.row(i)}: {file} is listed again (first at {read.row(seen)}); a released list names each "
                "image once, so the file is damaged"
            )
        out.append(resolved)
    return out


# --------------------------------------------------------------------------------------------------
# Reading the metadata files


def _bytes(path: Path, max_bytes: int) -> bytes:
    return read_annotation(path, max_bytes=max_bytes)


def _lines(path: Path, max_bytes: int) -> list[tuple[int, str]]:
    """(line number, stripped text) of every non-blank line that is not a ``#`` comment."""
    try:
        text = _bytes(path, max_bytes).decode("utf-8-sig")  # a byte-order mark, as Windows editors write, dropped
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    return [(n, s) for n, line in enumerate(text.splitlines(), 1) if (s := line.strip()) and not s.startswith("#")]


def _loadmat(path: Path, variables: Sequence[str], max_bytes: int) -> dict[str, Any]:
    """The named variables of a MATLAB file; a missing one is an error naming the file and what it holds."""
    from scipy.io import loadmat

    data = _bytes(path, max_bytes)
    try:
        mat = loadmat(io.BytesIO(data), squeeze_me=True)
    except Exception as err:  # scipy raises ValueError, TypeError, MatReadError, ... for a damaged file
        raise ValueError(f"{path}: not a readable MATLAB .mat file ({type(err).__name__}: {err})") from None
    missing = [v for v in variables if v not in mat]
    if missing:
        have = ", ".join(sorted(k for k in mat if not k.startswith("__"))) or "none"
        raise ValueError(f"{path}: no variable {missing[0]!r} (has: {have})")
    return {v: mat[v] for v in variables}


def _int_list(value: Any, path: Path, what: str) -> list[int]:
    import numpy as np

    array = np.atleast_1d(np.asarray(value)).ravel()
    if array.dtype.kind not in "iuf" or (array.dtype.kind == "f" and not np.all(np.mod(array, 1) == 0)):
        raise ValueError(f"{path}: {what} is not a list of whole numbers (dtype {array.dtype})")
    return [int(v) for v in array]


def _records(value: Any, fields: Sequence[str], path: Path, variable: str) -> list[dict[str, Any]]:
    """The rows of a MATLAB struct array as dicts of the named fields."""
    import numpy as np

    array = np.atleast_1d(np.asarray(value)).ravel()
    names = array.dtype.names or ()
    missing = [f for f in fields if f not in names]
    if missing:
        raise ValueError(f"{path}: {variable} has no field {missing[0]!r} (fields: {', '.join(names) or 'none'})")
    return [{f: row[f] for f in fields} for row in array]


def _strings(value: Any) -> list[str]:
    import numpy as np

    return [str(v).strip() for v in np.atleast_1d(np.asarray(value, dtype=object)).ravel()]


def _label(value: Any, count: int, where: str) -> int:
    """A released 1-based class number as a 0-based index; anything else is an error naming ``where``."""
    try:
        as_float = float(str(value).strip())  # MATLAB stores most numbers as doubles
    except ValueError:
        raise ValueError(f"{where}: class {str(value)!r} is not a number") from None
    if not as_float.is_integer():
        raise ValueError(f"{where}: class {str(value)!r} is not a whole number")
    number = int(as_float)
    if not 1 <= number <= count:
        raise ValueError(f"{where}: class {number} is outside 1..{count}")
    return number - 1


def _numbered(count: int) -> list[str]:
    return [str(i) for i in range(count)]


def _first(root: Path, candidates: Sequence[str], what: str) -> Path:
    for rel in candidates:
        if (root / rel).exists():
            return root / rel
    raise FileNotFoundError(f"{root / candidates[0]}: no {what} (looked for {', '.join(candidates)})")


# --------------------------------------------------------------------------------------------------
# The layouts


def _flowers102(root: Path, split: str, max_bytes: int) -> Read:
    from openalign.eval.templates import shipped_classnames

    names = shipped_classnames("flowers102")
    labels_path, setid_path = root / "imagelabels.mat", root / "setid.mat"
    per_image = _int_list(_loadmat(labels_path, ["labels"], max_bytes)["labels"], labels_path, "labels")
    keys = {"train": ["trnid"], "val": ["valid"], "test": ["tstid"], "trainval": ["trnid", "valid"]}[split]
    setid = _loadmat(setid_path, keys, max_bytes)
    files, labels, rows = [], [], []
    for key in keys:
        for position, image_id in enumerate(_int_list(setid[key], setid_path, key), 1):
            if not 1 <= image_id <= len(per_image):
                raise ValueError(f"{setid_path}: {key} lists image {image_id}, outside the {len(per_image)} labels")
            labels.append(_label(per_image[image_id - 1], len(names), f"{labels_path}: image {image_id}"))
            files.append(root / "jpg" / f"image_{image_id:05d}.jpg")
            rows.append(f"{setid_path}: {key} entry {position} (image {image_id})")
    return Read("flowers102", names, _numbered(len(names)), files, labels, str(setid_path), rows=rows)


def _pets(root: Path, split: str, max_bytes: int) -> Read:
    from openalign.eval.templates import shipped_classnames

    names = shipped_classnames("pets")
    path = root / "annotations" / f"{split}.txt"
    files, labels, rows = [], [], []
    breed_of: dict[int, str] = {}  # the file-name breed each class number was first seen with
    for n, line in _lines(path, max_bytes):
        parts = line.split()
        if len(parts) < 2:
            raise ValueError(f"{path}:{n}: expected 'IMAGE CLASS-ID SPECIES BREED-ID', got {line!r}")
        label = _label(parts[1], len(names), f"{path}:{n}")
        # The file name carries the breed, so a shifted or mistyped class number shows as a second breed.
        breed = parts[0].rsplit("_", 1)[0].lower()
        if breed_of.setdefault(label, breed) != breed:
            raise ValueError(f"{path}:{n}: {parts[0]} has class {label + 1}, the class of {breed_of[label]} images")
        labels.append(label)
        files.append(root / "images" / f"{parts[0]}.jpg")
        rows.append(f"{path}:{n}")
    return Read("pets", names, _numbered(len(names)), files, labels, str(path), rows=rows)


def _cars(root: Path, split: str, max_bytes: int) -> Read:
    fields = ["fname", "class"]
    if (root / "cars_annos.mat").is_file() and not (root / "devkit").is_dir():
        # The single-file release: every image under car_ims/, with a test flag per annotation.
        path = root / "cars_annos.mat"
        mat = _loadmat(path, ["annotations", "class_names"], max_bytes)
        names = _strings(mat["class_names"])
        rows = _records(mat["annotations"], ["relative_im_path", "class", "test"], path, "annotations")
        want = 1 if split == "test" else 0
        chosen = [(r["relative_im_path"], r["class"]) for r in rows if int(r["test"]) == want]
        image_dir, listed = root, path
    else:
        meta = _first(root, ["devkit/cars_meta.mat", "cars_meta.mat"], "Stanford Cars devkit meta file")
        names = _strings(_loadmat(meta, ["class_names"], max_bytes)["class_names"])
        if split == "train":
            listed = _first(root, ["devkit/cars_train_annos.mat", "cars_train_annos.mat"], "training annotations")
        else:
            listed = _first(
                root,
                ["cars_test_annos_withlabels.mat", "devkit/cars_test_annos_withlabels.mat"],
                "labelled test annotations (cars_test_annos.mat has no classes)",
            )
        rows = _records(_loadmat(listed, ["annotations"], max_bytes)["annotations"], fields, listed, "annotations")
        chosen = [(r["fname"], r["class"]) for r in rows]
        image_dir = root / f"cars_{split}"
    files, labels, where = [], [], []
    for i, (file, cls) in enumerate(chosen, 1):
        labels.append(_label(cls, len(names), f"{listed}: annotation {i}"))
        files.append(image_dir / str(file))
        where.append(f"{listed}: annotation {i}")
    return Read("cars", names, _numbered(len(names)), files, labels, str(listed), rows=where)


def _food101(root: Path, split: str, max_bytes: int) -> Read:
    meta = root / "meta"
    classes = [line for _, line in _lines(meta / "classes.txt", max_bytes)]
    index = {c: i for i, c in enumerate(classes)}
    names = [c.replace("_", " ") for c in classes]
    if (meta / "labels.txt").is_file():
        readable = [line.lower() for _, line in _lines(meta / "labels.txt", max_bytes)]
        if len(readable) != len(classes):
            raise ValueError(f"{meta / 'labels.txt'}: {len(readable)} labels for {len(classes)} classes.txt entries")
        names = readable
    path = meta / f"{split}.txt"
    files, labels, rows = [], [], []
    for n, line in _lines(path, max_bytes):
        cls, sep, _ = line.partition("/")
        if not sep or cls not in index:
            raise ValueError(f"{path}:{n}: {line!r} is not CLASS/ID with a class of {meta / 'classes.txt'}")
        labels.append(index[cls])
        files.append(root / "images" / f"{line}.jpg")
        rows.append(f"{path}:{n}")
    return Read("food101", names, classes, files, labels, str(path), rows=rows)


def _imagenet(root: Path, split: str, max_bytes: int) -> Read:
    from openalign.eval.templates import imagenet_wnids, shipped_classnames

    wnids, names = imagenet_wnids(), shipped_classnames("imagenet")
    index = {w: i for i, w in enumerate(wnids)}
    folder = _first(root, [split, f"ILSVRC/Data/CLS-LOC/{split}"], f"ImageNet {split} folder")
    subdirs = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if subdirs:
        stray = [d for d in subdirs if d not in index]
        if stray:
            raise ValueError(f"{folder / stray[0]}: not an ImageNet WordNet id ({len(stray)} such folders)")
        files, labels, skipped = [], [], []
        for wnid in subdirs:
            scan = scan_folder(folder / wnid)  # the same images every other stage reads from a folder
            files += scan.images
            labels += [index[wnid]] * len(scan.images)
            skipped += [str(p) for p in scan.other]
        return Read("imagenet", names, wnids, files, labels, str(folder), skipped)
    if split == "train":
        raise ValueError(f"{folder}: the ImageNet train split needs one WordNet-id folder per class")
    wnid_of, listed = _val_ground_truth(root, max_bytes)
    # Labels for fewer images than the folder holds would shrink the validation set without a word.
    on_disk = sorted(p.stem for p in folder.iterdir() if _VAL_NAME.match(p.stem) and is_image_file(p))
    unlabelled = [stem for stem in on_disk if stem not in wnid_of]
    if unlabelled:
        raise ValueError(
            f"{listed}: labels for {len(wnid_of)} images, but {folder} holds {len(on_disk)} ILSVRC2012_val_* images "
            f"({len(unlabelled)} without a label, the first {unlabelled[0]}); a short or truncated label file?"
        )
    files, labels, rows = [], [], []
    for stem in sorted(wnid_of):
        wnid = wnid_of[stem]
        if wnid not in index:
            raise ValueError(f"{listed}: {stem} is labelled {wnid!r}, not an ImageNet class")
        files.append(folder / f"{stem}.JPEG")
        labels.append(index[wnid])
        rows.append(f"{listed}: {stem}")
    return Read("imagenet", names, wnids, files, labels, str(listed), rows=rows)


def _val_ground_truth(root: Path, max_bytes: int) -> tuple[dict[str, str], Path]:
    """The WordNet id of every flat validation image (by file stem): the devkit's ground truth (1-based
    ILSVRC2012_IDs, line N for image N, mapped through ``meta.mat``'s synsets) or ``LOC_val_solution.csv``."""
    devkit = ["ILSVRC2012_devkit_t12/data", "devkit/data", "data", "."]
    truth = next(
        (
            root / d / "ILSVRC2012_validation_ground_truth.txt"
            for d in devkit
            if (root / d / "ILSVRC2012_validation_ground_truth.txt").is_file()
        ),
        None,
    )
    if truth is not None:
        meta = truth.parent / "meta.mat"
        synsets = _loadmat(meta, ["synsets"], max_bytes)["synsets"]
        by_id = {
            int(r["ILSVRC2012_ID"]): str(r["WNID"])
            for r in _records(synsets, ["ILSVRC2012_ID", "WNID"], meta, "synsets")
        }
        out = {}
        for n, line in _lines(truth, max_bytes):
            try:
                wnid = by_id[int(line)]
            except (ValueError, KeyError):
                raise ValueError(f"{truth}:{n}: {line!r} is not an ILSVRC2012_ID of {meta}") from None
            out[f"ILSVRC2012_val_{n:08d}"] = wnid
        return out, truth
    solution = root / "LOC_val_solution.csv"
    if not solution.is_file():
        raise FileNotFoundError(
            f"{root}: the flat validation folder needs labels: ILSVRC2012_devkit_t12/data/"
            "ILSVRC2012_validation_ground_truth.txt with meta.mat, or LOC_val_solution.csv"
        )
    text = _bytes(solution, max_bytes).decode("utf-8-sig", "replace")
    rows = list(csv.reader(io.StringIO(text)))
    if not rows or [c.strip() for c in rows[0][:2]] != ["ImageId", "PredictionString"]:
        raise ValueError(f"{solution}: expected the header 'ImageId,PredictionString'")
    out = {}
    for n, row in enumerate(rows[1:], 2):
        if not row:
            continue
        prediction = row[1].split() if len(row) > 1 else []
        if not _VAL_NAME.match(row[0].strip()) or not prediction:
            raise ValueError(
                f"{solution}:{n}: expected 'ILSVRC2012_val_NNNNNNNN,WNID x y x y ...', got {','.join(row)!r}"
            )
        stem = row[0].strip()
        if stem in out:
            raise ValueError(f"{solution}:{n}: {stem} is listed again; a released list names each image once")
        out[stem] = prediction[0]
    return out, solution


def _vtab1k(root: Path, split: str, max_bytes: int) -> Read:
    from openalign.eval.templates import vtab1k_classnames

    path = root / f"{split}.txt"
    shipped = vtab1k_classnames().get(root.name)
    files, labels, rows = [], [], []
    for n, line in _lines(path, max_bytes):
        parts = line.rsplit(None, 1)
        image, label = (parts[0], parts[1]) if len(parts) == 2 else ("", "")
        if not image or not _LABEL.match(label):
            raise ValueError(f"{path}:{n}: expected 'PATH LABEL' with a label 0, 1, ..., got {line!r}")
        # Checked before anything is sized by it: a task without a shipped class list has as many classes as its
        # largest label needs, and one mistyped label must not make that millions.
        if shipped and (len(label) > 6 or int(label) >= len(shipped)):
            raise ValueError(
                f"{path}:{n}: label {label} of {image} is outside the {len(shipped)} classes of {root.name}"
            )
        if len(label) > 6 or int(label) >= MAX_VTAB_CLASSES:
            raise ValueError(
                f"{path}:{n}: label {label} of {image} is beyond the {MAX_VTAB_CLASSES} classes a task may have "
                "(labels are 0, 1, ..., number of classes - 1)"
            )
        files.append(root / image)
        labels.append(int(label))
        rows.append(f"{path}:{n}")
    count = len(shipped) if shipped else (max(labels) + 1 if labels else 0)
    names = list(shipped) if shipped else _numbered(count)
    return Read(f"vtab1k/{root.name}", names, _numbered(count), files, labels, str(path), rows=rows)


_LAYOUTS: dict[str, Callable[[Path, str, int], Read]] = {
    "flowers102": _flowers102,
    "pets": _pets,
    "cars": _cars,
    "food101": _food101,
    "imagenet": _imagenet,
    "vtab1k": _vtab1k,
}
