"""A copy detector: the separately trained image embedding model that finds near-duplicates of test images.

The ALIGN supplement removes training images that are near-duplicates of evaluation images with "a separate
high-quality image embedding model" and a cosine threshold of 0.975 (``openalign.data.dedup``). A generic
image embedding is the wrong tool for that threshold: it maps two *different* photos of the same kind of
scene close together, while what must come out close is the *same* photo after the web has re-cropped,
resized, colour-corrected and re-compressed it. This network is trained for exactly that
(``openalign.pipeline.copy_detector``): the nano image tower (its EfficientNet, or the plain convolutional
stack with ``image.family: convnet``), its last feature map pooled to a coarse grid (layout is what tells two
scenes of the same kind apart), linearly projected and L2-normalised.

It saves and loads like every openalign model, through ``openalign.model.io`` (``save_model``,
``load_copy_detector``): ``config.json`` with this config, plus ``model.safetensors``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from tqdm import tqdm

from openalign.config import ConfigError, ImageTowerConfig, model_config
from openalign.data.augment import image_array, to_pixels
from openalign.model.towers import image_tower

__all__ = ["CopyDetector", "CopyDetectorConfig"]


def _nano_image_tower() -> ImageTowerConfig:
    return model_config("nano").image


@dataclass
class CopyDetectorConfig:
    """The detector's network: an image tower (the nano EfficientNet unless ``image.family`` says convnet), a linear
    projection, L2 normalisation."""

    image: ImageTowerConfig = field(default_factory=_nano_image_tower)
    image_size: int = 64  # every image is resized (whole, no crop) to this square before embedding
    embed_dim: int = 128
    # The last feature map is average-pooled to grid × grid cells and flattened before the projection: a global
    # mean would throw away where things are, and two different scenes often differ only in that.
    grid: int = 2
    temperature: float = 0.05  # fixed InfoNCE temperature of training; low, so close negatives still cost

    def validate(self) -> None:
        """Raises ConfigError naming the bad field."""
        if self.image_size < 16:
            raise ConfigError(f"copy_detector.image_size must be at least 16, got {self.image_size}")
        if self.grid < 1:
            raise ConfigError(f"copy_detector.grid must be positive, got {self.grid}")
        if self.embed_dim < 1:
            raise ConfigError(f"copy_detector.embed_dim must be positive, got {self.embed_dim}")
        if not 0 < self.temperature <= 10:
            raise ConfigError(f"copy_detector.temperature must be in (0, 10], got {self.temperature}")


class CopyDetector(nn.Module):
    """Image → unit vector; copies of one image land within a small angle of each other."""

    def __init__(self, config: CopyDetectorConfig | None = None):
        super().__init__()
        self.config = config or CopyDetectorConfig()
        self.config.validate()
        self.backbone = image_tower(self.config.image)
        self.projection = nn.Linear(self.backbone.num_features * self.config.grid**2, self.config.embed_dim)
        # How it was trained (steps, image counts, per-step losses); saved in config.json without the losses.
        self.train_stats: dict[str, Any] = {}

    @property
    def embed_dim(self) -> int:
        return self.config.embed_dim

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] pixels in [-1, 1] → [B, embed_dim] L2-normalised embeddings."""
        x = F.adaptive_avg_pool2d(self.backbone.feature_map(pixel_values), self.config.grid).flatten(1)
        return F.normalize(self.projection(x), dim=-1)

    def preprocess(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """PIL images → [B, 3, S, S] float pixels in [-1, 1], the whole image resized to the model's size."""
        return to_pixels(torch.from_numpy(np.stack([image_array(im, self.config.image_size) for im in images])))

    @torch.inference_mode()
    def embed(
        self,
        images: Iterable[Image.Image],
        batch_size: int = 256,
        progress: bool = False,
        device: str | torch.device = "cpu",
    ) -> np.ndarray:
        """L2-normalised float32 embeddings [N, embed_dim] of PIL images, in input order.

        Runs in eval mode on ``device`` (the model is moved there), ``batch_size`` images at a time, so an
        iterator of any length is fine. An image that cannot be decoded raises ValueError naming its position.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        was_training = self.training
        self.eval()
        self.to(device)
        out: list[np.ndarray] = []
        batch: list[np.ndarray] = []
        bar = tqdm(desc="copy-embed", unit="img", disable=not progress, dynamic_ncols=True)

        def flush() -> None:
            pixels = to_pixels(torch.from_numpy(np.stack(batch)).to(device))
            out.append(self(pixels).float().cpu().numpy())
            bar.update(len(batch))
            batch.clear()

        try:
            for i, image in enumerate(images):
                try:
                    batch.append(image_array(image, self.config.image_size))
                except (OSError, ValueError) as err:
                    raise ValueError(f"image {i}: {err}") from err
                if len(batch) == batch_size:
                    flush()
            if batch:
                flush()
        finally:
            bar.close()
            self.train(was_training)
        if not out:
            return np.zeros((0, self.embed_dim), dtype=np.float32)
        return np.ascontiguousarray(np.concatenate(out), dtype=np.float32)
