"""Full fine-tuning of the image tower for classification (paper Sec. 5.2, Tables 4 and 6).

Both of the paper's recipes train in two stages with SGD and momentum 0.9:

1. **head**: only a new linear classifier on the pooled EfficientNet features; the backbone is frozen
   (eval mode, so its batch-norm statistics do not move either);
2. **full**: every layer, the backbone at ``backbone_lr_scale`` (1/10) of the head's learning rate.

ImageNet (``imagenet_recipe``): lr 0.1 then 0.01, ×0.2 every 30 epochs, 100 epochs each, no weight decay.
Fine-grained (``fine_grained_recipe``): batch 256, weight decay 1e-5, lr 1e-2 then 1e-3 with cosine decay
over 20k steps each, batch norm frozen in stage 2 (statistics fixed: small data sets give noisy ones).
Resolutions (289/360 and 475/600), crops and the number of runs are the recipe's (``openalign.eval.recipes``,
``--recipe paper-finegrained`` / ``paper-imagenet-finetune``); the training loop only sees tensors.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, Dataset, default_collate
from tqdm import tqdm

from openalign.data.sources import DEFAULT_MAX_FILE_BYTES
from openalign.eval.linear_probe import classification_metrics
from openalign.eval.transfer_config import FinetuneConfig, StageConfig, fine_grained_recipe, imagenet_recipe
from openalign.optim import build_optimizer, build_scheduler

if TYPE_CHECKING:
    from openalign.eval.recipes import Recipe
    from openalign.model.dual_encoder import DualEncoder
    from openalign.text.tokenizer import TextTokenizer


class ImageClassifier(nn.Module):
    """An image tower (``backbone``: pixels -> pooled features) with a linear classification head."""

    def __init__(self, backbone: nn.Module, num_features: int, num_classes: int, dropout: float = 0.0):
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"num_classes must be at least 1, got {num_classes}")
        self.backbone = backbone
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(num_features, num_classes)
        # A zero head starts every class at the same logit: the first steps fit the head, not noise.
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_dual_encoder(cls, model: nn.Module, num_classes: int, dropout: float = 0.0) -> ImageClassifier:
        """Classifier on the dual encoder's EfficientNet pooled features (the projection is not used)."""
        image = getattr(model, "image", None)
        if image is None or not hasattr(image, "num_features"):
            raise ValueError("expected an openalign DualEncoder with an image tower")
        return cls(image, image.num_features, num_classes, dropout)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.dropout(self.backbone(pixel_values)))
        return logits


def _set_train_mode(clf: ImageClassifier, stage: StageConfig) -> None:
    clf.train()
    if not stage.train_backbone:
        # Frozen features: no dropout, no stochastic depth, no batch-norm statistics updates.
        clf.backbone.eval()
    elif stage.freeze_bn:
        for m in clf.backbone.modules():
            if isinstance(m, _BatchNorm):
                m.eval()


def _infinite(loader: DataLoader) -> Iterator[Any]:
    while True:
        yielded = False
        for batch in loader:
            if batch is None:  # every sample of the batch was unreadable
                continue
            yielded = True
            yield batch
        if not yielded:
            raise ValueError("the training set is empty (or none of its images could be read)")


def _collate_readable(batch: list[Any]) -> Any:
    """Default collation of the samples that could be read; ``None`` marks an unreadable one."""
    kept = [b for b in batch if b is not None]
    return default_collate(kept) if kept else None


def _check_dataset(data: Any, what: str) -> None:
    try:
        n = len(data)
    except TypeError:
        raise ValueError(f"the {what} set must be a sized dataset of (pixels, label) pairs") from None
    if n == 0:
        raise ValueError(f"the {what} set is empty")


class LabelledData(Protocol):
    """(pixels, label) pairs by index: a list of them, or a sized Dataset such as :class:`LabelledImages`
    (whose training sets give None for an unreadable file)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Any: ...


def _as_dataset(data: LabelledData) -> Dataset:
    # A DataLoader reads any sized, indexable collection; torch's annotation asks for a Dataset.
    return cast(Dataset, data)


def train_stage(
    clf: ImageClassifier,
    data: LabelledData,
    stage: StageConfig,
    *,
    batch_size: int,
    momentum: float = 0.9,
    device: str | torch.device = "cpu",
    num_workers: int = 0,
    seed: int = 0,
    progress: bool = False,
    name: str = "finetune",
) -> dict[str, Any]:
    """Run one stage; returns the optimiser (for inspection) and the last loss."""
    _check_dataset(data, "training")
    trainable = [p.requires_grad for p in clf.backbone.parameters()]
    for p in clf.backbone.parameters():
        p.requires_grad_(stage.train_backbone and p.requires_grad)
    optim_cfg = stage.optim_config(momentum)
    optimizer = build_optimizer(clf, optim_cfg)
    scheduler = build_scheduler(optimizer, optim_cfg)
    gen = torch.Generator().manual_seed(seed)
    loader = DataLoader(
        _as_dataset(data),
        batch_size=batch_size,
        shuffle=True,
        generator=gen,
        num_workers=num_workers,
        collate_fn=_collate_readable,
    )
    batches = _infinite(loader)
    _set_train_mode(clf, stage)
    last = math.nan
    try:
        bar = tqdm(range(stage.steps), desc=name, unit="step", disable=not progress)
        for _ in bar:
            pixels, labels = next(batches)
            logits = clf(pixels.to(device))
            loss = F.cross_entropy(logits, torch.as_tensor(labels, device=device).long())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            last = float(loss.detach())
            bar.set_postfix(loss=f"{last:.3f}", refresh=False)
    finally:
        for p, flag in zip(clf.backbone.parameters(), trainable, strict=True):
            p.requires_grad_(flag)
        clf.eval()
    return {"optimizer": optimizer, "loss": last, "steps": stage.steps}


@torch.no_grad()
def evaluate_classifier(
    clf: nn.Module,
    data: LabelledData,
    *,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Top-1/top-5 accuracy and mean per-class recall (%) of ``clf`` on (pixels, label) pairs."""
    _check_dataset(data, "evaluation")
    was_training = clf.training
    clf.eval()
    logits, labels = [], []
    try:
        for pixels, y in DataLoader(_as_dataset(data), batch_size=batch_size, shuffle=False):
            logits.append(clf(pixels.to(device)).float().cpu())
            labels.append(torch.as_tensor(y).long())
    finally:
        clf.train(was_training)
    out = torch.cat(logits)
    ks = tuple(k for k in (1, 5) if k <= out.shape[1])
    return classification_metrics(out, torch.cat(labels), ks)


def finetune(
    model: nn.Module,
    train_data: LabelledData,
    num_classes: int,
    config: FinetuneConfig | None = None,
    *,
    test_data: LabelledData | None = None,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> tuple[ImageClassifier, dict[str, Any]]:
    """Fine-tune ``model``'s image tower (a DualEncoder, or an ``ImageClassifier``) in two stages.

    ``train_data`` yields (pixels [3, H, W], label) pairs already transformed (train augmentation); the
    returned metrics hold each stage's final loss and, with ``test_data``, the test metrics.
    """
    cfg = config or FinetuneConfig()
    with torch.random.fork_rng():  # seeded dropout and stochastic depth, the caller's RNG left as it was
        torch.manual_seed(cfg.seed)
        return _finetune(model, train_data, num_classes, cfg, test_data, device, progress)


def _finetune(
    model: nn.Module,
    train_data: Any,
    num_classes: int,
    cfg: FinetuneConfig,
    test_data: Any,
    device: str | torch.device,
    progress: bool,
) -> tuple[ImageClassifier, dict[str, Any]]:
    if isinstance(model, ImageClassifier):
        clf = model
    else:
        clf = ImageClassifier.from_dual_encoder(model, num_classes, cfg.dropout)
    clf.to(device)
    metrics: dict[str, Any] = {}
    for name, stage in (("head", cfg.head), ("full", cfg.full)):
        if stage.steps == 0:
            continue
        result = train_stage(
            clf,
            train_data,
            stage,
            batch_size=cfg.batch_size,
            momentum=cfg.momentum,
            device=device,
            num_workers=cfg.num_workers,
            seed=cfg.seed,
            progress=progress,
            name=f"finetune {name}",
        )
        metrics[f"{name}_loss"] = result["loss"]
    if test_data is not None:
        metrics.update(evaluate_classifier(clf, test_data, batch_size=cfg.batch_size, device=device))
    return clf, metrics


# --------------------------------------------------------------------------------------------------
# Images as (pixels, label) pairs, and the `finetune` eval task


class LabelledImages(Dataset):
    """(transform(image), label) pairs. Images that are files are opened on access, so a large training
    set never sits in memory; images from WebDataset shards are decoded once and kept.

    With ``skip_unreadable`` (training sets) a file that cannot be read yields ``None``, which the training
    loader drops, and its path is recorded in ``unreadable``: one corrupt file does not end a 20k-step run.
    Evaluation sets keep the default, so a bad test image is an error rather than a smaller denominator.
    """

    def __init__(self, images: Any, labels: Sequence[int], transform: Any, *, skip_unreadable: bool = False):
        from pathlib import Path

        names = list(getattr(images, "names", []))
        self.max_bytes: int = getattr(images, "max_bytes", DEFAULT_MAX_FILE_BYTES)
        if len(names) == len(labels) and names and all(Path(n).is_file() for n in names):
            self.paths: list[str] | None = names
            self.images: list[Any] = []
        else:
            self.paths = None
            self.images = list(images)
        if len(self) != len(labels):
            raise ValueError(f"{len(self)} images for {len(labels)} labels")
        self.labels = [int(y) for y in labels]
        self.transform = transform
        self.skip_unreadable = skip_unreadable
        self.unreadable: set[str] = set()

    def __len__(self) -> int:
        return len(self.paths) if self.paths is not None else len(self.images)

    def with_transform(self, transform: Any, *, skip_unreadable: bool = False) -> LabelledImages:
        """The same images and labels under another transform (e.g. the evaluation crop)."""
        other = copy.copy(self)
        other.transform = transform
        other.skip_unreadable = skip_unreadable
        other.unreadable = set()
        return other

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int] | None:
        if self.paths is not None:
            from openalign.eval.sets import open_image

            try:
                image = open_image(self.paths[i], max_bytes=self.max_bytes)
            except (OSError, ValueError):
                if not self.skip_unreadable:
                    raise
                self.unreadable.add(self.paths[i])
                return None
        else:
            image = self.images[i]
        return self.transform(image), self.labels[i]


def transfer_datasets(
    model: DualEncoder, options: dict[str, Any], recipe: Recipe | None = None
) -> tuple[LabelledImages, LabelledImages, int, str]:
    """Train (augmented) and val (centre crop) sets for fine-tuning, sized by ``image_size`` options or the
    recipe. A recipe trains on Inception-style random-resized crops and flips and evaluates a central crop
    of its ``crop_ratio``; without one, training takes random crops of the resized image (the pre-training
    augmentation)."""
    from openalign.data.transforms import (
        center_crop_transform,
        eval_transform,
        inception_crop_transform,
        model_resize,
        train_transform,
    )
    from openalign.eval.linear_probe import load_labelled_pair

    train, val, val_labels = load_labelled_pair(options)
    cfg = model.config
    size = options.get("image_size") or (recipe.train_size if recipe else cfg.image_size)
    eval_size = options.get("eval_image_size") or (recipe.eval_size if recipe else size)
    mean, std = cfg.pixel_mean, cfg.pixel_std
    if recipe is not None:
        train_t = inception_crop_transform(size, mean, std)
        val_t = center_crop_transform(eval_size, recipe.crop_ratio, mean, std)
    else:
        train_t = train_transform(size, model_resize(size), mean=mean, std=std)
        val_t = eval_transform(eval_size, model_resize(eval_size), mean=mean, std=std)
    return (
        LabelledImages(train.images, train.labels, train_t, skip_unreadable=True),
        LabelledImages(val.images, val_labels, val_t),
        len(train.classnames),
        val.name,
    )


def _given(value: Any, default: Any) -> Any:
    """A flag's value when it was given (0 included), else the recipe's."""
    return default if value is None else value


def resolve_finetune(options: dict[str, Any], n_train: int) -> tuple[FinetuneConfig, int, Recipe | None]:
    """The fine-tuning config, the number of runs and the paper recipe (if any) that ``options`` select;
    flags that are set override the recipe's values."""
    recipe = None
    if options["recipe"] not in ("fine-grained", "imagenet"):
        from openalign.eval.recipes import get_recipe

        recipe = get_recipe(options["recipe"], "finetune")
    batch = _given(options["finetune_batch_size"], recipe.batch_size if recipe else 256)
    steps_per_epoch = max(1, math.ceil(n_train / batch))
    if recipe is not None:
        cfg = recipe.finetune_config(steps_per_epoch, steps=options["steps"], epochs=options["epochs"], batch=batch)
    elif options["recipe"] == "imagenet":
        cfg = imagenet_recipe(steps_per_epoch, _given(options["epochs"], 100), batch)
    else:
        cfg = fine_grained_recipe(_given(options["steps"], 20_000), batch)
    runs = _given(options["runs"], recipe.runs if recipe else 1)
    if runs < 1:
        raise ValueError(f"--runs must be at least 1, got {runs}")
    return cfg, runs, recipe


_AVERAGED = ("top1", "top5", "mean_per_class_recall", "head_loss", "full_loss")


def mean_of_runs(per_run: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's metrics as they are; several runs' as their mean (what Table 6 reports), each run's value
    under ``<metric>_runs`` and the sample standard deviation of top-1 under ``top1_std``."""
    if len(per_run) == 1:
        return dict(per_run[0])
    out = dict(per_run[-1])
    for key in _AVERAGED:
        values = [float(m[key]) for m in per_run if key in m]
        if len(values) == len(per_run):
            out[key] = sum(values) / len(values)
            out[f"{key}_runs"] = values
    top1 = out["top1_runs"]
    out["top1_std"] = math.sqrt(sum((v - out["top1"]) ** 2 for v in top1) / (len(top1) - 1))
    out["runs"] = len(per_run)
    return out


def _run(model: DualEncoder, tokenizer: TextTokenizer, options: dict[str, Any]) -> dict[str, Any]:
    from dataclasses import replace

    from openalign.eval.recipes import RECIPES

    recipe = RECIPES.get(options["recipe"])
    train, val, num_classes, name = transfer_datasets(model, options, recipe)
    cfg, runs, recipe = resolve_finetune(options, len(train))
    size = options["image_size"] or (recipe.train_size if recipe else model.config.image_size)
    image = model.image
    # Every run starts from the pre-trained weights, and so does whatever a suite runs next.
    pristine = {k: v.detach().to("cpu", copy=True) for k, v in image.state_dict().items()}
    per_run = []
    try:
        for run in range(runs):
            image.load_state_dict(pristine)
            _, metrics = finetune(
                model, train, num_classes, replace(cfg, seed=cfg.seed + run), test_data=val,
                device=options["device"], progress=True,
            )  # fmt: skip
            per_run.append(metrics)
    finally:
        image.load_state_dict(pristine)
    return {
        "dataset": name,
        **mean_of_runs(per_run),
        "num_train": len(train),
        "train_images_unreadable": sorted(train.unreadable),
        "recipe": options["recipe"],
        "train_size": size,
        "eval_size": options["eval_image_size"] or (recipe.eval_size if recipe else size),
    }


def _register() -> None:
    from openalign.eval.linear_probe import classification_options
    from openalign.eval.tasks import Option, Task, register

    register(
        Task(
            "finetune",
            _run,
            "two-stage fine-tuning of the image tower for classification (head, then all layers)",
            options=(
                *classification_options(),
                Option(
                    "recipe",
                    default="fine-grained",
                    choices=("fine-grained", "imagenet", "paper-finegrained", "paper-imagenet-finetune"),
                    help="fine-grained: wd 1e-5, cosine, BN frozen; imagenet: ×0.2 every 30 epochs (both at the "
                    "model's resolution); paper-finegrained: the paper's Table 6 preset (289/360, crop 0.875, "
                    "Inception crops, mean of 3 runs); paper-imagenet-finetune: its Table 4 preset (475/600, "
                    "batch 1024); flags override a preset",
                ),
                Option("steps", int, None, help="fine-grained: steps per stage (default and paper 20000)"),
                Option("epochs", int, None, help="imagenet: epochs per stage (default and paper 100)"),
                Option(
                    "finetune_batch_size",
                    int,
                    None,
                    help="training batch (default 256; paper: 256 fine-grained, 1024 ImageNet)",
                ),
                Option("runs", int, None, help="independent runs (seeds 0, 1, ...) whose mean is reported (default 1)"),
                Option("image_size", int, None, help="training resolution (default: the model's; paper 289)"),
                Option("eval_image_size", int, None, help="evaluation resolution (default: training's; paper 360)"),
            ),
            examples=(
                "openalign eval finetune --model runs/b7-base/final --train flowers102:flowers:train "
                "--val flowers102:flowers:test --recipe paper-finegrained --out results/",
                "openalign eval finetune --model runs/b7-base/final --train flowers/train --val flowers/test "
                "--image-size 289 --eval-image-size 360 --out results/",
                "openalign eval finetune --model runs/nano/final --train shapes/train --val shapes/val --steps 200",
            ),
            description="Stage 1 trains a linear head on the frozen EfficientNet pooled features; stage 2 "
            "trains every layer with a 10× smaller learning rate on the backbone. Reports top-1/top-5 accuracy "
            "and mean per-class recall on val (the mean of --runs runs). The model's weights are restored afterwards.",
        )
    )


_register()
