"""What the host did while a benchmark's steps were timed: the stepping thread's CPU time and how often the
kernel took its core away, the CPU time of the process's other threads, and of its child processes (the data
workers).

On a GPU a step whose kernels fill little of its wall time (``bench.profile``) is bound by the host, in one of
two ways that call for different remedies: the stepping thread works for the whole step (launching and
dispatching is the limit: fewer kernels, CUDA graphs), or it is kept from working: by the GIL another thread
holds, or by other processes holding its core, which shows as involuntary context switches. Neither of those
counts as the thread's CPU time; waiting for the device does (CUDA spins at a synchronisation, on a host with
more cores than GPUs), so the profile's kernel time and synchronisations tell that part. A training loop
slower than its bare step on the same model tells the cases apart by these figures beside its profile.

On a GPU the backward pass does not run on the stepping thread: PyTorch's autograd engine runs a device's backward
on a thread of its own (named ``pt_autograd_<device>``) while the thread that called ``backward`` waits, and a
compiled backward's Python (inductor's launching code) runs there. Its CPU time is read apart from the other
threads'.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from typing import Any

from openalign.bench.gpu_memory import PROC, process_tree, stat_fields

__all__ = ["HostClock", "host_line"]


def _cpu_ticks(entry: int | str) -> int | None:
    """User + system CPU time so far of a process (``PID``) or thread (``self/task/TID``) in clock ticks, or None
    once it is gone."""
    fields = stat_fields(entry)
    # utime and stime: fields 14 and 15 of proc(5), the 12th and 13th after the command name.
    return None if fields is None else int(fields[11]) + int(fields[12])


def _child_cpu_s() -> float | None:
    """CPU seconds (user + system) used so far by the processes below this one, alive now; None without
    ``/proc``. A child that ends between two readings drops out of the later one."""
    if not (PROC / "self").exists():
        return None
    me = os.getpid()
    ticks = (_cpu_ticks(pid) for pid in process_tree(me) if pid != me)
    return sum(t for t in ticks if t is not None) / os.sysconf("SC_CLK_TCK")


AUTOGRAD_THREADS = "pt_autograd_"  # how PyTorch names the threads its autograd engine runs a device's backward on


def _autograd_cpu_s() -> float | None:
    """CPU seconds (user + system) used so far by this process's autograd device threads; None when it has none
    (a CPU run: the CPU's backward runs on the calling thread) or without ``/proc``."""
    tasks = PROC / "self" / "task"
    if not tasks.is_dir():
        return None
    ticks: list[int] = []
    for task in tasks.iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # ended between listing and reading
            continue
        used = _cpu_ticks(f"self/task/{task.name}") if name.startswith(AUTOGRAD_THREADS) else None
        if used is not None:
            ticks.append(used)
    return sum(ticks) / os.sysconf("SC_CLK_TCK") if ticks else None


def _switches() -> int | None:
    """The calling thread's involuntary context switches so far (Linux), else None."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    return None if who is None else resource.getrusage(who).ru_nivcsw


@dataclass(frozen=True)
class _Reading:
    wall: float
    thread_cpu: float
    process_cpu: float
    child_cpu: float | None
    autograd_cpu: float | None
    switches: int | None

    @classmethod
    def now(cls) -> _Reading:
        # The slow reading (the process tree) first: the clocks then start after it, not before.
        child, autograd = _child_cpu_s(), _autograd_cpu_s()
        return cls(time.perf_counter(), time.thread_time(), time.process_time(), child, autograd, _switches())


class HostClock:
    """Read ``start()`` before the first timed step and ``stop(steps)`` after the last, in the thread that runs
    the steps; ``stop`` returns per-step figures (``host_line`` prints them)."""

    def __init__(self) -> None:
        self._start: _Reading | None = None

    def start(self) -> None:
        self._start = _Reading.now()

    def stop(self, steps: int) -> dict[str, Any]:
        end, start = _Reading.now(), self._start
        if start is None:
            raise RuntimeError("HostClock.stop() without start()")
        wall = max(end.wall - start.wall, 1e-9)
        thread = end.thread_cpu - start.thread_cpu
        children = None if start.child_cpu is None or end.child_cpu is None else end.child_cpu - start.child_cpu
        switches = None if start.switches is None or end.switches is None else end.switches - start.switches
        # A thread the engine starts during the timed steps had used nothing before them.
        autograd = None if end.autograd_cpu is None else end.autograd_cpu - (start.autograd_cpu or 0.0)
        return {
            "steps": steps,
            "wall_s": wall / steps,
            "thread_cpu_s": thread / steps,  # the stepping thread's own CPU time
            "busy": thread / wall,  # its share of the wall time
            # Other threads of the process (PyTorch's CPU op pool, batch assembly, compile workers): CPU s a step.
            "other_threads_cpu_s": max(end.process_cpu - start.process_cpu - thread, 0.0) / steps,
            # Of which the autograd engine's device threads (a GPU's backward), where the process has any.
            "autograd_threads_cpu_s": None if autograd is None else autograd / steps,
            "involuntary_switches": None if switches is None else switches / steps,
            "child_cores": None if children is None else children / wall,  # cores the child processes kept busy
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        }


def host_line(host: dict[str, Any]) -> str:
    """``HostClock.stop``'s figures in one line."""
    # The mean step, where the tables print the median: a mean far above it is an outlier (a step that compiled).
    line = (
        f"main thread busy {100 * host['busy']:.0f} % of the steps ({host['thread_cpu_s'] * 1e3:.1f} ms CPU of a mean "
        f"{host['wall_s'] * 1e3:.1f} ms step)"
    )
    if host["involuntary_switches"] is not None:
        line += f", {host['involuntary_switches']:.1f} involuntary switches a step"
    line += f"; other threads {host['other_threads_cpu_s'] * 1e3:.1f} ms CPU a step"
    if host.get("autograd_threads_cpu_s") is not None:
        line += f" (autograd's device threads, which run the backward, {host['autograd_threads_cpu_s'] * 1e3:.1f} ms)"
    if host["child_cores"] is not None:
        line += f"; child processes {host['child_cores']:.1f} of {host['cores']} cores"
    return line
