"""What a training run reports: a progress bar, ``metrics.jsonl``, TensorBoard events, Weights & Biases and plots.

Only the main rank writes. ``metrics.jsonl`` holds one JSON object per record, ``{"step": …, "time": …,
<metric>: …}``; values that are not finite are written as null so every line stays valid JSON. A resumed
run first drops the records (and TensorBoard events) after its checkpoint's step: those steps are about to
be taken again, and the file should describe the run that actually produced the weights.

With ``log.wandb`` the same numeric records go to a W&B run (``WANDB_MODE=offline`` writes it under
``WANDB_DIR``, or the run directory, for a later ``wandb sync``, with no network). Each start or resume is a
W&B run of its own; W&B only accepts increasing steps within one run, and a resume repeats steps.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from openalign.config import ConfigError

__all__ = ["LogConfig", "RunLogger", "plot_metrics", "read_metrics"]

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


@dataclass
class LogConfig:
    """How often and where metrics go."""

    every: int = 10  # steps between metric records (JSONL, TensorBoard, progress-bar figures)
    tensorboard: bool = True  # also write TensorBoard events under run_dir/tensorboard (if installed)
    progress: bool = True  # a progress bar on stderr (main rank only)
    wandb: bool = False  # also log to Weights & Biases (pip install wandb); WANDB_MODE=offline needs no network
    wandb_project: str = "openalign"  # the W&B project
    wandb_run_name: str | None = None  # the W&B run's name; None = the run directory's name
    wandb_tags: list[str] = field(default_factory=list)  # W&B tags of the run, e.g. [lit, b7]

    def __post_init__(self) -> None:
        if isinstance(self.every, int) and self.every < 1:
            raise ConfigError(f"log.every must be at least 1, got {self.every}")

    def logger_kwargs(self, start_step: int = 0) -> dict[str, Any]:
        """Keyword arguments of ``RunLogger`` beyond run_dir, is_main and total_steps."""
        wandb = None
        if self.wandb:
            wandb = {"project": self.wandb_project, "name": self.wandb_run_name, "tags": list(self.wandb_tags)}
        return {"tensorboard": self.tensorboard, "progress": self.progress, "start_step": start_step, "wandb": wandb}


def check_wandb(enabled: bool) -> None:
    """With ``log.wandb`` on, a missing wandb is one line before the run starts (every rank checks, so none is
    left waiting for a rank that stopped). Only looked up, not imported: importing it takes a second."""
    import importlib.util

    if enabled and importlib.util.find_spec("wandb") is None:
        raise ConfigError("log.wandb is on but wandb is not installed: pip install wandb (or set --log.wandb false)")


def _plain(value: Any) -> Any:
    """A JSON-ready scalar: tensors and numpy scalars become numbers, NaN and ±inf become None."""
    if isinstance(value, torch.Tensor):
        value = value.detach().float().item() if value.numel() == 1 else value.tolist()
    elif hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{name}/"))
        else:
            out[name] = _plain(value)
    return out


def say(line: str) -> None:
    """``line`` on stderr, above the progress bar of a run under way (tqdm clears and redraws any bar) rather than
    run into its line; printed plainly where there is none."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)


class RunLogger:
    """Metrics of one run: JSONL and TensorBoard on the main rank, a progress bar on its stderr.

    ``log(step, metrics)`` takes any flat or nested mapping of numbers (tensors allowed; nested keys are
    joined with "/"); ``loss``, ``temperature``, ``lr``, ``pairs_per_s`` and ``data_wait`` also go into the
    progress bar, which shows the steps done, their rate and the ETA. ``wandb`` holds ``wandb.init`` arguments
    (project, name, tags, config) to log the numeric records to W&B as well. On other ranks every method does
    nothing.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        is_main: bool,
        total_steps: int,
        tensorboard: bool = True,
        *,
        progress: bool = True,
        start_step: int = 0,
        wandb: dict[str, Any] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.total_steps = total_steps
        self.start_time = time.time()
        self._file: Any = None
        self._writer: Any = None
        self._wandb: Any = None
        self._bar: Any = None
        self._shown: dict[str, str] = {}
        if not is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / METRICS_FILE
        if path.is_file():
            # A fresh run in an old directory starts a fresh record (-1 keeps nothing).
            _truncate_after(path, start_step if start_step > 0 else -1)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print("tensorboard is not installed; metrics go to metrics.jsonl only", file=sys.stderr)
            else:
                # purge_step drops events a crashed run wrote after the checkpoint it resumes from.
                self._writer = SummaryWriter(str(self.run_dir / TENSORBOARD_DIR), purge_step=start_step or None)
        if wandb is not None:
            try:
                self._wandb = _start_wandb(self.run_dir, wandb)
            except BaseException:
                self.close()
                raise
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps, initial=start_step, unit="step", desc="train", file=sys.stderr, dynamic_ncols=True
            )

    def say(self, line: str) -> None:
        """``line`` on stderr (main rank), above the progress bar rather than run into it (``say``)."""
        if self.is_main:
            say(line)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` at ``step`` (JSONL line, TensorBoard scalars) and move the progress bar."""
        if not self.is_main:
            return
        flat = _flatten(metrics)
        record = {"step": int(step), "time": round(time.time(), 3), **flat}
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in flat.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self._writer.add_scalar(key, value, int(step))
        if self._wandb is not None:
            numbers = {k: v for k, v in flat.items() if isinstance(v, int | float) and not isinstance(v, bool)}
            self._wandb.log(numbers, step=int(step))
        if self._bar is not None:
            if step > self._bar.n:
                self._bar.update(step - self._bar.n)
            # Figures persist until replaced, so a record of only eval metrics keeps the last loss on screen.
            shown = self._shown
            for key, label, fmt in (
                ("pairs_per_s", "pairs/s", "{:.1f}"),
                ("data_wait", "data", "{:.0%}"),
                ("loss", "loss", "{:.4f}"),
                ("temperature", "temp", "{:.4f}"),
                ("lr", "lr", "{:.2e}"),
            ):
                if isinstance(flat.get(key), int | float):
                    shown[label] = fmt.format(flat[key])
            if shown:
                self._bar.set_postfix(shown)

    def close(self) -> None:
        """Flush and close the files and the bar (idempotent)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _start_wandb(run_dir: Path, options: dict[str, Any]) -> Any:
    try:
        import wandb
    except ImportError:
        raise ConfigError("log.wandb is on but wandb is not installed: pip install wandb") from None
    kwargs = dict(options)
    kwargs["name"] = kwargs.get("name") or run_dir.resolve().name
    if not os.environ.get("WANDB_DIR"):
        kwargs["dir"] = str(run_dir)  # W&B's files live with the run, not in the working directory
    try:
        return wandb.init(**kwargs)
    except Exception as err:  # wandb raises its own types for a missing login, a bad project name, …
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"log.wandb: wandb.init failed: {first} (wandb login, or WANDB_MODE=offline)") from None


def _truncate_after(path: Path, step: int) -> None:
    """Rewrite ``path`` keeping only records at or before ``step`` (atomically: temp file, then rename)."""
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut off by a crash
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
                kept.append(json.dumps(record, ensure_ascii=False) + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------- plots


def read_metrics(path: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """Every numeric metric of a run as ``{name: [(step, value), …]}`` sorted by step.

    ``path`` is a run directory or its ``metrics.jsonl``. When a step was logged twice (a run resumed
    from an earlier checkpoint without truncation) the later record wins; unreadable lines are skipped.
    """
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no {METRICS_FILE} (is this a training run directory?)")
    series: dict[str, dict[int, float]] = {}
    with open(p, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                continue
            for key, value in record.items():
                if key in ("step", "time") or isinstance(value, bool) or not isinstance(value, int | float):
                    continue
                series.setdefault(key, {})[record["step"]] = float(value)
    if not series:
        raise ValueError(f"{p}: no metric records")
    return {key: sorted(points.items()) for key, points in series.items()}


def plot_metrics(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Loss, temperature, learning rate and held-out R@1 over steps, as a 2×2 PNG (default run_dir/metrics.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = read_metrics(run_dir)
    base = Path(run_dir) if Path(run_dir).is_dir() else Path(run_dir).parent
    target = Path(out) if out is not None else base / "metrics.png"
    recall_keys = sorted(k for k in series if k.rsplit("/", 1)[-1] in ("i2t_r1", "t2i_r1"))
    panels = [
        ("loss", ["loss"], "linear"),
        ("temperature", ["temperature"], "log"),
        ("learning rate", ["lr"], "linear"),
        ("held-out R@1 (%)", recall_keys, "linear"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    for ax, (title, keys, scale) in zip(axes.flat, panels, strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
        drawn = False
        for key in keys:
            points = series.get(key, [])
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3, label=key)
                drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
            continue
        if scale == "log" and all(v > 0 for k in keys for _, v in series.get(k, [])):
            ax.set_yscale("log")
        if len(keys) > 1:
            ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"{base.name}: {max(s for pts in series.values() for s, _ in pts)} steps")
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target
