"""One training step, as the paper describes it.

Embed the per-rank batch (whole, or in gradient-cached chunks), compute the normalised-softmax loss over the
global batch, back-propagate, and skip the update if any rank's loss or gradient norm is not finite; otherwise
clip, step the optimizer and the schedule. The loop around it (``openalign.train.loop``) streams, logs,
evaluates and checkpoints.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from openalign.optim import GroupLRScheduler
from openalign.train.distributed import (
    average_replicated_grads,
    fsdp_no_sync,
    grad_norm,
    is_distributed,
    replicated_params,
    unwrap,
)
from openalign.train.grad_cache import Batch, LossFn, Pixels, cached_step, plain_step
from openalign.train.towers import ChunkCaptions, Towers

if TYPE_CHECKING:
    from openalign.train.config import LoopConfig

__all__ = ["BufferSnapshot", "StepStats", "TrainStep", "step_loss"]


def step_loss(t: LoopConfig) -> LossFn:
    """The paper's loss with this run's label smoothing, share of negatives and loss blocks."""
    from openalign.loss import contrastive_loss

    block = t.loss_block_rows or None
    return partial(
        contrastive_loss, label_smoothing=t.label_smoothing, negatives_fraction=t.negatives_fraction, block_rows=block
    )


@dataclass(frozen=True)
class StepStats:
    """What one step reports, every figure global (averaged over ranks)."""

    loss: float
    grad_norm: float
    temperature: float  # the one this step's loss used
    lr: float
    finite: bool  # every rank's loss and gradient norm were finite: the update was taken
    checkpoint_due: bool  # rank 0's checkpoint clock, carried by the step's one collective


class BufferSnapshot:
    """A copy of some tensors (batch-norm statistics and counters), allocated once, taken and put back with one
    foreach copy per device and dtype: a list mixing dtypes takes CUDA's per-tensor path, a launch per buffer."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.device, t.dtype), []).append(t)
        self.live = list(groups.values())
        self.saved = [[t.detach().clone() for t in group] for group in self.live]

    def take(self) -> None:
        for live, saved in zip(self.live, self.saved, strict=True):
            torch._foreach_copy_(saved, live)

    def restore(self) -> None:
        for live, saved in zip(self.live, self.saved, strict=True):
            torch._foreach_copy_(live, saved)


@dataclass
class TrainStep:
    """The step of one run: ``step(batch)`` trains on a host batch and returns its ``StepStats``.

    ``wrapped`` is what the graph pass calls (the DDP or FSDP model), ``towers`` how the model's towers run.
    ``chunk_size`` turns on gradient caching; ``pixels`` turns the stream's uint8 pixels into the model's input
    on the device, chunk by chunk. ``bf16`` runs the step under bf16 autocast (FSDP has its own policy).
    """

    wrapped: nn.Module
    towers: Towers
    optimizer: torch.optim.Optimizer
    scheduler: GroupLRScheduler
    loss_fn: LossFn
    device: torch.device
    world_size: int = 1
    chunk_size: int | None = None
    grad_clip: float | None = None
    pixels: Pixels | None = None
    bf16: bool = False
    fsdp: bool = False

    def __post_init__(self) -> None:
        self.model = self.towers.model
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # A bad batch would leave NaN in batch-norm running statistics even though its update is skipped.
        self.buffers = BufferSnapshot(self.model.buffers())

    def __call__(self, batch: Batch, checkpoint_due: bool = False) -> StepStats:
        captions = self.towers.captions(batch, self.chunk_size)  # checked and measured on the host, for free
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        self.buffers.take()
        loss = self.embed_and_backward(batch, captions)
        if self.fsdp:
            average_replicated_grads(replicated_params(self.model))
        norm = grad_norm(self.params)
        stats = self._reduce(loss, norm, checkpoint_due)  # the step's one host sync
        if not stats.finite:
            self.buffers.restore()
            self.optimizer.zero_grad(set_to_none=True)
            return stats
        if self.grad_clip is not None:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.grad_clip, norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stats

    def embed_and_backward(self, batch: Batch, captions: list[ChunkCaptions] | None) -> torch.Tensor:
        """The loss of the batch, its gradients accumulated into ``.grad``; whole, or chunk by chunk."""
        autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if self.bf16 and not self.fsdp
            else contextlib.nullcontext()
        )
        temperature = lambda: self.model.temperature  # noqa: E731 - re-read: the graph must be fresh each call
        with autocast:
            if self.chunk_size is None:
                return plain_step(self.wrapped, batch, self.loss_fn, temperature, pixels=self.pixels, captions=captions)
            no_sync: Callable[[], contextlib.AbstractContextManager[None]] | None = getattr(
                self.wrapped, "no_sync", None
            )
            if self.fsdp:
                no_sync = partial(fsdp_no_sync, self.model)
            return cached_step(
                self.wrapped,
                batch,
                self.chunk_size,
                self.loss_fn,
                temperature,
                no_sync=no_sync,
                inner=unwrap(self.wrapped),
                pixels=self.pixels,
                captions=captions,
            )

    def _reduce(self, loss: torch.Tensor, norm: torch.Tensor, checkpoint_due: bool) -> StepStats:
        """Loss, finiteness, the checkpoint clock, gradient norm and temperature in one collective, one sync.
        The norm is global and the temperature replicated already: every rank adds the same."""
        lr = float(self.optimizer.param_groups[0]["lr"])
        loss, norm = loss.float(), norm.float().to(loss.device)
        finite = torch.isfinite(loss) & torch.isfinite(norm)
        zero = torch.zeros_like(loss)
        temperature = self.model.temperature.detach().float().mean().to(loss.device)
        packed = torch.stack(
            [
                torch.where(finite, loss, zero),
                (~finite).float(),
                torch.full_like(loss, float(checkpoint_due)),
                torch.where(finite, norm, zero),
                temperature,
            ]
        )
        if is_distributed():
            dist.all_reduce(packed)
        values = packed.tolist()
        world = self.world_size
        return StepStats(
            loss=values[0] / world,
            grad_norm=values[3] / world,
            temperature=values[4] / world,
            lr=lr,
            finite=values[1] == 0,
            checkpoint_due=values[2] > 0,
        )
