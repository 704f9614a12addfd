"""The ``openalign`` process keeps the memory its tensors free, for the next ones.

glibc's ``malloc`` serves a large request (from 128 KiB, rising to a block's size once such a block is freed) by
mapping fresh pages, and gives freed memory at the top of its heap back to the system once more than twice that
threshold lies free there. A training step allocates and frees the same activations every step, so each step
would touch its pages anew, in page faults and system time. Raising both thresholds for the command's own process
keeps the freed blocks for reuse, for a little more peak memory, which the step's own peak still bounds
(docs/decisions/host-overheads.md).

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
