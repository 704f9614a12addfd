"""EfficientNet (Tan & Le 2019) as ALIGN's image tower.

The feature is the global average pool of the last MBConv block's output: ALIGN does not train the
1×1 head convolution, so it is not built (640 channels for B7, 1376 for L2). Padding follows
TensorFlow's "SAME" rule at every input size, so TF-trained weights give TF's numbers; the "hf" mode
reproduces transformers' fixed paddings instead, so its checkpoints give its numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from openalign.config import ImageTowerConfig
from openalign.model.layers import BatchNorm2d, drop_path, has_values, maybe_checkpointed


def round_filters(channels: int, width: float, divisor: int = 8) -> int:
    """Scale a channel count by ``width`` and round to a multiple of ``divisor``, never losing > 10 %."""
    scaled = channels * width
    rounded = max(divisor, int(scaled + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * scaled:
        rounded += divisor
    return rounded


def round_repeats(repeats: int, depth: float) -> int:
    return math.ceil(depth * repeats)


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TF "SAME": output ceil(size / stride), the extra pixel of an odd total pad going after."""
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


Pad = tuple[int, int, int, int]  # left, right, top, bottom (F.pad order)


class Conv2dSame(nn.Conv2d):
    """Conv2d with TF SAME padding computed from the input size, or a fixed (possibly asymmetric) pad."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, pad: Pad | None = None):
        super().__init__(cin, cout, kernel, stride=stride, padding=0, groups=groups, bias=False)
        if pad is None and stride == 1:
            # An odd kernel at stride 1 pads symmetrically whatever the size: let the conv do it.
            pad = (kernel // 2,) * 4
        self.fixed_pad = pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed_pad is None:
            k, s = self.kernel_size[0], self.stride[0]
            top, bottom = same_padding(x.shape[-2], k, s)
            left, right = same_padding(x.shape[-1], k, s)
            pad = (left, right, top, bottom)
        else:
            pad = self.fixed_pad
        left, right, top, bottom = pad
        if self._dense_depthwise(x):
            return depthwise_as_matmul(x, self.weight, self.stride[0], pad)
        if left == right and top == bottom:
            return F.conv2d(x, self.weight, None, self.stride, (top, left), 1, self.groups)
        return F.conv2d(F.pad(x, pad), self.weight, None, self.stride, 0, 1, self.groups)

    def _dense_depthwise(self, x: torch.Tensor) -> bool:
        """Whether this is a depthwise conv over a map no larger than its kernel window, on the CPU.

        There oneDNN's depthwise backward runs at a fraction of a GFLOP/s, far slower than the same work as a
        matmul, and such maps are where a small input
        ends (EfficientNet's last stages at 48–96 px). When the whole map fits in one window each output
        reads nearly every input anyway, so the dense per-channel matrix wastes little; on larger maps
        the direct conv wins, and GPUs keep their own kernels. Tensors of shapes only (plans count the
        FLOPs a GPU would run) keep the conv; a compiled graph takes the matmul as eager code does.
        """
        k = self.kernel_size[0]
        return (
            not _direct_only
            and self.groups == self.in_channels == self.out_channels
            and x.device.type == "cpu"
            and (torch.compiler.is_compiling() or has_values(x))
            and x.shape[-2] * x.shape[-1] <= k * k
        )


def depthwise_as_matmul(x: torch.Tensor, weight: torch.Tensor, stride: int, pad: Pad) -> torch.Tensor:
    """A depthwise conv as one batched matmul: per channel, a dense [outputs, inputs] matrix made of its
    kernel's taps (zero where a tap falls outside the map), applied to every sample's flattened map.

    ``pad`` is (left, right, top, bottom) as for ``F.pad``; the result equals
    ``F.conv2d(F.pad(x, pad), weight, stride=stride, groups=C)`` up to float rounding.
    """
    b, c, h, w = x.shape
    k = weight.shape[-1]
    left, right, top, bottom = pad
    ho, wo = (h + top + bottom - k) // stride + 1, (w + left + right - k) // stride + 1
    # Output (oy, ox) reads input (iy, ix) through tap (iy - oy·stride + top, ix - ox·stride + left).
    dy = torch.arange(h).view(1, h) - torch.arange(ho).view(ho, 1) * stride + top
    dx = torch.arange(w).view(1, w) - torch.arange(wo).view(wo, 1) * stride + left
    inside_y, inside_x = (dy >= 0) & (dy < k), (dx >= 0) & (dx < k)
    taps = dy.clamp(0, k - 1).view(ho, 1, h, 1) * k + dx.clamp(0, k - 1).view(1, wo, 1, w)
    inside = inside_y.view(ho, 1, h, 1) & inside_x.view(1, wo, 1, w)
    taps, inside = taps.reshape(ho * wo, h * w), inside.reshape(ho * wo, h * w)
    matrix = weight.reshape(c, k * k)[:, taps] * inside.to(weight.dtype)  # [C, outputs, inputs]
    y: torch.Tensor = _ChannelMatmul.apply(matrix, x.reshape(b, c, h * w).permute(1, 2, 0))  # [C, outputs, B]
    y = y.permute(2, 0, 1).reshape(b, c, ho, wo)
    channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    return y.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


class _ChannelMatmul(torch.autograd.Function):
    """``torch.bmm`` whose operands and gradients are made contiguous first: the CPU kernel copies a
    batch-strided operand one matrix at a time (thousands of tiny copies per call), one copy is cheaper."""

    @staticmethod
    def forward(ctx: Any, matrix: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ctx.x_dtype = x.dtype
        x = x.contiguous().to(matrix.dtype)
        ctx.save_for_backward(matrix, x)
        # In the weights' precision, as the saved operands are: the backward runs outside autocast.
        with torch.autocast(x.device.type, enabled=False):
            return torch.bmm(matrix, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        matrix, x = ctx.saved_tensors
        grad = grad.contiguous().to(matrix.dtype)
        return torch.bmm(grad, x.transpose(1, 2)), torch.bmm(matrix.transpose(1, 2), grad).to(ctx.x_dtype)


_direct_only = False  # set by direct_depthwise()


@contextmanager
def direct_depthwise() -> Iterator[None]:
    """Every depthwise conv through ``F.conv2d`` inside the block, as a GPU runs it. A plan's fake tensors
    hold no values and always take the conv; checking the plan against a real CPU step needs the step to
    run the same kernels (and the model's FLOPs are the conv's, whichever kernel computes them)."""
    global _direct_only
    saved, _direct_only = _direct_only, True
    try:
        yield
    finally:
        _direct_only = saved


class ConvBN(nn.Module):
    def __init__(
        self,
        cin: int,
        cout: int,
        kernel: int,
        cfg: ImageTowerConfig,
        stride: int = 1,
        groups: int = 1,
        act: bool = True,
        pad: Pad | None = None,
    ):
        super().__init__()
        self.conv = Conv2dSame(cin, cout, kernel, stride, groups, pad)
        self.bn = BatchNorm2d.for_tower(cout, cfg)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn(self.conv(x))
        return F.silu(x) if self.act else x


class SqueezeExcite(nn.Module):
    """Squeeze-and-excitation: the block's channels scaled by a gate computed from their spatial means.

    The gate's two 1×1 convolutions see a 1×1 map, so they are matrix products and run as such (``F.linear`` on
    the weights viewed as matrices): a convolution call costs a GPU's host several times a GEMM's (cuDNN's
    dispatch), and these are two of a block's five convolutions, forward and backward, for a few thousand
    multiply-adds each. The weights keep their convolution shape, so checkpoints and the peers' layouts match."""

    def __init__(self, channels: int, reduced: int):
        super().__init__()
        self.reduce = nn.Conv2d(channels, reduced, 1)
        self.expand = nn.Conv2d(reduced, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.mean((2, 3))
        s = F.silu(F.linear(s, self.reduce.weight.flatten(1), self.reduce.bias))
        s = F.linear(s, self.expand.weight.flatten(1), self.expand.bias)
        return x * torch.sigmoid(s)[:, :, None, None]


class MBConv(nn.Module):
    """Inverted residual block: 1×1 expand, k×k depthwise, squeeze-excitation, 1×1 project."""

    def __init__(
        self,
        cin: int,
        cout: int,
        kernel: int,
        stride: int,
        expand_ratio: int,
        drop_rate: float,
        cfg: ImageTowerConfig,
        depthwise_pad: Pad | None,
    ):
        super().__init__()
        mid = cin * expand_ratio
        self.expand = ConvBN(cin, mid, 1, cfg) if expand_ratio != 1 else None
        self.depthwise = ConvBN(mid, mid, kernel, cfg, stride=stride, groups=mid, pad=depthwise_pad)
        self.se = SqueezeExcite(mid, max(1, int(cin * cfg.se_ratio))) if cfg.se_ratio > 0 else None
        self.project = ConvBN(mid, cout, 1, cfg, act=False)
        self.residual = stride == 1 and cin == cout
        self.drop_rate = drop_rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.expand(x) if self.expand is not None else x
        h = self.depthwise(h)
        if self.se is not None:
            h = self.se(h)
        h = self.project(h)
        if self.residual:
            h = drop_path(h, self.drop_rate, self.training) + x
        return h


class EfficientNet(nn.Module):
    """EfficientNet feature extractor: ``forward`` maps [B, 3, H, W] pixels to [B, num_features]."""

    def __init__(self, cfg: ImageTowerConfig):
        super().__init__()
        self.cfg = cfg
        width, div = cfg.width_coefficient, cfg.depth_divisor
        hf = cfg.padding == "hf"
        symmetric = cfg.padding == "symmetric"
        stem = round_filters(cfg.stem_channels, width, div)
        self.stem = ConvBN(3, stem, 3, cfg, stride=2, pad=(0, 1, 0, 1) if hf else (1, 1, 1, 1) if symmetric else None)

        stages = list(
            zip(
                cfg.kernel_sizes,
                cfg.num_repeats,
                cfg.in_channels,
                cfg.out_channels,
                cfg.expand_ratios,
                cfg.strides,
                strict=True,
            )
        )
        total = sum(round_repeats(r, cfg.depth_coefficient) for _, r, *_ in stages)
        blocks: list[nn.Module] = []
        for kernel, repeats, cin, cout, expand, stride in stages:
            cin, cout = round_filters(cin, width, div), round_filters(cout, width, div)
            for j in range(round_repeats(repeats, cfg.depth_coefficient)):
                idx = len(blocks)
                s = stride if j == 0 else 1
                pad = None
                half = kernel // 2
                if hf and s == 2:
                    even = idx in cfg.hf_depthwise_padding
                    pad = (half, half, half, half) if even else (half - 1, half, half - 1, half)
                elif symmetric:
                    pad = (half, half, half, half)
                rate = cfg.drop_connect_rate * idx / total
                block = MBConv(cin if j == 0 else cout, cout, kernel, s, expand, rate, cfg, pad)
                if hf and j == 0:
                    block.residual = False  # transformers' port never adds one to a stage's first block
                blocks.append(block)
        self.blocks = nn.ModuleList(blocks)
        self.num_features = round_filters(cfg.out_channels[-1], width, div)
        self.gradient_checkpointing = cfg.gradient_checkpointing
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """TF EfficientNet init: convs N(0, 2 / fan_out) with fan_out = k·k·out / groups."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels // m.groups
                nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / fan_out))
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.feature_map(pixel_values).mean((2, 3))

    def feature_map(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The last block's output [B, num_features, h, w], before the pool."""
        if self.cfg.channels_last:
            pixel_values = pixel_values.contiguous(memory_format=torch.channels_last)
        x: torch.Tensor = self.stem(pixel_values)
        for block in self.blocks:
            x = maybe_checkpointed(self.gradient_checkpointing and self.training, block)(x)
        return x
