"""Vector stores for search: exact inner-product search over a memory-mapped float32 matrix, and FAISS
approximate indexes (IVF-Flat, IVF-PQ, HNSW) above a size threshold.

Every store keeps its vectors as ``vectors.npy`` (float32 [N, D], L2-normalised rows, memory-mapped on
load), so exact search, re-ranking and adding items never need the approximate index. The approximate
index is IVF-PQ with 4-bit "fast-scan" codes: the codes of the probed lists are scanned with SIMD lookups
(a 640-d vector is 80 bytes instead of 2560, and the scan is bound by memory bandwidth), and the best
``rerank``·k candidates are re-scored exactly from the memory-mapped matrix, so the returned scores are
exact. The code size follows the memory budget: the finest codes whose RAM fits in it. IVF-Flat and
HNSW can be asked for by name.
The number of lists probed (or HNSW's ``efSearch``) is calibrated at build time to reach a target
recall@10 against exact search.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from openalign.config import ConfigError, from_dict, to_dict
from openalign.data.npy_rows import NpyRows

AnnKind = Literal["auto", "exact", "ivf_flat", "ivf_pq", "hnsw", "ivf_pq_disk"]
VECTORS = "vectors.npy"
FAISS_FILE = "faiss.index"
ANN_FILE = "ann.json"


@dataclass
class AnnConfig:
    """How a vector store searches: exactly, or through a FAISS index chosen from size and memory."""

    kind: AnnKind = "auto"  # auto: exact up to exact_threshold, then ivf_pq sized to memory_budget_mb
    exact_threshold: int = 100_000  # exact search is a few ms up to about this many 640-d vectors
    memory_budget_mb: float = 8192.0  # RAM the approximate index may hold (IVF-Flat and HNSW hold every vector)
    nlist: int = 0  # IVF lists; 0 picks 2·sqrt(N)
    nprobe: int = 0  # IVF lists probed per query; 0 calibrates it to reach target_recall
    pq_m: int = 0  # IVF-PQ 4-bit sub-quantizers (M/2 bytes per vector); 0: the most the budget allows, ≤ D/4
    rerank: int = 10  # IVF-PQ: re-score rerank·k candidates exactly from the memory-mapped vectors
    hnsw_m: int = 32  # HNSW neighbours per node
    ef_construction: int = 80
    ef_search: int = 0  # HNSW search breadth; 0 calibrates it to reach target_recall
    target_recall: float = 0.95  # recall@10 against exact search that calibration aims for
    train_size: int = 0  # vectors used to train IVF centroids and PQ codebooks; 0 picks 40·nlist
    kmeans_iterations: int = 10  # k-means passes; centroids barely move after ~10 on embeddings
    seed: int = 0
    on_disk: bool = True  # imports (--embeddings) above exact_threshold: IVF-PQ built shard by shard into on-disk lists
    disk_nbits: int = 8  # bits per sub-quantizer code of the on-disk IVF-PQ (kind ivf_pq_disk)


def ann_config(data: dict[str, Any] | AnnConfig | None = None, **overrides: Any) -> AnnConfig:
    """A validated AnnConfig from a mapping (strict keys) or an existing config, plus overrides."""
    base = to_dict(data) if isinstance(data, AnnConfig) else dict(data or {})
    base.update(overrides)
    cfg = from_dict(AnnConfig, base)
    if cfg.exact_threshold < 0:
        raise ConfigError(f"exact_threshold must be ≥ 0, got {cfg.exact_threshold}")
    if cfg.memory_budget_mb <= 0:
        raise ConfigError(f"memory_budget_mb must be positive, got {cfg.memory_budget_mb}")
    if not 0 < cfg.target_recall <= 1:
        raise ConfigError(f"target_recall must be in (0, 1], got {cfg.target_recall}")
    for name in ("nlist", "nprobe", "pq_m", "ef_search", "train_size"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name} must be ≥ 0, got {getattr(cfg, name)}")
    if cfg.rerank < 1 or cfg.hnsw_m < 2 or cfg.ef_construction < 1 or cfg.kmeans_iterations < 1:
        raise ConfigError("rerank must be ≥ 1, hnsw_m ≥ 2, ef_construction ≥ 1 and kmeans_iterations ≥ 1")
    return cfg


def choose_kind(n: int, dim: int, cfg: AnnConfig) -> str:
    """The index kind ``auto`` resolves to for ``n`` vectors of width ``dim``."""
    if cfg.kind != "auto":
        return cfg.kind
    return "exact" if n <= cfg.exact_threshold else "ivf_pq"


def pick_pq_m(n: int, dim: int, budget_mb: float) -> int:
    """Sub-quantizers for ``n`` vectors: as fine as D/4 (4 dimensions per 4-bit code), coarser only as
    far as the memory budget requires; ConfigError when even the coarsest codes do not fit."""
    candidates = sorted((m for m in range(1, max(1, dim // 4) + 1) if dim % m == 0), reverse=True)
    for m in candidates:
        if n * (m / 2 + 8) <= budget_mb * 2**20:  # codes plus the 8-byte id FAISS keeps per vector
            return m
    need = n * (candidates[-1] / 2 + 8) / 2**20
    raise ConfigError(f"{n} vectors need at least {need:.0f} MB for IVF-PQ codes; memory_budget_mb is {budget_mb}")


def normalize_rows(x: np.ndarray) -> np.ndarray:
    """Float32 rows scaled to unit length (zero rows stay zero)."""
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    out: np.ndarray = x / np.maximum(norms, 1e-12)
    return out


def exact_search(
    vectors: np.ndarray, queries: np.ndarray, k: int, block: int = 65_536
) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` inner products of each query against every row, best first, in blocks of rows.

    Works on a memory-mapped matrix without loading it whole. Returns (scores [Q, k'], ids [Q, k'])
    with k' = min(k, N).
    """
    queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
    n = vectors.shape[0]
    k = min(k, n)
    nq = queries.shape[0]
    if k <= 0:
        return np.empty((nq, 0), np.float32), np.empty((nq, 0), np.int64)
    best_s = np.full((nq, 0), -np.inf, np.float32)
    best_i = np.empty((nq, 0), np.int64)
    for start in range(0, n, block):
        chunk = np.asarray(vectors[start : start + block], dtype=np.float32)
        scores = queries @ chunk.T
        kk = min(k, scores.shape[1])
        part = np.argpartition(-scores, kk - 1, axis=1)[:, :kk]
        cand_s = np.concatenate([best_s, np.take_along_axis(scores, part, 1)], axis=1)
        cand_i = np.concatenate([best_i, part + start], axis=1)
        keep = np.argpartition(-cand_s, min(k, cand_s.shape[1]) - 1, axis=1)[:, :k]
        best_s, best_i = np.take_along_axis(cand_s, keep, 1), np.take_along_axis(cand_i, keep, 1)
    order = np.argsort(-best_s, axis=1, kind="stable")
    return np.take_along_axis(best_s, order, 1), np.take_along_axis(best_i, order, 1)


def recall_at(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean fraction of each row of ``truth`` ids that appear in the same row of ``found``."""
    hits = [len(set(f.tolist()) & set(t.tolist())) / max(1, len(t)) for f, t in zip(found, truth, strict=True)]
    return float(np.mean(hits)) if hits else 1.0


class VectorStore:
    """One modality's vectors: a memory-mapped matrix plus, above the threshold, a FAISS index.

    Ids are row numbers, aligned with the metadata rows of the same modality.
    """

    def __init__(self, vectors: np.ndarray, ann: Any = None, kind: str = "exact", params: dict | None = None):
        if vectors.ndim != 2:
            raise ValueError(f"vectors must be a [N, D] matrix, got shape {vectors.shape}")
        self.vectors = vectors
        self.ann = ann
        self.kind = kind
        self.params = dict(params or {})
        # Rows to re-rank, read with positioned reads rather than through the map (an on-disk store): a
        # fault on a mapped file maps its cached neighbours too, so scattered reads through a map make the
        # resident set grow towards the file's size.
        self.read_rows: Callable[[np.ndarray], np.ndarray] | None = None
        # The approximate search itself, when it is not ``ann.search``: a served on-disk index reads the lists
        # its queries probe instead of mapping the lists file (``disk_lists.ProbedLists``).
        self.probe: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]] | None = None
        self._apply_params()

    # ------------------------------------------------------------------ properties

    @property
    def size(self) -> int:
        return int(self.vectors.shape[0])

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])

    def memory_bytes(self) -> int:
        """Bytes held in RAM by the approximate index (the memory-mapped matrix is paged on demand)."""
        if self.ann is None:
            return 0
        import faiss

        # Counted from the structures rather than by serialising, which would copy the whole index.
        if self.kind == "hnsw":
            links = faiss.vector_to_array(self.ann.hnsw.neighbors).nbytes
            return int(self.size * self.dim * 4 + links + self.size * 16)
        ivf = faiss.extract_index_ivf(self.ann)
        pq = faiss.downcast_index(ivf).pq if self.kind.startswith("ivf_pq") else None  # type: ignore[attr-defined]  # faiss stub
        codebooks = pq.centroids.size() * 4 if pq is not None else 0
        if self.kind == "ivf_pq_disk":  # the lists stay on disk, paged in as queries probe them
            return int(ivf.nlist * self.dim * 4 + codebooks)
        return int(ivf.ntotal * (ivf.code_size + 8) + ivf.nlist * self.dim * 4 + codebooks)

    # ------------------------------------------------------------------ search

    def _apply_params(self) -> None:
        if self.ann is None:
            return
        import faiss

        if "nprobe" in self.params:
            faiss.extract_index_ivf(self.ann).nprobe = int(self.params["nprobe"])
        if "ef_search" in self.params:
            self.ann.hnsw.efSearch = int(self.params["ef_search"])

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` (scores, ids) per query row, best first.

        An approximate index can reach fewer than ``k`` vectors for some queries; those slots hold id -1
        and score -inf.
        """
        queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
        if queries.shape[1] != self.dim:
            raise ValueError(f"query width {queries.shape[1]} != index width {self.dim}")
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if self.size == 0:
            return np.empty((len(queries), 0), np.float32), np.empty((len(queries), 0), np.int64)
        if self.ann is None:
            return exact_search(self.vectors, queries, k)
        if self.kind in ("ivf_pq", "ivf_pq_disk"):
            return self._search_reranked(queries, k)
        scores, ids = self.ann.search(queries, min(k, self.size))
        return _drop_missing(scores, ids)

    def _search_reranked(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        # PQ scores are approximate; re-scoring a few times k candidates with the stored float32
        # vectors recovers exact order among them for the cost of a few small random reads.
        depth = min(self.size, k * int(self.params.get("rerank", 8)))
        _, cand = (self.probe or self.ann.search)(queries, depth)
        out_s = np.full((len(queries), min(k, self.size)), -np.inf, np.float32)
        out_i = np.full_like(out_s, -1, dtype=np.int64)
        for row, ids in enumerate(cand):
            ids = ids[ids >= 0]
            order = np.sort(ids)  # sorted reads are kinder to a memory-mapped file
            rows = self.vectors[order] if self.read_rows is None else self.read_rows(order)
            scores = np.asarray(rows, dtype=np.float32) @ queries[row]
            top = np.argsort(-scores, kind="stable")[:k]
            out_s[row, : len(top)] = scores[top]
            out_i[row, : len(top)] = order[top]
        return _drop_missing(out_s, out_i)

    # ------------------------------------------------------------------ persistence

    def save(self, directory: str | Path) -> Path:
        """Write the approximate index and its parameters next to ``vectors.npy`` (already on disk)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        if self.probe is not None:
            # A served on-disk index: its faiss.index was written with its lists, and the index in memory holds
            # only the lists of the query at hand, so there is nothing here to write.
            if not (out / FAISS_FILE).is_file():
                raise ValueError(f"{out}: an on-disk index is saved only where it was built, beside its lists")
        elif self.ann is not None:
            import faiss

            tmp = out / (FAISS_FILE + ".tmp")
            faiss.write_index(self.ann, str(tmp))
            tmp.replace(out / FAISS_FILE)
        elif (out / FAISS_FILE).exists():
            (out / FAISS_FILE).unlink()
        _write_json(out / ANN_FILE, {"kind": self.kind, "params": self.params, "size": self.size, "dim": self.dim})
        return out

    @classmethod
    def load(cls, directory: str | Path, mmap: bool = True) -> VectorStore:
        """Open a saved store; the matrix (and an on-disk index's lists) are memory-mapped unless ``mmap`` is
        False. An on-disk index opens its files once and reads through them, so a rebuild that replaces them, or
        removes the folder, leaves what this store reads as it was."""
        d = Path(directory)
        if not (d / VECTORS).is_file():
            raise FileNotFoundError(f"{d}: no {VECTORS}")
        meta: dict[str, Any] = read_json(d / ANN_FILE) if (d / ANN_FILE).is_file() else {"kind": "exact"}
        if not isinstance(meta.get("kind"), str):
            raise ValueError(f"{d / ANN_FILE}: damaged, it names no index kind")
        rows = NpyRows(d / VECTORS, hold=True) if meta["kind"] == "ivf_pq_disk" else None
        vectors = read_matrix(d / VECTORS, mmap) if rows is None else rows.mapped() if mmap else rows.read(0, len(rows))
        ann = None
        if meta["kind"] != "exact":
            if not (d / FAISS_FILE).is_file():
                raise FileNotFoundError(f"{d}: ann.json names a {meta['kind']} index but {FAISS_FILE} is missing")
            import faiss

            if meta["kind"] == "ivf_pq_disk":
                from openalign.search.disk_lists import read_disk_index

                ann = read_disk_index(d, mmap)
            else:
                try:
                    ann = faiss.read_index(str(d / FAISS_FILE))
                except RuntimeError as err:
                    raise ValueError(f"{d / FAISS_FILE}: truncated or damaged ({_first_line(err)})") from None
            if ann.ntotal != vectors.shape[0]:
                raise ValueError(f"{d}: {FAISS_FILE} holds {ann.ntotal} vectors but {VECTORS} has {vectors.shape[0]}")
        store = cls(vectors, ann, meta["kind"], meta.get("params", {}))
        if rows is not None:
            from openalign.search.disk_lists import LISTS, ProbedLists

            store.read_rows = rows.take
            if mmap:
                checked = bool(store.params.get("list_checksums"))
                store.probe = ProbedLists(ann, d / LISTS, require_checksums=checked).search
        return store


def _first_line(err: BaseException, limit: int = 160) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = (lines[-1] if lines else "") or type(err).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file of an index; a damaged one is a ValueError naming it."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: damaged, not valid JSON ({_first_line(err)})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: damaged, expected a JSON object, found {type(data).__name__}")
    return data


def read_matrix(path: Path, mmap: bool = True) -> np.ndarray:
    """A saved .npy array of an index (memory-mapped unless ``mmap`` is False); a truncated or damaged one is a
    ValueError naming it."""
    try:
        array: np.ndarray = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        if isinstance(err, OSError) and err.errno is not None:
            raise
        raise ValueError(f"{path}: truncated or damaged .npy file ({_first_line(err)})") from None
    return array


def _drop_missing(scores: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # FAISS pads with id -1 when a query reaches fewer than k vectors; drop columns that no row fills
    # and leave -1 (score -inf) where only some rows ran short, for the caller to skip per row.
    ids = ids.astype(np.int64)
    scores = np.where(ids >= 0, scores, -np.inf).astype(np.float32)
    filled = (ids >= 0).any(axis=0)
    width = int(filled.sum()) if filled.all() or not filled.any() else int(np.argmin(filled))
    return scores[:, :width], ids[:, :width]


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


# --------------------------------------------------------------------------------------------------
# Building


def _sample_rows(vectors: np.ndarray | NpyRows, count: int, rng: np.random.Generator) -> np.ndarray:
    n = vectors.shape[0]
    idx = np.arange(n) if count >= n else np.sort(rng.choice(n, size=count, replace=False))
    if isinstance(vectors, NpyRows):
        # Read, not mapped: faulting a few hundred rows of a freshly written file through a map maps the
        # kernel's read-ahead around each, far more memory than the rows.
        return np.ascontiguousarray(vectors.take(idx), dtype=np.float32)
    return np.ascontiguousarray(vectors[idx], dtype=np.float32)


def _add_in_blocks(index: Any, vectors: np.ndarray, start: int = 0, block: int = 100_000) -> None:
    for s in range(start, vectors.shape[0], block):
        index.add(np.ascontiguousarray(vectors[s : s + block], dtype=np.float32))


def calibration_queries(
    vectors: np.ndarray | NpyRows, count: int = 256, noise: float = 1.0, seed: int = 0
) -> np.ndarray:
    """Queries near (not on) stored vectors: a stored row plus Gaussian noise of relative size ``noise``,
    renormalised, so calibration does not reward finding a query's own copy."""
    rng = np.random.default_rng(seed + 1)
    base = _sample_rows(vectors, count, rng)
    jitter = rng.standard_normal(base.shape).astype(np.float32) * (noise / math.sqrt(base.shape[1]))
    return normalize_rows(base + jitter)


PLATEAU_GAIN = 0.01  # recall@10 a doubling of the search breadth must buy while the target is out of reach


def nprobe_steps(nlist: int) -> list[int]:
    """Powers of two and the midpoints between them, up to ``nlist``: nprobe drives latency linearly."""
    return sorted({min(nlist, int(b * 2**i)) for i in range(0, int(math.log2(max(1, nlist))) + 2) for b in (1, 1.5)})


def calibrate(
    store: VectorStore,
    cfg: AnnConfig,
    name: str,
    candidates: list[int],
    queries: np.ndarray | None,
    truth: np.ndarray | None = None,
) -> dict[str, Any]:
    """Set ``store.params[name]`` to the smallest search breadth whose recall@10 against exact search (``truth``,
    else computed) reaches the target.

    Where the codes cannot reach it (PQ codes re-ranked at a fixed depth top out below it), breadth stops at the
    point past which doubling it buys less than ``PLATEAU_GAIN``: probing every list for the last 0.1 point
    would make the index slower than exact search. The result then says so (``calibration_plateau``).
    """
    if queries is None:
        queries = calibration_queries(store.vectors, seed=cfg.seed)
    if truth is None:
        truth = exact_search(store.vectors, queries, 10)[1]
    recall: dict[int, float] = {}
    chosen, plateau = candidates[-1], False
    for value in candidates:
        store.params[name] = value
        store._apply_params()
        recall[value] = recall_at(store.search(queries, 10)[1], truth)
        if recall[value] >= cfg.target_recall:
            chosen = value
            break
        half = [v for v in recall if v <= value // 2]
        if half and recall[value] - recall[max(half)] < PLATEAU_GAIN:
            chosen, plateau = max(half), True
            break
    store.params[name] = chosen
    store._apply_params()
    return {"calibrated_recall@10": round(recall[chosen], 4), **({"calibration_plateau": True} if plateau else {})}


def build_store(
    vectors: np.ndarray, cfg: AnnConfig | None = None, calibration: np.ndarray | None = None
) -> VectorStore:
    """Index ``vectors`` (normalised float32 [N, D], ideally a memmap of ``vectors.npy``) per ``cfg``.

    ``calibration``: queries like the ones the index will serve (e.g. caption embeddings for an image
    index), used to pick nprobe / efSearch; by default, jittered copies of stored vectors.
    """
    cfg = cfg or AnnConfig()
    n, dim = vectors.shape
    kind = choose_kind(n, dim, cfg)
    if kind == "exact" or n == 0:
        return VectorStore(vectors, None, "exact", {})
    if kind == "ivf_pq_disk":
        raise ConfigError("kind ivf_pq_disk is built from embedding files: openalign index build --embeddings DIR")
    import faiss

    rng = np.random.default_rng(cfg.seed)
    params: dict[str, Any] = {}
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, cfg.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = cfg.ef_construction
        _add_in_blocks(index, vectors)
        store = VectorStore(vectors, index, kind, params)
        if cfg.ef_search:
            store.params["ef_search"] = cfg.ef_search
            store._apply_params()
        else:
            store.params.update(calibrate(store, cfg, "ef_search", [16, 32, 64, 128, 256, 512, 1024], calibration))
        return store

    # 2·sqrt(N) lists balances the coarse search (nlist dot products) against the list scans
    # (nprobe·N/nlist) for the few probes a recall of 0.95 needs, and keeps k-means cheap on a CPU.
    nlist = min(cfg.nlist or max(1, int(2 * math.sqrt(n))), n)
    train = _sample_rows(vectors, min(n, cfg.train_size or 40 * nlist), rng)
    quantizer = faiss.IndexFlatIP(dim)
    ivf: faiss.IndexIVF
    if kind == "ivf_flat":
        ivf = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
    elif kind == "ivf_pq":
        m = cfg.pq_m or pick_pq_m(n, dim, cfg.memory_budget_mb)
        if dim % m:
            raise ConfigError(f"pq_m={m} must divide the embedding width {dim}")
        # 4-bit codes are what the SIMD fast-scan kernels read; re-ranking restores exact scores.
        ivf = faiss.IndexIVFPQFastScan(quantizer, dim, nlist, m, 4, faiss.METRIC_INNER_PRODUCT)
        params.update(pq_m=m, pq_nbits=4, rerank=cfg.rerank)
    else:
        raise ConfigError(f"unknown index kind {kind!r}")
    ivf.cp.seed = cfg.seed
    ivf.cp.niter = cfg.kmeans_iterations
    ivf.train(train)
    _add_in_blocks(ivf, vectors)
    params["nlist"] = nlist
    store = VectorStore(vectors, ivf, kind, params)
    if cfg.nprobe:
        store.params["nprobe"] = min(cfg.nprobe, nlist)
        store._apply_params()
    else:
        store.params.update(calibrate(store, cfg, "nprobe", nprobe_steps(nlist), calibration))
    return store


def extend_store(store: VectorStore, vectors: np.ndarray, cfg: AnnConfig | None = None) -> VectorStore:
    """A store over ``vectors`` (the old rows followed by new ones), reusing a trained IVF index.

    Trained IVF centroids stay valid when a store grows, so new rows are only added; an exact store that
    outgrows the threshold, or any HNSW/auto change of kind, is rebuilt.
    """
    cfg = cfg or AnnConfig()
    old = store.size
    if vectors.shape[0] < old or vectors.shape[1] != store.dim:
        raise ValueError(f"cannot extend a store of {old}×{store.dim} with a matrix of shape {vectors.shape}")
    wanted = choose_kind(vectors.shape[0], vectors.shape[1], cfg)
    if store.ann is not None and store.kind in ("ivf_flat", "ivf_pq") and wanted == store.kind:
        _add_in_blocks(store.ann, vectors, start=old)
        return VectorStore(vectors, store.ann, store.kind, store.params)
    return build_store(vectors, cfg)


def save_vectors(
    path: str | Path,
    parts: list[np.ndarray],
    total: int,
    dim: int,
    each_block: Callable[[int, int, np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """Write the concatenation of ``parts`` to ``path`` as a float32 .npy (atomically) and memory-map it.

    ``each_block(part_index, first_row_in_part, block)``, when given, sees every block of up to 65,536 rows
    before it is written and returns what is written instead (a check or a rescaling)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.npy")
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(total, dim))
    row = 0
    for index, part in enumerate(parts):
        for s in range(0, part.shape[0], 65_536):
            block = part[s : s + 65_536]
            block = np.asarray(block, dtype=np.float32) if each_block is None else each_block(index, s, block)
            out[row : row + len(block)] = block
            row += len(block)
    if row != total:
        raise ValueError(f"expected {total} rows, wrote {row}")
    out.flush()
    del out
    os.replace(tmp, path)
    saved: np.ndarray = np.load(path, mmap_mode="r")
    return saved
