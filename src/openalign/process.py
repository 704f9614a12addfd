"""How a process of ours ends once its work is done, and how a benchmark runs a contender in one of its own."""

from __future__ import annotations

import gc
import multiprocessing as mp
from collections.abc import Callable
from typing import Any


def skip_exit_collection() -> None:
    """Leave every object alive now out of the garbage collector's passes, the interpreter's last one included.

    At exit Python collects over every object it tracks, torch's hundreds of thousands among them: ~0.7 s of a
    two-core machine after ``import torch`` alone, ~1.7 s for a gloo rank that ran an FSDP2 step. Call it where
    a process's work ends (a command, a spawned child that has handed over its result): nothing that pass could
    free matters to a process about to end. Files and queues still close and flush as the process exits.
    """
    gc.freeze()


def _contender(fn: Callable[..., Any], args: tuple[Any, ...], fork_workers: bool, queue: Any) -> None:
    if fork_workers:
        # DataLoader workers fork from this process, as they do from a training process started by a shell or
        # torchrun; inheriting spawn from the parent would add interpreter start-ups to the first steps.
        mp.set_start_method("fork", force=True)
    try:
        queue.put(fn(*args))
    except Exception as err:  # reported by the parent as one line
        queue.put({"error": f"{type(err).__name__}: {err}"})
    skip_exit_collection()  # the parent joins this process before it starts the next


def run_spawned(fn: Callable[..., Any], *args: Any, fork_workers: bool = False) -> Any:
    """``fn(*args)`` in a freshly spawned interpreter, its result returned or its error raised as one line.

    Benchmarks time each contender in a process of its own, so that none inherits another's caches, allocator
    state or threads. ``fn`` must be importable by name (a module-level function).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_contender, args=(fn, args, fork_workers, queue))
    proc.start()
    result = queue.get()
    proc.join()
    if isinstance(result, dict) and "error" in result:
        what = f"{fn.__name__}({args[0]!r})" if args else f"{fn.__name__}()"
        raise RuntimeError(f"{what} failed: {result['error']}")
    return result
