"""``openalign bench dedup``: the bucketed near-duplicate search against exact brute force, in one run.

The data are synthetic embeddings shaped like real ones (``bench/planted_copies.py``): a decaying spectrum (a
few directions carry most of the variance), topics (groups of similar images) and planted duplicates of train
images in the test set (augmented copies: noise added, re-normalised), plus near misses just under the threshold.
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
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from openalign.bench.dedup_settings import DedupBenchSettings
from openalign.bench.planted_copies import brute_force_pairs, pair_set, synthetic_embeddings
from openalign.data.dedup import DedupConfig, find_near_duplicates


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

    truth = pair_set(subset[bi], bj)
    in_subset = np.isin(result.train_idx, subset)
    ours_sub = pair_set(result.train_idx[in_subset], result.test_idx[in_subset])
    recall = len(truth & ours_sub) / len(truth) if truth else 1.0
    false_pos = len(ours_sub - truth)
    planted_rows = np.flatnonzero(dup_src >= 0)
    found = pair_set(result.train_idx, result.test_idx)
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
