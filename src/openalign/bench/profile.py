"""Where a training step's time goes: the profiler's per-op table and the host synchronisations of a step.

``bench train --profile DIR`` writes, for each contender it times (ours, transformers' loop, the real training
loop with ``--recipe``, named ``recipe-<compiled|eager>``), ``DIR/<contender>.txt``: a header with the step's
wall time, the device time its kernels took and how many kernels it launched (on a GPU: a step whose kernels
cover little of its wall time is waiting on the host, launching or synchronising), the host synchronisations
one step made with the Python line that made each, and PyTorch's per-op table sorted by self time on the
device (the CPU's on a CPU; on a GPU a second table sorted by the host's self time follows).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from openalign.bench.host import host_line

__all__ = ["StepProfiler", "count_syncs", "keep_best", "print_profiles", "profile_line", "profile_steps"]


@contextlib.contextmanager
def count_syncs(device: torch.device) -> Iterator[Counter[str]]:
    """Counts the host synchronisations CUDA work makes inside the block, by the Python line that made each
    (``torch.cuda.set_sync_debug_mode``); nothing is counted on a CPU, where there is nothing to wait for."""
    found: Counter[str] = Counter()
    if device.type != "cuda":
        yield found
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            found[f"{Path(w.filename).name}:{w.lineno}"] += 1


class StepProfiler:
    """The profiler over ``steps`` whole steps (entered before the first, left after the last: the device is
    synchronised at both ends, so the wall time is the steps' own); ``write`` puts the table and the step's
    totals in a file."""

    def __init__(self, device: torch.device, steps: int) -> None:
        self.device = device
        self.steps = steps
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities)
        self.wall = 0.0
        self.syncs: Counter[str] = Counter()

    def __enter__(self) -> StepProfiler:
        self._sync()
        self.prof.__enter__()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._sync()
        self.wall = time.perf_counter() - self.start
        self.prof.__exit__(*exc)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def write(self, path: Path, title: str) -> dict[str, Any]:
        """The table and totals per step in ``path``; the totals returned."""
        events = self.prof.key_averages()
        cuda = self.device.type == "cuda"
        if cuda:
            kernels = [e for e in self.prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            device_s = sum(e.device_time for e in kernels) / 1e6  # microseconds
            launches = len(kernels)
        else:
            device_s = sum(e.self_cpu_time_total for e in events) / 1e6
            launches = sum(e.count for e in events)
        totals = {
            "wall_s": self.wall / self.steps,
            "device_busy_s": device_s / self.steps,
            ("kernels" if cuda else "ops"): launches / self.steps,
            "host_syncs": sum(self.syncs.values()),
        }
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        lines = [
            f"# {title}: {self.steps} steps profiled on {self.device.type}",
            f"wall time per step {totals['wall_s'] * 1e3:.1f} ms; "
            + (
                f"kernels' device time {totals['device_busy_s'] * 1e3:.1f} ms "
                f"({100 * totals['device_busy_s'] / max(totals['wall_s'], 1e-9):.0f} % of it), "
                f"{totals['kernels']:.0f} kernels per step"
                if cuda
                else f"ops' self CPU time {totals['device_busy_s'] * 1e3:.1f} ms, {totals['ops']:.0f} ops per step"
            ),
            f"host synchronisations in one step: {totals['host_syncs']}"
            + "".join(f"\n  {n:4d}  {where}" for where, n in self.syncs.most_common()),
            "",
            events.table(sort_by=sort, row_limit=50, max_name_column_width=60),
        ]
        if cuda:  # the host's side of a step the host bounds: where launching and dispatching go
            lines += ["", "by self CPU time:", events.table(sort_by="self_cpu_time_total", row_limit=40)]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines))
        return totals


def profile_steps(step: Callable[[], Any], device: torch.device, steps: int, path: Path, title: str) -> dict[str, Any]:
    """One step with its host synchronisations counted, then ``steps`` steps under the profiler, written to
    ``path``; ``step`` runs one whole training step (warm already)."""
    profiler = StepProfiler(device, steps)
    with count_syncs(device) as syncs:
        step()
    profiler.syncs = syncs
    with profiler:
        for _ in range(steps):
            step()
    return profiler.write(path, title)


def profile_line(totals: dict[str, Any]) -> str:
    """``StepProfiler.write``'s totals in one line."""
    wall, busy = totals["wall_s"], totals["device_busy_s"]
    if "kernels" in totals:
        work = f"kernels {busy * 1e3:.1f} ms ({100 * busy / max(wall, 1e-9):.0f} %), {totals['kernels']:.0f} kernels"
    else:
        work = f"ops' CPU time {busy * 1e3:.1f} ms, {totals['ops']:.0f} ops"
    return f"wall {wall * 1e3:.1f} ms a step; {work}; {totals['host_syncs']} host syncs"


def keep_best(best: dict[str, dict[str, Any]], which: str, result: dict[str, Any]) -> None:
    """``result`` kept as ``best[which]`` if its step is the shortest so far; the profile, taken in the first
    round only, stays with whichever round is kept."""
    profiled = result["profile"] or (best.get(which) or {}).get("profile")
    if which not in best or result["step_s"] < best[which]["step_s"]:
        best[which] = result
    best[which]["profile"] = profiled


def print_profiles(best: dict[str, dict[str, Any]], names: list[str]) -> None:
    """Lines under a benchmark's table: each contender's host during its timed steps (``bench.host``), and its
    profile where it was profiled."""
    for which in names:
        if best[which].get("host"):
            print(f"{which:>12} on the host: {host_line(best[which]['host'])}")
        if best[which]["profile"]:
            print(f"{which:>12} profiled: {profile_line(best[which]['profile'])}")
