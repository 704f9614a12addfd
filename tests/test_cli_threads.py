"""The ``openalign`` process's OpenMP threads sleep soon after their work runs out instead of spinning."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Parallel sums on two threads with pauses between them, as a step's regions have serial work between them: the
# process's CPU time counts what the idle thread burns while it waits for the next region.
_PAUSES = """
import resource, sys, time
from openalign.cli.threads import sleep_when_idle
applied = sleep_when_idle() if sys.argv[1] == "sleep" else False
import torch
torch.set_num_threads(2)
x = torch.ones(1 << 20)
x.sum()
start = resource.getrusage(resource.RUSAGE_SELF)
for _ in range(100):
    x.sum()
    time.sleep(0.003)
end = resource.getrusage(resource.RUSAGE_SELF)
print(applied, (end.ru_utime - start.ru_utime) + (end.ru_stime - start.ru_stime))
"""


def _cpu_seconds(mode: str) -> tuple[bool, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    out = subprocess.run(
        [sys.executable, "-c", _PAUSES, mode], capture_output=True, text=True, check=True, timeout=120, env=env
    )
    applied, seconds = out.stdout.split()
    return applied == "True", float(seconds)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GNU OpenMP, as in PyTorch's Linux wheels")
def test_idle_threads_stop_spinning_between_regions() -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores: libgomp spins little anyway when its threads outnumber them")
    applied, short = _cpu_seconds("sleep")
    assert applied
    _, default = _cpu_seconds("default")
    # By default the idle thread spins through most of each 3 ms pause; told to sleep, it stops within half a
    # millisecond, so the process burns far less CPU for the same sums.
    assert short < 0.5 * default, (short, default)


def test_the_environment_and_a_loaded_torch_win(monkeypatch: pytest.MonkeyPatch) -> None:
    from openalign.cli.threads import SPIN_ROUNDS, sleep_when_idle

    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):  # set first, so that the end of the test restores them
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert sleep_when_idle() and os.environ["GOMP_SPINCOUNT"] == str(SPIN_ROUNDS)
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    assert not sleep_when_idle() and os.environ["GOMP_SPINCOUNT"] == "123"  # the user's choice stays
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert not sleep_when_idle() and "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setitem(sys.modules, "torch", object())  # loaded: libgomp has read its settings already
    assert not sleep_when_idle() and "GOMP_SPINCOUNT" not in os.environ
