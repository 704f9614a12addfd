"""The README's "pipeline, one command per stage" run end to end through the real CLI, on a tiny crawl.

Each line is read from README.md and run as written, in a folder holding the inputs it names, with only
flags that make the run small appended (fewer steps, smaller images, a tiny model); then the stage's outputs
are checked. A changed README line is what runs here; a new command runs without extra flags or checks.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from openalign.cli import build_parser, main
from openalign.cli.options import data, overrides
from readme_utils import readme_lines

SECTION = "## The pipeline, one command per stage"
CRAWL_ROWS = 240
IMAGE_SIZE = 32
RETRIEVAL_IMAGES = 8

# Flags appended to the README's own, only to make each stage small; keyed by command path.
SHRINK: dict[tuple[str, ...], list[str]] = {
    ("copy-detector", "train"): ["--steps", "2", "--batch-size", "8", "--warmup-steps", "0", "--image-size", "32"],
    ("dedup",): ["--clusters", "8", "--batch-size", "32"],
    # Several shards, so the README's brace range below names some shards that exist and many that do not
    # (a missing shard of a range is skipped and counted, as webdataset does).
    ("shard",): ["--samples-per-shard", "64"],
    # The nano dual encoder on 32 px crops instead of B7 + BERT-Base at 289 px; a batch of 4 instead of 16384.
    ("train",): [
        "--model.preset", "nano", "--model.image_size", "32", "--model.image.virtual_batch_size", "4",
        "--data.batch_size", "4", "--train.batch_size", "4", "--data.image_size", "32", "--data.resize", "36",
        "--data.max_text_length", "16", "--data.workers", "0", "--data.shuffle_buffer", "16",
        "--optim.total_steps", "2", "--optim.warmup_steps", "1",
    ],
}  # fmt: skip


def _command(argv: list[str]) -> tuple[str, ...]:
    """The command path of an argv: ("filter",), ("copy-detector", "train"), ("eval", "suite"), ..."""
    two = tuple(argv[:2])
    return two if two in {("copy-detector", "train"), ("eval", "suite"), ("index", "build")} else (argv[0],)


# --------------------------------------------------------------------------------------------------
# Inputs, in the formats the README's lines read


def _write_inputs(root: Path) -> None:
    from openalign.data.synthetic import write_corpus, write_retrieval_set

    # crawl.parquet (img2dataset-style metadata) + crawl/images/...: image_path values are relative to crawl/.
    write_corpus(
        root / "crawl",
        CRAWL_ROWS,
        seed=0,
        image_size=IMAGE_SIZE,
        test_seed=1,
        retrieval_images=RETRIEVAL_IMAGES,
        classification_per_class=1,
        test_duplicates=4,
    )
    (root / "crawl" / "metadata.parquet").rename(root / "crawl.parquet")
    # A Karpathy-format retrieval test set; its images are also the test images dedup checks the crawl against.
    karpathy = write_retrieval_set(root / "retrieval", RETRIEVAL_IMAGES, seed=1, image_size=IMAGE_SIZE)
    shutil.copytree(root / "retrieval" / "images", root / "test_images")
    # Plus byte-exact copies of two clean crawl images with unique files: whatever the copy detector learnt in
    # its few steps, they embed to the very same point, so dedup must drop their rows.
    crawl = pq.read_table(root / "crawl.parquet").to_pylist()
    uses = Counter(row["image_path"] for row in crawl)
    clean = [r for r in crawl if r["noise"] == "clean" and not r["image_noise"] and uses[r["image_path"]] == 1]
    for row in clean[:2]:
        shutil.copy(root / "crawl" / row["image_path"], root / "test_images" / f"copy_of_{row['key']}.jpg")
    suite = {
        "tasks": [
            {
                "task": "retrieval",
                "name": "synthetic",
                "dataset": f"karpathy:{karpathy.relative_to(root)}",
                "images": "retrieval",
                "batch_size": 8,
            }
        ]
    }
    (root / "suite.yaml").write_text(yaml.safe_dump(suite))


# --------------------------------------------------------------------------------------------------
# What each stage must leave behind; ``args`` is the README line as the CLI parses it


def _check_filter(args: argparse.Namespace, state: dict[str, Any]) -> None:
    rows_in = pq.read_metadata("crawl.parquet").num_rows
    rows_out = pq.read_metadata(args.output).num_rows
    assert 0 < rows_out < rows_in
    funnel = json.loads(Path(data(args)["report"]).read_text())
    assert funnel["rows_in"] == rows_in and funnel["rows_out"] == rows_out


def _check_copy_detector(args: argparse.Namespace, state: dict[str, Any]) -> None:
    meta = json.loads((Path(args.out) / "config.json").read_text())
    assert meta["architecture"] == "copy_detector"
    assert (Path(args.out) / "model.safetensors").is_file()


def _check_dedup(args: argparse.Namespace, state: dict[str, Any]) -> None:
    settings = data(args)
    out = Path(args.out)
    stem = Path(settings["metadata"]).name.split(".")[0]
    table = Path(settings.get("metadata_out") or out / f"{stem}_dedup.parquet")
    rows_in = pq.read_metadata(settings["metadata"]).num_rows
    rows_out = pq.read_metadata(table).num_rows
    stats = json.loads((out / "stats.json").read_text())
    assert stats["train_n"] == rows_in and stats["test_n"] == len(list(Path(args.test).glob("*.jpg")))
    dropped = set(json.loads((out / "drop.json").read_text()))
    assert 0 < rows_out == rows_in - len(dropped)
    kept = set(pq.read_table(settings["metadata"], columns=["key"]).column("key").to_pylist())
    copied = {p.stem.removeprefix("copy_of_") for p in Path(args.test).glob("copy_of_*.jpg")} & kept
    assert copied and copied <= dropped, (copied, dropped)
    assert (out / "duplicates.parquet").is_file()


def _check_vocab(args: argparse.Namespace, state: dict[str, Any]) -> None:
    import openalign

    tokenizer = openalign.load_tokenizer(args.out)
    assert (Path(args.out) / "tokenizer.json").is_file() and tokenizer.vocab_size > 100
    assert tokenizer(["a red circle on grass"])["input_ids"].shape[0] == 1


def _check_shard(args: argparse.Namespace, state: dict[str, Any]) -> None:
    from openalign.data.shards import read_stats

    tars = sorted(Path(args.out).glob("*.tar"))
    stats = read_stats(args.out)
    rows = pq.read_metadata(args.input).num_rows
    assert len(tars) == stats.shards == math.ceil(stats.successes / 64) >= 2
    assert stats.successes == rows and stats.failed == 0
    state["shard_samples"] = stats.successes


def _check_train(args: argparse.Namespace, state: dict[str, Any]) -> None:
    from openalign.train.config import load_train_config

    cfg = load_train_config(args.config, overrides(args))
    final = Path(cfg.train.run_dir) / "final"
    assert (final / "config.json").is_file() and (final / "model.safetensors").is_file()
    metrics = [json.loads(line) for line in (Path(cfg.train.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert max(m.get("step", 0) for m in metrics) == 2


def _check_eval(args: argparse.Namespace, state: dict[str, Any]) -> None:
    from openalign.cli.eval import suite_parser

    out = Path(suite_parser().parse_args(args.rest).out)
    results = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert len(results) == 1 and (out / "results.md").is_file()
    metrics = results[0]["metrics"]
    recalls = {k: v for k, v in metrics.items() if k[:3] in ("i2t", "t2i")}
    assert len(recalls) == 6 and all(0.0 <= v <= 100.0 for v in recalls.values()), metrics
    assert metrics["num_images"] == RETRIEVAL_IMAGES


def _check_index(args: argparse.Namespace, state: dict[str, Any]) -> None:
    from openalign.search.catalog import SearchIndex

    summary = SearchIndex.open(args.out).summary()
    assert summary["images"] == state["shard_samples"] and summary["captions"] == state["shard_samples"]


CHECKS: dict[tuple[str, ...], Callable[[argparse.Namespace, dict[str, Any]], None]] = {
    ("filter",): _check_filter,
    ("copy-detector", "train"): _check_copy_detector,
    ("dedup",): _check_dedup,
    ("vocab",): _check_vocab,
    ("shard",): _check_shard,
    ("train",): _check_train,
    ("eval", "suite"): _check_eval,
    ("index", "build"): _check_index,
}


# --------------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("one_thread")
def test_readme_pipeline_runs_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = readme_lines(SECTION)
    commands = [_command(shlex.split(line)[1:]) for line in lines]
    assert set(CHECKS) | {("serve",)} <= set(commands), f"a pipeline stage is gone from the README: {lines}"
    monkeypatch.chdir(tmp_path)
    _write_inputs(tmp_path)

    # `openalign serve` would listen forever: the line runs for real up to the point where uvicorn would start,
    # and the app it built is queried in-process instead.
    import openalign.search.api as api

    served: dict[str, Any] = {}
    monkeypatch.setattr(api, "serve", lambda app, **kwargs: served.update(app=app, **kwargs))

    state: dict[str, Any] = {}
    for line, command in zip(lines, commands, strict=True):
        argv = shlex.split(line)[1:] + SHRINK.get(command, [])
        code = main(argv)
        output = capsys.readouterr()
        assert code == 0, f"README line failed (exit {code}): {line}\nran: {shlex.join(argv)}\n{output.err[-3000:]}"
        check = CHECKS.get(command)
        if check is not None:
            check(build_parser().parse_args(argv), state)

    from fastapi.testclient import TestClient

    assert served, "openalign serve did not get as far as serving"
    with TestClient(served["app"]) as client:
        health = client.get("/health").json()
        assert health["status"] == "ok" and health["images"] == state["shard_samples"]
        assert health["model"] == "final"  # the folder the README's training wrote, named without its path
        hits = client.post("/search", json={"text": "a red circle on grass", "k": 3})
        assert hits.status_code == 200
        results = hits.json()["results"]
        assert len(results) == 3 and all(-1.0 <= r["score"] <= 1.0 for r in results)
        assert client.get(results[0]["thumbnail"]).headers["content-type"] == "image/jpeg"
