"""IVF-PQ indexes larger than memory: trained once, built shard by shard, merged into on-disk lists.

The coarse centroids and PQ codebooks are trained once on rows sampled across the whole input; each input
shard is then encoded into its own IVF-PQ index with those shared parameters (only one shard's codes in
memory, its vectors read in blocks), and the shards' inverted lists are merged into one file
(``lists.ivfdata``) that FAISS's ``OnDiskInvertedLists`` memory-maps. ``faiss.index`` then holds only the
centroids, codebooks and list offsets, so opening an index reads a few megabytes and a query pages in just
the lists it probes.

Vectors are read with plain file reads (``data.npy_rows``), not through a memory map, so that a scan
through them leaves nothing of the file in the process's resident set.
"""

from __future__ import annotations

import math
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from openalign.config import ConfigError
from openalign.data.npy_rows import BLOCK, NpyRows
from openalign.search.disk_lists import CHECKSUMS, LISTS, ProbedLists, quiet_c_stdout
from openalign.search.index import (
    FAISS_FILE,
    VECTORS,
    AnnConfig,
    VectorStore,
    calibrate,
    calibration_queries,
    exact_search,
    nprobe_steps,
)

DISK_KIND = "ivf_pq_disk"
TRUTH_BLOCK = 16_384  # rows scored at a time by exact search for calibration: 256 queries × this many floats
TRAINED = "trained.index"


def write_unit_vectors(parts: list[Path], path: Path, dim: int, tolerance: float) -> int:
    """Every row of ``parts``, checked finite and scaled to unit length, appended to one float32 .npy at
    ``path`` a block at a time; returns how many rows were more than ``tolerance`` from unit length."""
    readers = [NpyRows(p) for p in parts]
    total = sum(len(r) for r in readers)
    rescaled = 0
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as out:
        np.lib.format.write_array_header_1_0(out, {"descr": "<f4", "fortran_order": False, "shape": (total, dim)})
        for reader in readers:
            for start, rows in reader.blocks():
                block = np.asarray(rows, dtype=np.float64)
                if not np.isfinite(block).all():
                    bad = start + int(np.argwhere(~np.isfinite(block))[0][0])
                    raise ValueError(f"{reader.path}: row {bad} holds NaN or infinite values")
                norms = np.linalg.norm(block, axis=1)
                if (norms == 0).any():
                    raise ValueError(
                        f"{reader.path}: row {start + int(np.argmin(norms))} is all zeros and has no direction"
                    )
                rescaled += int((np.abs(norms - 1) > tolerance).sum())
                out.write((block / norms[:, None]).astype("<f4").tobytes())
    os.replace(tmp, path)
    return rescaled


def disk_pq_m(dim: int) -> int:
    """Default sub-quantizers of on-disk codes: about 4 dimensions per byte, at most 64 bytes a vector
    (the codes are read from disk at query time; re-ranking restores exact scores)."""
    return max(m for m in range(1, min(64, max(1, dim // 4)) + 1) if dim % m == 0)


def disk_params(n: int, dim: int, cfg: AnnConfig) -> dict[str, int]:
    """nlist, pq_m, nbits and training rows for ``n`` vectors of width ``dim``."""
    nlist = min(cfg.nlist or max(1, int(2 * math.sqrt(n))), n)
    m = cfg.pq_m or disk_pq_m(dim)
    if dim % m:
        raise ConfigError(f"pq_m={m} must divide the embedding width {dim}")
    if not 1 <= cfg.disk_nbits <= 16:
        raise ConfigError(f"disk_nbits must be in 1..16, got {cfg.disk_nbits}")
    train = min(n, cfg.train_size or 40 * nlist)
    if train < 2**cfg.disk_nbits or train < nlist:
        raise ConfigError(
            f"{train} training rows cannot train {nlist} lists and {2**cfg.disk_nbits} codes per sub-vector"
        )
    return {"nlist": nlist, "pq_m": m, "pq_nbits": cfg.disk_nbits, "train_size": train}


def train_shared(vectors: NpyRows, params: dict[str, int], cfg: AnnConfig, path: Path) -> None:
    """Train the coarse centroids and PQ codebooks on rows sampled across every shard; write the empty
    trained index to ``path``."""
    import faiss

    rng = np.random.default_rng(cfg.seed)
    rows = np.sort(rng.choice(len(vectors), size=params["train_size"], replace=False))
    sample = np.ascontiguousarray(vectors.take(rows), dtype=np.float32)
    dim = vectors.shape[1]
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFPQ(
        quantizer, dim, params["nlist"], params["pq_m"], params["pq_nbits"], faiss.METRIC_INNER_PRODUCT
    )
    index.cp.seed = cfg.seed
    index.cp.niter = cfg.kmeans_iterations
    index.pq.cp.niter = cfg.kmeans_iterations  # FAISS's 25 passes per sub-quantizer dominate training time
    index.pq.cp.seed = cfg.seed
    index.train(sample)
    faiss.write_index(index, str(path))


def encode_shard(vectors: NpyRows, start: int, stop: int, trained: Path, path: Path) -> None:
    """Rows ``start:stop`` (ids are row numbers) encoded with the shared trained index, written to ``path``."""
    import faiss

    index = faiss.read_index(str(trained))
    for s in range(start, stop, BLOCK):
        block = np.ascontiguousarray(vectors.read(s, min(stop, s + BLOCK)), dtype=np.float32)
        index.add_with_ids(block, np.arange(s, s + len(block), dtype=np.int64))
    faiss.write_index(index, str(path))


def merge_shards(trained: Path, parts: list[Path], lists: Path) -> Any:
    """The trained index with the inverted lists of every part, in order, merged into ``lists`` on disk, and
    each list's checksums beside it (``disk_lists.CHECKSUMS``).

    FAISS's own merge copies the codes through its memory map of ``lists``, so every page of the merged file
    stays resident in the building process: its peak grew with the index. Here FAISS only allocates each
    list's place in the file (``set_all_lists_sizes`` touches no page), and the codes and ids of one part at a time are
    written there with ``pwrite``, through the page cache; the layout, and so the index, is FAISS's.
    """
    import faiss

    index = faiss.read_index(str(trained))
    ivf = faiss.extract_index_ivf(index)
    nlist, code_size = ivf.nlist, ivf.code_size

    def part_lists(part: Path) -> tuple[Any, Any]:
        shard = faiss.read_index(str(part), faiss.IO_FLAG_MMAP)  # pages of one part at a time
        return shard, faiss.extract_index_ivf(shard).invlists

    sizes = np.zeros((len(parts), nlist), np.int64)
    for p, part in enumerate(parts):
        _, invlists = part_lists(part)
        sizes[p] = [invlists.list_size(n) for n in range(nlist)]
    merged: Any = faiss.OnDiskInvertedLists(nlist, code_size, str(lists))
    totals = np.ascontiguousarray(sizes.sum(0), dtype=np.uint64)
    merged.set_all_lists_sizes(faiss.swig_ptr(totals))  # lists back to back, each exactly its size
    used = int(totals.sum()) * (code_size + 8)
    if used:
        with quiet_c_stdout():  # FAISS notes the file's new size
            merged.update_totsize(used)
        # Growing the file records its new bytes as a free slot; the lists fill them, so the slot is taken (else
        # a later allocation, were the index ever grown, would be placed over list 0).
        merged.allocate_slot(used)
    table: Any = merged.lists
    codes_at = np.array([table.at(n).offset for n in range(nlist)], np.int64)
    ids_at = codes_at + np.array([table.at(n).capacity for n in range(nlist)], np.int64) * code_size
    written = np.zeros(nlist, np.int64)
    sums = np.zeros((nlist, 2), np.uint32)  # a list's parts lie back to back, so its CRC-32 runs on over them
    with open(lists, "r+b") as f:
        for p, part in enumerate(parts):
            shard, invlists = part_lists(part)
            for n in np.flatnonzero(sizes[p]).tolist():
                count = int(sizes[p, n])
                codes = faiss.rev_swig_ptr(invlists.get_codes(n), count * code_size).tobytes()
                found = faiss.rev_swig_ptr(invlists.get_ids(n), count).tobytes()
                os.pwrite(f.fileno(), codes, int(codes_at[n] + written[n] * code_size))
                os.pwrite(f.fileno(), found, int(ids_at[n] + written[n] * 8))
                sums[n] = zlib.crc32(codes, int(sums[n, 0])), zlib.crc32(found, int(sums[n, 1]))
                written[n] += count
            del shard, invlists  # unmaps the part
    np.save(lists.with_name(CHECKSUMS), sums)
    index.ntotal = ivf.ntotal = int(written.sum())
    ivf.replace_invlists(merged, True)
    merged.this.disown()
    return index


def exact_truth(vectors: NpyRows, queries: np.ndarray, k: int) -> np.ndarray:
    """Ids of the exact top ``k`` of ``queries``, scanning ``vectors`` a block at a time."""
    best_s = np.full((len(queries), 0), -np.inf, np.float32)
    best_i = np.empty((len(queries), 0), np.int64)
    for start, rows in vectors.blocks(TRUTH_BLOCK):
        s, i = exact_search(np.asarray(rows, np.float32), queries, k)
        cand_s, cand_i = np.concatenate([best_s, s], 1), np.concatenate([best_i, i + start], 1)
        order = np.argsort(-cand_s, axis=1, kind="stable")[:, :k]
        best_s, best_i = np.take_along_axis(cand_s, order, 1), np.take_along_axis(cand_i, order, 1)
    return best_i


def build_disk_store(
    directory: Path,
    shard_rows: list[int],
    cfg: AnnConfig,
    calibration: np.ndarray | None = None,
    home: Path | None = None,
) -> VectorStore:
    """An on-disk IVF-PQ store over ``directory/vectors.npy`` (unit rows), whose consecutive row ranges of
    ``shard_rows`` rows are the input shards: trained once, encoded a shard at a time, merged on disk.
    ``home``: the folder the store will be moved to, recorded as where its lists live."""
    vectors = NpyRows(directory / VECTORS)
    n, dim = vectors.shape
    if sum(shard_rows) != n:
        raise ValueError(f"{directory / VECTORS}: {n} rows, but the shards hold {sum(shard_rows)}")
    params: dict[str, Any] = disk_params(n, dim, cfg)
    parts_dir = directory / "parts"
    parts_dir.mkdir(exist_ok=True)
    trained = directory / TRAINED
    train_shared(vectors, params, cfg, trained)
    parts, start = [], 0
    for number, rows in enumerate(shard_rows):
        part = parts_dir / f"part_{number:05d}.index"
        encode_shard(vectors, start, start + rows, trained, part)
        parts.append(part)
        start += rows
    index = merge_shards(trained, parts, directory / LISTS)
    shutil.rmtree(parts_dir)
    import faiss

    if home is not None:
        lists: Any = faiss.downcast_InvertedLists(faiss.extract_index_ivf(index).invlists)  # type: ignore[arg-type]
        lists.filename = str(home / LISTS)
    faiss.write_index(index, str(directory / FAISS_FILE))
    params.update(rerank=cfg.rerank, list_checksums="crc32")
    store = VectorStore(np.load(directory / VECTORS, mmap_mode="r"), index, DISK_KIND, params)
    store.read_rows = vectors.take
    # Calibration searches as a server does, reading the lists it probes: through FAISS's map they would
    # stay resident, and the build's peak would grow with the index.
    store.probe = ProbedLists(index, directory / LISTS, require_checksums=True).search
    if cfg.nprobe:
        store.params["nprobe"] = min(cfg.nprobe, params["nlist"])
        store._apply_params()
        return store
    if calibration is None:
        calibration = calibration_queries(vectors, seed=cfg.seed)
    queries = np.ascontiguousarray(calibration, dtype=np.float32)
    truth = exact_truth(vectors, queries, 10)
    store.params.update(calibrate(store, cfg, "nprobe", nprobe_steps(params["nlist"]), queries, truth))
    return store
