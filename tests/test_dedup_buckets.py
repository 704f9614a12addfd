"""The bucket rule on files: DuckDB, Spark and numpy engines find the same pairs as a plain brute force."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from openalign.data.dedup import DedupConfig
from openalign.data.dedup_buckets import EmbeddingFiles, find_pairs_in_files

THRESHOLD = 0.975
SETTINGS = {"clusters": 16, "nearest": 5, "combo": 3, "threshold": THRESHOLD, "project_dim": 16, "chunk_size": 250}


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _copies(src: np.ndarray, cosine: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Unit vectors at exactly ``cosine`` from unit rows ``src``: a unit direction orthogonal to each row."""
    noise = rng.standard_normal(src.shape)
    noise = _unit(noise - (noise * src).sum(1, keepdims=True) * src)
    return cosine[:, None] * src + np.sqrt(1 - cosine**2)[:, None] * noise


def _write_layout(root: Path, parts: list[np.ndarray], prefix: str) -> None:
    """clip-retrieval's inference layout: img_emb/img_emb_N.npy and metadata/metadata_N.parquet with keys."""
    (root / "img_emb").mkdir(parents=True)
    (root / "metadata").mkdir()
    start = 0
    for n, part in enumerate(parts):
        np.save(root / "img_emb" / f"img_emb_{n}.npy", part.astype(np.float32))
        keys = [f"{prefix}{start + r:05d}" for r in range(len(part))]
        pq.write_table(
            pa.table({"image_path": [f"{k}.jpg" for k in keys], "key": keys}),
            root / "metadata" / f"metadata_{n}.parquet",
        )
        start += len(part)


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    rng = np.random.default_rng(7)
    dim, n_crawl, n_test = 24, 1500, 150
    centres = rng.standard_normal((12, dim))
    crawl = _unit(centres[rng.integers(0, 12, n_crawl)] + 0.7 * rng.standard_normal((n_crawl, dim)))
    test = _unit(centres[rng.integers(0, 12, n_test)] + 0.7 * rng.standard_normal((n_test, dim)))
    src = rng.choice(n_crawl, 60, replace=False)
    # 30 duplicates just above the threshold, 30 near misses just under it.
    cosine = np.concatenate([rng.uniform(0.977, 0.995, 30), rng.uniform(0.96, 0.973, 30)])
    test[:60] = _copies(crawl[src], cosine, rng)
    crawl[5] = np.nan  # an unusable row: skipped by every engine
    root = tmp_path_factory.mktemp("planted")
    _write_layout(root / "crawl", [crawl[:700], crawl[700:1100], crawl[1100:]], "c")
    _write_layout(root / "test", [test], "t")
    sides = {
        name: EmbeddingFiles(
            tuple(sorted((root / name / "img_emb").glob("*.npy"))),
            tuple(sorted((root / name / "metadata").glob("*.parquet"))),
        )
        for name in ("crawl", "test")
    }
    return {
        "crawl_emb": crawl,
        "test_emb": test,
        "dup": {(int(s), n) for n, s in enumerate(src[:30])},
        "root": root,
        **sides,
    }


def _brute(crawl: np.ndarray, test: np.ndarray) -> dict[tuple[int, int], float]:
    """Every crawl/test pair with cosine above the threshold, comparing all pairs in float64."""
    cos = np.nan_to_num(_unit(crawl) @ _unit(test).T, nan=-1.0)
    return {(int(i), int(j)): float(cos[i, j]) for i, j in zip(*np.nonzero(cos > THRESHOLD), strict=True)}


def _sharing_a_bucket(work: Path, crawl: np.ndarray, test: np.ndarray) -> set[tuple[int, int]]:
    """Pairs whose nearest-centroid lists (computed plainly from the saved centroids) share ``combo`` ids."""
    routing = np.load(work / "routing.npz")
    nearest, combo = routing["shape"][1:]

    def near(x: np.ndarray) -> list[set[int]]:
        p = _unit(x) @ routing["basis"] - routing["offset"]
        d = ((p[:, None, :] - routing["centroids"][None]) ** 2).sum(-1)
        return [set(np.argsort(row)[:nearest].tolist()) if np.isfinite(row).all() else set() for row in d]

    a, b = near(crawl), near(test)
    return {(i, j) for i, j in itertools.product(range(len(a)), range(len(b))) if len(a[i] & b[j]) >= combo}


def _run(planted: dict, tmp: Path, **extra: object) -> dict[tuple[int, int], float]:
    cfg = DedupConfig(**{**SETTINGS, **extra})  # type: ignore[arg-type]
    result, crawl_keys, test_keys = find_pairs_in_files(planted["crawl"], planted["test"], cfg, tmp)
    pairs = result.pairs_table(crawl_keys, test_keys).to_pylist()
    assert all(p["train_key"] == f"c{p['train_idx']:05d}" and p["test_key"] == f"t{p['test_idx']:05d}" for p in pairs)
    return {(p["train_idx"], p["test_idx"]): p["cosine"] for p in pairs}


def test_duckdb_and_numpy_equal_brute_force_on_pairs_sharing_a_bucket(planted: dict, tmp_path: Path) -> None:
    found = _run(planted, tmp_path / "duckdb", engine="duckdb", memory_limit="64MB")
    brute = _brute(planted["crawl_emb"], planted["test_emb"])
    shared = _sharing_a_bucket(tmp_path / "duckdb", planted["crawl_emb"], planted["test_emb"])
    expected = {pair for pair in brute if pair in shared}
    assert set(found) == expected
    assert all(abs(found[p] - brute[p]) < 1e-5 for p in found)
    # Every planted duplicate is found and no near miss is; the bucket rule loses nothing of brute force here.
    assert planted["dup"] <= set(found) and set(brute) == set(found)
    assert _run(planted, tmp_path / "numpy", engine="numpy") == found
    assert _run(planted, tmp_path / "all_keys", engine="duckdb", prune_keys=False) == found


@pytest.mark.slow
def test_spark_local_mode_gives_the_duckdb_pairs(planted: dict, tmp_path: Path, spark: Any) -> None:
    # The run's session (conftest's `spark`) is active, and the engine's own session reuses it. Few partitions:
    # the fixture is tiny, and each shuffle partition is a task to schedule.
    conf = {"spark.sql.shuffle.partitions": "2", "spark.default.parallelism": "2"}
    found = _run(planted, tmp_path / "spark", engine="spark", spark_master="local[2]", spark_conf=conf)
    assert found == _run(planted, tmp_path / "duckdb", engine="duckdb")
    assert planted["dup"] <= set(found)


def test_dedup_command_on_embedding_folders_drops_the_planted_duplicates(planted: dict, tmp_path: Path) -> None:
    from openalign.cli import main

    keys = [f"c{n:05d}" for n in range(len(planted["crawl_emb"]))]
    pq.write_table(pa.table({"key": keys, "caption": [f"caption {k}" for k in keys]}), tmp_path / "filtered.parquet")
    out = tmp_path / "out"
    argv = ["dedup", str(planted["root"] / "crawl"), str(planted["root"] / "test"), str(out), "--quiet"]
    flags = ["--clusters", "16", "--nearest", "5", "--project-dim", "16", "--memory-limit", "256MB"]
    assert main([*argv, *flags, "--metadata", str(tmp_path / "filtered.parquet")]) == 0
    expected = sorted({f"c{i:05d}" for i, _ in _brute(planted["crawl_emb"], planted["test_emb"])})
    assert json.loads((out / "drop.json").read_text()) == expected
    kept = pq.read_table(out / "filtered_dedup.parquet").column("key").to_pylist()
    assert kept == [k for k in keys if k not in set(expected)]
    pairs = pq.read_table(out / "duplicates.parquet").to_pylist()
    assert {(p["train_key"], p["test_key"]) for p in pairs} >= {(f"c{i:05d}", f"t{j:05d}") for i, j in planted["dup"]}


SPILL_CHILD = """
import json, resource, sys
from pathlib import Path
import numpy as np
limit = int(sys.argv[2]) << 20
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from openalign.data.dedup import DedupConfig
from openalign.data.dedup_buckets import EmbeddingFiles, find_pairs_in_files
root = Path(sys.argv[1])
out = {}
for name, spill in (("no_spill", "1MB"), ("spill", None)):
    cfg = DedupConfig(clusters=4, nearest=2, combo=1, project_dim=0, memory_limit="64MB", max_spill=spill, threads=1)
    cfg.prune_keys = False  # every bucket row goes into the join
    try:
        sides = EmbeddingFiles((root / "c.npy",)), EmbeddingFiles((root / "t.npy",))
        r, _, _ = find_pairs_in_files(*sides, cfg, root / name)
        out[name] = [r.stats["candidate_pairs"], r.train_idx.tolist(), r.test_idx.tolist()]
    except Exception as err:
        out[name] = type(err).__name__
peak = [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmPeak")]
print(json.dumps({**out, "vm_peak_kb": int(peak[0])}))
"""


def test_duckdb_join_stays_within_its_memory_limit_by_spilling(tmp_path: Path) -> None:
    """The distinct candidates (millions of pairs) do not fit DuckDB's 64MB: the join must spill to finish,
    and fails when spilling is capped; the whole process runs under an address-space limit."""
    rng = np.random.default_rng(3)
    crawl = rng.standard_normal((16_000, 16)).astype(np.float32)
    test = rng.standard_normal((300, 16)).astype(np.float32)
    test[:20] = crawl[:20] + 0.01 * rng.standard_normal((20, 16)).astype(np.float32)
    np.save(tmp_path / "c.npy", crawl)
    np.save(tmp_path / "t.npy", test)
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SPILL_CHILD), str(tmp_path), "6144"],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert child.returncode == 0, child.stderr[-2000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["no_spill"] == "OutOfMemoryException"
    n_candidates, found_i, found_j = report["spill"]
    assert n_candidates > 1_000_000  # 16 bytes a pair before any hash-table overhead: over 64MB to deduplicate
    assert set(zip(found_i, found_j, strict=True)) == set(_brute(crawl, test)) >= {(n, n) for n in range(20)}


def test_bench_on_files_finds_the_planted_duplicates(tmp_path: Path) -> None:
    from openalign.bench.dedup import run_dedup_bench
    from openalign.bench.dedup_settings import DedupBenchSettings

    settings = DedupBenchSettings(
        train=3000, test=400, dim=64, brute_train=600, files=True, shard_rows=1000, work_dir=str(tmp_path)
    )
    settings.dedup = DedupConfig(clusters=64, memory_limit="256MB")
    settings.process_memory_gb = 3.0  # the search process runs under RLIMIT_DATA
    report = run_dedup_bench(settings)
    assert report["recall_vs_brute_force"] == 1.0 and report["planted_found"] == report["planted"] == 20
    # The search process's own peak (VmHWM, not its parent's size at fork), under its limit.
    assert report["near_misses_matched"] == 0 and 0 < report["peak_rss_mb"] < 3 * 1024
    assert list(tmp_path.iterdir()) == []  # the folders and work files are removed


def test_embedding_folder_without_the_key_column_is_a_one_line_error(
    planted: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from openalign.cli import main

    argv = ["dedup", str(planted["root"] / "crawl"), str(planted["root"] / "test"), str(tmp_path / "out")]
    assert main([*argv, "--key-column", "url", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "metadata_0.parquet: no 'url' column" in err and len(err.splitlines()) == 1
