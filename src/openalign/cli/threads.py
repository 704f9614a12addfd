"""The ``openalign`` process's compute threads sleep soon after their work runs out, instead of spinning.

PyTorch's CPU kernels share their work among OpenMP threads (GNU libgomp in the Linux wheels). A thread done with
its share waits for the next parallel region by spinning, 300,000 rounds by default, before it sleeps. When these
threads have the cores to themselves that costs nothing; when another program keeps one core busy (a browser, a
second job, a test run beside it), the spinning thread takes turns on a core with the thread that still has work,
and every one of a step's thousands of regions waits for that thread, which can make a step several times slower.

With 10,000 rounds a waiting thread sleeps after a few microseconds to half a millisecond (a round is one
``pause`` instruction, 10-140 cycles depending on the CPU): much faster beside a busy core, no slower on a quiet
machine (docs/decisions/host-overheads.md). The work each thread does, and so every result, is the same.

Only the command's own process (and what it starts) is changed, and only before PyTorch is loaded: libgomp reads
its settings when it loads. A ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` already in the environment is left as
it is.
"""

from __future__ import annotations

import os
import sys

__all__ = ["SPIN_ROUNDS", "sleep_when_idle"]

# Fewer rounds help beside a busy core, but never spinning (OMP_WAIT_POLICY=PASSIVE) slows the quiet step: a
# thread that sleeps at once is woken for every region.
SPIN_ROUNDS = 10_000


def sleep_when_idle() -> bool:
    """Set ``GOMP_SPINCOUNT`` to ``SPIN_ROUNDS`` for this process and its children; False (and nothing changed)
    when the environment already says how OpenMP threads wait, or PyTorch is already loaded."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ or "torch" in sys.modules:
        return False
    os.environ["GOMP_SPINCOUNT"] = str(SPIN_ROUNDS)
    return True
