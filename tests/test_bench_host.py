"""``bench.host``: the stepping thread's CPU time, the other threads' and the child processes', against steps whose
host work is known: a thread that spins, one that sleeps, a spinning thread beside it, a spinning child."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from openalign.bench.host import HostClock, host_line

STEP_S = 0.1


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _steps(step: object, n: int = 3) -> dict[str, object]:
    clock = HostClock()
    clock.start()
    for _ in range(n):
        step()  # type: ignore[operator]
    return clock.stop(n)


def test_a_busy_step_keeps_the_thread_busy_and_a_sleeping_one_does_not() -> None:
    busy = _steps(lambda: _spin(STEP_S))
    asleep = _steps(lambda: time.sleep(STEP_S))
    assert busy["steps"] == 3 and busy["wall_s"] == pytest.approx(STEP_S, rel=0.5)
    # Bounds wide enough for a shared two-core machine: the spinning thread may lose its core now and then.
    assert busy["busy"] > 0.6 and busy["thread_cpu_s"] > 0.6 * STEP_S
    assert asleep["busy"] < 0.2 and asleep["thread_cpu_s"] < 0.2 * STEP_S
    assert asleep["wall_s"] >= STEP_S


def test_other_threads_and_child_processes_are_counted_apart() -> None:
    stop = threading.Event()

    def spin_until_stopped() -> None:
        while not stop.is_set():
            pass

    thread = threading.Thread(target=spin_until_stopped)
    thread.start()
    child = None
    try:
        alone = _steps(lambda: time.sleep(STEP_S))  # a neighbour thread spinning (holding the GIL), no child
        child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.5)  # the child's interpreter started and spinning
        beside = _steps(lambda: time.sleep(STEP_S))
    finally:
        stop.set()
        thread.join()
        if child is not None:
            child.kill()
            child.wait()
    # The stepping thread slept both times; the neighbour's CPU is the process's other threads', never a child's.
    for host in (alone, beside):
        assert host["busy"] < 0.2
        assert host["other_threads_cpu_s"] > 0.5 * STEP_S
    if sys.platform == "linux":
        assert alone["child_cores"] is not None and alone["child_cores"] < 0.3
        assert beside["child_cores"] is not None and beside["child_cores"] > 0.4
        assert beside["involuntary_switches"] is not None and beside["involuntary_switches"] >= 0
        assert "child processes" in host_line(beside) and "involuntary switches a step" in host_line(beside)


def test_stop_without_start_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="without start"):
        HostClock().stop(1)
