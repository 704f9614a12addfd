"""The bucket stage: centroids from a sample, then every row's bucket keys written to Parquet, chunk by chunk.

This is the part of the rule that needs no join: k-means on a sample of the crawl (in the PCA projection
when ``project_dim`` is set), each row's ``nearest`` centroids, and the C(nearest, combo) bucket keys of
those, exactly as ``openalign.data.dedup.find_near_duplicates`` computes them (same sample, same
projection, same keys), so the join engines find the same candidates as the in-memory search.

Memory is one chunk of rows plus, when ``prune_keys`` is on, the test side's distinct bucket keys: a crawl
bucket no test image has cannot join, so it is not written. That cuts the crawl's Parquet from 120 rows
per image to the few that can match; it assumes the test keys fit in memory (8 bytes × 120 per test image).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from openalign.data.dedup import (
    DedupConfig,
    _fit_clusters,
    _nearest_clusters,
    _normalised,
    _Projection,
    bucket_keys,
    kmeans_sample,
)
from openalign.data.dedup_buckets.files import OpenFiles


@dataclass
class Routing:
    """What sends a row to its buckets: the projection, the centroids' index and the bucket shape."""

    projection: _Projection
    index: Any  # faiss.IndexFlatL2 over the centroids
    clusters: int
    nearest: int
    combo: int
    sample_rows: int

    def keys(self, chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(bucket keys [n_valid, C(nearest, combo)], valid row positions, projected rows [n, d]) of raw rows."""
        unit, ok = _normalised(chunk)
        rows = np.flatnonzero(ok)
        projected = self.projection(unit)
        labels = _nearest_clusters(self.index, projected[rows], self.nearest)
        return bucket_keys(labels, self.combo, self.clusters), rows, projected

    def save(self, path: Path) -> None:
        """Centroids and projection, so that a run can be checked (or its routing re-used) later."""
        p = self.projection
        np.savez(
            path,
            centroids=self.index.reconstruct_n(0, self.index.ntotal),
            basis=p.basis if p.basis is not None else np.zeros((0, 0), np.float32),
            offset=p.offset if p.offset is not None else np.zeros(0, np.float32),
            shape=np.array([self.clusters, self.nearest, self.combo]),
        )


def fit_routing(crawl: OpenFiles, cfg: DedupConfig, notes: list[str]) -> Routing | None:
    """Centroids on the same sample of crawl rows the in-memory search draws; None without valid rows."""
    drawn = kmeans_sample(crawl.rows, crawl.take, cfg, notes)
    if drawn is None:
        return None
    sample, k, nearest, combo, n_fit = drawn
    projection = _Projection(sample, cfg.project_dim)
    index = _fit_clusters(projection(sample), k, cfg)
    return Routing(projection, index, k, nearest, combo, n_fit)


def write_buckets(
    side: OpenFiles,
    routing: Routing,
    out_dir: Path,
    *,
    chunk_size: int,
    row_column: str,
    keep: np.ndarray | None = None,
    projected_path: Path | None = None,
) -> dict[str, int]:
    """One Parquet part per chunk in ``out_dir``: (k bucket key, ``row_column`` global row) for every valid row.

    With ``keep`` (sorted distinct keys), only buckets among them are written. With ``projected_path`` (and
    a PCA projection) every row's projection is written there as one ``.npy``, for the cosine check's
    exact screen. Returns rows, rows skipped as invalid (NaN, inf, zero) and bucket rows written.
    """
    dim = routing.projection.dim
    projected_out = None
    if projected_path is not None and dim is not None:
        projected_out = np.lib.format.open_memmap(projected_path, mode="w+", dtype=np.float32, shape=(side.rows, dim))
    out_dir.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([("k", pa.int64()), (row_column, pa.int64())])
    stats = {"rows": 0, "invalid": 0, "bucket_rows": 0}
    part = 0
    for start, chunk in side.chunks(chunk_size):
        keys, rows, projected = routing.keys(chunk)
        if projected_out is not None:
            projected_out[start : start + len(chunk)] = projected
        stats["rows"] += len(chunk)
        stats["invalid"] += len(chunk) - len(rows)
        flat = keys.reshape(-1)
        owner = np.repeat(rows.astype(np.int64) + start, keys.shape[1])
        if keep is not None:
            at = np.minimum(np.searchsorted(keep, flat), max(0, len(keep) - 1))
            hit = keep[at] == flat if len(keep) else np.zeros(len(flat), bool)
            flat, owner = flat[hit], owner[hit]
        if len(flat) or part == 0:  # an empty side still gets one (empty) part, so readers find a schema
            pq.write_table(pa.table([flat, owner], schema=schema), out_dir / f"part-{part:05d}.parquet")
            part += 1
        stats["bucket_rows"] += len(flat)
    if projected_out is not None:
        projected_out.flush()
    return stats


def distinct_keys(bucket_dir: Path) -> np.ndarray:
    """Sorted distinct bucket keys of a (test) side's parts: what a crawl bucket must be among to join."""
    found = [
        np.unique(pq.read_table(p, columns=["k"]).column("k").to_numpy()) for p in sorted(bucket_dir.glob("*.parquet"))
    ]
    return np.unique(np.concatenate(found)) if found else np.zeros(0, np.int64)
