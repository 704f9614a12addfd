"""``openalign.process``: a benchmark's contender in a spawned interpreter of its own."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable

import pytest

from openalign.process import run_spawned, run_spawned_in_turns


def _where(tag: str) -> tuple[str, int, str]:
    return tag, os.getpid(), mp.get_start_method()


def _broken(tag: str, turn: Callable[[], None] | None = None) -> None:
    raise ValueError(f"no {tag} here")


def _ended(code: int) -> None:
    os._exit(code)  # as a process killed for memory, or crashed in C code, ends: without a word


def _prepare_then_run(tag: str, prepare_s: float, turn: Callable[[], None]) -> dict[str, float | str]:
    """A contender: prepares (compiles) for ``prepare_s``, then waits for its turn and runs for 0.3 s."""
    start = time.monotonic()
    time.sleep(prepare_s)
    ready = time.monotonic()
    turn()
    go = time.monotonic()
    time.sleep(0.3)
    return {"tag": tag, "start": start, "ready": ready, "go": go, "end": time.monotonic()}


def test_a_contender_runs_in_its_own_process_and_hands_back_its_result() -> None:
    tag, pid, method = run_spawned(_where, "a")
    assert tag == "a" and pid != os.getpid() and method == "spawn"
    # A training contender's DataLoader workers fork from it, as a training process's do.
    assert run_spawned(_where, "b", fork_workers=True)[2] == "fork"


def test_a_failing_contender_is_one_line_naming_it() -> None:
    with pytest.raises(RuntimeError, match=r"^_broken\('x'\) failed: ValueError: no x here$"):
        run_spawned(_broken, "x")


def test_a_contender_that_ends_without_a_word_is_an_error_not_a_wait_for_ever() -> None:
    with pytest.raises(
        RuntimeError, match=r"^_ended\(3\) failed: its process ended with exit code 3 before reporting$"
    ):
        run_spawned(_ended, 3)


def test_contenders_prepare_together_then_run_one_at_a_time_in_order() -> None:
    a, b = run_spawned_in_turns(_prepare_then_run, [("a", 1.5), ("b", 2.5)])
    assert (a["tag"], b["tag"]) == ("a", "b")
    # They prepared at once: b had started before a was ready, so the wait is the longer preparation, not the sum.
    assert b["start"] < a["ready"]
    # Neither ran before both were ready, and b ran only once a had ended: no timed run shared the machine.
    assert a["go"] >= b["ready"] and b["go"] >= a["end"]


def test_a_contender_failing_while_preparing_stops_the_others_at_once() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^_broken\('x'\) failed: ValueError: no x here$"):
        list(run_spawned_in_turns(_broken, [("x",), ("y",)]))
    # The first fails while the second has a minute to prepare; the second fails while the first waits its turn.
    with pytest.raises(RuntimeError, match=r"^_prepare_then_run\('a'\) failed: TypeError"):
        list(run_spawned_in_turns(_prepare_then_run, [("a", "not seconds"), ("b", 60.0)]))
    with pytest.raises(RuntimeError, match=r"^_prepare_then_run\('b'\) failed: TypeError"):
        list(run_spawned_in_turns(_prepare_then_run, [("a", 0.1), ("b", "not seconds")]))
    assert time.monotonic() - start < 30  # b's minute of preparation was not waited for
    assert not mp.active_children()
