"""``openalign bench train --recipe``: the real training loop timed on the bare step's model, batch and shards.

``train()`` runs as ``openalign train`` would (its non-finite guard, clipping when set, the schedule, a metrics
record every step, TensorBoard when installed), on the model ``bench train`` builds for its bare step
(the same preset, image size, embedding width, text pooling and vocabulary), fed by the same stream over the
same synthetic shards. The stream is wrapped so that the loop's own requests for the next batch are timed: a
step is the time from one request to the next, and the part of it spent waiting for the batch is reported
apart, as the bare step's ``data`` part is; the timed steps are also read on the host (``openalign.bench.host``).
With ``--profile`` the loop runs three steps more: one with its host synchronisations counted, then two under the
profiler (``openalign.bench.profile``), whose table is written once the loop has ended: inside the stream its
seconds would be the loop's wait for data.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from openalign.bench.train_setup import TrainBenchSettings, model_cfg, shard_stream

if TYPE_CHECKING:
    from openalign.train.config import TrainConfig


class TimedStream:
    """A training stream whose batches are timed as the loop asks for them; everything else is the stream's."""

    def __init__(
        self, stream: Any, timed: tuple[int, int], device: torch.device, profile: tuple[int, Path] | None = None
    ) -> None:
        self.stream = stream
        self.device = device
        self.asked: list[float] = []  # when the loop asked for each batch
        self.got: list[float] = []  # when it had it
        self.timed = timed  # (first, end): the steps whose host figures are read (``bench.host``)
        self.profile = profile  # (the step to count synchronisations in, file): the profile's steps follow
        self.profiled: dict[str, Any] | None = None  # the profile's totals, once written
        self._profiler: Any = None  # the profile's steps, once taken
        self.host: dict[str, Any] | None = None  # the timed steps' host figures, once read

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    def write_profile(self) -> None:
        """The profiled steps' table and totals (``profiled``), once the loop has ended."""
        if self._profiler is not None and self.profile is not None:
            title = "openalign train: the loop's step (bench train --recipe)"
            self.profiled = self._profiler.write(self.profile[1], title)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        from openalign.bench.host import HostClock
        from openalign.bench.profile import StepProfiler, count_syncs

        batches = iter(self.stream)
        device = self.device
        first = None if self.profile is None else self.profile[0]
        profiler = StepProfiler(device, 2)
        counting = contextlib.ExitStack()
        clock = HostClock()
        while True:
            # Read at the timed steps' ends, outside them: before the first one's ask, after the last one's end.
            if len(self.asked) == self.timed[0]:
                clock.start()
                if device.type == "cuda":  # the peak of the timed steps, as the bare step's
                    torch.cuda.reset_peak_memory_stats(device)
            # The loop asks for step i's batch when step i - 1 has ended: steps counted from the first profiled one.
            step = -1 if first is None else len(self.asked) - first
            if step == 0:
                profiler.syncs = counting.enter_context(count_syncs(device))
            elif step == 1:
                counting.close()
                profiler.__enter__()
            elif step == 3:
                profiler.__exit__(None, None, None)
                self._profiler = profiler
            self.asked.append(time.perf_counter())
            if len(self.asked) == self.timed[1] + 1:
                self.host = clock.stop(self.timed[1] - self.timed[0])
            batch = next(batches)
            self.got.append(time.perf_counter())
            yield batch


def recipe_config(
    s: TrainBenchSettings, shards: str, tokenizer_dir: str, run_dir: str, extra_steps: int = 0
) -> TrainConfig:
    """The training run the recipe mode times: the bare step's model and batch, the paper's loop settings."""
    from openalign.config import to_dict
    from openalign.train.config import load_train_config

    cfg = model_cfg(s)
    overrides: dict[str, Any] = {
        "model.preset": s.preset,
        "data.source": "shards",
        "data.shards": shards,
        "data.tokenizer": tokenizer_dir,
        "data.workers": s.workers,
        "data.max_text_length": cfg.text.max_length,
        "optim.name": "lamb",  # as the bare step's optimizer
        "optim.lr": 1e-3,
        "optim.weight_decay": 1e-5,
        "optim.schedule": "warmup_linear_decay",
        "train.run_dir": run_dir,
        "train.batch_size": s.batch_size,
        # The last step's end is never asked for a batch: untimed.
        "train.steps": s.warmup + s.steps + 1 + extra_steps,
        "train.device": s.device,
        "train.precision": "bf16" if s.bf16 else "fp32",
        # Compiled or eager as the bare step (on CUDA the loop would otherwise always compile its towers).
        "train.compile": s.compile,
        "train.grad_clip": s.grad_clip,
        "train.checkpoint_every": 0,
        "train.checkpoint_minutes": 0,
        "log.every": 1,
        "log.progress": False,
        "eval.every": 0,
    }
    train_cfg = load_train_config({}, overrides)
    train_cfg.model.overrides = to_dict(cfg)  # every field: the very model the bare step trains
    return train_cfg


def measure_loop(s: TrainBenchSettings, shards: str, tokenizer_dir: str, profile: str | None = None) -> dict[str, Any]:
    """The real loop's step (median of the timed steps, as the bare step's), its data wait, pairs/s and peak
    memory, measured in the calling process; with ``profile`` (a directory), three steps more profiled."""
    from openalign.bench.model import peak_memory_mb
    from openalign.text import load_tokenizer
    from openalign.train.loop import train

    device = torch.device(s.device)
    cfg = model_cfg(s)
    tokenizer = load_tokenizer(tokenizer_dir, max_length=cfg.text.max_length)
    timed: list[TimedStream] = []

    def factory(*_: Any, **__: Any) -> TimedStream:
        # The bare step's stream, not one rebuilt from the run's data section: the same batches, the same work.
        name = f"recipe-{'compiled' if s.compile else 'eager'}.txt"
        where = (s.warmup + s.steps, Path(profile) / name) if profile else None
        steps = (s.warmup, s.warmup + s.steps)
        timed.append(TimedStream(shard_stream(s, shards, tokenizer, cfg, s.workers), steps, device, where))
        return timed[0]

    with tempfile.TemporaryDirectory(prefix="openalign-bench-recipe-") as run_dir:
        config = recipe_config(s, shards, tokenizer_dir, run_dir, 3 if profile else 0)
        result = train(config, stream_factory=factory, tokenizer=tokenizer)
    stream = timed[0]
    stream.write_profile()
    first = s.warmup
    steps = [stream.asked[i + 1] - stream.asked[i] for i in range(first, first + s.steps)]
    waits = [stream.got[i] - stream.asked[i] for i in range(first, first + s.steps)]
    median = sorted(range(len(steps)), key=steps.__getitem__)[len(steps) // 2]
    step_s = steps[median]
    return {
        "model": "recipe",
        "step_s": step_s,
        "parts_s": {"data": waits[median], "compute": step_s - waits[median]},
        "mean_step_s": sum(steps) / len(steps),
        "mean_data_s": sum(waits) / len(waits),
        "steps_s": steps,  # every timed step, in order: a slow one apart from the rest shows here
        # The loop's first step (compiled: its towers' compilation, or none where their graphs are compiled already)
        "first_step_s": stream.asked[1] - stream.asked[0],
        "pairs_per_s": s.batch_size / step_s,
        "peak_mem_mb": peak_memory_mb(device),
        "peak_mem_kind": "max allocated" if device.type == "cuda" else "peak RSS of the training process",
        "flops_per_step": 0,
        "skipped_steps": result.skipped_steps,
        "final_loss": float(result.metrics.get("loss", float("nan"))),
        "profile": stream.profiled,
        "host": stream.host,
    }
