"""A plain local WebDataset tar read from its headers alone: each sample's members as places in the file.

``read_samples`` reads every byte of a shard through ``tarfile``, which costs far more per sample than the
sample's header blocks are worth when most samples are not needed. That happens in the training stream: each
DataLoader worker walks the whole global sample sequence (to agree with the others on where each sample
falls) but decodes only its own share. Here a worker reads the 512-byte header of each member, and later the
bytes of the members it actually uses (``MemberRef.read``), so the walk costs a few microseconds a member.

Only a tar ``read_samples`` would read without a single report is indexed: uncompressed, regular members
with valid checksums, names with extensions, no member over the size limit or repeated, and a proper
end-of-archive marker. Anything else (compression, PAX or GNU long-name headers, damage, truncation) gives
``None``, and the caller falls back to ``read_samples``, which reports what it finds. So both readers yield the
same samples from any shard.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from openalign.data.sources import is_remote, split_member_name

_BLOCK = 512
_REGULAR = (b"0", b"\0")
_DIRECTORY = b"5"
_POSIX_MAGIC = b"ustar\x0000"
# Reads of the header chain are batched: one read brings this many bytes, which usually hold the headers of
# several small members (captions, metadata) and the start of the data that follows.
_READ_AHEAD = 1 << 16


@dataclass(frozen=True)
class MemberRef:
    """Where a member's bytes lie in a local tar: read only when (and as far as) they are needed."""

    path: str
    offset: int
    size: int

    def read(self, limit: int | None = None) -> bytes:
        """The member's bytes, or its first ``limit`` of them; fewer when the file has changed since it was
        indexed (the caller's decoder then finds the data broken)."""
        n = self.size if limit is None else min(limit, self.size)
        if n == 0:
            return b""
        with open(self.path, "rb") as f:
            return os.pread(f.fileno(), n, self.offset)


class TarWindow:
    """Reads members of one open tar, in file order, through a window of the file: the captions and image
    heads of a run of small samples then come from one read."""

    def __init__(self, fd: int):
        self.fd, self.buffer, self.start = fd, b"", 0

    def read(self, ref: MemberRef, limit: int | None = None) -> bytes:
        """``ref.read(limit)``, from the window when it holds those bytes."""
        n = ref.size if limit is None else min(limit, ref.size)
        at = ref.offset - self.start
        if at >= 0 and at + n <= len(self.buffer):
            return self.buffer[at : at + n]
        if n >= _READ_AHEAD:
            return os.pread(self.fd, n, ref.offset)
        self.buffer, self.start = os.pread(self.fd, _READ_AHEAD, ref.offset), ref.offset
        return self.buffer[:n]


def _octal(field: bytes) -> int | None:
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        return None  # base-256 sizes and garbage: left to tarfile


def _checksum_ok(header: bytes) -> bool:
    field = header[148:156]
    stored = _octal(field)
    if stored is None:
        return False
    unsigned = sum(header) - sum(field) + 8 * 32  # the checksum field counts as eight spaces
    if stored == unsigned:
        return True
    # tarfile accepts the signed sum too (some old writers computed it so).
    high = header[:148] + header[156:]
    return stored == unsigned - 256 * (len(high) - len(high.translate(None, bytes(range(128, 256)))))


def _members(path: str, max_member_bytes: int) -> Iterator[tuple[str, int, int]] | None:
    """(name, data offset, size) of every regular member, or None if the tar is not plain (see the module)."""
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            end = os.fstat(f.fileno()).st_size
            buffer, start = b"", 0  # buffer holds the file's bytes [start, start + len(buffer))
            out: list[tuple[str, int, int]] = []
            offset = 0
            while True:
                if offset + _BLOCK > end:
                    return None  # no end-of-archive marker
                if not start <= offset <= start + len(buffer) - _BLOCK:
                    # A jump over a large member reads a small window: what follows it may be large too.
                    ahead = _READ_AHEAD if offset - start - len(buffer) < _READ_AHEAD else 4 * _BLOCK
                    buffer, start = os.pread(f.fileno(), ahead, offset), offset
                    if len(buffer) < _BLOCK:
                        return None
                header = buffer[offset - start : offset - start + _BLOCK]
                if header.count(0) == _BLOCK:
                    # The end-of-archive marker: two zero blocks and nothing after them but zeros.
                    if not out or end - offset < 2 * _BLOCK or not _zeros(f.fileno(), offset, end):
                        return None
                    return iter(out)
                if not _checksum_ok(header):
                    return None
                size = _octal(header[124:136])
                kind = header[156:157]
                name = _name(header)
                if size is None or name is None or offset + _BLOCK + size > end:
                    return None
                if kind in _REGULAR and not name.endswith("/"):
                    if size > max_member_bytes:
                        return None
                    out.append((name, offset + _BLOCK, size))
                elif kind != _DIRECTORY and not (kind in _REGULAR and name.endswith("/")):
                    return None  # links, devices, PAX and GNU headers: tarfile's business
                offset += _BLOCK + -(-size // _BLOCK) * _BLOCK
    except OSError:
        return None


def _name(header: bytes) -> str | None:
    raw = header[:100].split(b"\0", 1)[0]
    if header[257:265] == _POSIX_MAGIC:
        prefix = header[345:500].split(b"\0", 1)[0]
        if prefix:
            raw = prefix + b"/" + raw
    if not raw:
        return None
    return raw.decode("utf-8", "surrogateescape")


def _zeros(fd: int, start: int, end: int) -> bool:
    while start < end:
        chunk = os.pread(fd, min(1 << 20, end - start), start)
        if not chunk or chunk.count(0) != len(chunk):
            return False
        start += len(chunk)
    return True


def index_samples(url: str, max_member_bytes: int) -> list[dict[str, Any]] | None:
    """The samples of a plain local tar, ``{"__key__", "__url__", "<ext>": MemberRef, ...}`` in file order,
    read from the member headers alone; None for a tar that is not plain (the module says which), a
    ``pipe:`` or remote url, or a file that cannot be read: ``read_samples`` then reads it and reports."""
    if url.startswith("pipe:"):
        return None
    path = url.removeprefix("file://")
    if is_remote(path):
        return None
    members = _members(path, max_member_bytes)
    if members is None:
        return None
    samples: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for name, offset, size in members:
        parts = split_member_name(name)
        if parts is None:
            return None
        key, ext = parts
        if current is None or key != current["__key__"]:
            current = {"__key__": key, "__url__": url}
            samples.append(current)
        if ext in current:
            return None
        current[ext] = MemberRef(path, offset, size)
    return samples
