"""Peak memory of the training stream's whole process tree, run as its own process (a clean baseline):

    python tests/stream_memory.py WORKERS PREFETCH_GB CAP_GB

prints one JSON line {"baseline", "peak", "batch_bytes"} in bytes. The tree is the process and its DataLoader
workers; its memory is the sum of their PSS (proportional set size: a page shared by n processes counts 1/n
in each, so pages forked workers share with the parent, and tensors handed over through shared memory, are
counted once). A sampler thread reads it every few milliseconds; past CAP_GB it ends the process (exit 3), so a
stream that grows without bound fails this measurement instead of the machine.

The source is a stand-in for decoding (one fixed image, cropped and flipped per sample), so that the memory of
the stream's own machinery is measured in seconds: 16,384 pairs at 64 px per batch, as uint8 0.2 GB.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
from PIL import Image

BATCH, SIZE, TEXT = 16_384, 64, 16


def pss(process: psutil.Process) -> int:
    try:
        with open(f"/proc/{process.pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # a worker that just ended
        return 0
    return 0


def tree(me: psutil.Process) -> int:
    return pss(me) + sum(pss(child) for child in me.children(recursive=True))


class FixedImageSource:
    """A TrainSource whose every sample is one small image and a short caption (no rendering cost)."""

    image = Image.new("RGB", (77, 77), (120, 30, 200))

    def fingerprint(self) -> str:
        return "fixed"

    def describe(self) -> str:
        return "a fixed image"

    def sequence(self, seed: int, start: int, epoch_length: int | None, on_epoch: Callable[[int], None]) -> Iterator:
        return ((True, pos, pos) for pos in itertools.count(start))

    def draws(self, run_seed: int, seed: int) -> Iterator:
        raise NotImplementedError

    def materialize(self, payload: int) -> tuple[str, Any]:
        return f"a purple square number {payload % 97}", self.image

    def cache_key(self, payload: int) -> None:
        return None  # measured as decoded every time


def main(workers: int, prefetch_gb: float, cap_gb: float) -> None:
    from openalign.text import train_wordpiece
    from openalign.train.data import DataConfig, TrainStream, _Plan, batch_bytes

    tokenizer = train_wordpiece((f"a purple square number {i}" for i in range(97)), vocab_size=200)
    cfg = DataConfig(
        source="synthetic", batch_size=BATCH, image_size=SIZE, workers=workers, prefetch_gb=prefetch_gb,
        max_text_length=TEXT,
    )  # fmt: skip
    image = {"image_size": SIZE, "resize": 77, "mean": (0.5,) * 3, "std": (0.5,) * 3}
    stream = TrainStream(_Plan(FixedImageSource(), cfg, tokenizer, image, 0, 1, 0, 0, None))  # type: ignore[arg-type]
    me = psutil.Process()
    baseline = tree(me)
    peak = [baseline]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            now = tree(me)
            peak[0] = max(peak[0], now)
            if now > cap_gb * 1e9:
                print(f"the stream's process tree passed {cap_gb} GB", file=sys.stderr, flush=True)
                for child in me.children(recursive=True):
                    child.kill()
                os._exit(3)
            time.sleep(0.005)

    threading.Thread(target=sample, daemon=True).start()
    batches = iter(stream)
    held = next(batches)
    # A slow step: the workers fill all the prefetch they are allowed while the batch is in use (until the tree
    # stops growing), then the next batch is assembled from what they prefetched.
    last, still = tree(me), 0.0
    for _ in range(600):
        time.sleep(0.25)
        now = tree(me)
        still = still + 0.25 if now <= last + 2**20 else 0.0
        last = max(last, now)
        if still >= 3:
            break
    held = next(batches)
    del held
    done.set()
    print(json.dumps({"baseline": baseline, "peak": peak[0], "batch_bytes": batch_bytes(cfg, SIZE)}))


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]))
