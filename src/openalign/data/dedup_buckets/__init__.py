"""The supplement's near-duplicate rule at crawl scale: one rule, engines that run its join.

``find_pairs_in_files`` takes each side as embedding files (``EmbeddingFiles``: clip-retrieval's
``img_emb/*.npy`` shards or one ``.npy``) and runs the rule of ``openalign.data.dedup``:

1. k-means centroids on a sample of the crawl (FAISS; in the PCA projection when ``project_dim`` is set);
2. each row's ``nearest`` centroids and its C(nearest, combo) bucket keys, chunk by chunk, to Parquet
   (``stage``);
3. the join on the bucket key, each candidate pair once, and the exact cosine check (``cosine``) on
   ``duckdb`` (out of core, ``memory_limit`` and ``temp_directory``; ``duckdb_join``) or ``spark``
   (any master; ``spark_join``). ``numpy`` (and ``sparse``) run the in-memory search of
   ``openalign.data.dedup`` on the concatenated files, the small-data engine of the same rule.

All engines draw the same k-means sample and compute the same keys and cosines, so they find the same pairs.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from openalign.config import ConfigError
from openalign.data.dedup import FILE_ENGINES, DedupConfig, DedupResult, find_near_duplicates
from openalign.data.dedup_buckets.cosine import PairScorer
from openalign.data.dedup_buckets.files import EmbeddingFiles, OpenFiles, ShardKeys
from openalign.data.dedup_buckets.stage import Routing, distinct_keys, fit_routing, write_buckets

__all__ = ["EmbeddingFiles", "OpenFiles", "Routing", "ShardKeys", "find_pairs_in_files"]


def _empty(stats: dict[str, Any], notes: list[str], reason: str) -> DedupResult:
    stats.update(clusters=0, candidate_pairs=0, duplicate_pairs=0, train_rows_removed=0, test_images_matched=0)
    notes.append(reason)
    return DedupResult(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32), stats, notes)


def _in_memory(crawl: OpenFiles, test: OpenFiles, cfg: DedupConfig) -> DedupResult:
    """The numpy/sparse engines: today's in-process search on the concatenated files (small data)."""
    train = np.concatenate([np.asarray(a, dtype=np.float32) for a in crawl.arrays])
    queries = np.concatenate([np.asarray(a, dtype=np.float32) for a in test.arrays])
    return find_near_duplicates(train, queries, config=cfg)


def find_pairs_in_files(
    crawl: EmbeddingFiles, test: EmbeddingFiles, config: DedupConfig, work_dir: str | Path
) -> tuple[DedupResult, ShardKeys, ShardKeys]:
    """Crawl/test pairs with cosine above the threshold, and the keys of both sides' rows (by global row).

    ``work_dir`` receives the bucket Parquet files, the candidates, DuckDB's spill and ``routing.npz``
    (centroids and projection); the caller owns it (and removes it).
    """
    config.validate()
    started = time.perf_counter()
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    crawl_open, test_open = crawl.open(), test.open()
    if crawl_open.dim != test_open.dim:
        raise ValueError(f"train embeddings are {crawl_open.dim}-d but test embeddings are {test_open.dim}-d")
    keys = (crawl_open.key_list(), test_open.key_list(cache_files=64))
    if config.engine not in FILE_ENGINES:
        result = _in_memory(crawl_open, test_open, config)
        result.stats["seconds"]["total_s"] = round(time.perf_counter() - started, 3)
        return result, *keys
    notes: list[str] = []
    stats: dict[str, Any] = {
        "train_n": crawl_open.rows,
        "test_n": test_open.rows,
        "dim": crawl_open.dim,
        "threshold": config.threshold,
        "engine": config.engine,
        "out_of_core": True,
        "train_files": len(crawl.files),
        "test_files": len(test.files),
    }
    if crawl_open.rows == 0 or test_open.rows == 0:
        return _empty(stats, notes, "nothing to compare: the train or the test set is empty"), *keys
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    routing = fit_routing(crawl_open, config, notes)
    if routing is None:
        return _empty(stats, notes, "no valid train rows to cluster"), *keys
    routing.save(work / "routing.npz")
    seconds["kmeans_s"] = time.perf_counter() - t

    t = time.perf_counter()
    chunk = config.chunk_size
    projected = (work / "crawl_projected.npy", work / "test_projected.npy") if routing.projection.dim else None
    test_side = write_buckets(
        test_open, routing, work / "test", chunk_size=chunk, row_column="j", projected_path=projected and projected[1]
    )
    if test_side["invalid"] == test_open.rows:
        return _empty(stats, notes, "nothing to compare: no valid test rows"), *keys
    keep = distinct_keys(work / "test") if config.prune_keys else None
    seconds["test_assign_s"] = time.perf_counter() - t
    t = time.perf_counter()
    crawl_side = write_buckets(
        crawl_open,
        routing,
        work / "crawl",
        chunk_size=chunk,
        row_column="i",
        keep=keep,
        projected_path=projected and projected[0],
    )
    seconds["train_assign_s"] = time.perf_counter() - t
    del keep

    t = time.perf_counter()
    if config.engine == "duckdb":
        from openalign.data.dedup_buckets.duckdb_join import duckdb_pairs

        scorer = PairScorer(crawl_open, test_open, config.threshold, projected)
        i, j, cos, n_candidates = duckdb_pairs(
            work, scorer, memory_limit=config.memory_limit, threads=config.threads, max_spill=config.max_spill
        )
    elif config.engine == "spark":
        from openalign.data.dedup_buckets.spark_join import spark_pairs

        i, j, cos, n_candidates = spark_pairs(
            work, crawl, test, config.threshold, projected=projected, master=config.spark_master, conf=config.spark_conf
        )
    else:  # validate() admits no other engine here
        raise ConfigError(f"dedup.engine {config.engine!r} cannot join bucket files")
    seconds["join_and_cosine_s"] = time.perf_counter() - t
    order = np.lexsort((j, i))
    i, j, cos = i[order], j[order], cos[order]
    stats.update(
        train_skipped_invalid=crawl_side["invalid"],
        test_skipped_invalid=test_side["invalid"],
        clusters=routing.clusters,
        clusters_requested=config.clusters,
        nearest=routing.nearest,
        combo=routing.combo,
        buckets_per_image=math.comb(routing.nearest, routing.combo),
        project_dim=routing.projection.dim,
        kmeans_sample=routing.sample_rows,
        train_bucket_rows_written=crawl_side["bucket_rows"],
        test_bucket_rows_written=test_side["bucket_rows"],
        candidate_pairs=n_candidates,
        candidate_fraction=n_candidates / max(1, crawl_open.rows * test_open.rows),
        duplicate_pairs=len(i),
        train_rows_removed=len(np.unique(i)),
        test_images_matched=len(np.unique(j)),
        seconds={name: round(v, 3) for name, v in {**seconds, "total_s": time.perf_counter() - started}.items()},
    )
    return DedupResult(i, j, cos, stats, notes), *keys
