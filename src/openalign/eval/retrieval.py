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

Recall at K only needs ranks below the largest K, which lets the one big matrix product run in bfloat16 on
CPUs that multiply it natively (half the work of float32) without changing a single rank: each score's
error has a proven bound, wrong items are counted when they certainly reach the bar, and the few that only
possibly do are scored exactly in float64 for the queries that can still rank below K. Queries whose count
of certain wrong items reaches K are settled and skipped from then on.

:func:`recall_at_k_sets` is the same measure when each query has its own set of correct candidates (CxC's
extended positives, text→text and image→image retrieval).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from openalign.eval.sets import RetrievalSet
from openalign.eval.tasks import Option, Task, register
from openalign.hardware import cpu_has_bfloat16_dot

if TYPE_CHECKING:
    from openalign.model.dual_encoder import DualEncoder
    from openalign.text.tokenizer import TextTokenizer

DEFAULT_KS = (1, 5, 10)
TIE_TOLERANCE = 1e-6
# Scores are made one tile at a time, 1024 images × 2048 captions (8 MiB of float32), which stays in the L3
# cache until its comparisons are done; the comparisons then walk it in stripes of 128 rows (1 MiB) so the
# second comparison of a stripe reads what the first just brought into L2. Larger tiles mean fewer matrix
# products, whose start and end cost most when another process holds a core.
_TILE_ROWS = 1024
_TILE_ELEMENTS = 2 * 1024 * 1024
_STRIPE_ROWS = 128
_PAIRS_AT_ONCE = 512  # pairs scored at a time: their gathered rows stay in L2

Precision = Literal["auto", "float32", "bfloat16"]


def _as_matrix(x: Any, name: str) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x).detach().cpu()
    if t.ndim != 2 or t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty [N, D] matrix, got shape {list(t.shape)}")
    if not t.is_floating_point():
        t = t.float()
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    # NaN propagates through max; either extreme being infinite is the only other way to be non-finite.
    if not (math.isfinite(float(t.amax())) and math.isfinite(float(t.amin()))):
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
    max_rank: int | None = None,
    precision: Precision = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pessimistic ranks (0 = first) of every image query's best caption and every caption query's image.

    Returns ``(i2t_rank [N], t2i_rank [M])``. Embeddings are compared by dot product (pass L2-normalised
    rows for cosine similarity). Scores are made ``block_size`` image rows × ``block_columns`` captions at a
    time (default 1024 × 2048); the tile shape changes the speed, not the ranks.

    With ``max_rank`` every rank at or above it is reported as ``max_rank`` (all that recall at K ≤ max_rank
    needs). That allows ``precision="bfloat16"``: scores from bfloat16 copies of the embeddings, half the
    arithmetic on CPUs with bfloat16 dot-product instructions, with a proven bound on their error; every
    query whose rank below ``max_rank`` that error could change is recounted exactly in float64, so the ranks
    are the float32 path's. ``"auto"`` takes it for large float32 inputs on such CPUs.
    """
    x, y, ids = _checked_inputs(image_emb, text_emb, text_image_ids)
    if max_rank is not None and (isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1):
        raise ValueError(f"max_rank must be a positive integer, got {max_rank!r}")
    if precision not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"precision must be 'auto', 'float32' or 'bfloat16', got {precision!r}")
    if precision == "bfloat16" and max_rank is None:
        raise ValueError("precision='bfloat16' needs max_rank: only ranks below it are recounted exactly")
    n, m = x.shape[0], y.shape[0]
    rows = max(1, min(n, block_size or _TILE_ROWS))
    cols = max(1, min(m, block_columns or max(_TILE_ELEMENTS // rows, 1)))
    if precision == "bfloat16" or (precision == "auto" and max_rank is not None and _bfloat16_pays(x, y)):
        assert max_rank is not None
        i2t, t2i = _bfloat16_ranks(x, y, ids, tie_tolerance, max_rank, rows, cols)
    else:
        # Each caption's score with its own image is the bar every other image must stay below (text→image);
        # an image's best own-caption score is the bar for every other caption (image→text).
        own, best = _own_scores(x, y, ids)
        text_bar = (own - tie_tolerance).numpy()
        image_bar = (best - tie_tolerance).numpy()
        t2i, i2t = _count_reaching(x, y, ids, text_bar, image_bar, rows, cols)
        if max_rank is not None:
            np.minimum(t2i, max_rank, out=t2i)
            np.minimum(i2t, max_rank, out=i2t)
    return torch.from_numpy(i2t).long(), torch.from_numpy(t2i).long()


def _checked_inputs(
    image_emb: Any, text_emb: Any, text_image_ids: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    return x, y, ids


def _own_scores(
    x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor, *, exact: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each caption's score with its own image, and each image's best score with one of its captions; in
    float64 when ``exact``."""
    own = _pair_scores(x, y, ids, torch.arange(y.shape[0]), exact=exact)
    best = torch.full((x.shape[0],), -torch.inf, dtype=own.dtype).scatter_reduce_(0, ids, own, reduce="amax")
    return own, best


def _score_tiles(
    x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor, rows: int, cols: int
) -> Iterator[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]]:
    """``(r0, c0, scores, own_rows, own_cols)`` per tile: ``scores = x[r0:r1] @ y[c0:c1].T`` as a numpy view that
    the next tile overwrites (float32 for bfloat16 inputs, which float32 holds exactly), and the own pairs
    (image, caption) that fall inside the tile."""
    n, m = x.shape[0], y.shape[0]
    low = x.dtype == torch.bfloat16
    # Own pairs grouped by tile, so each tile finds the scores it must not count as wrong items by slicing.
    n_col_tiles = -(-m // cols)
    tile_of = (ids // rows) * n_col_tiles + torch.arange(m) // cols
    order = torch.argsort(tile_of, stable=True)
    bounds = [0, *torch.cumsum(torch.bincount(tile_of, minlength=-(-n // rows) * n_col_tiles), 0).tolist()]
    own_rows, own_cols = ids[order].numpy(), order.numpy()
    score_buf = torch.empty(rows * cols, dtype=torch.float32 if low else x.dtype)
    product_buf = torch.empty(rows * cols, dtype=x.dtype) if low else score_buf
    score_np = score_buf.numpy()
    tile = 0
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        x_block = x[r0:r1]
        for c0 in range(0, m, cols):
            c1 = min(m, c0 + cols)
            size = (r1 - r0) * (c1 - c0)
            product = product_buf[:size].view(r1 - r0, c1 - c0)
            torch.mm(x_block, y[c0:c1].T, out=product)
            if low:
                score_buf[:size].view(r1 - r0, c1 - c0).copy_(product)
            lo, hi = bounds[tile], bounds[tile + 1]
            tile += 1
            yield r0, c0, score_np[:size].reshape(r1 - r0, c1 - c0), own_rows[lo:hi], own_cols[lo:hi]


def _stripes(scores: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    for s0 in range(0, scores.shape[0], _STRIPE_ROWS):
        yield s0, scores[s0 : s0 + _STRIPE_ROWS]


def _pair_scores(
    x: torch.Tensor, y: torch.Tensor, images: torch.Tensor, captions: torch.Tensor, *, exact: bool = False
) -> torch.Tensor:
    """``x[images[k]] · y[captions[k]]`` for every k, in float64 when ``exact`` (float32 products and their
    sums are then exact to far below the tie tolerance); a few hundred pairs at a time, so the gathered rows
    stay in cache."""
    dtype = torch.float64 if exact else x.dtype
    out = torch.empty(len(images), dtype=dtype)
    for a in range(0, len(images), _PAIRS_AT_ONCE):
        i, c = images[a : a + _PAIRS_AT_ONCE], captions[a : a + _PAIRS_AT_ONCE]
        torch.linalg.vecdot(x[i].to(dtype), y[c].to(dtype), out=out[a : a + len(i)])
    return out


def _count_reaching(
    x: torch.Tensor,
    y: torch.Tensor,
    ids: torch.Tensor,
    text_bar: np.ndarray,
    image_bar: np.ndarray,
    rows: int,
    cols: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Per caption, how many other images score at or above its bar; per image, how many captions of other
    images score at or above its bar."""
    n, m = x.shape[0], y.shape[0]
    t2i = np.zeros(m, dtype=np.int32)
    i2t = np.zeros(n, dtype=np.int32)
    image_col = image_bar[:, None]
    # The comparisons run in numpy, on this thread: as hundreds of short parallel torch ops they would each
    # stall whenever another process holds a core; here they cost little next to the products.
    reach_buf = np.empty(min(rows, _STRIPE_ROWS) * cols, dtype=np.bool_)
    for r0, c0, scores, own_i, own_j in _score_tiles(x, y, ids, rows, cols):
        c1 = c0 + scores.shape[1]
        for s0, stripe in _stripes(scores):
            reach = reach_buf[: stripe.size].reshape(stripe.shape)
            # Bytes summed into int32: no int64 mask or counts are ever materialised.
            np.greater_equal(stripe, text_bar[c0:c1], out=reach)
            t2i[c0:c1] += reach.view(np.uint8).sum(0, dtype=np.int32)
            np.greater_equal(stripe, image_col[r0 + s0 : r0 + s0 + len(stripe)], out=reach)
            i2t[r0 + s0 : r0 + s0 + len(stripe)] += reach.view(np.uint8).sum(1, dtype=np.int32)
        # The tile's own pairs were counted above when they reached the bar; take them back out.
        if len(own_i):
            s = scores[own_i - r0, own_j - c0]
            t2i[own_j] -= s >= text_bar[own_j]
            np.subtract.at(i2t, own_i, (s >= image_bar[own_i]).astype(np.int32))
    return t2i, i2t


# bfloat16 keeps an 8-bit significand: rounding to it moves a value by at most 2^-8 of itself (unit roundoff),
# which also bounds the move measured against the rounded value to 2^-8 / (1 - 2^-8); float32 sums move by
# at most 2^-24 of the running sum per addition.
_BF16_UNIT = 2.0**-8
_BF16_ROUNDING = _BF16_UNIT / (1 - _BF16_UNIT)
_FP32_UNIT = 2.0**-24
_BF16_MIN_WORK = 1 << 30  # multiply-adds below which float32 is fast enough not to bother


def _bfloat16_pays(x: torch.Tensor, y: torch.Tensor) -> bool:
    big = x.shape[0] * y.shape[0] * x.shape[1] >= _BF16_MIN_WORK
    return x.dtype == torch.float32 and big and cpu_has_bfloat16_dot()


class _Bracket:
    """One direction's ranks from bfloat16 scores, bracketed by their error bound.

    Per query (a caption ranking images, or an image ranking captions): how many wrong items certainly reach
    its bar, and the (image, caption, score) triples of those that only possibly do. Once the sure count
    reaches ``max_rank`` the query's rank is settled and its items stop being looked at.
    """

    def __init__(self, bar: np.ndarray, eps: np.ndarray, max_rank: int) -> None:
        self.bar, self.eps, self.max_rank = bar, eps, max_rank
        self.sure_at = _score_reaching(bar + eps, sure=True)
        self.maybe_at = _score_reaching(bar - eps)  # +inf once the query is settled
        self.sure = np.zeros(len(bar), dtype=np.int32)
        self._band: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def take(self, lo: int, query: np.ndarray, image: np.ndarray, caption: np.ndarray, score: np.ndarray) -> None:
        """Items that reached their query's ``maybe_at``, own pairs already removed; queries lie in
        [lo, lo + the span the caller scanned)."""
        if not len(query):
            return
        sure = score >= self.sure_at[query]
        counts = np.bincount(query[sure] - lo)
        span = slice(lo, lo + len(counts))
        self.sure[span] += counts.astype(np.int32)
        settled = np.flatnonzero(self.sure[span] >= self.max_rank)
        self.maybe_at[lo + settled] = np.inf
        band = ~sure
        if band.any():
            self._band.append((image[band].astype(np.int32), caption[band].astype(np.int32), score[band]))

    def ranks(self, query_of: str, exact_scores: Any) -> np.ndarray:
        """Ranks capped at ``max_rank``: the sure count plus the kept items whose exact score reaches the bar."""
        rank = np.minimum(self.sure, self.max_rank)
        if not self._band:
            return rank
        image, caption, approx = (np.concatenate(parts) for parts in zip(*self._band, strict=True))
        query = caption if query_of == "caption" else image
        take = self.sure[query] < self.max_rank
        image, caption, approx, query = image[take], caption[take], approx[take], query[take]
        exact = exact_scores(image, caption)
        # The bound is what makes these ranks exact; check it wherever an exact score is at hand.
        slack = self.eps[query] + _BF16_ROUNDING * np.abs(approx.astype(np.float64))
        broken = np.flatnonzero(np.abs(exact - approx) > slack)
        if len(broken):
            k = broken[0]
            raise RuntimeError(
                f"bfloat16 score of image {image[k]} and caption {caption[k]} is {approx[k]:.6g}, exact "
                f"{exact[k]:.6g}: outside the error bound {slack[k]:.3g}; use precision='float32'"
            )
        rank += np.bincount(query[exact >= self.bar[query]], minlength=len(rank)).astype(rank.dtype)
        return np.minimum(rank, self.max_rank)


def _bfloat16_ranks(
    x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor, tie_tolerance: float, max_rank: int, rows: int, cols: int
) -> tuple[np.ndarray, np.ndarray]:
    """Ranks capped at ``max_rank`` from bfloat16 scores bracketed by their error bound.

    For a pair (a, b) whose bfloat16 copies differ by (da, db), the exact dot product of the copies is within
    |a||db| + |da||b| + |da||db| of a·b (Cauchy-Schwarz); summing it in float32 adds at most γ|ã||b̃|, with
    γ = k u / (1 - k u) for k additions (2d allowed, for sums split across blocks); rounding the sum to
    bfloat16 moves it by at most 2^-8 / (1 - 2^-8) of the rounded value. A wrong item is "sure" when even its
    lowest possible exact score reaches the bar, "maybe" when its highest does; the maybe-but-not-sure items
    of queries that can still rank below ``max_rank`` are scored exactly in float64 at the end.
    """
    d = x.shape[1]
    own, best = _own_scores(x, y, ids, exact=True)
    xb, yb = x.bfloat16(), y.bfloat16()

    def norms(a: torch.Tensor, ab: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # A value minus its bfloat16 rounding is exact in its own dtype, and |ã| ≤ |a| + |ã - a|. A float32
        # norm is within (d + 2) u of the true one; scaled up by twice that, it is an upper bound.
        up = 1 + 2 * (d + 2) * _FP32_UNIT
        norm, err = (torch.linalg.vector_norm(t, dim=1).double() * up for t in (a, ab.to(a.dtype).sub_(a)))
        return norm, err, norm + err

    x_norm, x_err, xb_norm = norms(x, xb)
    y_norm, y_err, yb_norm = norms(y, yb)
    gamma = 2 * d * _FP32_UNIT / (1 - 2 * d * _FP32_UNIT)

    def bound(q: tuple[torch.Tensor, ...], c: tuple[torch.Tensor, ...]) -> np.ndarray:
        # Against every candidate at once: the largest candidate norms stand in for each one's own.
        (q_norm, q_err, qb_norm), (c_norm, c_err, cb_norm) = q, (t.max() for t in c)
        return (q_norm * c_err + q_err * c_norm + q_err * c_err + gamma * qb_norm * cb_norm + 1e-30).numpy()

    t2i = _Bracket((own - tie_tolerance).numpy(), bound((y_norm, y_err, yb_norm), (x_norm, x_err, xb_norm)), max_rank)
    i2t = _Bracket((best - tie_tolerance).numpy(), bound((x_norm, x_err, xb_norm), (y_norm, y_err, yb_norm)), max_rank)
    own_image = ids.numpy()
    image_maybe_col = i2t.maybe_at[:, None]  # a view: settling an image shows through

    mask_buf = np.empty(min(rows, _STRIPE_ROWS) * cols, dtype=np.bool_)
    for r0, c0, scores, _, _ in _score_tiles(xb, yb, ids, rows, cols):
        width = scores.shape[1]
        for s0, stripe in _stripes(scores):
            a = r0 + s0
            mask = mask_buf[: stripe.size].reshape(stripe.shape)
            flat = stripe.reshape(-1)
            for bracket, bars, by_caption in (
                (t2i, t2i.maybe_at[c0 : c0 + width], True),
                (i2t, image_maybe_col[a : a + len(stripe)], False),
            ):
                np.greater_equal(stripe, bars, out=mask)
                idx = np.flatnonzero(mask)
                if not len(idx):
                    continue
                r, c = np.divmod(idx, width)
                image, caption = r + a, c + c0
                wrong = own_image[caption] != image
                image, caption, score = image[wrong], caption[wrong], flat[idx[wrong]]
                if by_caption:
                    bracket.take(c0, caption, image, caption, score)
                else:
                    bracket.take(a, image, image, caption, score)

    def exact_scores(image: np.ndarray, caption: np.ndarray) -> np.ndarray:
        return _pair_scores(x, y, torch.from_numpy(image), torch.from_numpy(caption), exact=True).numpy()

    return i2t.ranks("image", exact_scores), t2i.ranks("caption", exact_scores)


def _score_reaching(bar: np.ndarray, *, sure: bool = False) -> np.ndarray:
    """The float32 threshold on bfloat16 scores at which the exact score certainly (``sure``) or possibly
    reaches ``bar`` (already widened by the input error), the bfloat16 rounding being at most
    ``_BF16_ROUNDING`` of the rounded score."""
    r = _BF16_ROUNDING
    # s - r|s| (the lowest exact score) and s + r|s| (the highest) increase with s; invert them piecewise.
    positive, negative = (1 - r, 1 + r) if sure else (1 + r, 1 - r)
    t = np.where(bar >= 0, bar / positive, bar / negative)
    t32 = t.astype(np.float32)
    # Rounding the threshold to float32 must never let through a score that should not pass, or the reverse.
    if sure:
        return np.where(t32 < t, np.nextafter(t32, np.float32(np.inf)), t32)
    return np.where(t32 > t, np.nextafter(t32, np.float32(-np.inf)), t32)


def recall_at_k(
    image_emb: Any,
    text_emb: Any,
    text_image_ids: Sequence[int] | np.ndarray | torch.Tensor,
    ks: Sequence[int] = DEFAULT_KS,
    *,
    tie_tolerance: float = TIE_TOLERANCE,
    precision: Precision = "auto",
) -> dict[str, float]:
    """Image→text and text→image recall at each K, in percent.

    ``image_emb`` [N, D] and ``text_emb`` [M, D] are L2-normalised embeddings (tensors or arrays);
    ``text_image_ids[j]`` is the index of the image caption j describes (several captions per image;
    every image needs at least one). Returns ``{"i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", ...}``.
    ``precision`` is :func:`retrieval_ranks`'s; every choice gives the same recalls.
    """
    ks = tuple(ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"ks must be positive integers, got {list(ks)}")
    i2t, t2i = retrieval_ranks(
        image_emb, text_emb, text_image_ids, tie_tolerance=tie_tolerance, max_rank=max(ks), precision=precision
    )
    out: dict[str, float] = {}
    for name, ranks in (("i2t", i2t), ("t2i", t2i)):
        for k in ks:
            out[f"{name}_r{k}"] = 100.0 * float((ranks < k).double().mean())
    return out


def topk_recall_at_k(
    image_emb: Any,
    text_emb: Any,
    text_image_ids: Sequence[int] | np.ndarray | torch.Tensor,
    ks: Sequence[int] = DEFAULT_KS,
    *,
    block_size: int = 1024,
) -> dict[str, float]:
    """Recall at each K, in percent, with ties handed out as ``torch.topk`` orders them: CLIP_benchmark's rule.

    A query hits at K when a correct item is among the K indices ``topk`` returns for its row of
    caption × image scores (text→image) or of that matrix's transpose (image→text), each K its own ``topk``
    as CLIP_benchmark calls it. Returns ``{"topk_i2t_r1", …, "topk_t2i_r10"}``; rows are scored
    ``block_size`` queries at a time.
    """
    x, y, ids = _checked_inputs(image_emb, text_emb, text_image_ids)
    ks = tuple(ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"ks must be positive integers, got {list(ks)}")
    caption_ids = ids.long()
    hits = {f"topk_{name}_r{k}": 0 for name in ("i2t", "t2i") for k in ks}
    for lo in range(0, y.shape[0], block_size):
        scores = y[lo : lo + block_size] @ x.T
        for k in ks:
            top = torch.topk(scores, min(k, x.shape[0]), dim=1).indices
            hits[f"topk_t2i_r{k}"] += int((top == caption_ids[lo : lo + block_size, None]).any(1).sum())
    for lo in range(0, x.shape[0], block_size):
        scores = (y @ x[lo : lo + block_size].T).T  # the caption × image matrix's columns, as CLIP_benchmark takes
        for k in ks:
            top = torch.topk(scores, min(k, y.shape[0]), dim=1).indices
            own = caption_ids[top] == torch.arange(lo, lo + scores.shape[0])[:, None]
            hits[f"topk_i2t_r{k}"] += int(own.any(1).sum())
    counts = {"i2t": x.shape[0], "t2i": y.shape[0]}
    return {key: 100.0 * n / counts[key.split("_")[1]] for key, n in hits.items()}


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


def evaluate_retrieval(
    model: DualEncoder,
    tokenizer: TextTokenizer,
    dataset: RetrievalSet,
    *,
    batch_size: int = 64,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> dict[str, Any]:
    """Embed a :class:`RetrievalSet` and return its recalls (``"i2t_r1"``, …, ``"t2i_r10"``, in percent),
    their mean (the "mean recall" of multilingual retrieval papers) and the set's size.

    The model's training mode and the global random state are left as they were, so evaluating between
    training steps does not change what training does next.
    """
    from openalign.embed import embed_images, embed_texts

    devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        images = embed_images(model, dataset.images, batch_size=batch_size, device=device, progress=progress)
        texts = embed_texts(
            model, tokenizer, dataset.captions, batch_size=max(batch_size, 256), device=device, progress=progress
        )
    metrics: dict[str, Any] = recall_at_k(images, texts, dataset.text_image_ids)
    metrics["mean_recall"] = sum(metrics.values()) / len(metrics)
    metrics.update(topk_recall_at_k(images, texts, dataset.text_image_ids))  # what --format clip_benchmark writes
    metrics["num_images"] = len(dataset.images)
    metrics["num_captions"] = len(dataset.captions)
    return metrics


def _run(model: DualEncoder, tokenizer: TextTokenizer, options: dict[str, Any]) -> dict[str, Any]:
    from openalign.eval.datasets import load_retrieval
    from openalign.eval.tasks import max_annotation_bytes, max_file_bytes

    dataset = load_retrieval(
        options["dataset"],
        options["images"],
        options["split"],
        max_file_bytes=max_file_bytes(options),
        max_annotation_bytes=max_annotation_bytes(options),
    )
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
