"""``openalign bench dedup --files``: the bucket rule out of core, on embedding folders larger than memory.

The synthetic embeddings of ``bench/planted_copies.py`` (topics, a decaying spectrum, planted duplicates and
near misses) are written shard by shard as clip-retrieval inference folders (``img_emb/img_emb_N.npy`` through
a memory map, ``metadata/metadata_N.parquet`` with keys), so generating them never holds the crawl in
memory. The search runs in a fresh process (``find_pairs_in_files``: DuckDB within ``memory_limit`` by
default), whose time and peak resident size are reported; brute force runs on a subsample (the planted
rows' sources plus random rows) read back from the files, as in the in-memory bench.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from openalign.bench import own_peak_rss
from openalign.bench.dedup_settings import DedupBenchSettings
from openalign.bench.planted_copies import brute_force_pairs, noisy_copies, pair_set, unit_rows
from openalign.data.dedup import DedupConfig
from openalign.data.dedup_buckets import EmbeddingFiles, find_pairs_in_files


def _write_folder(root: Path, parts: list[tuple[int, int]], dim: int, prefix: str) -> tuple[list[Path], list[Path]]:
    (root / "img_emb").mkdir(parents=True, exist_ok=True)
    (root / "metadata").mkdir(parents=True, exist_ok=True)
    paths, tables = [], []
    for n, (start, rows) in enumerate(parts):
        path = root / "img_emb" / f"img_emb_{n}.npy"
        np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, dim)).flush()
        keys = pa.array([f"{prefix}{i}" for i in range(start, start + rows)], pa.string())
        tables.append(root / "metadata" / f"metadata_{n}.parquet")
        pq.write_table(pa.table({"key": keys}), tables[-1])
        paths.append(path)
    return paths, tables


def write_synthetic_folders(
    root: Path, settings: DedupBenchSettings, shard_rows: int, topic_size: int = 200, block: int = 65_536
) -> tuple[EmbeddingFiles, EmbeddingFiles, np.ndarray, np.ndarray]:
    """(crawl folder, test folder, duplicate_src, near_miss_src), the same model as ``synthetic_embeddings``."""
    rng = np.random.default_rng(settings.seed)
    n, m, dim = settings.train, settings.test, settings.dim
    scale = (1.0 / np.sqrt(np.arange(dim) + 10.0)).astype(np.float32)
    n_topics = max(1, n // topic_size)
    centres = rng.standard_normal((n_topics, dim), dtype=np.float32) * scale

    def draw(rows: int) -> np.ndarray:
        x = rng.standard_normal((rows, dim), dtype=np.float32) * (0.8 * scale)
        x += centres[rng.integers(0, n_topics, rows)]
        return unit_rows(x)

    parts = [(s, min(shard_rows, n - s)) for s in range(0, n, shard_rows)]
    crawl_paths, crawl_tables = _write_folder(root / "crawl", parts, dim, "c")
    for (_, rows), path in zip(parts, crawl_paths, strict=True):
        out = np.load(path, mmap_mode="r+")
        for s in range(0, rows, block):
            out[s : s + block] = draw(min(block, rows - s))
        out.flush()
        del out
    crawl = EmbeddingFiles(tuple(crawl_paths), tuple(crawl_tables))
    test = np.concatenate([draw(min(block, m - s)) for s in range(0, m, block)])
    n_dup, n_miss = round(m * settings.duplicate_fraction), round(m * settings.near_miss_fraction)
    sources = rng.choice(n, n_dup + n_miss, replace=False)
    picked = rng.permutation(m)[: n_dup + n_miss]
    cosine = np.concatenate([rng.uniform(0.98, 0.995, n_dup), rng.uniform(0.93, 0.97, n_miss)])
    test[picked] = noisy_copies(crawl.open().take(sources), cosine, rng)
    duplicate_src = np.full(m, -1, dtype=np.int64)
    near_miss_src = np.full(m, -1, dtype=np.int64)
    duplicate_src[picked[:n_dup]] = sources[:n_dup]
    near_miss_src[picked[n_dup:]] = sources[n_dup:]
    test_paths, test_tables = _write_folder(root / "test", [(0, m)], dim, "t")
    np.save(test_paths[0], test)
    test_files = EmbeddingFiles(tuple(test_paths), tuple(test_tables))
    return crawl, test_files, duplicate_src, near_miss_src


def _limit_memory(gib: float) -> None:
    """RLIMIT_DATA of this process: malloc and anonymous maps past it fail (file-backed maps are not counted,
    so the limit is the process's own memory, not the embedding files it maps)."""
    if gib > 0:
        limit = int(gib * 2**30)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def _search(crawl: EmbeddingFiles, test: EmbeddingFiles, cfg: DedupConfig, work: str) -> dict[str, Any]:
    """In a fresh process: the search, its wall time and this process's peak resident size."""
    t = time.perf_counter()
    result, _, _ = find_pairs_in_files(crawl, test, cfg, work)
    seconds = time.perf_counter() - t
    peak_mb = own_peak_rss() / 2**20
    return {
        "seconds": seconds,
        "peak_rss_mb": peak_mb,
        "i": result.train_idx,
        "j": result.test_idx,
        "stats": result.stats,
    }


def run_files_bench(settings: DedupBenchSettings, cfg: DedupConfig) -> dict[str, Any]:
    """Write the folders, run the out-of-core search in a child process, compare with brute force."""
    engine = cfg.engine if cfg.engine in ("duckdb", "spark") else "duckdb"
    cfg = DedupConfig(**{**asdict(cfg), "engine": engine})
    root = Path(tempfile.mkdtemp(prefix="openalign-bench-dedup-", dir=settings.work_dir))
    try:
        t = time.perf_counter()
        crawl, test, dup_src, miss_src = write_synthetic_folders(root, settings, settings.shard_rows)
        on_disk = sum(p.stat().st_size for p in crawl.files) / 2**30
        print(f"  folders written in {time.perf_counter() - t:.1f} s ({on_disk:.1f} GiB of crawl .npy, not timed)")
        # A fresh process, so that its peak resident size is the search's alone; passive OpenMP waits as in
        # the in-memory bench (spinning threads steal a shared machine's cores).
        previous = os.environ.get("OMP_WAIT_POLICY")
        os.environ["OMP_WAIT_POLICY"] = previous or "PASSIVE"
        try:
            with mp.get_context("spawn").Pool(1, _limit_memory, (settings.process_memory_gb,)) as pool:
                found = pool.apply(_search, (crawl, test, cfg, str(root / "work")))
        finally:
            if previous is None:
                del os.environ["OMP_WAIT_POLICY"]
        st = found["stats"]
        limit = f", process limit {settings.process_memory_gb:g} GiB" if settings.process_memory_gb > 0 else ""
        print(
            f"  ours ({engine}, DuckDB memory_limit {cfg.memory_limit}{limit}): {found['seconds']:.1f} s, peak RSS "
            f"{found['peak_rss_mb']:.0f} MB; {st['candidate_pairs']:,} candidate pairs, "
            f"{st['duplicate_pairs']:,} duplicates; {st['seconds']}",
            flush=True,
        )
        opened = crawl.open()
        rng = np.random.default_rng(settings.seed + 1)
        planted = np.unique(np.concatenate([dup_src[dup_src >= 0], miss_src[miss_src >= 0]]))
        budget = max(settings.brute_train, len(planted))
        others = np.setdiff1d(rng.choice(settings.train, min(settings.train, budget), replace=False), planted)
        subset = np.sort(np.concatenate([planted, others[: budget - len(planted)]]))
        queries = test.open().take(np.arange(settings.test))
        t = time.perf_counter()
        bi, bj = brute_force_pairs(opened.take(subset), queries, cfg.threshold)
        brute_sub_s = time.perf_counter() - t
        brute_s = brute_sub_s * settings.train / len(subset)
        truth = pair_set(subset[bi], bj)
        i, j = found["i"], found["j"]
        keep = np.isin(i, subset)
        ours_sub = pair_set(i[keep], j[keep])
        recall = len(truth & ours_sub) / len(truth) if truth else 1.0
        all_found = pair_set(i, j)
        planted_rows = np.flatnonzero(dup_src >= 0)
        planted_found = sum((int(dup_src[r]), int(r)) in all_found for r in planted_rows)
        misses = sum((int(miss_src[r]), int(r)) in all_found for r in np.flatnonzero(miss_src >= 0))
        print(
            f"  brute force: {brute_s:.1f} s (scaled from {len(subset):,} train rows in {brute_sub_s:.1f} s); "
            f"ours / brute force {found['seconds'] / brute_s:.3f}"
        )
        print(
            f"  recall vs brute force: {recall:.4f} ({len(truth & ours_sub):,}/{len(truth):,} pairs on the subsample), "
            f"{len(ours_sub - truth)} pairs brute force rejects; planted duplicates found: "
            f"{planted_found:,}/{len(planted_rows):,}; near misses wrongly matched: {misses}"
        )
        return {
            "engine": engine,
            "memory_limit": cfg.memory_limit,
            "process_memory_gb": settings.process_memory_gb,
            "ours_s": found["seconds"],
            "peak_rss_mb": found["peak_rss_mb"],
            "crawl_gib_on_disk": on_disk,
            "brute_force_s": brute_s,
            "brute_force_subsample": len(subset),
            "recall_vs_brute_force": recall,
            "planted_found": planted_found,
            "planted": len(planted_rows),
            "near_misses_matched": misses,
            "stats": st,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
