"""The training stream's host memory is bounded by ``data.prefetch_gb``, whatever the batch or the workers.

Measured on real processes (the stream and its DataLoader workers, ``tests/stream_memory.py``): a 16,384-pair
batch at 64 px, whose pieces in flight the budget bounds. When workers collated whole float32 batches, four of
them with two batches of prefetch held 6.4 GB for this batch; the measurement stops itself at 3 GB.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from openalign.config import ConfigError
from openalign.train.data import DataConfig, prefetch_pieces

SCRIPT = Path(__file__).with_name("stream_memory.py")
BUDGET_GB = 0.21  # one batch of 16,384 pairs at 64 px as uint8 (0.206 GB), the least the stream accepts
# A worker's own process: interpreter heap, its reader's state, the refill pool; no batch-sized data.
PER_WORKER = 64 * 2**20
CAP_GB = 3.0


def measure(workers: int) -> dict[str, int]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(workers), str(BUDGET_GB), str(CAP_GB)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_peak_memory_of_the_process_tree_is_bounded_by_the_budget_not_the_workers() -> None:
    peaks = {}
    for workers in (2, 4):
        m = measure(workers)
        grown = m["peak"] - m["baseline"]
        # The pieces in flight (the budget), the batch being assembled and the one in use, and each worker's own.
        bound = BUDGET_GB * 1e9 + 2 * m["batch_bytes"] + workers * PER_WORKER
        assert grown <= bound, f"{workers} workers: the tree grew {grown / 1e9:.2f} GB, bound {bound / 1e9:.2f} GB"
        peaks[workers] = m["peak"]
    # Two more workers add two processes, not more data in flight.
    assert peaks[4] - peaks[2] <= 2 * PER_WORKER, {k: v / 1e9 for k, v in peaks.items()}


def test_a_budget_that_cannot_hold_a_batch_is_refused_naming_the_setting() -> None:
    cfg = DataConfig(shards="x.tar", batch_size=16_384, prefetch_gb=4.0, workers=14)
    with pytest.raises(ConfigError, match=r"data\.prefetch_gb 4 cannot hold one batch of 16384 pairs at 289 px"):
        prefetch_pieces(cfg, 289)
    tiny = DataConfig(shards="x.tar", batch_size=64, prefetch_gb=0.0001, workers=2)
    with pytest.raises(ConfigError) as info:
        prefetch_pieces(tiny, 64)
    need = float(re.search(r"at least ([0-9.e-]+)", str(info.value)).group(1))  # type: ignore[union-attr]
    assert f"({need:g} GB as uint8)" in str(info.value) and "0.00 GB" not in str(info.value)
    tiny.prefetch_gb = need  # the figure named is enough, and no more than a tenth over
    assert prefetch_pieces(tiny, 64) >= 1
    tiny.prefetch_gb = need / 1.1
    with pytest.raises(ConfigError):
        prefetch_pieces(tiny, 64)
    cfg.prefetch_gb = 4.2
    # 4.2 GB holds 65 pieces of 256 pairs (a batch is 64 of them, 4.12 GB): 4 ahead for each of 14 workers.
    assert prefetch_pieces(cfg, 289) == 65 // 14
    # A small batch is not prefetched more than two batches ahead, however large the budget.
    small = DataConfig(shards="x.tar", batch_size=512, prefetch_gb=100.0, workers=2)
    assert prefetch_pieces(small, 64) == 2
