"""`openalign demo`: one seed gives one result, whatever the process's hash seed or the machine's speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from openalign.config import ConfigError
from openalign.pipeline.demo import DemoConfig, run_demo

_DATA_STAGES = """
import sys
import torch
from openalign.pipeline.demo import DemoConfig, run_demo
torch.set_num_threads(int(sys.argv[2]))
cfg = DemoConfig(out=sys.argv[1], corpus_size=1200, retrieval_images=40, classification_per_class=1,
                 vocab_size=400, copy_detector_steps=4, workers=0)
run_demo(cfg, until="shards")
"""

# Files that record how long a stage took, not what it made.
_TIMINGS = {"stages", "demo_config.json"}


def _without_timings(value: object, root: str) -> object:
    """A JSON value with its durations dropped and the run folder's path made relative."""
    if isinstance(value, dict):
        timed = ("seconds", "duration")
        return {k: _without_timings(v, root) for k, v in value.items() if not k.endswith(timed)}
    if isinstance(value, list):
        return [_without_timings(v, root) for v in value]
    return value.replace(root, "RUN") if isinstance(value, str) else value


def _files(root: Path) -> dict[str, bytes]:
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and rel.parts[0] not in _TIMINGS:
            data = path.read_bytes()
            if path.suffix == ".json":
                data = json.dumps(_without_timings(json.loads(data), str(root)), sort_keys=True).encode()
            out[rel.as_posix()] = data
    return out


@pytest.mark.slow
def test_data_stages_give_byte_identical_outputs_in_every_process(tmp_path: Path) -> None:
    # Different hash seeds reorder Python sets and dicts of strings; different processes reorder the
    # WordPiece trainer's hash maps; a machine with more cores starts with more threads, which round the
    # copy detector's sums differently. None may change a byte of what the data stages write.
    for run, hash_seed, threads in (("a", "1", "1"), ("b", "2", "3")):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        subprocess.run([sys.executable, "-c", _DATA_STAGES, str(tmp_path / run), threads], env=env, check=True)
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    for name in ("filtered.parquet", "deduped.parquet", "copy_detector/model.safetensors", "vocab/tokenizer.json"):
        assert name in a
    assert any(name.startswith("shards/") and name.endswith(".tar") for name in a)
    assert sorted(a) == sorted(b)
    assert [name for name in a if a[name] != b[name]] == []


def test_unknown_stage_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no stage 'training'"):
        run_demo(DemoConfig(out=str(tmp_path)), until="training")
    with pytest.raises(ConfigError, match="copy_detector_steps"):
        run_demo(DemoConfig(out=str(tmp_path), copy_detector_steps=0))


def _summaries(
    t2i: float, temperature: float, planted: int = 100, found: int = 30, train_seconds: float = 300.0
) -> dict[str, dict]:
    return {
        "eval": {"results": [{"t2i_r1": t2i}], "seconds": 4.0},
        "train": {"metrics": {"temperature": temperature}, "skipped_steps": 0, "seconds": train_seconds},
        "dedup": {"planted_after_filter": planted, "planted_found": found, "other_rows_removed": 7, "seconds": 90.0},
    }


def test_the_report_says_where_to_look_when_the_mark_is_missed() -> None:
    from openalign.pipeline.demo import diagnose

    cfg = DemoConfig(target_r1=65.0)
    missed = diagnose(cfg, _summaries(40.0, 0.5), [(100, 2.0), (400, 20.0), (500, 40.0)])
    assert "does not reach" in missed[0]
    assert any("still climbing" in line and "20.0 % at step 400" in line for line in missed)
    assert any("Temperature: 0.500" in line for line in missed)
    assert any("found 30 of 100" in line and "30 % recall" in line for line in missed)
    reached = diagnose(cfg, _summaries(70.0, 0.08), [(400, 69.5), (500, 70.0)])
    assert "reaches" in reached[0] and any("levelled off" in line for line in reached)
    assert not any("Temperature" in line or "Wall time" in line for line in reached)
    slow = diagnose(cfg, _summaries(70.0, 0.08, train_seconds=620.0), [(400, 69.5), (500, 70.0)])
    assert any("11.9 min, over the 10 min mark" in line and "train (620 s) and dedup (90 s)" in line for line in slow)


def test_a_quick_run_is_not_held_against_the_full_runs_marks() -> None:
    from openalign.pipeline.demo import _mark, diagnose, quick_config

    cfg = quick_config("runs/quick")
    assert cfg.target_r1 is None and cfg.target_minutes is None
    cfg.validate()
    lines = diagnose(cfg, _summaries(12.0, 0.5, train_seconds=900.0), [(10, 2.0), (30, 12.0)])
    assert "no mark" in lines[0]
    assert not any("does not reach" in line or "reaches" in line or "Where to look" in line for line in lines)
    assert not any("Wall time" in line or "Temperature" in line for line in lines)
    assert any("Learning curve" in line for line in lines) and any("found 30 of 100" in line for line in lines)
    assert _mark(None, "%") == "" and _mark(65.0, "%") == " (mark 65 %)"
    with pytest.raises(ConfigError, match="target_minutes"):
        DemoConfig(target_minutes=0.0).validate()
