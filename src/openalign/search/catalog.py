"""An index directory on disk: image and caption vector stores, Parquet metadata aligned with vector ids,
and thumbnails, opened memory-mapped.

Layout::

    INDEX/index.json               format marker, embedding width, model, counts, skipped inputs
    INDEX/image/vectors.npy        float32 [N, D]; row i is image id i
    INDEX/image/metadata.parquet   id, key, path, url, caption, width, height (row i = id i)
    INDEX/image/thumbs.bin         JPEG thumbnails back to back; thumbs.idx.npy holds N+1 offsets
    INDEX/image/ann.json, faiss.index   the approximate index, when the store is large enough
    INDEX/image/lists.ivfdata      an on-disk IVF-PQ index's inverted lists (read by the lists probed)
    INDEX/image/lists.crc32.npy    the CRC-32 of each list's codes and ids, checked as a list is read
    INDEX/image/rows.bin           imported indexes: each metadata row as JSON, back to back; rows.idx.npy
                                   holds N+1 offsets, so serving reads only the rows of its results
    INDEX/text/...                 the caption store: id, image_id, key, caption
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from openalign.data.held_file import DamagedFile, HeldFile
from openalign.data.npy_rows import npy_header
from openalign.search.index import VectorStore, read_json, read_matrix

FORMAT = "openalign-index"
FORMAT_VERSION = 1
INFO = "index.json"
METADATA = "metadata.parquet"
THUMBS = "thumbs.bin"
THUMBS_INDEX = "thumbs.idx.npy"
ROWS = "rows.bin"
ROWS_INDEX = "rows.idx.npy"
Modality = Literal["image", "text"]
MODALITIES: tuple[str, ...] = ("image", "text")

IMAGE_SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("key", pa.string()),
        ("path", pa.string()),
        ("url", pa.string()),
        ("caption", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
    ]
)
TEXT_SCHEMA = pa.schema([("id", pa.int64()), ("image_id", pa.int64()), ("key", pa.string()), ("caption", pa.string())])
SCHEMAS = {"image": IMAGE_SCHEMA, "text": TEXT_SCHEMA}


class Thumbnails:
    """Encoded thumbnails addressed by image id: one blob file plus an offsets array, both memory-mapped."""

    def __init__(self, blob: np.ndarray | None, offsets: np.ndarray | None):
        self.blob = blob
        self.offsets = offsets

    @classmethod
    def open(cls, directory: Path) -> Thumbnails:
        if not (directory / THUMBS_INDEX).is_file():
            return cls(None, None)
        offsets = read_matrix(directory / THUMBS_INDEX)
        size = int(offsets[-1]) if len(offsets) else 0
        blob = np.memmap(directory / THUMBS, dtype=np.uint8, mode="r") if size else np.empty(0, np.uint8)
        if len(blob) < size:
            raise ValueError(f"{directory / THUMBS}: truncated, {len(blob)} bytes where {THUMBS_INDEX} needs {size}")
        return cls(blob, offsets)

    def __len__(self) -> int:
        return 0 if self.offsets is None else len(self.offsets) - 1

    def get(self, image_id: int) -> bytes | None:
        if self.offsets is None or self.blob is None or not 0 <= image_id < len(self):
            return None
        start, end = int(self.offsets[image_id]), int(self.offsets[image_id + 1])
        return bytes(self.blob[start:end]) if end > start else None


class RowFile:
    """Metadata rows addressed by id without loading the table: JSON rows back to back in ``rows.bin`` and
    N+1 offsets in ``rows.idx.npy``, so a lookup reads only the bytes of its rows.

    Both are read with ``pread``, not memory-mapped: a served lookup touches a few scattered rows, and every
    page a map faults in (with the neighbours the kernel maps around it) would stay in the server's resident
    set, which then grows towards the file's size with the queries served. Both are opened once, so a rebuilt
    index moved over this one's folder changes nothing it reads.
    """

    def __init__(self, directory: Path):
        self.rows_path, index_path = directory / ROWS, directory / ROWS_INDEX
        self.index_file = HeldFile(index_path)
        shape, _, dtype, self.index_offset = npy_header(index_path, self.index_file)
        if len(shape) != 1 or dtype != np.dtype("<i8"):
            raise ValueError(f"{index_path}: expected 1-d int64 offsets, got {np.dtype(dtype)} {list(shape)}")
        self.num_rows = max(0, int(shape[0]) - 1)
        if self.index_file.size() < self.index_offset + 8 * int(shape[0]):
            raise ValueError(f"{index_path}: truncated, fewer offsets than its header says")
        if not self.rows_path.is_file():
            raise FileNotFoundError(f"{self.rows_path}: missing; {ROWS_INDEX} points into it")
        self.rows_file = HeldFile(self.rows_path)
        size = self._bounds(np.array([self.num_rows - 1]))[0, 1] if self.num_rows else 0
        have = self.rows_file.size()
        if have < size:
            raise ValueError(f"{self.rows_path}: truncated, {have} bytes where {ROWS_INDEX} needs {size}")

    def _bounds(self, ids: np.ndarray) -> np.ndarray:
        """[len(ids), 2] byte ranges of rows ``ids`` in ``rows.bin``: offsets i and i + 1, one 16-byte read."""
        data = b"".join(self.index_file.read(16, self.index_offset + 8 * i) for i in ids.tolist())
        return np.frombuffer(data, "<i8").reshape(-1, 2)

    def take(self, ids: list[int] | np.ndarray) -> list[dict[str, Any]]:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        bad = ids[(ids < 0) | (ids >= self.num_rows)]
        if len(bad):
            raise IndexError(f"row {int(bad[0])} is out of range for {self.num_rows} rows")
        out = []
        for (start, end), row in zip(self._bounds(ids).tolist(), ids.tolist(), strict=True):
            try:
                if not 0 <= start <= end:
                    raise ValueError("offsets out of order")
                out.append(json.loads(self.rows_file.read(end - start, start)))
            except ValueError:  # JSON and UTF-8 errors are ValueErrors
                raise DamagedFile(self.rows_path, f"row {row} is not the JSON object {ROWS_INDEX} points to") from None
        return out


def write_rows(directory: Path, tables: Iterable[pa.Table], batch_rows: int = 65_536) -> int:
    """Write ``rows.bin`` and ``rows.idx.npy`` from ``tables`` (one after another, ``batch_rows`` rows at a
    time); returns the row count.

    The offsets go to a raw file as they are made and get their ``.npy`` header at the end, so memory is one
    batch of rows whatever the number of rows (a Python list of offsets would cost tens of bytes a row).
    """
    raw = directory / (ROWS_INDEX + ".raw")
    count, end = 0, 0
    with open(directory / ROWS, "wb") as blob, open(raw, "wb") as index:
        index.write(np.zeros(1, "<i8").tobytes())
        for table in tables:
            for batch in table.to_batches(max_chunksize=batch_rows):
                lengths = []
                for row in batch.to_pylist():
                    data = json.dumps(row, ensure_ascii=False, separators=(",", ":")).encode()
                    blob.write(data)
                    lengths.append(len(data))
                ends = end + np.cumsum(np.asarray(lengths, dtype=np.int64))
                index.write(ends.astype("<i8").tobytes())
                end, count = int(ends[-1]) if len(ends) else end, count + len(lengths)
    with open(directory / ROWS_INDEX, "wb") as out, open(raw, "rb") as src:
        np.lib.format.write_array_header_1_0(out, {"descr": "<i8", "fortran_order": False, "shape": (count + 1,)})
        shutil.copyfileobj(src, out, 1 << 20)
    raw.unlink()
    return count


def read_metadata(directory: Path) -> pa.Table | RowFile:
    """A store's row file when it has one, else its ``metadata.parquet``; a missing or unreadable one is
    one line naming it."""
    if (directory / ROWS_INDEX).is_file():
        return RowFile(directory)

    """A store's ``metadata.parquet``; a missing or unreadable one is one line naming it."""
    path = directory / METADATA
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; {directory}/vectors.npy has no metadata (the index is incomplete)")
    try:
        return pq.read_table(path, memory_map=True)
    except (pa.ArrowException, OSError) as err:
        text = " ".join(str(err).split())[:160]
        raise ValueError(f"{path}: not a readable Parquet table ({text})") from None


class SearchIndex:
    """An opened index directory: vector stores, metadata and thumbnails of images (and captions)."""

    def __init__(
        self, root: Path, info: dict[str, Any], stores: dict[str, VectorStore], meta: dict[str, pa.Table | RowFile]
    ):
        self.root = root
        self.info = info
        self.stores = stores
        self.meta = meta
        self.thumbnails = Thumbnails.open(root / "image")

    @classmethod
    def open(cls, path: str | Path, mmap: bool = True) -> SearchIndex:
        """Open ``path`` (written by ``build_index``); vectors are memory-mapped unless ``mmap`` is False."""
        root = Path(path)
        info_path = root / INFO
        if not info_path.is_file():
            raise FileNotFoundError(f"{root}: not an openalign index (no {INFO})")
        info = read_json(info_path)
        if info.get("format") != FORMAT:
            raise ValueError(f"{info_path}: format is {info.get('format')!r}, expected {FORMAT!r}")
        stores: dict[str, VectorStore] = {}
        meta: dict[str, pa.Table | RowFile] = {}
        for modality in MODALITIES:
            directory = root / modality
            if not (directory / "vectors.npy").is_file():
                continue
            store = VectorStore.load(directory, mmap=mmap)
            table = read_metadata(directory)
            if table.num_rows != store.size:
                raise ValueError(f"{directory}: {table.num_rows} metadata rows for {store.size} vectors")
            if store.size and store.dim != info["embed_dim"]:
                raise ValueError(f"{directory}: vectors are {store.dim}-d, index.json says {info['embed_dim']}")
            stores[modality], meta[modality] = store, table
        if "image" not in stores:
            raise FileNotFoundError(f"{root}: the index has no image store")
        return cls(root, info, stores, meta)

    @property
    def embed_dim(self) -> int:
        return int(self.info["embed_dim"])

    def size(self, modality: str = "image") -> int:
        return self.stores[modality].size if modality in self.stores else 0

    def store(self, modality: str) -> VectorStore:
        if modality not in MODALITIES:
            raise ValueError(f"unknown modality {modality!r}; expected 'image' or 'text'")
        if modality not in self.stores:
            raise ValueError("this index has no caption store; rebuild it with captions to search captions")
        return self.stores[modality]

    def rows(self, modality: str, ids: list[int] | np.ndarray) -> list[dict[str, Any]]:
        """Metadata rows of ``ids`` (in that order) as dicts."""
        table = self.meta[modality]
        if len(ids) == 0:
            return []
        if isinstance(table, RowFile):
            return table.take(ids)
        rows: list[dict[str, Any]] = table.take(pa.array(np.asarray(ids, dtype=np.int64))).to_pylist()
        return rows

    def image_roots(self) -> list[Path]:
        """The folders this index's image files were declared to lie in (``index build`` records its input's,
        ``index import --image-root`` the one given), with links resolved; none for shards."""
        return [Path(os.path.realpath(root)) for root in self.info.get("image_roots") or []]

    def image_file(self, image_id: int) -> Path | None:
        """The file image ``image_id``'s row names, only if it lies inside one of ``image_roots`` once ``..``
        and links are resolved (a relative path starts at the first root); else None."""
        roots = self.image_roots()
        if not roots or not 0 <= image_id < self.size("image"):
            return None
        recorded = self.rows("image", [image_id])[0].get("path")
        if not recorded or "\0" in recorded:
            return None
        real = Path(os.path.realpath(roots[0] / recorded))
        if not any(real.is_relative_to(root) for root in roots) or not real.is_file():
            return None
        return real

    def vector(self, modality: str, item_id: int) -> np.ndarray:
        """The stored (normalised) embedding of one item."""
        store = self.store(modality)
        if not 0 <= item_id < store.size:
            raise KeyError(f"no {modality} with id {item_id} (the index holds {store.size})")
        return np.asarray(store.vectors[item_id], dtype=np.float32)

    def summary(self) -> dict[str, Any]:
        return {
            "images": self.size("image"),
            "captions": self.size("text"),
            "embed_dim": self.embed_dim,
            "index": {m: s.kind for m, s in self.stores.items()},
            "model": self.info.get("model"),
        }
