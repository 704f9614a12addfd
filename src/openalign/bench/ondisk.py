"""``openalign bench index``: the on-disk IVF-PQ index built from embedding shards, at several sizes.

For each size, synthetic clustered vectors (``bench.search.clustered_vectors``) are written as
clip-retrieval's inference folder (``img_emb/img_emb_N.npy`` + ``metadata/metadata_N.parquet``), and
``openalign index build --embeddings`` runs in a child process that reports its own peak RSS (VmHWM; the
build starts no processes of its own); it is printed beside the size of the vectors it indexed. A second child opens
the index memory-mapped, as ``openalign search`` and ``serve`` do, runs the queries, and reports its RSS
beside the index file's size, recall@10 and latency beside exact search over the same vectors, and a
metadata lookup from the row file beside reading the Parquet row groups that hold the same rows.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SERVE_CHILD = """
import json, sys, time
import numpy as np
import pyarrow.parquet as pq
from pathlib import Path
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
path, queries_path, k, exact_queries = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
queries = np.load(queries_path)
from openalign.search.catalog import SearchIndex
from openalign.search.index import exact_search, recall_at
from openalign.data.npy_rows import NpyRows
from openalign.search.ondisk import exact_truth
import faiss
before = rss()
t0 = time.perf_counter()
index = SearchIndex.open(path)
open_s = time.perf_counter() - t0
store = index.store("image")
times, found, lookups = [], [], []
for q in queries:
    t0 = time.perf_counter()
    _, ids = store.search(q[None], k)
    times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    index.rows("image", ids[0])
    lookups.append(time.perf_counter() - t0)
    found.append(ids[0])
after = rss()
table = pq.ParquetFile(path / "image" / "metadata.parquet")
starts = np.cumsum([0] + [table.metadata.row_group(g).num_rows for g in range(table.num_row_groups)])
parquet = []
for ids in found[:20]:  # the baseline: the Parquet row groups holding the same rows
    t0 = time.perf_counter()
    groups = sorted({int(np.searchsorted(starts, i, side="right") - 1) for i in ids})
    table.read_row_groups(groups)
    parquet.append(time.perf_counter() - t0)
truth = exact_truth(NpyRows(path / "image" / "vectors.npy"), queries, k)
exact_times = []
for q in queries[:exact_queries]:
    t0 = time.perf_counter()
    exact_search(store.vectors, q[None], k)
    exact_times.append(time.perf_counter() - t0)
print(json.dumps({
    "open_s": open_s, "rss_before": before, "rss_after": after, "ann_ms": [t * 1000 for t in times],
    "exact_ms": [t * 1000 for t in exact_times], "recall": recall_at(np.array(found), truth),
    "rows_ms": [t * 1000 for t in lookups], "parquet_ms": [t * 1000 for t in parquet],
    "params": store.params,
}))
"""


@dataclass
class IndexBenchSettings:
    """What ``openalign bench index`` measures."""

    sizes: str = "1000000,2000000,4000000"  # comma-separated vector counts, one build and one serve each
    dim: int = 64  # embedding width
    shard_size: int = 500_000  # vectors per embedding file (img_emb_N.npy)
    queries: int = 200  # timed one at a time through the on-disk index
    exact_queries: int = 10  # timed one at a time through exact search (each reads every vector)
    k: int = 10
    nlist: int = 0  # IVF lists; 0 picks 2·sqrt(N)
    pq_m: int = 0  # sub-quantizers; 0 picks about D/4 (at most 64)
    disk_nbits: int = 8  # bits per code
    nprobe: int = 0  # 0 calibrates it at build time to reach target_recall
    target_recall: float = 0.95  # recall@k against exact search that nprobe is calibrated for
    memory_limit_gb: float = 16.0  # address-space limit of each child, so a runaway fails itself
    work_dir: str | None = None  # where shards and indexes are written (default: a temporary folder)
    keep: bool = False  # keep the shards and indexes
    seed: int = 0  # the synthetic vectors and queries
    json_path: str | None = None  # also write the results to this JSON file

    def validate(self) -> None:
        if min(self.dim, self.shard_size, self.queries, self.exact_queries, self.k) < 1 or not self.size_list():
            raise ValueError("dim, shard_size, queries, exact_queries, k and sizes must be positive")

    def size_list(self) -> list[int]:
        try:
            sizes = [int(s.replace("_", "")) for s in self.sizes.split(",") if s.strip()]
        except ValueError:
            raise ValueError(f"--sizes must be comma-separated whole numbers, got {self.sizes!r}") from None
        if any(s < 1 for s in sizes):
            raise ValueError(f"--sizes must be positive, got {self.sizes!r}")
        return sizes


def write_folder(root: Path, n: int, dim: int, shard_size: int, seed: int) -> int:
    """Clip-retrieval's inference layout of ``n`` clustered vectors; returns the vectors' bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from openalign.bench.search import clustered_vectors

    (root / "img_emb").mkdir(parents=True, exist_ok=True)
    (root / "metadata").mkdir(exist_ok=True)
    written = 0
    for number, start in enumerate(range(0, n, shard_size)):
        rows = min(shard_size, n - start)
        np.save(root / "img_emb" / f"img_emb_{number}.npy", clustered_vectors(rows, dim, seed * 100_003 + number))
        ids = range(start, start + rows)
        table = pa.table({"image_path": [f"/images/{i:09d}.jpg" for i in ids], "caption": [f"image {i}" for i in ids]})
        pq.write_table(table, root / "metadata" / f"metadata_{number}.parquet")
        written += rows * dim * 4
    return written


def _limit(gb: float) -> Any:
    def apply() -> None:
        limit = int(gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply


BUILD_CHILD = """
import sys
from openalign.bench import own_peak_rss
from openalign.cli import main
code = main(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    f.write(str(own_peak_rss()))
sys.exit(code)
"""


def _build(folder: Path, out: Path, s: IndexBenchSettings) -> tuple[float, int]:
    """Seconds and peak RSS (bytes) of ``openalign index build --embeddings`` in a child process."""
    peak_file = out.with_name(out.name + ".peak")
    argv = [sys.executable, "-c", BUILD_CHILD, str(peak_file), "index", "build", "--embeddings", str(folder)]
    argv += ["--out", str(out)]
    for name in ("nlist", "pq_m", "disk_nbits", "nprobe", "target_recall"):
        argv += [f"--ann.{name}", str(getattr(s, name))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    t0 = time.perf_counter()
    done = subprocess.run(argv, preexec_fn=_limit(s.memory_limit_gb), stdout=subprocess.DEVNULL, env=env)
    if done.returncode:
        raise RuntimeError(f"index build of {folder} failed (exit {done.returncode})")
    seconds = time.perf_counter() - t0
    peak = int(peak_file.read_text())
    peak_file.unlink()
    return seconds, peak


def _serve(index: Path, queries: Path, s: IndexBenchSettings) -> dict[str, Any]:
    argv = [sys.executable, "-c", SERVE_CHILD, str(index), str(queries), str(s.k), str(s.exact_queries)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, preexec_fn=_limit(s.memory_limit_gb))
    if done.returncode:
        raise RuntimeError(f"serving {index} failed: {done.stderr.strip().splitlines()[-1:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _mb(x: float) -> str:
    return f"{x / 2**20:,.0f} MB"


def run_index_bench(s: IndexBenchSettings) -> list[dict[str, Any]]:
    """Build and serve an on-disk index at each size; prints one block per size and returns the figures."""
    from openalign.bench.search import clustered_vectors

    root = Path(s.work_dir or tempfile.mkdtemp(prefix="openalign-bench-index-"))
    root.mkdir(parents=True, exist_ok=True)
    queries = root / "queries.npy"
    np.save(queries, clustered_vectors(s.queries, s.dim, s.seed + 7_777_777))
    results = []
    try:
        for n in s.size_list():
            folder, index = root / f"emb-{n}", root / f"index-{n}"
            shutil.rmtree(folder, ignore_errors=True)
            shutil.rmtree(index, ignore_errors=True)
            print(f"{n:,} × {s.dim}: writing {-(-n // s.shard_size)} shards …", file=sys.stderr, flush=True)
            data = write_folder(folder, n, s.dim, s.shard_size, s.seed)
            print("building …", file=sys.stderr, flush=True)
            build_s, peak = _build(folder, index, s)
            # Below the exact threshold the index is the vectors themselves, searched exactly.
            parts = (
                ("faiss.index", "lists.ivfdata") if (index / "image" / "lists.ivfdata").is_file() else ("vectors.npy",)
            )
            files = sum((index / "image" / f).stat().st_size for f in parts)
            print("serving …", file=sys.stderr, flush=True)
            served = _serve(index, queries, s)
            ann, exact = np.median(served["ann_ms"]), np.median(served["exact_ms"])
            rows, parquet = np.median(served["rows_ms"]), np.median(served["parquet_ms"])
            serve_rss = served["rss_after"] - served["rss_before"]
            figures = {
                "n": n, "dim": s.dim, "vectors_bytes": data, "build_s": build_s, "build_peak_rss": peak,
                "index_file_bytes": files, "serve_rss_growth": serve_rss, "serve_rss": served["rss_after"],
                "recall@10": served["recall"], "ann_p50_ms": ann, "exact_p50_ms": exact,
                "rows_p50_ms": rows, "parquet_rows_p50_ms": parquet, "params": served["params"],
            }  # fmt: skip
            results.append(figures)
            print(
                f"\n{n:,} vectors × {s.dim} ({-(-n // s.shard_size)} shards), built in {build_s:,.0f} s\n"
                f"  build peak RSS (process tree)  {_mb(peak):>10}  vs the vectors {_mb(data):>10}  "
                f"ratio {peak / data:.2f}\n"
                f"  index file (index + lists)     {_mb(files):>10}  vs the vectors {_mb(data):>10}  "
                f"ratio {files / data:.2f}\n"
                f"  serving RSS growth (open + {s.queries} queries) {_mb(serve_rss)} "
                f"(process {_mb(served['rss_after'])}) vs the index file {_mb(files)}  ratio {serve_rss / files:.2f}\n"
                f"  recall@{s.k} vs exact search      {served['recall']:.3f}  "
                f"(nprobe {served['params'].get('nprobe')})\n"
                f"  query p50                      {ann:8.2f} ms  vs exact {exact:8.1f} ms  ratio {ann / exact:.4f}\n"
                f"  metadata of {s.k} results p50     {rows:8.3f} ms  vs Parquet row groups {parquet:8.1f} ms  "
                f"ratio {rows / parquet:.4f}",
                flush=True,
            )
            if not s.keep:
                shutil.rmtree(folder, ignore_errors=True)
                shutil.rmtree(index, ignore_errors=True)
    finally:
        if not s.keep and not s.work_dir:
            shutil.rmtree(root, ignore_errors=True)
    if s.json_path:
        Path(s.json_path).write_text(json.dumps(results, indent=2, default=str) + "\n")
    return results
