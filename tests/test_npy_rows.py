"""Row reads without a memory map: ``NpyRows.take`` against NumPy's fancy indexing, the crawl side's
``OpenFiles.take`` leaving nothing of the file resident, and the bucket stage's ``KeySet`` against
``np.isin``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import openalign.data.npy_rows as npy_rows
from openalign.data.dedup_buckets.stage import KeySet
from openalign.data.npy_rows import NpyRows

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.mark.parametrize("dtype", ["<f4", "<f2"])
def test_take_equals_fancy_indexing_for_any_rows(tmp_path: Path, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    matrix = np.random.default_rng(0).standard_normal((5000, 24)).astype(dtype)
    np.save(tmp_path / "m.npy", matrix)
    rows = NpyRows(tmp_path / "m.npy")
    rng = np.random.default_rng(1)
    requests = [
        rng.integers(0, 5000, 700),  # scattered, with repeats, unordered
        np.arange(4999, -1, -1),  # every row, backwards: long runs
        np.array([0, 4999, 0]),
        np.array([], np.int64),
        rng.choice(5000, 40, replace=False),
    ]
    # Tiny spans and gaps: every run is split and every gap rule taken, as on a crawl of many GB.
    sizes: list[int] = []
    pread = npy_rows.os.pread

    def counted(fd: int, size: int, offset: int) -> bytes:
        sizes.append(size)
        return pread(fd, size, offset)

    monkeypatch.setattr(npy_rows.os, "pread", counted)
    for span, gap in ((4 << 20, 16 << 10), (rows.row_bytes * 3, rows.row_bytes), (rows.row_bytes, 1)):
        monkeypatch.setattr(npy_rows, "SPAN_BYTES", span)
        monkeypatch.setattr(npy_rows, "GAP_BYTES", gap)
        for ids in requests:
            sizes.clear()
            got = rows.take(ids)
            assert got.dtype == matrix.dtype and np.array_equal(got, matrix[ids])
            assert max(sizes, default=0) <= span  # the buffer of one read is bounded at any request
    with pytest.raises(IndexError):
        rows.take(np.array([5000]))
    with pytest.raises(IndexError):
        rows.take(np.array([-1]))


RESIDENT = """
import sys, numpy as np
from pathlib import Path
from openalign.data.dedup_buckets import EmbeddingFiles
def file_pages():
    return int(next(l for l in open("/proc/self/status") if l.startswith("RssFile")).split()[1]) * 1024
path = Path(sys.argv[1])
rows = np.sort(np.random.default_rng(0).choice(100_000, 8_000, replace=False))
side = EmbeddingFiles((path,)).open()
before = file_pages()
taken = side.take(rows)
read = file_pages() - before
mapped = np.load(path, mmap_mode="r")
before = file_pages()
control = np.asarray(mapped[rows], np.float32)  # the same rows through a memory map
print(read, file_pages() - before, int(np.array_equal(taken, control)))
"""


def test_a_sample_spread_over_the_crawl_leaves_no_file_pages_resident(tmp_path: Path) -> None:
    # 100,000 rows of 1 KB (about 100 MB); 8,000 rows spread over it, as the k-means sample is.
    np.save(tmp_path / "crawl.npy", np.random.default_rng(2).standard_normal((100_000, 256)).astype(np.float32))
    script = textwrap.dedent(RESIDENT)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "crawl.npy")], capture_output=True,
                          text=True, env={"PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    read, mapped, same = map(int, done.stdout.split())
    size = (tmp_path / "crawl.npy").stat().st_size
    assert same == 1
    assert mapped > 0.2 * size  # the control: the map keeps the pages around each row
    assert read < 0.02 * size, (read, mapped, size)


def test_key_set_membership_equals_isin() -> None:
    rng = np.random.default_rng(3)
    members = rng.integers(-(2**62), 2**62, 20_000)
    members[:3] = [0, -1, np.iinfo(np.int64).max]
    keys = KeySet(np.concatenate([members, members[:500]]))  # repeats collapse
    assert len(keys) == len(np.unique(members))
    asked = np.concatenate([members[::3], rng.integers(-(2**62), 2**62, 200_000), [np.iinfo(np.int64).min, 1]])
    asked = rng.permutation(asked)
    assert np.array_equal(keys.contains(asked), np.isin(asked, members))
    block = asked[: len(asked) // 4 * 4]
    assert np.array_equal(keys.contains(block.reshape(-1, 4)), np.isin(block, members))  # flattened
    # Packed bucket keys (three 12-bit cluster ids), as the bucket stage asks them.
    ids = np.sort(rng.integers(0, 4096, (5000, 3)), axis=1)
    packed = (ids[:, 0] << 24) | (ids[:, 1] << 12) | ids[:, 2]
    some = KeySet(packed[::2])
    assert np.array_equal(some.contains(packed), np.isin(packed, packed[::2]))
    empty = KeySet(np.zeros(0, np.int64))
    assert not empty.contains(asked).any() and len(empty) == 0
