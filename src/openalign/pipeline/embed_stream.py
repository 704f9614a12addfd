"""The streaming half of ``openalign embed``: the input's parts, decoding in DataLoader worker processes in
input order, and writing a part's files a batch at a time, so that memory depends on the batch size, never on
a part's size.

Decoding. The events of a rank's parts are cut into chunks (up to ``chunk`` consecutive events of one part);
with ``k`` workers, worker ``w`` decodes chunks ``w, w + k, …`` and the DataLoader hands them back round robin,
which is the input order again. Every worker walks the same event stream (reading a shard member is cheap
beside decoding it) and decodes only its own chunks, so the output is the in-process output, bit for bit.

Writing. Vectors go to a ``.npy`` whose header is rewritten with the final row count when the part ends (the
header has a fixed size, so the rows never move); metadata goes through a ``ParquetWriter`` in row groups of
at most ``META_ROWS`` rows. Both are written under temporary names and renamed into place by the caller.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from openalign.data.sources import BadInput, Record, Source, open_parquet, table_format

META_ROWS = 8192  # metadata rows held before they are written as one Parquet row group
NPY_HEADER = 128  # bytes of a .npy header (magic, version, length, the padded dict): room for any shape
MAX_WORKERS = 16  # the default never starts more decoding processes than this per rank


@dataclass
class Item:
    """One input event after the worker's side: a skip reason, or the prepared image and its row."""

    part: int
    skip: str | None = None  # why the event yields no row
    image: Any = None  # what the embedder takes: a transformed tensor (ALIGN) or a PIL image
    caption: str = ""
    meta: tuple[str, str, str] = ("", "", "")  # image_path, key, url


Prepare = Callable[[int, Record | BadInput], Item]


def default_workers(local_world: int) -> int:
    """The cores this process may run on, shared among the ranks of its node, at most ``MAX_WORKERS``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform
        cores = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores // max(1, local_world)))


def _chunks(events: Iterator[tuple[int, Record | BadInput]], size: int) -> Iterator[list[tuple[int, Any]]]:
    """Runs of up to ``size`` consecutive events of one part."""
    chunk: list[tuple[int, Any]] = []
    for part, event in events:
        if chunk and (len(chunk) == size or chunk[0][0] != part):
            yield chunk
            chunk = []
        chunk.append((part, event))
    if chunk:
        yield chunk


def _identity(chunk: list[Item]) -> list[Item]:
    return chunk


def _make_dataset(events: Callable[[], Iterator[tuple[int, Record | BadInput]]], prepare: Prepare, size: int) -> Any:
    from torch.utils.data import IterableDataset, get_worker_info

    class Chunks(IterableDataset):
        def __iter__(self) -> Iterator[list[Item]]:
            info = get_worker_info()
            share, me = (info.num_workers, info.id) if info is not None else (1, 0)
            for n, chunk in enumerate(_chunks(events(), size)):
                if n % share == me:
                    yield [prepare(part, event) for part, event in chunk]

    return Chunks()


def decoded_items(
    events: Callable[[], Iterator[tuple[int, Record | BadInput]]], prepare: Prepare, *, chunk: int, workers: int
) -> Iterator[Item]:
    """``prepare(part, event)`` of every event of ``events()``, in order; by ``workers`` processes (0: here).

    ``events`` is called once in each worker (and once here without workers)."""
    dataset = _make_dataset(events, prepare, chunk)
    if workers == 0:
        for items in dataset:
            yield from items
        return
    from torch.utils.data import DataLoader

    # batch_size=None: each chunk is one DataLoader item; two chunks ahead per worker bound the memory.
    loader = DataLoader(dataset, batch_size=None, num_workers=workers, collate_fn=_identity, prefetch_factor=2)
    try:
        for items in loader:
            yield from items
    except RuntimeError as err:
        if not str(err).startswith("DataLoader worker"):
            raise
        raise WorkerDied(
            f"a decoding worker {str(err).removeprefix('DataLoader worker ')} (killed, or out of memory); "
            "finished parts are kept: run the command again to resume"
        ) from None


class WorkerDied(ChildProcessError):
    """A decoding process ended without a word (a kill, the kernel's out-of-memory killer): one line, since
    its traceback is the DataLoader's and says nothing the user can act on."""


# --------------------------------------------------------------------------------------------------
# Parts


def _chunked_events(source: Source, chunk_rows: int) -> Iterator[tuple[int, Record | BadInput]]:
    """(part, event) of a table or folder: a record's part is its row // chunk_rows; a skipped row is counted
    in the part of the row after the last record (rows skipped by the reader are rows too)."""
    next_row = 0
    for event in source.events():
        if isinstance(event, Record):
            next_row = event.index + 1
            yield event.index // chunk_rows, event
        else:
            yield next_row // chunk_rows, event
            next_row += 1


def _parquet(source: Source) -> bool:
    return source.kind == "table" and source.table is not None and table_format(source.table) == "parquet"


def count_parts(source: Source, chunk_rows: int) -> int:
    """Shards: one part each. A table or folder: its rows in chunks (one pass over the rows, no image read)."""
    if source.kind == "shards":
        return len(source.urls)
    if _parquet(source):
        assert source.table is not None
        return -(-int(open_parquet(source.table).metadata.num_rows) // chunk_rows)  # the footer: no row read
    last = -1
    for part, _ in _chunked_events(source, chunk_rows):
        last = part
    return last + 1


def part_events(source: Source, chunk_rows: int, wanted: set[int]) -> Iterator[tuple[int, Record | BadInput]]:
    """(part, event) for the ``wanted`` parts, in input order; shards outside them are not opened."""
    if source.kind == "shards":
        for i, url in enumerate(source.urls):
            if i in wanted:
                for event in dataclasses.replace(source, urls=(url,)).events():
                    yield i, event
        return
    if _parquet(source):  # each part's own rows only: a rank never reads the image bytes of another's
        for part in sorted(wanted):
            rows = (part * chunk_rows, (part + 1) * chunk_rows)
            for event in dataclasses.replace(source, rows=rows).events():
                yield part, event
        return
    for part, event in _chunked_events(source, chunk_rows):
        if part in wanted:
            yield part, event


def part_name(source: Source, part: int, chunk_rows: int) -> str:
    if source.kind == "shards":
        return source.urls[part]
    return f"{source.spec} rows {part * chunk_rows}..{(part + 1) * chunk_rows - 1}"


# --------------------------------------------------------------------------------------------------
# Files


def npy_header(rows: int, dim: int, dtype: str) -> bytes:
    """A version 1.0 ``.npy`` header of exactly ``NPY_HEADER`` bytes for a C-order [rows, dim] array."""
    text = f"{{'descr': '{np.dtype(dtype).str}', 'fortran_order': False, 'shape': ({rows}, {dim}), }}"
    body = text.encode("latin1")
    pad = NPY_HEADER - 10 - len(body) - 1
    if pad < 0:
        raise ValueError(f"a [{rows}, {dim}] array's .npy header does not fit in {NPY_HEADER} bytes")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body) + pad + 1) + body + b" " * pad + b"\n"


class NpyAppender:
    """A [rows, dim] ``.npy`` file written a block of rows at a time; ``close`` writes the true row count."""

    def __init__(self, path: Path, dim: int, dtype: str):
        self.path, self.dim, self.dtype, self.rows = path, dim, dtype, 0
        self.file = open(path, "wb")  # noqa: SIM115 (closed by close())
        self.file.write(npy_header(0, dim, dtype))

    def append(self, block: np.ndarray) -> None:
        if block.ndim != 2 or block.shape[1] != self.dim:
            raise ValueError(f"{self.path}: rows of width {self.dim} expected, got shape {block.shape}")
        self.file.write(np.ascontiguousarray(block, dtype=self.dtype).tobytes())
        self.rows += len(block)

    def close(self) -> None:
        self.file.seek(0)
        self.file.write(npy_header(self.rows, self.dim, self.dtype))
        self.file.close()


class MetadataWriter:
    """String columns to a Parquet file, ``META_ROWS`` rows per row group at most."""

    def __init__(self, path: Path, columns: tuple[str, ...]):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.columns = columns
        self.schema = pa.schema([(name, pa.string()) for name in columns])
        self.writer = pq.ParquetWriter(path, self.schema)
        self.pending: list[tuple[str, ...]] = []
        self.rows = 0

    def append(self, row: tuple[str, ...]) -> None:
        self.pending.append(row)
        self.rows += 1
        if len(self.pending) >= META_ROWS:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self.pending:
            cols = list(zip(*self.pending, strict=True))
            self.writer.write_table(pa.table(dict(zip(self.columns, cols, strict=True)), schema=self.schema))
            self.pending.clear()

    def close(self) -> None:
        self._flush()
        self.writer.close()
