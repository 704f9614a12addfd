"""A file opened once and read by position, and ``DamagedFile``, the fault of one that reads wrong.

A served index reads its files through descriptors it opened when it loaded: a rebuild that replaces the
files, or removes their folder, then changes nothing a loaded version reads, since the kernel keeps a file
open by a descriptor until the descriptor closes. A read that comes back short (the same file cut) or a
block whose checksum no longer matches is ``DamagedFile``: a fault of the side that holds the file.
"""

from __future__ import annotations

import errno
import os
import weakref
from pathlib import Path


class DamagedFile(OSError):
    """A file that reads short or fails its checksum; ``str`` names its path, ``public`` only its name."""

    def __init__(self, path: str | Path, reason: str):
        super().__init__(errno.EIO, reason, os.fspath(path))
        self.path, self.reason = Path(path), reason

    def public(self) -> str:
        """The fault without where the file lives, for a reply to a client."""
        return f"{self.path.name}: {self.reason}"


class HeldFile:
    """A file opened read-only once, read with ``pread`` through that descriptor until it is closed."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDONLY)
        self._close = weakref.finalize(self, os.close, self.fd)

    def size(self) -> int:
        """Bytes in the file as it is now (the file held, not whatever its path names)."""
        return os.fstat(self.fd).st_size

    def read(self, size: int, offset: int) -> bytes:
        """Exactly ``size`` bytes at ``offset``; DamagedFile where the file ends first."""
        parts, got = [], 0
        while got < size:  # one pread returns at most about 2 GB
            part = os.pread(self.fd, size - got, offset + got)
            if not part:
                raise DamagedFile(self.path, f"truncated, {got} of {size} bytes at offset {offset}")
            parts.append(part)
            got += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        self._close()
