"""An on-disk IVF-PQ index opened for search: ``faiss.index`` with its inverted lists in ``lists.ivfdata``
and a CRC-32 of each list's codes and of its ids in ``lists.crc32.npy``.

``read_disk_index`` opens it with the lists memory-mapped by FAISS (or copied into memory); ``ProbedLists``
searches it reading only the lists a group of queries probes, with ``pread`` through a descriptor opened
once, so that a served index keeps no more of the file resident than one group's lists, and a rebuild that
replaces the file changes nothing it reads. ``search/index.py`` opens stores with these;
``search/ondisk.py`` builds them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from openalign.data.held_file import DamagedFile, HeldFile

LISTS = "lists.ivfdata"
CHECKSUMS = "lists.crc32.npy"  # uint32 [nlist, 2]: CRC-32 of each list's codes, then of its ids


@contextlib.contextmanager
def quiet_c_stdout() -> Iterator[None]:
    # FAISS's on-disk lists print notes ("resizing …", "updating ondisk filename …", the latter on every
    # open) with C printf; they must not land in a command's stdout (``openalign search --json``), so C's
    # stdout is discarded for the call (errors come back as exceptions, not as printed text).
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    libc.fflush(None)
    saved = os.dup(1)
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.close(null)
        yield
    finally:
        libc.fflush(None)
        os.dup2(saved, 1)
        os.close(saved)


def read_disk_index(directory: Path, mmap: bool = True) -> Any:
    """``faiss.index`` of a store, its lists memory-mapped from ``lists.ivfdata`` beside it, or with
    ``mmap`` False copied into memory (the same codes, so the same results)."""
    import faiss

    path = directory / "faiss.index"
    if not (directory / LISTS).is_file():
        raise FileNotFoundError(f"{directory}: {LISTS} is missing (the on-disk inverted lists of {path.name})")
    try:
        with quiet_c_stdout():  # an index that was moved has its lists' file name updated, with a note
            index = faiss.read_index(str(path), faiss.IO_FLAG_ONDISK_SAME_DIR)
    except RuntimeError as err:
        raise ValueError(f"{path}: truncated or damaged ({str(err).strip().splitlines()[-1][:160]})") from None
    if not mmap:
        ivf = faiss.extract_index_ivf(index)
        memory = faiss.ArrayInvertedLists(ivf.nlist, ivf.code_size)
        memory.merge_from(ivf.invlists, 0)  # type: ignore[arg-type]  # faiss stub
        ivf.replace_invlists(memory, True)
        memory.this.disown()  # type: ignore[attr-defined]  # faiss stub
    return index


class ProbedLists:
    """Searches an on-disk IVF index by reading only the lists its queries probe, with ``pread``.

    FAISS's ``OnDiskInvertedLists`` memory-maps the lists file, and every page a query faults in (with the
    neighbours the kernel maps around it) stays in the server's resident set: after enough queries a
    served index is as large in memory as on disk. Here the index holds an in-memory ``ArrayInvertedLists``
    filled, for one group of queries, with just the lists they probe (read from the file, which the page
    cache keeps hot) and freed afterwards. Results are those of the memory-mapped index: the same codes,
    scored by the same ``search_preassigned`` after the same coarse search. A group holds at most
    ``budget_bytes`` of lists (one query's lists at least), so memory is a setting, not the index's size.

    The lists file is opened once, here. Each list read is checked against its recorded CRC-32 (where the
    index has them, which ``require_checksums`` demands) and its ids against the index's size: damage is
    ``DamagedFile``, never a wrong answer.
    """

    def __init__(self, index: Any, lists_path: Path, budget_bytes: int = 64 << 20, require_checksums: bool = False):
        import faiss

        self.index, self.path, self.budget = index, lists_path, budget_bytes  # the index owns the IVF part used below
        self.file = HeldFile(lists_path)
        self.ivf: Any = faiss.extract_index_ivf(index)  # Any: the Python wrappers' signatures, not the stub's
        disk = faiss.downcast_InvertedLists(self.ivf.invlists)  # type: ignore[arg-type]  # faiss stub
        if not isinstance(disk, faiss.OnDiskInvertedLists):
            raise TypeError(f"{lists_path}: the index's lists are not on disk")
        table: Any = disk.lists
        entries = [table.at(n) for n in range(self.ivf.nlist)]
        self.sizes = np.array([e.size for e in entries], np.int64)
        # A list's codes start at its offset; its ids follow its capacity's worth of codes.
        self.codes_at = np.array([e.offset for e in entries], np.int64)
        self.ids_at = self.codes_at + np.array([e.capacity for e in entries], np.int64) * self.ivf.code_size
        self.list_bytes = self.sizes * (self.ivf.code_size + 8)
        del entries, table, disk
        end = int((self.ids_at + self.sizes * 8).max(initial=0))
        if self.file.size() < end:
            raise DamagedFile(lists_path, f"truncated, {self.file.size()} bytes where its lists end at {end}")
        self.checksums = read_checksums(lists_path.with_name(CHECKSUMS), self.ivf.nlist, require_checksums)
        self._swap_lists()  # frees the mapped lists
        self.lock = threading.Lock()  # the index's lists are replaced for each group of queries

    def _swap_lists(self) -> Any:
        """A fresh, empty in-memory list set in the index (the previous one, with its buffers, is freed)."""
        import faiss

        lists: Any = faiss.ArrayInvertedLists(self.ivf.nlist, self.ivf.code_size)
        self.ivf.replace_invlists(lists, True)
        lists.this.disown()  # the index owns it now
        return lists

    def _groups(self, probe: np.ndarray) -> list[tuple[int, int]]:
        """Consecutive query ranges whose probed lists together stay within the budget."""
        groups, start, held = [], 0, np.zeros(self.ivf.nlist, bool)
        total = 0
        for q, row in enumerate(probe):
            row = row[row >= 0]
            new = row[~held[row]]
            add = int(self.list_bytes[new].sum())
            if q > start and total + add > self.budget:
                groups.append((start, q))
                start, total = q, 0
                held[:] = False
                new = row
                add = int(self.list_bytes[row].sum())
            held[new] = True
            total += add
        groups.append((start, len(probe)))
        return groups

    def _read(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """List ``n``'s codes and ids, checked against its checksums and the index's size."""
        size = int(self.sizes[n])
        codes = self.file.read(size * self.ivf.code_size, int(self.codes_at[n]))
        ids = self.file.read(size * 8, int(self.ids_at[n]))
        if self.checksums is not None and (zlib.crc32(codes), zlib.crc32(ids)) != tuple(self.checksums[n].tolist()):
            raise DamagedFile(self.path, f"list {n} fails its checksum")
        found = np.frombuffer(ids, np.int64)
        if found.min() < 0 or found.max() >= self.ivf.ntotal:
            raise DamagedFile(self.path, f"list {n} holds ids outside [0, {self.ivf.ntotal})")
        return np.frombuffer(codes, np.uint8), found

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        import faiss

        queries = np.ascontiguousarray(queries, dtype=np.float32)
        scores = np.empty((len(queries), k), np.float32)
        ids = np.empty((len(queries), k), np.int64)
        with self.lock:
            coarse, probe = self.ivf.quantizer.search(queries, self.ivf.nprobe)
            for a, b in self._groups(probe):
                memory = self._swap_lists()
                try:
                    for n in np.unique(probe[a:b][probe[a:b] >= 0]).tolist():
                        if self.sizes[n]:
                            codes, found = self._read(n)
                            memory.add_entries(n, len(found), faiss.swig_ptr(found), faiss.swig_ptr(codes))
                    scores[a:b], ids[a:b] = self.ivf.search_preassigned(queries[a:b], k, probe[a:b], coarse[a:b])
                finally:
                    self._swap_lists()  # frees this group's lists
        return scores, ids


def read_checksums(path: Path, nlist: int, required: bool) -> np.ndarray | None:
    """The lists' recorded checksums, None where an index has none and none are ``required``."""
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path}: missing; the index records a checksum for each of its lists")
        return None
    try:
        sums: np.ndarray = np.load(path, allow_pickle=False)
    except (ValueError, EOFError) as err:
        raise DamagedFile(path, f"not a checksum table ({err})") from None
    if sums.shape != (nlist, 2) or sums.dtype != np.uint32:
        raise DamagedFile(path, f"expected uint32 [{nlist}, 2] checksums, found {sums.dtype} {list(sums.shape)}")
    return sums
