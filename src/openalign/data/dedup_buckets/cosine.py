"""The exact check of candidate pairs: vectors read back from the ``.npy`` files by row id.

Both join engines hand over (crawl row, test row) batches; this reads the two rows of each pair from the
memory-mapped matrices, normalises them as the in-memory search does, and keeps pairs whose cosine exceeds
the threshold. Reading by row id keeps the vectors out of the join (a 640-d float row is 2.5 KB; a bucket
row is 16 bytes), so the join shuffles keys only and the cosine check touches only candidate rows.

With the PCA projection, candidates are first screened on the projected rows the bucket stage wrote, as
the in-memory search screens them: for unit rows cos > t means |x - y|² < 2(1 - t), and an orthonormal
projection never lengthens a distance, so a pair failing the bound there cannot be a duplicate. The
screen reads ``project_dim`` floats per row instead of D.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from openalign.data.dedup_buckets.files import EmbeddingFiles, OpenFiles
from openalign.data.npy_rows import NpyRows

PAIR_SCHEMA = pa.schema([("i", pa.int64()), ("j", pa.int64()), ("cosine", pa.float32())])


@dataclass
class PairScorer:
    """Cosines of (crawl row, test row) pairs above ``threshold``; ``block`` pairs gathered at a time."""

    crawl: OpenFiles
    test: OpenFiles
    threshold: float
    projected: tuple[Path, Path] | None = None  # crawl and test rows in the PCA projection, for the screen
    block: int = 16_384  # bounds the two gathered [block, D] matrices

    def __post_init__(self) -> None:
        self.screen: tuple[NpyRows, np.ndarray] | None = None
        if self.projected is not None:
            # Crawl rows are read per batch without a memory map (candidates arrive in crawl order, so the reads
            # are near-sequential and nothing of the file stays resident); the test side's projection is held,
            # as its bucket keys are (``project_dim`` floats a row).
            self.screen = (NpyRows(self.projected[0]), np.load(self.projected[1]))
        # The in-memory search's bound, with the same margin for float rounding.
        self.max_sq = np.float32(2.0 * (1.0 - self.threshold) * (1 + 1e-4) + 1e-5)

    @classmethod
    def from_files(
        cls, crawl: EmbeddingFiles, test: EmbeddingFiles, threshold: float, projected: tuple[Path, Path] | None
    ) -> PairScorer:
        return cls(crawl.open(), test.open(), threshold, projected)

    def __call__(self, i: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        keep_i, keep_j, keep_c = [], [], []
        for s in range(0, len(i), self.block):
            a, b = i[s : s + self.block], j[s : s + self.block]
            if self.screen is not None:
                diff = self.screen[0].take(a) - self.screen[1][b]
                near = np.einsum("ij,ij->i", diff, diff) < self.max_sq
                a, b = a[near], b[near]
            cos = np.einsum("ij,ij->i", self.crawl.unit_rows(a), self.test.unit_rows(b))
            hit = cos > self.threshold  # float32 against the threshold, as the in-memory search compares
            keep_i.append(a[hit])
            keep_j.append(b[hit])
            keep_c.append(cos[hit])
        if not keep_i:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
        return np.concatenate(keep_i), np.concatenate(keep_j), np.concatenate(keep_c).astype(np.float32)

    def batches(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """Arrow batches of candidates (columns i, j) in, batches of pairs above the threshold out."""
        for batch in batches:
            i = batch.column("i").to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
            j = batch.column("j").to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
            hi, hj, hc = self(i, j)
            yield pa.RecordBatch.from_arrays([pa.array(hi), pa.array(hj), pa.array(hc)], schema=PAIR_SCHEMA)
