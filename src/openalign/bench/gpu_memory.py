"""Peak memory of a process tree (a training process and its data workers), sampled from ``/proc``.

PSS (proportional set size, ``/proc/PID/smaps_rollup``) splits each page among the processes mapping it, so
its sum over the tree counts the pages workers share with their parent since ``fork``, and batches passed
through shared memory, once. The sum of RSS counts them in every process that maps them (an upper bound);
the machine's used memory (``MemTotal − MemAvailable``) also sees shared memory no process maps any more and
the page cache's losses, but everything else running on the host too. All three are kept. Without ``/proc``
(not Linux), psutil's figures are used where it is installed.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

__all__ = ["TreeSampler", "process_tree", "stat_fields", "tree_memory"]

PROC = Path("/proc")
GiB = 2**30


def stat_fields(pid: int | str) -> list[str] | None:
    """``/proc/PID/stat``'s fields after the command name (the first is the state, field 3 of proc(5)), or None
    once the process is gone."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:  # gone between listing and reading
        return None
    # The command name may hold spaces and parentheses: the fields after its last ")" are fixed.
    return stat[stat.rindex(")") + 2 :].split()


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    parents: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = stat_fields(entry.name)
        if fields is not None:
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(parents.get(pid, ()))
    return tree


def _rollup(pid: int) -> tuple[int, int] | None:
    """(PSS, RSS) bytes of one process, or None once it is gone."""
    try:
        text = (PROC / str(pid) / "smaps_rollup").read_text()
    except OSError:
        try:  # kernels before 4.14 have no smaps_rollup: RSS only
            status = (PROC / str(pid) / "status").read_text()
        except OSError:
            return None
        rss = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        return rss * 1024, rss * 1024
    fields = {line.split(":")[0]: int(line.split()[1]) for line in text.splitlines()[1:] if line.endswith("kB")}
    return fields.get("Pss", 0) * 1024, fields.get("Rss", 0) * 1024


def _host_used() -> int:
    info = {line.split(":")[0]: int(line.split()[1]) for line in (PROC / "meminfo").read_text().splitlines()}
    return (info["MemTotal"] - info["MemAvailable"]) * 1024


def tree_memory(root: int) -> dict[str, int]:
    """Now: processes in the tree, the sum of their PSS and of their RSS, the host's used bytes."""
    if not (PROC / "self").exists():
        return _psutil_tree(root)
    pss = rss = n = 0
    for pid in process_tree(root):
        got = _rollup(pid)
        if got is not None:
            pss, rss, n = pss + got[0], rss + got[1], n + 1
    return {"processes": n, "pss": pss, "rss": rss, "host_used": _host_used()}


def _psutil_tree(root: int) -> dict[str, int]:
    try:
        import psutil  # type: ignore[import-untyped]  # optional, and only off Linux
    except ImportError:
        return {}
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.Error:
        return {}
    pss = rss = 0
    for p in procs:
        try:
            info = p.memory_full_info()
        except psutil.Error:
            continue
        rss += info.rss
        pss += getattr(info, "pss", getattr(info, "uss", info.rss))
    return {"processes": len(procs), "pss": pss, "rss": rss, "host_used": psutil.virtual_memory().used}


class TreeSampler:
    """Samples ``tree_memory(root)`` every ``period`` seconds in a thread until ``stop``; keeps the peaks."""

    def __init__(self, root: int, period: float = 0.5) -> None:
        self.root, self.period = root, period
        self.peak: dict[str, int] = {}
        self.host_before = _host_used() if (PROC / "meminfo").exists() else None
        self.samples = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                now = tree_memory(self.root)
            except (OSError, ValueError):  # a process vanished mid-read: the next sample will do
                now = {}
            for k, v in now.items():
                self.peak[k] = max(self.peak.get(k, 0), v)
            self.samples += bool(now)
            self._done.wait(self.period)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def summary(self) -> dict[str, Any]:
        """Peaks in GiB: the tree's PSS sum (the figure), RSS sum, and how far the host's used memory rose."""
        if not self.samples:
            return {"note": "no memory samples (no /proc and no psutil)"}
        out: dict[str, Any] = {
            "peak_pss_gib": round(self.peak.get("pss", 0) / GiB, 2),
            "peak_rss_sum_gib": round(self.peak.get("rss", 0) / GiB, 2),
            "max_processes": self.peak.get("processes", 0),
            "samples": self.samples,
            "sampled_every_s": self.period,
        }
        if self.host_before is not None and "host_used" in self.peak:
            out["host_used_rise_gib"] = round((self.peak["host_used"] - self.host_before) / GiB, 2)
        return out
