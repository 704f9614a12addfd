"""Vector stores and query arithmetic against plain reference computations."""

from __future__ import annotations

import numpy as np
import pytest

from openalign.bench.search import clustered_vectors
from openalign.config import ConfigError
from openalign.search.index import (
    AnnConfig,
    VectorStore,
    ann_config,
    build_store,
    calibrate,
    choose_kind,
    exact_search,
    extend_store,
    normalize_rows,
    nprobe_steps,
    pick_pq_m,
    recall_at,
    save_vectors,
)
from openalign.search.query import Query, check_query, compose_query, remove_near_duplicates


def reference_topk(x: np.ndarray, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    scores = q @ x.T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, order, 1), order


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    x = clustered_vectors(6000, 32, seed=1, clusters=60, latent=12)
    q = clustered_vectors(100, 32, seed=2, clusters=60, latent=12)
    return x, q


def test_exact_search_matches_a_full_sort_across_blocks():
    rng = np.random.default_rng(0)
    x = normalize_rows(rng.standard_normal((1037, 16)))
    q = normalize_rows(rng.standard_normal((9, 16)))
    scores, ids = exact_search(x, q, 25, block=100)  # many blocks, one partial
    ref_s, ref_i = reference_topk(x, q, 25)
    np.testing.assert_allclose(scores, ref_s, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ids, ref_i)
    scores, ids = exact_search(x[:7], q, 25)  # k larger than the store
    assert ids.shape == (9, 7)
    np.testing.assert_array_equal(np.sort(ids, axis=1), np.tile(np.arange(7), (9, 1)))


def test_exact_search_works_on_a_memory_mapped_file(tmp_path, data):
    x, q = data
    mapped = save_vectors(tmp_path / "vectors.npy", [x[:2500], x[2500:]], len(x), x.shape[1])
    assert isinstance(mapped, np.memmap)
    np.testing.assert_array_equal(np.asarray(mapped), x)
    _, ids = exact_search(mapped, q, 10, block=1000)
    np.testing.assert_array_equal(ids, reference_topk(x, q, 10)[1])


def test_recall_at_counts_overlap():
    assert recall_at(np.array([[1, 2, 3]]), np.array([[3, 4, 5]])) == pytest.approx(1 / 3)
    assert recall_at(np.array([[1, 2], [5, 6]]), np.array([[2, 1], [7, 8]])) == pytest.approx(0.5)


@pytest.mark.parametrize("kind", ["ivf_flat", "ivf_pq", "hnsw"])
def test_approximate_indexes_reach_their_calibrated_recall(kind, data):
    x, q = data
    extra = {"pq_m": 16} if kind == "ivf_pq" else {}  # 2 dims per 4-bit code: this data is only 32-d
    store = build_store(x, AnnConfig(kind=kind, target_recall=0.9, nlist=64, **extra))
    assert store.kind == kind and store.ann is not None
    scores, ids = store.search(q, 10)
    _, truth = reference_topk(x, q, 10)
    assert recall_at(ids, truth) >= 0.85
    # Scores are exact inner products of the returned ids (IVF-Flat/HNSW natively, IVF-PQ after re-ranking).
    np.testing.assert_allclose(scores, np.einsum("qd,qkd->qk", q, x[ids]), atol=1e-4)
    assert (np.diff(scores, axis=1) <= 1e-6).all()
    import faiss

    assert store.memory_bytes() == pytest.approx(faiss.serialize_index(store.ann).nbytes, rel=0.1)


def test_calibration_picks_the_smallest_breadth_that_reaches_the_target(data):
    x, _ = data
    low = build_store(x, AnnConfig(kind="ivf_flat", nlist=64, target_recall=0.5))
    high = build_store(x, AnnConfig(kind="ivf_flat", nlist=64, target_recall=0.99))
    assert low.params["nprobe"] < high.params["nprobe"]
    assert high.params["calibrated_recall@10"] >= 0.99 or high.params["nprobe"] == 64


class _Curve:
    """A store whose recall@10 at each nprobe follows ``curve``: its results hold that share of the truth."""

    def __init__(self, curve):
        self.params, self.curve, self.asked = {}, curve, []

    def _apply_params(self):
        pass

    def search(self, queries, k):
        nprobe = self.params["nprobe"]
        self.asked.append(nprobe)
        hits = round(100 * self.curve(nprobe))
        return None, np.tile(np.r_[np.arange(hits), 1000 + np.arange(100 - hits)], (len(queries), 1))


def test_calibration_stops_where_more_lists_buy_no_recall():
    truth, queries = np.tile(np.arange(100), (4, 1)), np.zeros((4, 8), np.float32)
    steps = nprobe_steps(1024)
    assert steps[:8] == [1, 2, 3, 4, 6, 8, 12, 16] and steps[-1] == 1024
    # Reachable: the smallest breadth at the target, no plateau.
    store = _Curve(lambda b: min(1.0, 0.5 + 0.1 * np.log2(b)))
    found = calibrate(store, AnnConfig(target_recall=0.9), "nprobe", steps, queries, truth)
    assert store.params["nprobe"] == 16 and found == {"calibrated_recall@10": 0.9}
    # Codes that top out at 0.88 (PQ re-ranked at a fixed depth): not every list for the last bit.
    store = _Curve(lambda b: min(0.88, 0.5 + 0.1 * np.log2(b)))
    found = calibrate(store, AnnConfig(target_recall=0.95), "nprobe", steps, queries, truth)
    assert found == {"calibrated_recall@10": 0.88, "calibration_plateau": True}
    assert store.params["nprobe"] == 16 and max(store.asked) == 32  # 16 → 32 bought nothing; stop there
    # Slow but steady gains (2 points a doubling) keep it going to the target.
    store = _Curve(lambda b: min(1.0, 0.7 + 0.02 * np.log2(b)))
    calibrate(store, AnnConfig(target_recall=0.9), "nprobe", steps, queries, truth)
    assert store.params["nprobe"] == 1024


def test_choose_kind_and_code_size_from_size_and_memory_budget():
    cfg = AnnConfig(exact_threshold=1000, memory_budget_mb=100)
    assert choose_kind(1000, 640, cfg) == "exact"
    assert choose_kind(1001, 640, cfg) == "ivf_pq"
    assert choose_kind(10, 640, AnnConfig(kind="hnsw")) == "hnsw"
    assert pick_pq_m(1_000_000, 640, 8192) == 160  # 80 bytes of codes per vector: the finest, D/4
    assert pick_pq_m(1_000_000, 640, 60) == 80  # (40 + 8) bytes × 1M = 46 MB fits, (80 + 8) does not
    with pytest.raises(ConfigError, match="memory_budget_mb"):
        pick_pq_m(1_000_000, 640, 5)


def test_store_round_trips_and_extends(tmp_path, data):
    x, q = data
    first = save_vectors(tmp_path / "vectors.npy", [x[:4000]], 4000, x.shape[1])
    store = build_store(first, AnnConfig(kind="ivf_flat", nlist=32, nprobe=32))
    store.save(tmp_path)
    loaded = VectorStore.load(tmp_path)
    assert loaded.kind == "ivf_flat" and loaded.params["nprobe"] == 32 and isinstance(loaded.vectors, np.memmap)
    np.testing.assert_array_equal(loaded.search(q, 5)[1], store.search(q, 5)[1])
    grown = save_vectors(tmp_path / "grown.npy", [loaded.vectors, x[4000:]], len(x), x.shape[1])
    extended = extend_store(loaded, grown, AnnConfig(kind="ivf_flat", nlist=32, nprobe=32))
    assert extended.ann is loaded.ann and extended.ann.ntotal == len(x)
    # nprobe = nlist probes every list: the extended index must agree with exact search exactly.
    np.testing.assert_array_equal(extended.search(q, 10)[1], reference_topk(x, q, 10)[1])


def test_exact_store_becomes_approximate_when_it_outgrows_the_threshold(data):
    x, _ = data
    cfg = AnnConfig(exact_threshold=5000, nlist=16)
    small = build_store(x[:3000], cfg)
    assert small.kind == "exact"
    assert extend_store(small, x, cfg).kind == "ivf_pq"


def test_ann_config_is_strict():
    with pytest.raises(ConfigError, match="nprobes"):
        ann_config({"nprobes": 3})
    with pytest.raises(ConfigError, match="target_recall"):
        ann_config(target_recall=1.5)
    with pytest.raises(ConfigError, match="kind"):
        ann_config(kind="lsh")


def test_compose_query_matches_the_paper_recipe():
    rng = np.random.default_rng(3)
    img, t1, t2, m1 = (rng.standard_normal(8) * s for s in (3.0, 0.5, 2.0, 7.0))
    got = compose_query(img, [t1, t2], [m1], text_weight=2.0, image_weight=1.0)
    unit = lambda v: v / np.linalg.norm(v)  # noqa: E731
    want = unit(unit(img) + 2 * unit(t1) + 2 * unit(t2) - 2 * unit(m1))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # Text alone is just the normalised text; the weight cannot matter.
    np.testing.assert_allclose(compose_query(None, [t1], text_weight=5.0), unit(t1), rtol=1e-5)
    with pytest.raises(ValueError, match="needs text or an image"):
        compose_query(None, [], [m1])
    with pytest.raises(ValueError, match="cancel"):
        compose_query(None, [t1], [t1])


def test_remove_near_duplicates_is_greedy_in_rank_order():
    v = normalize_rows(np.array([[1, 0, 0], [0.999, 0.04, 0], [0, 1, 0], [0.7, 0.7, 0], [0, 0.999, 0.04]]))
    kept = remove_near_duplicates(np.arange(5), v, threshold=0.95)
    assert kept == [0, 2, 3]
    assert remove_near_duplicates(np.arange(5), v, threshold=1.0) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("query", "message"),
    [
        (Query(), "empty query"),
        (Query(text="   ", minus=["x"]), "empty query"),
        (Query(text="a", k=0), "k must be"),
        (Query(text="a", k=1001), "k must be"),
        (Query(text="a", modality="audio"), "unknown modality"),  # type: ignore[arg-type]
        (Query(text="a", dedup=1.5), "dedup"),
        (Query(text="a", text_weight=float("nan")), "text_weight"),
    ],
)
def test_bad_queries_are_rejected_with_a_reason(query, message):
    with pytest.raises(ValueError, match=message):
        check_query(query)
