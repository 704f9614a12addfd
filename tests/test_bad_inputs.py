"""Every command, every bad input: exit status 2, one line on stderr, no traceback, nothing written.

Each case builds its bad input in its own folder, runs the real CLI in a child process (under an
address-space limit, so that a damaged file read whole fails the case instead of the machine) and checks
that neither its folder nor the shared inputs changed: no output, no temporary name, no half-written file.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import openalign

# Loading torch and a model maps about 2.2 GB of address space before any input is read.
MEMORY_LIMIT = 4 * 2**30
SRC = str(Path(openalign.__file__).resolve().parents[1])


@dataclass(frozen=True)
class World:
    """Good inputs every case may read (never write): a model with its tokenizer, images, tables, shards."""

    root: Path
    model: Path
    photos: Path
    pairs: Path  # url/caption/width/height metadata, as `filter` reads
    images_table: Path  # key/caption/jpg bytes, as `shard` reads
    shards: Path
    index: Path


def _jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((20, 24, 3)) * 255).astype(np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    import torch

    from conftest import tiny_overrides
    from openalign.cli import main
    from openalign.text import train_wordpiece

    root = tmp_path_factory.mktemp("world")
    model = root / "model"
    tokenizer = train_wordpiece(["a red cat", "a blue dog", "a green bird"] * 5, vocab_size=60, min_frequency=1)
    torch.manual_seed(0)
    openalign.save_model(
        openalign.create_model("nano", **tiny_overrides(text={"vocab_size": tokenizer.vocab_size})), model
    )
    tokenizer.save(model)
    photos = root / "photos"
    photos.mkdir()
    for i, caption in enumerate(["a red cat", "a blue dog", "a green bird"]):
        (photos / f"p{i}.jpg").write_bytes(_jpeg(i))
        (photos / f"p{i}.txt").write_text(caption)
    n = 60
    pairs = root / "pairs.parquet"
    pq.write_table(
        pa.table({
            "url": [f"http://x/{i}.jpg" for i in range(n)],
            "caption": [f"a red cat number {i} on a mat" for i in range(n)],
            "width": [400] * n,
            "height": [300] * n,
        }),
        pairs,
    )  # fmt: skip
    images_table = root / "images.parquet"
    pq.write_table(
        pa.table({"key": [f"k{i}" for i in range(n)], "caption": ["a cat"] * n, "jpg": [_jpeg(i) for i in range(n)]}),
        images_table,
    )
    shards = root / "shards"
    index = root / "index"
    assert main(["shard", str(photos), str(shards), "--quiet"]) == 0
    assert main(["index", "build", "--model", str(model), "--images", str(photos), "--out", str(index), "--quiet"]) == 0
    return World(root, model, photos, pairs, images_table, shards, index)


# --------------------------------------------------------------------------------------------------
# bad inputs, made from good ones


def damaged_pages(good: Path, out: Path) -> Path:
    """``good`` with its data pages overwritten; the footer (schema, row counts) still reads."""
    data = bytearray(good.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little") + 8
    data[4 : len(data) - footer] = b"\xab" * (len(data) - footer - 4)
    out.write_bytes(bytes(data))
    return out


def start_cut(good: Path, out: Path) -> Path:
    """``good`` without its first 200 bytes: every page offset of the footer now points elsewhere."""
    out.write_bytes(good.read_bytes()[200:])
    return out


def bad_yaml(path: Path) -> Path:
    path.write_text("rules: {max_words: [30\nengine: duckdb\n")
    return path


def unwritable(tmp: Path) -> Path:
    """A folder no file can be created in: a read-only one, or /proc where permission bits do not bind (root)."""
    locked = tmp / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    return locked if not os.access(locked, os.W_OK) else Path("/proc")


def a_file(tmp: Path, name: str = "taken") -> Path:
    (tmp / name).write_text("not a folder\n")
    return tmp / name


# --------------------------------------------------------------------------------------------------
# the table


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[Path, World], list[str]]  # the command line, with its bad input made in the folder given
    match: str  # in the error line


CASES: list[Case] = []


def case(name: str, match: str) -> Callable[[Callable[[Path, World], list[str]]], None]:
    def add(build: Callable[[Path, World], list[str]]) -> None:
        CASES.append(Case(name, build, match))

    return add


# filter ------------------------------------------------------------------------------------------


@case("filter-damaged-parquet-pages", "cannot filter")
def _(t: Path, w: World) -> list[str]:
    return ["filter", str(damaged_pages(w.pairs, t / "bad.parquet")), str(t / "out.parquet"), "--quiet"]


@case("filter-parquet-start-cut-off", "cannot filter")
def _(t: Path, w: World) -> list[str]:
    return ["filter", str(start_cut(w.pairs, t / "cut.parquet")), str(t / "out.parquet"), "--quiet"]


@case("filter-parquet-that-is-text", "bad.parquet")
def _(t: Path, w: World) -> list[str]:
    (t / "bad.parquet").write_text("url,caption\nhttp://x,a cat\n")
    return ["filter", str(t / "bad.parquet"), str(t / "out.parquet"), "--quiet"]


@case("filter-output-folder-is-a-file", "not a directory")
def _(t: Path, w: World) -> list[str]:
    return ["filter", str(w.pairs), str(a_file(t) / "out.parquet"), "--quiet"]


@case("filter-output-folder-unwritable", "cannot write")
def _(t: Path, w: World) -> list[str]:
    return ["filter", str(w.pairs), str(unwritable(t) / "out.parquet"), "--quiet"]


@case("filter-report-unwritable", "report")
def _(t: Path, w: World) -> list[str]:
    return ["filter", str(w.pairs), str(t / "out.parquet"), "--report", str(unwritable(t) / "r.json"), "--quiet"]


@case("filter-report-folder-missing", "no such directory")
def _(t: Path, w: World) -> list[str]:
    return ["filter", str(w.pairs), str(t / "out.parquet"), "--report", str(t / "none" / "r.json"), "--quiet"]


@case("filter-report-is-a-folder", "report")
def _(t: Path, w: World) -> list[str]:
    (t / "r.json").mkdir()
    return ["filter", str(w.pairs), str(t / "out.parquet"), "--report", str(t / "r.json"), "--quiet"]


@case("filter-overwrite-output-is-the-input", "is, or holds, the input")
def _(t: Path, w: World) -> list[str]:
    (t / "pairs.parquet").write_bytes(w.pairs.read_bytes())
    return ["filter", str(t / "pairs.parquet"), str(t / "pairs.parquet"), "--overwrite", "--quiet"]


@case("filter-overwrite-output-holds-the-input", "is, or holds, the input")
def _(t: Path, w: World) -> list[str]:
    (t / "parts.parquet").mkdir()
    (t / "parts.parquet" / "0.parquet").write_bytes(w.pairs.read_bytes())
    return ["filter", str(t / "parts.parquet" / "*.parquet"), str(t / "parts.parquet"), "--overwrite", "--quiet"]


@case("filter-overwrite-same-file-by-another-path", "is, or holds, the input")
def _(t: Path, w: World) -> list[str]:
    (t / "d").mkdir()
    (t / "d" / "pairs.parquet").write_bytes(w.pairs.read_bytes())
    return ["filter", str(t / "d" / "pairs.parquet"), str(t / "d" / ".." / "d" / "pairs.parquet"), "--overwrite"]


@case("filter-output-exists", "exists")
def _(t: Path, w: World) -> list[str]:
    (t / "out.parquet").write_text("keep me")
    return ["filter", str(w.pairs), str(t / "out.parquet"), "--quiet"]


@case("filter-malformed-config-yaml", "not valid YAML at line 2")
def _(t: Path, w: World) -> list[str]:
    return ["filter", str(w.pairs), str(t / "out.parquet"), "--config", str(bad_yaml(t / "f.yaml"))]


@case("filter-malformed-rules-yaml", "not valid YAML")
def _(t: Path, w: World) -> list[str]:
    return ["filter", str(w.pairs), str(t / "out.parquet"), "--rules", str(bad_yaml(t / "rules.yaml"))]


@case("filter-config-yaml-is-a-list", "mapping")
def _(t: Path, w: World) -> list[str]:
    (t / "f.yaml").write_text("- rules\n- engine\n")
    return ["filter", str(w.pairs), str(t / "out.parquet"), "--config", str(t / "f.yaml")]


@case("filter-config-file-missing", "no-such.yaml")
def _(t: Path, w: World) -> list[str]:
    return ["filter", str(w.pairs), str(t / "out.parquet"), "--config", str(t / "no-such.yaml")]


@case("filter-missing-input", "missing.parquet")
def _(t: Path, w: World) -> list[str]:
    return ["filter", str(t / "missing.parquet"), str(t / "out.parquet"), "--quiet"]


@case("filter-unknown-output-format", "out.txt")
def _(t: Path, w: World) -> list[str]:
    return ["filter", str(w.pairs), str(t / "out.txt"), "--quiet"]


@case("filter-zero-threads", "threads")
def _(t: Path, w: World) -> list[str]:
    return ["filter", str(w.pairs), str(t / "out.parquet"), "--threads", "0", "--quiet"]


@case("filter-csv-stray-quote-names-its-line", "line 6")
def _(t: Path, w: World) -> list[str]:
    # 300 rows with one stray quote in row 5: once 295 rows vanished into one "malformed row" and it exited 0.
    quote = '"'
    rows = [f"http://x/{i}.jpg,{quote if i == 4 else ''}a red cat number {i},400,300" for i in range(300)]
    (t / "pairs.csv").write_text("\n".join(["url,caption,width,height", *rows]) + "\n")
    return ["filter", str(t / "pairs.csv"), str(t / "out.parquet"), "--quiet"]


@case("filter-caption-column-holds-ints", "not text")
def _(t: Path, w: World) -> list[str]:
    pq.write_table(
        pa.table({"url": ["http://x/0.jpg"], "caption": [5], "width": [400], "height": [300]}), t / "p.parquet"
    )
    return ["filter", str(t / "p.parquet"), str(t / "out.parquet"), "--quiet"]


# shard -------------------------------------------------------------------------------------------


@case("shard-out-is-an-existing-file", "not a directory")
def _(t: Path, w: World) -> list[str]:
    return ["shard", str(w.photos), str(a_file(t)), "--quiet"]


@case("shard-out-below-a-file", "not a directory")
def _(t: Path, w: World) -> list[str]:
    return ["shard", str(w.photos), str(a_file(t) / "shards"), "--quiet"]


@case("shard-out-unwritable", "cannot write")
def _(t: Path, w: World) -> list[str]:
    return ["shard", str(w.photos), str(unwritable(t) / "shards"), "--quiet"]


@case("shard-damaged-parquet-pages", "cannot read")
def _(t: Path, w: World) -> list[str]:
    return ["shard", str(damaged_pages(w.images_table, t / "bad.parquet")), str(t / "shards"), "--quiet"]


@case("shard-parquet-start-cut-off", "cannot read")
def _(t: Path, w: World) -> list[str]:
    return ["shard", str(start_cut(w.images_table, t / "cut.parquet")), str(t / "shards"), "--quiet"]


@case("shard-malformed-config-yaml", "not valid YAML")
def _(t: Path, w: World) -> list[str]:
    return ["shard", str(w.photos), str(t / "shards"), "--config", str(bad_yaml(t / "s.yaml"))]


@case("shard-missing-input", "no such input")
def _(t: Path, w: World) -> list[str]:
    return ["shard", str(t / "photos"), str(t / "shards"), "--quiet"]


@case("shard-zero-samples-per-shard", "samples_per_shard")
def _(t: Path, w: World) -> list[str]:
    return ["shard", str(w.photos), str(t / "shards"), "--samples-per-shard", "0", "--quiet"]


@case("shard-caption-column-holds-lists", "not text")
def _(t: Path, w: World) -> list[str]:
    table = pa.table({"key": ["a"], "caption": [["a", "cat"]], "jpg": [_jpeg(0)]})
    pq.write_table(table, t / "rows.parquet")
    return ["shard", str(t / "rows.parquet"), str(t / "shards"), "--quiet"]


@case("shard-jsonl-caption-column-holds-ints", "not text")
def _(t: Path, w: World) -> list[str]:
    (t / "rows.jsonl").write_text('{"key": "a", "caption": 1, "image_path": "a.jpg"}\n')
    return ["shard", str(t / "rows.jsonl"), str(t / "shards"), "--quiet"]


# vocab -------------------------------------------------------------------------------------------


@case("vocab-damaged-parquet-pages", "cannot read")
def _(t: Path, w: World) -> list[str]:
    return ["vocab", str(damaged_pages(w.pairs, t / "bad.parquet")), str(t / "vocab"), "--quiet"]


@case("vocab-parquet-start-cut-off", "cannot read")
def _(t: Path, w: World) -> list[str]:
    return ["vocab", str(start_cut(w.pairs, t / "cut.parquet")), str(t / "vocab"), "--quiet"]


@case("vocab-out-is-a-file", "not a directory")
def _(t: Path, w: World) -> list[str]:
    return ["vocab", str(w.pairs), str(a_file(t)), "--quiet"]


@case("vocab-out-unwritable", "cannot write")
def _(t: Path, w: World) -> list[str]:
    return ["vocab", str(w.pairs), str(unwritable(t) / "vocab"), "--quiet"]


@case("vocab-malformed-config-yaml", "not valid YAML")
def _(t: Path, w: World) -> list[str]:
    return ["vocab", str(w.pairs), str(t / "vocab"), "--config", str(bad_yaml(t / "v.yaml"))]


@case("vocab-no-usable-captions", "no usable captions")
def _(t: Path, w: World) -> list[str]:
    (t / "empty.txt").write_text("\n\n")
    return ["vocab", str(t / "empty.txt"), str(t / "vocab"), "--quiet"]


# dedup -------------------------------------------------------------------------------------------


def _embeddings(t: Path, train_dim: int = 8, test_dim: int = 8) -> tuple[str, str]:
    rng = np.random.default_rng(0)
    np.save(t / "train.npy", rng.standard_normal((20, train_dim)).astype(np.float32))
    np.save(t / "test.npy", rng.standard_normal((5, test_dim)).astype(np.float32))
    return str(t / "train.npy"), str(t / "test.npy")


@case("dedup-out-is-a-file", "not a directory")
def _(t: Path, w: World) -> list[str]:
    return ["dedup", *_embeddings(t), str(a_file(t)), "--quiet"]


@case("dedup-out-unwritable", "cannot write")
def _(t: Path, w: World) -> list[str]:
    return ["dedup", *_embeddings(t), str(unwritable(t) / "dedup"), "--quiet"]


@case("dedup-train-embeddings-missing", "missing.npy")
def _(t: Path, w: World) -> list[str]:
    _, test = _embeddings(t)
    return ["dedup", str(t / "missing.npy"), test, str(t / "dedup"), "--quiet"]


@case("dedup-embeddings-not-npy", "train.npy")
def _(t: Path, w: World) -> list[str]:
    _, test = _embeddings(t)
    (t / "train.npy").write_bytes(b"\x93NUMPY garbage")
    return ["dedup", str(t / "train.npy"), test, str(t / "dedup"), "--quiet"]


@case("dedup-embedding-widths-differ", "8")
def _(t: Path, w: World) -> list[str]:
    return ["dedup", *_embeddings(t, 8, 4), str(t / "dedup"), "--quiet"]


@case("dedup-malformed-config-yaml", "not valid YAML")
def _(t: Path, w: World) -> list[str]:
    return ["dedup", *_embeddings(t), str(t / "dedup"), "--config", str(bad_yaml(t / "d.yaml"))]


@case("dedup-model-missing", "no-model")
def _(t: Path, w: World) -> list[str]:
    return ["dedup", str(w.photos), str(w.photos), str(t / "dedup"), "--embedder", f"align:{t / 'no-model'}"]


# train -------------------------------------------------------------------------------------------


def _train(t: Path, w: World, *extra: str) -> list[str]:
    (t / "run.yaml").write_text(
        "model: {preset: nano, init: MODEL}\n"
        "data: {source: shards, tokenizer: MODEL, batch_size: 2, workers: 1, shuffle_buffer: 0}\n"
        "train: {steps: 1, run_dir: RUN}\n".replace("MODEL", str(w.model)).replace("RUN", str(t / "run"))
    )
    return ["train", "--config", str(t / "run.yaml"), "--data.shards", str(w.shards / "00000.tar"), *extra]


@case("train-every-shard-missing", "none of the 2 shard(s) exists")
def _(t: Path, w: World) -> list[str]:
    return _train(t, w, "--data.shards", str(t / "gone" / "{00000..00001}.tar"))


@case("train-lr-infinite", "optim.lr: expected a finite number")
def _(t: Path, w: World) -> list[str]:
    # Once accepted: ten non-finite steps, then a kept checkpoint full of NaN that --resume could not recover.
    return _train(t, w, "--optim.lr", ".inf")


@case("train-run-dir-is-a-file", "not a directory")
def _(t: Path, w: World) -> list[str]:
    return _train(t, w, "--train.run_dir", str(a_file(t)))


@case("train-run-dir-unwritable", "cannot write")
def _(t: Path, w: World) -> list[str]:
    return _train(t, w, "--train.run_dir", str(unwritable(t) / "run"))


@case("train-malformed-config-yaml", "not valid YAML")
def _(t: Path, w: World) -> list[str]:
    return ["train", "--config", str(bad_yaml(t / "run.yaml"))]


@case("train-tokenizer-missing", "no-tokenizer")
def _(t: Path, w: World) -> list[str]:
    return _train(t, w, "--data.tokenizer", str(t / "no-tokenizer"))


@case("train-unknown-recipe", "no_such_recipe")
def _(t: Path, w: World) -> list[str]:
    return ["train", "--config", "no_such_recipe"]


# eval --------------------------------------------------------------------------------------------


@case("eval-retrieval-out-is-a-file", "not a directory")
def _(t: Path, w: World) -> list[str]:
    out = a_file(t)
    return ["eval", "retrieval", "--model", str(w.model), "--dataset", f"wds:{w.shards}/00000.tar", "--out", str(out)]


@case("eval-retrieval-out-unwritable", "cannot write")
def _(t: Path, w: World) -> list[str]:
    out = unwritable(t) / "results"
    return ["eval", "retrieval", "--model", str(w.model), "--dataset", f"wds:{w.shards}/00000.tar", "--out", str(out)]


@case("eval-retrieval-damaged-csv", "pairs.csv")
def _(t: Path, w: World) -> list[str]:
    (t / "pairs.csv").write_text('image,caption\np0.jpg,"a red cat\n')
    return ["eval", "retrieval", "--model", str(w.model), "--dataset", f"csv:{t / 'pairs.csv'}", "--images", str(t)]


@case("eval-zeroshot-missing-dataset", "no-such")
def _(t: Path, w: World) -> list[str]:
    return ["eval", "zeroshot", "--model", str(w.model), "--dataset", str(t / "no-such")]


@case("eval-knn-model-missing", "no-model")
def _(t: Path, w: World) -> list[str]:
    return ["eval", "knn", "--model", str(t / "no-model"), "--train", str(w.photos), "--val", str(w.photos)]


@case("eval-simlex-file-missing", "simlex.txt")
def _(t: Path, w: World) -> list[str]:
    return ["eval", "simlex", "--model", str(w.model), "--file", str(t / "simlex.txt")]


@case("eval-unknown-task", "nonesuch")
def _(t: Path, w: World) -> list[str]:
    return ["eval", "nonesuch", "--model", str(w.model)]


@case("eval-suite-malformed-yaml", "not valid YAML")
def _(t: Path, w: World) -> list[str]:
    (t / "suite.yaml").write_text("tasks:\n  - {task: zeroshot\n")
    return ["eval", "suite", str(t / "suite.yaml"), "--model", str(w.model)]


@case("eval-suite-out-unwritable", "cannot write")
def _(t: Path, w: World) -> list[str]:
    (t / "suite.yaml").write_text(f"tasks:\n  - {{task: retrieval, dataset: 'wds:{w.shards}/00000.tar'}}\n")
    return ["eval", "suite", str(t / "suite.yaml"), "--model", str(w.model), "--out", str(unwritable(t) / "r")]


@case("eval-suite-out-is-a-file", "not a directory")
def _(t: Path, w: World) -> list[str]:
    (t / "suite.yaml").write_text(f"tasks:\n  - {{task: retrieval, dataset: 'wds:{w.shards}/00000.tar'}}\n")
    return ["eval", "suite", str(t / "suite.yaml"), "--model", str(w.model), "--out", str(a_file(t))]


def mismatched_model(t: Path, w: World) -> Path:
    """``w.model``'s weights under a config one text layer wider than they are."""
    import shutil

    model = t / "mismatched"
    shutil.copytree(w.model, model)
    meta = json.loads((model / "config.json").read_text())
    meta["model"]["text"]["hidden_size"] = 48
    (model / "config.json").write_text(json.dumps(meta))
    return model


@case("eval-simlex-model-shapes-mismatch", "the model expects [")
def _(t: Path, w: World) -> list[str]:
    (t / "simlex.txt").write_text("word1\tword2\tSimLex999\ncat\tdog\t5.0\nred\tblue\t3.0\n")
    return ["eval", "simlex", "--model", str(mismatched_model(t, w)), "--file", str(t / "simlex.txt")]


@case("eval-simlex-model-weights-truncated", "model.safetensors: truncated or corrupt")
def _(t: Path, w: World) -> list[str]:
    import shutil

    model = t / "cut"
    shutil.copytree(w.model, model)
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) // 2])
    (t / "simlex.txt").write_text("word1\tword2\tSimLex999\ncat\tdog\t5.0\n")
    return ["eval", "simlex", "--model", str(model), "--file", str(t / "simlex.txt")]


@case("eval-retrieval-karpathy-over-max-annotation-mb", "max_annotation_mb")
def _(t: Path, w: World) -> list[str]:
    images = [{"split": "test", "filename": "p0.jpg", "sentences": [{"raw": "a red cat"}]}]
    (t / "karpathy.json").write_text(json.dumps({"images": images}))
    dataset = f"karpathy:{t / 'karpathy.json'}"
    argv = ["eval", "retrieval", "--model", str(w.model), "--dataset", dataset, "--images", str(w.photos)]
    return [*argv, "--max-annotation-mb", "0.00001", "--out", str(t / "results")]


# index build, search, serve ----------------------------------------------------------------------


@case("index-build-out-below-a-file", "not a directory")
def _(t: Path, w: World) -> list[str]:
    return ["index", "build", "--model", str(w.model), "--images", str(w.photos), "--out", str(a_file(t) / "idx")]


@case("index-build-out-unwritable", "cannot write")
def _(t: Path, w: World) -> list[str]:
    out = unwritable(t) / "idx"
    return ["index", "build", "--model", str(w.model), "--images", str(w.photos), "--out", str(out), "--quiet"]


@case("index-build-damaged-parquet-pages", "cannot read")
def _(t: Path, w: World) -> list[str]:
    table = damaged_pages(w.images_table, t / "bad.parquet")
    return ["index", "build", "--model", str(w.model), "--images", str(table), "--out", str(t / "idx"), "--quiet"]


@case("index-build-model-missing", "no-model")
def _(t: Path, w: World) -> list[str]:
    return ["index", "build", "--model", str(t / "no-model"), "--images", str(w.photos), "--out", str(t / "idx")]


@case("index-build-malformed-config-yaml", "not valid YAML")
def _(t: Path, w: World) -> list[str]:
    cfg = str(bad_yaml(t / "b.yaml"))
    return [
        "index",
        "build",
        "--model",
        str(w.model),
        "--images",
        str(w.photos),
        "--out",
        str(t / "i"),
        "--config",
        cfg,
    ]


@case("index-build-resume-under-another-max-file-mb", "max_file_mb (was 64.0, now 1.0)")
def _(t: Path, w: World) -> list[str]:
    pending = t / "idx" / "pending"
    pending.mkdir(parents=True)
    manifest = {"source": str(w.photos), "captions": False, "chunk_size": 1024, "base_images": 0}
    manifest |= {"thumbnail_size": 256, "max_file_mb": 64.0, "max_pixels": 64_000_000, "allow_outside_root": False}
    (pending / "manifest.json").write_text(json.dumps(manifest))
    argv = ["index", "build", "--model", str(w.model), "--images", str(w.photos), "--out", str(t / "idx")]
    return [*argv, "--max-file-mb", "1", "--quiet"]


@case("index-build-caption-column-holds-ints", "not text")
def _(t: Path, w: World) -> list[str]:
    pq.write_table(pa.table({"key": ["a"], "caption": [7], "jpg": [_jpeg(0)]}), t / "rows.parquet")
    argv = ["index", "build", "--model", str(w.model), "--images", str(t / "rows.parquet"), "--out", str(t / "idx")]
    return [*argv, "--captions", "--quiet"]


@case("search-index-missing", "no-index")
def _(t: Path, w: World) -> list[str]:
    return ["search", str(t / "no-index"), "--text", "a red cat"]


@case("search-index-is-an-empty-folder", "empty")
def _(t: Path, w: World) -> list[str]:
    (t / "empty").mkdir()
    return ["search", str(t / "empty"), "--text", "a red cat"]


def index_copy(t: Path, w: World) -> Path:
    import shutil

    return Path(shutil.copytree(w.index, t / "idx"))


@case("search-index-json-damaged", "index.json: damaged, not valid JSON")
def _(t: Path, w: World) -> list[str]:
    index = index_copy(t, w)
    (index / "index.json").write_text("{'format': 'openalign-index'}")
    return ["search", str(index), "--text", "a red cat"]


@case("search-index-vectors-truncated", "image/vectors.npy: truncated or damaged .npy file")
def _(t: Path, w: World) -> list[str]:
    index = index_copy(t, w)
    data = (index / "image" / "vectors.npy").read_bytes()
    (index / "image" / "vectors.npy").write_bytes(data[: len(data) - 40])
    return ["search", str(index), "--text", "a red cat"]


@case("search-index-metadata-missing", "image/metadata.parquet: missing")
def _(t: Path, w: World) -> list[str]:
    index = index_copy(t, w)
    (index / "image" / "metadata.parquet").unlink()
    return ["search", str(index), "--text", "a red cat"]


@case("serve-index-json-damaged", "index.json: damaged, not valid JSON")
def _(t: Path, w: World) -> list[str]:
    index = index_copy(t, w)
    (index / "index.json").write_text('{"format": "openalign-index", ')
    return ["serve", "--index", str(index), "--port", "0"]


@case("search-query-image-missing", "nope.jpg")
def _(t: Path, w: World) -> list[str]:
    return ["search", str(w.index), "--image", str(t / "nope.jpg")]


@case("search-query-image-not-an-image", "q.jpg")
def _(t: Path, w: World) -> list[str]:
    (t / "q.jpg").write_text("not an image")
    return ["search", str(w.index), "--image", str(t / "q.jpg")]


@case("search-k-zero", "k")
def _(t: Path, w: World) -> list[str]:
    return ["search", str(w.index), "--text", "a red cat", "-k", "0"]


@case("serve-index-missing", "no-index")
def _(t: Path, w: World) -> list[str]:
    return ["serve", "--index", str(t / "no-index"), "--port", "0"]


@case("serve-index-is-a-file", "taken")
def _(t: Path, w: World) -> list[str]:
    return ["serve", "--index", str(a_file(t)), "--port", "0"]


@case("serve-reload-check-negative", "--reload-check-s must be -1 (never) or seconds")
def _(t: Path, w: World) -> list[str]:
    return ["serve", "--index", str(w.index), "--port", "0", "--reload-check-s", "-0.5"]


@case("serve-port-out-of-range", "port")
def _(t: Path, w: World) -> list[str]:
    return ["serve", "--index", str(w.index), "--port", "70000"]


# Sockets the port cases hold while their command runs (closed with the test session).
_HELD: list[socket.socket] = []


def port_in_use() -> int:
    """A loopback port another socket is listening on."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    _HELD.append(sock)
    return int(sock.getsockname()[1])


@case("serve-port-in-use", "is in use")
def _(t: Path, w: World) -> list[str]:
    return ["serve", "--index", str(w.index), "--host", "127.0.0.1", "--port", str(port_in_use())]


@case("serve-port-in-use-checked-before-the-index-loads", "is in use")
def _(t: Path, w: World) -> list[str]:
    # The index does not exist: the port is what is reported, found before any loading starts.
    return ["serve", "--index", str(t / "no-index"), "--port", str(port_in_use())]


@case("serve-host-unknown", "cannot listen on")
def _(t: Path, w: World) -> list[str]:
    return ["serve", "--index", str(w.index), "--host", "no-such-host.invalid", "--port", "0"]


@case("serve-malformed-config-yaml", "not valid YAML")
def _(t: Path, w: World) -> list[str]:
    return ["serve", "--index", str(w.index), "--config", str(bad_yaml(t / "serve.yaml"))]


# --------------------------------------------------------------------------------------------------
# the check


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` with its content's digest (folders as "dir")."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


ENV = {**os.environ, "PYTHONPATH": SRC, "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"}
LIMIT = f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT}, {MEMORY_LIMIT}))\n"


def _fresh(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``openalign ARGV`` in a new interpreter."""
    code = LIMIT + "import sys\nfrom openalign.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=240, env=ENV, cwd=cwd, check=False
    )


# A child that imports torch and the stages once, then forks one process per command line: each case
# still runs the real `main` in its own process, with its own exit status and streams, for a few
# milliseconds where a new interpreter would spend seconds importing torch. An uncaught exception
# prints its traceback and exits 1, as the interpreter would; a case that hangs is killed by SIGALRM.
FORK_SERVER = (
    LIMIT
    + """import json, os, signal, sys, traceback
import torch, pyarrow.parquet, duckdb
import openalign.cli, openalign.data.shards, openalign.eval.suite, openalign.pipeline.dedup
import openalign.search.api, openalign.search.build, openalign.text.vocab, openalign.train.loop
from openalign.cli import main

for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(request["cwd"])
            for fd, name in ((1, "stdout"), (2, "stderr")):
                os.dup2(os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            signal.alarm(200)
            try:
                code = main(request["argv"])
            except SystemExit as exit:
                if isinstance(exit.code, str):
                    print(exit.code, file=sys.stderr)
                code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
            except BaseException:
                traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
"""
)


class Forks:
    def __init__(self, streams: Path):
        self.streams = streams
        self.server = subprocess.Popen(
            [sys.executable, "-c", FORK_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV
        )

    def run(self, argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
        out, err = self.streams / "stdout", self.streams / "stderr"
        assert self.server.stdin is not None and self.server.stdout is not None
        self.server.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}))
        self.server.stdin.write("\n")
        self.server.stdin.flush()
        code = int(self.server.stdout.readline())
        return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())

    def close(self) -> None:
        assert self.server.stdin is not None
        self.server.stdin.close()
        self.server.wait(timeout=60)


@pytest.fixture(scope="module")
def forks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Forks]:
    server = Forks(tmp_path_factory.mktemp("streams"))
    yield server
    server.close()


def test_the_table_is_long_enough() -> None:
    commands = {c.name.split("-")[0] for c in CASES}
    assert len(CASES) >= 50 and len({c.name for c in CASES}) == len(CASES)
    assert commands == {"filter", "shard", "vocab", "dedup", "train", "eval", "index", "search", "serve"}


@pytest.mark.parametrize("bad", CASES, ids=[c.name for c in CASES])
def test_a_bad_input_is_one_line_and_writes_nothing(bad: Case, tmp_path: Path, world: World, forks: Forks) -> None:
    argv = bad.build(tmp_path, world)
    before, inputs = _snapshot(tmp_path), _snapshot(world.root)
    # filter loads no torch: its cases start a new interpreter each, the others fork from one that has it.
    run = _fresh(argv, tmp_path) if argv[0] == "filter" else forks.run(argv, tmp_path)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    command = argv[0] if argv[0] not in ("index",) else "index"
    assert lines and lines[-1].startswith(f"openalign {command}: error: "), run.stderr[-3000:]
    assert bad.match in lines[-1], lines[-1]
    # Nothing before the error line but argparse's usage (which starts "usage:" and indents its continuation).
    for line in lines[:-1]:
        assert line.startswith(("usage:", " ")), run.stderr[-3000:]
    assert _snapshot(tmp_path) == before, "the command left or changed files"
    assert _snapshot(world.root) == inputs, "the command changed an input"
    if (tmp_path / "locked").exists():
        (tmp_path / "locked").chmod(0o755)


def test_a_report_write_is_whole_or_absent(tmp_path: Path) -> None:
    from openalign.outputs import atomic_write_text

    atomic_write_text(tmp_path / "r.json", json.dumps({"a": 1}))
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": 1}
    with pytest.raises(TypeError):
        atomic_write_text(tmp_path / "r.json", 5)  # type: ignore[arg-type]  # fails after the temporary file opened
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": 1}
