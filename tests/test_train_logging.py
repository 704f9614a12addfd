from __future__ import annotations

import json
import math
from pathlib import Path

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
    }
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
