"""ALIGN's normalised-softmax contrastive loss, with in-batch negatives gathered across ranks.

Image-to-text and text-to-image cross-entropies with label smoothing are summed (Jia et al. 2021, eq. 1-3).
Under ``torch.distributed`` each rank scores only its own rows against the global batch, so memory is
O(n * N) per rank rather than O(N^2).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from openalign.model.layers import has_values

__all__ = ["contrastive_loss", "global_loss_value", "sigmoid_loss", "uniform_loss"]


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class _AllGatherRows(torch.autograd.Function):
    """Concatenate every rank's rows (sizes may differ); backward hands each row its summed gradient.

    Every rank scores its own rows against all gathered rows, so a row's gradient is spread over all ranks;
    summing over ranks and keeping this rank's slice gives the owner the gradient of the sum of all ranks'
    losses.
    """

    @staticmethod
    def forward(ctx: Any, local: Tensor, sizes: list[int], rank: int) -> Tensor:
        # all_gather needs equal shapes, so ranks with fewer rows pad up to the largest and strip afterwards.
        padded = local.new_zeros((max(sizes), *local.shape[1:]))
        padded[: local.shape[0]] = local
        buckets = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(buckets, padded)
        ctx.start = sum(sizes[:rank])
        ctx.stop = ctx.start + sizes[rank]
        return torch.cat([bucket[:size] for bucket, size in zip(buckets, sizes, strict=True)])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        # Cloned because all_reduce works in place and autograd may still hold this buffer.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad[ctx.start : ctx.stop], None, None


def _columns(image_emb: Tensor, text_emb: Tensor, gather: bool) -> tuple[Tensor, Tensor, Tensor, int]:
    """Every rank's images and texts [N, D] (this rank's alone without ``gather``), the global column index
    of each of this rank's rows' positive [n], and the number of ranks whose rows were gathered."""
    n = image_emb.shape[0]
    world, rank = _world()
    if gather and world > 1:
        if has_values(image_emb):
            size = torch.tensor([n], device=image_emb.device)
            sizes_list = [torch.empty_like(size) for _ in range(world)]
            dist.all_gather(sizes_list, size)
            sizes = [int(s) for s in sizes_list]
        else:  # a planned step (fake tensors, no values to exchange): every rank holds n rows
            sizes = [n] * world
        # One collective for both modalities instead of two.
        both = _AllGatherRows.apply(torch.cat([image_emb, text_emb], dim=1), sizes, rank)
        all_images, all_texts = both.split(image_emb.shape[1], dim=1)
        offset = sum(sizes[:rank])
    else:
        world, all_images, all_texts, offset = 1, image_emb, text_emb, 0
    if all_images.shape[0] == 0:
        raise ValueError("the loss got an empty global batch")
    positives = torch.arange(offset, offset + n, device=image_emb.device)
    return all_images, all_texts, positives, world


class _BlockwiseCrossEntropy(torch.autograd.Function):
    """The summed label-smoothed cross-entropy of ``rows @ cols.T / temperature``, a block of rows at a time.

    Row i's loss is ``lse_i - (1 - eps) z_i,pos - eps / K * sum_j z_ij`` over its K candidate columns (all N,
    or the sampled ``candidates`` [n, K] with the positive first). Forward keeps only each row's log-sum-exp;
    backward recomputes a block's logits and takes ``softmax - (1 - eps) onehot - eps / K`` as their
    gradient, so no [n, N] matrix outlives its block.
    """

    @staticmethod
    def forward(
        ctx: Any,
        rows: Tensor,
        cols: Tensor,
        temperature: Tensor,
        positives: Tensor,
        candidates: Tensor | None,
        label_smoothing: float,
        block: int,
    ) -> Tensor:
        inv_t = 1 / temperature.to(rows.dtype)
        lse = rows.new_empty(rows.shape[0])
        total = rows.new_zeros(())
        for start in range(0, rows.shape[0], block):
            logits, target = _block_logits(rows, cols, inv_t, positives, candidates, start, block)
            lse_b = torch.logsumexp(logits, dim=1)
            positive = logits.gather(1, target[:, None]).squeeze(1)
            smoothed = label_smoothing / logits.shape[1] * logits.sum(dim=1)
            total += (lse_b - (1 - label_smoothing) * positive - smoothed).sum()
            lse[start : start + block] = lse_b
        ctx.save_for_backward(rows, cols, temperature, positives, lse)
        ctx.candidates, ctx.label_smoothing, ctx.block = candidates, label_smoothing, block
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        rows, cols, temperature, positives, lse = ctx.saved_tensors
        candidates, eps, block = ctx.candidates, ctx.label_smoothing, ctx.block
        inv_t = 1 / temperature.to(rows.dtype)
        grad_rows, grad_cols = torch.zeros_like(rows), torch.zeros_like(cols)
        grad_t = rows.new_zeros(())
        for start in range(0, rows.shape[0], block):
            logits, target = _block_logits(rows, cols, inv_t, positives, candidates, start, block)
            g = torch.exp(logits - lse[start : start + block, None])
            g -= eps / logits.shape[1]
            g[torch.arange(g.shape[0], device=g.device), target] -= 1 - eps
            grad_t -= (g * logits).sum() * inv_t  # d logits / d t = -logits / t
            if candidates is not None:  # back onto the columns the candidates name
                g = torch.zeros(g.shape[0], cols.shape[0], dtype=g.dtype, device=g.device).scatter_add_(
                    1, candidates[start : start + block], g
                )
            grad_rows[start : start + block] = g @ cols * inv_t
            grad_cols += g.T @ rows[start : start + block] * inv_t
        return grad_rows * grad, grad_cols * grad, (grad_t * grad).to(temperature.dtype), None, None, None, None


class _BlockwiseBothWays(torch.autograd.Function):
    """Both directions of the loss over one set of pairs (a single process), from one product a block.

    Text-to-image logits are the image-to-text ones transposed, so each block ``S_b = X_b Y^T / t`` gives
    its rows' log-sum-exp and, kept online (a running maximum and sum per column), the columns'. The sum is
    ``sum(row lse) + sum(column lse) - 2 (1 - eps) trace(S) - 2 eps / N sum(S)``, and backward recomputes
    each block: its gradient is the row softmax plus the column softmax less the targets.
    """

    @staticmethod
    def forward(ctx: Any, images: Tensor, texts: Tensor, temperature: Tensor, eps: float, block: int) -> Tensor:
        n = images.shape[0]
        inv_t = 1 / temperature.to(images.dtype)
        row_lse = images.new_empty(n)
        col_max = images.new_full((n,), -math.inf)
        col_sum = images.new_zeros(n)
        for start in range(0, n, block):
            logits = images[start : start + block] @ texts.T * inv_t
            row_lse[start : start + block] = torch.logsumexp(logits, dim=1)
            top = torch.maximum(col_max, logits.amax(dim=0))
            col_sum = col_sum * torch.exp(col_max - top) + torch.exp(logits - top).sum(dim=0)
            col_max = top
        col_lse = col_max + torch.log(col_sum)
        trace = (images * texts).sum() * inv_t
        total = (images.sum(dim=0) @ texts.sum(dim=0)) * inv_t
        ctx.save_for_backward(images, texts, temperature, row_lse, col_lse)
        ctx.eps, ctx.block = eps, block
        return row_lse.sum() + col_lse.sum() - 2 * (1 - eps) * trace - 2 * eps / n * total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        images, texts, temperature, row_lse, col_lse = ctx.saved_tensors
        eps, block, n = ctx.eps, ctx.block, images.shape[0]
        inv_t = 1 / temperature.to(images.dtype)
        grad_images, grad_texts = torch.zeros_like(images), torch.zeros_like(texts)
        grad_t = images.new_zeros(())
        for start in range(0, n, block):
            logits = images[start : start + block] @ texts.T * inv_t
            g = torch.exp(logits - row_lse[start : start + block, None]) + torch.exp(logits - col_lse[None, :])
            g -= 2 * eps / n
            rows = torch.arange(g.shape[0], device=g.device)
            g[rows, rows + start] -= 2 * (1 - eps)
            grad_t -= (g * logits).sum() * inv_t
            grad_images[start : start + block] = g @ texts * inv_t
            grad_texts += g.T @ images[start : start + block] * inv_t
        return grad_images * grad, grad_texts * grad, (grad_t * grad).to(temperature.dtype), None, None


def _block_logits(
    rows: Tensor, cols: Tensor, inv_t: Tensor, positives: Tensor, candidates: Tensor | None, start: int, block: int
) -> tuple[Tensor, Tensor]:
    """Logits of rows ``start:start+block`` against their candidate columns, and each row's positive there."""
    logits = rows[start : start + block] @ cols.T * inv_t
    if candidates is None:
        return logits, positives[start : start + block]
    picked = candidates[start : start + block]
    return logits.gather(1, picked), torch.zeros(picked.shape[0], dtype=torch.long, device=picked.device)


def _num_negatives(num_columns: int, negatives_fraction: float) -> int:
    # Rounded half up: Python's round() would give a 2-column batch at fraction 0.5 no negative at all.
    return int(negatives_fraction * (num_columns - 1) + 0.5)


def _sample_columns(
    positives: Tensor, num_columns: int, num_negatives: int, generator: torch.Generator | None
) -> Tensor:
    """Column indices [n, 1 + num_negatives]: column 0 is each row's positive, the rest a uniformly random
    subset of that row's other columns, drawn independently per row."""
    scores = torch.rand(positives.shape[0], num_columns, generator=generator, device=positives.device)
    # Above any uniform draw, so top-k always keeps the positive and puts it first.
    scores.scatter_(1, positives[:, None], 2.0)
    return scores.topk(num_negatives + 1, dim=1).indices


def _summed_cross_entropy(
    logits: Tensor,
    positives: Tensor,
    label_smoothing: float,
    negatives_fraction: float,
    generator: torch.Generator | None,
) -> Tensor:
    num_negatives = _num_negatives(logits.shape[1], negatives_fraction)
    if num_negatives == logits.shape[1] - 1:
        return F.cross_entropy(logits, positives, reduction="sum", label_smoothing=label_smoothing)
    columns = _sample_columns(positives, logits.shape[1], num_negatives, generator)
    return F.cross_entropy(
        logits.gather(1, columns),
        torch.zeros_like(positives),
        reduction="sum",
        label_smoothing=label_smoothing,
    )


def _validate(
    image_emb: Tensor,
    text_emb: Tensor,
    temperature: Tensor | float,
    label_smoothing: float,
    negatives_fraction: float,
) -> None:
    if image_emb.dim() != 2 or text_emb.dim() != 2:
        raise ValueError(f"embeddings must be 2-D [n, D], got {tuple(image_emb.shape)} and {tuple(text_emb.shape)}")
    if image_emb.shape[1] != text_emb.shape[1]:
        raise ValueError(f"embedding widths differ: image {image_emb.shape[1]}, text {text_emb.shape[1]}")
    if image_emb.shape[0] != text_emb.shape[0]:
        raise ValueError(f"batch sizes differ: {image_emb.shape[0]} images, {text_emb.shape[0]} texts")
    if not image_emb.is_floating_point() or image_emb.dtype != text_emb.dtype:
        raise ValueError(
            f"embeddings must share one floating dtype, got image {image_emb.dtype}, text {text_emb.dtype}"
        )
    if not 0 < negatives_fraction <= 1:
        raise ValueError(f"negatives_fraction must be in (0, 1], got {negatives_fraction}")
    if not 0 <= label_smoothing < 1:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if isinstance(temperature, Tensor):
        if temperature.dim() != 0:
            raise ValueError(f"temperature tensor must be 0-dim, got shape {tuple(temperature.shape)}")
    elif not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive finite float or a 0-dim tensor, got {temperature!r}")


def contrastive_loss(
    image_emb: Tensor,
    text_emb: Tensor,
    temperature: Tensor | float,
    label_smoothing: float = 0.1,
    negatives_fraction: float = 1.0,
    gather: bool = True,
    generator: torch.Generator | None = None,
    block_rows: int | None = None,
) -> Tensor:
    """Image-to-text plus text-to-image softmax cross-entropy over in-batch negatives, as a 0-dim tensor.

    ``image_emb`` and ``text_emb`` are this rank's L2-normalised [n, D] embeddings of paired samples;
    ``logits = image_emb @ text_emb.T / temperature``. Each direction is averaged over the N rows of the
    batch and the two are summed. ``label_smoothing`` puts ``1 - eps`` on the positive and ``eps`` spread
    uniformly over the row's columns, as ``F.cross_entropy``. A tensor ``temperature`` (0-dim) receives
    gradients; its value is not checked, to avoid a device sync per step.

    With ``gather`` and more than one rank, every rank's embeddings become extra negatives (N = sum of the
    ranks' n, which may differ) and gradients flow back to their owners. Each rank returns (W/N) times the
    sum over its own rows because the gather's backward sums every rank's contribution into the owner and
    DDP then divides by W, so the averaged gradients equal those of the global-batch loss. For the same
    reason the returned value is not the global loss; ``global_loss_value`` recovers it for logging.
    Without ``gather`` each rank computes the loss of its local batch alone.

    ``negatives_fraction < 1`` (the paper's ablation) scores each row against its positive and an
    independently drawn uniform subset of fraction * (N - 1) (rounded half up) other columns, smoothing then
    spreading over those columns only. Subsets are drawn from ``generator`` (on the embeddings' device), a
    separate draw per direction; give each rank its own seed, or ranks draw the same subsets for their rows.
    When the subset would be every column nothing is drawn and the loss is the full one.

    ``block_rows`` computes the same loss ``block_rows`` rows at a time, recomputing each block's logits in
    backward: memory O(block_rows * N + N * D) instead of several [n, N] matrices. In one process with every
    negative both directions share each block's product; otherwise each direction pays one more product.
    """
    _validate(image_emb, text_emb, temperature, label_smoothing, negatives_fraction)
    if block_rows is not None and block_rows < 1:
        raise ValueError(f"block_rows must be at least 1, got {block_rows}")
    all_images, all_texts, positives, world = _columns(image_emb, text_emb, gather)
    if block_rows is not None and all_images.shape[0] > block_rows:  # one block would hold the dense logits
        return _blockwise_loss(
            image_emb, text_emb, all_images, all_texts, positives, world, temperature, label_smoothing,
            negatives_fraction, generator, block_rows,
        )  # fmt: skip
    logits_i2t = image_emb @ all_texts.T / temperature
    logits_t2i = text_emb @ all_images.T / temperature
    i2t, t2i = (
        _summed_cross_entropy(logits, positives, label_smoothing, negatives_fraction, generator)
        for logits in (logits_i2t, logits_t2i)
    )
    return (i2t + t2i) * (world / logits_i2t.shape[1])


def _blockwise_loss(
    image_emb: Tensor,
    text_emb: Tensor,
    all_images: Tensor,
    all_texts: Tensor,
    positives: Tensor,
    world: int,
    temperature: Tensor | float,
    label_smoothing: float,
    negatives_fraction: float,
    generator: torch.Generator | None,
    block_rows: int,
) -> Tensor:
    """``contrastive_loss`` a block of rows at a time: both directions from one product per block in a single
    process with every negative, else each direction by ``_BlockwiseCrossEntropy``, negatives drawn as the
    dense path draws them."""
    t = temperature if isinstance(temperature, Tensor) else image_emb.new_tensor(float(temperature))
    num_columns = all_images.shape[0]
    num_negatives = _num_negatives(num_columns, negatives_fraction)
    if world == 1 and num_negatives == num_columns - 1:
        both: Tensor = _BlockwiseBothWays.apply(image_emb, text_emb, t, label_smoothing, block_rows)
        return both / num_columns
    total = image_emb.new_zeros(())
    for rows, cols in ((image_emb, all_texts), (text_emb, all_images)):
        picked = None
        if num_negatives < num_columns - 1:
            picked = _sample_columns(positives, num_columns, num_negatives, generator)
        total = total + _BlockwiseCrossEntropy.apply(rows, cols, t, positives, picked, label_smoothing, block_rows)
    return total * (world / num_columns)


class _BlockwiseSigmoid(torch.autograd.Function):
    """``sum_ij softplus(l_ij) - sum_i l_i,pos`` for ``l = rows @ cols.T / t + b``, a block of rows at a time.

    That is the sigmoid loss's ``-sum_ij log sigmoid(z_ij l_ij)`` (``z`` = +1 for the positive, -1 else),
    since ``softplus(-x) - softplus(x) = -x``; its gradient in ``l`` is ``sigmoid(l) - onehot``, recomputed
    block by block in backward, so no [n, N] matrix outlives its block.
    """

    @staticmethod
    def forward(
        ctx: Any, rows: Tensor, cols: Tensor, temperature: Tensor, bias: Tensor, positives: Tensor, block: int
    ) -> Tensor:
        inv_t, b = 1 / temperature.to(rows.dtype), bias.to(rows.dtype)
        total = rows.new_zeros(())
        for start in range(0, rows.shape[0], block):
            total += F.softplus(rows[start : start + block] @ cols.T * inv_t + b).sum()
        total -= (rows * cols[positives]).sum() * inv_t + b * rows.shape[0]
        ctx.save_for_backward(rows, cols, temperature, bias, positives)
        ctx.block = block
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        rows, cols, temperature, bias, positives = ctx.saved_tensors
        inv_t, b = 1 / temperature.to(rows.dtype), bias.to(rows.dtype)
        grad_rows, grad_cols = torch.zeros_like(rows), torch.zeros_like(cols)
        grad_t, grad_b = rows.new_zeros(()), rows.new_zeros(())
        for start in range(0, rows.shape[0], ctx.block):
            products = rows[start : start + ctx.block] @ cols.T
            g = torch.sigmoid(products * inv_t + b)
            g[torch.arange(g.shape[0], device=g.device), positives[start : start + ctx.block]] -= 1
            grad_b += g.sum()
            grad_t -= (g * products).sum() * inv_t * inv_t  # d l / d t = -products / t^2
            grad_rows[start : start + ctx.block] = g @ cols * inv_t
            grad_cols += g.T @ rows[start : start + ctx.block] * inv_t
        return (
            grad_rows * grad, grad_cols * grad, (grad_t * grad).to(temperature.dtype), (grad_b * grad).to(bias.dtype),
            None, None,
        )  # fmt: skip


def sigmoid_loss(
    image_emb: Tensor,
    text_emb: Tensor,
    temperature: Tensor | float,
    bias: Tensor | float,
    gather: bool = True,
    block_rows: int | None = None,
) -> Tensor:
    """The sigmoid loss of SigLIP (Zhai et al. 2023): every image-caption pair of the batch a binary decision,
    ``-1/N sum_ij log sigmoid(z_ij (x_i . y_j / temperature + bias))`` with ``z`` = +1 for the N true pairs
    and -1 for the others, as a 0-dim tensor.

    ``image_emb`` and ``text_emb`` are this rank's L2-normalised [n, D] embeddings of paired samples. With
    ``gather`` and more than one rank, each rank scores its images against every rank's captions (N = the sum
    of the ranks' n), which covers every pair of the global batch once, and returns (W/N) times its sum as
    ``contrastive_loss`` does, so that DDP's averaged gradients are the global loss's. ``block_rows`` scores
    that many rows at a time and recomputes them in backward: memory O(block_rows * N + N * D).
    """
    _validate(image_emb, text_emb, temperature, 0.0, 1.0)
    if block_rows is not None and block_rows < 1:
        raise ValueError(f"block_rows must be at least 1, got {block_rows}")
    _, all_texts, positives, world = _columns(image_emb, text_emb, gather)
    t = temperature if isinstance(temperature, Tensor) else image_emb.new_tensor(float(temperature))
    b = bias if isinstance(bias, Tensor) else image_emb.new_tensor(float(bias))
    num_columns = all_texts.shape[0]
    if block_rows is None or num_columns <= block_rows:
        logits = image_emb @ all_texts.T / t + b
        positive = logits.gather(1, positives[:, None]).sum()
        return (F.softplus(logits).sum() - positive) * (world / num_columns)
    total: Tensor = _BlockwiseSigmoid.apply(image_emb, all_texts, t, b, positives, block_rows)
    return total * (world / num_columns)


def uniform_loss(batch_size: int, negatives_fraction: float = 1.0) -> float:
    """``contrastive_loss`` of a model that scores every candidate of a row alike (any label smoothing): where
    a run starts from and the level a training loss must fall below to say the model has learnt anything."""
    return 2 * math.log(1 + _num_negatives(batch_size, negatives_fraction))


def global_loss_value(loss: Tensor) -> Tensor:
    """Detached mean over ranks of ``contrastive_loss``'s value: the global-batch loss, for logging.

    A collective: every rank must call it. Single-process it returns the loss unchanged (detached).
    """
    value = loss.detach().clone()
    world, _ = _world()
    if world > 1:
        dist.all_reduce(value)
        value /= world
    return value
