"""The join on Spark, with the same logic as the DuckDB engine, in DataFrame operations.

Bucket rows are read from the Parquet parts, joined on the key, each (crawl row, test row) pair kept once
(``distinct``), and the exact cosine check runs on the executors (``mapInArrow``) reading the rows from
the ``.npy`` files by id, so the files must be at the same path on every executor (a shared filesystem;
on one machine, ``local[N]``). Pairs above the threshold are written as Parquet and read back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from openalign.data.dedup_buckets.cosine import PairScorer
from openalign.data.dedup_buckets.files import EmbeddingFiles
from openalign.data.filters.spark_engine import SparkSettings, spark_session


def _scorer_fn(
    crawl: EmbeddingFiles, test: EmbeddingFiles, threshold: float, projected: tuple[Path, Path] | None
) -> Any:
    def score(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        yield from PairScorer.from_files(crawl, test, threshold, projected).batches(batches)  # once per task

    return score


def spark_pairs(
    work: Path,
    crawl: EmbeddingFiles,
    test: EmbeddingFiles,
    threshold: float,
    *,
    projected: tuple[Path, Path] | None = None,
    master: str = "local[*]",
    conf: dict[str, str] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(crawl rows, test rows, cosines, candidate count) from the buckets under ``work/crawl`` and ``work/test``."""
    from pyspark import StorageLevel

    spark = spark_session(SparkSettings(master, dict(conf or {})))
    # Executors need only the matrices' paths: keys stay on the driver.
    bare = [dataclasses.replace(side, keys=None, metadata=None) for side in (crawl, test)]
    buckets = spark.read.parquet(str(work / "crawl"))
    test_buckets = spark.read.parquet(str(work / "test"))
    candidates = buckets.join(test_buckets, "k").select("i", "j").distinct().persist(StorageLevel.MEMORY_AND_DISK)
    try:
        n_candidates = candidates.count()
        out = work / "spark_pairs"
        pairs = candidates.mapInArrow(
            _scorer_fn(bare[0], bare[1], threshold, projected), "i long, j long, cosine float"
        )
        pairs.write.mode("overwrite").parquet(str(out))
    finally:
        candidates.unpersist()
    table = pq.read_table(out, schema=pa.schema([("i", pa.int64()), ("j", pa.int64()), ("cosine", pa.float32())]))
    return (
        table.column("i").to_numpy(),
        table.column("j").to_numpy(),
        table.column("cosine").to_numpy(),
        int(n_candidates),
    )
