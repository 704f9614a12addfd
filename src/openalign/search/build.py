"""Building and growing an index directory from a folder of images or WebDataset shards.

Inputs are read in a fixed order and cut into chunks of ``chunk_size`` items. Each chunk's embeddings,
metadata and thumbnails are written to ``INDEX/pending/chunk-NNNNNN`` and appear there only once
complete, so an interrupted build picks up after the last finished chunk. When every chunk is done the
new rows are appended behind the existing ones (ids never change), the approximate index is extended or
rebuilt, and the result is staged under ``pending/final`` and moved into place, ``index.json`` last.
Items whose key is already in the index are skipped, so running a build again over a grown folder adds
only the new images. Unreadable images are skipped and counted by reason.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from PIL import Image
from tqdm import tqdm

from openalign.config import ConfigError, from_dict, to_dict
from openalign.data.sources import (
    DEFAULT_MAX_FILE_BYTES,
    BadInput,
    Record,
    Source,
    batched,
    file_limit,
    open_source,
)
from openalign.data.transforms import decode_image, model_transform
from openalign.outputs import refuse_input_as_output
from openalign.search.catalog import (
    FORMAT,
    FORMAT_VERSION,
    INFO,
    METADATA,
    SCHEMAS,
    THUMBS,
    THUMBS_INDEX,
    SearchIndex,
    read_metadata,
)
from openalign.search.index import (
    AnnConfig,
    VectorStore,
    ann_config,
    build_store,
    extend_store,
    read_json,
    save_vectors,
)

if TYPE_CHECKING:
    from openalign.model.dual_encoder import DualEncoder
    from openalign.text.tokenizer import TextTokenizer

PENDING = "pending"


@dataclass(frozen=True)
class IndexBuildResult:
    """What one ``build_index`` run did, and the index's size after it."""

    added_images: int  # images this run added
    added_captions: int  # captions this run added (0 without a caption store)
    images: int  # images in the index now
    captions: int  # captions in the index now
    skipped: dict[str, int]  # items this run could not read, by reason
    already_indexed: int  # items whose key the index already held

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class BuildConfig:
    """How ``build_index`` reads, embeds and stores items."""

    captions: bool = False  # also build a caption store (image → text search)
    chunk_size: int = 1024  # items per resumable chunk
    batch_size: int = 64  # images per forward pass (captions use 4× this)
    thumbnail_size: int = 256  # longest side of stored JPEG thumbnails; 0 stores none
    max_pixels: int = 64_000_000  # larger images are skipped as "too_large"
    max_file_mb: float = 64.0  # larger image files (and shard members) are skipped unread as too_large_file
    # table input: also read image paths that resolve outside the table's folder (else skipped as outside_root)
    allow_outside_root: bool = False
    device: str = "cpu"
    ann: AnnConfig = field(default_factory=AnnConfig)


def build_config(data: dict[str, Any] | None = None, **overrides: Any) -> BuildConfig:
    """A validated BuildConfig from a mapping with strict keys (``ann`` nested), plus overrides."""
    cfg = from_dict(BuildConfig, {**(data or {}), **overrides})
    if cfg.chunk_size < 1 or cfg.batch_size < 1:
        raise ConfigError("chunk_size and batch_size must be at least 1")
    if cfg.thumbnail_size < 0:
        raise ConfigError(f"thumbnail_size must be ≥ 0, got {cfg.thumbnail_size}")
    try:
        file_limit(cfg.max_file_mb)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    cfg.ann = ann_config(cfg.ann)
    return cfg


@dataclass
class Item:
    """One input image: where it comes from, its caption, and a way to read its bytes."""

    key: str
    path: str
    read: Callable[[], bytes]
    caption: str = ""
    url: str = ""


# --------------------------------------------------------------------------------------------------
# Sources


def _item(record: Record, on_error: Callable[[str, str], None]) -> Item:
    """An index item from a source record. Keys are what an index stores and grows by: a folder image's path
    relative to the folder, ``SHARD.tar/KEY`` for a shard sample, the key (or row number) of a table row."""
    if record.kind == "folder":
        assert record.path is not None
        return Item(record.key, str(record.path.resolve()), record.read, record.caption or "")
    if record.kind == "shards":
        key = f"{Path(record.origin).name}/{record.key}"
        url = ""
        if record.raw_meta is not None:
            try:
                url = str(record.metadata().get("url") or "")
            except BadInput:
                on_error("bad_json", key)
        return Item(key, record.origin, record.read, record.caption or "", url)
    meta = record.metadata()
    return Item(record.key, record.origin, record.read, record.caption or "", str(meta.get("url") or ""))


def _with_root(roots: list[str], opened: Source) -> list[str]:
    """``roots`` and the folder ``opened``'s image files lie in, which ``serve`` may read an image from when it
    has no thumbnail (shard samples have none outside their tars)."""
    folder = opened.image_folder()
    here = [] if folder is None else [str(folder.resolve())]
    return [*roots, *(r for r in here if r not in roots)]


def iter_source(
    source: str | Path | Source,
    on_error: Callable[[str, str], None],
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    allow_outside_root: bool = False,
) -> Iterator[Item]:
    """Every item of an image folder (recursive; ``foo.txt`` beside ``foo.jpg`` is its caption), a table or
    WebDataset shards (``openalign.data.sources.open_source``, which skips files over ``max_file_bytes`` and a
    table's image paths outside its folder unless ``allow_outside_root``); skipped items go to ``on_error``.
    Recognising the input happens here (or was done by the caller), so a missing one raises before the first
    item."""
    opened = (
        source
        if isinstance(source, Source)
        else open_source(source, max_file_bytes=max_file_bytes, allow_outside_root=allow_outside_root)
    )
    return (_item(record, on_error) for record in opened.records(on_error))


# --------------------------------------------------------------------------------------------------
# Chunks


def make_thumbnail(image: Image.Image, size: int) -> bytes:
    """A JPEG no larger than ``size`` on its longest side."""
    thumb = image.copy()
    thumb.thumbnail((size, size), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    thumb.save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def _write_chunk(
    directory: Path,
    image_vecs: np.ndarray,
    image_rows: list[dict],
    thumbs: list[bytes],
    text_vecs: np.ndarray | None,
    text_rows: list[dict],
    skipped: Counter,
    seen: int,
) -> None:
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    np.save(tmp / "image.npy", image_vecs)
    pq.write_table(pa.Table.from_pylist(image_rows, schema=_chunk_schema("image")), tmp / "image.parquet")
    offsets = np.zeros(len(thumbs) + 1, np.int64)
    offsets[1:] = np.cumsum([len(t) for t in thumbs])
    np.save(tmp / "thumbs.idx.npy", offsets)
    (tmp / "thumbs.bin").write_bytes(b"".join(thumbs))
    if text_vecs is not None:
        np.save(tmp / "text.npy", text_vecs)
        pq.write_table(pa.Table.from_pylist(text_rows, schema=_chunk_schema("text")), tmp / "text.parquet")
    (tmp / "stats.json").write_text(json.dumps({"seen": seen, "skipped": dict(skipped)}))
    os.replace(tmp, directory)


def _chunk_schema(modality: str) -> pa.Schema:
    # Chunk rows carry local positions; global ids are assigned when chunks are merged.
    schema = SCHEMAS[modality].remove(0)
    return (
        schema.set(schema.get_field_index("image_id"), pa.field("image_row", pa.int64()))
        if modality == "text"
        else schema
    )


@torch.no_grad()
def _embed_chunk(
    items: list[Item],
    model: DualEncoder,
    tokenizer: TextTokenizer | None,
    cfg: BuildConfig,
    transform: Callable,
    directory: Path,
) -> Counter:
    from openalign.embed import embed_images, embed_texts

    skipped: Counter = Counter()
    vecs: list[torch.Tensor] = []
    rows: list[dict] = []
    thumbs: list[bytes] = []
    for batch in batched(items, cfg.batch_size):
        pixels = []
        for item in batch:
            try:
                image = decode_image(item.read(), max_pixels=cfg.max_pixels)
            except BadInput as err:  # an unreadable file, or an image that does not decode
                skipped[err.reason] += 1
                continue
            pixels.append(transform(image))
            rows.append(
                {
                    "key": item.key,
                    "path": item.path,
                    "url": item.url,
                    "caption": item.caption,
                    "width": image.width,
                    "height": image.height,
                }
            )
            thumbs.append(make_thumbnail(image, cfg.thumbnail_size) if cfg.thumbnail_size else b"")
        if pixels:
            vecs.append(embed_images(model, pixels, batch_size=cfg.batch_size, device=cfg.device))
    dim = model.embed_dim
    image_vecs = torch.cat(vecs).numpy() if vecs else np.zeros((0, dim), np.float32)
    text_vecs, text_rows = None, []
    if cfg.captions and tokenizer is not None:  # build_index checked that captions come with a tokenizer
        text_rows = [
            {"image_row": i, "key": r["key"], "caption": r["caption"]} for i, r in enumerate(rows) if r["caption"]
        ]
        texts = [r["caption"] for r in text_rows]
        text_vecs = (
            embed_texts(model, tokenizer, texts, batch_size=4 * cfg.batch_size, device=cfg.device).numpy()
            if texts
            else np.zeros((0, dim), np.float32)
        )
    _write_chunk(directory, image_vecs, rows, thumbs, text_vecs, text_rows, skipped, len(items))
    return skipped


# --------------------------------------------------------------------------------------------------
# Merging


def _existing_keys(out: Path) -> set[str]:
    path = out / "image" / METADATA
    if not path.is_file():
        return set()
    return set(pq.read_table(path, columns=["key"]).column("key").to_pylist())


def _merge_modality(
    out: Path, stage: Path, modality: str, chunks: list[Path], base_ids: dict[str, int], ann: AnnConfig, dim: int
) -> int:
    """Stage ``modality``'s vectors, metadata (and thumbnails) with the chunks appended; returns the new size."""
    src, dst = out / modality, stage / modality
    dst.mkdir(parents=True, exist_ok=True)
    old_store = VectorStore.load(src) if (src / "vectors.npy").is_file() else None
    old_size = old_store.size if old_store else 0
    parts = [old_store.vectors] if old_store else []
    tables = [read_metadata(src)] if old_store else []
    next_id, image_offset = old_size, base_ids["image"]
    for chunk in chunks:
        vec_file = chunk / f"{modality}.npy"
        image_count = len(np.load(chunk / "image.npy", mmap_mode="r"))
        if vec_file.is_file():
            vecs = np.load(vec_file, mmap_mode="r")
            table = pq.read_table(chunk / f"{modality}.parquet")
            if modality == "text":
                image_ids = pc.add(table.column("image_row"), pa.scalar(image_offset, pa.int64()))
                table = table.drop_columns(["image_row"]).add_column(0, "image_id", image_ids)
            ids = pa.array(np.arange(next_id, next_id + len(vecs), dtype=np.int64))
            table = table.add_column(0, "id", ids).select(SCHEMAS[modality].names).cast(SCHEMAS[modality])
            parts.append(vecs)
            tables.append(table)
            next_id += len(vecs)
        image_offset += image_count
    vectors = save_vectors(dst / "vectors.npy", parts, next_id, dim)
    pq.write_table(pa.concat_tables(tables) if tables else SCHEMAS[modality].empty_table(), dst / METADATA)
    calibration = None
    if modality == "image" and (stage / "text" / "vectors.npy").is_file():
        # Captions are what an image store is queried with; they make the better calibration set.
        text = np.load(stage / "text" / "vectors.npy", mmap_mode="r")
        calibration = (
            np.asarray(text[np.linspace(0, len(text) - 1, min(256, len(text))).astype(int)]) if len(text) else None
        )
    store = extend_store(old_store, vectors, ann) if old_store else build_store(vectors, ann, calibration)
    store.save(dst)
    if modality == "image":
        _merge_thumbs(src, dst, chunks)
    return next_id


def _merge_thumbs(src: Path, dst: Path, chunks: list[Path]) -> None:
    offsets = [np.load(src / THUMBS_INDEX)] if (src / THUMBS_INDEX).is_file() else [np.zeros(1, np.int64)]
    with open(dst / THUMBS, "wb") as blob:
        if (src / THUMBS).is_file():
            with open(src / THUMBS, "rb") as old:
                shutil.copyfileobj(old, blob)
        end = int(offsets[0][-1])
        for chunk in chunks:
            chunk_offsets = np.load(chunk / "thumbs.idx.npy")
            with open(chunk / "thumbs.bin", "rb") as part:
                shutil.copyfileobj(part, blob)
            offsets.append(chunk_offsets[1:] + end)
            end += int(chunk_offsets[-1])
    np.save(dst / THUMBS_INDEX, np.concatenate(offsets))


def commit_stage(out: Path) -> None:
    """Move a fully staged result into place (index.json last) and drop the pending work."""
    stage = out / PENDING / "final"
    if not (stage / "ready").is_file():
        return
    for modality in ("image", "text"):
        if not (stage / modality).is_dir():
            continue
        (out / modality).mkdir(exist_ok=True)
        for f in (stage / modality).iterdir():
            os.replace(f, out / modality / f.name)
    os.replace(stage / INFO, out / INFO)
    shutil.rmtree(out / PENDING)


# --------------------------------------------------------------------------------------------------
# Entry point


def build_index(
    model: DualEncoder,
    tokenizer: TextTokenizer | None,
    source: str | Path,
    out: str | Path,
    config: BuildConfig | None = None,
    *,
    model_path: str | None = None,
    tokenizer_path: str | None = None,
    progress: bool = True,
) -> IndexBuildResult:
    """Embed every image of ``source`` (and its caption) into the index directory ``out``.

    Creates the index, resumes an interrupted build, or appends new items to an existing index.
    Returns what was added, the index's new size and the items skipped by reason.
    """
    created = not Path(out).exists()
    try:
        return _build_into(
            model, tokenizer, source, out, config, model_path=model_path, tokenizer_path=tokenizer_path,
            progress=progress,
        )  # fmt: skip
    except BaseException:
        # A new index that failed before its first chunk leaves nothing a rerun could resume from.
        if created and Path(out).is_dir() and not any((Path(out) / PENDING).glob("chunk-*")):
            shutil.rmtree(out, ignore_errors=True)
        raise


def _build_into(
    model: DualEncoder,
    tokenizer: TextTokenizer | None,
    source: str | Path,
    out: str | Path,
    config: BuildConfig | None = None,
    *,
    model_path: str | None = None,
    tokenizer_path: str | None = None,
    progress: bool = True,
) -> IndexBuildResult:
    cfg = config or BuildConfig()
    if cfg.captions and tokenizer is None:
        raise ValueError("a caption store needs the model's tokenizer to embed captions")
    errors: Counter = Counter()
    opened = open_source(  # checks that the source exists
        source, max_file_bytes=file_limit(cfg.max_file_mb), allow_outside_root=cfg.allow_outside_root
    )
    refuse_input_as_output(out, [source, *opened.local_paths()])
    source_items = iter_source(opened, lambda reason, detail: errors.update([reason]))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    commit_stage(out)  # a previous run that died while moving files into place
    info: dict[str, Any] = read_json(out / INFO) if (out / INFO).is_file() else {}
    dim = model.embed_dim
    if info and info.get("embed_dim") != dim:
        raise ValueError(f"{out} holds {info.get('embed_dim')}-d embeddings but the model makes {dim}-d ones")
    if info and bool(info.get("captions")) != cfg.captions:
        want = "with" if info.get("captions") else "without"
        raise ValueError(f"{out} was built {want} captions; pass the same --captions setting to add to it")
    from openalign.search.fingerprint import FINGERPRINT, fingerprint

    built_by = fingerprint(model, tokenizer)
    recorded = info.get(FINGERPRINT)
    if isinstance(recorded, dict) and any(
        recorded.get(part) and built_by[part] and recorded.get(part) != built_by[part] for part in built_by
    ):
        raise ValueError(
            f"{out / INFO}: the index was built by another model ({info.get('model')}); its vectors and the new "
            "ones would not be comparable: add to it with that model, or build a new index"
        )
    pending = out / PENDING
    manifest = {
        "source": os.fspath(source),
        "captions": cfg.captions,
        "chunk_size": cfg.chunk_size,
        "base_images": info.get("counts", {}).get("image", 0),
        "thumbnail_size": cfg.thumbnail_size,
        # The limits that decide which items are kept: finished chunks were cut under them, so a resume under
        # others would keep an item in one chunk that it skips in the next.
        "max_file_mb": cfg.max_file_mb,
        "max_pixels": cfg.max_pixels,
        "allow_outside_root": cfg.allow_outside_root,
    }
    if (pending / "manifest.json").is_file():
        previous = json.loads((pending / "manifest.json").read_text())
        if previous != manifest:
            diff = [k for k in manifest if previous.get(k) != manifest[k]]
            changes = ", ".join(f"{k} (was {previous.get(k)!r}, now {manifest[k]!r})" for k in diff)
            raise ValueError(
                f"{pending} holds an unfinished build with different {changes}; "
                "rerun it with the same arguments or delete that directory"
            )
    pending.mkdir(exist_ok=True)
    (pending / "manifest.json").write_text(json.dumps(manifest))

    known = _existing_keys(out)
    duplicates: Counter = Counter()

    def fresh(items: Iterable[Item]) -> Iterator[Item]:
        for item in items:
            if item.key in known:
                duplicates["already_indexed"] += 1
                continue
            known.add(item.key)
            yield item

    items = fresh(source_items)
    transform = model_transform(model.config, train=False)
    model.to(cfg.device).eval()
    skipped: Counter = Counter()
    chunks: list[Path] = []
    with tqdm(unit="img", desc="index", disable=not progress) as bar:
        for number, chunk in enumerate(batched(items, cfg.chunk_size)):
            directory = pending / f"chunk-{number:06d}"
            if directory.is_dir():
                skipped.update(json.loads((directory / "stats.json").read_text())["skipped"])
            else:
                skipped.update(_embed_chunk(chunk, model, tokenizer, cfg, transform, directory))
            chunks.append(directory)
            bar.update(len(chunk))

    skipped.update(errors)
    old_counts = info.get("counts", {})
    if info and not chunks:
        shutil.rmtree(pending)  # nothing new: leave the index as it is
        return IndexBuildResult(
            added_images=0,
            added_captions=0,
            images=old_counts.get("image", 0),
            captions=old_counts.get("text", 0),
            skipped=dict(skipped),
            already_indexed=duplicates["already_indexed"],
        )
    stage = pending / "final"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    base = {"image": manifest["base_images"]}
    counts: dict[str, int] = {}
    if cfg.captions:
        counts["text"] = _merge_modality(out, stage, "text", chunks, base, cfg.ann, dim)
    counts["image"] = _merge_modality(out, stage, "image", chunks, base, cfg.ann, dim)
    total_skipped = Counter(info.get("skipped", {}))
    total_skipped.update(skipped)
    new_info = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "embed_dim": dim,
        "model": model_path if model_path is not None else info.get("model"),
        "tokenizer": tokenizer_path if tokenizer_path is not None else info.get("tokenizer"),
        # An index from before fingerprints keeps none: which model made its old vectors is not known.
        FINGERPRINT: None
        if info and not isinstance(recorded, dict)
        else {part: (recorded or {}).get(part) or value for part, value in built_by.items()},
        "captions": cfg.captions,
        "counts": counts,
        "ann": to_dict(cfg.ann),
        "sources": [*info.get("sources", []), os.fspath(source)],
        "image_roots": _with_root(info.get("image_roots") or [], opened),
        "skipped": dict(total_skipped),
    }
    (stage / INFO).write_text(json.dumps(new_info, indent=2) + "\n")
    (stage / "ready").write_text("")
    commit_stage(out)
    return IndexBuildResult(
        added_images=counts["image"] - old_counts.get("image", 0),
        added_captions=counts.get("text", 0) - old_counts.get("text", 0),
        images=counts["image"],
        captions=counts.get("text", 0),
        skipped=dict(skipped),
        already_indexed=duplicates["already_indexed"],
    )


def open_index(path: str | Path, mmap: bool = True) -> SearchIndex:
    """Open an index directory (memory-mapped)."""
    return SearchIndex.open(path, mmap=mmap)
