"""The ``openalign`` process keeps the memory its tensors free, for the next ones.

glibc's ``malloc`` serves a large request (from 128 KiB, rising to a block's size once such a block is freed) by
mapping fresh pages, and gives freed memory at the top of its heap back to the system once more than twice that
threshold lies free there. A training step allocates and frees the same activations every step, so each step
touched its pages anew: the demo's 900 training steps took 26.5 million page faults, 62 s of system time beside
766 s of user time on two cores. Raising both thresholds for the command's own process keeps the freed blocks
for reuse: 80 steps of the demo's training (set-up included) took 0.933x the wall time (median of 3 pairs), 1.3
million page faults fell to 0.38 million and system time from 6.2 to 1.9 s, for 3 % more peak memory (818
against 792 MiB), which the step's own peak still bounds. `openalign demo --seeds 3`: stages of 510 / 499 / 489 s
against 521 / 518 / 518, the same held-out figures.

Only the command's process (and the data workers it forks) is changed: ``openalign.cli.main`` called with an
argument list, as a library or a test does, leaves the caller's allocator alone. Elsewhere than glibc (macOS,
musl) nothing changes.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["retain_freed_memory"]

_M_TRIM_THRESHOLD = -1  # malloc.h
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit: larger requests are still mapped, and unmapped when freed
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top beyond this goes back to the system


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where there is no glibc ``mallopt``."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the interpreter runs on (no ldconfig subprocess)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; musl's stub returns 0 and changes nothing.
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
