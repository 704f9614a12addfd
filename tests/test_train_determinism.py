"""Two runs of the packaged CPU recipe with one seed give bit-identical weights, whatever the process's
hash seed: the vocabulary learnt at the start, the synthetic stream read through a DataLoader worker, the
initial weights and every step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file


@pytest.mark.slow
def test_two_same_seed_runs_of_nano_cpu_give_identical_weights(tmp_path: Path) -> None:
    def run(name: str, hash_seed: str) -> Path:
        out = tmp_path / name
        cmd = [
            sys.executable, "-m", "openalign.cli", "train", "--config", "nano_cpu", "--train.run_dir", str(out),
            "--optim.total_steps", "4", "--optim.warmup_steps", "1", "--data.batch_size", "16",
            "--data.workers", "1", "--eval.every", "0", "--train.checkpoint_every", "0", "--train.threads", "1",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "finished 4 steps" in done.stderr + done.stdout
        return out / "final"

    a, b = run("a", "1"), run("b", "2")
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not (wa[k] == wb[k]).all()]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"
