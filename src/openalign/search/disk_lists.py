"""An on-disk IVF-PQ index opened for search: ``faiss.index`` with its inverted lists in ``lists.ivfdata``.

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from openalign.data.held_file import HeldFile

LISTS = "lists.ivfdata"


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

    The lists file is opened once, here: a file moved over its path later changes nothing read.
    """

    def __init__(self, index: Any, lists_path: Path, budget_bytes: int = 64 << 20):
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
            raise ValueError(f"{lists_path}: truncated, {self.file.size()} bytes where its lists end at {end}")
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
        """List ``n``'s codes and ids."""
        size = int(self.sizes[n])
        codes = self.file.read(size * self.ivf.code_size, int(self.codes_at[n]))
        ids = self.file.read(size * 8, int(self.ids_at[n]))
        return np.frombuffer(codes, np.uint8), np.frombuffer(ids, np.int64)

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
