"""A copy detector: the separately trained image embedding model that finds near-duplicates of test images.

The ALIGN supplement removes training images that are near-duplicates of evaluation images with "a separate
high-quality image embedding model" and a cosine threshold of 0.975 (``openalign.data.dedup``). A generic
image embedding is the wrong tool for that threshold: it maps two *different* photos of the same kind of
scene close together, while what must come out close is the *same* photo after the web has re-cropped,
resized, colour-corrected and re-compressed it. So the detector here is trained for exactly that, on the
crawl's own images and without labels (in the spirit of SimCLR, Chen et al. 2020, and of copy-detection
descriptors such as SSCD, Pizzi et al. 2022):

- two views of one image, each passed through what reposting does to a picture (a re-crop of a few percent
  and a resize, a lower-resolution copy scaled back up, brightness/contrast/colour changes, a JPEG
  re-encode at a random quality), are the positive pair; every other image of the batch is a negative;
- the loss is ``openalign.loss.contrastive_loss`` (symmetric InfoNCE) with a low fixed temperature, so even
  a negative at cosine 0.9 costs a lot and the model learns to keep distinct images well apart while the
  views of one image collapse to almost the same point;
- a small extra term keeps pulling the two views together after InfoNCE is satisfied, because the
  threshold asks copies to reach cosine 0.975, not merely to beat the negatives;
- the network is the nano EfficientNet image tower, its last feature map pooled to a coarse grid (layout
  is what tells two scenes of the same kind apart) and linearly projected, L2-normalised.

Everything a step needs is precomputed or batched: images are decoded and resized once, JPEG round trips are
done once per image (a few variants at random qualities), and the geometric and colour changes run on whole
batches in torch. Exact duplicates among the training images (one image behind many alt-texts) are dropped
before training, since two copies in one batch would be a positive pair scored as a negative.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from openalign.config import ConfigError, ImageTowerConfig, from_dict, model_config, to_dict
from openalign.loss import contrastive_loss
from openalign.model.efficientnet import EfficientNet
from openalign.optim import OptimConfig, build_optimizer, warmup_cosine

__all__ = [
    "AugmentConfig",
    "CopyDetector",
    "CopyDetectorConfig",
    "augment_views",
    "colour_jitter",
    "crop_resize",
    "train_copy_detector",
]

FORMAT = "openalign-copy-detector"
FORMAT_VERSION = 1


def _nano_image_tower() -> ImageTowerConfig:
    return model_config("nano").image


@dataclass
class CopyDetectorConfig:
    """The detector's network: an EfficientNet image tower, a linear projection, L2 normalisation."""

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


@dataclass
class AugmentConfig:
    """What reposting does to an image, as training views; a bit stronger than the copies to be found.

    The defaults cover the synthetic world's planted copies (re-crop ≤ 4 %, brightness ±7 %, colour ±10 %,
    JPEG 70–90) with a margin, so real copies fall inside what the detector was taught to ignore.
    """

    crop: float = 0.06  # each side independently loses up to this fraction of the side, then resize back
    rescale_prob: float = 0.5  # fraction of views stored at a lower resolution and scaled back up
    rescale_min: float = 0.5  # smallest side of that copy, as a fraction of the side
    brightness: float = 0.1  # multiply by U(1 - b, 1 + b)
    contrast: float = 0.1  # scale deviations from the image's mean grey by U(1 - c, 1 + c)
    saturation: float = 0.15  # scale deviations from each pixel's grey by U(1 - s, 1 + s)
    jpeg_variants: int = 2  # JPEG round trips precomputed per image; a view is one of them or the original
    jpeg_quality: tuple[int, int] = (40, 95)  # quality range of those round trips

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
        if self.jpeg_variants < 0:
            raise ConfigError(f"augment.jpeg_variants must be 0 or more, got {self.jpeg_variants}")
        lo, hi = self.jpeg_quality
        if not 1 <= lo <= hi <= 100:
            raise ConfigError(f"augment.jpeg_quality must be 1 <= low <= high <= 100, got {self.jpeg_quality}")


# --------------------------------------------------------------------------------------------------
# The model


class CopyDetector(nn.Module):
    """Image → unit vector; copies of one image land within a small angle of each other."""

    def __init__(self, config: CopyDetectorConfig | None = None):
        super().__init__()
        self.config = config or CopyDetectorConfig()
        self.config.validate()
        self.backbone = EfficientNet(self.config.image)
        self.projection = nn.Linear(self.backbone.num_features * self.config.grid**2, self.config.embed_dim)
        self.train_stats: dict[str, Any] = {}

    @property
    def embed_dim(self) -> int:
        return self.config.embed_dim

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] pixels in [-1, 1] → [B, embed_dim] L2-normalised embeddings."""
        net = self.backbone
        x = pixel_values.contiguous(memory_format=torch.channels_last) if net.cfg.channels_last else pixel_values
        x = net.stem(x)
        for block in net.blocks:
            x = block(x)
        x = F.adaptive_avg_pool2d(x, self.config.grid).flatten(1)
        return F.normalize(self.projection(x), dim=-1)

    def preprocess(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """PIL images → [B, 3, S, S] float pixels in [-1, 1], the whole image resized to the model's size."""
        return _to_pixels(torch.from_numpy(np.stack([_to_array(im, self.config.image_size) for im in images])))

    @torch.inference_mode()
    def embed(self, images: Iterable[Image.Image], batch_size: int = 256, progress: bool = False) -> np.ndarray:
        """L2-normalised float32 embeddings [N, embed_dim] of PIL images, in input order.

        Runs in eval mode on CPU, ``batch_size`` images at a time, so an iterator of any length is fine.
        An image that cannot be decoded raises ValueError naming its position.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        was_training = self.training
        self.eval()
        out: list[np.ndarray] = []
        batch: list[np.ndarray] = []
        bar = tqdm(desc="copy-embed", unit="img", disable=not progress, dynamic_ncols=True)

        def flush() -> None:
            pixels = _to_pixels(torch.from_numpy(np.stack(batch)))
            out.append(self(pixels).float().numpy())
            bar.update(len(batch))
            batch.clear()

        try:
            for i, image in enumerate(images):
                try:
                    batch.append(_to_array(image, self.config.image_size))
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

    def save(self, path: str | Path) -> Path:
        """Write ``config.json`` (config, format marker, training stats) and ``model.safetensors`` to ``path``."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        tmp = out / "model.safetensors.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.replace(out / "model.safetensors")
        stats = {k: v for k, v in self.train_stats.items() if k != "losses"}
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "detector": to_dict(self.config), "train": stats}
        (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
        return out

    @classmethod
    def load(cls, path: str | Path) -> CopyDetector:
        """A detector saved by ``save``, in eval mode."""
        root = Path(path)
        cfg_path = root / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{path}: no config.json (expected a copy detector directory)")
        meta = json.loads(cfg_path.read_text())
        if meta.get("format") != FORMAT:
            raise ConfigError(f"{cfg_path}: not a copy detector (format={meta.get('format')!r}, expected {FORMAT!r})")
        if meta.get("format_version") != FORMAT_VERSION:
            raise ConfigError(f"{cfg_path}: unsupported copy detector format_version {meta.get('format_version')!r}")
        detector = cls(from_dict(CopyDetectorConfig, meta["detector"], "copy_detector"))
        weights = root / "model.safetensors"
        if not weights.is_file():
            raise FileNotFoundError(f"{path}: no model.safetensors")
        detector.load_state_dict(load_file(str(weights)), strict=True)
        detector.train_stats = dict(meta.get("train", {}))
        return detector.eval()


# --------------------------------------------------------------------------------------------------
# Images and augmentation


def _to_array(image: Image.Image, size: int) -> np.ndarray:
    """uint8 [3, size, size] of the whole image (RGB; alpha and palettes flattened)."""
    if not isinstance(image, Image.Image):
        raise ValueError(f"expected a PIL image, got {type(image).__name__}")
    if image.mode != "RGB":
        image = image.convert("RGB")
    if image.size != (size, size):
        image = image.resize((size, size), Image.Resampling.BICUBIC, reducing_gap=3.0)
    return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1).copy()


def _to_pixels(x: torch.Tensor) -> torch.Tensor:
    """uint8 or [0, 1] float → [-1, 1] float, the ALIGN pixel convention."""
    if x.dtype == torch.uint8:
        x = x.float() / 255.0
    return x * 2.0 - 1.0


def _jpeg_round_trip(array: np.ndarray, quality: int) -> np.ndarray:
    buf = io.BytesIO()
    Image.fromarray(array.transpose(1, 2, 0)).save(buf, format="JPEG", quality=quality)
    return np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"), dtype=np.uint8).transpose(2, 0, 1)


def _uniform(n: int, low: float, high: float, generator: torch.Generator) -> torch.Tensor:
    return torch.rand(n, generator=generator) * (high - low) + low


def _grey(x: torch.Tensor) -> torch.Tensor:
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
    mean = _grey(x).mean(dim=(2, 3), keepdim=True)
    x = ((x - mean) * contrast.view(shape) + mean).clamp(0.0, 1.0)
    grey = _grey(x)
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
    return _to_pixels(colour_jitter(x, *factors))


def _prepare(
    images: Iterable[Image.Image], size: int, max_images: int, progress: bool
) -> tuple[np.ndarray, dict[str, int]]:
    """Decode and resize once; drop exact duplicates and unreadable images (counted, never fatal)."""
    arrays: list[np.ndarray] = []
    seen: set[bytes] = set()
    counts = {"images_in": 0, "exact_duplicates": 0, "unreadable": 0}
    bar = tqdm(images, desc="copy-prepare", unit="img", disable=not progress, dynamic_ncols=True)
    for image in bar:
        counts["images_in"] += 1
        try:
            array = _to_array(image, size)
        except (OSError, ValueError):
            counts["unreadable"] += 1
            continue
        digest = hashlib.blake2b(array.tobytes(), digest_size=16).digest()
        if digest in seen:
            counts["exact_duplicates"] += 1
            continue
        seen.add(digest)
        arrays.append(array)
        if len(arrays) >= max_images:
            break
    bar.close()
    if len(arrays) < 2:
        raise ValueError(f"train_copy_detector needs at least 2 distinct readable images, got {len(arrays)}")
    return np.stack(arrays), counts


def _jpeg_bank(arrays: np.ndarray, cfg: AugmentConfig, seed: int, progress: bool) -> torch.Tensor:
    """[N, 1 + jpeg_variants, 3, S, S] uint8: the image, then its JPEG round trips at random qualities."""
    rng = random.Random(f"copy-detection-jpeg/{seed}")
    bank = np.empty((len(arrays), 1 + cfg.jpeg_variants, *arrays.shape[1:]), dtype=np.uint8)
    bank[:, 0] = arrays
    lo, hi = cfg.jpeg_quality
    for i in tqdm(range(len(arrays)), desc="copy-jpeg", unit="img", disable=not progress or not cfg.jpeg_variants):
        for j in range(cfg.jpeg_variants):
            bank[i, 1 + j] = _jpeg_round_trip(arrays[i], rng.randint(lo, hi))
    return torch.from_numpy(bank)


def _views(bank: torch.Tensor, idx: torch.Tensor, cfg: AugmentConfig, generator: torch.Generator) -> torch.Tensor:
    variant = torch.randint(0, bank.shape[1], (len(idx),), generator=generator)
    return augment_views(bank[idx, variant], cfg, generator)


@torch.no_grad()
def _recalibrate_batch_norm(model: CopyDetector, arrays: np.ndarray, batch_size: int, max_images: int) -> None:
    """Re-estimate batch-norm statistics as exact averages over clean images.

    A short run leaves the running statistics far from the final weights' (momentum 0.01 forgets slowly),
    and eval mode would then see different activations than training did.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the batches below
    model.train()
    subset = torch.from_numpy(arrays[:max_images])
    for s in range(0, len(subset), batch_size):
        chunk = subset[s : s + batch_size]
        if len(chunk) > 1:
            model(_to_pixels(chunk))
    for m, momentum in zip(norms, saved, strict=True):
        m.momentum = momentum
    model.eval()


# --------------------------------------------------------------------------------------------------
# Training


def train_copy_detector(
    images: Iterable[Image.Image],
    *,
    image_size: int = 64,
    embed_dim: int = 128,
    grid: int = 2,
    steps: int = 300,
    batch_size: int = 128,
    seconds: float | None = None,
    lr: float = 3e-3,
    weight_decay: float = 1e-4,
    optimizer: Literal["adamw", "lamb"] = "adamw",
    warmup_steps: int = 20,
    temperature: float = 0.05,
    alignment: float = 0.1,
    augment: AugmentConfig | None = None,
    max_images: int = 20_000,
    seed: int = 0,
    progress: bool = False,
) -> CopyDetector:
    """Train a copy detector on unlabelled images (e.g. the crawl's own) and return it in eval mode.

    Each step draws ``batch_size`` distinct images, makes two reposting-style views of each and minimises
    ``contrastive_loss(view_a, view_b, temperature)`` without label smoothing, plus ``alignment`` times the
    views' mean ``(1 - cosine) / temperature`` (0 turns that pull off). Training stops after
    ``steps`` steps or ``seconds`` of wall time, whichever comes first; the learning rate follows a warmup
    then a cosine decay over whichever budget is being used up faster, so a run cut short by ``seconds``
    still ends annealed. At most ``max_images`` distinct images are used (the first ones). The result is
    deterministic for a given ``seed`` and thread count; ``detector.train_stats`` records the per-step
    losses, steps, seconds and image counts (exact duplicates and unreadable images are skipped and counted).
    """
    augment = augment or AugmentConfig()
    augment.validate()
    config = CopyDetectorConfig(image_size=image_size, embed_dim=embed_dim, grid=grid, temperature=temperature)
    config.validate()
    if steps < 1 or batch_size < 2:
        raise ValueError(f"steps must be ≥ 1 and batch_size ≥ 2, got steps={steps}, batch_size={batch_size}")
    if seconds is not None and not seconds > 0:
        raise ValueError(f"seconds must be positive or None, got {seconds}")
    if alignment < 0:
        raise ValueError(f"alignment must be 0 or more, got {alignment}")
    if max_images < 2:
        raise ValueError(f"max_images must be at least 2, got {max_images}")
    start = time.perf_counter()
    arrays, counts = _prepare(images, image_size, max_images, progress)
    bank = _jpeg_bank(arrays, augment, seed, progress)
    batch_size = min(batch_size, len(arrays))

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CopyDetector(config)
    generator = torch.Generator().manual_seed(seed)
    opt = build_optimizer(
        model,
        OptimConfig(name=optimizer, lr=lr, weight_decay=weight_decay, schedule="constant", warmup_steps=0),
    )
    warmup = min(warmup_steps, max(0, steps - 1))
    losses: list[float] = []
    order = torch.randperm(len(arrays), generator=generator)
    cursor = 0
    model.train()
    train_start = time.perf_counter()
    bar = tqdm(total=steps, desc="copy-train", unit="step", disable=not progress, dynamic_ncols=True)
    step = 0
    while step < steps:
        elapsed = time.perf_counter() - train_start
        if seconds is not None and elapsed >= seconds:
            break
        # Progress through the run in steps, or in time when the clock runs out sooner.
        position = step if seconds is None else max(step, int(steps * elapsed / seconds))
        factor = warmup_cosine(min(position, steps - 1), warmup, steps) if steps > 1 else 1.0
        for group in opt.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0) * factor
        if cursor + batch_size > len(order):  # a new epoch: every image once before any twice
            order, cursor = torch.randperm(len(arrays), generator=generator), 0
        idx = order[cursor : cursor + batch_size]
        cursor += batch_size
        view_a, view_b = _views(bank, idx, augment, generator), _views(bank, idx, augment, generator)
        emb_a, emb_b = model(view_a), model(view_b)
        loss = contrastive_loss(emb_a, emb_b, temperature, label_smoothing=0.0, gather=False)
        if alignment:
            # InfoNCE stops pulling a positive pair once it beats the negatives by a few temperatures; the
            # threshold needs copies at cosine > 0.975, so keep pulling (the alignment term of Wang & Isola).
            loss = loss + alignment * (1.0 - (emb_a * emb_b).sum(-1)).mean() / temperature
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        bar.update(1)
        if progress:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", img_s=f"{2 * step * batch_size / (elapsed or 1e-9):.0f}")
    bar.close()
    train_seconds = time.perf_counter() - train_start
    _recalibrate_batch_norm(model, arrays, batch_size=max(batch_size, 64), max_images=4096)
    model.train_stats = {
        **counts,
        "images_used": len(arrays),
        "steps": step,
        "batch_size": batch_size,
        "train_seconds": round(train_seconds, 3),
        "total_seconds": round(time.perf_counter() - start, 3),
        "seed": seed,
        "augment": to_dict(augment),
        "losses": losses,
    }
    return model.eval()
