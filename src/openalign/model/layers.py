"""Building blocks shared by both towers: batch norm policies, stochastic depth, checkpointing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from openalign.config import ImageTowerConfig


class BatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d that can normalise each group of ``virtual_batch_size`` samples with its own statistics.

    ALIGN trained with 16 pairs per TPU core and per-core batch statistics; "virtual" (ghost) batches
    reproduce that regularisation on a device that holds far more than 16 samples. Running statistics
    are updated once per forward with the mean of the groups' statistics.
    """

    def __init__(self, num_features: int, eps: float, momentum: float, virtual_batch_size: int | None = None):
        super().__init__(num_features, eps=eps, momentum=momentum)
        self.virtual_batch_size = virtual_batch_size

    @classmethod
    def for_tower(cls, num_features: int, cfg: ImageTowerConfig) -> BatchNorm2d:
        """A batch norm with an image tower's settings: its eps, its TF-style momentum (weight of the old running
        statistics, so PyTorch's is one minus it) and ghost batches when ``batch_norm`` is ``virtual``."""
        virtual = cfg.virtual_batch_size if cfg.batch_norm == "virtual" else None
        return cls(num_features, eps=cfg.bn_eps, momentum=1.0 - cfg.bn_momentum, virtual_batch_size=virtual)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vb = self.virtual_batch_size
        weight, bias = self._affine()
        if not (self.training and vb and x.shape[0] >= vb):
            if weight is self.weight:
                return super().forward(x)
            return self._whole_batch(x, weight, bias)
        # One group of exactly vb rows goes through the same kernels as many, so a gradient-cached chunk of
        # vb rows computes what the whole batch computes for those rows (to the kernels' rounding).
        if x.shape[0] % vb:
            groups = x.split(vb)
            out = torch.cat([F.batch_norm(g, None, None, weight, bias, True, 0.0, self.eps) for g in groups])
            with torch.no_grad():
                mean = torch.stack([g.mean((0, 2, 3)) for g in groups]).mean(0)
                var = torch.stack([g.var((0, 2, 3), correction=1 if g.numel() > g.shape[1] else 0) for g in groups])
                var = var.mean(0)
        else:
            out, mean, var = _GhostBatchNorm.apply(x, weight, bias, x.shape[0] // vb, self.eps)
        if self.track_running_stats:
            running_mean, running_var, tracked = running_stats(self)
            momentum = self.momentum
            assert momentum is not None  # __init__ takes a float
            with torch.no_grad():
                # Under bf16 autocast the groups arrive in bf16; the running buffers stay fp32.
                running_mean.lerp_(mean.to(running_mean.dtype), momentum)
                running_var.lerp_(var.to(running_var.dtype), momentum)
                tracked.add_(1)
        return out

    def _affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Weight and bias in the running statistics' precision. FSDP2's bf16 policy casts parameters, not
        buffers: a bf16 affine beside fp32 running statistics is a dtype error in the batch-norm kernel, and
        statistics must stay fp32 anyway. The kernel takes a bf16 input with an fp32 affine and statistics
        (as under autocast), and the cast's gradient goes back to the bf16 parameter."""
        weight, bias = self.weight, self.bias
        stats = self.running_mean
        if stats is not None and weight.dtype != stats.dtype:
            return weight.to(stats.dtype), bias.to(stats.dtype)
        return weight, bias

    def _whole_batch(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``nn.BatchNorm2d.forward`` with the given affine (momentum is always a float here)."""
        momentum = self.momentum
        assert momentum is not None
        if self.training and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        use_batch = self.training or self.running_mean is None
        return F.batch_norm(x, self.running_mean, self.running_var, weight, bias, use_batch, momentum, self.eps)


def _grouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, C, H, W] as [B / groups, groups * C, H, W], channel g*C + c holding channel c of rows g*B/groups ...
    (g+1)*B/groups - 1; one copy, in ``t``'s layout so that it moves whole runs: in memory [rows, H, W, groups, C]
    for channels-last, [rows, groups, C, H, W] for contiguous."""
    slices: torch.Tensor = t.unflatten(0, (groups, -1)).transpose(0, 1)
    if t.is_contiguous() or not t.is_contiguous(memory_format=torch.channels_last):
        return slices.contiguous().flatten(1, 2)
    return slices.permute(0, 3, 4, 1, 2).contiguous().flatten(3).permute(0, 3, 1, 2)


def _ungrouped(t: torch.Tensor, groups: int, like: torch.Tensor) -> torch.Tensor:
    """``_grouped``'s inverse, into a new tensor in ``like``'s layout."""
    out = torch.empty_like(like)
    out.unflatten(0, (groups, -1)).copy_(t.unflatten(1, (groups, -1)).transpose(0, 1))
    return out


class _GhostBatchNorm(torch.autograd.Function):
    """Batch norm of ``groups`` equal slices of the batch, each with its own statistics, by PyTorch's own batch-norm
    kernels: the slices become channels (``_grouped``), so one batch norm normalises each slice by its own
    statistics, and one copy each way moves the rows. A loop over 1,024 groups of 16 (a 16k batch) would launch one
    batch norm per group and layer; normalising by hand (mean, variance, scale and shift as tensor ops in fp32) takes
    ~15 elementwise kernels forward and as many backward per layer, each a pass over the activation. The backward
    takes the kernels' backward on gradients laid out as their inputs were, as they are fast only so. Statistics are
    fp32 whatever the input's precision (the kernels'). Returns the output, a tensor of its own in ``x``'s layout
    (FSDP2 warns of, and an in-place op would drop, its hook on a block that returns a view), and for the running
    statistics the mean over groups of each group's mean and unbiased variance."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        grouped = _grouped(x, groups)
        weights = weight.repeat(groups)
        normed, mean, invstd = torch.native_batch_norm(
            grouped, weights, bias.repeat(groups), None, None, True, 0.0, eps
        )
        ctx.save_for_backward(grouped, weights, mean, invstd)
        ctx.groups, ctx.eps = groups, eps
        n = grouped.numel() // grouped.shape[1]
        var = invstd.float().pow(-2).sub_(eps)
        if n > 1:
            var.mul_(n / (n - 1))
        mean, var = mean.float().view(groups, -1).mean(0), var.view(groups, -1).mean(0)
        ctx.mark_non_differentiable(mean, var)
        return _ungrouped(normed, groups, x), mean, var

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        grouped, weights, mean, invstd = ctx.saved_tensors
        groups = ctx.groups
        dx, dw, db = torch.ops.aten.native_batch_norm_backward(
            _grouped(grad, groups), grouped, weights, None, None, mean, invstd, True, ctx.eps, [True, True, True]
        )
        dw, db = (t.view(groups, -1).sum(0) for t in (dw, db))
        return _ungrouped(dx, groups, grad), dw, db, None, None


def drop_path(x: torch.Tensor, rate: float, training: bool) -> torch.Tensor:
    """Stochastic depth: drop the whole residual branch of a sample with probability ``rate``.

    Per sample, not per element: element dropout here (as in transformers' port) is a different
    regulariser from the one EfficientNet was trained with.
    """
    if not training or rate == 0.0:
        return x
    keep = 1.0 - rate
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    return x * mask.div_(keep)


def running_stats(bn: _BatchNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``running_mean``, ``running_var`` and ``num_batches_tracked`` of a batch norm that tracks them."""
    if bn.running_mean is None or bn.running_var is None or bn.num_batches_tracked is None:
        raise ValueError(f"{type(bn).__name__} keeps no running statistics")
    return bn.running_mean, bn.running_var, bn.num_batches_tracked


@contextmanager
def frozen_bn_stats(module: nn.Module) -> Iterator[None]:
    """Batch norm inside ``module`` normalises with batch statistics but leaves running statistics alone."""
    saved = []
    for m in module.modules():
        if isinstance(m, _BatchNorm) and m.track_running_stats:
            saved.append((m, m.momentum, running_stats(m)[2].clone()))
            m.momentum = 0.0
    try:
        yield
    finally:
        for m, momentum, tracked in saved:
            m.momentum = momentum
            running_stats(m)[2].copy_(tracked)


def checkpointed(module: nn.Module, *args: Any) -> Any:
    """Run ``module`` under activation checkpointing, updating batch-norm running statistics once.

    The backward pass re-runs the forward; without the guard every batch norm would fold the same
    batch into its running statistics twice. Dropout and stochastic depth replay the same random
    draws because checkpoint restores the RNG state.
    """
    if torch.compiler.is_compiling():
        # A compiled graph recomputes from its functional form, whose buffer updates are applied once, after the
        # forward: nothing to guard (and Dynamo refuses the guard's counter, a side effect inside a checkpoint).
        return checkpoint(module, *args, use_reentrant=False)
    calls = 0

    def run(*inner: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return module(*inner)
        with frozen_bn_stats(module):
            return module(*inner)

    return checkpoint(run, *args, use_reentrant=False)


def maybe_checkpointed(enabled: bool, module: nn.Module) -> Callable[..., Any]:
    if enabled and torch.is_grad_enabled():
        return lambda *args: checkpointed(module, *args)
    return module


def has_values(t: torch.Tensor) -> bool:
    """False for tensors that carry shapes only (meta, or fake ones made by ``FakeTensorMode``), whose values
    cannot be read: checks on values are skipped for them. So are those inside a graph being compiled, which are
    fake too: answered before ``is_fake``, which Dynamo does not trace (a call of it breaks the graph)."""
    return not (torch.compiler.is_compiling() or t.is_meta or is_fake(t))


def host_readable(t: torch.Tensor) -> bool:
    """True for a tensor whose values the host reads for free: one with values, in CPU memory, outside a
    compiled graph. Reading an accelerator tensor (``int()``, ``bool()``, ``.tolist()``) makes the host wait
    for every kernel queued before it, so code that chooses shapes from values does so only here."""
    return t.device.type == "cpu" and has_values(t)
