"""Run a test function in real processes joined by a gloo process group."""

from __future__ import annotations

import faulthandler
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from openalign.train.distributed import open_group


def _entry(rank: int, fn: Callable[..., Any], world_size: int, workdir: str, args: tuple[Any, ...]) -> None:
    # A rank that dies on a signal prints where it was.
    faulthandler.enable()
    # Several ranks share few cores; intra-op threads would only fight each other.
    torch.set_num_threads(1)
    open_group(
        "gloo",
        init_method=f"file://{workdir}/store",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        result = fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    torch.save(result, f"{workdir}/result{rank}.pt")
    # The result is on disk: leave without interpreter teardown, where the destructors of gloo pairs, DDP
    # reducers and FSDP state run in no fixed order while the other rank may be closing its sockets.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_gloo(fn: Callable[..., Any], world_size: int, workdir: Path, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return their results by rank.

    ``fn`` must be importable by name from the spawned processes and return something ``torch.save`` can
    store. ``workdir`` must be an empty directory. A worker's exception is re-raised here.
    """
    context = mp.start_processes(
        _entry, args=(fn, world_size, str(workdir), args), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"gloo workers did not finish within {timeout} s")
    return [torch.load(workdir / f"result{rank}.pt") for rank in range(world_size)]
