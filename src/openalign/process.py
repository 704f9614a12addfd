"""How a process of ours ends once its work is done, and how a benchmark runs a contender in one of its own."""

from __future__ import annotations

import gc
import multiprocessing as mp
from collections.abc import Callable, Iterator, Sequence
from queue import Empty
from typing import Any


def skip_exit_collection() -> None:
    """Leave every object alive now out of the garbage collector's passes, the interpreter's last one included.

    At exit Python collects over every object it tracks, torch's hundreds of thousands among them, which takes a
    noticeable share of a short process's time. Call it where
    a process's work ends (a command, a spawned child that has handed over its result): nothing that pass could
    free matters to a process about to end. Files and queues still close and flush as the process exits.
    """
    gc.freeze()


_READY = "ready"


class Turn:
    """A contender's place in ``run_spawned_in_turns``: calling it says the contender is ready (built, compiled,
    warmed up) and blocks until the parent lets it run alone."""

    def __init__(self, queue: Any, go: Any) -> None:
        self.queue, self.go = queue, go

    def __call__(self) -> None:
        self.queue.put(_READY)
        self.go.wait()


def _contender(
    fn: Callable[..., Any], args: tuple[Any, ...], fork_workers: bool, queue: Any, turn: Turn | None = None
) -> None:
    if fork_workers:
        # DataLoader workers fork from this process, as they do from a training process started by a shell or
        # torchrun; inheriting spawn from the parent would add interpreter start-ups to the first steps.
        mp.set_start_method("fork", force=True)
    try:
        queue.put(fn(*args) if turn is None else fn(*args, turn=turn))
    except Exception as err:  # reported by the parent as one line
        queue.put({"error": f"{type(err).__name__}: {err}"})
    skip_exit_collection()  # the parent joins this process before it starts the next


def _message(proc: Any, queue: Any) -> Any:
    """The child's next message; an error if it ends without one (killed, out of memory, a crash in C code)
    rather than waiting for ever."""
    while True:
        try:
            return queue.get(timeout=1.0)
        except Empty:
            if proc.is_alive():
                continue
            try:  # sent just before it ended
                return queue.get(timeout=1.0)
            except Empty:
                return {"error": f"its process ended with exit code {proc.exitcode} before reporting"}


def _result(fn: Callable[..., Any], args: tuple[Any, ...], result: Any) -> Any:
    if isinstance(result, dict) and "error" in result:
        what = f"{fn.__name__}({args[0]!r})" if args else f"{fn.__name__}()"
        raise RuntimeError(f"{what} failed: {result['error']}")
    return result


def run_spawned(fn: Callable[..., Any], *args: Any, fork_workers: bool = False) -> Any:
    """``fn(*args)`` in a freshly spawned interpreter, its result returned or its error raised as one line.

    Benchmarks time each contender in a process of its own, so that none inherits another's caches, allocator
    state or threads. ``fn`` must be importable by name (a module-level function).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_contender, args=(fn, args, fork_workers, queue))
    proc.start()
    result = _message(proc, queue)
    proc.join()
    return _result(fn, args, result)


def run_spawned_in_turns(fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]]) -> Iterator[Any]:
    """``fn(*args, turn=turn)`` for each ``args`` of ``calls``, each in a spawned interpreter of its own, all
    started at once: each prepares beside the others until it calls ``turn()``; once every one has, they run on
    one at a time, in order, each alone while it is timed. Compiling contenders compile together, so the wait is
    the longest compilation rather than the sum, and no timing shares the machine.

    Yields the results in order as each ends. An error (one line, naming the call) stops the processes still
    running, as does leaving the loop early.
    """
    ctx = mp.get_context("spawn")
    runs = []
    try:
        for args in calls:
            queue, go = ctx.Queue(), ctx.Event()
            proc = ctx.Process(target=_contender, args=(fn, args, False, queue, Turn(queue, go)))
            proc.start()
            runs.append((proc, queue, go))
        firsts = []
        for (proc, queue, _), args in zip(runs, calls, strict=True):
            firsts.append(_message(proc, queue))  # "ready", or the end of one that never waited
            if not _is_ready(firsts[-1]):
                _result(fn, args, firsts[-1])  # an error: raised now, not after the others have compiled
        for (proc, queue, go), first, args in zip(runs, firsts, calls, strict=True):
            if _is_ready(first):
                go.set()
                first = _message(proc, queue)
            proc.join()
            yield _result(fn, args, first)
    finally:
        for proc, _, _ in runs:
            if proc.is_alive():
                proc.terminate()
                proc.join()


def _is_ready(message: Any) -> bool:
    return isinstance(message, str) and message == _READY
