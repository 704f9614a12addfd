"""What the pipeline reads: the one place that knows inputs.

Every stage that takes images (``shard``, ``dedup``, ``index build``, eval's folder and shard sets, the
training stream) and every reader of captions (``vocab``) goes through this module, so they accept exactly
the same inputs and name a skipped item with the same reason:

- **names**: which file suffixes are images (``IMAGE_SUFFIXES``, case-insensitive), which WebDataset
  members hold a sample's image, caption and metadata (``IMAGE_MEMBERS``, ``CAPTION_MEMBER``,
  ``METADATA_MEMBER``), the sidecar files beside an image in a folder, the columns of a table, and the files
  of a saved tokenizer (``TOKENIZER_FILES``; ``find_tokenizer_file`` prefers ``tokenizer.json``);
- **shard lists**: ``expand_urls`` turns brace ranges, globs, comma / ``::`` lists and folders of tars into
  shard urls, and ``read_samples`` / ``iter_samples`` read WebDataset tars without ever raising mid-stream;
- **one reader**: ``open_source`` recognises an image folder (recursive), a table (Parquet, CSV/TSV, JSON
  lines with image bytes or an ``image_path`` column) or WebDataset shards, and ``Source.records`` yields
  uniform ``Record`` s (key, image bytes read on demand, caption if any, metadata); ``decode_records`` and
  ``batched`` turn them into decoded images and batches. CSV/TSV is read strictly
  (``openalign.data.tables``): a record that does not parse is an error naming its line, and a caption
  column that is not text (an int or list column) is an error naming it, never a string made of it.

Items that cannot be used are never raised mid-stream: they are reported as ``BadInput`` (a reason slug
plus a detail), either through an ``on_skip(reason, detail)`` callback or in the stream itself
(``Source.events``), so the caller counts them. Every file read of an input goes through ``read_file`` and
every table path through ``ImageRoot``, the two places that bound what an input can make a stage read:

- ``read_file`` reads regular files only (``not_a_file``: a device such as ``/dev/zero``, a FIFO, a folder)
  of at most ``max_bytes`` (``too_large_file``; default ``DEFAULT_MAX_FILE_MB``), checked before reading and
  again while reading, so no input file can drive a stage out of memory; a WebDataset member whose header
  claims more than the limit is skipped unread (``too_large_member``), and a PAX or GNU long-name header
  claiming more than ``MAX_TAR_HEADER_BYTES`` ends its shard unread (``too_large_header``);
- ``ImageRoot`` keeps a table's ``image_path`` inside its image root once symlinks are resolved
  (``outside_root``: an absolute path elsewhere, a ``..`` escape, a symlink pointing out), because a table
  is data, often from someone else, and must not be able to pick files such as ``~/.ssh/id_rsa`` to be packed
  into shards or an index; ``allow_outside_root`` lifts this for tables one trusts.

This module is model-free and torch-free at import: decoding pulls in ``openalign.data.transforms`` only
when an image is actually decoded.
"""

from __future__ import annotations

import glob
import io
import json
import logging
import os
import re
import stat
import subprocess
import tarfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal, Protocol, TypeVar

from openalign.data.bad_input import BadInput

if TYPE_CHECKING:
    from PIL import Image

log = logging.getLogger(__name__)

__all__ = [
    "CAPTION_COLUMNS",
    "CAPTION_MEMBER",
    "CAPTION_SUFFIX",
    "CAPTION_TEXT_SUFFIXES",
    "DEFAULT_MAX_ANNOTATION_BYTES",
    "DEFAULT_MAX_ANNOTATION_MB",
    "DEFAULT_MAX_FILE_BYTES",
    "DEFAULT_MAX_FILE_MB",
    "FILENAME_COLUMNS",
    "IMAGE_BYTES_COLUMNS",
    "IMAGE_MEMBER",
    "IMAGE_MEMBERS",
    "IMAGE_PATH_COLUMN",
    "IMAGE_SUFFIXES",
    "METADATA_MEMBER",
    "METADATA_SUFFIX",
    "SHARD_SUFFIXES",
    "SPECIAL_TOKENS_MAP",
    "TABLE_SUFFIXES",
    "TOKENIZER_CONFIG",
    "TOKENIZER_FILES",
    "TOKENIZER_JSON",
    "TOKENIZER_VOCAB_FILES",
    "VOCAB_TXT",
    "BadInput",
    "ErrorHandler",
    "FolderScan",
    "ImageRoot",
    "Record",
    "Source",
    "SourceKind",
    "annotation_limit",
    "batched",
    "check_annotation",
    "decode_records",
    "expand_urls",
    "file_limit",
    "find_tokenizer_file",
    "image_member",
    "is_image_file",
    "iter_samples",
    "open_source",
    "read_annotation",
    "read_annotation_json",
    "read_annotation_text",
    "read_caption_table",
    "read_file",
    "read_file_head",
    "read_samples",
    "read_table_batches",
    "resolve_image_path",
    "scan_folder",
    "sniff_image_format",
    "split_member_name",
    "table_format",
]

# --------------------------------------------------------------------------------------------------
# Names

# Image files of a folder, compared lower-cased (``.JPG`` is an image too).
IMAGE_SUFFIXES: frozenset[str] = frozenset(
    {".jpg", ".jpeg", ".jfif", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm"}
)
# WebDataset members that hold a sample's image, in order of preference (the first one present is the image).
# Member extensions are compared lower-cased (see ``split_member_name``).
IMAGE_MEMBERS: tuple[str, ...] = ("jpg", "jpeg", "png", "webp", "jfif", "bmp", "gif", "tif", "tiff", "ppm", "image")
IMAGE_MEMBER = "jpg"  # the member the shard writer stores every image as (always JPEG)
CAPTION_MEMBER = "txt"  # a sample's caption (UTF-8; CLIP_benchmark retrieval sets put one caption per line)
METADATA_MEMBER = "json"  # a sample's metadata (img2dataset: url, caption, width, height, ...)
# Files beside ``cat.jpg`` in an image folder: ``cat.txt`` is its caption, ``cat.json`` its metadata.
CAPTION_SUFFIX = ".txt"
METADATA_SUFFIX = ".json"
SHARD_SUFFIXES: tuple[str, ...] = (".tar", ".tgz", ".tar.gz")

# Tables: format by suffix (a trailing ``.gz`` is part of it).
TABLE_SUFFIXES: Mapping[str, str] = {
    ".parquet": "parquet",
    ".csv": "csv",
    ".tsv": "csv",
    ".csv.gz": "csv",
    ".tsv.gz": "csv",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".jsonl.gz": "jsonl",
}
CAPTION_TEXT_SUFFIXES: tuple[str, ...] = (".txt", ".text")  # a plain list of captions, one per line
CAPTION_COLUMNS: tuple[str, ...] = ("caption", "text", "alt", "alt_text", "txt", "TEXT")
IMAGE_BYTES_COLUMNS: tuple[str, ...] = ("jpg", "image", "image_bytes", "img", "bytes", "png", "webp")
IMAGE_PATH_COLUMN = "image_path"  # a table row's image file, relative to the image root
FILENAME_COLUMNS: tuple[str, ...] = ("filename", "file", "image", "path", "image_path")  # captions tables

# A saved tokenizer: the file that defines it, in order of preference, then the files that describe it.
TOKENIZER_JSON = "tokenizer.json"  # Hugging Face tokenizers' format (preferred)
VOCAB_TXT = "vocab.txt"  # BERT's one-wordpiece-per-line vocabulary
TOKENIZER_CONFIG = "tokenizer_config.json"  # transformers' settings (do_lower_case, model_max_length, ...)
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
TOKENIZER_VOCAB_FILES: tuple[str, ...] = (TOKENIZER_JSON, VOCAB_TXT)
TOKENIZER_FILES: tuple[str, ...] = (*TOKENIZER_VOCAB_FILES, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)

# The largest input file (an image, a sidecar, a shard member) any stage reads into memory. The largest
# images of web crawls are a few MB; 64 MB leaves room for big TIFFs and PNGs while a few of them at once
# still fit a small machine.
DEFAULT_MAX_FILE_MB = 64.0
DEFAULT_MAX_FILE_BYTES = int(DEFAULT_MAX_FILE_MB * 2**20)
# The largest annotation file read whole (a Karpathy or COCO captions JSON, a class list, a .mat, a key list,
# a JSON array of rows), decompressed size for a .gz. MSCOCO's Karpathy JSON, among the largest, is 150 MB.
DEFAULT_MAX_ANNOTATION_MB = 512.0
DEFAULT_MAX_ANNOTATION_BYTES = int(DEFAULT_MAX_ANNOTATION_MB * 2**20)
# The longest line of a JSON Lines table (one row); longer ones are skipped unread as malformed.
MAX_LINE_BYTES = DEFAULT_MAX_FILE_BYTES
_LINE_BUFFER = 1 << 20

ErrorHandler = Callable[[str, str], None]
SourceKind = Literal["folder", "table", "shards"]
T = TypeVar("T")


def is_image_file(path: str | os.PathLike) -> bool:
    """Whether a file name has an image suffix (case-insensitive)."""
    return Path(path).suffix.lower() in IMAGE_SUFFIXES


def image_member(sample: Mapping[str, Any], members: Sequence[str] = IMAGE_MEMBERS) -> str | None:
    """The member of a WebDataset sample that holds its image (the first of ``members`` present), or None."""
    return next((m for m in members if m in sample), None)


def find_tokenizer_file(path: str | os.PathLike) -> Path | None:
    """The tokenizer a path names: the file itself, or in a directory ``tokenizer.json`` before ``vocab.txt``."""
    p = Path(path)
    if p.is_dir():
        return next((p / name for name in TOKENIZER_VOCAB_FILES if (p / name).is_file()), None)
    return p if p.is_file() else None


def table_format(path: str | os.PathLike) -> str | None:
    """``"parquet"``, ``"csv"`` or ``"jsonl"`` from a table's suffix (``.csv.gz`` included), else None."""
    p = Path(path)
    suffix = "".join(p.suffixes[-2:]).lower() if p.suffix.lower() == ".gz" else p.suffix.lower()
    return TABLE_SUFFIXES.get(suffix)


def file_limit(max_file_mb: float) -> int:
    """``max_file_mb`` (a setting's value) in bytes; raises ``ValueError`` unless it is positive."""
    if isinstance(max_file_mb, bool) or not isinstance(max_file_mb, int | float) or not max_file_mb > 0:
        raise ValueError(f"max_file_mb must be a positive number of MB, got {max_file_mb!r}")
    return max(1, int(max_file_mb * 2**20))


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GB" if n >= 2**30 else f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n} bytes"


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _check_stat(path: str | os.PathLike, st: os.stat_result, max_bytes: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise BadInput("not_a_file", f"{path}: {_kind(st.st_mode)}, not a regular file")
    if st.st_size > max_bytes:
        raise BadInput("too_large_file", f"{path}: {_size(st.st_size)}, over the {_size(max_bytes)} limit")


def read_file(path: str | os.PathLike, *, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> bytes:
    """The bytes of an input file; raises ``BadInput`` instead of OSError or MemoryError: ``missing_file``,
    ``unreadable_file``, ``not_a_file`` (a device, FIFO, socket or directory, even behind a symlink) or
    ``too_large_file`` (over ``max_bytes``).

    The file is looked at before it is opened (opening a FIFO would wait for a writer, opening some devices
    has effects) and again once open, and never more than ``max_bytes`` + 1 bytes are read, so a file that
    is replaced or grows in between is still caught."""
    return _read(path, max_bytes, None)


def read_file_head(path: str | os.PathLike, size: int = 16, *, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> bytes:
    """The first ``size`` bytes of an input file (enough to tell its format), with ``read_file``'s checks:
    a file over ``max_bytes`` is refused as it would be when read whole."""
    return _read(path, max_bytes, size)


# Magic numbers at the start of an encoded image: what the bytes are, whatever the file is called.
_IMAGE_MAGIC: tuple[tuple[bytes, int, str], ...] = (
    (b"\xff\xd8\xff", 0, "jpeg"),
    (b"\x89PNG\r\n\x1a\n", 0, "png"),
    (b"GIF87a", 0, "gif"),
    (b"GIF89a", 0, "gif"),
    (b"WEBP", 8, "webp"),  # after RIFF and the chunk size
    (b"BM", 0, "bmp"),
    (b"II*\x00", 0, "tiff"),
    (b"MM\x00*", 0, "tiff"),
)
IMAGE_HEAD_BYTES = 16  # enough of a file for ``sniff_image_format``


def sniff_image_format(data: bytes) -> str | None:
    """``jpeg``, ``png``, ``gif``, ``webp``, ``bmp`` or ``tiff`` from an image's first bytes; None otherwise."""
    for magic, offset, name in _IMAGE_MAGIC:
        if data[offset : offset + len(magic)] == magic and (name != "webp" or data[:4] == b"RIFF"):
            return name
    return None


def _read(path: str | os.PathLike, max_bytes: int, head: int | None) -> bytes:
    try:
        _check_stat(path, os.stat(path), max_bytes)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise BadInput("missing_file", str(path)) from None
    except BadInput:
        raise
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path, which a table can hold
        raise BadInput("unreadable_file", f"{path!r}: {getattr(err, 'strerror', None) or err}") from None
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            _check_stat(path, st, max_bytes)
            if head is not None:
                return f.read(head)
            # The first read asks for one byte more than the size seen, so a regular file is read in one go
            # without a buffer of the limit's size; a file that grew since is read on, up to the limit.
            chunks, total, want = [], 0, min(st.st_size, max_bytes) + 1
            while chunk := f.read(want):
                chunks.append(chunk)
                total += len(chunk)
                if total > max_bytes:
                    raise BadInput("too_large_file", f"{path}: grew past the {_size(max_bytes)} limit while read")
                want = min(1 << 20, max_bytes + 1 - total)
    except OSError as err:
        raise BadInput("unreadable_file", f"{path}: {err.strerror or err}") from None
    return b"".join(chunks)


def annotation_limit(max_annotation_mb: float) -> int:
    """``max_annotation_mb`` (a setting's value) in bytes; raises ``ValueError`` unless it is positive."""
    if (
        isinstance(max_annotation_mb, bool)
        or not isinstance(max_annotation_mb, int | float)
        or not max_annotation_mb > 0
    ):
        raise ValueError(f"max_annotation_mb must be a positive number of MB, got {max_annotation_mb!r}")
    return max(1, int(max_annotation_mb * 2**20))


def check_annotation(path: str | os.PathLike, *, max_bytes: int = DEFAULT_MAX_ANNOTATION_BYTES) -> Path:
    """``path`` once ``stat`` shows a regular file of at most ``max_bytes``: for an annotation file that is read
    as a stream but kept whole in memory (a CSV of captions). Raises ``FileNotFoundError`` or a one-line
    ``ValueError`` naming ``max_annotation_mb``."""
    try:
        _check_stat(path, os.stat(path), max_bytes)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except BadInput as err:
        raise ValueError(_annotation_error(path, err)) from None
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: cannot read ({getattr(err, 'strerror', None) or err})") from None
    return Path(path)


def _annotation_error(path: str | os.PathLike, err: BadInput) -> str:
    detail = err.detail.removeprefix(f"{path}: ")
    if err.reason == "too_large_file":
        detail += " for annotation files (raise it with max_annotation_mb)"
    return f"{path}: cannot read ({detail})"


def read_annotation(path: str | os.PathLike, *, max_bytes: int = DEFAULT_MAX_ANNOTATION_BYTES) -> bytes:
    """The bytes of an annotation file read whole, a ``.gz`` one decompressed: at most ``max_bytes`` either way,
    so neither a huge file nor a gzip bomb can fill memory. Raises ``FileNotFoundError``, or a one-line
    ``ValueError`` naming the file, what is wrong and, for size, ``max_annotation_mb``."""
    try:
        data = read_file(path, max_bytes=max_bytes)
    except BadInput as err:
        if err.reason == "missing_file":
            raise FileNotFoundError(f"{path}: no such file") from None
        raise ValueError(_annotation_error(path, err)) from None
    if not str(path).lower().endswith(".gz"):
        return data
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip framing
    chunks: list[bytes] = []
    total = 0
    try:
        pending = data
        while pending:
            chunk = inflate.decompress(pending, max_bytes + 1 - total)
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                limit = f"{_size(max_bytes)} limit for annotation files (raise it with max_annotation_mb)"
                raise ValueError(f"{path}: cannot read (decompresses to more than the {limit})")
            pending = inflate.unconsumed_tail
            if inflate.eof:
                if not inflate.unused_data:
                    break
                # A concatenated gzip member (as ``cat a.gz b.gz`` makes) starts a new stream.
                pending, inflate = inflate.unused_data, zlib.decompressobj(16 + zlib.MAX_WBITS)
            elif not pending:
                raise ValueError(f"{path}: cannot read (the gzip stream ends early)")
    except zlib.error as err:
        raise ValueError(f"{path}: cannot read (not gzip data: {err})") from None
    return b"".join(chunks)


def read_annotation_text(path: str | os.PathLike, *, max_bytes: int = DEFAULT_MAX_ANNOTATION_BYTES) -> str:
    """``read_annotation`` decoded as UTF-8 (a byte-order mark dropped); bytes that are not are an error naming
    where."""
    data = read_annotation(path, max_bytes=max_bytes)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None


def read_annotation_json(path: str | os.PathLike, *, max_bytes: int = DEFAULT_MAX_ANNOTATION_BYTES) -> Any:
    """``read_annotation`` parsed as JSON; a file that does not parse is an error naming it."""
    text = read_annotation_text(path, max_bytes=max_bytes)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None


class ImageRoot:
    """A table's image root: the files its ``image_path`` values name, confined to it.

    Unless ``allow_outside_root``, a path is resolved (symlinks included) and must lie inside ``root``: an absolute
    path elsewhere, a ``..`` escape or a symlink pointing out raises ``BadInput("outside_root")``. The resolved path
    is what is returned, so the file checked is the file read. Resolving a path walks every one of its components;
    the folders already walked are remembered, so a table of millions of images in thousands of folders costs one
    ``lstat`` per image. Make one per pass over a table: a folder swapped for a symlink during the pass is seen by
    the next one."""

    _MAX_FOLDERS = 65_536

    def __init__(self, root: Path, *, allow_outside_root: bool = False) -> None:
        self.root = root
        self.allow_outside_root = allow_outside_root
        self._base: Path | None = None
        self._folders: dict[Path, Path] = {}

    def resolve(self, value: str) -> Path:
        file = Path(value)
        candidate = file if file.is_absolute() else self.root / file
        if self.allow_outside_root:
            return candidate
        try:
            if self._base is None:
                self._base = self.root.resolve()
            resolved = self._resolve(candidate)
        except (OSError, RuntimeError, ValueError) as err:  # a symlink loop, a NUL byte
            raise BadInput("unreadable_file", f"{value!r}: {err}") from None
        if not resolved.is_relative_to(self._base):
            raise BadInput("outside_root", f"{value}: resolves to {resolved}, outside the image root {self._base}")
        return resolved

    def _resolve(self, candidate: Path) -> Path:
        """``candidate.resolve()``, with its folder's resolution remembered."""
        if candidate.name in ("", ".", ".."):
            return candidate.resolve()
        folder = self._folders.get(candidate.parent)
        if folder is None:
            if len(self._folders) >= self._MAX_FOLDERS:
                self._folders.clear()
            folder = self._folders[candidate.parent] = candidate.parent.resolve()
        joined = folder / candidate.name
        try:
            link = stat.S_ISLNK(os.lstat(joined).st_mode)  # unlike Path.is_symlink, raises on a NUL byte
        except (FileNotFoundError, NotADirectoryError):
            link = False
        return joined.resolve() if link else joined


def resolve_image_path(root: Path, value: str, *, allow_outside_root: bool = False) -> Path:
    """The file a table's image path names, confined to ``root`` (see ``ImageRoot``, which a pass over a whole
    table uses instead)."""
    return ImageRoot(root, allow_outside_root=allow_outside_root).resolve(value)


def batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """Consecutive lists of ``size`` items (the last one shorter)."""
    if size < 1:
        raise ValueError(f"batch size must be at least 1, got {size}")
    it = iter(items)
    while batch := list(islice(it, size)):
        yield batch


# --------------------------------------------------------------------------------------------------
# WebDataset member names

# webdataset's rule: the key is the path up to the first dot of the file name, the extension is the rest.
_MEMBER_NAME = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


def split_member_name(name: str) -> tuple[str, str] | None:
    """``"dir/000123.jpg"`` → ``("dir/000123", "jpg")``; ``None`` for a name without an extension."""
    match = _MEMBER_NAME.match(name.removeprefix("./"))
    if match is None:
        return None
    return match.group(1), match.group(2).lower()


# --------------------------------------------------------------------------------------------------
# Shard lists


def _split_top_level(spec: str) -> list[str]:
    """Split on "::" and on commas that are not inside braces (inside braces a comma is an alternative)."""
    parts: list[str] = []
    depth, start, i = 0, 0, 0
    while i < len(spec):
        ch = spec[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth = max(depth - 1, 0)
        elif depth == 0 and (ch == "," or spec.startswith("::", i)):
            parts.append(spec[start:i])
            i += 2 if ch == ":" else 1
            start = i
            continue
        i += 1
    parts.append(spec[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_braces(pattern: str) -> list[str]:
    """Bash-style brace expansion: ``{00..09}`` (zero padding kept), ``{a,b}``, nested and repeated groups."""
    start = pattern.find("{")
    if start < 0:
        return [pattern]
    depth = 0
    for end in range(start, len(pattern)):
        if pattern[end] == "{":
            depth += 1
        elif pattern[end] == "}":
            depth -= 1
            if depth == 0:
                break
    else:
        raise ValueError(f"unbalanced brace in shard pattern {pattern!r}")
    head, body, tail = pattern[:start], pattern[start + 1 : end], pattern[end + 1 :]
    match = _RANGE.match(body)
    if match:
        lo_s, hi_s = match.groups()
        lo, hi = int(lo_s), int(hi_s)
        padded = (len(lo_s) > 1 and lo_s.lstrip("-").startswith("0")) or (
            len(hi_s) > 1 and hi_s.lstrip("-").startswith("0")
        )
        width = max(len(lo_s), len(hi_s)) if padded else 0
        step = 1 if hi >= lo else -1
        choices = [str(v).zfill(width) for v in range(lo, hi + step, step)]
    else:
        choices = _split_alternatives(body)
    out: list[str] = []
    for choice in choices:
        for expanded in _expand_braces(head + choice + tail):
            out.append(expanded)
    return out


def _split_alternatives(body: str) -> list[str]:
    out, depth, start = [], 0, 0
    for i, ch in enumerate(body):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(body[start:i])
            start = i + 1
    out.append(body[start:])
    return out


def is_remote(url: str) -> bool:
    if url.startswith("pipe:"):
        return True
    return re.match(r"^[a-z][a-z0-9+.\-]*://", url) is not None and not url.startswith("file://")


def expand_urls(spec: str | Sequence[str]) -> list[str]:
    """Turn a shard specification into an ordered list of shard urls.

    Accepts brace ranges (``data/{00000..00009}.tar``), brace and top-level comma lists, ``::``-separated
    lists (webdataset's separator), globs (``data/*.tar``), a directory (its ``*.tar``/``*.tgz`` files),
    ``file://`` urls, ``pipe:COMMAND`` urls, or a sequence of any of these. Explicit paths that do not exist
    are kept, so that ``read_samples`` reports them; a glob or directory that matches nothing is an error.
    """
    if isinstance(spec, str | os.PathLike):
        text = os.fspath(spec)
        if os.path.exists(text) and not os.path.isdir(text):
            return [text]  # a real file whose name happens to contain a comma or braces
        parts = [text] if text.startswith("pipe:") else _split_top_level(text)
    else:
        parts = [os.fspath(s) for s in spec]
    if not parts:
        raise ValueError("empty shard specification")
    urls: list[str] = []
    for part in parts:
        if part.startswith("pipe:"):
            urls.append(part)
            continue
        for item in _expand_braces(part):
            item = item.removeprefix("file://")
            if is_remote(item):
                urls.append(item)
            elif os.path.isdir(item):
                shards = glob.glob(os.path.join(glob.escape(item), "*"))
                found = sorted(p for p in shards if p.endswith(SHARD_SUFFIXES))
                if not found:
                    raise FileNotFoundError(f"no .tar shards in directory {item}")
                urls.extend(found)
            elif glob.has_magic(item) and not os.path.exists(item):
                found = sorted(glob.glob(item))
                if not found:
                    raise FileNotFoundError(f"no shards match {item}")
                urls.extend(found)
            else:
                urls.append(item)
    return urls


# --------------------------------------------------------------------------------------------------
# Reading WebDataset tars


def _log_error(reason: str, detail: str) -> None:
    log.warning("skipped (%s): %s", reason, detail)


# The most a tar's metadata header (a PAX extended header, a GNU long name or long link) may hold. tarfile
# reads such a header whole, in one allocation of the size its header block claims, before it yields the
# member it describes; real ones hold a path and a few attributes, a few KB at most.
MAX_TAR_HEADER_BYTES = 1 << 20
_METADATA_HEADERS = frozenset(
    {tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE}
)


class _OversizedHeader(tarfile.TarError):
    """A tar metadata header over ``MAX_TAR_HEADER_BYTES``; not a ``HeaderError``, so that tarfile's
    ``ignore_zeros`` does not step over it (it would read on from inside the claimed header)."""


class _BoundedTarInfo(tarfile.TarInfo):
    """A ``TarInfo`` that refuses a metadata header claiming more than ``MAX_TAR_HEADER_BYTES`` before tarfile
    reads it, so a crafted shard cannot make a reader allocate the size it claims (a 2 GB PAX header)."""

    def _proc_member(self, archive: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _METADATA_HEADERS and self.size > MAX_TAR_HEADER_BYTES:
            raise _OversizedHeader(
                f"a {self.type.decode('ascii', 'replace')!r} header at offset {self.offset} claims "
                f"{_size(self.size)}, over the {_size(MAX_TAR_HEADER_BYTES)} limit; the rest of the shard is skipped"
            )
        member: tarfile.TarInfo = super()._proc_member(archive)  # type: ignore[misc]
        return member


class _Readable(Protocol):
    def read(self, size: int, /) -> bytes: ...

    def seek(self, pos: int, /) -> object: ...


def _scan(fileobj: _Readable, start: int, end: int | None) -> tuple[bool, int]:
    """Whether the bytes in [start, end) (to EOF when end is None) are all zero, and how many there are."""
    fileobj.seek(start)
    seen, zero = 0, True
    while end is None or start + seen < end:
        chunk = fileobj.read(1 << 20 if end is None else min(1 << 20, end - start - seen))
        if not chunk:
            break
        seen += len(chunk)
        zero = zero and chunk.count(0) == len(chunk)
    return zero, seen


def _iter_tar(
    tf: tarfile.TarFile, url: str, report: ErrorHandler, seekable: bool, max_member_bytes: int
) -> Iterator[dict]:
    """Group consecutive members by key into samples; drop a sample any of whose members is unreadable or
    larger than ``max_member_bytes`` (such a member is stepped over, never read)."""
    current: dict[str, Any] | None = None
    current_bad = False
    after_gap = False  # the member after a damaged region may start a sample that lost its first member
    expected = 0  # where the next header should start if nothing between members was damaged
    raw = tf.fileobj
    while True:
        try:
            member = tf.next()
        except _OversizedHeader as err:
            report("too_large_header", f"{url}: {err}")
            current_bad = True
            break
        except (tarfile.TarError, OSError, EOFError, zlib.error) as err:
            report("truncated", f"{url}: {err}")
            current_bad = True
            break
        if seekable and (member is None or member.offset > expected):
            # With ignore_zeros tarfile steps over blocks it cannot parse; non-zero skipped bytes were a header.
            zero, seen = _scan(raw, expected, None if member is None else member.offset)
            if not zero and member is None and seen < tarfile.BLOCKSIZE:
                report("truncated", f"{url}: the file ends inside a member header at offset {expected}")
                current_bad = True
            elif not zero and member is None and expected == 0:
                report("not_a_tar", f"{url}: no tar header found")
            elif not zero:
                where = "at the end" if member is None else f"before {member.name}"
                report("corrupt", f"{url}: unreadable bytes {where} (from offset {expected}) skipped")
                current_bad = after_gap = True
            elif member is None and seen < 2 * tarfile.BLOCKSIZE:
                # A complete tar ends with two zero blocks; without them the last member may be missing.
                report("truncated", f"{url}: no end-of-archive marker after offset {expected}")
                current_bad = True
        if member is None:
            break
        expected = tf.offset  # tarfile's own idea of where the next header starts
        if not member.isreg():
            continue
        parts = split_member_name(member.name)
        if parts is None:
            report("no_extension", f"{url}: member {member.name} has no extension")
            continue
        key, ext = parts
        if current is None or key != current["__key__"]:
            if current is not None and not current_bad:
                yield current
            current = {"__key__": key, "__url__": url}
            current_bad = after_gap
        after_gap = False
        if member.size > max_member_bytes:
            report(
                "too_large_member",
                f"{url}: member {member.name} has {_size(member.size)}, over the {_size(max_member_bytes)} limit",
            )
            current_bad = True
            continue
        try:
            handle = tf.extractfile(member)
            data = handle.read() if handle is not None else b""
        except (tarfile.TarError, OSError, EOFError, zlib.error) as err:
            report("truncated", f"{url}: member {member.name}: {err}")
            current_bad = True
            break
        if len(data) != member.size:
            report("truncated", f"{url}: member {member.name} has {len(data)} of {member.size} bytes")
            current_bad = True
            break
        if ext in current:
            report("duplicate_member", f"{url}: {member.name} appears twice in a row; kept the first")
            continue
        current[ext] = data
    if current is not None and not current_bad:
        yield current


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def read_samples(
    url: str, *, on_error: ErrorHandler | None = None, max_member_bytes: int = DEFAULT_MAX_FILE_BYTES
) -> Iterator[dict]:
    """Yield one dict per sample of a WebDataset tar: ``{"__key__", "__url__", "<ext>": bytes, ...}``.

    ``url`` is a local path (optionally ``file://``, optionally gzip-compressed) or ``pipe:COMMAND`` whose
    stdout is a tar. Problems are passed to ``on_error(reason, detail)`` (default: a logged warning) and
    skipped, never raised: reasons are ``missing``, ``unreadable``, ``not_a_tar``, ``truncated``, ``corrupt``
    (a damaged header; the samples on both sides of it are dropped because either may have lost a member),
    ``no_extension``, ``duplicate_member``, ``too_large_member`` (a member over ``max_member_bytes``, whose
    sample is dropped), ``too_large_header`` (a PAX or GNU long-name header over ``MAX_TAR_HEADER_BYTES``:
    the rest of the shard is skipped unread), ``not_a_file`` (a device, FIFO or folder given as a shard),
    ``unsupported_url`` and ``pipe_failed``.
    """
    report = on_error or _log_error
    url = os.fspath(url)
    if url.startswith("pipe:"):
        yield from _read_pipe(url, report, max_member_bytes)
        return
    path = url.removeprefix("file://")
    if is_remote(path):
        report("unsupported_url", f"{url}: only local paths and pipe: urls are read (try pipe:curl -s {url})")
        return
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):  # /dev/zero would be read as endless empty blocks, a FIFO waits for a writer
            report("not_a_file", f"{url}: {_kind(mode)}, not a regular file")
            return
        handle = open(path, "rb")  # noqa: SIM115 - closed below, after the generator finishes
    except FileNotFoundError as err:
        report("missing", f"{url}: {err.strerror}")
        return
    except OSError as err:
        report("unreadable", f"{url}: {err}")
        return
    with handle:
        try:
            tf = tarfile.open(fileobj=handle, mode="r:*", ignore_zeros=True, tarinfo=_BoundedTarInfo)  # noqa: SIM115
        except _OversizedHeader as err:
            report("too_large_header", f"{url}: {err}")
            return
        except (tarfile.TarError, OSError, EOFError, zlib.error) as err:
            report("not_a_tar", f"{url}: {_one_line(err)}")
            return
        with tf:
            yield from _iter_tar(tf, url, report, seekable=True, max_member_bytes=max_member_bytes)


def _read_pipe(url: str, report: ErrorHandler, max_member_bytes: int) -> Iterator[dict]:
    command = url.removeprefix("pipe:")
    proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        try:
            tf = tarfile.open(fileobj=proc.stdout, mode="r|*", ignore_zeros=True, tarinfo=_BoundedTarInfo)  # noqa: SIM115
        except _OversizedHeader as err:
            report("too_large_header", f"{url}: {err}")
        except (tarfile.TarError, OSError, EOFError, zlib.error) as err:
            report("not_a_tar", f"{url}: {_one_line(err)}")
        else:
            with tf:
                yield from _iter_tar(tf, url, report, seekable=False, max_member_bytes=max_member_bytes)
    finally:
        proc.stdout.close()
        stderr = proc.stderr.read().decode("utf-8", "replace").strip() if proc.stderr else ""
        if proc.wait() != 0:
            report("pipe_failed", f"{url}: exit status {proc.returncode}: {stderr[-200:]}")


def iter_samples(
    spec: str | Sequence[str], *, on_error: ErrorHandler | None = None, max_member_bytes: int = DEFAULT_MAX_FILE_BYTES
) -> Iterator[dict]:
    """``read_samples`` over every shard of ``expand_urls(spec)``, in order."""
    for url in expand_urls(spec):
        yield from read_samples(url, on_error=on_error, max_member_bytes=max_member_bytes)


# --------------------------------------------------------------------------------------------------
# Folders


@dataclass(frozen=True)
class FolderScan:
    """The files of an image folder, searched recursively in sorted order; hidden files and folders (a name
    starting with ``.``) are left out. ``other`` are the files that are neither an image nor the caption or
    metadata sidecar of one: they are reported as skipped (``not_an_image``), never silently dropped."""

    root: Path
    images: list[Path]
    other: list[Path]


def scan_folder(root: str | os.PathLike) -> FolderScan:
    """List an image folder (see ``FolderScan``). Every entry but a folder is listed, so a FIFO, a device or a
    dangling symlink named like an image is reported when read (``not_a_file``, ``missing_file``) rather than
    left out unseen."""
    base = Path(root)
    files = sorted(
        p
        for p in base.rglob("*")
        if not any(part.startswith(".") for part in p.relative_to(base).parts) and not p.is_dir()
    )
    images = [p for p in files if is_image_file(p)]
    stems = {p.with_suffix("") for p in images}
    sidecar = (CAPTION_SUFFIX, METADATA_SUFFIX)
    other = [p for p in files if not is_image_file(p) and not (p.suffix in sidecar and p.with_suffix("") in stems)]
    return FolderScan(base, images, other)


def read_caption_table(path: str | os.PathLike) -> dict[str, str]:
    """Captions of an image folder from a table: a file column (path relative to the folder, or file name)
    and a caption column."""
    names, types, batches = _read_table(Path(path))
    file_col = next((c for c in FILENAME_COLUMNS if c in names), None)
    text_col = next((c for c in CAPTION_COLUMNS if c in names), None)
    if file_col is None or text_col is None:
        need = f"a file column ({' / '.join(FILENAME_COLUMNS)}) and a caption column ({' / '.join(CAPTION_COLUMNS)})"
        raise ValueError(f"{path}: a captions table needs {need}; has {names}")
    _text_column_check(Path(path), types, text_col, "a captions table holds text captions")
    return {
        str(r[file_col]): _caption_text(r[text_col], f"{path}: {file_col} {r[file_col]}") for b in batches for r in b
    }


def _caption_text(value: Any, where: str = "") -> str:
    if value is None:
        return ""
    if not isinstance(value, str | bytes):  # a JSON line's value can differ from the column's first ones
        raise ValueError(f"{where}: the caption is a {type(value).__name__}, not text")
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


# --------------------------------------------------------------------------------------------------
# Tables


def open_parquet(path: str | os.PathLike) -> Any:
    """``pyarrow.parquet.ParquetFile(path)``; a file that is not Parquet raises ``ValueError`` naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as err:
        raise ValueError(f"cannot read {path}: {' '.join(str(err).split())}") from None


def parquet_batches(
    path: str | os.PathLike, batch_size: int = 4096, columns: Sequence[str] | None = None
) -> Iterator[Any]:
    """The record batches of a Parquet file; a damaged data page raises ``ValueError`` naming the file, where
    pyarrow's own error names neither the file nor the page."""
    import pyarrow as pa

    reader = open_parquet(path)
    batches = reader.iter_batches(batch_size=batch_size, columns=columns)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (OSError, pa.ArrowException) as err:
            raise ValueError(f"cannot read {path}: {' '.join(str(err).split())}") from None
        yield batch


def read_table_batches(path: Path, batch_size: int = 4096) -> tuple[list[str], Iterator[list[dict]]]:
    """Column names and row batches of a Parquet, CSV/TSV or JSON-lines file, read incrementally where possible."""
    names, _, batches = _read_table(path, batch_size)
    return names, batches


def _read_table(
    path: Path, batch_size: int = 4096, on_skip: ErrorHandler | None = None, max_cell_bytes: int | None = None
) -> tuple[list[str], dict[str, Any], Iterator[list[dict]]]:
    """Column names, their Arrow types (a CSV column is text) and row batches of a table, read a batch at a
    time so that no table sits in memory whole.

    CSV/TSV is read strictly (``openalign.data.tables``): a record that does not parse (a stray quote,
    the wrong number of fields) raises ``ValueError`` naming its line, so no row is lost unseen; columns
    that name things (keys, urls, captions, file names) stay text and the others become numbers where
    every value of a batch is one. JSON Lines is read line by line (see ``_jsonl_rows``): a line that is
    not a JSON object goes to ``on_skip("bad_json", ...)`` and is counted, or raises naming its line when
    there is no ``on_skip``; its columns and their types are those of the first batch of rows. A Parquet
    batch holds fewer rows when its rows are large (images in a bytes column), ``max_cell_bytes`` guiding
    how many.
    """
    import pyarrow as pa

    from openalign.data.tables import read_csv

    fmt = table_format(path)
    try:
        if fmt == "parquet":
            reader = open_parquet(path)
            schema = reader.schema_arrow
            types = {f.name: f.type for f in schema}
            rows = _parquet_batch_rows(reader, batch_size, max_cell_bytes)
            return schema.names, types, (b.to_pylist() for b in parquet_batches(path, rows))
        if fmt == "csv":
            names, records = read_csv(path)
            return names, dict.fromkeys(names, pa.string()), _csv_batches(names, records, batch_size)
        if fmt == "jsonl":
            rows_iter = _jsonl_rows(path, on_skip)
            first = list(islice(rows_iter, batch_size))
            names = list(dict.fromkeys(k for row in first for k in row))
            types = {n: _json_type([row.get(n) for row in first]) for n in names}
            return names, types, batched(_chain_all(first, rows_iter), batch_size)
    except pa.ArrowInvalid as err:
        raise ValueError(f"cannot read {path}: {' '.join(str(err).split())}") from err
    suffix = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
    raise ValueError(f"{path}: unsupported table format {suffix.lower()!r} (use .parquet, .csv, .tsv or .jsonl)")


def _parquet_rows(path: Path, rows: tuple[int, int], max_cell_bytes: int) -> Iterator[list[dict]]:
    """Rows ``start..stop-1`` of a Parquet file in batches: only the row groups holding them are read."""
    import pyarrow as pa

    if table_format(path) != "parquet":
        raise ValueError(f"{path}: reading a range of rows needs a Parquet table")
    start, stop = rows
    reader = open_parquet(path)
    meta = reader.metadata
    groups, first, at = [], None, 0
    for g in range(meta.num_row_groups):
        n = meta.row_group(g).num_rows
        if at < stop and at + n > start:
            groups.append(g)
            first = at if first is None else first
        at += n
    if not groups or first is None:
        return
    size = _parquet_batch_rows(reader, 4096, max_cell_bytes)
    at = first
    try:
        for batch in reader.iter_batches(batch_size=size, row_groups=groups):
            lo, hi = max(start, at), min(stop, at + batch.num_rows)
            if lo < hi:
                yield batch.slice(lo - at, hi - lo).to_pylist()
            at += batch.num_rows
    except (OSError, pa.ArrowException) as err:
        raise ValueError(f"cannot read {path}: {' '.join(str(err).split())}") from None


# Rows of a Parquet batch are held as Python objects at once: a batch of large rows (images) is cut shorter.
_PARQUET_BATCH_BYTES = 256 * 2**20


def _parquet_batch_rows(reader: Any, batch_size: int, max_cell_bytes: int | None) -> int:
    """``batch_size``, or fewer rows where the file's largest row group averages large rows."""
    meta = reader.metadata
    widest = 0.0
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        if group.num_rows:
            widest = max(widest, group.total_byte_size / group.num_rows)
    budget = max(_PARQUET_BATCH_BYTES, 2 * (max_cell_bytes or 0))
    return max(1, min(batch_size, int(budget // widest) if widest else batch_size))


def _json_type(values: list[Any]) -> Any:
    """The Arrow type of a JSON column from its values in the first batch: text when any value is a string
    (a row whose value is not is then that row's problem), else what pyarrow infers."""
    import pyarrow as pa

    present = [v for v in values if v is not None]
    if not present:
        return pa.null()
    if any(isinstance(v, str) for v in present):
        return pa.string()
    try:
        return pa.array(present).type
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return pa.struct([])  # mixed kinds that include no string: neither text nor a number


def line_reader(path: str | os.PathLike) -> BinaryIO:
    """``path`` (``.gz`` decompressed) opened for ``bounded_lines``, through a 1 MiB buffer: with io's default of
    8 KiB, stepping over a line of gigabytes takes hundreds of thousands of reads."""
    import gzip

    if str(path).lower().endswith(".gz"):
        return io.BufferedReader(gzip.GzipFile(path, "rb"), buffer_size=_LINE_BUFFER)
    return open(path, "rb", buffering=_LINE_BUFFER)


def bounded_lines(fh: BinaryIO) -> Iterator[bytes | None]:
    """The lines of ``fh``, each read with a limit (``MAX_LINE_BYTES``), so that a file of one endless line cannot
    fill memory: a longer line is stepped over without being kept, and stands as None."""
    while raw := fh.readline(MAX_LINE_BYTES + 1):
        if len(raw) > MAX_LINE_BYTES:
            while raw and not raw.endswith(b"\n"):
                raw = fh.readline(_LINE_BUFFER)
            yield None
        else:
            yield raw


def _jsonl_rows(path: Path, on_skip: ErrorHandler | None) -> Iterator[dict]:
    """The objects of a JSON Lines file (``.gz`` decompressed as it is read), one line at a time, each line
    read with a limit (``MAX_LINE_BYTES``) so that a file of one endless line cannot fill memory. A line that
    is too long, does not parse or is not an object goes to ``on_skip("bad_json", ...)``, or raises a
    ``ValueError`` naming its line. A file that is a JSON array instead is read whole within the annotation
    limit (it cannot be read in parts)."""

    def bad(number: int, why: str) -> None:
        if on_skip is None:
            raise ValueError(f"{path}: line {number}: {why}")
        on_skip("bad_json", f"{path}: line {number}: {why}")

    with line_reader(path) as fh:
        if fh.read(4096).lstrip().startswith(b"["):
            rows = read_annotation_json(path)
            if not isinstance(rows, list):
                raise ValueError(f"{path}: a JSON table must be one object per line or an array of objects")
            for item, row in enumerate(rows, 1):
                if isinstance(row, dict):
                    yield row
                else:
                    bad(item, f"item {item} is a JSON {type(row).__name__}, not an object")
            return
        fh.seek(0)
        for number, raw in enumerate(bounded_lines(fh), 1):
            if raw is None:
                bad(number, f"longer than {_size(MAX_LINE_BYTES)}")
                continue
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except ValueError as err:  # UnicodeDecodeError is a ValueError
                bad(number, f"not JSON ({' '.join(str(err).split())})")
                continue
            if not isinstance(row, dict):
                bad(number, f"a JSON {type(row).__name__}, not an object")
                continue
            yield row


# A key "000123" must not become the integer 123, nor a caption "1920" a number.
_TEXT_LIKE = frozenset({"key", "url", "sha256", "status", *CAPTION_COLUMNS, *FILENAME_COLUMNS})


def _csv_batches(names: list[str], records: Iterator[list[str]], batch_size: int) -> Iterator[list[dict]]:
    from openalign.data.tables import clean_text, infer_values, undecodable

    for batch in batched(records, batch_size):
        values = []
        for name, column in zip(names, zip(*batch, strict=True), strict=True):
            text = list(column) if undecodable(column) is None else [clean_text(v) for v in column]
            values.append(text if name in _TEXT_LIKE else infer_values(text))
        yield [dict(zip(names, row, strict=True)) for row in zip(*values, strict=True)]


def _text_column_check(path: Path, types: Mapping[str, Any], column: str, hint: str) -> None:
    """A caption column of another type (an int or list column) is refused, not turned into strings."""
    from openalign.data.tables import text_type_error

    if column in types and (why := text_type_error(column, types[column])) is not None:
        raise ValueError(f"{path}: {why}; {hint}")


# --------------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class Record:
    """One image of a source, its caption and metadata, in the same shape whatever the source.

    ``key`` names the item within its source: for a folder the path relative to it (``sub/cat.jpg``), for
    shards the sample key (``000123``; ``origin`` is its shard), for a table the ``key`` column or the row
    number. ``index`` is the item's position among the source's images. The image is either already in
    memory (``data``: a shard member, a table's bytes column) or read from ``path`` on demand by ``read``.
    """

    key: str
    kind: SourceKind
    origin: str  # the image file, or the shard / table the bytes come from
    index: int = 0
    caption: str | None = None  # None: the source has no caption for this image
    path: Path | None = None
    data: bytes | None = field(default=None, repr=False)
    raw_meta: Mapping[str, Any] | bytes | Path | None = field(default=None, repr=False)
    max_bytes: int = DEFAULT_MAX_FILE_BYTES  # the largest file ``read`` and ``metadata`` read

    def read(self) -> bytes:
        """The encoded image; raises ``BadInput`` (``missing_image`` or a ``read_file`` reason)."""
        if self.data is not None:
            return self.data
        if self.path is not None:
            return read_file(self.path, max_bytes=self.max_bytes)
        raise BadInput("missing_image", f"{self.origin}: {self.key}")

    def decode(self, *, max_pixels: int = 64_000_000, min_side: int = 2) -> Image.Image:
        """The image as 8-bit RGB; raises ``BadInput`` with the reason it cannot be used."""
        from openalign.data.transforms import decode_image

        return decode_image(self.read(), max_pixels=max_pixels, min_side=min_side)

    def metadata(self) -> dict[str, Any]:
        """The item's metadata: a table's other columns, a shard's ``json`` member or a folder's ``.json``
        sidecar (``{}`` when there is none); raises ``BadInput("bad_json")`` when it is not a JSON object."""
        raw = self.raw_meta
        if raw is None:
            return {}
        if isinstance(raw, Mapping):
            return dict(raw)
        try:
            value = json.loads(read_file(raw, max_bytes=self.max_bytes) if isinstance(raw, Path) else raw)
        except (ValueError, TypeError) as err:  # UnicodeDecodeError is a ValueError
            raise BadInput("bad_json", f"{self.origin}: {self.key}: {err}") from None
        if not isinstance(value, dict):
            raise BadInput("bad_json", f"{self.origin}: {self.key}: a JSON {type(value).__name__}, not an object")
        return value


Event = Record | BadInput


def _folder_events(scan: FolderScan, captions: Mapping[str, str] | None, max_bytes: int) -> Iterator[Event]:
    for file in scan.other:
        yield BadInput("not_an_image", str(file))
    for index, file in enumerate(scan.images):
        rel = file.relative_to(scan.root).as_posix()
        if captions is not None:
            caption = captions.get(rel, captions.get(file.name))
        else:
            sidecar = file.with_suffix(CAPTION_SUFFIX)
            try:
                text = read_file(sidecar, max_bytes=max_bytes) if sidecar.is_file() else None
                caption = None if text is None else text.decode("utf-8", "replace").strip()
            except BadInput as err:
                yield err
                continue
        meta = file.with_suffix(METADATA_SUFFIX)
        yield Record(
            key=rel,
            kind="folder",
            origin=str(file),
            index=index,
            caption=caption,
            path=file,
            raw_meta=meta if meta.is_file() else None,
            max_bytes=max_bytes,
        )


def _table_events(
    path: Path,
    image_root: Path,
    caption_column: str | None,
    image_column: str | None,
    require_caption: bool,
    max_bytes: int,
    allow_outside_root: bool,
    rows: tuple[int, int] | None = None,
) -> Iterator[Event]:
    skipped: list[BadInput] = []
    names, types, batches = _read_table(
        path, on_skip=lambda reason, detail: skipped.append(BadInput(reason, detail)), max_cell_bytes=max_bytes
    )
    if rows is not None:
        batches = _parquet_rows(path, rows, max_bytes)
    caption = caption_column or next((c for c in CAPTION_COLUMNS if c in names), None)
    if (caption_column and caption_column not in names) or (require_caption and caption is None):
        raise ValueError(f"{path}: no caption column ({caption_column or ' / '.join(CAPTION_COLUMNS)}); has {names}")
    if caption is not None:
        _text_column_check(path, types, caption, "choose the caption column with --caption-column")
    if image_column is not None and image_column not in names:
        raise ValueError(f"{path}: no image column {image_column!r}; has {names}")
    candidates = [image_column] if image_column else [c for c in IMAGE_BYTES_COLUMNS if c in names]
    if not candidates and IMAGE_PATH_COLUMN not in names:
        raise ValueError(
            f"{path}: no image bytes column ({' / '.join(IMAGE_BYTES_COLUMNS)}) or {IMAGE_PATH_COLUMN} column"
        )
    index = 0 if rows is None else rows[0]
    images = ImageRoot(image_root, allow_outside_root=allow_outside_root)
    for batch in batches:
        yield from skipped  # lines of a JSON table that are not rows, in order with the rows around them
        skipped.clear()
        for row in batch:
            key = row.get("key")
            key = str(key) if key not in (None, "") else f"{index:09d}"
            data: bytes | None = None
            too_large = None
            for column in candidates:
                value = row.get(column)
                if isinstance(value, dict):  # datasets' Image feature: {"bytes": ..., "path": ...}
                    value = value.get("bytes")
                if isinstance(value, bytes):
                    if len(value) > max_bytes:  # the same rule as an image file's
                        too_large = f"row {key}: column {column!r} holds {_size(len(value))}, over the"
                        too_large += f" {_size(max_bytes)} limit"
                        break
                    data = value
                    break
            text = row.get(caption) if caption else None
            if too_large is not None or (text is not None and not isinstance(text, str | bytes)):
                reason = "too_large_file" if too_large is not None else "caption_not_text"
                detail = too_large or f"row {key}: caption column {caption!r} holds {type(text).__name__}"
                yield BadInput(reason, f"{path}: {detail}")
                index += 1
                continue
            file = None
            if data is None and row.get(IMAGE_PATH_COLUMN):
                try:
                    file = images.resolve(str(row[IMAGE_PATH_COLUMN]))
                except BadInput as err:
                    yield BadInput(err.reason, f"row {key}: {err.detail}")
                    index += 1
                    continue
            if data is None and file is None:
                yield BadInput("missing_image", f"row {key}: no image bytes or {IMAGE_PATH_COLUMN}")
            else:
                yield Record(
                    key=key,
                    kind="table",
                    origin=str(file) if file is not None else str(path),
                    index=index,
                    caption=None if caption is None else _caption_text(text),
                    path=file,
                    data=data,
                    raw_meta={k: v for k, v in row.items() if k not in candidates},
                    max_bytes=max_bytes,
                )
            index += 1
    yield from skipped


def _shard_events(urls: Sequence[str], max_bytes: int) -> Iterator[Event]:
    errors: list[BadInput] = []
    index = 0
    for url in urls:
        for sample in read_samples(
            url, on_error=lambda reason, detail: errors.append(BadInput(reason, detail)), max_member_bytes=max_bytes
        ):
            yield from errors
            errors.clear()
            key = str(sample["__key__"])
            member = image_member(sample)
            if member is None:
                yield BadInput("no_image", f"{url}: sample {key} has no image member")
                continue
            text = sample.get(CAPTION_MEMBER)
            yield Record(
                key=key,
                kind="shards",
                origin=url,
                index=index,
                caption=None if text is None else text.decode("utf-8", "replace").strip(),
                data=sample[member],
                raw_meta=sample.get(METADATA_MEMBER),
                max_bytes=max_bytes,
            )
            index += 1
        yield from errors
        errors.clear()


# --------------------------------------------------------------------------------------------------
# Sources


@dataclass(frozen=True)
class Source:
    """An input recognised by ``open_source``: an image folder, a table or WebDataset shards."""

    spec: str
    kind: SourceKind
    scan: FolderScan | None = None  # folder
    urls: tuple[str, ...] = ()  # shards
    table: Path | None = None  # table
    captions: Mapping[str, str] | None = field(default=None, repr=False)  # folder: captions by file
    image_root: Path | None = None  # table: where relative image paths start (default the table's folder)
    caption_column: str | None = None  # table: default the first of CAPTION_COLUMNS present
    image_column: str | None = None  # table: default the first of IMAGE_BYTES_COLUMNS present, then image_path
    require_caption: bool = False  # table: a missing caption column is an error
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES  # larger files and shard members are skipped, never read
    allow_outside_root: bool = False  # table: read image paths that resolve outside the image root
    rows: tuple[int, int] | None = None  # Parquet table: only rows start..stop-1 (their row groups) are read

    def events(self) -> Iterator[Record | BadInput]:
        """Every item in order: a ``Record``, or a ``BadInput`` for an item (or a whole shard) that was skipped.

        A table whose columns do not fit raises ``ValueError`` before the first item."""
        if self.kind == "folder":
            assert self.scan is not None
            return _folder_events(self.scan, self.captions, self.max_file_bytes)
        if self.kind == "table":
            assert self.table is not None
            root = self.image_folder()
            assert root is not None
            events = _table_events(
                self.table,
                root,
                self.caption_column,
                self.image_column,
                self.require_caption,
                self.max_file_bytes,
                self.allow_outside_root,
                self.rows,
            )
            first = next(events, None)  # column checks happen here, not at the first next() of the caller
            return iter(()) if first is None else _chain(first, events)
        return _shard_events(self.urls, self.max_file_bytes)

    def image_folder(self) -> Path | None:
        """Where the input's image files lie: an image folder, a table's image root (default the table's
        folder); None for shards, whose images are inside their tars."""
        if self.kind == "folder":
            assert self.scan is not None
            return self.scan.root
        if self.kind == "table":
            assert self.table is not None
            return self.image_root if self.image_root is not None else self.table.parent
        return None

    def local_paths(self) -> list[str]:
        """The files and folders on this machine that the input reads (the shards a glob or brace spec names,
        the table and its image root, the folder): what an output must not be, or hold."""
        if self.kind == "folder":
            assert self.scan is not None
            return [os.fspath(self.scan.root)]
        if self.kind == "table":
            assert self.table is not None
            return [os.fspath(p) for p in (self.table, self.image_root) if p is not None]
        return [url for url in self.urls if not is_remote(url)]

    def records(self, on_skip: ErrorHandler | None = None) -> Iterator[Record]:
        """The usable records; every skipped item goes to ``on_skip(reason, detail)`` (default: a warning)."""
        report = on_skip or _log_error
        for event in self.events():
            if isinstance(event, BadInput):
                report(event.reason, event.detail)
            else:
                yield event


def _chain(first: T, rest: Iterator[T]) -> Iterator[T]:
    yield first
    yield from rest


def _chain_all(first: Iterable[T], rest: Iterator[T]) -> Iterator[T]:
    yield from first
    yield from rest


def _looks_like_shards(text: str) -> bool:
    return text.startswith("pipe:") or any(mark in text for mark in ("{", "*", "?", "[", ",", "::")) or is_remote(text)


def open_source(
    spec: str | os.PathLike,
    *,
    captions: str | os.PathLike | None = None,
    image_root: str | os.PathLike | None = None,
    caption_column: str | None = None,
    image_column: str | None = None,
    require_caption: bool = False,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    allow_outside_root: bool = False,
) -> Source:
    """Recognise an input: a folder holding images (read recursively; ``cat.txt`` / ``cat.json`` beside
    ``cat.jpg`` are its caption and metadata, or ``captions`` names a table of them), a folder of ``.tar``
    shards, a table (``.parquet``, ``.csv``/``.tsv``, ``.jsonl``; image bytes or an ``image_path`` column,
    relative to ``image_root``), or a shard file / pattern (``{00000..00009}.tar``, globs, lists, ``pipe:``).

    Files and shard members over ``max_file_bytes`` are skipped unread; a table's image paths must resolve
    inside ``image_root`` (default the table's folder) unless ``allow_outside_root`` (see ``read_file`` and
    ``resolve_image_path``).

    Raises ``FileNotFoundError`` for an input that does not exist or holds nothing readable and
    ``ValueError`` for an option that does not apply to the input's kind.
    """
    if max_file_bytes < 1:
        raise ValueError(f"max_file_bytes must be at least 1, got {max_file_bytes}")
    text = os.fspath(spec)
    path = Path(text)
    table_options = caption_column or image_column  # image_root only matters for a table
    if path.is_dir():
        scan = scan_folder(path)
        if not scan.images and not any(p.name.endswith(SHARD_SUFFIXES) for p in scan.other):
            raise FileNotFoundError(f"{text}: no images or .tar shards in this folder")
        if scan.images:
            if table_options:
                raise ValueError("--caption-column/--image-column apply to a table input, not to a folder")
            table = read_caption_table(captions) if captions is not None else None
            return Source(text, "folder", scan=scan, captions=table, max_file_bytes=max_file_bytes)
        kind: SourceKind = "shards"
    elif path.is_file():
        kind = "table" if table_format(path) is not None else "shards"
        if kind == "shards" and not text.endswith(SHARD_SUFFIXES):
            raise ValueError(
                f"{text}: not an image folder, a table (.parquet, .csv, .tsv, .jsonl) or a WebDataset shard (.tar)"
            )
    elif _looks_like_shards(text):
        kind = "shards"
    else:
        raise FileNotFoundError(f"no such input: {text} (no such directory, table or shard)")
    if captions is not None:
        raise ValueError("--captions applies to an image folder input, not to a table or shards")
    if kind == "table":
        root = Path(image_root) if image_root is not None else None
        return Source(
            text,
            "table",
            table=path,
            image_root=root,
            caption_column=caption_column,
            image_column=image_column,
            require_caption=require_caption,
            max_file_bytes=max_file_bytes,
            allow_outside_root=allow_outside_root,
        )
    if table_options:
        raise ValueError("--caption-column/--image-column apply to a table input, not to shards")
    urls = expand_urls(text)
    if not any(Path(u).exists() or is_remote(u) for u in urls):
        raise FileNotFoundError(
            f"{text}: no such shard" + (f" ({len(urls)} named, none exists)" if len(urls) > 1 else "")
        )
    return Source(text, "shards", urls=tuple(urls), max_file_bytes=max_file_bytes)


def decode_records(
    records: Iterable[Record], on_skip: ErrorHandler | None = None, *, max_pixels: int = 64_000_000, min_side: int = 2
) -> Iterator[tuple[Record, Image.Image]]:
    """(record, RGB image) for every record whose image reads and decodes; the others go to ``on_skip``."""
    report = on_skip or _log_error
    for record in records:
        try:
            yield record, record.decode(max_pixels=max_pixels, min_side=min_side)
        except BadInput as err:
            report(err.reason, f"{record.origin}: {record.key}: {err.detail}")
