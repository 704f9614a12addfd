"""Training checkpoints: everything needed to continue a run bit for bit, written atomically.

``run_dir/checkpoints/step_0000010/`` holds

- ``config.json`` + ``model.safetensors``: the model, loadable on its own with ``openalign.load_model``;
- the tokenizer files, so the directory is a complete model for evaluation or search;
- ``trainer.pt``: optimizer and scheduler state, the step, every rank's random generator states, every
  rank's data-stream position, the NaN-guard counters and the training config.

A checkpoint is written into ``step_XXXXXXX.tmp`` and renamed into place (``os.replace``), so a process
killed at any moment leaves either the previous complete checkpoints or the new one, never a half-written
one; leftovers of an interrupted write are ignored and cleaned up by the next save. ``run_dir/final`` is
written the same way. Only the last ``keep`` checkpoints are kept. Rank 0 writes; every rank reads on
resume, so multi-node runs need ``run_dir`` on a filesystem all nodes share.

A state holding a NaN or Inf tensor (weights or optimizer state) is never written: nothing can be resumed
from it, and writing it would push a good checkpoint out of the ``keep`` newest. Reading checks the same,
so ``--resume latest`` passes over a checkpoint that is truncated, incomplete or non-finite to the newest
one that is whole (``open_checkpoint``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from openalign.config import ModelConfig, to_dict
from openalign.model.checkpoint_dir import FORMAT, FORMAT_VERSION

if TYPE_CHECKING:
    from openalign.text.tokenizer import TextTokenizer

__all__ = [
    "CHECKPOINT_DIR",
    "CheckpointError",
    "OpenedCheckpoint",
    "capture_rng",
    "list_checkpoints",
    "load_trainer_state",
    "non_finite_tensors",
    "open_checkpoint",
    "restore_rng",
    "write_checkpoint",
    "write_model",
    "write_model_dir",
]

CHECKPOINT_DIR = "checkpoints"
TRAINER_FILE = "trainer.pt"
MODEL_FILE = "model.safetensors"
_NAME = re.compile(r"^step_(\d{7,})$")
_TRAINER_KEYS = ("step", "world_size", "optimizer", "scheduler", "rng", "stream")


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"step_{step:07d}"


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or resumed from; ``reason`` says why in a few words."""

    def __init__(self, where: str | Path, reason: str | None = None):
        super().__init__(str(where) if reason is None else f"{where}: {reason}")
        self.reason = str(where) if reason is None else reason


def _step_dirs(run_dir: str | Path) -> list[tuple[int, Path]]:
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _NAME.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as (step, path), oldest first."""
    return [(step, path) for step, path in _step_dirs(run_dir) if (path / TRAINER_FILE).is_file()]


@dataclass
class OpenedCheckpoint:
    path: Path
    trainer: dict[str, Any]  # load_trainer_state's first half
    model: dict[str, torch.Tensor]  # the model state dict, on CPU


def open_checkpoint(run_dir: str | Path, resume: str, log: Callable[[str], None] = print) -> OpenedCheckpoint | None:
    """Resolve and read ``--resume``: "latest" is the newest checkpoint of ``run_dir`` that reads whole and is
    finite (None when there is none yet, so a preemptible job can always pass it); anything else is a
    checkpoint directory, and a bad one is a ``CheckpointError``.

    "latest" logs one line for each checkpoint it passes over and why. When every checkpoint of the run is
    damaged it raises rather than start at step 0, which would train over them from scratch.
    """
    if resume != "latest":
        path = Path(resume)
        if not (path / TRAINER_FILE).is_file():
            raise FileNotFoundError(
                f"{resume}: not a training checkpoint (no {TRAINER_FILE}); expected a step_* directory"
            )
        return OpenedCheckpoint(path, *load_trainer_state(path))
    damaged = 0
    for _, path in reversed(_step_dirs(run_dir)):
        if not (path / TRAINER_FILE).is_file():
            # What a write killed before its rename would leave, were the rename not atomic: never a checkpoint.
            log(f"resume: skipping {path}: incomplete checkpoint (no {TRAINER_FILE})")
            continue
        try:
            return OpenedCheckpoint(path, *load_trainer_state(path))
        except CheckpointError as err:
            damaged += 1
            log(f"resume: skipping {path}: {err.reason}")
    if damaged:
        raise CheckpointError(
            Path(run_dir) / CHECKPOINT_DIR,
            f"none of its {damaged} checkpoint(s) can be resumed from (reasons above); "
            "move them away to start at step 0",
        )
    return None


def non_finite_tensors(tree: Any, prefix: str = "") -> list[str]:
    """Dotted names of the floating-point tensors in nested dicts/lists that hold a NaN or an Inf."""
    found: list[str] = []
    if isinstance(tree, torch.Tensor):
        if (tree.is_floating_point() or tree.is_complex()) and not bool(torch.isfinite(tree).all()):
            found.append(prefix or "tensor")
    elif isinstance(tree, dict):
        for key, value in tree.items():
            found += non_finite_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            found += non_finite_tensors(value, f"{prefix}.{i}" if prefix else str(i))
    return found


def _check_finite(where: Path, **parts: Any) -> None:
    bad = [name for part, tree in parts.items() for name in non_finite_tensors(tree, part)]
    if bad:
        raise CheckpointError(where, f"{len(bad)} tensor(s) hold NaN or Inf, e.g. {bad[0]}")


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
    save_file(tensors, str(out / MODEL_FILE), metadata={"format": "pt"})
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": to_dict(config)}
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")


@contextlib.contextmanager
def _atomic_dir(target: Path) -> Iterator[Path]:
    """Yield an empty ``target.tmp`` to fill; on success it replaces ``target`` whole, on an error it is removed.
    A process killed in between leaves the ``.tmp`` sibling, which the next write to ``target`` clears."""
    tmp = target.with_name(target.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(tmp)
    if target.exists():  # the same step written again (a resumed run re-saving): replace it whole
        shutil.rmtree(target)
    os.replace(tmp, target)
    _fsync_dir(target.parent)


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
    """Write checkpoint ``step`` atomically and prune all but the newest ``keep``. Call on one rank only.

    A non-finite tensor in the model or trainer state is a ``CheckpointError`` before anything is written.
    """
    final = step_dir(run_dir, step)
    _check_finite(final, model=model_state, trainer=trainer_state)
    with _atomic_dir(final) as tmp:
        write_model_dir(tmp, model_config, model_state)
        if tokenizer is not None:
            tokenizer.save(tmp)
        torch.save(trainer_state, tmp / TRAINER_FILE)
    _prune(run_dir, keep, final)
    return final


def write_model(
    out: str | Path,
    model_config: ModelConfig,
    model_state: dict[str, torch.Tensor],
    tokenizer: TextTokenizer | None = None,
) -> Path:
    """A complete model directory at ``out`` (loadable with ``openalign.load_model``), written atomically like a
    checkpoint; a non-finite weight is a ``CheckpointError`` and leaves ``out`` as it was."""
    out = Path(out)
    _check_finite(out, model=model_state)
    with _atomic_dir(out) as tmp:
        write_model_dir(tmp, model_config, model_state)
        if tokenizer is not None:
            tokenizer.save(tmp)
    return out


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


def _first_sentence(err: BaseException, limit: int = 160) -> str:
    # The library's own words, kept to one line: torch appends paragraphs of advice to a bad zip's message.
    text = " ".join(str(err).split()).split(". ")[0].rstrip(".") or type(err).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def load_trainer_state(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(trainer state, model state dict on CPU) of a checkpoint directory; ``CheckpointError`` when a file is
    missing, truncated or unreadable, or a tensor holds NaN or Inf."""
    path = Path(path)
    for name in (TRAINER_FILE, MODEL_FILE):
        if not (path / name).is_file():
            raise CheckpointError(path, f"missing {name}")
    try:
        trainer = torch.load(path / TRAINER_FILE, map_location="cpu", weights_only=True)
    except Exception as err:  # a cut-off zip, a bad pickle, an I/O error: all mean the same here
        raise CheckpointError(path, f"{TRAINER_FILE} is truncated or unreadable ({_first_sentence(err)})") from None
    if not isinstance(trainer, dict):
        raise CheckpointError(path, f"{TRAINER_FILE} holds no trainer state")
    missing = [key for key in _TRAINER_KEYS if key not in trainer]
    if missing:
        raise CheckpointError(path, f"{TRAINER_FILE} lacks {', '.join(missing)}")
    try:
        model_state = load_file(str(path / MODEL_FILE), device="cpu")
    except Exception as err:
        raise CheckpointError(path, f"{MODEL_FILE} is truncated or unreadable ({_first_sentence(err)})") from None
    _check_finite(path, model=model_state, trainer=trainer)
    return trainer, model_state
