"""Gradient caching: the contrastive loss of a large batch with the activation memory of a small chunk.

ALIGN's loss couples every pair in the batch (16384 on 1024 TPU cores), so splitting the batch into
micro-batches that each see only their own negatives changes the objective. Gradient caching (Gao et
al. 2021) keeps the objective exact:

1. embed the whole per-rank batch chunk by chunk without building a graph;
2. compute the loss on those embeddings (gathered across ranks as usual) and its gradient with respect to
   every embedding and to the temperature;
3. re-run each chunk with a graph and back-propagate the cached embedding gradients into the towers.

The two forward passes must compute the same function, so each chunk's random state (CPU and CUDA
generators) is saved before the first pass and restored before the second: dropout and stochastic depth
draw the same masks. Data augmentation happens before the model, so it is shared by construction.

Batch norm. Each chunk is normalised with its own batch statistics, which is exactly ghost ("virtual")
batch norm with groups of ``chunk_size`` samples: with ``image.batch_norm: virtual`` and
``virtual_batch_size`` equal to (or dividing) the chunk size, cached training is identical to plain
training of the whole batch, running statistics included; with per-device batch norm it equals plain
training with chunk-sized statistics groups. Running statistics are updated once per step and once per
sample: the first pass records each chunk's statistics without touching the running buffers, the second
pass leaves them frozen, and one update with the mean over chunks is applied at the end, as the
ghost-batch-norm layer does for its groups.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from openalign.model.layers import frozen_bn_stats, running_stats
from openalign.train.towers import ChunkCaptions

Batch = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# Turns a batch's pixels as they travel (uint8) into the model's input; applied chunk by chunk, so the float
# copy of the whole batch never exists at once.
Pixels = Callable[[torch.Tensor], torch.Tensor]

__all__ = ["Pixels", "RngState", "cached_step", "chunk_batch", "plain_step"]

CAPTIONS = ("input_ids", "attention_mask")


@dataclass
class RngState:
    """The generator states that dropout and stochastic depth draw from on ``device``."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda)

    def restore(self, device: torch.device) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, device)


def chunk_batch(batch: Batch, chunk_size: int, text_widths: list[int] | None = None) -> list[Batch]:
    """Split every tensor of ``batch`` along dim 0 into chunks of ``chunk_size`` rows; with ``text_widths``, chunk
    ``i``'s captions cut to their first ``text_widths[i]`` columns (views: nothing is read or copied)."""
    n = next(iter(batch.values())).shape[0]
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    chunks = [{k: v[i : i + chunk_size] for k, v in batch.items()} for i in range(0, n, chunk_size)]
    if text_widths is not None:
        for chunk, width in zip(chunks, text_widths, strict=True):
            chunk.update({k: chunk[k][:, :width] for k in CAPTIONS if k in chunk})
    return chunks


def _embed(
    model: nn.Module, batch: Batch, pixels: Pixels | None, captions: ChunkCaptions | None
) -> tuple[torch.Tensor, torch.Tensor]:
    values = batch["pixel_values"]
    image, text = model(
        pixels(values) if pixels is not None else values,
        batch["input_ids"],
        batch.get("attention_mask"),
        captions.groups if captions is not None else None,
    )
    return image, text


def _widths(captions: list[ChunkCaptions] | None) -> list[int] | None:
    return [c.width for c in captions] if captions is not None else None


def _batch_norms(model: nn.Module) -> list[_BatchNorm]:
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]


@contextlib.contextmanager
def _recording_bn_stats(model: nn.Module) -> Iterator[Callable[[], None]]:
    """Lets each forward write its batch statistics into the running buffers (momentum 1), collects them
    through the returned ``record()``, then restores the buffers and applies one update with the mean of the
    recorded statistics at the layer's own momentum."""
    layers = _batch_norms(model)
    saved = []
    for m in layers:
        mean, var, tracked = running_stats(m)
        saved.append((m, m.momentum, mean.clone(), var.clone(), tracked.clone()))
    means: list[list[torch.Tensor]] = [[] for _ in layers]
    variances: list[list[torch.Tensor]] = [[] for _ in layers]
    for m in layers:
        m.momentum = 1.0

    def record() -> None:
        for i, m in enumerate(layers):
            mean, var, _ = running_stats(m)
            means[i].append(mean.clone())
            variances[i].append(var.clone())

    ok = False
    try:
        yield record
        ok = True
    finally:
        for i, (m, momentum, mean, var, tracked) in enumerate(saved):
            m.momentum = momentum
            running_mean, running_var, running_tracked = running_stats(m)
            running_mean.copy_(mean)
            running_var.copy_(var)
            running_tracked.copy_(tracked)
            if ok and means[i]:
                # momentum=None is PyTorch's cumulative average: the factor is 1 / batches seen so far.
                factor = momentum if momentum is not None else 1.0 / float(tracked + 1)
                running_mean.lerp_(torch.stack(means[i]).mean(0), factor)
                running_var.lerp_(torch.stack(variances[i]).mean(0), factor)
                running_tracked.add_(1)


def plain_step(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    temperature: Callable[[], torch.Tensor],
    *,
    pixels: Pixels | None = None,
    captions: list[ChunkCaptions] | None = None,
) -> torch.Tensor:
    """One forward and backward of the whole per-rank batch; returns the (detached) loss. ``captions``: how the
    batch's captions reach the text tower (``Towers.captions``, one chunk), or None to take them whole."""
    if captions is not None:
        (batch,) = chunk_batch(batch, next(iter(batch.values())).shape[0], _widths(captions))
    image, text = _embed(model, batch, pixels, captions[0] if captions is not None else None)
    loss = loss_fn(image.float(), text.float(), temperature())
    loss.backward()
    return loss.detach()


def cached_step(
    model: nn.Module,
    batch: Batch,
    chunk_size: int,
    loss_fn: LossFn,
    temperature: Callable[[], torch.Tensor],
    *,
    no_sync: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
    inner: nn.Module | None = None,
    pixels: Pixels | None = None,
    captions: list[ChunkCaptions] | None = None,
) -> torch.Tensor:
    """Accumulate into ``.grad`` the gradients of ``loss_fn`` over the whole batch, ``chunk_size`` rows at a
    time; returns the (detached) loss.

    ``model`` is what the graph pass calls (a DDP wrapper, say); ``inner`` the bare module used for the
    no-graph pass (default ``model``), so DDP does not prepare a reduction for a pass without backward.
    ``no_sync`` (DDP's) is entered for every chunk but the last, so gradients are all-reduced once per step.
    ``temperature()`` returns the model's temperature with its graph; its gradient is added with the last
    chunk so that every parameter receives its gradient in the same (synchronised) backward.
    ``pixels`` prepares each chunk's pixels for the model (both passes), as in ``plain_step``; ``captions`` says how
    each chunk's captions reach the text tower (``Towers.captions``).
    """
    inner = inner if inner is not None else model
    chunks = chunk_batch(batch, chunk_size, _widths(captions))
    layouts = captions if captions is not None else [None] * len(chunks)
    device = batch["pixel_values"].device
    states: list[RngState] = []
    images, texts = [], []
    with torch.no_grad(), _recording_bn_stats(inner) as record:
        for chunk, layout in zip(chunks, layouts, strict=True):
            states.append(RngState.capture(device))
            image, text = _embed(inner, chunk, pixels, layout)
            record()
            images.append(image.float())
            texts.append(text.float())
    end_state = RngState.capture(device)

    image_all = torch.cat(images).requires_grad_()
    text_all = torch.cat(texts).requires_grad_()
    temp = temperature().detach().float().requires_grad_()
    loss = loss_fn(image_all, text_all, temp)
    grad_image, grad_text, grad_temp = torch.autograd.grad(loss, [image_all, text_all, temp])

    offset = 0
    last = len(chunks) - 1
    for i, (chunk, state, layout) in enumerate(zip(chunks, states, layouts, strict=True)):
        state.restore(device)
        n = chunk["pixel_values"].shape[0]
        # Gradients are all-reduced on the last chunk only.
        with no_sync() if no_sync is not None and i != last else contextlib.nullcontext(), frozen_bn_stats(inner):
            image, text = _embed(model, chunk, pixels, layout)
            # d(surrogate)/d(params) = sum over rows of (dL/d emb) · (d emb/d params): the chain rule with the
            # loss's part already done.
            surrogate = (image.float() * grad_image[offset : offset + n]).sum()
            surrogate = surrogate + (text.float() * grad_text[offset : offset + n]).sum()
            if i == last:
                surrogate = surrogate + temperature().float() * grad_temp
            surrogate.backward()
        offset += n
    end_state.restore(device)
    return loss.detach()
