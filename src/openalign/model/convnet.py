"""A plain convolutional image tower for CPU-sized runs: a stack of 3×3 convolution, batch norm and ReLU layers.

ALIGN's tower is an EfficientNet, and the paper's presets keep it. Scaled down to a few hundred thousand
weights and ~48 px inputs, though, an EfficientNet is a poor learner per CPU-second: its depthwise convolutions
and squeeze-excitation gates move little arithmetic per byte, so a CPU runs them far below its peak, and from
scratch they pick up spatial structure slowly, where a stack of dense convolutions learns to name a scene's shapes
in a fraction of the steps. ``image.family: convnet`` selects it; widths and strides are ``image.conv_channels`` and
``image.conv_strides``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openalign.config import ImageTowerConfig
from openalign.model.layers import BatchNorm2d, maybe_checkpointed


class ConvBNReLU(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, cfg: ImageTowerConfig):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn = BatchNorm2d.for_tower(cout, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class ConvNet(nn.Module):
    """``forward`` maps [B, 3, H, W] pixels to [B, num_features]: the global average pool of the last layer."""

    def __init__(self, cfg: ImageTowerConfig):
        super().__init__()
        self.cfg = cfg
        widths = (3, *cfg.conv_channels)
        self.layers = nn.ModuleList(
            ConvBNReLU(cin, cout, stride, cfg)
            for cin, cout, stride in zip(widths[:-1], widths[1:], cfg.conv_strides, strict=True)
        )
        self.num_features = cfg.conv_channels[-1]
        self.gradient_checkpointing = cfg.gradient_checkpointing
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """He init for ReLU layers, N(0, 2 / fan_out), as torchvision's ResNets; batch norm starts as identity."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.feature_map(pixel_values).mean((2, 3))

    def feature_map(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The last layer's output [B, num_features, h, w], before the pool."""
        x = pixel_values.contiguous(memory_format=torch.channels_last) if self.cfg.channels_last else pixel_values
        for layer in self.layers:
            x = maybe_checkpointed(self.gradient_checkpointing and self.training, layer)(x)
        return x
