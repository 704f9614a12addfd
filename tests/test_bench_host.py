"""``bench.host``: the stepping thread's CPU time, the other threads' and the child processes', against steps whose
host work is known in CPU seconds (not wall time, which a loaded machine stretches): a thread that works, one that
sleeps, a neighbour thread that works while the stepping one waits, a child process that works."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from openalign.bench.host import HostClock, host_line

WORK_S = 0.05  # CPU seconds of work a step


def _work(seconds: float) -> None:
    """Spin until this thread has had ``seconds`` of CPU, however long a busy machine makes that take."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _steps(step: Callable[[], None], n: int = 3) -> dict[str, float]:
    clock = HostClock()
    clock.start()
    for _ in range(n):
        step()
    return clock.stop(n)


def test_a_working_step_is_the_threads_cpu_and_a_sleeping_one_is_not() -> None:
    working = _steps(lambda: _work(WORK_S))
    asleep = _steps(lambda: time.sleep(WORK_S))
    assert working["steps"] == 3
    assert working["thread_cpu_s"] == pytest.approx(WORK_S, rel=0.2)
    assert 0 < working["busy"] <= 1.01
    assert working["wall_s"] >= 0.99 * working["thread_cpu_s"]
    assert asleep["thread_cpu_s"] < 0.1 * WORK_S and asleep["busy"] < 0.1
    assert asleep["wall_s"] >= WORK_S


def _steps_beside(name: str | None, n: int = 3) -> dict[str, float]:
    """``n`` steps in each of which the stepping thread waits while a neighbour thread works ``WORK_S`` of CPU; the
    neighbour takes ``name`` as the kernel knows it (``/proc/self/task/TID/comm``), as PyTorch names its autograd
    threads, and lives until the steps are read, as those do."""
    go, done, finish = threading.Event(), threading.Event(), threading.Event()

    def neighbour() -> None:
        if name is not None:
            assert ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0) == 0  # PR_SET_NAME
        for _ in range(n):
            go.wait()
            go.clear()
            _work(WORK_S)
            done.set()
        finish.wait()

    def step() -> None:
        go.set()
        done.wait()
        done.clear()

    thread = threading.Thread(target=neighbour)
    thread.start()
    try:
        return _steps(step, n)
    finally:
        finish.set()
        thread.join(timeout=60)


def test_a_neighbour_threads_work_is_the_other_threads_cpu() -> None:
    host = _steps_beside(None)
    assert host["other_threads_cpu_s"] >= 0.9 * WORK_S
    assert host["thread_cpu_s"] < 0.2 * WORK_S
    if host["child_cores"] is not None:  # a thread's work is never a child's
        assert host["child_cores"] * host["wall_s"] < 0.02


@pytest.mark.skipif(sys.platform != "linux", reason="threads' names and CPU are read from /proc")
@pytest.mark.parametrize("name", ["pt_autograd_0", "worker"])
def test_an_autograd_device_threads_work_is_read_apart(name: str) -> None:
    """A GPU's backward runs on the autograd engine's thread for that device while the stepping thread waits: its
    CPU is the other threads' and read apart by its name; a thread of another name is not."""
    host = _steps_beside(name, 4)
    assert host["other_threads_cpu_s"] >= 0.9 * WORK_S and host["thread_cpu_s"] < 0.2 * WORK_S
    if name.startswith("pt_autograd_"):
        # /proc counts in clock ticks (10 ms): 0.2 s of work within two of them.
        assert host["autograd_threads_cpu_s"] * 4 == pytest.approx(4 * WORK_S, abs=0.025)
        assert "(autograd's device threads, which run the backward, " in host_line(host)
    else:
        assert host["autograd_threads_cpu_s"] is None and "autograd" not in host_line(host)


@pytest.mark.skipif(sys.platform != "linux", reason="child processes' CPU is read from /proc")
def test_a_child_processs_work_is_counted_as_its_cores() -> None:
    # The child works 0.3 CPU seconds when told, says so, and stays alive (a child that has ended drops out).
    code = (
        "import sys, time\n"
        "sys.stdin.readline()\n"
        "end = time.process_time() + 0.3\n"
        "while time.process_time() < end: pass\n"
        "print('done', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        time.sleep(0.2)  # its interpreter started: start-up is not counted
        clock = HostClock()
        clock.start()
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        host = clock.stop(1)
    finally:
        child.kill()
        child.wait()
    assert host["child_cores"] is not None and host["involuntary_switches"] is not None
    # /proc counts in clock ticks (10 ms on Linux): 0.3 s within two of them and the interpreter's own exit path.
    assert host["child_cores"] * host["wall_s"] == pytest.approx(0.3, abs=0.05)
    assert host["thread_cpu_s"] < 0.1  # the stepping thread waited on the pipe
    line = host_line(host)
    assert "child processes" in line and "involuntary switches a step" in line and "of a mean" in line


def test_stop_without_start_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="without start"):
        HostClock().stop(1)
