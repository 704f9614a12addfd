"""Benchmarks behind `openalign bench`: each prints our figure beside a baseline from the same run."""

from __future__ import annotations

import resource


def own_peak_rss() -> int:
    """This process's peak resident size in bytes: VmHWM, the high-water mark of its own address space.

    ``ru_maxrss`` will not do in a child process: exec records the size of the address space it replaces,
    the parent's at fork, so a child of a large parent reports at least the parent's size."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
