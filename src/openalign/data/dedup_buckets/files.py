"""One side of the search as files: ``.npy`` embedding matrices read by row, and the keys of their rows.

A side is a list of matrices (clip-retrieval's ``img_emb/img_emb_XXXX.npy`` shards, or one ``.npy``)
whose rows are numbered globally in file order; keys come from each file's metadata table (a Parquet
file with a key column) or from one list for the whole side. Nothing here holds a whole side in memory:
matrices are memory-mapped and a key column is read one file at a time, when a key is asked for.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import overload

import numpy as np

from openalign.data.dedup import _normalised, load_embeddings
from openalign.data.npy_rows import NpyRows


@dataclass(frozen=True)
class EmbeddingFiles:
    """The matrices of one side, in row order, and where their keys are.

    ``metadata[f]`` is the Parquet table of file f's rows (its ``key_column`` names them); alternatively
    ``keys`` names every row of the side. Without either, rows are reported by number.
    """

    files: tuple[Path, ...]
    metadata: tuple[Path, ...] | None = None
    keys: Sequence[str] | None = None
    key_column: str = "key"

    def __post_init__(self) -> None:
        if not self.files:
            raise ValueError("no embedding files")
        if self.metadata is not None and len(self.metadata) != len(self.files):
            raise ValueError(f"{len(self.metadata)} metadata tables for {len(self.files)} embedding files")

    def open(self) -> OpenFiles:
        return OpenFiles(self)


class OpenFiles:
    """Memory-mapped matrices of a side with their row offsets; rows are read by global number."""

    def __init__(self, spec: EmbeddingFiles):
        self.spec = spec
        self.arrays = [load_embeddings(p) for p in spec.files]
        dims = {a.shape[1] for a in self.arrays}
        if len(dims) != 1:
            raise ValueError(f"{spec.files[0].parent}: embedding files of different widths {sorted(dims)}")
        self.dim = dims.pop()
        # Row reads go through plain reads; a column-major file (rare) is read through its map.
        self.readers = [
            NpyRows(p) if a.flags.c_contiguous else None for p, a in zip(spec.files, self.arrays, strict=True)
        ]
        self.offsets = np.concatenate([[0], np.cumsum([len(a) for a in self.arrays])]).astype(np.int64)
        self.rows = int(self.offsets[-1])
        if spec.keys is not None and len(spec.keys) != self.rows:
            raise ValueError(f"{len(spec.keys)} keys for {self.rows} embeddings")
        if spec.metadata is not None:
            for table, array, path in zip(spec.metadata, self.arrays, spec.files, strict=True):
                _check_metadata(table, spec.key_column, len(array), path)

    @property
    def named(self) -> bool:
        """Whether rows have keys (else they are reported by number)."""
        return self.spec.keys is not None or self.spec.metadata is not None

    def chunks(self, size: int) -> Iterator[tuple[int, np.ndarray]]:
        """(first global row, rows) of at most ``size`` rows, never crossing a file: memory is one chunk.

        Chunks are read with plain file reads rather than through the memory map, so a pass over the whole
        crawl leaves no file pages mapped into the process (its resident size stays one chunk).
        """
        for offset, array, reader in zip(self.offsets[:-1], self.arrays, self.readers, strict=True):
            for s in range(0, len(array), size):
                rows = reader.read(s, s + size) if reader is not None else np.asarray(array[s : s + size])
                yield int(offset) + s, np.asarray(rows, dtype=np.float32)

    def take(self, rows: np.ndarray) -> np.ndarray:
        """Rows by global number (any order), as float32 [len(rows), D], read without the memory map (a sample
        spread over the crawl would otherwise map most of its pages into the process)."""
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((len(rows), self.dim), dtype=np.float32)
        if rows.size and (rows.min() < 0 or rows.max() >= self.rows):
            raise IndexError(f"row ids outside [0, {self.rows})")
        file_of = np.searchsorted(self.offsets, rows, side="right") - 1
        for f in np.unique(file_of):
            at = np.flatnonzero(file_of == f)
            local = rows[at] - self.offsets[f]
            reader = self.readers[f]
            if reader is not None:
                out[at] = reader.take(local)
            else:
                order = np.argsort(local, kind="stable")  # ascending reads are sequential on disk
                out[at[order]] = self.arrays[f][local[order]]
        return out

    def unit_rows(self, rows: np.ndarray) -> np.ndarray:
        """Rows by global number, L2-normalised exactly as the in-memory search normalises them."""
        return _normalised(self.take(rows))[0]

    def key_list(self, cache_files: int = 4) -> ShardKeys:
        return ShardKeys(self, cache_files)


def _check_metadata(table: Path, column: str, rows: int, matrix: Path) -> None:
    """Before any work: the table reads, has the key column and one row per embedding (ValueError naming it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(table)
    except (pa.ArrowInvalid, OSError) as err:
        raise ValueError(f"{table}: not a readable Parquet table ({err})") from None
    names = meta.schema_arrow.names
    if column not in names:
        raise ValueError(f"{table}: no {column!r} column to name the rows by (columns: {', '.join(names)})")
    if meta.metadata.num_rows != rows:
        raise ValueError(f"{table} has {meta.metadata.num_rows} rows but {matrix} has {rows}")


class ShardKeys(Sequence[str]):
    """Keys of a side by global row, read from one metadata table at a time (a few kept in memory)."""

    def __init__(self, files: OpenFiles, cache_files: int = 4):
        self.files = files
        self.cache: OrderedDict[int, list[str]] = OrderedDict()
        self.cache_files = max(1, cache_files)

    def __len__(self) -> int:
        return self.files.rows

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...
    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        if isinstance(i, slice):
            return [self[n] for n in range(*i.indices(len(self)))]
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(i)
        spec = self.files.spec
        if spec.keys is not None:
            return str(spec.keys[i])
        if spec.metadata is None:
            return str(i)
        f = int(np.searchsorted(self.files.offsets, i, side="right") - 1)
        return self._file_keys(f)[i - int(self.files.offsets[f])]

    def _file_keys(self, f: int) -> list[str]:
        if f in self.cache:
            self.cache.move_to_end(f)
            return self.cache[f]
        import pyarrow.parquet as pq

        assert self.files.spec.metadata is not None
        path, column = self.files.spec.metadata[f], self.files.spec.key_column
        keys = [str(k) for k in pq.read_table(path, columns=[column]).column(column).to_pylist()]
        self.cache[f] = keys
        if len(self.cache) > self.cache_files:
            self.cache.popitem(last=False)
        return keys
