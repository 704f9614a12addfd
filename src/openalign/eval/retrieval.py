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

Scores are computed in cache-sized tiles of image rows × caption columns and counted for both directions
while the tile is still in cache, so each score is computed once and the working memory stays at a few
tens of MB however many images and captions there are.

:func:`recall_at_k_sets` is the same measure when each query has its own set of correct candidates (CxC's
extended positives, text→text and image→image retrieval).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from openalign.eval.tasks import Option, Task, register

DEFAULT_KS = (1, 5, 10)
TIE_TOLERANCE = 1e-6
# Scores are made one tile at a time, 1024 images × 2048 captions (8 MiB of float32), which stays in the L3
# cache until its comparisons are done; the comparisons then walk it in stripes of 128 rows (1 MiB) so the
# second comparison of a stripe reads what the first just brought into L2. Larger tiles mean fewer matrix
# products, whose start and end cost most when another process holds a core.
_TILE_ROWS = 1024
_TILE_ELEMENTS = 2 * 1024 * 1024
_STRIPE_ROWS = 128


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
    block_columns: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pessimistic ranks (0 = first) of every image query's best caption and every caption query's image.

    Returns ``(i2t_rank [N], t2i_rank [M])``. Embeddings are compared by dot product (pass L2-normalised
    rows for cosine similarity). Scores are made ``block_size`` image rows × ``block_columns`` captions at a
    time (default 1024 × 2048); the tile shape changes the speed, not the ranks.
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

    # Each caption's score with its own image is the bar every other image must stay below (text→image);
    # an image's best own-caption score is the bar for every other caption (image→text).
    own = torch.cat([(x[ids[a : a + 8192]] * y[a : a + 8192]).sum(1) for a in range(0, m, 8192)])
    best = torch.full((n,), -torch.inf, dtype=dtype).scatter_reduce_(0, ids, own, reduce="amax")
    text_bar = (own - tie_tolerance).numpy()
    image_bar = (best - tie_tolerance).numpy()[:, None]

    rows = max(1, min(n, block_size or _TILE_ROWS))
    cols = max(1, min(m, block_columns or max(_TILE_ELEMENTS // rows, 1)))
    # Own pairs grouped by tile, so each tile finds the scores it must not count as wrong items by slicing.
    n_col_tiles = -(-m // cols)
    tile_of = (ids // rows) * n_col_tiles + torch.arange(m) // cols
    order = torch.argsort(tile_of, stable=True)
    bounds = [0, *torch.cumsum(torch.bincount(tile_of, minlength=-(-n // rows) * n_col_tiles), 0).tolist()]
    own_rows, own_cols = ids[order].numpy(), order.numpy()

    t2i_rank = np.zeros(m, dtype=np.int32)
    i2t_rank = np.zeros(n, dtype=np.int32)
    # The comparisons run in numpy, on this thread: as hundreds of short parallel torch ops they would each
    # stall whenever another process holds a core; here they cost little next to the products.
    score_buf = torch.empty(rows * cols, dtype=dtype)
    score_np = score_buf.numpy()
    reach_buf = np.empty(min(rows, _STRIPE_ROWS) * cols, dtype=np.bool_)
    tile = 0
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        x_block = x[r0:r1]
        for c0 in range(0, m, cols):
            c1 = min(m, c0 + cols)
            size = (r1 - r0) * (c1 - c0)
            torch.mm(x_block, y[c0:c1].T, out=score_buf[:size].view(r1 - r0, c1 - c0))
            scores = score_np[:size].reshape(r1 - r0, c1 - c0)
            for s0 in range(0, r1 - r0, _STRIPE_ROWS):
                s1 = min(r1 - r0, s0 + _STRIPE_ROWS)
                stripe = scores[s0:s1]
                reach = reach_buf[: stripe.size].reshape(stripe.shape)
                # Bytes summed into int32: no int64 mask or counts are ever materialised.
                np.greater_equal(stripe, text_bar[c0:c1], out=reach)
                t2i_rank[c0:c1] += reach.view(np.uint8).sum(0, dtype=np.int32)
                np.greater_equal(stripe, image_bar[r0 + s0 : r0 + s1], out=reach)
                i2t_rank[r0 + s0 : r0 + s1] += reach.view(np.uint8).sum(1, dtype=np.int32)
            # The tile's own pairs were counted above when they reached the bar; take them back out.
            lo, hi = bounds[tile], bounds[tile + 1]
            tile += 1
            if lo < hi:
                i, j = own_rows[lo:hi], own_cols[lo:hi]
                s = scores[i - r0, j - c0]
                t2i_rank[j] -= s >= text_bar[j]
                np.subtract.at(i2t_rank, i, (s >= image_bar[i, 0]).astype(np.int32))
    return torch.from_numpy(i2t_rank).long(), torch.from_numpy(t2i_rank).long()


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
# Retrieval against any set of positives


def recall_at_k_sets(
    query_emb: torch.Tensor,
    cand_emb: torch.Tensor,
    positives: Sequence[Collection[int]],
    ks: Sequence[int] = (1, 5, 10),
    *,
    exclude: Sequence[int | None] | None = None,
    block_size: int = 1024,
) -> dict[str, Any]:
    """Recall@k (%) when each query has a set of correct candidates: a query hits at k when any of its
    positives is among its k best-scored candidates.

    ``positives[q]`` holds candidate indices; ``exclude[q]`` (optional) is one candidate index removed
    from query q's ranking (the query itself in T2T/I2I). Ties count against the query: a positive ranks
    behind every non-positive candidate scoring at least as high, so identical embeddings never score.
    Queries without positives are skipped and counted (``skipped``), never scored as misses or hits.
    Returns ``{"r1": ..., "r5": ..., "queries": evaluated, "skipped": n}``. Scores are dot products
    (cosine for L2-normalised rows); the similarity matrix is built ``block_size`` queries at a time.
    """
    q, c = torch.as_tensor(query_emb).float(), torch.as_tensor(cand_emb).float()
    if q.ndim != 2 or c.ndim != 2 or q.shape[1] != c.shape[1]:
        raise ValueError(
            f"query and candidate embeddings must be [Q, D] and [N, D], got {list(q.shape)}, {list(c.shape)}"
        )
    if len(positives) != q.shape[0]:
        raise ValueError(f"positives has {len(positives)} entries for {q.shape[0]} queries")
    if exclude is not None and len(exclude) != q.shape[0]:
        raise ValueError(f"exclude has {len(exclude)} entries for {q.shape[0]} queries")
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"ks must be positive integers, got {list(ks)}")
    n = c.shape[0]
    for i, pos in enumerate(positives):
        bad = [j for j in pos if not 0 <= j < n]
        if bad:
            raise ValueError(f"query {i}: positive candidate index {bad[0]} is outside [0, {n})")
        if exclude is not None and exclude[i] is not None and exclude[i] in pos:
            raise ValueError(f"query {i}: candidate {exclude[i]} is both excluded and a positive")
    keep = [i for i, pos in enumerate(positives) if len(pos) > 0]
    if not keep:
        raise ValueError("no query has a positive candidate; nothing to evaluate")
    ranks = []
    for start in range(0, len(keep), block_size):
        rows = keep[start : start + block_size]
        sim = q[rows] @ c.T
        is_pos = torch.zeros_like(sim, dtype=torch.bool)
        for r, i in enumerate(rows):
            is_pos[r, list(positives[i])] = True
        if exclude is not None:
            for r, i in enumerate(rows):
                if exclude[i] is not None:
                    sim[r, exclude[i]] = -torch.inf
        best = sim.masked_fill(~is_pos, -torch.inf).max(1, keepdim=True).values
        # -inf marks the excluded candidate; it never outranks a finite positive.
        ranks.append(((sim >= best) & ~is_pos & torch.isfinite(sim)).sum(1))
    rank = torch.cat(ranks)
    out: dict[str, Any] = {f"r{k}": 100.0 * float((rank < k).double().mean()) for k in ks}
    out["queries"] = len(keep)
    out["skipped"] = len(positives) - len(keep)
    return out


# --------------------------------------------------------------------------------------------------
# The `retrieval` eval task


@dataclass
class HeldOutSet:
    """A retrieval set already in memory (e.g. the synthetic world's held-out scenes), in the shape
    :func:`evaluate_retrieval` reads: images, captions, and the image each caption describes."""

    images: list[Any]
    captions: list[str]
    text_image_ids: list[int]


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
