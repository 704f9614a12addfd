"""Embedding a crawl at scale: images and captions of WebDataset shards (or a table / image folder cut into
fixed-size row chunks) into clip-retrieval's inference layout, by any number of processes.

Every input part (a shard, or a chunk of ``table_chunk_rows`` rows) becomes one file triple numbered by the
part's position in the input, so the output does not depend on how many processes wrote it::

    OUT/img_emb/img_emb_0003.npy      [rows, D] image embeddings (L2-normalised; float16 as clip-retrieval)
    OUT/text_emb/text_emb_0003.npy    [rows, D] caption embeddings of the same rows
    OUT/metadata/metadata_0003.parquet  image_path, caption, key, url: one row per embedding
    OUT/stats/stats_0003.json         the part's source, rows, skipped items by reason and the job's id
    (a part without a usable row has its stats only: clip-retrieval's readers fail on an empty .npy pair)
    OUT/embed.json                    the model's fingerprint and the settings; totals once every part is done

Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``) rank r works the parts i with i mod world = r, on
``cuda:LOCAL_RANK`` when CUDA is there; one plain process is rank 0 of 1. Each file is written under a
temporary name and renamed, the metadata last, so a part whose metadata exists is finished and a restarted
job skips it, while a part cut short is redone from its start. A part counts as done only when its stats carry
the id of this job (a hash of the source, the model and every setting that changes a byte of output), and a
folder is resumed only by a job with the same embed.json. No process group is needed: whichever rank finishes
last finds every part done and writes the totals. Unreadable images are skipped and counted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from openalign.config import ConfigError, to_dict
from openalign.data.sources import BadInput, Record, Source, file_limit, open_source
from openalign.outputs import atomic_write_text, check_writable, refuse_input_as_output
from openalign.pipeline.dedup import Embedder, load_embedder, parse_embedder
from openalign.pipeline.embed_stream import (
    Item,
    MetadataWriter,
    NpyAppender,
    Prepare,
    count_parts,
    decoded_items,
    default_workers,
    part_events,
    part_name,
)

if TYPE_CHECKING:
    from openalign.model.dual_encoder import DualEncoder
    from openalign.text.tokenizer import TextTokenizer

INFO = "embed.json"
FORMAT = "openalign-embed"
DTYPES = ("float16", "float32")
METADATA_COLUMNS = ("image_path", "caption", "key", "url")


@dataclass
class EmbedShardsConfig:
    """What ``openalign embed`` writes and how it reads its input."""

    images: bool = True  # write image embeddings (img_emb/)
    captions: bool = True  # write caption embeddings (text_emb/); needs a model with a text tower
    batch_size: int = 64  # images per forward pass (captions go in the same groups)
    # .npy element type: float16 is what clip-retrieval writes (half the disk); float32 keeps embed_images' bits
    dtype: str = "float16"
    table_chunk_rows: int = 10000  # a table or image folder is cut into parts of this many rows
    image_root: str | None = None  # a table's image_path values start here (default the table's folder)
    max_pixels: int = 64_000_000  # larger images are skipped as too_large
    max_file_mb: float = 64.0  # larger image files (and shard members) are skipped unread as too_large_file
    # table input: also read image paths that resolve outside the image root (else skipped as outside_root)
    allow_outside_root: bool = False
    device: str = "auto"  # auto: cuda:LOCAL_RANK when CUDA is available, else cpu; cuda: cuda:LOCAL_RANK
    # processes decoding images beside each rank; -1: this rank's share of the cores it may use (at most 16);
    # 0: decode in the embedding process itself. The files are the same whatever the number.
    workers: int = -1

    def validate(self) -> None:
        if not (self.images or self.captions):
            raise ConfigError("nothing to embed: --no-images and --no-captions together")
        if self.workers < -1:
            raise ConfigError(f"workers must be -1 (from the cores), 0 (in-process) or more, got {self.workers}")
        if self.batch_size < 1 or self.table_chunk_rows < 1:
            raise ConfigError("batch_size and table_chunk_rows must be at least 1")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        try:
            file_limit(self.max_file_mb)
        except ValueError as err:
            raise ConfigError(str(err)) from None


@dataclass(frozen=True)
class Rank:
    """This process's place in the job, from torchrun's environment (rank 0 of 1 without it)."""

    rank: int = 0
    world: int = 1
    local: int = 0
    local_world: int = 1  # ranks on this node (torchrun's LOCAL_WORLD_SIZE)

    @classmethod
    def from_env(cls) -> Rank:
        try:
            rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
            local = int(os.environ.get("LOCAL_RANK", 0))
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        except ValueError as err:
            raise ConfigError(f"RANK, WORLD_SIZE and LOCAL_RANK must be whole numbers ({err})") from None
        if world < 1 or not 0 <= rank < world:
            raise ConfigError(f"RANK {rank} is not within WORLD_SIZE {world}")
        return cls(rank, world, local, max(1, local_world))


@dataclass
class EmbedShardsResult:
    """What this process did, and the job's totals when it found every part done."""

    parts: int  # parts in the input
    worked: list[int]  # parts this process embedded
    already_done: list[int]  # parts of this process that an earlier run had finished
    rows: int  # embeddings this process wrote
    skipped: dict[str, int]  # items this process skipped, by reason
    complete: bool  # every part of the job is done (totals are in embed.json)
    totals: dict[str, Any] = field(default_factory=dict)  # the job's rows and skipped items, when complete


@dataclass
class Model:
    """The embedder: images through ``image`` (ALIGN tower or copy detector), captions through ``text``."""

    image: Embedder
    text: DualEncoder | None
    tokenizer: TextTokenizer | None
    name: str

    def fingerprint(self) -> dict[str, str | None]:
        from openalign.search.fingerprint import tokenizer_sha256, weights_sha256

        return {"weights": weights_sha256(self.image.model), "tokenizer": tokenizer_sha256(self.tokenizer)}


def pick_device(setting: str, rank: Rank) -> str:
    import torch

    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        return f"cuda:{rank.local}"  # each process of a node its own GPU
    return "cpu" if setting == "auto" else setting


def load_embed_model(model: str | None, embedder: str | None, *, device: str = "cpu", captions: bool = True) -> Model:
    """``model``: what ``index build`` and ``search`` take (an openalign checkpoint, a transformers AlignModel
    folder or a cached hub id), with its tokenizer; or ``embedder``: ``copy-detector:DIR`` / ``align:DIR`` as
    dedup reads it. A missing folder is a one-line error."""
    if (model is None) == (embedder is None):
        raise ConfigError("give either --model (an ALIGN checkpoint) or --embedder copy-detector:DIR / align:DIR")
    if embedder is not None:
        spec = parse_embedder(embedder)
        if spec.kind == "npy":
            raise ConfigError("--embedder npy has no model to embed with; give copy-detector:DIR or align:DIR")
        loaded = load_embedder(spec, device)
        assert loaded is not None
        name = str(spec)
        path = spec.path
    else:
        from openalign.model.hub import resolve
        from openalign.model.io import load_model

        path = resolve(model or "")
        name = str(model)
        loaded = Embedder(parse_embedder(f"align:{path}"), load_model(path), device)
    from openalign.model.dual_encoder import DualEncoder

    loaded.model.to(device)
    text = loaded.model if isinstance(loaded.model, DualEncoder) else None
    tokenizer = None
    if captions:
        if text is None:
            raise ConfigError(f"{name} is a copy detector: it embeds images only; pass --no-captions")
        from openalign.text import load_tokenizer

        assert path is not None  # a model spec always names its folder
        tokenizer = load_tokenizer(path, max_length=text.config.text.max_length)
    return Model(loaded, text, tokenizer, name)


# --------------------------------------------------------------------------------------------------
# Output


class Layout:
    """clip-retrieval's file names in ``out``, numbered with at least 4 digits (more for 10000+ parts, so that
    names sort in part order, as clip-retrieval's readers sort them)."""

    KINDS = ("img_emb", "text_emb", "metadata", "stats")

    def __init__(self, out: Path, parts: int, job: str):
        self.out, self.job = out, job
        self.width = max(4, len(str(max(parts - 1, 0))))

    def path(self, kind: str, part: int) -> Path:
        suffix = {"img_emb": "npy", "text_emb": "npy", "metadata": "parquet", "stats": "json"}[kind]
        return self.out / kind / f"{kind}_{part:0{self.width}d}.{suffix}"

    def done(self, part: int) -> bool:
        """Its stats name this job, and its metadata is in place or it had no usable row (stats are written
        before the metadata, so a part with rows whose metadata is missing is redone)."""
        try:
            stats = json.loads(self.path("stats", part).read_text())
            if stats["job"] != self.job:
                return False
            return self.path("metadata", part).is_file() or stats["rows"] == 0
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def any_files(self) -> bool:
        return any(
            p.is_file() for kind in self.KINDS if (self.out / kind).is_dir() for p in (self.out / kind).iterdir()
        )


def _tmp(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _atomic(path: Path, write: Any) -> None:
    """``write(tmp)`` then rename onto ``path``: a reader never sees half a file."""
    tmp = _tmp(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _meta(record: Record, source: Source) -> tuple[str, str, str]:
    """(image_path, key, url): a shard sample's image_path is its key, as clip-retrieval writes it, and its
    key ``SHARD.tar/KEY``, as ``index build`` keys it; a table row's image_path is its image file."""
    try:
        url = str(record.metadata().get("url") or "")
    except BadInput:
        url = ""
    if source.kind == "shards":
        return record.key, f"{Path(record.origin).name}/{record.key}", url
    return (str(record.path) if record.path is not None else record.key), record.key, url


def _preparer(model: Model, cfg: EmbedShardsConfig, source: Source) -> Prepare:
    """What a decoding worker does to one event: decode the image and, for an ALIGN tower, run the model's
    eval transform too (the same function ``embed_images`` would run, so the pixels are the same bits)."""
    from openalign.data.transforms import model_transform
    from openalign.model.dual_encoder import DualEncoder

    net = model.image.model
    transform = model_transform(net.config, train=False) if isinstance(net, DualEncoder) else None

    def prepare(part: int, event: Record | BadInput) -> Item:
        if isinstance(event, BadInput):
            return Item(part, skip=event.reason)
        image: Any = None
        if cfg.images:
            try:
                image = event.decode(max_pixels=cfg.max_pixels)
            except BadInput as err:
                return Item(part, skip=err.reason)
            if transform is not None:
                image = transform(image)
        return Item(part, image=image, caption=event.caption or "", meta=_meta(event, source))

    return prepare


class PartOut:
    """One part being written: rows gathered into batches of ``batch_size``, each embedded and appended to
    the part's temporary files; ``finish`` renames them into place, the metadata last."""

    def __init__(self, layout: Layout, part: int, model: Model, cfg: EmbedShardsConfig, dim: int):
        self.layout, self.part, self.model, self.cfg = layout, part, model, cfg
        self.skipped: Counter[str] = Counter()
        self.images: list[Any] = []
        self.captions: list[str] = []
        for kind in layout.KINDS:  # what a killed run left of this part
            final = layout.path(kind, part)
            for stale in final.parent.glob(f".{final.name}.*.tmp"):
                stale.unlink(missing_ok=True)
        self.npy: dict[str, NpyAppender] = {}
        for kind, wanted in (("img_emb", cfg.images), ("text_emb", cfg.captions)):
            if wanted:
                self.npy[kind] = NpyAppender(_tmp(layout.path(kind, part)), dim, cfg.dtype)
        self.meta = MetadataWriter(_tmp(layout.path("metadata", part)), METADATA_COLUMNS)

    def add(self, item: Item) -> None:
        if item.skip is not None:
            self.skipped[item.skip] += 1
            return
        if self.cfg.images:
            self.images.append(item.image)
        self.captions.append(item.caption)
        path, key, url = item.meta
        self.meta.append((path, item.caption, key, url))
        if len(self.captions) == self.cfg.batch_size:
            self._flush()

    def _flush(self) -> None:
        from openalign.embed import embed_texts

        model, cfg = self.model, self.cfg
        if cfg.images and self.images:
            self.npy["img_emb"].append(model.image.embed(self.images, batch_size=cfg.batch_size))
        if cfg.captions and self.captions:
            assert model.text is not None and model.tokenizer is not None
            vecs = embed_texts(
                model.text, model.tokenizer, self.captions, batch_size=cfg.batch_size, device=model.image.device
            )
            self.npy["text_emb"].append(vecs.numpy())
        self.images.clear()
        self.captions.clear()

    def finish(self, source_name: str) -> dict[str, Any]:
        self._flush()
        for writer in self.npy.values():
            writer.close()
        self.meta.close()
        stats = {"source": source_name, "rows": self.meta.rows, "skipped": dict(self.skipped), "job": self.layout.job}
        text = json.dumps(stats, indent=1, sort_keys=True) + "\n"
        if not self.meta.rows:
            # No files for a part without rows: embedding_reader's npy+parquet reader fails on an empty pair
            # (it slices 0 metadata rows into its batch); the stats record the part as done.
            self._remove_temporary()
            _atomic(self.layout.path("stats", self.part), lambda tmp: tmp.write_text(text))
            return stats
        _atomic(self.layout.path("stats", self.part), lambda tmp: tmp.write_text(text))
        for kind in self.npy:
            os.replace(_tmp(self.layout.path(kind, self.part)), self.layout.path(kind, self.part))
        metadata = self.layout.path("metadata", self.part)
        os.replace(_tmp(metadata), metadata)  # last: the part is done
        return stats

    def abandon(self) -> None:
        """Close and remove the temporary files of a part cut short by an error."""
        for writer in self.npy.values():
            writer.file.close()
        self.meta.writer.close()
        self._remove_temporary()

    def _remove_temporary(self) -> None:
        for kind in (*self.npy, "metadata"):
            _tmp(self.layout.path(kind, self.part)).unlink(missing_ok=True)


def _settings(cfg: EmbedShardsConfig, device: str) -> dict[str, Any]:
    """The settings that decide the files' content (the device type too: a GPU's float sums differ from a
    CPU's); a restart must use the same ones. The number of decoding workers changes no byte."""
    keep = (
        "images",
        "captions",
        "batch_size",
        "dtype",
        "table_chunk_rows",
        "image_root",
        "max_pixels",
        "max_file_mb",
        "allow_outside_root",
    )
    settings = {k: v for k, v in to_dict(cfg).items() if k in keep}
    return {**settings, "device": device.split(":")[0]}


def _job_id(info: dict[str, Any]) -> str:
    """What a part's stats carry: the hash of everything in ``info`` that decides its bytes."""
    decides = {k: info[k] for k in ("source", "parts", "fingerprint", "embed_dim", "settings")}
    return hashlib.sha256(json.dumps(decides, sort_keys=True).encode()).hexdigest()[:16]


def _differs(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """The first thing that makes ``old`` another job's embed.json, in words, or None."""
    if old.get("format") != FORMAT:
        return f"{INFO} is not openalign embed's"
    for part in ("source", "parts", "fingerprint", "settings"):
        was, now = old.get(part), new[part]
        if was == now:
            continue
        if isinstance(was, dict) and isinstance(now, dict):
            key = next(k for k in sorted({*was, *now}) if was.get(k) != now.get(k))
            return f"another {'model ' if part == 'fingerprint' else ''}{key} ({was.get(key)} ≠ {now.get(key)})"
        return f"another {part} ({was} ≠ {now})"
    return None


def _check_or_write_info(out: Path, info: dict[str, Any], layout: Layout) -> bool:
    """Refuse a folder another job wrote (its embed.json differs, or it holds parts and no embed.json); write
    embed.json when absent, as any rank may, since every rank writes the same. True when this call wrote it."""
    path = out / INFO
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            old = {}
        why = _differs(old if isinstance(old, dict) else {}, info)
        if why is not None:
            raise ConfigError(
                f"{path}: this folder was written with {why}; resume with the same model and settings, "
                "or write to a new folder"
            )
        return False
    if layout.any_files():
        raise ConfigError(
            f"{out}: holds embedding parts but no {INFO}, so nothing says how they were made; "
            "write to a new folder or remove them"
        )
    atomic_write_text(path, json.dumps(info, indent=2) + "\n")
    return True


def _undo_start(out: Path, layout: Layout, parts: int, created: bool) -> None:
    """After a failure before any part of the job was done: remove this run's embed.json, empty part
    folders, and the folder itself if the run made it, so a corrected rerun starts clean."""
    if any(layout.done(i) for i in range(parts)):
        return
    (out / INFO).unlink(missing_ok=True)
    for kind in layout.KINDS:
        with contextlib.suppress(OSError):  # absent, or another rank's files are in it
            (out / kind).rmdir()
    if created:
        with contextlib.suppress(OSError):
            out.rmdir()


def _totals(layout: Layout, parts: int) -> dict[str, Any]:
    rows, skipped = 0, Counter[str]()
    for part in range(parts):
        stats = json.loads(layout.path("stats", part).read_text())
        rows += int(stats["rows"])
        skipped.update(stats["skipped"])
    return {"rows": rows, "skipped": dict(sorted(skipped.items()))}


def embed_shards(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    model: Model,
    cfg: EmbedShardsConfig | None = None,
    *,
    rank: Rank | None = None,
    progress: bool = False,
) -> EmbedShardsResult:
    """Embed this rank's unfinished parts of ``source`` into ``out`` (see the module docstring)."""
    cfg = cfg or EmbedShardsConfig()
    cfg.validate()
    rank = rank or Rank.from_env()
    out = Path(out)
    check_writable(out, what="embedding folder", directory=True)
    opened = open_source(
        source,
        image_root=cfg.image_root,
        max_file_bytes=file_limit(cfg.max_file_mb),
        allow_outside_root=cfg.allow_outside_root,
    )
    refuse_input_as_output(out, [source, *opened.local_paths()])
    parts = count_parts(opened, cfg.table_chunk_rows)
    if parts == 0:
        raise ValueError(f"{source}: no rows to embed")
    dim = model.image.model.embed_dim
    info = {
        "format": FORMAT,
        "source": os.fspath(source),
        "parts": parts,
        "model": model.name,
        "fingerprint": model.fingerprint(),
        "embed_dim": dim,
        "settings": _settings(cfg, model.image.device),
    }
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    layout = Layout(out, parts, _job_id(info))
    try:
        wrote = _check_or_write_info(out, info, layout)
    except BaseException:
        if created:
            out.rmdir()
        raise
    try:
        result = _embed_parts(opened, layout, model, cfg, rank, info, progress)
    except BaseException:
        if wrote:
            _undo_start(out, layout, parts, created)
        raise
    return result


def _embed_parts(
    opened: Source,
    layout: Layout,
    model: Model,
    cfg: EmbedShardsConfig,
    rank: Rank,
    info: dict[str, Any],
    progress: bool,
) -> EmbedShardsResult:
    out, parts, dim = layout.out, int(info["parts"]), int(info["embed_dim"])
    mine = [i for i in range(parts) if i % rank.world == rank.rank]
    finished = {i for i in mine if layout.done(i)}  # each check reads the part's stats
    done = [i for i in mine if i in finished]
    todo = [i for i in mine if i not in finished]
    skipped_here: Counter[str] = Counter()
    rows = 0
    from tqdm import tqdm

    workers = cfg.workers if cfg.workers >= 0 else default_workers(rank.local_world)
    items = decoded_items(
        lambda: part_events(opened, cfg.table_chunk_rows, set(todo)),
        _preparer(model, cfg, opened),
        chunk=cfg.batch_size,
        workers=workers,
    )
    current: PartOut | None = None

    def finish(writer: PartOut) -> None:
        nonlocal rows
        stats = writer.finish(part_name(opened, writer.part, cfg.table_chunk_rows))
        rows += stats["rows"]
        skipped_here.update(writer.skipped)
        bar.update(1)

    with tqdm(total=len(todo), unit="part", desc=f"embed rank {rank.rank}", disable=not progress) as bar:
        seen = set()
        try:
            for item in items:
                if current is None or current.part != item.part:
                    if current is not None:
                        finish(current)
                    seen.add(item.part)
                    current = PartOut(layout, item.part, model, cfg, dim)
                current.add(item)
            if current is not None:
                finish(current)
                current = None
        finally:
            if current is not None:
                current.abandon()
        for part in todo:
            if part not in seen:  # a shard (or chunk) with nothing in it still gets its stats
                finish(PartOut(layout, part, model, cfg, dim))
    complete = all(layout.done(i) for i in range(parts))
    totals: dict[str, Any] = {}
    if complete:  # the last rank to finish gets here with every part on disk; writing twice writes the same
        totals = _totals(layout, parts)
        atomic_write_text(out / INFO, json.dumps({**info, "complete": True, "totals": totals}, indent=2) + "\n")
    return EmbedShardsResult(parts, todo, done, rows, dict(sorted(skipped_here.items())), complete, totals)
