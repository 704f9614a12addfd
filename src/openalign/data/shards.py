"""WebDataset shards in the img2dataset layout: ``00000.tar`` holding ``key.jpg`` / ``key.txt`` / ``key.json``
next to ``00000.parquet`` (the json of every sample in the tar, one row each) and ``00000_stats.json``.

As in img2dataset, ``width``/``height`` are the size of the JPEG in the tar and ``original_width``/
``original_height`` the size of the image before this writer resized it: the crawl's sizes when the
metadata brings them (its ``original_width``/``original_height``, else its ``width``/``height``, as a
crawl table states them), else the size of the image it was given.

Shards are read, and shard lists expanded, by ``openalign.data.sources`` (re-exported here): reading never
raises mid-stream, because one bad file in a million must not stop a training run. Writing is deterministic
(members sorted, fixed mtime and owner), so the same samples always give byte-identical shards, and each tar
appears under its final name only once it is complete, so an interrupted job never leaves a half-written
shard behind.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import io
import json
import logging
import math
import os
import re
import tarfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from openalign.data.sources import (
    CAPTION_MEMBER,
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_FILE_MB,
    IMAGE_MEMBER,
    METADATA_MEMBER,
    BadInput,
    ErrorHandler,
    Source,
    expand_urls,
    file_limit,
    iter_samples,
    open_source,
    read_samples,
    split_member_name,
)
from openalign.data.transforms import BadImage, decode_image
from openalign.outputs import check_writable

log = logging.getLogger(__name__)

__all__ = [
    "ErrorHandler",
    "ShardResult",
    "SkipSample",
    "expand_urls",
    "iter_samples",
    "read_samples",
    "read_stats",
    "samples_from_folder",
    "samples_from_source",
    "samples_from_table",
    "shard_input",
    "split_member_name",
    "write_shards",
]

# A fixed timestamp (the first second of 2021, UTC) rather than 0, which some archive tools display as a warning.
FIXED_MTIME = 1_609_459_200
_JPEG_MAGIC = b"\xff\xd8\xff"
_EXT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


# --------------------------------------------------------------------------------------------------
# Writing


class SkipSample(BadInput):
    """A sample the writer cannot store; ``reason`` is counted in the shard's stats."""


def _jsonable(value: Any) -> Any:
    """Metadata rows carry numpy scalars, NaN and timestamps; JSON gets plain values (NaN becomes null)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        return _jsonable(value.item())  # numpy scalar
    if hasattr(value, "tolist"):
        return _jsonable(value.tolist())  # numpy array
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if isinstance(value, bytes):
        raise TypeError("raw bytes cannot go into JSON")
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def _encode_image(value: Any, max_side: int | None, quality: int) -> tuple[bytes, tuple[int, int], tuple[int, int]]:
    """JPEG bytes, original (w, h) and written (w, h). JPEG input needing no resize is kept byte for byte."""
    if value is None:
        raise SkipSample("missing_image", "no image")
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        image = decode_image(data)  # raises BadImage with a reason
        passthrough = data.startswith(_JPEG_MAGIC)
    elif isinstance(value, Image.Image):
        data, image, passthrough = b"", _rgb(value), False
        if min(image.size) < 1:
            raise SkipSample("too_small", f"{image.size[0]}x{image.size[1]}")
    else:
        raise SkipSample("missing_image", f"image is a {type(value).__name__}, not bytes or a PIL image")
    original = image.size
    if max_side is not None and max(original) > max_side:
        scale = max_side / max(original)
        size = (max(1, round(original[0] * scale)), max(1, round(original[1] * scale)))
        image = image.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)
        passthrough = False
    if passthrough:
        return data, original, original
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue(), original, image.size


def _encode_sample(sample: dict, max_side: int | None, quality: int) -> tuple[str, dict[str, bytes]]:
    key = sample.get("key")
    if not isinstance(key, str) or not key or "." in key or "/" in key or "\\" in key:
        raise SkipSample("bad_key", f"key {key!r} must be a non-empty string without '.', '/' or '\\'")
    try:
        jpg, original, written = _encode_image(sample.get(IMAGE_MEMBER), max_side, quality)
    except BadImage as err:
        raise SkipSample(err.reason, f"{key}: {err}") from err
    members: dict[str, bytes] = {IMAGE_MEMBER: jpg}
    text = sample.get(CAPTION_MEMBER)
    if text is not None:
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as err:
                raise SkipSample("bad_text", f"{key}: caption is not UTF-8") from err
        members[CAPTION_MEMBER] = str(text).encode("utf-8")
    meta = dict(sample.get(METADATA_MEMBER) or {})
    # img2dataset's fields. width/height describe the JPEG stored here, so the caller's (a crawl table's
    # sizes, or an earlier img2dataset's resized copy) cannot stand; the crawl's sizes are kept as the
    # originals, which is what filtering reads.
    if meta.get("original_width") is None or meta.get("original_height") is None:
        if meta.get("width") is not None and meta.get("height") is not None:
            original = (meta["width"], meta["height"])
        meta["original_width"], meta["original_height"] = original
    meta["width"], meta["height"] = written
    meta.setdefault("key", key)
    if text is not None:
        meta.setdefault("caption", str(text))
    meta.setdefault("status", "success")
    try:
        members[METADATA_MEMBER] = json.dumps(_jsonable(meta), sort_keys=True, ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError) as err:
        raise SkipSample("bad_json", f"{key}: {err}") from err
    for ext, value in sample.items():
        if ext in ("key", IMAGE_MEMBER, CAPTION_MEMBER, METADATA_MEMBER):
            continue
        if not isinstance(ext, str) or not _EXT.match(ext):
            raise SkipSample("bad_member", f"{key}: extension {ext!r} is not a plain name")
        if isinstance(value, bytes):
            members[ext] = value
        elif isinstance(value, str):
            members[ext] = value.encode("utf-8")
        elif isinstance(value, dict):
            members[ext] = json.dumps(_jsonable(value), sort_keys=True, ensure_ascii=False).encode("utf-8")
        else:
            raise SkipSample("bad_member", f"{key}: {ext} is a {type(value).__name__}, not bytes, str or dict")
    return key, members


def _add_member(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = FIXED_MTIME
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tf.addfile(info, io.BytesIO(data))


class _Shard:
    """One tar being filled: written under a temporary name, renamed once closed."""

    def __init__(self, out_dir: Path, name: str):
        self.path = out_dir / f"{name}.tar"
        self.parquet_path = out_dir / f"{name}.parquet"
        self.stats_path = out_dir / f"{name}_stats.json"
        self.tmp = out_dir / f".{name}.tar.tmp"
        self.tf: tarfile.TarFile | None = None
        self.keys: set[str] = set()
        self.rows: list[dict[str, Any]] = []  # each sample's json, in tar order
        self.failures: Counter[str] = Counter()
        self.image_bytes = 0
        self.start = time.time()

    def add(self, key: str, members: dict[str, bytes]) -> None:
        if self.tf is None:
            self.tf = tarfile.open(self.tmp, "w", format=tarfile.PAX_FORMAT)  # noqa: SIM115 - closed in close()
        for ext in sorted(members):
            _add_member(self.tf, f"{key}.{ext}", members[ext])
        self.keys.add(key)
        self.rows.append(json.loads(members[METADATA_MEMBER]))
        self.image_bytes += len(members[IMAGE_MEMBER])

    def close(self) -> Path | None:
        if self.tf is not None:
            self.tf.close()
            _write_rows(self.rows, self.parquet_path)
            os.replace(self.tmp, self.path)
        stats = {
            "shard": self.path.name if self.tf is not None else None,
            "count": len(self.keys) + sum(self.failures.values()),
            "successes": len(self.keys),
            "failed": sum(self.failures.values()),
            "failures": dict(sorted(self.failures.items())),
            "bytes": self.path.stat().st_size if self.tf is not None else 0,
            "image_bytes": self.image_bytes,
            "duration": round(time.time() - self.start, 3),
        }
        if stats["count"]:
            self.stats_path.write_text(json.dumps(stats, indent=2) + "\n")
        return self.path if self.tf is not None else None


# img2dataset's columns first; the caller's other metadata follows in order of appearance.
_PARQUET_FIRST = ("key", "caption", "url", "width", "height", "original_width", "original_height", "status")


def _column(values: list[Any]) -> Any:
    """One Parquet column from json values. Objects, lists and columns that mix kinds are stored as JSON
    text (a string stays itself): one sample's odd metadata must not cost the shard its table."""
    import pyarrow as pa

    if not any(isinstance(v, dict | list) for v in values):
        try:
            return pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            pass
    dumps = functools.partial(json.dumps, sort_keys=True, ensure_ascii=False)
    as_text = [v if v is None or isinstance(v, str) else dumps(v) for v in values]
    return pa.array(as_text, pa.string())


def _write_rows(rows: list[dict[str, Any]], path: Path) -> None:
    """The shard's table, one row per sample in tar order, written under a temporary name and renamed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = [n for n in _PARQUET_FIRST if any(n in r for r in rows)]
    names += list(dict.fromkeys(k for r in rows for k in r if k not in _PARQUET_FIRST))
    table = pa.table({n: _column([r.get(n) for r in rows]) for n in names})
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def write_shards(
    samples: Iterable[dict | BadInput],
    out_dir: str | os.PathLike,
    *,
    samples_per_shard: int = 1000,
    prefix: str = "",
    max_side: int | None = None,
    jpeg_quality: int = 95,
    progress: bool = False,
) -> list[Path]:
    """Write samples ``{"key", "jpg", "txt", "json", ...}`` into img2dataset-style WebDataset shards.

    ``jpg`` is encoded bytes (any format PIL reads) or a PIL image; it is stored as JPEG, downscaled so its
    longer side is at most ``max_side`` when given; JPEG bytes that need no resize are stored unchanged.
    ``txt`` is the caption; ``json`` the metadata, to which img2dataset's ``key``, ``caption`` and
    ``status`` (``success``) are added where absent, and ``width``/``height`` (the stored JPEG's) and
    ``original_width``/``original_height`` (see the module docstring) always. Other keys become extra
    members (bytes as they are, str as UTF-8, dict as JSON). Each tar gets its table,
    ``{prefix}00000.parquet``: every stored sample's json, one row each, in tar order. A sample that
    cannot be stored is skipped and counted by reason in the stats file of the shard being filled
    (``{prefix}00000_stats.json``: count, successes, failed, failures by reason, bytes, image_bytes,
    duration); an item that is a ``SkipSample`` (a sample that failed before reaching the writer) is
    counted the same way. Returns the tar paths.
    """
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be at least 1, got {samples_per_shard}")
    if not 1 <= jpeg_quality <= 100:
        raise ValueError(f"jpeg_quality must be in 1..100, got {jpeg_quality}")
    if max_side is not None and max_side < 1:
        raise ValueError(f"max_side must be at least 1, got {max_side}")
    if "/" in prefix or "\\" in prefix:
        raise ValueError(f"prefix {prefix!r} must not contain a path separator")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    index = 0
    shard = _Shard(out, f"{prefix}{index:05d}")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc="shard", unit="img", dynamic_ncols=True)
    try:
        for sample in samples:
            if bar is not None:
                bar.update(1)
            if isinstance(sample, BadInput):  # failed upstream (e.g. a missing file): counted here
                shard.failures[sample.reason] += 1
                continue
            try:
                if not isinstance(sample, dict):
                    raise SkipSample("bad_sample", f"a {type(sample).__name__}, not a dict")
                key, members = _encode_sample(sample, max_side, jpeg_quality)
                if key in shard.keys:
                    raise SkipSample("duplicate_key", f"{key} already in this shard")
            except SkipSample as err:
                shard.failures[err.reason] += 1
                log.debug("skipped sample: %s", err)
                continue
            shard.add(key, members)
            if len(shard.keys) >= samples_per_shard:
                path = shard.close()
                if path is not None:
                    written.append(path)
                index += 1
                shard = _Shard(out, f"{prefix}{index:05d}")
        path = shard.close()
        if path is not None:
            written.append(path)
    finally:
        if bar is not None:
            bar.close()
        if shard.tf is not None and not shard.tf.closed:  # type: ignore[attr-defined]  # typeshed lacks it
            # interrupted: drop the partial shard
            shard.tf.close()
            shard.tmp.unlink(missing_ok=True)
    return written


@dataclass(frozen=True)
class ShardResult:
    """Totals over a folder's ``{prefix}NNNNN_stats.json`` files: what ``shard_input`` and ``read_stats`` return."""

    shards: int  # tar files written
    count: int  # samples offered to the writer: successes + failed
    successes: int  # samples written
    failed: int  # samples skipped
    bytes: int  # size of the tar files
    failures: dict[str, int]  # skipped samples by reason, sorted by reason

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def shard_samples(tar: str | os.PathLike) -> int | None:
    """The samples a shard records it holds: ``successes`` of its ``{name}_stats.json`` (as ``openalign shard``
    and img2dataset write it beside ``{name}.tar``), else the rows of its ``{name}.parquet``; None without
    either (or when they cannot be read)."""
    base = os.fspath(tar).removesuffix(".tar")
    try:
        return int(json.loads(Path(f"{base}_stats.json").read_text(encoding="utf-8"))["successes"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(f"{base}.parquet").metadata.num_rows)
    except (OSError, ValueError):
        return None


def read_stats(out_dir: str | os.PathLike, prefix: str = "") -> ShardResult:
    """Totals over every ``{prefix}NNNNN_stats.json`` in ``out_dir``: shards, count, successes, failed, bytes,
    failures."""
    totals = dict.fromkeys(("shards", "count", "successes", "failed", "bytes"), 0)
    failures: Counter[str] = Counter()
    pattern = re.compile(rf"^{re.escape(prefix)}\d+_stats\.json$")
    for path in sorted(Path(out_dir).iterdir()):
        if not pattern.match(path.name):
            continue
        stats = json.loads(path.read_text())
        totals["shards"] += 1 if stats.get("shard") else 0
        for field in ("count", "successes", "failed", "bytes"):
            totals[field] += int(stats.get(field, 0))
        failures.update(stats.get("failures", {}))
    return ShardResult(**totals, failures=dict(sorted(failures.items())))


# --------------------------------------------------------------------------------------------------
# Inputs for ``openalign shard``


def samples_from_source(source: Source) -> Iterator[dict | SkipSample]:
    """The writer's samples from any input ``open_source`` recognises, skipped items included (so they are
    counted in the shard being filled). A folder's images are keyed by their running index, with their
    path relative to the folder kept as ``filename``; an image without a caption is ``missing_caption``."""
    for event in source.events():
        if isinstance(event, BadInput):
            yield SkipSample(event.reason, event.detail)
            continue
        if event.caption is None:
            yield SkipSample("missing_caption", f"{event.origin}: {event.key}")
            continue
        try:
            meta = event.metadata()
            if event.kind == "folder":
                meta["filename"] = event.key
            data = event.read()
        except BadInput as err:
            yield SkipSample(err.reason, err.detail)
            continue
        key = f"{event.index:09d}" if event.kind == "folder" else event.key
        yield {"key": key, IMAGE_MEMBER: data, CAPTION_MEMBER: event.caption, METADATA_MEMBER: meta}


def samples_from_table(
    path: str | os.PathLike,
    *,
    image_root: str | os.PathLike | None = None,
    caption_column: str | None = None,
    image_column: str | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    allow_outside_root: bool = False,
) -> Iterator[dict | SkipSample]:
    """Samples from a metadata table whose rows hold image bytes (a binary column, or a ``{"bytes": ...}``
    struct as Hugging Face datasets store images) or point to image files (``image_path``, relative paths
    resolved against ``image_root``, default the table's folder; a path resolving outside it is skipped as
    ``outside_root`` unless ``allow_outside_root``). Every other column goes into the json.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"no such table: {path}")
    source = open_source(
        path,
        image_root=image_root,
        caption_column=caption_column,
        image_column=image_column,
        require_caption=True,
        max_file_bytes=max_file_bytes,
        allow_outside_root=allow_outside_root,
    )
    return samples_from_source(source)


def samples_from_folder(
    folder: str | os.PathLike,
    *,
    captions: str | os.PathLike | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> Iterator[dict | SkipSample]:
    """Samples from a folder of images (searched recursively, in sorted order) whose captions are sidecar
    ``.txt`` files (``cat.jpg`` + ``cat.txt``) or rows of a ``captions`` table keyed by the path relative to
    the folder or the file name. A sidecar ``.json`` becomes the metadata. Keys are the running index; the
    relative path is kept as ``filename``. An image without a caption is skipped as ``missing_caption``.
    """
    if not Path(folder).is_dir():
        raise FileNotFoundError(f"no such folder: {folder}")
    return samples_from_source(open_source(folder, captions=captions, max_file_bytes=max_file_bytes))


def shard_input(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    samples_per_shard: int = 1000,
    max_side: int | None = None,
    jpeg_quality: int = 95,
    prefix: str = "",
    captions: str | os.PathLike | None = None,
    image_root: str | os.PathLike | None = None,
    caption_column: str | None = None,
    image_column: str | None = None,
    max_file_mb: float = DEFAULT_MAX_FILE_MB,
    allow_outside_root: bool = False,
    progress: bool = False,
) -> ShardResult:
    """Write ``source`` (an image folder, a Parquet/CSV/JSONL table with image bytes or ``image_path``, or
    WebDataset shards to re-shard; see ``openalign.data.sources.open_source``) as WebDataset shards in
    ``out_dir``; returns the totals of the shards' stats files. Files over ``max_file_mb`` and anything
    that is not a regular file are skipped unread (``too_large_file``, ``too_large_member``, ``not_a_file``),
    as are a table's image paths outside ``image_root`` (``outside_root``) unless ``allow_outside_root``."""
    out = Path(out_dir)
    check_writable(out, directory=True)
    samples = samples_from_source(
        open_source(
            source,
            captions=captions,
            image_root=image_root,
            caption_column=caption_column,
            image_column=image_column,
            require_caption=True,
            max_file_bytes=file_limit(max_file_mb),
            allow_outside_root=allow_outside_root,
        )
    )
    if out.is_dir() and any(out.glob(f"{glob.escape(prefix)}[0-9]*.tar")):
        raise ValueError(f"{out} already holds {prefix}NNNNN.tar shards; choose an empty folder or another --prefix")
    created = not out.exists()
    try:
        write_shards(
            samples,
            out,
            samples_per_shard=samples_per_shard,
            prefix=prefix,
            max_side=max_side,
            jpeg_quality=jpeg_quality,
            progress=progress,
        )
    except BaseException:
        if created and out.is_dir() and not any(out.iterdir()):  # an input that failed before its first shard
            out.rmdir()
        raise
    return read_stats(out, prefix=prefix)
