"""Synthetic embeddings shaped like real ones, with planted copies, and the exact pairs brute force finds.

A decaying spectrum (a few directions carry most of the variance), topics (groups of similar images) and, in
the test set, augmented copies of train rows (noise added, re-normalised) at a chosen cosine: duplicates just
above the bench's threshold and near misses just under it. Brute force (every test × train cosine by blocked
matrix products) is the ground truth the dedup benches score the bucketed search against.
"""

from __future__ import annotations

import numpy as np
import torch


def unit_rows(x: np.ndarray) -> np.ndarray:
    """``x`` with every row scaled to unit length, in place."""
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def noisy_copies(source: np.ndarray, cosine: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Unit vectors at (about) the given cosine from unit ``source`` rows: isotropic noise, re-normalised."""
    noise = rng.standard_normal(source.shape, dtype=np.float32)
    noise -= (noise * source).sum(1, keepdims=True) * source  # orthogonal to the source: exact angle
    noise = unit_rows(noise)
    tangent = np.sqrt(1.0 - cosine**2)[:, None].astype(np.float32)
    return unit_rows(source * cosine[:, None].astype(np.float32) + noise * tangent)


def synthetic_embeddings(
    n_train: int,
    n_test: int,
    dim: int,
    *,
    duplicate_fraction: float = 0.05,
    near_miss_fraction: float = 0.05,
    topic_size: int = 200,
    seed: int = 0,
    block: int = 65_536,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train [N, D], test [M, D], duplicate_src [M], near_miss_src [M]) unit float32 embeddings.

    ``duplicate_src[j]`` is the train row test row j copies with cosine 0.98–0.995 (-1 for none);
    ``near_miss_src[j]`` likewise for copies at 0.93–0.97, which a 0.975 threshold must reject.
    """
    rng = np.random.default_rng(seed)
    # Variance of direction k falls like 1/(k + 10): the top 10 % of directions carry about half of it.
    scale = (1.0 / np.sqrt(np.arange(dim) + 10.0)).astype(np.float32)
    n_topics = max(1, n_train // topic_size)
    centres = rng.standard_normal((n_topics, dim), dtype=np.float32) * scale

    def draw(n: int) -> np.ndarray:
        out = np.empty((n, dim), dtype=np.float32)
        for s in range(0, n, block):
            m = min(block, n - s)
            x = rng.standard_normal((m, dim), dtype=np.float32) * (0.8 * scale)
            x += centres[rng.integers(0, n_topics, m)]
            out[s : s + m] = unit_rows(x)
        return out

    train, test = draw(n_train), draw(n_test)
    n_dup = round(n_test * duplicate_fraction)
    n_miss = round(n_test * near_miss_fraction)
    if n_dup + n_miss > n_test:
        raise ValueError("duplicate_fraction + near_miss_fraction must not exceed 1")
    sources = rng.choice(n_train, n_dup + n_miss, replace=False)
    rows = rng.permutation(n_test)[: n_dup + n_miss]
    cosine = np.concatenate([rng.uniform(0.98, 0.995, n_dup), rng.uniform(0.93, 0.97, n_miss)])
    test[rows] = noisy_copies(train[sources], cosine, rng)
    duplicate_src = np.full(n_test, -1, dtype=np.int64)
    near_miss_src = np.full(n_test, -1, dtype=np.int64)
    duplicate_src[rows[:n_dup]] = sources[:n_dup]
    near_miss_src[rows[n_dup:]] = sources[n_dup:]
    return train, test, duplicate_src, near_miss_src


def brute_force_pairs(
    train: np.ndarray, test: np.ndarray, threshold: float, *, train_block: int = 16_384, test_block: int = 8_192
) -> tuple[np.ndarray, np.ndarray]:
    """Every (train row, test row) with cosine > threshold, by blocked exact matrix products."""
    found_i: list[np.ndarray] = []
    found_j: list[np.ndarray] = []
    q = torch.from_numpy(np.ascontiguousarray(test, dtype=np.float32))
    for s in range(0, len(train), train_block):
        t = torch.from_numpy(np.ascontiguousarray(train[s : s + train_block], dtype=np.float32))
        for u in range(0, len(q), test_block):
            hits = torch.nonzero(t @ q[u : u + test_block].T > threshold)
            found_i.append(hits[:, 0].numpy() + s)
            found_j.append(hits[:, 1].numpy() + u)
    if not found_i:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(found_i).astype(np.int64), np.concatenate(found_j).astype(np.int64)


def pair_set(i: np.ndarray, j: np.ndarray) -> set[tuple[int, int]]:
    return set(zip(i.tolist(), j.tolist(), strict=True))
