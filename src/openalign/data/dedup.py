"""Near-duplicate test-image removal, as in the ALIGN supplement.

Training images that are near-duplicates of evaluation images would inflate every downstream number,
so they are dropped before training. The paper's recipe, which avoids comparing every train image
with every test image:

1. k-means with K clusters (4K in the paper) on the train embeddings;
2. each image's 10 nearest clusters;
3. every 3-cluster combination of those 10 is a bucket, so C(10, 3) = 120 buckets per image;
4. train/test pairs sharing at least one bucket are candidates (a join on the bucket key), which is the
   same as: pairs whose nearest-cluster lists have at least 3 clusters in common;
5. a candidate is a near-duplicate when its embedding cosine exceeds 0.975.

Two images whose cosine exceeds 0.975 are so close that they almost always have at least 3 of their
10 nearest clusters in common, which is why the bucket join loses (almost) nothing against brute force
while comparing a tiny fraction of the pairs.

Engineering choices beyond the paper, each switchable:

- Clusters are learnt and assigned in a PCA projection of the embeddings (``project_dim``, default 64):
  the cluster lists only decide *which* pairs get compared, and projection never increases a distance,
  so near-duplicates stay close. The cosine check always uses the full embeddings.
- Candidates are first screened in that projection: for unit vectors cos > t means |x - y|² < 2(1 - t),
  and a projected distance is never longer than the full one, so a pair failing the bound there cannot
  be a duplicate. The screen is exact (it loses nothing) and reads 64 floats per pair instead of D.
- k-means trains on a sample of at most ``points_per_cluster`` × K train rows, as FAISS does.
- Train rows are processed in chunks, so memory holds one chunk of train vectors, the test set and its
  bucket keys; train embeddings may be a memory-mapped ``.npy`` larger than RAM.
- Rows with NaN/inf values or zero norm cannot be compared; they are skipped and counted.

This module is model-free: arrays in, pairs out, plus the files around them (keys, ``.npy`` embeddings,
metadata tables, result files). Embedding images and the whole run live in ``openalign.pipeline.dedup``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from openalign.config import ConfigError
from openalign.data.sources import Source, decode_records, open_source, table_format

ENGINES = ("duckdb", "sparse", "numpy")  # who joins bucket keys in memory (see _TestBuckets)
# Engines of the files path (openalign.data.dedup_buckets): bucket keys in Parquet, joined out of core.
FILE_ENGINES = ("duckdb", "spark")
TABLE_READERS = {"parquet": "read_parquet", "csv": "read_csv_auto", "jsonl": "read_json_auto"}  # by table_format


@dataclass
class DedupConfig:
    """Settings of the near-duplicate search; the defaults are the paper's where the paper gives one."""

    clusters: int = 4096  # k-means K on the train embeddings (paper: 4K); capped for small inputs
    nearest: int = 10  # nearest clusters per image (paper: 10)
    combo: int = 3  # clusters per bucket key (paper: 3, so C(10, 3) = 120 buckets per image)
    threshold: float = 0.975  # a candidate pair is a near-duplicate when cosine > threshold (paper)
    seed: int = 0  # k-means initialisation and the k-means training sample
    # who joins bucket keys: duckdb, sparse or numpy in memory (see _TestBuckets); with out_of_core (or
    # clip-retrieval embedding folders, or spark) duckdb or spark join bucket-key Parquet files
    engine: Literal["duckdb", "sparse", "numpy", "spark"] = "duckdb"
    project_dim: int = 64  # PCA width for learning/assigning clusters; 0 clusters the full embeddings
    points_per_cluster: int = 32  # k-means trains on at most K × this many train rows (FAISS: 39–256)
    min_points_per_cluster: int = 39  # K is capped at n_train // this (FAISS warns below 39)
    kmeans_iters: int = 8  # the clusters only route pairs to comparisons: rough centroids do
    chunk_size: int = 131_072  # train rows per join chunk: bounds memory at any train size
    out_of_core: bool = False  # write bucket keys to Parquet and join them with duckdb or spark (any crawl size)
    prune_keys: bool = True  # out of core: write only crawl buckets some test image has (test keys in memory)
    memory_limit: str | None = "4GB"  # out of core: DuckDB's memory before it spills to temp_directory
    temp_directory: str | None = None  # out of core: bucket Parquet files and DuckDB spill (default: system temp)
    max_spill: str | None = None  # out of core: most disk DuckDB may spill, e.g. "200GB" (default: 90% of free)
    threads: int | None = None  # out of core: DuckDB threads (default: all cores)
    spark_master: str = "local[*]"  # engine spark: any Spark master URL (local[N], spark://host:7077, yarn, ...)
    spark_conf: dict[str, str] = field(default_factory=dict)  # engine spark: extra spark.* settings

    def validate(self) -> None:
        """Cross-field checks; raises ConfigError naming the bad field."""
        for name in ("clusters", "nearest", "combo", "points_per_cluster", "min_points_per_cluster"):
            if getattr(self, name) < 1:
                raise ConfigError(f"dedup.{name} must be at least 1, got {getattr(self, name)}")
        if self.combo > self.nearest:
            raise ConfigError(f"dedup.combo ({self.combo}) cannot exceed dedup.nearest ({self.nearest})")
        if not -1.0 <= self.threshold < 1.0:
            raise ConfigError(f"dedup.threshold must be in [-1, 1), got {self.threshold}")
        if self.project_dim < 0:
            raise ConfigError(f"dedup.project_dim must be 0 (off) or positive, got {self.project_dim}")
        if self.kmeans_iters < 1 or self.chunk_size < 1:
            raise ConfigError("dedup.kmeans_iters and dedup.chunk_size must be at least 1")
        engines = (*ENGINES, *FILE_ENGINES[1:])
        if self.engine not in engines:
            raise ConfigError(f"dedup.engine: {self.engine!r} is not one of {', '.join(map(repr, engines))}")
        _key_bits(self.clusters, self.combo)


@dataclass
class DedupResult:
    """Near-duplicate pairs (one row per train/test pair: cosine above the threshold, or accepted by verification)
    and run statistics."""

    train_idx: np.ndarray  # int64 [P], row of the train embedding matrix
    test_idx: np.ndarray  # int64 [P], row of the test embedding matrix
    cosine: np.ndarray  # float32 [P]
    stats: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # human-readable remarks (e.g. a capped K)
    # str [P] each: the check that accepted a pair (embedding, aligned, phash or features) and what proposed it
    # (search: the cosine search, votes: local-feature votes); None means embedding and search for every pair
    decided_by: np.ndarray | None = None
    proposed_by: np.ndarray | None = None

    @property
    def drop_indices(self) -> np.ndarray:
        """Sorted unique train rows to remove: every train image that duplicates some test image."""
        return np.unique(self.train_idx)

    def pairs_table(self, train_keys: Sequence[str] | None = None, test_keys: Sequence[str] | None = None) -> pa.Table:
        """The pairs as an Arrow table, with the images' keys when given."""
        n = len(self.train_idx)
        decided = self.decided_by if self.decided_by is not None else np.full(n, "embedding")
        proposed = self.proposed_by if self.proposed_by is not None else np.full(n, "search")
        columns: dict[str, Any] = {"train_idx": self.train_idx, "test_idx": self.test_idx, "cosine": self.cosine}
        columns["decided_by"] = pa.array(decided.tolist(), pa.string())
        columns["proposed_by"] = pa.array(proposed.tolist(), pa.string())
        if train_keys is not None:
            columns["train_key"] = pa.array([train_keys[i] for i in self.train_idx], pa.string())
        if test_keys is not None:
            columns["test_key"] = pa.array([test_keys[i] for i in self.test_idx], pa.string())
        return pa.table(columns)


# --------------------------------------------------------------------------------------------------
# Bucket keys


def _key_bits(n_clusters: int, combo: int) -> int:
    bits = max(1, (n_clusters - 1).bit_length())
    if bits * combo > 63:
        raise ConfigError(
            f"dedup: {combo} cluster ids of {bits} bits do not fit an int64 bucket key; "
            "use fewer clusters or a smaller combo"
        )
    return bits


def bucket_keys(nearest_clusters: np.ndarray, combo: int, n_clusters: int) -> np.ndarray:
    """All ``combo``-cluster combinations of each row's nearest clusters, as int64 keys.

    Row i of the result holds C(nearest, combo) keys; a key packs the sorted cluster ids into fixed
    bit fields, so two images get the same key exactly when they share those clusters.
    """
    labels = np.asarray(nearest_clusters)
    if labels.ndim != 2:
        raise ValueError(f"nearest_clusters must be a 2-d array [n, nearest], got shape {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() >= n_clusters):
        raise ValueError(f"cluster ids must lie in [0, {n_clusters}); got {labels.min()}..{labels.max()}")
    bits = _key_bits(n_clusters, combo)
    ids = np.sort(labels.astype(np.int64), axis=1)
    combos = np.array(list(itertools.combinations(range(labels.shape[1]), combo)), dtype=np.int64)
    keys = np.take(ids, combos[:, -1], axis=1)
    for position in range(combo - 1):
        # Shift the small [n, nearest] array, then gather: cheaper than shifting [n, C(nearest, combo)].
        keys |= np.take(ids << np.int64(bits * (combo - 1 - position)), combos[:, position], axis=1)
    return keys


# --------------------------------------------------------------------------------------------------
# Candidate pairs: the join on bucket keys


class _TestBuckets:
    """The test side of the join, built once: (bucket key, test row) for every test image's buckets.

    ``candidates`` returns the distinct (train row, test row) pairs sharing at least one bucket:
    - duckdb: ``SELECT DISTINCT`` over an equi-join in DuckDB SQL (parallel, spills to disk);
    - sparse: DuckDB joins train keys to the test buckets' numbers, then the sparse product
      (train × bucket) · (bucket × test) expands them into pairs; its non-zeros are exactly the distinct
      pairs, so no hash table of pairs is needed (needs scipy);
    - numpy: binary search of train keys in the sorted test keys, then ``np.unique`` (no extra deps).
    """

    def __init__(self, keys: np.ndarray, rows: np.ndarray, engine: str, n_test: int):
        self.engine = engine
        self.n_test = n_test
        flat = keys.reshape(-1)
        owner = np.repeat(rows.astype(np.int64), keys.shape[1])
        if engine == "duckdb":
            import duckdb

            self.con = duckdb.connect()
            self.con.register("test_buckets", pa.table({"k": flat, "j": owner}))
        elif engine == "sparse":
            try:
                import scipy.sparse
            except ImportError as err:
                raise ImportError("dedup engine 'sparse' needs scipy (pip install scipy)") from err
            import duckdb

            vocab, column = np.unique(flat, return_inverse=True)
            ones = np.ones(len(flat), dtype=np.float32)
            self.by_bucket = scipy.sparse.csr_matrix((ones, (column, owner)), shape=(len(vocab), n_test))
            self.con = duckdb.connect()
            self.con.register("vocab", pa.table({"k": vocab, "c": np.arange(len(vocab), dtype=np.int64)}))
        else:
            order = np.argsort(flat, kind="stable")
            self.sorted_keys, self.sorted_rows = flat[order], owner[order]

    def candidates(self, keys: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Distinct (train row, test row) pairs sharing at least one bucket."""
        if self.engine == "sparse":
            return self._sparse(keys, rows)
        flat = keys.reshape(-1)
        owner = np.repeat(rows.astype(np.int64), keys.shape[1])
        if self.engine == "duckdb":
            self.con.register("train_buckets", pa.table({"k": flat, "i": owner}))
            out = self.con.sql(
                "SELECT DISTINCT t.i AS i, q.j AS j FROM train_buckets t JOIN test_buckets q ON t.k = q.k"
            ).to_arrow_table()
            self.con.unregister("train_buckets")
            return (
                out.column("i").to_numpy().astype(np.int64, copy=False),
                out.column("j").to_numpy().astype(np.int64, copy=False),
            )
        lo = np.searchsorted(self.sorted_keys, flat, side="left")
        hi = np.searchsorted(self.sorted_keys, flat, side="right")
        counts = hi - lo
        hit = counts > 0
        lo, counts, owner = lo[hit], counts[hit], owner[hit]
        # Expand each matching train key into its run of equal test keys without a Python loop.
        starts = np.repeat(lo - (np.cumsum(counts) - counts), counts)
        train_rows = np.repeat(owner, counts)
        test_rows = self.sorted_rows[starts + np.arange(counts.sum())]
        codes = np.unique(train_rows * np.int64(self.n_test) + test_rows)
        return codes // self.n_test, codes % self.n_test

    def _sparse(self, keys: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        import scipy.sparse

        # Most train buckets hold no test image; DuckDB's hash join keeps the others, as bucket numbers.
        self.con.register(
            "train_buckets", pa.table({"k": keys.reshape(-1), "r": np.repeat(np.arange(len(rows)), keys.shape[1])})
        )
        hits = self.con.sql("SELECT r, c FROM train_buckets JOIN vocab USING (k)").to_arrow_table()
        self.con.unregister("train_buckets")
        image, bucket = hits.column("r").to_numpy(), hits.column("c").to_numpy()
        order = np.argsort(image, kind="stable")
        indptr = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(np.bincount(image, minlength=len(rows)), out=indptr[1:])
        by_image = scipy.sparse.csr_matrix(
            (np.ones(len(bucket), dtype=np.float32), bucket[order], indptr), shape=(len(rows), self.by_bucket.shape[0])
        )
        product = (by_image @ self.by_bucket).tocsr()
        train_rows = np.repeat(rows.astype(np.int64), np.diff(product.indptr))
        return train_rows, product.indices.astype(np.int64)

    def close(self) -> None:
        if self.engine in ("duckdb", "sparse"):
            self.con.close()


# --------------------------------------------------------------------------------------------------
# Embedding preparation


def _normalised(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unit rows and a mask of usable rows (finite, non-zero); unusable rows come back as zeros."""
    x = np.asarray(x, dtype=np.float32)
    # One NaN or inf makes the squared norm non-finite, so a single pass finds the unusable rows.
    with np.errstate(invalid="ignore", over="ignore"):
        sq = np.einsum("ij,ij->i", x, x)
    ok = np.isfinite(sq) & (sq > 1e-24)
    out = x / np.sqrt(np.where(ok, sq, 1.0))[:, None]
    if not ok.all():
        out[~ok] = 0.0
    return out, ok


class _Projection:
    """PCA to ``dim`` components fitted on the k-means sample; identity when dim is 0 or ≥ width."""

    def __init__(self, sample: np.ndarray, dim: int, max_rows: int = 65_536):
        self.mean: np.ndarray | None = None
        self.basis: np.ndarray | None = None
        self.offset: np.ndarray | None = None
        if 0 < dim < sample.shape[1] and len(sample) > 1:
            # The leading directions need far fewer rows than k-means does.
            sample = sample[:: max(1, len(sample) // max_rows)]
            self.mean = sample.mean(axis=0, dtype=np.float64).astype(np.float32)
            centred = sample - self.mean
            _, vectors = np.linalg.eigh((centred.T @ centred).astype(np.float64))
            self.basis = np.ascontiguousarray(vectors[:, ::-1][:, :dim]).astype(np.float32)
            self.offset = self.mean @ self.basis

    @property
    def lossless_bound(self) -> bool:
        """True when projected distances never exceed full ones (an orthonormal projection)."""
        return self.basis is not None

    @property
    def dim(self) -> int | None:
        return None if self.basis is None else self.basis.shape[1]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.basis is None:
            return np.ascontiguousarray(x, dtype=np.float32)
        out: np.ndarray = x @ self.basis  # (x - mean) @ basis without a centred copy of x
        out -= self.offset
        return out


def _effective_clusters(cfg: DedupConfig, n_train: int, notes: list[str]) -> tuple[int, int, int]:
    k = min(cfg.clusters, max(cfg.nearest, n_train // cfg.min_points_per_cluster), n_train)
    if k < cfg.clusters:
        notes.append(
            f"clusters capped from {cfg.clusters} to {k}: {n_train} train images allow about one cluster "
            f"per {cfg.min_points_per_cluster} images"
        )
    nearest = min(cfg.nearest, k)
    combo = min(cfg.combo, nearest)
    if nearest < cfg.nearest:
        notes.append(
            f"nearest clusters reduced from {cfg.nearest} to {nearest} (only {k} clusters); "
            "with so few clusters every pair is compared"
        )
    return k, nearest, combo


def kmeans_sample(
    n_train: int, take: Callable[[np.ndarray], np.ndarray], config: DedupConfig, notes: list[str]
) -> tuple[np.ndarray, int, int, int, int] | None:
    """The train rows k-means learns from, unit length: ``points_per_cluster`` × K of them drawn with
    ``config.seed`` (``take(rows)`` reads them, in increasing order), invalid ones dropped; with the clusters,
    nearest and combo sizes that sample supports and the number of rows drawn. None (and a note) when no drawn row
    is valid."""
    k, nearest, combo = _effective_clusters(config, n_train, notes)
    rng = np.random.default_rng(config.seed)
    n_fit = min(n_train, k * config.points_per_cluster)
    fit_rows = np.sort(rng.choice(n_train, n_fit, replace=False)) if n_fit < n_train else np.arange(n_train)
    sample, ok = _normalised(take(fit_rows))
    sample = sample[ok]
    if not len(sample):
        notes.append("no valid train rows in the k-means sample (NaN, inf or zero embeddings)")
        return None
    if len(sample) < k:
        k = max(1, len(sample))
        nearest, combo = min(nearest, k), min(combo, k)
        notes.append(f"only {len(sample)} valid rows in the k-means sample; clusters reduced to {k}")
    return sample, k, nearest, combo, n_fit


def _fit_clusters(sample: np.ndarray, k: int, cfg: DedupConfig) -> Any:
    import faiss

    kmeans = faiss.Kmeans(
        sample.shape[1],
        k,
        niter=cfg.kmeans_iters,
        seed=cfg.seed,
        max_points_per_centroid=cfg.points_per_cluster,
        min_points_per_centroid=1,
        verbose=False,
    )
    kmeans.train(sample)
    assert kmeans.centroids is not None  # set by train()
    index = faiss.IndexFlatL2(sample.shape[1])
    index.add(kmeans.centroids)
    return index


def _nearest_clusters(index: Any, x: np.ndarray, nearest: int, block: int = 262_144) -> np.ndarray:
    out = np.empty((len(x), nearest), dtype=np.int64)
    for s in range(0, len(x), block):
        out[s : s + block] = index.search(x[s : s + block], nearest)[1]
    return out


def _pair_dots(a: np.ndarray, a_rows: np.ndarray, b: np.ndarray, b_rows: np.ndarray) -> np.ndarray:
    out = np.empty(len(a_rows), dtype=np.float32)
    block = 32_768  # bounds the two gathered [block, D] matrices
    for s in range(0, len(a_rows), block):
        x = np.take(a, a_rows[s : s + block], axis=0)
        y = np.take(b, b_rows[s : s + block], axis=0)
        out[s : s + block] = np.einsum("ij,ij->i", x, y)
    return out


def _pair_sq_distances(a: np.ndarray, a_rows: np.ndarray, b: np.ndarray, b_rows: np.ndarray) -> np.ndarray:
    out = np.empty(len(a_rows), dtype=np.float32)
    block = 65_536
    for s in range(0, len(a_rows), block):
        diff = np.take(a, a_rows[s : s + block], axis=0) - np.take(b, b_rows[s : s + block], axis=0)
        out[s : s + block] = np.einsum("ij,ij->i", diff, diff)
    return out


# --------------------------------------------------------------------------------------------------
# The search


def find_near_duplicates(
    train_emb: np.ndarray,
    test_emb: np.ndarray,
    *,
    clusters: int = 4096,
    nearest: int = 10,
    combo: int = 3,
    threshold: float = 0.975,
    seed: int = 0,
    engine: Literal["duckdb", "sparse", "numpy"] = "duckdb",
    config: DedupConfig | None = None,
    progress: bool = False,
    **extra: Any,
) -> DedupResult:
    """Train/test image pairs whose embedding cosine exceeds ``threshold``, found through shared buckets.

    ``train_emb`` [N, D] and ``test_emb`` [M, D] need not be normalised (rows are normalised here);
    ``train_emb`` may be a memory-mapped array. ``config`` replaces the keyword settings when given;
    ``extra`` sets the other DedupConfig fields (``project_dim``, ``chunk_size``, ...).
    """
    if config is None:
        try:
            config = DedupConfig(
                clusters=clusters, nearest=nearest, combo=combo, threshold=threshold, seed=seed, engine=engine, **extra
            )
        except TypeError as err:
            raise ConfigError(f"find_near_duplicates: {err}") from err
    config.validate()
    if config.engine not in ENGINES:
        raise ConfigError(f"dedup.engine {config.engine!r} joins bucket files: use openalign.data.dedup_buckets")
    if train_emb.ndim != 2 or test_emb.ndim != 2:
        raise ValueError(f"embeddings must be 2-d [n, dim]; got train {train_emb.shape}, test {test_emb.shape}")
    if train_emb.shape[1] != test_emb.shape[1]:
        raise ValueError(f"train embeddings are {train_emb.shape[1]}-d but test embeddings are {test_emb.shape[1]}-d")
    started = time.perf_counter()
    n_train, n_test = len(train_emb), len(test_emb)
    notes: list[str] = []
    timings: dict[str, float] = {}
    test, test_ok = _normalised(test_emb)
    stats: dict[str, Any] = {
        "train_n": n_train,
        "test_n": n_test,
        "dim": int(train_emb.shape[1]),
        "threshold": config.threshold,
        "engine": config.engine,
        "train_skipped_invalid": 0,
        "test_skipped_invalid": int((~test_ok).sum()),
    }
    empty = DedupResult(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32), stats, notes)
    if n_train == 0 or not test_ok.any():
        stats.update(clusters=0, candidate_pairs=0, duplicate_pairs=0, train_rows_removed=0, test_images_matched=0)
        notes.append("nothing to compare: the train or the (valid) test set is empty")
        return empty

    # k-means sample: the paper clusters "all training images"; a sample of K × points_per_cluster
    # rows gives the same centroids for a fraction of the time.
    drawn = kmeans_sample(n_train, lambda rows: train_emb[rows], config, notes)
    if drawn is None:
        stats.update(clusters=0, candidate_pairs=0, duplicate_pairs=0, train_rows_removed=0, test_images_matched=0)
        return empty
    sample, k, n_nearest, n_combo, n_fit = drawn
    t = time.perf_counter()
    projection = _Projection(sample, config.project_dim)
    index = _fit_clusters(projection(sample), k, config)
    timings["kmeans_s"] = time.perf_counter() - t
    del sample

    t = time.perf_counter()
    test_rows = np.flatnonzero(test_ok)
    test_proj = projection(test)
    test_keys = bucket_keys(_nearest_clusters(index, test_proj[test_rows], n_nearest), n_combo, k)
    buckets = _TestBuckets(test_keys, test_rows, config.engine, n_test)
    del test_keys
    timings["test_assign_s"] = time.perf_counter() - t

    pairs_i: list[np.ndarray] = []
    pairs_j: list[np.ndarray] = []
    pairs_c: list[np.ndarray] = []
    n_candidates = n_prefiltered = 0
    train_invalid = 0
    max_sq_distance = np.float32(2.0 * (1.0 - config.threshold) * (1 + 1e-4) + 1e-5)
    timings.update(train_assign_s=0.0, join_s=0.0, cosine_s=0.0)
    try:
        with tqdm(total=n_train, unit="img", desc="dedup train", disable=not progress) as bar:
            for start in range(0, n_train, config.chunk_size):
                t = time.perf_counter()
                chunk, ok = _normalised(train_emb[start : start + config.chunk_size])
                train_invalid += int((~ok).sum())
                rows = np.flatnonzero(ok)
                chunk_proj = projection(chunk)
                keys = bucket_keys(_nearest_clusters(index, chunk_proj[rows], n_nearest), n_combo, k)
                timings["train_assign_s"] += time.perf_counter() - t
                t = time.perf_counter()
                local, j = buckets.candidates(keys, rows)
                del keys
                timings["join_s"] += time.perf_counter() - t
                t = time.perf_counter()
                n_candidates += len(local)
                if projection.lossless_bound:
                    # cos > t means |x - y|² < 2(1 - t) for unit rows, and an orthonormal projection only
                    # shrinks distances: pairs failing this in the narrow space cannot be duplicates.
                    near = _pair_sq_distances(chunk_proj, local, test_proj, j) < max_sq_distance
                    local, j = local[near], j[near]
                n_prefiltered += len(local)
                cos = _pair_dots(chunk, local, test, j)
                hit = cos > config.threshold
                pairs_i.append(local[hit] + start)
                pairs_j.append(j[hit])
                pairs_c.append(cos[hit])
                timings["cosine_s"] += time.perf_counter() - t
                bar.update(len(chunk))
    finally:
        buckets.close()

    train_idx, test_idx, cosine = np.concatenate(pairs_i), np.concatenate(pairs_j), np.concatenate(pairs_c)
    order = np.lexsort((test_idx, train_idx))
    train_idx, test_idx, cosine = train_idx[order], test_idx[order], cosine[order]
    stats.update(
        train_skipped_invalid=train_invalid,
        clusters=k,
        clusters_requested=config.clusters,
        nearest=n_nearest,
        combo=n_combo,
        buckets_per_image=math.comb(n_nearest, n_combo),
        project_dim=projection.dim,
        kmeans_sample=n_fit,
        candidate_pairs=n_candidates,
        candidate_fraction=n_candidates / max(1, n_train * n_test),
        full_cosines_computed=n_prefiltered,
        duplicate_pairs=len(train_idx),
        train_rows_removed=len(np.unique(train_idx)),
        test_images_matched=len(np.unique(test_idx)),
        seconds={name: round(v, 3) for name, v in {**timings, "total_s": time.perf_counter() - started}.items()},
    )
    return DedupResult(train_idx, test_idx, cosine, stats, notes)


# --------------------------------------------------------------------------------------------------
# Inputs and outputs: keys, .npy embeddings, images of a source, metadata tables, result files


def load_keys(path: str | Path, expected: int | None = None) -> list[str]:
    """Image keys from a text file (one per line), a JSON list, or a Parquet/CSV file with a ``key`` column."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no such keys file")
    keys: list[str]
    if p.suffix == ".json":
        from openalign.data.sources import read_annotation_json

        listed = read_annotation_json(p)
        if not isinstance(listed, list):
            raise ValueError(f"{path}: expected a JSON list of keys")
        keys = [str(k) for k in listed]
    elif p.suffix in (".parquet", ".csv"):
        import duckdb

        reader = "read_parquet" if p.suffix == ".parquet" else "read_csv_auto"
        con = duckdb.connect()
        columns = [r[0] for r in con.execute(f"DESCRIBE SELECT * FROM {reader}(?)", [str(p)]).fetchall()]
        if "key" not in columns:
            raise ValueError(f"{path}: no 'key' column (columns: {', '.join(columns)})")
        rows = con.execute(f"SELECT CAST(key AS VARCHAR) FROM {reader}(?)", [str(p)]).fetchall()
        keys = [str(r[0]) for r in rows]
    else:
        from openalign.data.sources import read_annotation_text

        keys = read_annotation_text(p).splitlines()
    if expected is not None and len(keys) != expected:
        raise ValueError(f"{path}: {len(keys)} keys for {expected} embeddings")
    return keys


def load_embeddings(path: str | Path) -> np.ndarray:
    """A 2-d ``.npy`` float matrix, memory-mapped so that a train set larger than RAM still works."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no such embeddings file")
    try:
        arr: np.ndarray = np.load(p, mmap_mode="r", allow_pickle=False)
    except ValueError as err:
        raise ValueError(f"{path}: not a numeric .npy array ({err})") from err
    if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"{path}: expected a 2-d float array [n, dim], got {arr.dtype} {arr.shape}")
    return arr


def iter_source_images(
    source: str | os.PathLike[str] | Source, on_skip: Callable[[str, str], None]
) -> Iterator[tuple[str, Any]]:
    """(key, RGB image) from any input ``openalign.data.sources.open_source`` reads (or a source it opened): an
    image folder (key = relative path without suffix), a table, or WebDataset shards (key = the sample key).

    Undecodable images, non-image files and unreadable shards are passed to ``on_skip(reason, detail)`` and
    skipped.
    """
    opened = source if isinstance(source, Source) else open_source(source)
    for record, image in decode_records(opened.records(on_skip), on_skip):
        yield (Path(record.key).with_suffix("").as_posix() if record.kind == "folder" else record.key), image


def _count(con: Any, query: str) -> int:
    row = con.execute(query).fetchone()
    return int(row[0]) if row is not None else 0


def _sql_string(path: str | Path) -> str:
    return "'" + str(path).replace("'", "''") + "'"


def remove_from_table(
    table_path: str | Path,
    out_path: str | Path,
    *,
    drop_keys: Sequence[str] | None = None,
    drop_rows: np.ndarray | None = None,
    key_column: str = "key",
    expected_rows: int | None = None,
) -> dict[str, int]:
    """Write ``table_path`` (Parquet / CSV / JSONL metadata) minus the dropped images, as Parquet.

    Rows are matched by ``key_column`` when ``drop_keys`` is given, otherwise by row position (row i of
    the table is row i of the train embeddings). Returns rows in / removed / out.
    """
    import duckdb

    p = Path(table_path)
    if not p.is_file():
        raise FileNotFoundError(f"{table_path}: no such metadata table")
    fmt = table_format(p)
    if fmt is None:
        raise ValueError(f"{table_path}: unsupported table format {p.suffix.lower()!r} (use .parquet, .csv or .jsonl)")
    con = duckdb.connect()
    try:
        source = f"{TABLE_READERS[fmt]}({_sql_string(p)})"
        con.execute(f"CREATE VIEW meta AS SELECT *, row_number() OVER () - 1 AS __row FROM {source}")
        columns = [r[0] for r in con.execute("DESCRIBE meta").fetchall()]
        if drop_keys is not None:
            if key_column not in columns:
                raise ValueError(f"{table_path}: no {key_column!r} column (columns: {', '.join(columns[:-1])})")
            con.register("dropped", pa.table({"k": pa.array(list(drop_keys), pa.string())}))
            condition = f'CAST("{key_column}" AS VARCHAR) NOT IN (SELECT k FROM dropped)'
        else:
            rows = np.asarray(drop_rows if drop_rows is not None else [], dtype=np.int64)
            con.register("dropped", pa.table({"r": rows}))
            condition = "__row NOT IN (SELECT r FROM dropped)"
        rows_in = _count(con, "SELECT count(*) FROM meta")
        if drop_keys is None and expected_rows is not None and rows_in != expected_rows:
            raise ValueError(
                f"{table_path}: {rows_in} rows but {expected_rows} train embeddings; without train keys the "
                "table must be row-aligned with the embeddings (or pass a keys file)"
            )
        keep = ", ".join(f'"{c}"' for c in columns if c != "__row")
        out = Path(out_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        query = f"SELECT {keep} FROM meta WHERE {condition} ORDER BY __row"
        con.execute(f"COPY ({query}) TO {_sql_string(out)} (FORMAT parquet)")
        rows_out = _count(con, f"SELECT count(*) FROM read_parquet({_sql_string(out)})")
    finally:
        con.close()
    return {"rows_in": rows_in, "rows_removed": rows_in - rows_out, "rows_out": rows_out}


def write_outputs(
    result: DedupResult,
    out_dir: str | Path,
    *,
    train_keys: Sequence[str] | None = None,
    test_keys: Sequence[str] | None = None,
) -> dict[str, Path]:
    """``duplicates.parquet`` and ``duplicates.csv`` (every pair), ``drop.parquet`` + ``drop.json`` (train rows
    to remove) and ``stats.json`` in ``out_dir``."""
    import pyarrow.csv as pa_csv
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [("pairs", "duplicates.parquet"), ("pairs_csv", "duplicates.csv"), ("drop", "drop.parquet")]
    paths = {name: out / f for name, f in names}
    pairs = result.pairs_table(train_keys, test_keys)
    pq.write_table(pairs, paths["pairs"])
    pa_csv.write_csv(pairs, paths["pairs_csv"])
    drop = result.drop_indices
    drop_cols: dict[str, Any] = {"train_idx": drop}
    if train_keys is not None:
        drop_cols["key"] = pa.array([train_keys[i] for i in drop], pa.string())
    pq.write_table(pa.table(drop_cols), paths["drop"])
    paths["drop_json"] = out / "drop.json"
    listing = [train_keys[i] for i in drop] if train_keys is not None else drop.tolist()
    paths["drop_json"].write_text(json.dumps(listing) + "\n")
    paths["stats"] = out / "stats.json"
    paths["stats"].write_text(json.dumps({**result.stats, "notes": result.notes}, indent=2) + "\n")
    return paths
