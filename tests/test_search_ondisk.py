"""On-disk IVF-PQ indexes built shard by shard from clip-retrieval's inference folders: recall against
FAISS brute force, the merged lists bit-equal to one in-memory index, memory-mapped results equal to
in-memory ones, build and serving memory that do not grow with the data, and one-line errors; a served
version that keeps answering while its folder is rebuilt or removed, and damaged lists as server faults."""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import faiss
import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient

from openalign.cli import main
from openalign.data.held_file import DamagedFile
from openalign.search.api import background_server, create_app, load_searcher
from openalign.search.catalog import SearchIndex
from openalign.search.disk_lists import LISTS, read_disk_index
from openalign.search.imported import import_embeddings
from openalign.search.index import AnnConfig, VectorStore
from openalign.search.ondisk import TRAINED, build_disk_store
from openalign.search.query import Query
from test_search_import import _error

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _clustered(n: int, d: int, seed: int) -> np.ndarray:
    # Clustered, not uniform: neighbourhoods exist, as in image embeddings.
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(99).standard_normal((200, d))
    x = centres[rng.integers(0, 200, n)] + 0.5 * rng.standard_normal((n, d))
    return x.astype(np.float32)


def _write_folder(root: Path, shards: list[np.ndarray], tag: str = "") -> Path:
    (root / "img_emb").mkdir(parents=True)
    (root / "metadata").mkdir()
    for i, x in enumerate(shards):
        np.save(root / "img_emb" / f"img_emb_{i}.npy", x)
        paths = [f"/photos/{i}/{j}.jpg" for j in range(len(x))]
        captions = [f"photo {tag}{i} {j}" for j in range(len(x))]
        pq.write_table(pa.table({"image_path": paths, "caption": captions}),
                       root / "metadata" / f"metadata_{i}.parquet")  # fmt: skip
    return root


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


ANN = AnnConfig(exact_threshold=1000, nlist=64, pq_m=8, disk_nbits=8, train_size=4000, target_recall=0.95)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    root = tmp_path_factory.mktemp("ondisk")
    shards = [_clustered(6000, 32, s) for s in range(3)]
    import_embeddings(_write_folder(root / "emb", shards), root / "index", ann=ANN)
    return root / "index", np.concatenate(shards)


def test_recall_against_faiss_brute_force(built: tuple[Path, np.ndarray]) -> None:
    path, raw = built
    index = SearchIndex.open(path)
    store = index.store("image")
    assert store.kind == "ivf_pq_disk" and store.params["nprobe"] < store.params["nlist"]
    unit = _unit(raw)
    queries = _unit(raw[::300] + 0.3 * np.random.default_rng(5).standard_normal((60, 32)).astype(np.float32))
    flat = faiss.IndexFlatIP(32)
    flat.add(unit)
    _, truth = flat.search(queries, 10)
    _, found = store.search(queries, 10)
    recall = np.mean([len(set(f) & set(t)) / 10 for f, t in zip(found.tolist(), truth.tolist(), strict=True)])
    assert recall >= 0.9, recall
    # Metadata comes from the row file, in result order, without loading the table.
    rows = index.rows("image", found[0][:3])
    assert [r["id"] for r in rows] == found[0][:3].tolist()
    assert rows[0]["path"] == f"/photos/{found[0][0] // 6000}/{found[0][0] % 6000}.jpg"


def test_merged_lists_equal_one_in_memory_index(built: tuple[Path, np.ndarray]) -> None:
    path, raw = built
    directory = path / "image"
    ondisk = read_disk_index(directory)
    ivf = faiss.extract_index_ivf(ondisk)
    assert (directory / LISTS).stat().st_size == len(raw) * (ivf.code_size + 8)  # no slack between lists
    memory = faiss.read_index(str(directory / TRAINED))  # the same trained centroids and codebooks
    memory.add_with_ids(np.load(directory / "vectors.npy"), np.arange(len(raw), dtype=np.int64))
    queries = _unit(raw[7::500])
    for nprobe in (1, 8, 64):
        faiss.extract_index_ivf(ondisk).nprobe = faiss.extract_index_ivf(memory).nprobe = nprobe
        d1, i1 = ondisk.search(queries, 20)
        d2, i2 = memory.search(queries, 20)
        assert np.array_equal(i1, i2) and np.array_equal(d1, d2)


def test_served_results_equal_the_memory_mapped_and_in_memory_index(built: tuple[Path, np.ndarray]) -> None:
    path, raw = built
    served = VectorStore.load(path / "image", mmap=True)
    loaded = VectorStore.load(path / "image", mmap=False)
    mapped = read_disk_index(path / "image")  # FAISS's own memory-mapped lists
    assert served.probe is not None and loaded.probe is None
    assert "OnDisk" in type(faiss.downcast_InvertedLists(faiss.extract_index_ivf(mapped).invlists)).__name__
    assert "Array" in type(faiss.downcast_InvertedLists(faiss.extract_index_ivf(loaded.ann).invlists)).__name__
    queries = _unit(raw[3::400])
    probed = served.probe.__self__  # type: ignore[attr-defined]
    for nprobe, budget in ((1, 64 << 20), (8, 64 << 20), (64, 64 << 20), (8, 1)):
        probed.budget = budget  # 1 byte: every query its own group
        for ann in (served.ann, loaded.ann, mapped):
            faiss.extract_index_ivf(ann).nprobe = nprobe
        s1, i1 = served.probe(queries, 30)
        s2, i2 = loaded.ann.search(queries, 30)
        s3, i3 = mapped.search(queries, 30)
        assert np.array_equal(i1, i2) and np.array_equal(s1, s2) and np.array_equal(i1, i3) and np.array_equal(s1, s3)
        invlists = faiss.extract_index_ivf(served.ann).invlists
        assert sum(invlists.list_size(n) for n in range(invlists.nlist)) == 0  # the group's lists are freed
    served.params["nprobe"] = loaded.params["nprobe"] = 8
    served._apply_params()
    loaded._apply_params()
    s1, i1 = served.search(queries, 10)
    s2, i2 = loaded.search(queries, 10)
    assert np.array_equal(i1, i2) and np.array_equal(s1, s2)


def test_query_groups_keep_their_lists_within_the_budget(built: tuple[Path, np.ndarray]) -> None:
    path, raw = built
    probed = VectorStore.load(path / "image").probe.__self__  # type: ignore[union-attr]
    _, probe = probed.ivf.quantizer.search(_unit(raw[::200]), 16)
    budget = int(np.sort(probed.list_bytes)[-16:].sum()) * 2  # room for two queries' lists at the least
    probed.budget = budget
    groups = probed._groups(probe)
    assert groups[0][0] == 0 and groups[-1][1] == len(probe) and len(groups) > 2
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(groups))  # consecutive, no gaps
    for a, b in groups:
        held = int(probed.list_bytes[np.unique(probe[a:b])].sum())
        assert held <= budget or b - a == 1
        if b < len(probe):  # a group stops only where the next query's lists would pass the budget
            assert int(probed.list_bytes[np.unique(probe[a : b + 1])].sum()) > budget


def test_search_json_stays_clean_after_the_index_moves(
    built: tuple[Path, np.ndarray], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # FAISS notes the moved lists file on C's stdout, below Python's sys.stdout: capfd sees file descriptor 1.
    moved = tmp_path / "moved"
    subprocess.run(["cp", "-r", str(built[0]), str(moved)], check=True)
    query = tmp_path / "q.json"
    query.write_text(json.dumps(_unit(built[1][:1])[0].tolist()))
    capfd.readouterr()
    assert main(["search", str(moved), "--embedding", str(query), "--json", "-k", "3"]) == 0
    assert json.loads(capfd.readouterr().out)[0]["id"] == 0


BUILD = """
import json, os, resource, sys
from openalign.search.imported import import_embeddings
from openalign.search.index import AnnConfig
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # fail this process, not the machine
cfg = AnnConfig(exact_threshold=1000, nlist=128, pq_m=32, disk_nbits=6, train_size=5000, nprobe=8)
peaks = {}
for folder, out in zip(sys.argv[1::2], sys.argv[2::2]):
    # Each build in a forked child (imports done once): its own peak, from the same starting point.
    read, write = os.pipe()
    if os.fork() == 0:
        import_embeddings(folder, out, ann=cfg)
        os.write(write, str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024).encode())
        os._exit(0)
    os.close(write)
    assert os.wait()[1] == 0
    peaks[folder] = int(os.read(read, 64))
print(json.dumps(peaks))
"""


def _child(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          env={"PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def peaks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[int, int, Path]]:
    """Peak RSS of a build from 1, 2 and 4 shards of 40,000 128-d vectors (20 MB each)."""
    root = tmp_path_factory.mktemp("peaks")
    args, data = [], {}
    for count in (1, 2, 4):
        folder = _write_folder(root / f"emb{count}", [_clustered(40_000, 128, s) for s in range(count)])
        data[count] = sum(f.stat().st_size for f in (folder / "img_emb").iterdir())
        args += [str(folder), str(root / f"index{count}")]
    found = json.loads(_child(BUILD, *args))
    return {count: (found[str(root / f"emb{count}")], data[count], root / f"index{count}") for count in (1, 2, 4)}


def test_build_memory_does_not_grow_with_the_data(peaks: dict[int, tuple[int, int, Path]]) -> None:
    peak = {count: p for count, (p, _, _) in peaks.items()}
    grown = peaks[4][1] - peaks[1][1]
    # Loading the vectors (let alone normalising them in float64) would add at least `grown` (60 MB) from 1
    # to 4 shards; what may grow is the merge paging through the codes (32 bytes a vector against 512) and
    # the allocator's noise.
    assert max(peak.values()) - min(peak.values()) < 0.4 * grown, (peak, grown)


SERVE = """
import sys, numpy as np
from pathlib import Path
import faiss
from openalign.search.index import VectorStore
from openalign.search.disk_lists import read_disk_index
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
queries = np.random.default_rng(0).standard_normal((300, 32)).astype(np.float32)
queries /= np.linalg.norm(queries, axis=1, keepdims=True)
warm = faiss.IndexIVFPQ(faiss.IndexFlatIP(32), 32, 4, 16, 4, faiss.METRIC_INNER_PRODUCT)
warm.train(np.random.default_rng(1).standard_normal((400, 32)).astype(np.float32))
warm.add(queries)
warm.search(queries, 10)  # FAISS's one-time set-up, outside every measurement
growth = []
before = rss()
store = VectorStore.load(sys.argv[1])
for n, q in enumerate(queries):  # the serving path: read the probed lists, re-rank from vectors.npy
    store.search(q[None], 10)
    if n == 9:
        early = rss()
growth += [rss() - before, rss() - early]
before = rss()
ann = read_disk_index(Path(sys.argv[1]))  # control 1: FAISS's memory-mapped lists, the same queries
faiss.extract_index_ivf(ann).nprobe = store.params["nprobe"]
for q in queries:
    ann.search(q[None], 100)
growth.append(rss() - before)
del ann  # unmaps the lists
before = rss()
ann = read_disk_index(Path(sys.argv[1]), mmap=False)  # control 2: the lists read into memory
ann.search(queries[:10], 10)
growth.append(rss() - before)
print(*growth)
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An on-disk store of 600,000 32-d vectors in 512 lists (14 MB of lists), built without metadata."""
    directory = tmp_path_factory.mktemp("served")
    np.save(directory / "vectors.npy", _unit(_clustered(600_000, 32, 0)))
    cfg = AnnConfig(nlist=512, pq_m=16, disk_nbits=8, train_size=5000, nprobe=32)
    build_disk_store(directory, [200_000] * 3, cfg).save(directory)
    return directory


def test_serving_memory_stays_under_the_index_size(served: Path) -> None:
    """300 queries probing 32 of 512 lists each reach nearly every list: through a memory map the pages
    they touch stay resident, read with ``pread`` only the lists of the query at hand are held."""
    size = (served / LISTS).stat().st_size + (served / "faiss.index").stat().st_size
    probed, late, mapped, loaded = map(int, _child(SERVE, str(served)).split())
    assert loaded > 0.8 * size  # the measurement catches an index read into memory
    assert mapped > 0.5 * size  # and the pages a memory map keeps
    # Opening the store and the first queries (FAISS's and NumPy's buffers, one query's lists) cost a fixed
    # few MB; the 290 queries after them add nothing that grows with the lists they reach.
    assert probed < 0.4 * size and late < 0.05 * size, (probed, late, mapped, loaded, size)


def test_bad_shards_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _write_folder(tmp_path / "emb", [_clustered(500, 16, 0), _clustered(500, 16, 1)])
    shard = folder / "img_emb" / "img_emb_1.npy"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    argv = ["index", "build", "--embeddings", str(folder), "--out", str(tmp_path / "i1"), "--exact-threshold", "10"]
    assert "img_emb_1.npy" in _error(capsys, argv)
    np.save(shard, _clustered(500, 24, 1))
    assert "24-d" in _error(capsys, [*argv[:5], str(tmp_path / "i2"), *argv[6:]])
    shard.unlink()
    assert "no img_emb/img_emb_1.npy" in _error(capsys, [*argv[:5], str(tmp_path / "i3"), *argv[6:]])


def test_missing_lists_file_is_one_line_error(
    built: tuple[Path, np.ndarray], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    moved = tmp_path / "broken"
    subprocess.run(["cp", "-r", str(built[0]), str(moved)], check=True)
    (moved / "image" / LISTS).unlink()
    query = tmp_path / "q.json"
    query.write_text(json.dumps([0.1] * 32))
    assert LISTS in _error(capsys, ["search", str(moved), "--embedding", str(query)])


SWAP_ANN = AnnConfig(exact_threshold=500, nlist=32, pq_m=8, disk_nbits=6, train_size=1500, nprobe=6, rerank=4)


def _answers(index: Path, queries: np.ndarray) -> list[list[dict]]:
    """What a server over ``index`` alone answers to each query (the results of ``/search``)."""
    with TestClient(create_app(load_searcher(index))) as http:
        return [http.post("/search", json={"embedding": q.tolist(), "k": 10}).json()["results"] for q in queries]


def test_a_served_version_keeps_its_files_while_its_folder_is_rebuilt_or_removed(tmp_path: Path) -> None:
    versions = []
    for v in range(3):  # three builds of the same shape over other vectors (and captions)
        shards = [_clustered(1500, 32, 10 * v + s) for s in range(2)]
        import_embeddings(_write_folder(tmp_path / f"emb{v}", shards, f"v{v} "), tmp_path / f"v{v}", ann=SWAP_ANN)
        versions.append(tmp_path / f"v{v}")
    queries = _unit(_clustered(24, 32, 77))
    expected = [_answers(v, queries) for v in versions]
    assert all(len({json.dumps(e[q]) for e in expected}) == 3 for q in range(len(queries)))  # versions differ
    live = tmp_path / "live"
    shutil.copytree(versions[0], live)
    errors: list[str] = []
    seen: list[int] = []  # the version each answer came from, in order
    stop = threading.Event()

    def client(url: str, worker: int) -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            for n in itertools.count(worker, 8):
                if stop.is_set():
                    return
                q = n % len(queries)
                try:
                    response = http.post("/search", json={"embedding": queries[q].tolist(), "k": 10})
                except httpx.HTTPError as err:
                    errors.append(f"query {q}: {err!r}")
                    continue
                if response.status_code != 200:
                    errors.append(f"{response.status_code} {response.text[:200]}")
                    continue
                found = [v for v in range(3) if response.json()["results"] == expected[v][q]]
                if not found:
                    errors.append(f"query {q}: an answer of no version")
                seen.extend(found)

    def served(version: int) -> None:
        mark, deadline = len(seen), time.monotonic() + 60
        while version not in seen[mark:] and not errors:
            assert time.monotonic() < deadline, f"version {version} is never served"
            time.sleep(0.02)
        time.sleep(0.3)  # requests keep coming to this version, with the previous one's files gone

    def replace(version: int) -> None:
        shutil.copytree(versions[version], tmp_path / "staging")
        if live.exists():
            live.rename(tmp_path / "trash")
        (tmp_path / "staging").rename(live)
        shutil.rmtree(tmp_path / "trash", ignore_errors=True)  # the served version's files are deleted

    with background_server(create_app(load_searcher(live), reload_check_s=0)) as url:
        threads = [threading.Thread(target=client, args=(url, w)) for w in range(8)]
        for t in threads:
            t.start()
        try:
            served(0)
            for version in (1, 2, 0, 1):
                replace(version)
                served(version)
            mark = len(seen)
            shutil.rmtree(live)  # rm -rf of the served folder: the version held keeps answering
            time.sleep(0.5)
            assert set(seen[mark:]) == {1}
            replace(2)
            served(2)
            gc.collect()  # the versions swapped out have closed their files: descriptors do not pile up
            assert not [f for f in _open_files() if f.startswith(str(tmp_path)) and f.endswith("(deleted)")]
        finally:
            stop.set()
            for t in threads:
                t.join(60)
    assert not errors, (len(errors), errors[:5])
    assert len(seen) > 100


def _open_files() -> list[str]:
    """What this process's file descriptors point at."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the descriptor of the listing itself, closed by now
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
    return found


def _damage(path: Path, kind: str, at: int) -> None:
    """Bytes of ``path`` at ``at`` inverted in place, or the file cut there (the same file, as a disk fault does)."""
    with open(path, "r+b") as f:
        if kind == "truncate":
            f.truncate(at)
            return
        f.seek(at)
        data = f.read(8)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in data))


@pytest.mark.parametrize("kind", ["codes", "ids", "truncate"])
def test_damaged_lists_are_a_server_fault_that_names_no_path(
    built: tuple[Path, np.ndarray], tmp_path: Path, kind: str
) -> None:
    copy = tmp_path / "index"
    shutil.copytree(built[0], copy)
    searcher = load_searcher(copy)
    probed = searcher.index.store("image").probe.__self__  # type: ignore[union-attr]
    queries = _unit(built[1][::90])
    _, probe = probed.ivf.quantizer.search(queries, probed.ivf.nprobe)
    hit = int(probe[0].max())  # a list the first query probes; lists lie in the file in their order
    clear = next(q for q in range(len(queries)) if probe[q].max() < hit)  # one that reads only lists before it
    with TestClient(create_app(searcher), raise_server_exceptions=False) as http:

        def ask(q: int) -> httpx.Response:
            return http.post("/search", json={"embedding": queries[q].tolist(), "k": 10})

        before = ask(clear).json()["results"]
        at = int(probed.ids_at[hit] if kind == "ids" else probed.codes_at[hit]) + (8 if kind == "codes" else 0)
        _damage(copy / "image" / LISTS, kind, at)
        for _ in range(2):  # the same answer every time, not a one-off
            response = ask(0)
            assert response.status_code == 500, response.text
            detail = response.json()["detail"]
            assert "damaged" in detail and LISTS in detail and "/" not in detail, detail
            assert str(tmp_path) not in response.text
        # Lists the damage did not reach still answer, as before.
        assert ask(clear).status_code == 200 and ask(clear).json()["results"] == before
    with pytest.raises(DamagedFile, match=LISTS):
        searcher.search(Query(embedding=queries[0].tolist(), k=10))


def test_damaged_rows_and_lists_cut_before_loading_are_one_line(
    built: tuple[Path, np.ndarray], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "index"
    shutil.copytree(built[0], copy)
    query = _unit(built[1][:1])[0].tolist()
    searcher = load_searcher(copy)
    rows = copy / "image" / "rows.bin"
    _damage(rows, "codes", rows.stat().st_size // 2)
    _damage(rows, "codes", 0)  # the first result's row is id 0, the query's own vector
    with TestClient(create_app(searcher), raise_server_exceptions=False) as http:
        response = http.post("/search", json={"embedding": query, "k": 10})
    assert response.status_code == 500 and "rows.bin" in response.json()["detail"], response.text
    assert str(tmp_path) not in response.text
    lists = copy / "image" / LISTS
    _damage(lists, "truncate", lists.stat().st_size - 1)
    (tmp_path / "q.json").write_text(json.dumps(query))
    line = _error(capsys, ["search", str(copy), "--embedding", str(tmp_path / "q.json")])
    assert f"{lists}: truncated" in line, line
