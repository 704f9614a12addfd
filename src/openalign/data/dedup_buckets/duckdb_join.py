"""The join on DuckDB, out of core: bucket-key Parquet in, distinct candidate pairs, the exact check.

DuckDB joins the crawl's and the test side's bucket rows on the key and keeps each (crawl row, test row)
pair once (``SELECT DISTINCT``), spilling to ``temp_directory`` past ``memory_limit``; the candidates
are then streamed in crawl-row order (sequential reads of the crawl's ``.npy`` files) through the exact
cosine check. Memory is DuckDB's limit, one batch of candidate vectors, and the pairs found.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from openalign.data.dedup_buckets.cosine import PairScorer


def _literal(value: str | Path) -> str:
    return "'" + str(value).replace("'", "''") + "'"


def duckdb_pairs(
    work: Path,
    scorer: PairScorer,
    *,
    memory_limit: str | None,
    threads: int | None = None,
    max_spill: str | None = None,
    batch_rows: int = 65_536,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(crawl rows, test rows, cosines, candidate count) from the buckets under ``work/crawl`` and ``work/test``."""
    import duckdb

    spill = work / "duckdb_spill"
    spill.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect()
    try:
        con.execute(f"SET temp_directory = {_literal(spill)}")
        if memory_limit:
            con.execute(f"SET memory_limit = {_literal(memory_limit)}")
        if max_spill:
            con.execute(f"SET max_temp_directory_size = {_literal(max_spill)}")
        if threads:
            con.execute(f"SET threads = {int(threads)}")
        con.execute("SET preserve_insertion_order = false")  # no row order to keep: lets the join stream
        candidates = work / "candidates.parquet"
        crawl, test = _literal(work / "crawl" / "*.parquet"), _literal(work / "test" / "*.parquet")
        con.execute(
            f"COPY (SELECT DISTINCT c.i, t.j FROM read_parquet({crawl}) c JOIN read_parquet({test}) t ON c.k = t.k) "
            f"TO {_literal(candidates)} (FORMAT parquet)"
        ).fetchall()
        n_candidates = int(con.execute(f"SELECT count(*) FROM read_parquet({_literal(candidates)})").fetchall()[0][0])
        reader = con.sql(f"SELECT i, j FROM read_parquet({_literal(candidates)}) ORDER BY i, j").to_arrow_reader(
            batch_rows
        )
        found = [scorer(b.column(0).to_numpy(), b.column(1).to_numpy()) for b in reader]
    finally:
        con.close()
    if not found:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32), n_candidates
    i, j, cos = (np.concatenate(parts) for parts in zip(*found, strict=True))
    return i, j, cos, n_candidates
