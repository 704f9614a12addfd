"""``openalign bench search``: approximate search against exact NumPy search on the same vectors, and
``openalign bench serve``: many concurrent clients against the real HTTP server.

The vectors are not uniform noise (on which every ANN method looks hopeless and every exact one looks
fine) but a mixture of clusters in a low-dimensional latent space, projected up to the embedding width
with isotropic noise on top: neighbourhoods exist, but they are not trivially separated. Queries are
fresh draws from the same distribution, not stored vectors.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from openalign.search.index import AnnConfig, AnnKind, build_store, exact_search, normalize_rows, recall_at


@dataclass
class SearchBenchSettings:
    """What ``openalign bench search`` measures."""

    n: int = 1_000_000  # vectors
    dim: int = 640  # width
    queries: int = 500  # timed one at a time through the approximate index
    exact_queries: int = 30  # timed one at a time through exact NumPy search (each scans every vector)
    k: int = 10  # results per query (recall@k is measured at it)
    kind: AnnKind = "auto"  # the index structure (see AnnConfig)
    memory_budget_mb: float = 8192.0  # RAM the approximate index may hold (see AnnConfig)
    target_recall: float = 0.95  # recall@10 against exact search that calibration aims for
    seed: int = 0  # the synthetic vectors and queries
    json_path: str | None = None  # also write the results to this JSON file


def clustered_vectors(
    n: int, dim: int, seed: int = 0, *, clusters: int = 10_000, latent: int = 48, block: int = 100_000
) -> np.ndarray:
    """``n`` unit vectors from a Gaussian mixture in a ``latent``-d space, linearly embedded in ``dim``-d
    with isotropic noise (about the intrinsic dimension and cluster structure of image embeddings).

    The default 10,000 clusters is several times the IVF list count at 1M vectors, so the index cannot
    simply put one cluster in each list (which would make search look easier than it is)."""
    rng = np.random.default_rng(seed)
    # The mixture parameters come from their own stream so that any two calls share one distribution.
    shape_rng = np.random.default_rng(12345)
    lift = shape_rng.standard_normal((latent, dim), dtype=np.float32) / np.sqrt(latent)
    centres = shape_rng.standard_normal((clusters, latent), dtype=np.float32)
    out = np.empty((n, dim), np.float32)
    for start in range(0, n, block):
        m = min(block, n - start)
        z = centres[rng.integers(0, clusters, m)] + 0.7 * rng.standard_normal((m, latent), dtype=np.float32)
        x = z @ lift + 0.2 * rng.standard_normal((m, dim), dtype=np.float32)
        out[start : start + m] = normalize_rows(x)
    return out


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _percentiles(seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds) * 1000
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "mean_ms": float(ms.mean())}


def _time_each(fn: Any, queries: np.ndarray) -> list[float]:
    times = []
    for q in queries:
        start = time.perf_counter()
        fn(q[None])
        times.append(time.perf_counter() - start)
    return times


def run_search_bench(s: SearchBenchSettings) -> dict[str, Any]:
    """Build an index over ``s.n`` clustered vectors and compare it with exact search; prints a table."""
    if s.n < 1 or s.dim < 1 or s.queries < 1 or s.exact_queries < 1 or s.k < 1:
        raise ValueError("n, dim, queries, exact_queries and k must be positive")
    print(f"generating {s.n:,} × {s.dim} clustered vectors …", file=sys.stderr)
    t0 = time.perf_counter()
    data = clustered_vectors(s.n + s.queries, s.dim, s.seed)
    vectors, queries = data[: s.n], data[s.n :]
    gen_s = time.perf_counter() - t0
    print("exact ground truth …", file=sys.stderr)
    _, truth = exact_search(vectors, queries, s.k)

    rss_before = _rss_mb()
    cfg = AnnConfig(kind=s.kind, memory_budget_mb=s.memory_budget_mb, target_recall=s.target_recall, seed=s.seed)
    print(f"building the index ({cfg.kind}) …", file=sys.stderr)
    t0 = time.perf_counter()
    store = build_store(vectors, cfg)
    build_s = time.perf_counter() - t0
    rss_after = _rss_mb()

    for q in queries[:20]:  # warm caches and thread pools
        store.search(q[None], s.k)
    ann_times = _time_each(lambda q: store.search(q, s.k), queries)
    _, found = store.search(queries, s.k)
    recall = recall_at(found, truth)
    exact_times = _time_each(lambda q: exact_search(vectors, q, s.k), queries[: s.exact_queries])
    ann, exact = _percentiles(ann_times), _percentiles(exact_times)
    result = {
        "settings": asdict(s),
        "index": store.kind,
        "params": store.params,
        "generate_s": round(gen_s, 2),
        "build_s": round(build_s, 2),
        "index_memory_mb": round(store.memory_bytes() / 2**20, 1),
        "vectors_mb": round(vectors.nbytes / 2**20, 1),
        "rss_growth_mb": round(rss_after - rss_before, 1),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
        f"recall@{s.k}": round(recall, 4),
        "ann": ann,
        "exact_numpy": exact,
        "speedup_p50": round(exact["p50_ms"] / ann["p50_ms"], 1) if ann["p50_ms"] > 0 else float("inf"),
        "cpu_count": os.cpu_count(),
    }
    print(
        f"\nsearch over {s.n:,} × {s.dim} clustered vectors, k={s.k}, {os.cpu_count()} CPUs\n"
        f"  index            {store.kind} {json.dumps(store.params)}\n"
        f"  build            {build_s:.1f} s (data generation {gen_s:.1f} s, not counted)\n"
        f"  memory           index {result['index_memory_mb']} MB in RAM; vectors {result['vectors_mb']} MB; "
        f"RSS +{result['rss_growth_mb']} MB during build; peak RSS {result['peak_rss_mb']} MB\n"
        f"  recall@{s.k}        {recall:.4f} against exact search ({s.queries} held-out queries)\n"
        f"  latency/query    ours p50 {ann['p50_ms']:.3f} ms, p99 {ann['p99_ms']:.3f} ms ({s.queries} queries)\n"
        f"                   exact NumPy p50 {exact['p50_ms']:.2f} ms, p99 {exact['p99_ms']:.2f} ms "
        f"({s.exact_queries} queries)\n"
        f"  speed-up         {result['speedup_p50']}× exact NumPy at p50"
    )
    if s.json_path:
        Path(s.json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


# --------------------------------------------------------------------------------------------------
# Load against the real server


@dataclass
class ServeBenchSettings:
    """What ``openalign bench serve`` measures."""

    index: str | None = None  # an index directory; default: the demo index (built if missing)
    clients: int = 16  # concurrent clients
    requests: int = 1000  # per client
    k: int = 10
    port: int = 0  # 0 picks a free port
    startup_timeout_s: float = 300.0  # how long the server may take to answer /health
    json_path: str | None = None  # also write the results to this JSON file


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_server(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    """Poll ``url``/health until it answers 200; RuntimeError if the process exits or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before answering")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server at {url} did not answer within {timeout:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if the server has not exited within 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


QUERY_WORDS = (
    "red",
    "blue",
    "green",
    "yellow",
    "purple",
    "orange",
    "circle",
    "square",
    "triangle",
    "star",
    "small",
    "large",
    "on water",
    "on bricks",
    "at the top",
    "on the left",
)


def _request_bodies(count: int, seed: int, n_images: int, k: int) -> list[dict[str, Any]]:
    """A mix like a search page's traffic: mostly text, some "more like this", some image ± text."""
    rng = np.random.default_rng(seed)
    bodies = []
    for _ in range(count):
        words = " ".join(rng.choice(QUERY_WORDS, size=int(rng.integers(1, 4)), replace=False))
        kind = rng.random()
        if kind < 0.7:
            bodies.append({"text": f"a {words}", "k": k})
        elif kind < 0.85:
            bodies.append({"image_id": int(rng.integers(0, n_images)), "k": k})
        else:
            bodies.append({"image_id": int(rng.integers(0, n_images)), "plus": [str(rng.choice(QUERY_WORDS))], "k": k})
    return bodies


def run_serve_bench(s: ServeBenchSettings) -> dict[str, Any]:
    """Start ``openalign serve`` in its own process and drive it with ``s.clients`` concurrent clients."""

    if s.clients < 1 or s.requests < 1:
        raise ValueError("clients and requests must be positive")
    index = s.index
    if index is None:
        from openalign.search.demo import build_demo_index, default_demo_dir

        index = str(build_demo_index(default_demo_dir(500, 0, None), n_images=500))
    port = s.port or free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "openalign.cli", "serve", "--index", index, "--port", str(port)]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([*cmd, "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
        return _drive(s, proc, url, index, log)


def _drive(s: ServeBenchSettings, proc: subprocess.Popen, url: str, index: str, log: Any) -> dict[str, Any]:
    import httpx

    try:
        try:
            wait_for_server(url, proc, s.startup_timeout_s)
        except RuntimeError as err:
            log.seek(0)
            tail = log.read().decode("utf-8", "replace").strip().splitlines()[-5:]
            raise RuntimeError(f"{err}: {' | '.join(tail)}") from err
        n_images = httpx.get(f"{url}/health").json()["images"]
        latencies: list[list[float]] = [[] for _ in range(s.clients)]
        statuses: list[Counter] = [Counter() for _ in range(s.clients)]

        def client(i: int) -> None:
            bodies = _request_bodies(s.requests, i, n_images, s.k)
            with httpx.Client(base_url=url, timeout=60) as http:
                for body in bodies:
                    start = time.perf_counter()
                    status: int | str
                    try:
                        status = http.post("/search", json=body).status_code
                    except httpx.HTTPError as err:
                        status = type(err).__name__
                    latencies[i].append(time.perf_counter() - start)
                    statuses[i][status] += 1

        threads = [threading.Thread(target=client, args=(i,)) for i in range(s.clients)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        alive = proc.poll() is None and httpx.get(f"{url}/health").status_code == 200
    finally:
        stop_server(proc)
    total: Counter = Counter()
    for c in statuses:
        total.update(c)
    flat = [x for lat in latencies for x in lat]
    lat = _percentiles(flat)
    server_errors = sum(v for k, v in total.items() if not isinstance(k, int) or k >= 500)
    result = {
        "settings": asdict(s),
        "index": index,
        "requests": len(flat),
        "wall_s": round(wall, 2),
        "throughput_rps": round(len(flat) / wall, 1),
        "statuses": {str(k): v for k, v in total.items()},
        "server_errors": server_errors,
        "server_alive_after": alive,
        **lat,
    }
    print(
        f"\nload: {s.clients} concurrent clients × {s.requests} POST /search on loopback ({n_images} images)\n"
        f"  requests         {len(flat)} in {wall:.1f} s ({result['throughput_rps']} req/s)\n"
        f"  statuses         {result['statuses']}; 5xx or transport errors: {server_errors}\n"
        f"  latency          p50 {lat['p50_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms (client side, under load)\n"
        f"  server alive     {alive}"
    )
    if s.json_path:
        Path(s.json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result
