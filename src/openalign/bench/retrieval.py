"""Retrieval recall against its floor: the one float32 matrix product every score needs, in the same run.

``recall_at_k`` on N images × 5N captions needs the N × 5N scores and a count of the wrong items above each
bar. The float32 product alone, done in one call into a full score matrix, is the baseline. Beside it:
``recall_at_k`` with float32 scores, and with its default precision (bfloat16 scores and an exact recount
on CPUs that multiply bfloat16 natively), which must give the very same recalls. Captions are their image's
embedding plus noise, so ranks near the top are as crowded as a real model's; the three are timed in the
same process, in alternating rounds, each keeping its best round, so the ratios stay meaningful on a busy
machine.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from openalign.eval import retrieval


@dataclass
class RetrievalBenchSettings:
    """What ``openalign bench retrieval`` measures."""

    images: int = 5000  # image embeddings (MSCOCO's 5K test images)
    captions_per_image: int = 5  # caption embeddings per image
    dim: int = 640  # embedding width
    # caption = image + noise × N(0, I / dim), normalised (9: a hard set, R@1 far below 100 %); None: independent
    # vectors
    noise: float | None = 9.0
    rounds: int = 3  # timed rounds; the best is kept
    seed: int = 0  # data seed
    json_path: str | None = None  # also write the results to this JSON file


def bench_embeddings(settings: RetrievalBenchSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(settings.seed)
    n, m, d = settings.images, settings.images * settings.captions_per_image, settings.dim
    images = torch.nn.functional.normalize(torch.randn(n, d, generator=gen), dim=1)
    ids = torch.arange(m) // settings.captions_per_image
    noise = torch.randn(m, d, generator=gen)
    texts = noise if settings.noise is None else images[ids] + settings.noise / d**0.5 * noise
    return images, torch.nn.functional.normalize(texts, dim=1), ids


def run_retrieval_bench(settings: RetrievalBenchSettings) -> dict[str, Any]:
    """Time the bare product and ``recall_at_k`` at float32 and at its default precision; print and return."""
    if min(settings.images, settings.captions_per_image, settings.dim, settings.rounds) < 1:
        raise ValueError("images, captions_per_image, dim and rounds must be positive")
    if settings.noise is not None and settings.noise < 0:
        raise ValueError(f"noise must be non-negative, got {settings.noise}")
    images, texts, ids = bench_embeddings(settings)
    n, m = images.shape[0], texts.shape[0]
    default = "bfloat16" if retrieval._bfloat16_pays(images, texts) else "float32"
    data = "independent random captions" if settings.noise is None else f"captions = image + noise {settings.noise:g}"
    print(f"retrieval recall: {n} images × {m} captions × {settings.dim} dims, {torch.get_num_threads()} threads")
    matmul, exact, fast = [], [], []
    for _ in range(settings.rounds):
        start = time.perf_counter()
        images @ texts.T
        matmul.append(time.perf_counter() - start)
        start = time.perf_counter()
        reference = retrieval.recall_at_k(images, texts, ids, precision="float32")
        exact.append(time.perf_counter() - start)
        start = time.perf_counter()
        metrics = retrieval.recall_at_k(images, texts, ids)
        fast.append(time.perf_counter() - start)
    result = {
        **asdict(settings),
        "matmul_s": min(matmul),
        "recall_at_k_s": min(fast),
        "recall_at_k_float32_s": min(exact),
        "ratio": min(fast) / min(matmul),
        "ratio_float32": min(exact) / min(matmul),
        "default_precision": default,
        "identical": metrics == reference,
        "metrics": metrics,
        "threads": torch.get_num_threads(),
    }
    print(f"  {data}: t2i R@1 {metrics['t2i_r1']:.1f} %, R@10 {metrics['t2i_r10']:.1f} %")
    print(f"  matrix product alone (float32)  {result['matmul_s']:.3f} s (best of {settings.rounds})")
    print(
        f"  recall_at_k, float32 scores     {result['recall_at_k_float32_s']:.3f} s"
        f" = {result['ratio_float32']:.2f} × the product"
    )
    print(f"  recall_at_k, default ({default})  {result['recall_at_k_s']:.3f} s = {result['ratio']:.2f} × the product")
    print(f"  same recalls at both precisions: {'yes' if result['identical'] else 'NO'}")
    if settings.json_path:
        with open(settings.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return result
