"""The ``openalign`` process's compute threads sleep soon after their work runs out, instead of spinning.

PyTorch's CPU kernels share their work among OpenMP threads (GNU libgomp in the Linux wheels). A thread done with
its share waits for the next parallel region by spinning, 300,000 rounds by default, before it sleeps. When these
threads have the cores to themselves that costs nothing; when another program keeps one core busy (a browser, a
second job, a test run beside it), the spinning thread takes turns on a core with the thread that still has work,
and every one of a step's thousands of regions waits for that thread. On two cores with one busy elsewhere the
demo's training step took 2.2 s instead of 0.25, and its decontamination stage 716 s instead of 86-108 (with the
same results).

With 10,000 rounds a waiting thread sleeps after a few microseconds to half a millisecond (a round is one
``pause`` instruction, 10-140 cycles depending on the CPU). Beside a program spinning on one of two cores, 60
steps of the demo's training (the whole ``openalign train`` command) took 0.48x the wall time (61 s against 127,
median of 2 pairs); on the quiet machine 150 steps took 1.03x (image tower in bf16) and 0.98x (fp32) the wall
time, within the spread of the alternating runs (0.94-1.05), and 0.93-0.97x the CPU time. The work each thread
does, and so every result, is the same.

Only the command's own process (and what it starts) is changed, and only before PyTorch is loaded: libgomp reads
its settings when it loads. A ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` already in the environment is left as
it is.
"""

from __future__ import annotations

import os
import sys

__all__ = ["SPIN_ROUNDS", "sleep_when_idle"]

# The bare training step beside the busy core: 2.22 s with libgomp's default, 1.44 s with 100,000 rounds, 0.86 s
# with 10,000, 0.77 s with 1,000, 0.71 s never spinning (OMP_WAIT_POLICY=PASSIVE), which made the quiet step
# slower (0.28 s against 0.23-0.26): a thread that sleeps at once is woken for every region.
SPIN_ROUNDS = 10_000


def sleep_when_idle() -> bool:
    """Set ``GOMP_SPINCOUNT`` to ``SPIN_ROUNDS`` for this process and its children; False (and nothing changed)
    when the environment already says how OpenMP threads wait, or PyTorch is already loaded."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ or "torch" in sys.modules:
        return False
    os.environ["GOMP_SPINCOUNT"] = str(SPIN_ROUNDS)
    return True
