"""The one near-duplicate removal path: embed train and test images, find the pairs, write what to keep.

``run_dedup`` is what ``openalign dedup`` and the demo's decontamination stage both run:

1. embeddings of both sides, from the embedder the settings name (``parse_embedder``, the one place that reads
   an embedder spec):

   - ``npy``: TRAIN and TEST are precomputed ``.npy`` matrices (keys from optional keys files) or folders in
     clip-retrieval's inference layout (``img_emb/img_emb_N.npy`` + ``metadata/metadata_N.parquet``, keys
     from its ``key_column``);
   - ``copy-detector:DIR``: a copy detector (``openalign copy-detector train``), the supplement's "separate
     high-quality image embedding model";
   - ``align:DIR``: the image tower of an ALIGN checkpoint (openalign or transformers AlignModel);

   images come from anything ``openalign.data.sources`` reads (image folder, table, WebDataset shards), an
   already opened ``Source``, or an explicit list of files (``ImageFiles``); unreadable ones are skipped and
   counted, and the computed embeddings and keys are saved in OUT for re-use;
2. the pairs with cosine above the threshold, found by ``openalign.data.dedup.find_near_duplicates`` (k-means
   buckets, as the supplement does) in memory, or, for embedding folders, ``--engine spark`` or
   ``--out-of-core``, by ``openalign.data.dedup_buckets`` (bucket keys in Parquet, joined on DuckDB or Spark);
3. the outputs: every pair (``duplicates.parquet`` and ``duplicates.csv``), the train images to drop
   (``drop.parquet``, ``drop.json``), ``stats.json`` and, given the train metadata table, that table without
   the dropped images.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

import numpy as np

from openalign.config import ConfigError
from openalign.data.dedup import (
    DedupConfig,
    DedupResult,
    find_near_duplicates,
    iter_source_images,
    load_embeddings,
    load_keys,
    remove_from_table,
    write_outputs,
)
from openalign.data.dedup_buckets import EmbeddingFiles, find_pairs_in_files
from openalign.data.sources import DEFAULT_MAX_FILE_BYTES, BadInput, Source, file_limit, open_source, read_file
from openalign.data.verification import VerifyConfig, require_opencv
from openalign.outputs import check_writable

if TYPE_CHECKING:
    from PIL import Image

    from openalign.model.copy_detector import CopyDetector
    from openalign.model.dual_encoder import DualEncoder

__all__ = [
    "EMBEDDER_KINDS",
    "DedupRun",
    "DedupRunConfig",
    "Embedder",
    "EmbedderSpec",
    "ImageFiles",
    "load_embedder",
    "parse_embedder",
    "run_dedup",
]

EmbedderKind = Literal["npy", "copy-detector", "align"]
EMBEDDER_KINDS: tuple[EmbedderKind, ...] = ("npy", "copy-detector", "align")
EMBEDDER_FORMS = "npy, copy-detector:DIR or align:DIR"


@dataclass
class DedupRunConfig(DedupConfig):
    """Everything ``openalign dedup`` needs: the search settings above, then what to read, how to embed it and
    what to write."""

    # npy: TRAIN and TEST are .npy embeddings; copy-detector:DIR or align:DIR: image folders, tables or shards
    # embedded with that copy detector or ALIGN checkpoint.
    embedder: str = "npy"
    train_keys: str | None = None  # npy: keys of the train rows (.txt one per line, .json list, or table)
    test_keys: str | None = None  # npy: keys of the test rows, same formats
    image_root: str | None = None  # a table input's image_path values start here (default the table's folder)
    max_file_mb: float = 64.0  # larger image files (and shard members) are skipped unread as too_large_file
    # table input: also read image paths that resolve outside the image root (else skipped as outside_root)
    allow_outside_root: bool = False
    metadata: str | None = None  # train metadata table (.parquet/.csv/.jsonl) to write without the duplicates
    metadata_out: str | None = None  # where that table goes (default OUT/<metadata name>_dedup.parquet)
    key_column: str = "key"  # metadata column matching the train keys
    batch_size: int = 64  # images per forward pass of the embedder
    device: str = "cpu"  # where the embedder runs: cpu or cuda
    # decide the pairs with cosine within verify_band of the threshold by their pixels (registered pixels,
    # pHash, then ORB + RANSAC: verification.checks); needs the images, and OpenCV (the verify extra) for ORB
    verify: bool = False
    verify_band: float = 0.05  # half-width of that band; above it the embedding alone decides
    # nearest clusters a pair must share in the band's widened search (combo is for the threshold alone): the
    # paper's 3 of 10 is lossless near 0.975 only, and misses more pairs the lower the band reaches; 2 of 10 misses
    # far fewer for more candidates.
    verify_combo: int = 2
    # also verify the pairs that ORB descriptors vote for (verification.min_votes of a train image's nearest
    # matches among all test images' descriptors), wherever their cosine is: a picture pasted into a page or
    # collage, which a global embedding places far from its original. Reads every train image's features
    # (ORB at verification.max_side) and keeps every test image's in memory. Implies --verify.
    verify_votes: bool = False
    verification: VerifyConfig = field(default_factory=VerifyConfig)

    def validate(self) -> None:
        """Cross-field checks; raises ConfigError naming the bad field."""
        super().validate()
        spec = parse_embedder(self.embedder, check_dir=False)
        self.verification.validate()
        if not 0 <= self.verify_band < 1:
            raise ConfigError(f"dedup.verify_band must be in [0, 1), got {self.verify_band}")
        if not 1 <= self.verify_combo <= self.nearest:
            raise ConfigError(f"dedup.verify_combo must be in [1, nearest={self.nearest}], got {self.verify_combo}")
        if self.verify_votes:  # the pairs the votes find are verified: asking for them asks for verification
            self.verify = True
            if "features" not in self.verification.checks:
                raise ConfigError("dedup.verify_votes needs the features check in verification.checks")
        if self.verify and spec.kind == "npy":
            which = "verify_votes" if self.verify_votes else "verify"
            raise ConfigError(f"dedup.{which} needs the images: use --embedder copy-detector:DIR or align:DIR")
        if self.batch_size < 1:
            raise ConfigError(f"dedup.batch_size must be at least 1, got {self.batch_size}")
        try:
            file_limit(self.max_file_mb)
        except ValueError as err:
            raise ConfigError(f"dedup.{err}") from None


# --------------------------------------------------------------------------------------------------
# Embedders


@dataclass(frozen=True)
class EmbedderSpec:
    """A parsed ``--embedder``: its kind and, for a model, the directory it loads from."""

    kind: EmbedderKind
    path: Path | None = None

    def __str__(self) -> str:
        return self.kind if self.path is None else f"{self.kind}:{self.path}"


def parse_embedder(text: str, *, check_dir: bool = True) -> EmbedderSpec:
    """``npy``, ``copy-detector:DIR`` or ``align:DIR``; anything else, or (with ``check_dir``) a directory that
    does not exist, is a one-line ConfigError."""
    kind, sep, rest = str(text).strip().partition(":")
    if kind not in EMBEDDER_KINDS:
        raise ConfigError(f"embedder {text!r}: expected {EMBEDDER_FORMS}")
    if kind == "npy":
        if sep:
            raise ConfigError(f"embedder {text!r}: npy takes no directory (TRAIN and TEST are the .npy files)")
        return EmbedderSpec("npy")
    if not rest.strip():
        raise ConfigError(f"embedder {text!r}: {kind} needs a model directory, as {kind}:DIR")
    path = Path(rest.strip())
    if check_dir and not path.is_dir():
        raise ConfigError(f"embedder {text!r}: no such directory {path}")
    return EmbedderSpec(cast(EmbedderKind, kind), path)


@dataclass
class Embedder:
    """Images → L2-normalised float32 embeddings [N, D] with the model an embedder spec names."""

    spec: EmbedderSpec
    model: CopyDetector | DualEncoder
    device: str = "cpu"

    def embed(self, images: Iterable[Image.Image], *, batch_size: int = 64, progress: bool = False) -> np.ndarray:
        from openalign.model.copy_detector import CopyDetector

        if isinstance(self.model, CopyDetector):
            return self.model.embed(images, batch_size=batch_size, progress=progress, device=self.device)
        from openalign.embed import embed_images

        emb = embed_images(self.model, images, batch_size=batch_size, device=self.device, progress=progress)
        return emb.numpy().astype(np.float32, copy=False)


def load_embedder(spec: EmbedderSpec | str, device: str = "cpu") -> Embedder | None:
    """The model a spec names, ready to embed; None for ``npy`` (nothing to embed)."""
    spec = parse_embedder(spec) if isinstance(spec, str) else spec
    if spec.kind == "npy" or spec.path is None:
        return None
    from openalign.model.io import load_copy_detector, load_model

    model = load_copy_detector(spec.path) if spec.kind == "copy-detector" else load_model(spec.path)
    return Embedder(spec, model, device)


def _detector_threshold(cfg: DedupRunConfig, embedder: Embedder) -> tuple[DedupRunConfig, str, str | None]:
    """The settings with a copy detector's fitted threshold, where it came from, and a note when it has none."""
    from dataclasses import replace

    from openalign.model.copy_detector import CopyDetector

    if not isinstance(embedder.model, CopyDetector):
        return cfg, "default", None
    fitted = (embedder.model.train_stats.get("threshold") or {}).get("value")
    if fitted is None:
        note = (
            f"copy detector {embedder.spec.path} has no fitted threshold (saved before thresholds were fitted, "
            f"or with no image held out): using threshold {cfg.threshold}"
        )
        return cfg, "default", note
    return replace(cfg, threshold=float(fitted)), "detector", None


# --------------------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class ImageFiles:
    """Image files and the keys to report them by, in this order: a side that is not one source."""

    keys: Sequence[str]
    paths: Sequence[Path]

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.paths):
            raise ValueError(f"ImageFiles: {len(self.keys)} keys for {len(self.paths)} files")

    def images(
        self, on_skip: Callable[[str, str], None], *, max_bytes: int = DEFAULT_MAX_FILE_BYTES
    ) -> Iterator[tuple[str, Image.Image]]:
        """(key, RGB image) of every file that reads (at most ``max_bytes``) and decodes; the others go to
        ``on_skip(reason, detail)``."""
        from openalign.data.transforms import decode_image

        for key, path in zip(self.keys, self.paths, strict=True):
            try:
                yield key, decode_image(read_file(path, max_bytes=max_bytes))
            except BadInput as err:
                on_skip(err.reason, f"{path}: {err.detail}")


Side = str | os.PathLike[str] | Source | ImageFiles


def _is_npy(side: Side) -> bool:
    return isinstance(side, str | os.PathLike) and Path(side).suffix == ".npy"


def _embed_side(
    side: Side,
    embedder: Embedder,
    *,
    batch_size: int,
    progress: bool,
    image_root: str | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    allow_outside_root: bool = False,
) -> tuple[np.ndarray, list[str], dict[str, int]]:
    keys: list[str] = []
    skipped: Counter[str] = Counter()

    def skip(reason: str, detail: str) -> None:
        skipped[reason] += 1

    pairs = _side_images(side, skip, image_root, max_file_bytes, allow_outside_root)

    def images() -> Iterator[Image.Image]:
        for key, image in pairs:
            keys.append(key)
            yield image

    emb = embedder.embed(images(), batch_size=batch_size, progress=progress)
    if not len(emb):
        raise ValueError(f"{_describe(side)}: no readable images (skipped: {dict(skipped) or 'none'})")
    return emb, keys, dict(sorted(skipped.items()))


def _side_images(
    side: Side,
    skip: Callable[[str, str], None],
    image_root: str | None,
    max_file_bytes: int,
    allow_outside_root: bool,
) -> Iterator[tuple[str, Image.Image]]:
    """(key, image) of every readable image of a side, in the same order on every pass."""
    if isinstance(side, ImageFiles):
        return side.images(skip, max_bytes=max_file_bytes)
    opened = (
        side
        if isinstance(side, Source)
        else open_source(
            side, image_root=image_root, max_file_bytes=max_file_bytes, allow_outside_root=allow_outside_root
        )
    )
    return iter_source_images(opened, skip)


def _describe(side: Side) -> str:
    if isinstance(side, Source):
        return side.spec
    if isinstance(side, ImageFiles):
        return f"{len(side.paths)} image files"
    return os.fspath(side)


def _npy_side(side: Side, keys_path: str | None) -> tuple[np.ndarray, list[str] | None]:
    if not isinstance(side, str | os.PathLike) or Path(side).suffix != ".npy":
        raise ValueError(
            f"{_describe(side)}: not a .npy embeddings file; pass --embedder copy-detector:DIR or align:DIR to "
            "embed images"
        )
    emb = load_embeddings(Path(side))
    return emb, (load_keys(keys_path, len(emb)) if keys_path else None)


def _is_folder(side: Side) -> bool:
    """A folder in clip-retrieval's inference layout (its embeddings are in img_emb/)."""
    return isinstance(side, str | os.PathLike) and (Path(side) / "img_emb").is_dir()


def _embedding_files(side: Side, keys_path: str | None, key_column: str) -> EmbeddingFiles:
    if _is_folder(side):
        from openalign.search.imported import find_shards

        assert isinstance(side, str | os.PathLike)
        if keys_path:
            raise ValueError(f"{_describe(side)}: an embedding folder names its rows in metadata/; drop the keys file")
        shards = find_shards(Path(side))
        return EmbeddingFiles(tuple(s.image for s in shards), tuple(s.metadata for s in shards), key_column=key_column)
    if not _is_npy(side):
        raise ValueError(
            f"{_describe(side)}: neither a .npy embeddings file nor a folder with img_emb/ (clip-retrieval's "
            "inference output); pass --embedder copy-detector:DIR or align:DIR to embed images"
        )
    assert isinstance(side, str | os.PathLike)
    count = len(load_embeddings(Path(side)))
    return EmbeddingFiles((Path(side),), keys=load_keys(keys_path, count) if keys_path else None)


def _files_run(
    train: Side, test: Side, cfg: DedupRunConfig
) -> tuple[DedupResult, Sequence[str] | None, Sequence[str] | None]:
    """The rule on embedding files (out of core on DuckDB or Spark); work files in a temporary folder."""
    crawl = _embedding_files(train, cfg.train_keys, cfg.key_column)
    queries = _embedding_files(test, cfg.test_keys, cfg.key_column)
    with tempfile.TemporaryDirectory(prefix="openalign-dedup-", dir=cfg.temp_directory) as work:
        result, train_names, test_names = find_pairs_in_files(crawl, queries, cfg, work)
    return (
        result,
        train_names if train_names.files.named else None,
        test_names if test_names.files.named else None,
    )


# --------------------------------------------------------------------------------------------------
# The run


@dataclass
class DedupRun:
    """What one dedup run found and wrote."""

    result: DedupResult  # the pairs (train row, test row, cosine) and the search statistics
    train_keys: Sequence[str] | None  # key of each train row (None: .npy embeddings without a keys file)
    test_keys: Sequence[str] | None
    paths: dict[str, Path]  # every file written, by role (pairs, pairs_csv, drop, drop_json, stats, metadata)
    skipped: dict[str, dict[str, int]] = field(default_factory=dict)  # unreadable images by side and reason
    table: dict[str, int] | None = None  # the metadata table's rows_in, rows_removed and rows_out

    @property
    def train_images(self) -> int:
        return int(self.result.stats["train_n"])

    @property
    def test_images(self) -> int:
        return int(self.result.stats["test_n"])

    @property
    def candidate_pairs(self) -> int:
        return int(self.result.stats.get("candidate_pairs", 0))

    @property
    def duplicate_pairs(self) -> int:
        return len(self.result.cosine)

    @property
    def train_rows_removed(self) -> int:
        return len(self.result.drop_indices)

    @property
    def dropped_keys(self) -> list[str] | None:
        """Keys of the train images to remove, in train order (None without train keys)."""
        if self.train_keys is None:
            return None
        return [self.train_keys[i] for i in self.result.drop_indices]


def run_dedup(
    train: Side,
    test: Side,
    out_dir: str | os.PathLike[str],
    config: DedupRunConfig | None = None,
    *,
    embedder: Embedder | None = None,
    progress: bool = False,
    detector_threshold: bool = False,
) -> DedupRun:
    """Embed (or load) both sides, find the near-duplicate pairs, write the outputs in ``out_dir``.

    ``train``/``test`` are ``.npy`` embeddings with the ``npy`` embedder; otherwise an image folder, table or
    shard spec, an opened ``Source`` or ``ImageFiles``, embedded by ``config.embedder`` (or by ``embedder``
    when given). With ``config.metadata`` (the filtered corpus) the table minus the dropped images is written
    too, matched by key when the train side has keys and by row otherwise.

    With ``detector_threshold`` (``openalign dedup`` sets it when no threshold was given) a copy detector's
    fitted threshold (``openalign.pipeline.copy_threshold``) replaces ``config.threshold``; a detector saved
    without one keeps it, with a note. ``stats.json`` names the threshold used and where it came from.
    """
    cfg = config or DedupRunConfig()
    cfg.validate()
    out = Path(out_dir)
    check_writable(out, directory=True)
    spec = embedder.spec if embedder is not None else parse_embedder(cfg.embedder)
    if cfg.verify:
        if spec.kind == "npy":
            raise ConfigError("dedup.verify needs the images: use --embedder copy-detector:DIR or align:DIR")
        if "features" in cfg.verification.checks:
            require_opencv()  # before the embedding, not after it
    skipped: dict[str, dict[str, int]] = {}
    # "setting": the caller's threshold; "default": none was given and no fitted one applies; "detector".
    threshold_source, note = ("default" if detector_threshold else "setting"), None
    train_names: Sequence[str] | None
    test_names: Sequence[str] | None
    on_files = spec.kind == "npy" and (
        cfg.out_of_core or cfg.engine == "spark" or _is_folder(train) or _is_folder(test)
    )
    if on_files:
        result, train_names, test_names = _files_run(train, test, cfg)
        n_train = int(result.stats["train_n"])
    elif spec.kind == "npy":
        train_emb, train_names = _npy_side(train, cfg.train_keys)
        test_emb, test_names = _npy_side(test, cfg.test_keys)
    else:
        for side in (train, test):
            if _is_npy(side):
                raise ValueError(
                    f"{_describe(side)}: with --embedder {spec}, give an image folder, table or shards, not embeddings"
                )
        if cfg.train_keys or cfg.test_keys:
            raise ValueError("keys files go with .npy embeddings; images bring their own keys")
        loaded = embedder or load_embedder(spec, cfg.device)
        assert loaded is not None
        model: Embedder = loaded
        if detector_threshold:
            cfg, threshold_source, note = _detector_threshold(cfg, model)

        def embed(side: Side) -> tuple[np.ndarray, list[str], dict[str, int]]:
            return _embed_side(
                side,
                model,
                batch_size=cfg.batch_size,
                progress=progress,
                image_root=cfg.image_root,
                max_file_bytes=file_limit(cfg.max_file_mb),
                allow_outside_root=cfg.allow_outside_root,
            )

        train_emb, train_list, skipped["train"] = embed(train)
        test_emb, test_list, skipped["test"] = embed(test)
        train_names, test_names = train_list, test_list
        out.mkdir(parents=True, exist_ok=True)
        for name, emb, names in (("train", train_emb, train_list), ("test", test_emb, test_list)):
            np.save(out / f"{name}_emb.npy", emb)
            (out / f"{name}_keys.json").write_text(json.dumps(names) + "\n")
    if not on_files and cfg.verify:
        from dataclasses import replace

        from openalign.pipeline.verify import verify_pairs

        wide = replace(cfg, threshold=max(-1.0, cfg.threshold - cfg.verify_band), combo=cfg.verify_combo)
        found = find_near_duplicates(train_emb, test_emb, config=wide, progress=progress)

        def images(side: Side) -> Iterator[Image.Image]:
            limit = file_limit(cfg.max_file_mb)
            pairs = _side_images(side, lambda reason, detail: None, cfg.image_root, limit, cfg.allow_outside_root)
            return (image for _, image in pairs)

        def cosine(train_rows: np.ndarray, test_rows: np.ndarray) -> np.ndarray:
            a, b = train_emb[train_rows], test_emb[test_rows]
            out: np.ndarray = np.einsum("ij,ij->i", a, b) / (
                np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-12
            )
            return out

        result = verify_pairs(
            found,
            images(train),
            images(test),
            threshold=cfg.threshold,
            band=cfg.verify_band,
            config=cfg.verification,
            votes=cosine if cfg.verify_votes else None,
        )
        n_train = len(train_emb)
    elif not on_files:
        result = find_near_duplicates(train_emb, test_emb, config=cfg, progress=progress)
        n_train = len(train_emb)
    result.stats["threshold"] = cfg.threshold
    result.stats["threshold_source"] = threshold_source
    if note:
        result.notes.append(note)
    if any(skipped.values()):
        result.stats["images_skipped"] = skipped
    table = None
    table_out: Path | None = None
    if cfg.metadata:
        table_out = Path(cfg.metadata_out or out / f"{Path(cfg.metadata).name.split('.')[0]}_dedup.parquet")
        table = remove_from_table(
            cfg.metadata,
            table_out,
            drop_keys=[train_names[i] for i in result.drop_indices] if train_names is not None else None,
            drop_rows=None if train_names is not None else result.drop_indices,
            key_column=cfg.key_column,
            expected_rows=n_train,
        )
        result.stats["metadata"] = {**table, "path": str(table_out)}
    paths = write_outputs(result, out, train_keys=train_names, test_keys=test_names)
    if table_out is not None:
        paths["metadata"] = table_out
    return DedupRun(result, train_names, test_names, paths, skipped, table)
