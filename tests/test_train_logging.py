from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from openalign.config import ConfigError, from_dict
from openalign.train.logging import LogConfig, RunLogger, plot_metrics, read_metrics


def lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_log_config_is_strict() -> None:
    assert from_dict(LogConfig, {"every": 5}).logger_kwargs(7) == {
        "tensorboard": True,
        "progress": True,
        "start_step": 7,
        "wandb": None,
    }
    wandb = from_dict(LogConfig, {"wandb": True, "wandb_tags": ["lit"]}).logger_kwargs()["wandb"]
    assert wandb == {"project": "openalign", "name": None, "tags": ["lit"]}
    with pytest.raises(ConfigError, match="every"):
        from_dict(LogConfig, {"every": 0})
    with pytest.raises(ConfigError, match="evry"):
        from_dict(LogConfig, {"evry": 3})


def test_jsonl_tensorboard_and_progress_bar(tmp_path: Path, capsys) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with RunLogger(tmp_path, True, total_steps=4) as logger:
        logger.log(1, {"loss": torch.tensor(2.5), "temperature": 0.9, "lr": 1e-3, "pairs_per_s": 123.4})
        logger.log(2, {"loss": float("nan"), "skipped": {"corrupt": 2, "empty": 1}, "note": "text is kept"})
        logger.log(4, {"loss": np.float32(1.25), "eval/t2i_r1": 40.0})
        logger.say("a line of its own")
    records = lines(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 4]
    assert records[0]["loss"] == 2.5 and records[0]["lr"] == 1e-3 and isinstance(records[0]["time"], float)
    assert records[1]["loss"] is None  # NaN is not JSON
    assert (
        records[1]["skipped/corrupt"] == 2 and records[1]["skipped/empty"] == 1 and records[1]["note"] == "text is kept"
    )
    assert records[2]["loss"] == 1.25 and records[2]["eval/t2i_r1"] == 40.0
    err = capsys.readouterr().err
    assert "4/4" in err and "pairs/s=123.4" in err and "loss=2.5000" in err and "lr=1.00e-03" in err
    # Above the bar, not run into its line.
    assert "a line of its own" in [line.strip("\r") for line in err.replace("\r", "\n").splitlines()]

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 2.5), (4, 1.25)]
    assert [(e.step, e.value) for e in events.Scalars("skipped/corrupt")] == [(2, 2.0)]
    assert "note" not in events.Tags()["scalars"]


def test_only_the_main_rank_writes(tmp_path: Path) -> None:
    logger = RunLogger(tmp_path / "run", False, total_steps=3)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert not (tmp_path / "run").exists()


def test_resume_drops_records_after_the_checkpoint(tmp_path: Path) -> None:
    logger = RunLogger(tmp_path, True, 10, tensorboard=False, progress=False)
    for step in range(1, 7):
        logger.log(step, {"loss": 10.0 - step})
    logger.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 3')  # cut off by a crash
    logger = RunLogger(tmp_path, True, 10, tensorboard=False, progress=False, start_step=4)
    logger.log(5, {"loss": 0.5})
    logger.close()
    assert [(r["step"], r["loss"]) for r in lines(tmp_path)] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 0.5)]
    RunLogger(tmp_path, True, 10, tensorboard=False, progress=False).close()  # a fresh run starts over
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_read_metrics_keeps_the_last_record_of_a_step(tmp_path: Path) -> None:
    rows = [
        {"step": 1, "loss": 3.0, "lr": 0.1},
        {"step": 2, "loss": 2.0},
        {"step": 2, "loss": 1.5, "eval/i2t_r1": 20.0},
        {"step": 1, "loss": 2.9},
        {"step": "x", "loss": 1.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "garbage\n")
    series = read_metrics(tmp_path)
    assert (
        series["loss"] == [(1, 2.9), (2, 1.5)] and series["lr"] == [(1, 0.1)] and series["eval/i2t_r1"] == [(2, 20.0)]
    )
    with pytest.raises(FileNotFoundError, match=r"metrics\.jsonl"):
        read_metrics(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no metric records"):
        read_metrics(tmp_path / "empty")


def test_plot_writes_a_png_with_four_panels(tmp_path: Path) -> None:
    with RunLogger(tmp_path, True, 50, tensorboard=False, progress=False) as logger:
        for step in range(1, 51):
            logger.log(step, {"loss": 5 * math.exp(-step / 20), "temperature": math.exp(-step / 15), "lr": step * 1e-4})
            if step % 10 == 0:
                logger.log(step, {"eval/i2t_r1": step / 2, "eval/t2i_r1": step / 3})
    out = plot_metrics(tmp_path)
    assert out == tmp_path / "metrics.png"
    image = Image.open(out)
    assert image.format == "PNG" and image.size == (1100, 700)
    pixels = np.asarray(image.convert("L"))
    assert (pixels < 128).mean() > 0.01  # something was drawn
    only_loss = tmp_path / "other"
    only_loss.mkdir()
    (only_loss / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n')
    assert plot_metrics(only_loss, tmp_path / "plots" / "x.png").is_file()


def test_plot_cli(tmp_path: Path, capsys) -> None:
    from openalign.cli import main

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0, "temperature": 0.5}\n')
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").is_file() and "p.png" in capsys.readouterr().out
    assert main(["plot", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("openalign plot: error:") and "metrics.jsonl" in err[0]


# ------------------------------------------------------------------------------ Weights & Biases


def _wandb_records(path: Path) -> list[Any]:
    """The records of a W&B transaction log (``run-ID.wandb``), decoded by wandb's own protobuf classes.

    wandb ships no Python reader of the file any more (its Go core writes it). The framing is LevelDB's log
    format after a 7-byte header (":W&B", magic, version): 32 KiB blocks of chunks, each with a 7-byte header
    (checksum, little-endian length, type 1 full / 2 first / 3 middle / 4 last), a block's tail under 7 bytes
    left as padding.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, parts, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
        elif kind == 0:
            break  # zero padding: the end of what was written
    return records


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def _children_named(word: str) -> list[str]:
    """Command lines of this process's live children that mention ``word`` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and word in cmdline:
            found.append(cmdline)
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_wandb_offline_run_holds_what_metrics_jsonl_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    from openalign.train.loop import train
    from test_train_loop import factory, tiny_config

    for key in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb_dir").mkdir()
    log = {"tensorboard": False, "progress": False, "every": 1, "wandb": True}
    log |= {"wandb_project": "align-tests", "wandb_run_name": "tiny-lit", "wandb_tags": ["lit", "tiny"]}
    cfg = tiny_config(tmp_path / "run", log=log, train={"steps": 3})
    try:
        train(cfg, stream_factory=factory())
    finally:
        wandb.teardown()  # stops the wandb-core service this process started
    assert _children_named("wandb") == []

    (run_file,) = (tmp_path / "wandb_dir" / "wandb").glob("offline-run-*/run-*.wandb")
    records = _wandb_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.display_name, run.project, list(run.tags)) == ("tiny-lit", "align-tests", ["lit", "tiny"])
    config = {_key(item): json.loads(item.value_json) for item in run.config.update}
    assert config["train"]["steps"] == 3 and config["log"]["wandb"] is True
    history: dict[int, dict[str, Any]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            history[r.history.step.num] = {_key(item): json.loads(item.value_json) for item in r.history.item}
    expected = {
        r["step"]: {k: v for k, v in r.items() if k not in ("step", "time") and isinstance(v, int | float)}
        for r in lines(tmp_path / "run")
    }
    assert sorted(expected) == [1, 2, 3] and "loss" in expected[1]
    assert sorted(history) == sorted(expected)
    for step, metrics in expected.items():
        assert {k: history[step][k] for k in metrics} == metrics, step
    assert not (tmp_path / "run" / "wandb").exists()  # WANDB_DIR wins over the run directory


def test_wandb_missing_is_one_line_before_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from openalign.cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec and import both fail
    argv = ["train", "--config", "nano_cpu", "--train.run_dir", str(tmp_path / "run"), "--log.wandb", "true"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "openalign train: error: log.wandb is on but wandb is not installed: pip install wandb "
        "(or set --log.wandb false)"
    )
    assert not (tmp_path / "run").exists()


def test_a_failing_wandb_init_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")

    def refuse(**kwargs: Any) -> None:
        raise wandb.errors.UsageError("api_key not configured (no-tty).\nCall wandb.login(key=...)")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(ConfigError) as caught:
        RunLogger(tmp_path, True, total_steps=2, progress=False, wandb={"project": "p", "name": None, "tags": []})
    assert str(caught.value) == (
        "log.wandb: wandb.init failed: api_key not configured (no-tty). (wandb login, or WANDB_MODE=offline)"
    )
