"""Training checkpoints: everything needed to continue a run bit for bit, written atomically.

``run_dir/checkpoints/step_0000010/`` holds

- ``config.json`` + ``model.safetensors``: the model, loadable on its own with ``openalign.load_model``;
- the tokenizer files, so the directory is a complete model for evaluation or search;
- ``trainer.pt``: optimizer and scheduler state, the step, every rank's random generator states, every
  rank's data-stream position, the NaN-guard counters and the training config.

A checkpoint is written into ``step_XXXXXXX.tmp`` and renamed into place (``os.replace``), so a process
killed at any moment leaves either the previous complete checkpoints or the new one, never a half-written
one; leftovers of an interrupted write are ignored and cleaned up by the next save. Only the last
``keep`` checkpoints are kept. Rank 0 writes; every rank reads on resume, so multi-node runs need
``run_dir`` on a filesystem all nodes share.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from openalign.config import ModelConfig, to_dict
from openalign.model.io import FORMAT, FORMAT_VERSION

if TYPE_CHECKING:
    from openalign.text.tokenizer import TextTokenizer

__all__ = [
    "CHECKPOINT_DIR",
    "capture_rng",
    "find_checkpoint",
    "list_checkpoints",
    "load_trainer_state",
    "restore_rng",
    "write_checkpoint",
    "write_model_dir",
]

CHECKPOINT_DIR = "checkpoints"
TRAINER_FILE = "trainer.pt"
_NAME = re.compile(r"^step_(\d{7,})$")


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"step_{step:07d}"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as (step, path), oldest first."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _NAME.match(path.name)
        if match and (path / TRAINER_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def find_checkpoint(run_dir: str | Path, resume: str) -> Path | None:
    """Resolve ``--resume``: "latest" is the newest complete checkpoint of ``run_dir`` (None when there is
    none yet, so a preemptible job can always pass it); anything else is a checkpoint directory."""
    if resume == "latest":
        found = list_checkpoints(run_dir)
        return found[-1][1] if found else None
    path = Path(resume)
    if not (path / TRAINER_FILE).is_file():
        raise FileNotFoundError(f"{resume}: not a training checkpoint (no {TRAINER_FILE}); expected a step_* directory")
    return path


# ---------------------------------------------------------------------------------------------- RNG


def capture_rng(device: torch.device | None = None) -> dict[str, Any]:
    """This process's generator states (Python, NumPy, torch CPU and, on a GPU, CUDA) as tensors and ints."""
    np_state = np.random.get_state()
    assert isinstance(np_state, tuple)  # the legacy form, which get_state returns by default
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "name": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Inverse of ``capture_rng``."""
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if device is not None and device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# ---------------------------------------------------------------------------------------------- write / read


def write_model_dir(out: Path, config: ModelConfig, state_dict: dict[str, torch.Tensor]) -> None:
    # The layout of openalign.save_model, written from a state dict so a sharded (FSDP) model, gathered
    # on rank 0, needs no second unsharded copy of itself.
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": to_dict(config)}
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")


def write_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model_config: ModelConfig,
    model_state: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
    tokenizer: TextTokenizer | None = None,
    keep: int = 3,
) -> Path:
    """Write checkpoint ``step`` atomically and prune all but the newest ``keep``. Call on one rank only."""
    final = step_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    write_model_dir(tmp, model_config, model_state)
    if tokenizer is not None:
        tokenizer.save(tmp)
    torch.save(trainer_state, tmp / TRAINER_FILE)
    _fsync_dir(tmp)
    if final.exists():  # the same step written again (a resumed run re-saving): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    _prune(run_dir, keep, final)
    return final


def _fsync_dir(path: Path) -> None:
    # Make the files and the rename durable before an older checkpoint is deleted.
    for child in [*path.iterdir(), path] if path.is_dir() else [path]:
        try:
            fd = os.open(child, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)


def _prune(run_dir: str | Path, keep: int, newest: Path) -> None:
    root = Path(run_dir) / CHECKPOINT_DIR
    for leftover in root.glob("step_*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)
    if keep < 1:
        return
    found = list_checkpoints(run_dir)
    for _, path in found[:-keep]:
        if path != newest:
            shutil.rmtree(path, ignore_errors=True)


def load_trainer_state(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(trainer state, model state dict on CPU) of a checkpoint directory."""
    path = Path(path)
    trainer = torch.load(path / TRAINER_FILE, map_location="cpu", weights_only=True)
    model_state = load_file(str(path / "model.safetensors"), device="cpu")
    return trainer, model_state
