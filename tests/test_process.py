"""``openalign.process``: a benchmark's contender in a spawned interpreter of its own."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from openalign.process import run_spawned


def _where(tag: str) -> tuple[str, int, str]:
    return tag, os.getpid(), mp.get_start_method()


def _broken(tag: str) -> None:
    raise ValueError(f"no {tag} here")


def test_a_contender_runs_in_its_own_process_and_hands_back_its_result() -> None:
    tag, pid, method = run_spawned(_where, "a")
    assert tag == "a" and pid != os.getpid() and method == "spawn"
    # A training contender's DataLoader workers fork from it, as a training process's do.
    assert run_spawned(_where, "b", fork_workers=True)[2] == "fork"


def test_a_failing_contender_is_one_line_naming_it() -> None:
    with pytest.raises(RuntimeError, match=r"^_broken\('x'\) failed: ValueError: no x here$"):
        run_spawned(_broken, "x")
