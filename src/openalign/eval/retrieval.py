"""Image-text retrieval recall (paper Tables 4-5): image→text and text→image R@K.

Definitions, as in the paper and the Flickr30K / MSCOCO literature (5 captions per image):

- image→text: an image query hits at K if ANY of its captions is among the K highest-scoring captions;
- text→image: a caption query hits at K if ITS image is among the K highest-scoring images;
- R@K is the percentage of queries that hit; every query is in the denominator.

Ties are broken pessimistically: a wrong item scoring the same as the best correct one ranks above it.
So a query's rank is the number of wrong items scoring at least as high as its best correct item, and
it hits at K when that rank is below K. A model that maps everything to one point therefore scores 0
instead of the chance-level luck a ``topk`` with index tie-breaking would give it. Because the
correct caption's score is computed separately from the blocked score matrix, scores within
``tie_tolerance`` (default 1e-6, above float32 matmul rounding for unit vectors) count as ties.

Scores are computed in blocks of image rows, so 5K images × 25K captions need a few hundred MB at most,
and each score is computed once for both directions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from openalign.eval.tasks import Option, Task, register

DEFAULT_KS = (1, 5, 10)
TIE_TOLERANCE = 1e-6
_BLOCK_ELEMENTS = 16 * 1024 * 1024  # scores per block: 64 MB of float32


def _as_matrix(x: Any, name: str) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x).detach().cpu()
    if t.ndim != 2 or t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty [N, D] matrix, got shape {list(t.shape)}")
    if not t.is_floating_point():
        t = t.float()
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or infinite values")
    return t


def retrieval_ranks(
    image_emb: Any,
    text_emb: Any,
    text_image_ids: Any,
    *,
    tie_tolerance: float = TIE_TOLERANCE,
    block_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pessimistic ranks (0 = first) of every image query's best caption and every caption query's image.

    Returns ``(i2t_rank [N], t2i_rank [M])``. Embeddings are compared by dot product (pass L2-normalised
    rows for cosine similarity). ``block_size`` image rows are scored at a time (default: 64 MB of scores).
    """
    x = _as_matrix(image_emb, "image_emb")
    y = _as_matrix(text_emb, "text_emb")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"image_emb has {x.shape[1]} dims, text_emb has {y.shape[1]}")
    dtype = torch.promote_types(x.dtype, y.dtype)
    x, y = x.to(dtype), y.to(dtype)
    ids = torch.as_tensor(
        np.asarray(text_image_ids) if not isinstance(text_image_ids, torch.Tensor) else text_image_ids
    )
    n, m = x.shape[0], y.shape[0]
    if ids.ndim != 1 or ids.shape[0] != m:
        raise ValueError(f"text_image_ids must have one entry per caption ({m}), got shape {list(ids.shape)}")
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"text_image_ids must be integer image indices, got {ids.dtype}")
    ids = ids.long()
    if m and (int(ids.min()) < 0 or int(ids.max()) >= n):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise ValueError(f"text_image_ids contains {bad}, outside the {n} images")
    per_image = torch.bincount(ids, minlength=n)
    if bool((per_image == 0).any()):
        lonely = int((per_image == 0).nonzero()[0])
        raise ValueError(f"image {lonely} has no caption in text_image_ids ({int((per_image == 0).sum())} such images)")

    # Each caption's score with its own image, the bar every other image must stay below.
    own = (x[ids] * y).sum(1)
    t2i_rank = torch.zeros(m, dtype=torch.long)
    i2t_rank = torch.empty(n, dtype=torch.long)
    cols = torch.arange(m)
    block = block_size or max(1, _BLOCK_ELEMENTS // m)
    for start in range(0, n, block):
        end = min(n, start + block)
        scores = x[start:end] @ y.T  # [b, M]
        mine = (ids >= start) & (ids < end)  # captions whose image is in this block
        rows = ids[mine] - start
        own_block = scores[rows, cols[mine]]

        # text→image: images in this block that reach the caption's own score; the own image is excluded
        at_least = scores >= (own - tie_tolerance)
        # Summing the bool mask as bytes into int32 is ~2.5x faster than torch's default int64 bool sum.
        counts = at_least.view(torch.uint8).sum(0, dtype=torch.int32)
        counts[mine] -= at_least[rows, cols[mine]].int()
        t2i_rank += counts

        # image→text: wrong captions reaching the image's best caption score
        best = torch.full((end - start,), -torch.inf, dtype=scores.dtype)
        best.scatter_reduce_(0, rows, own_block, reduce="amax")
        reach = scores >= (best[:, None] - tie_tolerance)
        right = torch.zeros(end - start, dtype=torch.long)
        right.scatter_add_(0, rows, (own_block >= best[rows] - tie_tolerance).long())
        i2t_rank[start:end] = reach.view(torch.uint8).sum(1, dtype=torch.int32) - right
    return i2t_rank, t2i_rank


def recall_at_k(
    image_emb: Any,
    text_emb: Any,
    text_image_ids: Sequence[int] | np.ndarray | torch.Tensor,
    ks: Sequence[int] = DEFAULT_KS,
    *,
    tie_tolerance: float = TIE_TOLERANCE,
) -> dict[str, float]:
    """Image→text and text→image recall at each K, in percent.

    ``image_emb`` [N, D] and ``text_emb`` [M, D] are L2-normalised embeddings (tensors or arrays);
    ``text_image_ids[j]`` is the index of the image caption j describes (several captions per image;
    every image needs at least one). Returns ``{"i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", ...}``.
    """
    ks = tuple(ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"ks must be positive integers, got {list(ks)}")
    i2t, t2i = retrieval_ranks(image_emb, text_emb, text_image_ids, tie_tolerance=tie_tolerance)
    out: dict[str, float] = {}
    for name, ranks in (("i2t", i2t), ("t2i", t2i)):
        for k in ks:
            out[f"{name}_r{k}"] = 100.0 * float((ranks < k).double().mean())
    return out


# --------------------------------------------------------------------------------------------------
# The `retrieval` eval task


def evaluate_retrieval(
    model: Any,
    tokenizer: Any,
    dataset: Any,
    *,
    batch_size: int = 64,
    device: str = "cpu",
    progress: bool = True,
) -> dict[str, Any]:
    """Embed a :class:`~openalign.eval.datasets.RetrievalSet` and return its recalls, their mean (the
    "mean recall" of multilingual retrieval papers) and the set's size."""
    from openalign.embed import embed_images, embed_texts

    images = embed_images(model, dataset.images, batch_size=batch_size, device=device, progress=progress)
    texts = embed_texts(
        model, tokenizer, dataset.captions, batch_size=max(batch_size, 256), device=device, progress=progress
    )
    metrics: dict[str, Any] = recall_at_k(images, texts, dataset.text_image_ids)
    metrics["mean_recall"] = sum(metrics.values()) / len(metrics)
    metrics["num_images"] = len(dataset.images)
    metrics["num_captions"] = len(dataset.captions)
    return metrics


def _run(model: Any, tokenizer: Any, options: dict[str, Any]) -> dict[str, Any]:
    from openalign.eval.datasets import load_retrieval

    dataset = load_retrieval(options["dataset"], options["images"], options["split"])
    metrics = evaluate_retrieval(model, tokenizer, dataset, batch_size=options["batch_size"], device=options["device"])
    return {"dataset": dataset.name, **metrics}


register(
    Task(
        "retrieval",
        _run,
        "zero-shot image-text retrieval R@1/5/10 (Flickr30K, MSCOCO, WebDataset, CSV)",
        options=(
            Option(
                "dataset",
                required=True,
                metavar="SPEC",
                help="karpathy:dataset_flickr30k.json, coco:captions_val2014.json, csv:pairs.csv or "
                "wds:shards/{0..3}.tar",
            ),
            Option("images", metavar="DIR", help="image root for Karpathy / COCO JSON (and relative CSV paths)"),
            Option("split", default="test", help="Karpathy split to evaluate (default test)"),
        ),
        examples=(
            "openalign eval retrieval --model runs/b0/final --dataset karpathy:dataset_flickr30k.json "
            "--images flickr30k-images --out results/",
            "openalign eval retrieval --model runs/b0/final --dataset karpathy:dataset_coco.json --images coco/ "
            "--name mscoco",
            "openalign eval retrieval --model runs/b0/final --dataset wds:'flickr_test/{0..4}.tar'",
        ),
        description="Image→text and text→image recall at 1, 5 and 10. An image query hits if any of its "
        "captions ranks in the top K, a caption query if its image does; ties count against the query.",
    )
)
