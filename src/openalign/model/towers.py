"""The image tower a config names, for every model that has one (the dual encoder, the copy detector)."""

from __future__ import annotations

from openalign.config import ImageTowerConfig
from openalign.model.convnet import ConvNet
from openalign.model.efficientnet import EfficientNet


def image_tower(cfg: ImageTowerConfig) -> ConvNet | EfficientNet:
    """The image tower ``cfg.family`` names: the plain convolutional stack or the EfficientNet."""
    return ConvNet(cfg) if cfg.family == "convnet" else EfficientNet(cfg)
