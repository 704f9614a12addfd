"""``openalign bench dedup``: the bucketed near-duplicate search against exact brute force, in one run.

The data are synthetic embeddings shaped like real ones: a decaying spectrum (a few directions carry
most of the variance), topics (groups of similar images) and planted duplicates of train images in
the test set (augmented copies: noise added, re-normalised), plus near misses just under the threshold.
Brute force (every test × train cosine by blocked matrix products) is timed on a train subsample and
scaled linearly, which is exact for its cost; it also gives the ground truth for the recall of our
pipeline on that subsample. The subsample holds the train rows of every planted duplicate besides
random rows, so the recall is measured on the pairs that matter.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from openalign.data.dedup import DedupConfig, find_near_duplicates


@dataclass
class DedupBenchSettings:
    """What ``openalign bench dedup`` measures."""

    train: int = 1_000_000  # train embeddings
    test: int = 50_000  # test embeddings
    dim: int = 640  # embedding width
    duplicate_fraction: float = 0.05  # of test images, copies of a train image with cosine 0.98–0.995
    near_miss_fraction: float = 0.05  # of test images, copies with cosine 0.93–0.97 (must not match)
    brute_train: int = 32_768  # train rows brute force runs on (then scaled)
    seed: int = 0  # data seed, and the k-means seed unless dedup.seed is given
    json_path: str | None = None  # also write the results to this JSON file
    # write the vectors as clip-retrieval embedding folders and run the out-of-core engine (dedup.engine duckdb
    # or spark) on them in a fresh process, reporting its peak resident size
    files: bool = False
    shard_rows: int = 1_000_000  # files: rows per img_emb_N.npy shard
    work_dir: str | None = None  # files: where the folders and work files go (default: the system temp dir)
    # files: the search process's memory limit in GiB (RLIMIT_DATA: its heap and anonymous maps, which is all of
    # its memory but the embedding files it reads), so that going past it fails the run; 0 sets none
    process_memory_gb: float = 0.0
    dedup: DedupConfig | None = None  # the search's settings (default: DedupConfig's)


def _unit(x: np.ndarray) -> np.ndarray:
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def _noisy_copies(source: np.ndarray, cosine: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Unit vectors at (about) the given cosine from unit ``source`` rows: isotropic noise, re-normalised."""
    noise = rng.standard_normal(source.shape, dtype=np.float32)
    noise -= (noise * source).sum(1, keepdims=True) * source  # orthogonal to the source: exact angle
    noise = _unit(noise)
    tangent = np.sqrt(1.0 - cosine**2)[:, None].astype(np.float32)
    return _unit(source * cosine[:, None].astype(np.float32) + noise * tangent)


def synthetic_embeddings(
    n_train: int,
    n_test: int,
    dim: int,
    *,
    duplicate_fraction: float = 0.05,
    near_miss_fraction: float = 0.05,
    topic_size: int = 200,
    seed: int = 0,
    block: int = 65_536,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train [N, D], test [M, D], duplicate_src [M], near_miss_src [M]) unit float32 embeddings.

    ``duplicate_src[j]`` is the train row test row j copies with cosine 0.98–0.995 (-1 for none);
    ``near_miss_src[j]`` likewise for copies at 0.93–0.97, which a 0.975 threshold must reject.
    """
    rng = np.random.default_rng(seed)
    # Variance of direction k falls like 1/(k + 10): the top 10 % of directions carry about half of it.
    scale = (1.0 / np.sqrt(np.arange(dim) + 10.0)).astype(np.float32)
    n_topics = max(1, n_train // topic_size)
    centres = rng.standard_normal((n_topics, dim), dtype=np.float32) * scale

    def draw(n: int) -> np.ndarray:
        out = np.empty((n, dim), dtype=np.float32)
        for s in range(0, n, block):
            m = min(block, n - s)
            x = rng.standard_normal((m, dim), dtype=np.float32) * (0.8 * scale)
            x += centres[rng.integers(0, n_topics, m)]
            out[s : s + m] = _unit(x)
        return out

    train, test = draw(n_train), draw(n_test)
    n_dup = round(n_test * duplicate_fraction)
    n_miss = round(n_test * near_miss_fraction)
    if n_dup + n_miss > n_test:
        raise ValueError("duplicate_fraction + near_miss_fraction must not exceed 1")
    sources = rng.choice(n_train, n_dup + n_miss, replace=False)
    rows = rng.permutation(n_test)[: n_dup + n_miss]
    cosine = np.concatenate([rng.uniform(0.98, 0.995, n_dup), rng.uniform(0.93, 0.97, n_miss)])
    test[rows] = _noisy_copies(train[sources], cosine, rng)
    duplicate_src = np.full(n_test, -1, dtype=np.int64)
    near_miss_src = np.full(n_test, -1, dtype=np.int64)
    duplicate_src[rows[:n_dup]] = sources[:n_dup]
    near_miss_src[rows[n_dup:]] = sources[n_dup:]
    return train, test, duplicate_src, near_miss_src


def brute_force_pairs(
    train: np.ndarray, test: np.ndarray, threshold: float, *, train_block: int = 16_384, test_block: int = 8_192
) -> tuple[np.ndarray, np.ndarray]:
    """Every (train row, test row) with cosine > threshold, by blocked exact matrix products."""
    found_i: list[np.ndarray] = []
    found_j: list[np.ndarray] = []
    q = torch.from_numpy(np.ascontiguousarray(test, dtype=np.float32))
    for s in range(0, len(train), train_block):
        t = torch.from_numpy(np.ascontiguousarray(train[s : s + train_block], dtype=np.float32))
        for u in range(0, len(q), test_block):
            hits = torch.nonzero(t @ q[u : u + test_block].T > threshold)
            found_i.append(hits[:, 0].numpy() + s)
            found_j.append(hits[:, 1].numpy() + u)
    if not found_i:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(found_i).astype(np.int64), np.concatenate(found_j).astype(np.int64)


def _pair_set(i: np.ndarray, j: np.ndarray) -> set[tuple[int, int]]:
    return set(zip(i.tolist(), j.tolist(), strict=True))


def run_dedup_bench(settings: DedupBenchSettings) -> dict[str, Any]:
    """Run both contenders and print our time, brute force's (scaled), the ratio and the recall.

    Unless OMP_WAIT_POLICY is set, the bench runs in a fresh process with it set to PASSIVE: on a
    shared machine, OpenMP threads that spin while waiting steal the cores they wait for (FAISS, its
    OpenBLAS and PyTorch each run an OpenMP pool). It applies to both contenders alike.
    """
    if settings.files:  # generates here; the search runs in its own process (see bench/dedup_files.py)
        cfg = settings.dedup or DedupConfig()
        from openalign.bench.dedup_files import run_files_bench

        print(
            f"dedup bench (files): {settings.train:,} train × {settings.test:,} test, {settings.dim}-d, "
            f"K={cfg.clusters}, nearest {cfg.nearest}, combo {cfg.combo}, cosine > {cfg.threshold}",
            flush=True,
        )
        report = run_files_bench(settings, cfg)
        report["settings"] = {k: v for k, v in asdict(settings).items() if k != "dedup"}
        if settings.json_path:
            with open(settings.json_path, "w") as f:
                json.dump(report, f, indent=2, default=float)
        return report
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        try:
            with mp.get_context("spawn").Pool(1) as pool:
                return pool.apply(run_dedup_bench, (settings,))
        finally:
            del os.environ["OMP_WAIT_POLICY"]
    cfg = settings.dedup or DedupConfig()
    print(
        f"dedup bench: {settings.train:,} train × {settings.test:,} test, {settings.dim}-d, "
        f"K={cfg.clusters}, nearest {cfg.nearest}, combo {cfg.combo}, cosine > {cfg.threshold}, "
        f"engine {cfg.engine}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}",
        flush=True,
    )
    t = time.perf_counter()
    train, test, dup_src, miss_src = synthetic_embeddings(
        settings.train,
        settings.test,
        settings.dim,
        duplicate_fraction=settings.duplicate_fraction,
        near_miss_fraction=settings.near_miss_fraction,
        seed=settings.seed,
    )
    print(f"  data generated in {time.perf_counter() - t:.1f} s (not timed)", flush=True)

    t = time.perf_counter()
    result = find_near_duplicates(train, test, config=cfg, progress=True)
    ours_s = time.perf_counter() - t
    parts = ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in result.stats["seconds"].items() if k != "total_s")
    print(
        f"  ours:        {ours_s:8.1f} s  ({parts}); {result.stats['candidate_pairs']:,} candidate pairs "
        f"({100 * result.stats['candidate_fraction']:.3f} % of all), {result.stats['duplicate_pairs']:,} duplicates",
        flush=True,
    )

    # Brute force on the planted rows' sources plus random rows, timed and scaled to the full train set.
    rng = np.random.default_rng(settings.seed + 1)
    planted = np.unique(np.concatenate([dup_src[dup_src >= 0], miss_src[miss_src >= 0]]))
    budget = max(settings.brute_train, len(planted))
    others = np.setdiff1d(rng.choice(settings.train, min(settings.train, budget), replace=False), planted)
    subset = np.sort(np.concatenate([planted, others[: budget - len(planted)]]))
    sub_train = np.ascontiguousarray(train[subset])
    t = time.perf_counter()
    bi, bj = brute_force_pairs(sub_train, test, cfg.threshold)
    brute_sub_s = time.perf_counter() - t
    brute_s = brute_sub_s * settings.train / len(subset)
    print(
        f"  brute force: {brute_s:8.1f} s  (scaled from {len(subset):,} train rows in {brute_sub_s:.1f} s)",
        flush=True,
    )

    truth = _pair_set(subset[bi], bj)
    in_subset = np.isin(result.train_idx, subset)
    ours_sub = _pair_set(result.train_idx[in_subset], result.test_idx[in_subset])
    recall = len(truth & ours_sub) / len(truth) if truth else 1.0
    false_pos = len(ours_sub - truth)
    planted_rows = np.flatnonzero(dup_src >= 0)
    found = _pair_set(result.train_idx, result.test_idx)
    planted_found = sum((int(dup_src[j]), int(j)) in found for j in planted_rows)
    misses_matched = sum((int(miss_src[j]), int(j)) in found for j in np.flatnonzero(miss_src >= 0))
    speedup = brute_s / ours_s
    print(f"  speed-up:    {speedup:8.1f}×  (brute force / ours)")
    print(
        f"  recall vs brute force: {recall:.4f} ({len(truth & ours_sub):,}/{len(truth):,} pairs on the subsample), "
        f"{false_pos} pairs brute force rejects"
    )
    print(
        f"  planted duplicates found: {planted_found:,}/{len(planted_rows):,}; "
        f"near misses (cosine 0.93–0.97) wrongly matched: {misses_matched}"
    )
    report = {
        "settings": {k: v for k, v in asdict(settings).items() if k != "dedup"},
        "dedup_config": asdict(cfg),
        "ours_s": ours_s,
        "brute_force_s": brute_s,
        "brute_force_subsample": len(subset),
        "brute_force_subsample_s": brute_sub_s,
        "speedup": speedup,
        "recall_vs_brute_force": recall,
        "false_positives_vs_brute_force": false_pos,
        "planted_found": planted_found,
        "planted": len(planted_rows),
        "near_misses_matched": misses_matched,
        "stats": result.stats,
    }
    if settings.json_path:
        with open(settings.json_path, "w") as f:
            json.dump(report, f, indent=2, default=float)
    return report
