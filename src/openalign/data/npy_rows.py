"""A ``.npy`` matrix read by rows with plain reads: nothing memory-mapped, so nothing of the file is resident.

Pages a memory map touches count in the process's resident set until the map goes away, and the kernel maps
a neighbourhood of every faulted page with it: a sample of rows spread over a 25 GB crawl, or one candidate
row per lookup over a serving index's rows, reads as gigabytes of RSS through a map. Rows read with
``pread`` land in the page cache only, which the kernel shares and reclaims, so a process's memory stays
what its settings bound.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from openalign.data.held_file import HeldFile

BLOCK = 65_536  # rows per block of a sequential pass
SPAN_BYTES = 4 << 20  # the most one read of ``take`` covers: bounds its buffer at any request
GAP_BYTES = 16 << 10  # unrequested bytes a read may cover between two requested rows rather than seek again


def npy_header(path: Path, held: HeldFile | None = None) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, Fortran order, dtype, byte offset of the data) of a ``.npy`` file, read through ``held`` when
    given; ValueError naming a damaged one."""
    try:
        with open(path, "rb") if held is None else os.fdopen(os.dup(held.fd), "rb") as f:
            f.seek(0)
            version = np.lib.format.read_magic(f)
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read_header(f)
            return tuple(shape), bool(fortran), np.dtype(dtype), f.tell()
    except (ValueError, OSError, EOFError) as err:
        if isinstance(err, OSError) and err.errno is not None:
            raise
        raise ValueError(f"{path}: not a NumPy .npy array ({err})") from None


class NpyRows:
    """A 2-D .npy matrix read by row ranges and row lists with plain reads (nothing mapped, nothing cached).

    With ``hold``, the file is opened once and every read goes through that descriptor, so what is read
    stays the file as opened when its path is replaced or removed (a served index); else each read opens it.
    """

    def __init__(self, path: str | Path, hold: bool = False):
        self.path = Path(path)
        self.file = HeldFile(self.path) if hold else None
        shape, fortran, self.dtype, self.offset = npy_header(self.path, self.file)
        if len(shape) != 2 or not shape[1]:
            raise ValueError(f"{self.path}: expected a 2-D [rows, dim] matrix, got shape {list(shape)}")
        if fortran:
            raise ValueError(f"{self.path}: Fortran-ordered matrix; save it row-major (C order)")
        self.shape: tuple[int, int] = (int(shape[0]), int(shape[1]))
        self.row_bytes = self.shape[1] * self.dtype.itemsize
        need = self.offset + self.shape[0] * self.row_bytes
        have = os.path.getsize(self.path) if self.file is None else self.file.size()
        if have < need:
            raise ValueError(f"{self.path}: truncated, {have} bytes where its header needs {need}")

    def __len__(self) -> int:
        return self.shape[0]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` as an array of the file's dtype."""
        count = max(0, min(stop, len(self)) - start)
        if self.file is not None:
            data = self.file.read(count * self.row_bytes, self.offset + start * self.row_bytes)
            return np.frombuffer(data, self.dtype).reshape(count, self.shape[1])
        with open(self.path, "rb") as f:
            f.seek(self.offset + start * self.row_bytes)
            rows = np.fromfile(f, dtype=self.dtype, count=count * self.shape[1])
        return rows.reshape(count, self.shape[1])

    def mapped(self) -> np.ndarray:
        """The matrix memory-mapped read-only, from the held file when there is one (the version reads see)."""
        if not len(self):
            return np.empty(self.shape, self.dtype)
        file = self.file or HeldFile(self.path)
        try:
            view = mmap.mmap(file.fd, 0, access=mmap.ACCESS_READ)  # the map keeps its own descriptor
        finally:
            if file is not self.file:
                file.close()
        return np.frombuffer(view, self.dtype, len(self) * self.shape[1], self.offset).reshape(self.shape)

    def take(self, rows: np.ndarray) -> np.ndarray:
        """The given rows (any order, repeats allowed) in the file's dtype.

        Rows are read in increasing order; requested rows less than ``GAP_BYTES`` apart share one read, and
        no read spans more than ``SPAN_BYTES``, so a dense request costs a few large reads, a sparse one a
        read per row, and the buffer stays small either way.
        """
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        out = np.empty((len(rows), self.shape[1]), self.dtype)
        if not len(rows):
            return out
        if rows.min() < 0 or rows.max() >= len(self):
            raise IndexError(f"{self.path}: row ids outside [0, {len(self)})")
        order = np.argsort(rows, kind="stable")
        ordered = rows[order]
        gap = max(1, GAP_BYTES // self.row_bytes)
        span = max(1, SPAN_BYTES // self.row_bytes)
        cuts = np.flatnonzero(np.diff(ordered) > gap) + 1
        file = self.file or HeldFile(self.path)
        try:
            for a, b in zip(np.r_[0, cuts].tolist(), np.r_[cuts, len(ordered)].tolist(), strict=True):
                while a < b:  # split a long run so that no read exceeds ``span`` rows
                    lo = int(ordered[a])
                    end = a + int(np.searchsorted(ordered[a:b], lo + span, side="left"))
                    hi = int(ordered[end - 1]) + 1
                    size = (hi - lo) * self.row_bytes
                    buf = file.read(size, self.offset + lo * self.row_bytes)
                    block = np.frombuffer(buf, self.dtype).reshape(hi - lo, self.shape[1])
                    out[order[a:end]] = block[ordered[a:end] - lo]
                    a = end
        finally:
            if file is not self.file:
                file.close()
        return out

    def blocks(self, block: int = BLOCK) -> Iterator[tuple[int, np.ndarray]]:
        for start in range(0, len(self), block):
            yield start, self.read(start, start + block)
