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

import contextlib
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

KEY_BLOCK = 16_384  # rows whose bucket keys are expanded at a time


@dataclass
class Routing:
    """What sends a row to its buckets: the projection, the centroids' index and the bucket shape."""

    projection: _Projection
    index: Any  # faiss.IndexFlatL2 over the centroids
    clusters: int
    nearest: int
    combo: int
    sample_rows: int

    def labels(self, chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(nearest centroids [n_valid, nearest], valid row positions, projected rows [n, d]) of raw rows."""
        unit, ok = _normalised(chunk)
        rows = np.flatnonzero(ok)
        projected = self.projection(unit)
        return _nearest_clusters(self.index, projected[rows], self.nearest), rows, projected

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
    keep: KeySet | None = None,
    projected_path: Path | None = None,
) -> dict[str, int]:
    """One Parquet part per chunk in ``out_dir``: (k bucket key, ``row_column`` global row) for every valid row.

    With ``keep``, only buckets among its keys are written. With ``projected_path`` (and
    a PCA projection) every row's projection is written there as one ``.npy``, for the cosine check's
    exact screen. Returns rows, rows skipped as invalid (NaN, inf, zero) and bucket rows written.
    """
    dim = routing.projection.dim
    out_dir.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([("k", pa.int64()), (row_column, pa.int64())])
    stats = {"rows": 0, "invalid": 0, "bucket_rows": 0}
    part = 0
    with contextlib.ExitStack() as stack:
        projected_out = None
        if projected_path is not None and dim is not None:
            # Appended chunk by chunk with plain writes: pages written through a memory map would stay in the
            # process's resident set (2.5 GB of projection at 10 M rows).
            projected_out = stack.enter_context(open(projected_path, "wb"))
            header = {"descr": "<f4", "fortran_order": False, "shape": (side.rows, dim)}
            np.lib.format.write_array_header_1_0(projected_out, header)
        for start, chunk in side.chunks(chunk_size):
            labels, rows, projected = routing.labels(chunk)
            if projected_out is not None:
                projected_out.write(np.ascontiguousarray(projected, dtype="<f4").tobytes())
            stats["rows"] += len(chunk)
            stats["invalid"] += len(chunk) - len(rows)
            kept_keys, kept_rows = [], []
            # C(nearest, combo) keys a row: expanded a block of rows at a time, so the chunk's memory is its rows.
            for s in range(0, len(rows), KEY_BLOCK):
                keys = bucket_keys(labels[s : s + KEY_BLOCK], routing.combo, routing.clusters)
                owner = np.repeat(rows[s : s + KEY_BLOCK].astype(np.int64) + start, keys.shape[1])
                flat = keys.reshape(-1)
                if keep is not None:
                    hit = keep.contains(flat)
                    flat, owner = flat[hit], owner[hit]
                kept_keys.append(flat)
                kept_rows.append(owner)
            flat = np.concatenate(kept_keys) if kept_keys else np.zeros(0, np.int64)
            owner = np.concatenate(kept_rows) if kept_rows else np.zeros(0, np.int64)
            if len(flat) or part == 0:  # an empty side still gets one (empty) part, so readers find a schema
                pq.write_table(pa.table([flat, owner], schema=schema), out_dir / f"part-{part:05d}.parquet")
                part += 1
            stats["bucket_rows"] += len(flat)
    return stats


class KeySet:
    """A fixed set of int64 bucket keys and a fast membership test for many keys at once.

    A crawl chunk asks about 120 keys a row, so binary search of each in the test side's sorted keys would be
    much of the bucket stage's time. A bit filter on a multiplicative hash of the key (about 64 bits per key, so ~1.5 %
    of absent keys pass) answers most of them with one lookup; only those that pass are binary-searched.
    """

    MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the high bits of key × 2^64/φ

    def __init__(self, keys: np.ndarray):
        self.keys = np.unique(np.asarray(keys, dtype=np.int64))
        bits = int(np.clip(np.ceil(np.log2(max(1, len(self.keys)) * 64)), 6, 32))
        self.shift = np.uint64(64 - bits)
        self.bits = np.zeros(1 << (bits - 3), np.uint8)
        h = self._hash(self.keys)
        np.bitwise_or.at(self.bits, h >> np.uint64(3), np.left_shift(1, h & np.uint64(7)).astype(np.uint8))

    def __len__(self) -> int:
        return len(self.keys)

    def _hash(self, keys: np.ndarray) -> np.ndarray:
        hashed: np.ndarray = (keys.view(np.uint64) * self.MULTIPLIER) >> self.shift
        return hashed

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """Boolean mask: which of ``keys`` (int64, any shape flattened) are in the set."""
        keys = np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)
        h = self._hash(keys)
        maybe = np.flatnonzero((self.bits[h >> np.uint64(3)] >> (h & np.uint64(7)).astype(np.uint8)) & 1)
        out = np.zeros(len(keys), bool)
        if len(maybe) and len(self.keys):
            asked = keys[maybe]
            at = np.minimum(np.searchsorted(self.keys, asked), len(self.keys) - 1)
            out[maybe[self.keys[at] == asked]] = True
        return out


def distinct_keys(bucket_dir: Path) -> KeySet:
    """The distinct bucket keys of a (test) side's parts: what a crawl bucket must be among to join."""
    found = [
        np.unique(pq.read_table(p, columns=["k"]).column("k").to_numpy()) for p in sorted(bucket_dir.glob("*.parquet"))
    ]
    return KeySet(np.concatenate(found) if found else np.zeros(0, np.int64))
