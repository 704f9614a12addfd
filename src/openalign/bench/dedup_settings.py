"""The settings of ``openalign bench dedup``, read by the in-memory bench (``bench/dedup.py``) and the out-of-core
one (``bench/dedup_files.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from openalign.data.dedup import DedupConfig


@dataclass
class DedupBenchSettings:
    """What ``openalign bench dedup`` measures."""

    train: int = 1_000_000  # train embeddings
    test: int = 50_000  # test embeddings
    dim: int = 640  # embedding width
    duplicate_fraction: float = 0.05  # of test images, copies of a train image with cosine 0.98–0.995
    near_miss_fraction: float = 0.05  # of test images, copies with cosine 0.93–0.97 (must not match)
    brute_train: int = 32_768  # train rows brute force runs on (then scaled)
    seed: int = 0  # data seed, and the k-means seed unless dedup.seed is given
    json_path: str | None = None  # also write the results to this JSON file
    # write the vectors as clip-retrieval embedding folders and run the out-of-core engine (dedup.engine duckdb
    # or spark) on them in a fresh process, reporting its peak resident size
    files: bool = False
    shard_rows: int = 1_000_000  # files: rows per img_emb_N.npy shard
    work_dir: str | None = None  # files: where the folders and work files go (default: the system temp dir)
    # files: the search process's memory limit in GiB (RLIMIT_DATA: its heap and anonymous maps, which is all of
    # its memory but the embedding files it reads), so that going past it fails the run; 0 sets none
    process_memory_gb: float = 0.0
    dedup: DedupConfig | None = None  # the search's settings (default: DedupConfig's)
