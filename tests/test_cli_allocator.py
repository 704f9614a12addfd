"""The ``openalign`` process keeps freed memory for reuse: a block freed and asked for again takes no new pages."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Allocates and frees tensors of 1, 2, ... 20 MiB, one after the other, and prints the page faults they took.
_CHURN = """
import resource, sys, torch
from openalign.cli.allocator import retain_freed_memory
applied = retain_freed_memory() if sys.argv[1] == "retain" else False
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for mib in range(1, 21):
    torch.ones(mib << 18).sum()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", _CHURN, mode], capture_output=True, text=True, check=True, timeout=120)
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_blocks_are_reused_without_new_pages() -> None:
    applied, retained = _faults("retain")
    if not applied:
        pytest.skip("no glibc mallopt here")
    _, default = _faults("default")
    largest = (20 << 20) // 4096  # pages of the largest block
    # By default each block larger than any freed before is mapped afresh: the pages of all 210 MiB are faulted
    # in. Retained, the heap grows to the largest block once and every later block reuses its pages.
    assert default > 5 * largest, default
    assert retained < 2 * largest and 4 * retained < default, (retained, default)


def test_only_the_process_command_line_changes_the_allocator_the_threads_and_the_exit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import openalign.cli as cli

    calls: list[str] = []
    monkeypatch.setattr(cli, "retain_freed_memory", lambda: calls.append("allocator") or True)
    monkeypatch.setattr(cli, "sleep_when_idle", lambda: calls.append("threads") or True)  # cli/threads.py
    monkeypatch.setattr(cli, "skip_exit_collection", lambda: calls.append("exit"))  # this process goes on collecting
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])  # as a library or a test calls it
    assert calls == []
    monkeypatch.setattr(sys, "argv", ["openalign", "plan", "--help"])
    with pytest.raises(SystemExit):
        cli.main()  # as the openalign command and python -m openalign call it
    assert calls == ["allocator", "threads", "exit"]  # the exit's pass skipped, even when the command raises
