"""WebDataset shards in the img2dataset layout: ``00000.tar`` holding ``key.jpg`` / ``key.txt`` / ``key.json``
next to ``00000_stats.json``.

Reading never raises mid-stream: a missing shard, a truncated tar or a corrupt member header is reported
through ``on_error(reason, detail)`` and reading goes on with whatever can still be trusted, because one bad
file in a million must not stop a training run. Writing is deterministic (members sorted, fixed mtime and
owner), so the same samples always give byte-identical shards, and each tar appears under its final name
only once it is complete, so an interrupted job never leaves a half-written shard behind.
"""

from __future__ import annotations

import glob
import io
import json
import logging
import math
import os
import re
import subprocess
import tarfile
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from PIL import Image

from openalign.data.transforms import BadImage, decode_image

log = logging.getLogger(__name__)

ErrorHandler = Callable[[str, str], None]

# A fixed timestamp (2021-01-01) rather than 0, which some archive tools display as a warning.
FIXED_MTIME = 1_609_459_200
_JPEG_MAGIC = b"\xff\xd8\xff"
# webdataset's rule: the key is the path up to the first dot of the file name, the extension is the rest.
_MEMBER_NAME = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")
_EXT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


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


def _is_remote(url: str) -> bool:
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
            if _is_remote(item):
                urls.append(item)
            elif os.path.isdir(item):
                shards = glob.glob(os.path.join(glob.escape(item), "*"))
                found = sorted(p for p in shards if p.endswith((".tar", ".tgz", ".tar.gz")))
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
# Reading


def _log_error(reason: str, detail: str) -> None:
    log.warning("skipped (%s): %s", reason, detail)


def split_member_name(name: str) -> tuple[str, str] | None:
    """``"dir/000123.jpg"`` → ``("dir/000123", "jpg")``; ``None`` for a name without an extension."""
    match = _MEMBER_NAME.match(name.removeprefix("./"))
    if match is None:
        return None
    return match.group(1), match.group(2).lower()


def _scan(fileobj: BinaryIO, start: int, end: int | None) -> tuple[bool, int]:
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


def _iter_tar(tf: tarfile.TarFile, url: str, report: ErrorHandler, seekable: bool) -> Iterator[dict]:
    """Group consecutive members by key into samples; drop a sample any of whose members is unreadable."""
    current: dict[str, Any] | None = None
    current_bad = False
    after_gap = False  # the member after a damaged region may start a sample that lost its first member
    expected = 0  # where the next header should start if nothing between members was damaged
    raw = tf.fileobj
    while True:
        try:
            member = tf.next()
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


def read_samples(url: str, *, on_error: ErrorHandler | None = None) -> Iterator[dict]:
    """Yield one dict per sample of a WebDataset tar: ``{"__key__", "__url__", "<ext>": bytes, ...}``.

    ``url`` is a local path (optionally ``file://``, optionally gzip-compressed) or ``pipe:COMMAND`` whose
    stdout is a tar. Problems are passed to ``on_error(reason, detail)`` (default: a logged warning) and
    skipped, never raised: reasons are ``missing``, ``unreadable``, ``not_a_tar``, ``truncated``, ``corrupt``
    (a damaged header; the samples on both sides of it are dropped because either may have lost a member),
    ``no_extension``, ``duplicate_member``, ``unsupported_url`` and ``pipe_failed``.
    """
    report = on_error or _log_error
    url = os.fspath(url)
    if url.startswith("pipe:"):
        yield from _read_pipe(url, report)
        return
    path = url.removeprefix("file://")
    if _is_remote(path):
        report("unsupported_url", f"{url}: only local paths and pipe: urls are read (try pipe:curl -s {url})")
        return
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below, after the generator finishes
    except FileNotFoundError as err:
        report("missing", f"{url}: {err.strerror}")
        return
    except OSError as err:
        report("unreadable", f"{url}: {err}")
        return
    with handle:
        try:
            tf = tarfile.open(fileobj=handle, mode="r:*", ignore_zeros=True)  # noqa: SIM115 - closed below
        except (tarfile.TarError, OSError, EOFError, zlib.error) as err:
            report("not_a_tar", f"{url}: {_one_line(err)}")
            return
        with tf:
            yield from _iter_tar(tf, url, report, seekable=True)


def _read_pipe(url: str, report: ErrorHandler) -> Iterator[dict]:
    command = url.removeprefix("pipe:")
    proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        try:
            tf = tarfile.open(fileobj=proc.stdout, mode="r|*", ignore_zeros=True)  # noqa: SIM115
        except (tarfile.TarError, OSError, EOFError, zlib.error) as err:
            report("not_a_tar", f"{url}: {_one_line(err)}")
        else:
            with tf:
                yield from _iter_tar(tf, url, report, seekable=False)
    finally:
        proc.stdout.close()
        stderr = proc.stderr.read().decode("utf-8", "replace").strip() if proc.stderr else ""
        if proc.wait() != 0:
            report("pipe_failed", f"{url}: exit status {proc.returncode}: {stderr[-200:]}")


def iter_samples(spec: str | Sequence[str], *, on_error: ErrorHandler | None = None) -> Iterator[dict]:
    """``read_samples`` over every shard of ``expand_urls(spec)``, in order."""
    for url in expand_urls(spec):
        yield from read_samples(url, on_error=on_error)


# --------------------------------------------------------------------------------------------------
# Writing


class SkipSample(ValueError):
    """A sample the writer cannot store; ``reason`` is counted in the shard's stats."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


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
        jpg, original, written = _encode_image(sample.get("jpg"), max_side, quality)
    except BadImage as err:
        raise SkipSample(err.reason, f"{key}: {err}") from err
    members: dict[str, bytes] = {"jpg": jpg}
    text = sample.get("txt")
    if text is not None:
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as err:
                raise SkipSample("bad_text", f"{key}: caption is not UTF-8") from err
        members["txt"] = str(text).encode("utf-8")
    meta = dict(sample.get("json") or {})
    # img2dataset's fields; caller metadata wins (a filtered corpus keeps its original web width/height).
    meta.setdefault("key", key)
    if text is not None:
        meta.setdefault("caption", str(text))
    meta.setdefault("width", written[0])
    meta.setdefault("height", written[1])
    meta.setdefault("original_width", original[0])
    meta.setdefault("original_height", original[1])
    try:
        members["json"] = json.dumps(_jsonable(meta), sort_keys=True, ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError) as err:
        raise SkipSample("bad_json", f"{key}: {err}") from err
    for ext, value in sample.items():
        if ext in ("key", "jpg", "txt", "json"):
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
        self.stats_path = out_dir / f"{name}_stats.json"
        self.tmp = out_dir / f".{name}.tar.tmp"
        self.tf: tarfile.TarFile | None = None
        self.keys: set[str] = set()
        self.failures: Counter[str] = Counter()
        self.image_bytes = 0
        self.start = time.time()

    def add(self, key: str, members: dict[str, bytes]) -> None:
        if self.tf is None:
            self.tf = tarfile.open(self.tmp, "w", format=tarfile.PAX_FORMAT)  # noqa: SIM115 - closed in close()
        for ext in sorted(members):
            _add_member(self.tf, f"{key}.{ext}", members[ext])
        self.keys.add(key)
        self.image_bytes += len(members["jpg"])

    def close(self) -> Path | None:
        if self.tf is not None:
            self.tf.close()
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


def write_shards(
    samples: Iterable[dict | SkipSample],
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
    ``txt`` is the caption; ``json`` the metadata, to which img2dataset's ``key``, ``caption``, ``width``,
    ``height``, ``original_width`` and ``original_height`` are added where absent. Other keys become extra
    members (bytes as they are, str as UTF-8, dict as JSON). A sample that cannot be stored is skipped and
    counted by reason in the stats file of the shard being filled (``{prefix}00000_stats.json``:
    count, successes, failed, failures by reason, bytes, image_bytes, duration); an item that is a
    ``SkipSample`` (a sample that failed before reaching the writer) is counted the same way. Returns the
    tar paths.
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
            if isinstance(sample, SkipSample):  # failed upstream (e.g. a missing file): counted here
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
        if shard.tf is not None and not shard.tf.closed:  # interrupted: drop the partial shard
            shard.tf.close()
            shard.tmp.unlink(missing_ok=True)
    return written


def read_stats(out_dir: str | os.PathLike, prefix: str = "") -> dict:
    """Totals over every ``{prefix}NNNNN_stats.json`` in ``out_dir``: count, successes, failed, failures, bytes."""
    total: dict[str, Any] = {"shards": 0, "count": 0, "successes": 0, "failed": 0, "bytes": 0, "failures": {}}
    failures: Counter[str] = Counter()
    pattern = re.compile(rf"^{re.escape(prefix)}\d+_stats\.json$")
    for path in sorted(Path(out_dir).iterdir()):
        if not pattern.match(path.name):
            continue
        stats = json.loads(path.read_text())
        total["shards"] += 1 if stats.get("shard") else 0
        for field in ("count", "successes", "failed", "bytes"):
            total[field] += int(stats.get(field, 0))
        failures.update(stats.get("failures", {}))
    total["failures"] = dict(sorted(failures.items()))
    return total


# --------------------------------------------------------------------------------------------------
# Inputs for ``openalign shard``

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
CAPTION_COLUMNS = ("caption", "text", "alt", "alt_text", "txt", "TEXT")
IMAGE_BYTES_COLUMNS = ("jpg", "image", "image_bytes", "img", "bytes", "png", "webp")
FILENAME_COLUMNS = ("filename", "file", "image", "path", "image_path")


def _read_file(path: Path) -> bytes | SkipSample:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return SkipSample("missing_file", str(path))
    except OSError as err:
        return SkipSample("unreadable_file", f"{path}: {err}")


def _read_table_batches(path: Path, batch_size: int = 4096) -> tuple[list[str], Iterator[list[dict]]]:
    """Column names and row batches of a Parquet, CSV or JSON-lines file, read incrementally where possible."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.json as pjson
    import pyarrow.parquet as pq

    suffix = "".join(path.suffixes[-2:]).lower() if path.suffix == ".gz" else path.suffix.lower()
    try:
        if suffix == ".parquet":
            pf = pq.ParquetFile(path)
            return pf.schema_arrow.names, (b.to_pylist() for b in pf.iter_batches(batch_size=batch_size))
        if suffix in (".csv", ".tsv", ".csv.gz", ".tsv.gz"):
            parse = pcsv.ParseOptions(delimiter="\t" if suffix.startswith(".tsv") else ",", newlines_in_values=True)
            # Strings stay strings: a key "000123" must not become the integer 123.
            probe = pcsv.open_csv(path, parse_options=parse)
            names = probe.schema.names
            probe.close()
            text_like = {"key", "url", "sha256", *CAPTION_COLUMNS, *FILENAME_COLUMNS}
            convert = pcsv.ConvertOptions(column_types={n: pa.string() for n in names if n in text_like})
            reader = pcsv.open_csv(path, parse_options=parse, convert_options=convert)
            return names, (b.to_pylist() for b in reader)
        if suffix in (".jsonl", ".json", ".jsonl.gz", ".ndjson"):
            table = pjson.read_json(path)
            return table.schema.names, (b.to_pylist() for b in table.to_batches(max_chunksize=batch_size))
    except pa.ArrowInvalid as err:
        raise ValueError(f"cannot read {path}: {' '.join(str(err).split())}") from err
    raise ValueError(f"{path}: unsupported table format {suffix!r} (use .parquet, .csv, .tsv or .jsonl)")


def samples_from_table(
    path: str | os.PathLike,
    *,
    image_root: str | os.PathLike | None = None,
    caption_column: str | None = None,
    image_column: str | None = None,
) -> Iterator[dict | SkipSample]:
    """Samples from a metadata table whose rows hold image bytes (a binary column, or a ``{"bytes": ...}``
    struct as Hugging Face datasets store images) or point to image files (``image_path``, relative paths
    resolved against ``image_root``, default the table's folder). Every other column goes into the json.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such table: {path}")
    names, batches = _read_table_batches(path)
    caption = caption_column or next((c for c in CAPTION_COLUMNS if c in names), None)
    if caption is None or caption not in names:
        raise ValueError(f"{path}: no caption column ({caption_column or ' / '.join(CAPTION_COLUMNS)}); has {names}")
    if image_column is not None and image_column not in names:
        raise ValueError(f"{path}: no image column {image_column!r}; has {names}")
    candidates = [image_column] if image_column else [c for c in IMAGE_BYTES_COLUMNS if c in names]
    if not candidates and "image_path" not in names:
        raise ValueError(f"{path}: no image bytes column ({' / '.join(IMAGE_BYTES_COLUMNS)}) or image_path column")
    root = Path(image_root) if image_root is not None else path.parent
    index = 0
    for batch in batches:
        for row in batch:
            key = row.get("key")
            key = str(key) if key not in (None, "") else f"{index:09d}"
            index += 1
            image: Any = None
            for column in candidates:
                value = row.get(column)
                if isinstance(value, dict):  # datasets' Image feature: {"bytes": ..., "path": ...}
                    value = value.get("bytes")
                if isinstance(value, bytes):
                    image = value
                    break
            if image is None and row.get("image_path"):
                file = Path(str(row["image_path"]))
                image = _read_file(file if file.is_absolute() else root / file)
                if isinstance(image, SkipSample):
                    yield image
                    continue
            if image is None:
                yield SkipSample("missing_image", f"row {key}: no image bytes or image_path")
                continue
            text = row.get(caption)
            meta = {k: v for k, v in row.items() if k not in candidates}
            yield {"key": key, "jpg": image, "txt": "" if text is None else str(text), "json": meta}


def _caption_table(path: Path) -> dict[str, str]:
    names, batches = _read_table_batches(path)
    file_col = next((c for c in FILENAME_COLUMNS if c in names), None)
    text_col = next((c for c in CAPTION_COLUMNS if c in names), None)
    if file_col is None or text_col is None:
        need = f"a file column ({' / '.join(FILENAME_COLUMNS)}) and a caption column ({' / '.join(CAPTION_COLUMNS)})"
        raise ValueError(f"{path}: a captions table needs {need}; has {names}")
    return {str(r[file_col]): "" if r[text_col] is None else str(r[text_col]) for b in batches for r in b}


def samples_from_folder(
    folder: str | os.PathLike, *, captions: str | os.PathLike | None = None
) -> Iterator[dict | SkipSample]:
    """Samples from a folder of images (searched recursively, in sorted order) whose captions are sidecar
    ``.txt`` files (``cat.jpg`` + ``cat.txt``) or rows of a ``captions`` table keyed by the path relative to
    the folder or the file name. A sidecar ``.json`` becomes the metadata. Keys are the running index; the
    relative path is kept as ``filename``. An image without a caption is skipped as ``missing_caption``.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no such folder: {folder}")
    table = _caption_table(Path(captions)) if captions is not None else None
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
    for index, file in enumerate(files):
        rel = file.relative_to(folder).as_posix()
        if table is not None:
            text = table.get(rel, table.get(file.name))
        else:
            sidecar = file.with_suffix(".txt")
            text = sidecar.read_text(encoding="utf-8", errors="replace").strip() if sidecar.is_file() else None
        if text is None:
            yield SkipSample("missing_caption", rel)
            continue
        meta: dict[str, Any] = {}
        if file.with_suffix(".json").is_file():
            try:
                meta = dict(json.loads(file.with_suffix(".json").read_text(encoding="utf-8")))
            except (ValueError, TypeError) as err:
                yield SkipSample("bad_json", f"{rel}: {err}")
                continue
        meta["filename"] = rel
        data = _read_file(file)
        if isinstance(data, SkipSample):
            yield data
            continue
        yield {"key": f"{index:09d}", "jpg": data, "txt": text, "json": meta}


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
    progress: bool = False,
) -> dict:
    """Write ``source`` (an image folder, or a Parquet/CSV/JSONL table with image bytes or ``image_path``) as
    WebDataset shards in ``out_dir``; returns the totals of the shards' stats files (see ``read_stats``)."""
    src = Path(source)
    if src.is_dir():
        if caption_column or image_column:
            raise ValueError("--caption-column/--image-column apply to a table input, not to a folder")
        samples: Iterable[dict | SkipSample] = samples_from_folder(src, captions=captions)
    elif src.is_file():
        if captions is not None:
            raise ValueError("--captions applies to an image folder input, not to a table")
        samples = samples_from_table(
            src, image_root=image_root, caption_column=caption_column, image_column=image_column
        )
    else:
        raise FileNotFoundError(f"no such input: {src}")
    out = Path(out_dir)
    if out.is_dir() and any(out.glob(f"{glob.escape(prefix)}[0-9]*.tar")):
        raise ValueError(f"{out} already holds {prefix}NNNNN.tar shards; choose an empty folder or another --prefix")
    write_shards(
        samples,
        out,
        samples_per_shard=samples_per_shard,
        prefix=prefix,
        max_side=max_side,
        jpeg_quality=jpeg_quality,
        progress=progress,
    )
    return read_stats(out, prefix=prefix)
