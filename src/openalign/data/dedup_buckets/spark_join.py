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
    crawl: EmbeddingFiles, test: EmbeddingFiles, threshold: float, projected: tuple[Path, Path] | None, seen: Any
) -> Any:
    def score(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        scorer = PairScorer.from_files(crawl, test, threshold, projected)  # files opened once per task
        for batch in batches:
            seen.add(batch.num_rows)  # candidates, counted in the same pass (no second join to count them)
            yield from scorer.batches(iter([batch]))

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
    spark = spark_session(SparkSettings(master, dict(conf or {})))
    # Executors need only the matrices' paths: keys stay on the driver.
    bare = [dataclasses.replace(side, keys=None, metadata=None) for side in (crawl, test)]
    buckets = spark.read.parquet(str(work / "crawl"))
    test_buckets = spark.read.parquet(str(work / "test"))
    candidates = buckets.join(test_buckets, "k").select("i", "j").distinct()
    # Candidates are counted in the scoring pass itself (a retried task would count its batches twice; the
    # count is a statistic, the pairs are unaffected).
    seen = spark.sparkContext.accumulator(0)
    out = work / "spark_pairs"
    score = _scorer_fn(bare[0], bare[1], threshold, projected, seen)
    candidates.mapInArrow(score, "i long, j long, cosine float").write.mode("overwrite").parquet(str(out))
    n_candidates = seen.value
    table = pq.read_table(out, schema=pa.schema([("i", pa.int64()), ("j", pa.int64()), ("cosine", pa.float32())]))
    return (
        table.column("i").to_numpy(),
        table.column("j").to_numpy(),
        table.column("cosine").to_numpy(),
        int(n_candidates),
    )
