"""Indexes over embeddings made elsewhere: one ``.npy`` matrix with a Parquet table of its rows, or the
folder clip-retrieval's inference writes::

    OUT/img_emb/img_emb_0.npy      image embeddings of shard 0 (float16 or float32 [N, D])
    OUT/text_emb/text_emb_0.npy    caption embeddings, row for row (optional)
    OUT/metadata/metadata_0.parquet   image_path, caption, and the source's own columns (url, key, ...)

Every shard is checked before anything is written: a 2-D floating-point matrix, as many rows as its
metadata, the same width in every shard, every number finite. Rows that are not unit length are
normalised (cosine search assumes it) and counted; a zero row has no direction and is an error. The index
has the layout ``build_index`` writes, so ``openalign search`` and ``openalign serve`` query it by
embedding; text and image queries need a model of the same width attached with ``--model``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from openalign.config import to_dict
from openalign.data.npy_rows import NpyRows
from openalign.search.build import PENDING, IndexBuildResult, commit_stage
from openalign.search.catalog import FORMAT, FORMAT_VERSION, INFO, METADATA, SCHEMAS, write_rows
from openalign.search.index import VECTORS, AnnConfig, build_store, choose_kind
from openalign.search.ondisk import DISK_KIND, build_disk_store, write_unit_vectors

UNIT_TOLERANCE = 1e-3  # rows whose length is this far from 1 are normalised


@dataclass(frozen=True)
class ImportResult(IndexBuildResult):
    """``IndexBuildResult`` of an import, with how many rows had to be normalised."""

    normalized: int = 0  # image and caption rows that were not unit length


@dataclass(frozen=True)
class Shard:
    """One part of the input: image embeddings, its metadata table and, optionally, caption embeddings."""

    image: Path
    metadata: Path
    text: Path | None = None


def _number(path: Path) -> int:
    found = re.search(r"(\d+)$", path.stem)
    return int(found.group(1)) if found else -1


def find_shards(embeddings: str | Path, metadata: str | Path | None = None) -> list[Shard]:
    """The shards of ``embeddings``: a ``.npy`` file with ``metadata`` (a ``.parquet`` file), or a
    clip-retrieval output folder (``img_emb/``, ``metadata/``, optional ``text_emb/``) matched by number."""
    root = Path(embeddings)
    if root.is_dir():
        if metadata is not None:
            raise ValueError(f"{root} is a folder of shards; its metadata/ is read, so drop --metadata")
        images = sorted((root / "img_emb").glob("img_emb_*.npy"), key=_number)
        if not images:
            raise FileNotFoundError(f"{root}: no img_emb/img_emb_*.npy (clip-retrieval's inference output)")
        tables = {_number(p): p for p in (root / "metadata").glob("metadata_*.parquet")}
        texts = {_number(p): p for p in (root / "text_emb").glob("text_emb_*.npy")}
        shards = []
        for image in images:
            n = _number(image)
            if n not in tables:
                raise FileNotFoundError(f"{image}: no metadata/metadata_{image.stem[8:]}.parquet beside it")
            if texts and n not in texts:
                raise FileNotFoundError(f"{image}: text_emb/ has no text_emb_{image.stem[8:]}.npy for it")
            shards.append(Shard(image, tables[n], texts.get(n)))
        orphans = sorted(set(tables) - {_number(image) for image in images})
        if orphans:  # an embedding shard went missing: its rows would silently drop out of the index
            raise FileNotFoundError(f"{tables[orphans[0]]}: no img_emb/img_emb_{orphans[0]}.npy for it")
        return shards
    if not root.is_file():
        raise FileNotFoundError(f"{root}: no such embeddings file or folder")
    if metadata is None:
        raise ValueError(f"{root}: --metadata (a Parquet table, one row per embedding) is required with a .npy file")
    if not Path(metadata).is_file():
        raise FileNotFoundError(f"{metadata}: no such metadata file")
    return [Shard(root, Path(metadata))]


def _open_matrix(path: Path) -> np.ndarray:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(f"{path}: not a NumPy .npy array ({err})") from None
    if not isinstance(array, np.ndarray):
        raise ValueError(f"{path}: holds several arrays (.npz); give one [N, D] .npy matrix")
    if array.ndim != 2 or not array.shape[1]:
        raise ValueError(f"{path}: expected a 2-D [rows, dim] matrix, got shape {list(array.shape)}")
    if array.dtype.kind != "f":
        raise ValueError(f"{path}: expected floating-point embeddings, got {array.dtype}")
    return array


def _rows(path: Path) -> int:
    try:
        return int(pq.ParquetFile(path).metadata.num_rows)
    except (pa.ArrowInvalid, OSError) as err:
        raise ValueError(f"{path}: not a readable Parquet table ({err})") from None


def check_shards(shards: list[Shard]) -> tuple[int, int, bool]:
    """(rows, dim, has captions) after checking shapes, types and row counts; ValueError naming the file."""
    dim, total = None, 0
    with_text = shards[0].text is not None
    for shard in shards:
        image = _open_matrix(shard.image)
        rows = _rows(shard.metadata)
        if rows != image.shape[0]:
            raise ValueError(f"{shard.image} has {image.shape[0]} rows but {shard.metadata} has {rows}")
        dim = dim or image.shape[1]
        if image.shape[1] != dim:
            raise ValueError(f"{shard.image}: {image.shape[1]}-d embeddings, but {shards[0].image} has {dim}-d")
        if shard.text is not None:
            text = _open_matrix(shard.text)
            if text.shape != image.shape:
                raise ValueError(f"{shard.text}: shape {list(text.shape)}, but {shard.image} is {list(image.shape)}")
        total += rows
    assert dim is not None
    return total, dim, with_text


def _text(table: pa.Table, name: str) -> list[str]:
    if name not in table.column_names:
        return [""] * table.num_rows
    return ["" if v is None else str(v) for v in table.column(name).to_pylist()]


def _image_table(shard: Shard, offset: int) -> pa.Table:
    """Our image metadata from a shard's table: ``image_path`` (or ``path``) is the path, ``key`` the key
    (else the path, else the row number), ``url`` and ``caption`` as they are; other columns are dropped."""
    table = pq.read_table(shard.metadata)
    paths = _text(table, "image_path" if "image_path" in table.column_names else "path")
    keys = _text(table, "key")
    n = table.num_rows
    ids = np.arange(offset, offset + n, dtype=np.int64)
    keys = [k or p or str(i) for k, p, i in zip(keys, paths, ids.tolist(), strict=True)]
    sizes = {side: pa.nulls(n, pa.int32()) for side in ("width", "height")}
    for side in [c for c in sizes if c in table.column_names]:
        try:
            sizes[side] = table.column(side).cast(pa.int32())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as err:
            raise ValueError(f"{shard.metadata}: column {side!r} is not whole numbers ({err})") from None
    columns = [pa.array(ids), keys, paths, _text(table, "url"), _text(table, "caption"), *sizes.values()]
    return pa.Table.from_arrays(columns, schema=SCHEMAS["image"])


def _tables(shards: list[Shard], modality: str) -> Iterator[pa.Table]:
    """Each shard's metadata rows for ``modality``, a shard at a time (never the whole table at once)."""
    offset = 0
    for shard in shards:
        image = _image_table(shard, offset)
        offset += image.num_rows
        if modality == "image":
            yield image
        else:
            ids = image.column("id")
            columns = [ids, ids, image.column("key"), image.column("caption")]
            yield pa.Table.from_arrays(columns, schema=SCHEMAS["text"])


def _write_metadata(path: Path, tables: Iterator[pa.Table], schema: pa.Schema) -> None:
    with pq.ParquetWriter(path, schema) as writer:
        for table in tables:
            writer.write_table(table)


def import_embeddings(
    embeddings: str | Path,
    out: str | Path,
    *,
    metadata: str | Path | None = None,
    ann: AnnConfig | None = None,
    model_path: str | None = None,
    tokenizer_path: str | None = None,
    model_dim: int | None = None,
    image_root: str | Path | None = None,
) -> ImportResult:
    """Write a new index at ``out`` from embeddings made elsewhere (see the module docstring).

    ``model_path`` attaches a model for text and image queries; ``model_dim`` (its embedding width) must
    then equal the embeddings'. ``image_root`` is the folder the metadata's image paths lie in (relative
    ones start there): ``serve`` reads image files only inside it, and none without it. Raises ValueError or
    FileNotFoundError naming the problem before writing.
    """
    if image_root is not None and not Path(image_root).is_dir():
        raise FileNotFoundError(f"image root {image_root}: no such directory")
    out = Path(out)
    if (out / INFO).is_file() or (out / PENDING).is_dir():
        raise ValueError(f"{out} already holds an index; import embeddings into a new directory")
    shards = find_shards(embeddings, metadata)
    total, dim, with_text = check_shards(shards)
    if model_dim is not None and model_dim != dim:
        raise ValueError(f"the model makes {model_dim}-d embeddings but {embeddings} holds {dim}-d ones")
    ann = ann or AnnConfig()
    created = not out.exists()
    stage = out / PENDING / "final"
    try:
        counts: dict[str, int] = {}
        normalized = 0
        # Above the exact size, an import is built shard by shard into on-disk lists unless told otherwise.
        kind = choose_kind(total, dim, ann)
        on_disk = kind == DISK_KIND or (kind == "ivf_pq" and ann.kind == "auto" and ann.on_disk)
        # Captions are what an image store is queried with, so they calibrate its approximate index: first.
        modalities = ["text", "image"] if with_text else ["image"]
        for modality in modalities:
            directory = stage / modality
            directory.mkdir(parents=True, exist_ok=True)
            parts = [s.image if modality == "image" else s.text for s in shards]
            normalized += write_unit_vectors([p for p in parts if p], directory / VECTORS, dim, UNIT_TOLERANCE)
            _write_metadata(directory / METADATA, _tables(shards, modality), SCHEMAS[modality])
            calibration = None
            if modality == "image" and with_text:
                text = NpyRows(stage / "text" / VECTORS)
                calibration = text.take(np.linspace(0, len(text) - 1, min(256, len(text))).astype(int))
            if on_disk:
                write_rows(directory, _tables(shards, modality))
                rows = [len(NpyRows(shard.image)) for shard in shards]
                build_disk_store(directory, rows, ann, calibration, home=out.resolve() / modality).save(directory)
            else:
                vectors = np.load(directory / VECTORS, mmap_mode="r")
                build_store(vectors, ann, calibration).save(directory)
            counts[modality] = total
        info: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "embed_dim": dim,
            "model": model_path,
            "tokenizer": tokenizer_path,
            "captions": with_text,
            "counts": counts,
            "ann": to_dict(ann),
            "sources": [os.fspath(embeddings)],
            "image_roots": [] if image_root is None else [str(Path(image_root).resolve())],
            "skipped": {},
            "imported": {"normalized": normalized},
        }
        (stage / INFO).write_text(json.dumps(info, indent=2) + "\n")
        (stage / "ready").write_text("")
        commit_stage(out)
    except BaseException:
        shutil.rmtree(out if created else out / PENDING, ignore_errors=True)
        raise
    return ImportResult(
        added_images=total,
        added_captions=counts.get("text", 0),
        images=total,
        captions=counts.get("text", 0),
        skipped={},
        already_indexed=0,
        normalized=normalized,
    )
