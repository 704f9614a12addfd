"""The sets evaluation reads, and the checks every loader of them shares.

A ``RetrievalSet`` (images, captions, which image each caption describes) and a ``ClassificationSet``
(labelled images and their class names) hold their images as an ``ImageSource``: opened lazily and in order,
each image file or shard member within ``max_bytes``. The loaders of ``eval/datasets.py`` and
``eval/released.py`` build them with ``resolve_images``, ``read_classnames`` and the shard readers here: a
missing image, an unreadable one or an empty class list is an error naming it, never a smaller set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from openalign.data.sources import (
    DEFAULT_MAX_ANNOTATION_BYTES,
    DEFAULT_MAX_FILE_BYTES,
    BadInput,
    image_member,
    read_annotation_json,
    read_annotation_text,
    read_file,
    read_samples,
)


def _decode(data: bytes, where: str) -> Image.Image:
    from openalign.data.transforms import BadImage, decode_image

    try:
        return decode_image(data)
    except BadImage as err:
        raise ValueError(f"{where}: unreadable image ({err})") from None


def open_image(path: str | Path, *, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> Image.Image:
    """An RGB image from a file; a missing, undecodable or too large (``max_bytes``) file, or one that is not a
    regular file, is an error naming the path."""
    try:
        data = read_file(path, max_bytes=max_bytes)
    except BadInput as err:
        if err.reason == "missing_file":
            raise FileNotFoundError(f"{path}: image file not found") from None
        raise ValueError(f"{path}: cannot read image ({err.detail.removeprefix(f'{path}: ')})") from None
    return _decode(data, str(path))


class ImageSource(Sequence):
    """The images of an eval set, opened lazily and in order each time it is iterated (a Sequence, so
    progress bars know the total; indexing a shard-backed source re-reads its shards)."""

    def __init__(
        self,
        names: Sequence[str],
        opener: Callable[[], Iterator[Image.Image]],
        *,
        max_bytes: int = DEFAULT_MAX_FILE_BYTES,
    ):
        self.names = list(names)  # a path or shard key per image, for messages and reports
        self._opener = opener
        self._paths: list[Path] | None = None
        self.max_bytes = max_bytes  # the largest image file or shard member read

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, index: int) -> Image.Image:  # type: ignore[override]
        if isinstance(index, slice):
            raise TypeError("ImageSource does not support slicing")
        index = range(len(self))[index]
        if self._paths is not None:
            return open_image(self._paths[index], max_bytes=self.max_bytes)
        for i, image in enumerate(self._opener()):
            if i == index:
                return image
        raise IndexError(index)

    def __iter__(self) -> Iterator[Image.Image]:
        count = 0
        for image in self._opener():
            count += 1
            yield image
        if count != len(self.names):
            raise ValueError(f"expected {len(self.names)} images, read {count}; did the files change?")

    @classmethod
    def from_files(cls, paths: Sequence[str | Path], *, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> ImageSource:
        files = [Path(p) for p in paths]

        def opener() -> Iterator[Image.Image]:
            return (open_image(p, max_bytes=max_bytes) for p in files)

        source = cls([str(p) for p in files], opener, max_bytes=max_bytes)
        source._paths = files
        return source

    @classmethod
    def from_shards(
        cls, urls: Sequence[str], keys: Sequence[tuple[str, str]], *, max_bytes: int = DEFAULT_MAX_FILE_BYTES
    ) -> ImageSource:
        """Images stored in WebDataset shards, named by (url, key); the shards are re-read on iteration."""
        wanted = list(keys)

        def opener() -> Iterator[Image.Image]:
            it = iter(wanted)
            expected = next(it, None)
            for sample in read_shards(urls, max_bytes):
                if expected is None:
                    return
                if (sample["__url__"], sample["__key__"]) != expected:
                    continue  # a sample without an image or label, skipped the same way on the first pass
                yield _decode(sample[required_image_member(sample)], f"{sample['__url__']}:{sample['__key__']}")
                expected = next(it, None)
            if expected is not None:
                raise ValueError(f"{expected[0]}: sample {expected[1]!r} disappeared between reads")

        return cls([f"{u}:{k}" for u, k in wanted], opener, max_bytes=max_bytes)


def read_shards(urls: Sequence[str], max_bytes: int) -> Iterator[dict]:
    errors: list[str] = []

    def on_error(reason: str, detail: str) -> None:
        errors.append(f"{reason}: {detail}")

    for url in urls:
        yield from read_samples(url, on_error=on_error, max_member_bytes=max_bytes)
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise ValueError(f"{url}: unreadable evaluation shard: {errors[0]}{more}")


def required_image_member(sample: dict) -> str:
    ext = image_member(sample)
    if ext is not None:
        return ext
    members = ", ".join(k for k in sample if not k.startswith("__"))
    raise ValueError(f"{sample['__url__']}: sample {sample['__key__']!r} has no image member (has: {members})")


def resolve_images(paths: list[list[Path]], where: str) -> list[Path]:
    """The first existing candidate path of every image; every missing one is reported by its first candidate."""
    found, missing = [], []
    for candidates in paths:
        hit = next((p for p in candidates if p.is_file()), None)
        if hit is None:
            missing.append(candidates[0])
        found.append(hit or candidates[0])
    if missing:
        more = f" ({len(missing)} of {len(paths)} images missing)" if len(missing) > 1 else ""
        raise FileNotFoundError(f"{missing[0]}: image file not found, listed in {where}{more}")
    return found


@dataclass
class RetrievalSet:
    """Images, captions and which image each caption describes (``text_image_ids[j]``): what
    :func:`evaluate_retrieval` reads. ``images`` are PIL images or transformed tensors, in a list or a lazily
    opened :class:`ImageSource`; every image needs at least one caption."""

    images: Sequence[Any]
    captions: list[str]
    text_image_ids: list[int]
    name: str = "retrieval"

    def __post_init__(self) -> None:
        n = len(self.images)
        if not n:
            raise ValueError(f"{self.name}: the retrieval set has no images")
        if len(self.captions) != len(self.text_image_ids):
            raise ValueError(
                f"{self.name}: {len(self.captions)} captions but {len(self.text_image_ids)} text_image_ids"
            )
        counts = [0] * n
        for j, i in enumerate(self.text_image_ids):
            if not 0 <= i < n:
                raise ValueError(f"{self.name}: caption {j} describes image {i}, outside [0, {n})")
            counts[i] += 1
        lonely = [i for i, c in enumerate(counts) if c == 0]
        if lonely:
            names = getattr(self.images, "names", None)
            first = names[lonely[0]] if names is not None else f"#{lonely[0]}"
            raise ValueError(f"{self.name}: image {first} has no caption ({len(lonely)} such images)")


@dataclass
class ClassificationSet:
    """Labelled images; ``labels[i]`` indexes ``classnames``. ``class_ids`` are the folder names, WordNet
    ids or indices the classes were found under (used to match classes across a train and a val set)."""

    name: str
    classnames: list[str]
    class_ids: list[str]
    labels: list[int]
    images: ImageSource
    skipped_files: list[str] = field(default_factory=list)  # non-image files in class folders (sidecars aside)

    def __post_init__(self) -> None:
        if not self.classnames:
            raise ValueError(f"{self.name}: the class list is empty")
        if not len(self.images):
            raise ValueError(f"{self.name}: no images in any of the {len(self.classnames)} classes")


def read_classnames(path: str | Path, *, max_annotation_bytes: int = DEFAULT_MAX_ANNOTATION_BYTES) -> list[str]:
    """Class names, one per line in label order (``classnames.txt``), or a JSON list."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no such class names file")
    if p.suffix == ".json":
        names = read_annotation_json(p, max_bytes=max_annotation_bytes)
        if not isinstance(names, list):
            raise ValueError(f"{path}: a JSON class names file is a list of names")
    else:
        names = [line.strip() for line in read_annotation_text(p, max_bytes=max_annotation_bytes).splitlines()]
    names = [str(n).strip() for n in names if str(n).strip()]
    if not names:
        raise ValueError(f"{path}: the class names file is empty")
    return names
