"""The exact check of candidate pairs: vectors read back from the ``.npy`` files by row id.

Both join engines hand over (crawl row, test row) batches; this reads the two rows of each pair from the
memory-mapped matrices, normalises them as the in-memory search does, and keeps pairs whose cosine exceeds
the threshold. Reading by row id keeps the vectors out of the join (a 640-d float row is 2.5 KB; a bucket
row is 16 bytes), so the join shuffles keys only and the cosine check touches only candidate rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from openalign.data.dedup_buckets.files import EmbeddingFiles, OpenFiles

PAIR_SCHEMA = pa.schema([("i", pa.int64()), ("j", pa.int64()), ("cosine", pa.float32())])


@dataclass
class PairScorer:
    """Cosines of (crawl row, test row) pairs above ``threshold``; ``block`` pairs gathered at a time."""

    crawl: OpenFiles
    test: OpenFiles
    threshold: float
    block: int = 16_384  # bounds the two gathered [block, D] matrices

    @classmethod
    def from_files(
        cls, crawl: EmbeddingFiles, test: EmbeddingFiles, threshold: float, block: int = 16_384
    ) -> PairScorer:
        return cls(crawl.open(), test.open(), threshold, block)

    def __call__(self, i: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        keep_i, keep_j, keep_c = [], [], []
        for s in range(0, len(i), self.block):
            a, b = i[s : s + self.block], j[s : s + self.block]
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
