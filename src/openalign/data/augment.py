"""What reposting does to a picture, as batched torch operations: the training views of the copy detector.

A copy of a web image has usually been re-cropped by a few percent, resized, stored at a lower resolution and
scaled back up, colour-corrected and re-compressed. ``augment_views`` does the geometric and colour part of
that to a whole batch at once; JPEG artefacts come from round trips made once per image (``jpeg_round_trip``)
that the caller picks from. Everything here is model-free: whole-image pixels in (``image_array``), pixels in
[-1, 1] out (``to_pixels``), the pixel convention of the copy detector these views train.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from openalign.config import ConfigError

__all__ = [
    "AugmentConfig",
    "augment_views",
    "colour_jitter",
    "crop_resize",
    "image_array",
    "jpeg_round_trip",
    "luma",
    "to_pixels",
]


@dataclass
class AugmentConfig:
    """What reposting does to an image, as training views; a bit stronger than the copies to be found.

    The batched views cover the synthetic world's planted copies (re-crop ≤ 4 %, brightness ±7 %, colour
    ±10 %, JPEG 70–90) with a margin; ``reposts`` adds the web's heavy edits (mirrors, pages, several edits at
    once), which a detector trained on the batched views alone finds less often.
    """

    crop: float = 0.06  # each side independently loses up to this fraction of the side, then resize back
    rescale_prob: float = 0.5  # fraction of views stored at a lower resolution and scaled back up
    rescale_min: float = 0.5  # smallest side of that copy, as a fraction of the side
    brightness: float = 0.1  # multiply by U(1 - b, 1 + b)
    contrast: float = 0.1  # scale deviations from the image's mean grey by U(1 - c, 1 + c)
    saturation: float = 0.15  # scale deviations from each pixel's grey by U(1 - s, 1 + s)
    jpeg_variants: int = 2  # JPEG round trips precomputed per image; a view is one of them or the original
    jpeg_quality: tuple[int, int] = (40, 95)  # quality range of those round trips
    # copies per image made once, before training, by openalign.data.reposting's random_repost (1 to 3 of its
    # edits at random strengths: re-crop, padding, mirror, rotation, captions and logos, embedding in a page,
    # ...), among which a view picks as among the JPEG variants: the heavy edits of the web that batched
    # torch views do not make. 0 = off
    reposts: int = 2

    def validate(self) -> None:
        """Raises ConfigError naming the bad field."""
        if not 0 <= self.crop < 0.5:
            raise ConfigError(f"augment.crop must be in [0, 0.5), got {self.crop}")
        if not 0 <= self.rescale_prob <= 1:
            raise ConfigError(f"augment.rescale_prob must be in [0, 1], got {self.rescale_prob}")
        if not 0 < self.rescale_min <= 1:
            raise ConfigError(f"augment.rescale_min must be in (0, 1], got {self.rescale_min}")
        for name in ("brightness", "contrast", "saturation"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"augment.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.jpeg_variants < 0 or self.reposts < 0:
            raise ConfigError(
                f"augment.jpeg_variants and augment.reposts must be 0 or more, got {self.jpeg_variants}, {self.reposts}"
            )
        if len(self.jpeg_quality) != 2:
            raise ConfigError(f"augment.jpeg_quality must be [low, high], got {list(self.jpeg_quality)}")
        lo, hi = self.jpeg_quality
        if not 1 <= lo <= hi <= 100:
            raise ConfigError(f"augment.jpeg_quality must be 1 <= low <= high <= 100, got {self.jpeg_quality}")


# --------------------------------------------------------------------------------------------------
# Pixels


def image_array(image: Image.Image, size: int) -> np.ndarray:
    """uint8 [3, size, size] of the whole image (RGB; alpha and palettes flattened), resized without a crop."""
    if not isinstance(image, Image.Image):
        raise ValueError(f"expected a PIL image, got {type(image).__name__}")
    if image.mode != "RGB":
        image = image.convert("RGB")
    if image.size != (size, size):
        image = image.resize((size, size), Image.Resampling.BICUBIC, reducing_gap=3.0)
    array: np.ndarray = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1).copy()
    return array


def to_pixels(x: torch.Tensor) -> torch.Tensor:
    """uint8 or [0, 1] float → [-1, 1] float, the ALIGN pixel convention."""
    if x.dtype == torch.uint8:
        x = x.float() / 255.0
    return x * 2.0 - 1.0


def jpeg_round_trip(array: np.ndarray, quality: int) -> np.ndarray:
    """uint8 [3, H, W] encoded as JPEG at ``quality`` (4:2:0, as most web JPEGs are) and decoded again.

    By libjpeg-turbo through simplejpeg, array to array: for the thumbnails a copy detector trains on, PIL's
    image objects and file parsing around the same library would take most of the time."""
    import simplejpeg

    hwc = np.ascontiguousarray(array.transpose(1, 2, 0))
    data = simplejpeg.encode_jpeg(hwc, quality=quality, colorspace="RGB", colorsubsampling="420", fastdct=False)
    decoded: np.ndarray = simplejpeg.decode_jpeg(data, colorspace="RGB")
    chw: np.ndarray = decoded.transpose(2, 0, 1)
    return chw


# --------------------------------------------------------------------------------------------------
# Batched changes


def _uniform(n: int, low: float, high: float, generator: torch.Generator) -> torch.Tensor:
    return torch.rand(n, generator=generator) * (high - low) + low


def luma(x: torch.Tensor) -> torch.Tensor:
    """ITU-R 601 luma, the grey PIL's ImageEnhance blends towards."""
    return 0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3]


def crop_resize(x: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """Crop each image to its box and resize it back to the full size, all in one bilinear resample.

    ``x`` is [B, C, H, W] float; ``boxes`` [B, 4] holds the fractions (left, right, top, bottom) of the side
    cut off each edge. Inside the box this equals cropping then ``F.interpolate(..., mode="bilinear")``.
    """
    left, right, top, bottom = boxes.to(x.dtype).unbind(1)
    # affine_grid maps output coordinates in [-1, 1] into the input: the kept box spans
    # [-1 + 2·left, 1 - 2·right], so its half-width is 1 - left - right and its centre left - right.
    theta = x.new_zeros(x.shape[0], 2, 3)
    theta[:, 0, 0] = 1.0 - left - right
    theta[:, 0, 2] = left - right
    theta[:, 1, 1] = 1.0 - top - bottom
    theta[:, 1, 2] = top - bottom
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def colour_jitter(
    x: torch.Tensor, brightness: torch.Tensor, contrast: torch.Tensor, saturation: torch.Tensor
) -> torch.Tensor:
    """PIL ``ImageEnhance`` Brightness, Contrast then Color with per-image factors [B], on [B, 3, H, W] in [0, 1].

    Each step clips to [0, 1] as PIL's 8-bit images do. Contrast blends towards the image's mean grey,
    saturation towards each pixel's grey.
    """
    shape = (x.shape[0], 1, 1, 1)
    x = (x * brightness.view(shape)).clamp(0.0, 1.0)
    mean = luma(x).mean(dim=(2, 3), keepdim=True)
    x = ((x - mean) * contrast.view(shape) + mean).clamp(0.0, 1.0)
    grey = luma(x)
    return ((x - grey) * saturation.view(shape) + grey).clamp(0.0, 1.0)


def augment_views(x: torch.Tensor, cfg: AugmentConfig, generator: torch.Generator) -> torch.Tensor:
    """Reposting-style views of a batch: [B, 3, S, S] uint8 (or [0, 1] float) → [B, 3, S, S] in [-1, 1].

    Per image: an independent crop of up to ``crop`` on each side resized back to S, with probability
    ``rescale_prob`` a round trip through a lower resolution (one random size per batch, so it stays one
    interpolate call), then brightness, contrast and saturation. Batched throughout: a step costs a few
    milliseconds however large the batch. JPEG artefacts come from precomputed variants the caller picks.
    """
    if x.dtype == torch.uint8:
        x = x.float() / 255.0
    n, _, h, w = x.shape
    if cfg.crop > 0:
        x = crop_resize(x, torch.rand(n, 4, generator=generator) * cfg.crop)
    if cfg.rescale_prob > 0 and cfg.rescale_min < 1:
        pick = torch.rand(n, generator=generator) < cfg.rescale_prob
        factor = float(_uniform(1, cfg.rescale_min, 1.0, generator))
        if pick.any():
            small = (max(2, round(h * factor)), max(2, round(w * factor)))
            down = F.interpolate(x[pick], size=small, mode="bilinear", antialias=True, align_corners=False)
            x = x.clone()
            x[pick] = F.interpolate(down, size=(h, w), mode="bilinear", align_corners=False)
    amounts = (cfg.brightness, cfg.contrast, cfg.saturation)
    factors = [_uniform(n, 1 - amount, 1 + amount, generator) for amount in amounts]
    return to_pixels(colour_jitter(x, *factors))
