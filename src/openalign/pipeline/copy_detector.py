"""Training the copy detector (``openalign.model.copy_detector``) on the crawl's own images, without labels.

The detector must map the *same* photo after reposting (re-cropped, resized, colour-corrected, re-compressed)
to almost the same point, and different photos well apart, so that the supplement's cosine threshold of 0.975
separates copies from look-alikes. It is trained for exactly that, in the spirit of SimCLR (Chen et al. 2020)
and of copy-detection descriptors such as SSCD (Pizzi et al. 2022):

- two views of one image, each passed through what reposting does to a picture (``openalign.data.augment``:
  a re-crop of a few percent and a resize, a lower-resolution copy scaled back up, brightness/contrast/colour
  changes, a JPEG re-encode at a random quality), are the positive pair; every other image of the batch is a
  negative. A view starts from the image, one of its JPEG round trips or one of its reposted copies
  (``openalign.data.reposting``: padding, mirroring, captions, embedding in a page, ...), made once;
- the loss is ``openalign.loss.contrastive_loss`` (symmetric InfoNCE) with a low fixed temperature, so even
  a negative at cosine 0.9 costs a lot and the model learns to keep distinct images well apart while the
  views of one image collapse to almost the same point;
- a small extra term keeps pulling the two views together after InfoNCE is satisfied, because the
  threshold asks copies to reach cosine 0.975, not merely to beat the negatives.

Everything a step needs is precomputed or batched: images are decoded and resized once, JPEG round trips and
reposted copies are made once per image (a few of each), and the geometric and colour
changes run on whole batches in torch. Exact duplicates among the training images (one image behind many
alt-texts) are dropped before training, since two copies in one batch would be a positive pair scored as a
negative.

``train_copy_detector`` trains on any iterable of PIL images; ``train_copy_detector_from_source`` reads an
image folder, a table or WebDataset shards through ``openalign.data.sources`` and saves the result with
``openalign.model.io.save_model`` (what ``openalign copy-detector train`` runs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image
from torch import nn
from tqdm import tqdm

from openalign.config import ConfigError, to_dict
from openalign.data.augment import AugmentConfig, augment_views, image_array, jpeg_round_trip, to_pixels
from openalign.data.reposting import random_repost
from openalign.data.sources import Source, decode_records, file_limit, open_source
from openalign.loss import contrastive_loss
from openalign.model.copy_detector import CopyDetector, CopyDetectorConfig
from openalign.model.io import save_model
from openalign.optim import OptimConfig, build_optimizer, warmup_cosine
from openalign.pipeline.copy_threshold import ThresholdFit, ThresholdFitConfig, fit_threshold_on_images, write_curve

__all__ = [
    "CopyDetectorRun",
    "CopyDetectorTrainConfig",
    "train_copy_detector",
    "train_copy_detector_from_source",
]


@dataclass
class CopyDetectorTrainConfig:
    """How the copy detector is built and trained (``openalign copy-detector train``)."""

    image_size: int = 64  # every image is resized (whole, no crop) to this square before embedding
    # The network: the nano EfficientNet, or the plain stack of 3x3 convolutions (openalign.model.convnet).
    family: Literal["efficientnet", "convnet"] = "efficientnet"
    embed_dim: int = 128  # width of the L2-normalised embedding
    grid: int = 2  # the last feature map is pooled to grid × grid cells (where things are) before the projection
    steps: int = 300  # training steps
    batch_size: int = 128  # distinct images per step, two views each; capped at the number of distinct images
    seconds: float | None = None  # also stop after this much training time; the schedule anneals over it
    lr: float = 3e-3  # peak learning rate
    weight_decay: float = 1e-4  # decoupled weight decay
    optimizer: Literal["adamw", "lamb"] = "adamw"  # openalign.optim's AdamW or LAMB
    warmup_steps: int = 20  # linear warmup before the cosine decay
    temperature: float = 0.05  # fixed InfoNCE temperature; low, so close negatives still cost
    alignment: float = 0.1  # weight of the extra pull between two views once InfoNCE is satisfied; 0 = off
    max_images: int = 20_000  # train on at most this many distinct images (the first ones)
    seed: int = 0  # weights, batches, views and JPEG qualities
    image_root: str | None = None  # a table source's image_path values start here (default the table's folder)
    max_file_mb: float = 64.0  # larger image files (and shard members) are skipped unread as too_large_file
    # table source: also read image paths that resolve outside the image root (else skipped as outside_root)
    allow_outside_root: bool = False
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    fit: ThresholdFitConfig = field(default_factory=ThresholdFitConfig)

    def detector(self) -> CopyDetectorConfig:
        """The network these settings build."""
        image = dataclasses.replace(CopyDetectorConfig().image, family=self.family)
        return CopyDetectorConfig(
            image=image,
            image_size=self.image_size,
            embed_dim=self.embed_dim,
            grid=self.grid,
            temperature=self.temperature,
        )

    def validate(self) -> None:
        """Raises ConfigError naming the bad field."""
        self.augment.validate()
        self.fit.validate()
        self.detector().validate()
        if self.steps < 1 or self.batch_size < 2:
            raise ConfigError(
                f"copy detector steps must be ≥ 1 and batch_size ≥ 2, got steps={self.steps}, "
                f"batch_size={self.batch_size}"
            )
        if self.seconds is not None and not self.seconds > 0:
            raise ConfigError(f"copy detector seconds must be positive or none, got {self.seconds}")
        if self.alignment < 0:
            raise ConfigError(f"copy detector alignment must be 0 or more, got {self.alignment}")
        if self.max_images < 2:
            raise ConfigError(f"copy detector max_images must be at least 2, got {self.max_images}")
        if self.lr <= 0 or self.weight_decay < 0 or self.warmup_steps < 0:
            raise ConfigError("copy detector lr must be positive, weight_decay and warmup_steps 0 or more")
        try:
            file_limit(self.max_file_mb)
        except ValueError as err:
            raise ConfigError(f"copy detector {err}") from None


@dataclass
class CopyDetectorRun:
    """A detector trained from a source and saved: where it is, how training went, what was skipped."""

    path: Path
    detector: CopyDetector
    skipped: dict[str, int] = field(default_factory=dict)  # input items that could not be read, by reason
    fit: ThresholdFit | None = None  # the operating threshold fitted on held-out images (None: none held out)

    @property
    def stats(self) -> dict[str, Any]:
        """Image counts, steps, seconds and per-step losses of the run (``CopyDetector.train_stats``)."""
        return self.detector.train_stats

    @property
    def steps(self) -> int:
        return int(self.stats["steps"])

    @property
    def images_used(self) -> int:
        return int(self.stats["images_used"])


# --------------------------------------------------------------------------------------------------
# Preparation: decoded once, JPEG variants once

# Held-out images are kept at most this large: enough for reposting edits to act as on a photo, while their
# memory follows the holdout setting, not the source's image sizes.
_HOLDOUT_SIDE = 256


def _reposted(image: Image.Image, size: int, count: int, rng: random.Random) -> np.ndarray:
    """uint8 [count, 3, size, size]: ``count`` copies of ``image`` by ``random_repost`` (1 to 3 edits), made on a
    thumbnail of twice ``size`` (enough for a caption or a page around it, and cheap whatever the source's size)."""
    small = image.convert("RGB")
    small.thumbnail((2 * size, 2 * size))
    return np.stack([image_array(random_repost(small, rng, edits=rng.randint(1, 3))[0], size) for _ in range(count)])


def _prepare(
    images: Iterable[Image.Image],
    size: int,
    max_images: int,
    progress: bool,
    holdout: list[Image.Image] | None = None,
    holdout_images: int = 0,
    reposts: int = 0,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Decode and resize once; drop exact duplicates and unreadable images (counted, never fatal). Returns the
    images [N, 3, S, S], ``reposts`` reposted copies of each [N, reposts, 3, S, S] (``_reposted``) and counts.

    With ``holdout``, the next ``holdout_images`` distinct images after the first ``max_images`` are appended
    to it (as thumbnails) instead: the training images stay exactly the ones read without it.
    """
    rng = random.Random(f"copy-detection-repost/{seed}")
    arrays: list[np.ndarray] = []
    copies: list[np.ndarray] = []
    seen: set[bytes] = set()
    counts = {"images_in": 0, "exact_duplicates": 0, "unreadable": 0}
    bar = tqdm(images, desc="copy-prepare", unit="img", disable=not progress, dynamic_ncols=True)
    for image in bar:
        counts["images_in"] += 1
        try:
            array = image_array(image, size)
        except (OSError, ValueError):
            counts["unreadable"] += 1
            continue
        digest = hashlib.blake2b(array.tobytes(), digest_size=16).digest()
        if digest in seen:
            counts["exact_duplicates"] += 1
            continue
        seen.add(digest)
        if len(arrays) < max_images:
            arrays.append(array)
            if reposts:
                copies.append(_reposted(image, size, reposts, rng))
        elif holdout is not None:
            held = image.convert("RGB")
            held.thumbnail((_HOLDOUT_SIDE, _HOLDOUT_SIDE))
            holdout.append(held)
        if len(arrays) >= max_images and (holdout is None or len(holdout) >= holdout_images):
            break
    bar.close()
    if len(arrays) < 2:
        raise ValueError(f"train_copy_detector needs at least 2 distinct readable images, got {len(arrays)}")
    stacked = np.stack(arrays)
    reposted = np.stack(copies) if copies else np.zeros((len(arrays), 0, *stacked.shape[1:]), np.uint8)
    return stacked, reposted, counts


def _bank(arrays: np.ndarray, reposted: np.ndarray, cfg: AugmentConfig, seed: int, progress: bool) -> torch.Tensor:
    """[N, 1 + jpeg_variants + reposts, 3, S, S] uint8: the image, its JPEG round trips at random qualities,
    then its reposted copies: everything a view starts from."""
    rng = random.Random(f"copy-detection-jpeg/{seed}")
    first = 1 + cfg.jpeg_variants
    bank = np.empty((len(arrays), first + reposted.shape[1], *arrays.shape[1:]), dtype=np.uint8)
    bank[:, 0] = arrays
    bank[:, first:] = reposted
    lo, hi = cfg.jpeg_quality
    for i in tqdm(range(len(arrays)), desc="copy-jpeg", unit="img", disable=not progress or not cfg.jpeg_variants):
        for j in range(cfg.jpeg_variants):
            bank[i, 1 + j] = jpeg_round_trip(arrays[i], rng.randint(lo, hi))
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
            model(to_pixels(chunk))
    for m, momentum in zip(norms, saved, strict=True):
        m.momentum = momentum
    model.eval()


# --------------------------------------------------------------------------------------------------
# Training


def train_copy_detector(
    images: Iterable[Image.Image],
    config: CopyDetectorTrainConfig | None = None,
    *,
    progress: bool = False,
    holdout: list[Image.Image] | None = None,
) -> CopyDetector:
    """Train a copy detector on unlabelled images (e.g. the crawl's own) and return it in eval mode.

    Each step draws ``batch_size`` distinct images, makes two reposting-style views of each and minimises
    ``contrastive_loss(view_a, view_b, temperature)`` without label smoothing, plus ``alignment`` times the
    views' mean ``(1 - cosine) / temperature``. Training stops after ``steps`` steps or ``seconds`` of wall
    time, whichever comes first; the learning rate follows a warmup then a cosine decay over whichever budget
    is being used up faster, so a run cut short by ``seconds`` still ends annealed. At most ``max_images``
    distinct images are used (the first ones). The result is deterministic for a given ``seed`` and thread
    count; ``detector.train_stats`` records the per-step losses, steps, seconds and image counts (exact
    duplicates and unreadable images are skipped and counted). Given a ``holdout`` list, up to
    ``config.fit.holdout`` distinct images after the training ones are put in it, never trained on.
    """
    cfg = config or CopyDetectorTrainConfig()
    cfg.validate()
    augment = cfg.augment
    start = time.perf_counter()
    arrays, reposted, counts = _prepare(
        images, cfg.image_size, cfg.max_images, progress, holdout, cfg.fit.holdout, augment.reposts, cfg.seed
    )
    bank = _bank(arrays, reposted, augment, cfg.seed, progress)
    batch_size = min(cfg.batch_size, len(arrays))
    steps, temperature = cfg.steps, cfg.temperature

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = CopyDetector(cfg.detector())
    generator = torch.Generator().manual_seed(cfg.seed)
    opt = build_optimizer(
        model,
        OptimConfig(name=cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay, schedule="constant", warmup_steps=0),
    )
    warmup = min(cfg.warmup_steps, max(0, steps - 1))
    losses: list[float] = []
    order = torch.randperm(len(arrays), generator=generator)
    cursor = 0
    model.train()
    train_start = time.perf_counter()
    bar = tqdm(total=steps, desc="copy-train", unit="step", disable=not progress, dynamic_ncols=True)
    step = 0
    while step < steps:
        elapsed = time.perf_counter() - train_start
        if cfg.seconds is not None and elapsed >= cfg.seconds:
            break
        # Progress through the run in steps, or in time when the clock runs out sooner.
        position = step if cfg.seconds is None else max(step, int(steps * elapsed / cfg.seconds))
        factor = warmup_cosine(min(position, steps - 1), warmup, steps) if steps > 1 else 1.0
        for group in opt.param_groups:
            group["lr"] = cfg.lr * group.get("lr_scale", 1.0) * factor
        if cursor + batch_size > len(order):  # a new epoch: every image once before any twice
            order, cursor = torch.randperm(len(arrays), generator=generator), 0
        idx = order[cursor : cursor + batch_size]
        cursor += batch_size
        view_a, view_b = _views(bank, idx, augment, generator), _views(bank, idx, augment, generator)
        emb_a, emb_b = model(view_a), model(view_b)
        loss = contrastive_loss(emb_a, emb_b, temperature, label_smoothing=0.0, gather=False)
        if cfg.alignment:
            # InfoNCE stops pulling a positive pair once it beats the negatives by a few temperatures; the
            # threshold needs copies at cosine > 0.975, so keep pulling (the alignment term of Wang & Isola).
            loss = loss + cfg.alignment * (1.0 - (emb_a * emb_b).sum(-1)).mean() / temperature
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
        "seed": cfg.seed,
        "augment": to_dict(augment),
        "losses": losses,
    }
    return model.eval()


def train_copy_detector_from_source(
    source: str | os.PathLike[str] | Source,
    out: str | os.PathLike[str],
    config: CopyDetectorTrainConfig | None = None,
    *,
    progress: bool = False,
) -> CopyDetectorRun:
    """Train on the images of an image folder, a table or WebDataset shards (anything
    ``openalign.data.sources.open_source`` reads, or a source it opened) and save the detector in ``out``.

    Items that cannot be read or decoded are skipped and counted by reason (``CopyDetectorRun.skipped``, also
    saved with the training statistics in ``out/config.json``). When the source holds distinct images beyond
    the ``max_images`` trained on, up to ``fit.holdout`` of them fit the operating threshold
    (``openalign.pipeline.copy_threshold``): it is saved under ``train.threshold`` in ``out/config.json``, the
    curve in ``out/threshold_curve.csv``.
    """
    cfg = config or CopyDetectorTrainConfig()
    cfg.validate()
    opened = (
        source
        if isinstance(source, Source)
        else open_source(
            source,
            image_root=cfg.image_root,
            max_file_bytes=file_limit(cfg.max_file_mb),
            allow_outside_root=cfg.allow_outside_root,
        )
    )
    skipped: Counter[str] = Counter()

    def skip(reason: str, detail: str) -> None:
        skipped[reason] += 1

    images = (image for _, image in decode_records(opened.records(skip), skip))
    holdout: list[Image.Image] = []
    detector = train_copy_detector(images, cfg, progress=progress, holdout=holdout if cfg.fit.holdout else None)
    detector.train_stats["skipped"] = dict(sorted(skipped.items()))
    fit = None
    if len(holdout) >= 2:
        fit = fit_threshold_on_images(detector, holdout, cfg.fit, progress=progress)
        detector.train_stats["threshold"] = fit.to_dict()
    path = save_model(detector, Path(out))
    if fit is not None:
        write_curve(fit, path)
    return CopyDetectorRun(path, detector, dict(sorted(skipped.items())), fit)
