"""Retrieval recall against its floor: the one matrix product every score needs, in the same run.

``recall_at_k`` on N images × 5N captions costs one N × 5N matrix product plus the counting of wrong
items above each bar. The product alone, done in one call into a full score matrix, is the baseline:
the ratio of the two is the counting's overhead, and stays meaningful on a machine busy with other work
because both are timed in the same process, in alternating rounds, each keeping its best round.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from openalign.eval.retrieval import recall_at_k


@dataclass
class RetrievalBenchSettings:
    images: int = 5000
    captions_per_image: int = 5
    dim: int = 640
    rounds: int = 3
    seed: int = 0
    json_path: str | None = None


def run_retrieval_bench(settings: RetrievalBenchSettings) -> dict[str, Any]:
    """Time ``recall_at_k`` and the bare matrix product on random unit vectors; print and return both."""
    if min(settings.images, settings.captions_per_image, settings.dim, settings.rounds) < 1:
        raise ValueError("images, captions_per_image, dim and rounds must be positive")
    gen = torch.Generator().manual_seed(settings.seed)
    n, m = settings.images, settings.images * settings.captions_per_image
    images = torch.nn.functional.normalize(torch.randn(n, settings.dim, generator=gen), dim=1)
    texts = torch.nn.functional.normalize(torch.randn(m, settings.dim, generator=gen), dim=1)
    ids = torch.arange(m) // settings.captions_per_image
    print(f"retrieval recall: {n} images × {m} captions × {settings.dim} dims, {torch.get_num_threads()} threads")
    matmul, recall = [], []
    for _ in range(settings.rounds):
        start = time.perf_counter()
        images @ texts.T
        matmul.append(time.perf_counter() - start)
        start = time.perf_counter()
        recall_at_k(images, texts, ids)
        recall.append(time.perf_counter() - start)
    result = {
        **asdict(settings),
        "matmul_s": min(matmul),
        "recall_at_k_s": min(recall),
        "ratio": min(recall) / min(matmul),
        "threads": torch.get_num_threads(),
    }
    print(f"  matrix product alone  {result['matmul_s']:.3f} s (best of {settings.rounds})")
    print(f"  recall_at_k           {result['recall_at_k_s']:.3f} s  = {result['ratio']:.2f} × the product")
    if settings.json_path:
        with open(settings.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return result
