"""How the two transfer evaluations train (paper Sec. 5.2): the linear probe's head on frozen features
(``LinearProbeConfig``) and fine-tuning's two stages (``StageConfig``, ``FinetuneConfig``), with the paper's
fine-grained and ImageNet fine-tuning configs. ``eval/recipes.py`` names them as presets; ``eval/linear_probe.py``
and ``eval/finetune.py`` run them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from openalign.config import from_dict
from openalign.optim import OptimConfig


@dataclass
class LinearProbeConfig:
    """How the linear head on frozen features is trained. Defaults are the paper's ImageNet recipe."""

    method: Literal["sgd", "lbfgs"] = "sgd"
    epochs: int = 100  # sgd: passes over the training features (paper: 100)
    batch_size: int = 1024  # sgd (paper: 1024)
    lr: float = 0.1  # sgd peak learning rate (paper: 0.1)
    momentum: float = 0.9  # sgd (paper: 0.9)
    weight_decay: float = 0.0  # sgd (paper: 0); never applied to the bias
    decay_every_epochs: int = 30  # sgd: lr ×decay_gamma every this many epochs (paper: 30)
    decay_gamma: float = 0.2  # sgd (paper: 0.2)
    C: float = 1.0  # lbfgs: inverse L2 strength, as scikit-learn's LogisticRegression(C=...)
    max_iter: int = 1000  # lbfgs iterations
    tol: float = 1e-6  # lbfgs: stop when the gradient's largest entry falls below this
    standardize: bool = False  # z-score features with training statistics before fitting
    seed: int = 0  # sgd: initialisation and shuffling

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "decay_every_epochs", "max_iter"):
            if getattr(self, name) < 1:
                raise ValueError(f"linear probe {name} must be at least 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"linear probe lr must be positive, got {self.lr}")
        if not self.C > 0:
            raise ValueError(f"linear probe C must be positive, got {self.C}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LinearProbeConfig:
        return from_dict(cls, data, "linear_probe")


@dataclass
class StageConfig:
    """One fine-tuning stage: what trains, at which rates, for how long."""

    steps: int = 20_000  # optimiser steps in this stage
    lr: float = 0.01  # the head's peak lr; the backbone gets lr × backbone_lr_scale
    schedule: Literal["cosine", "step"] = "cosine"
    decay_every: int = 0  # step schedule: steps between ×decay_gamma decays (30 epochs' worth in the paper)
    decay_gamma: float = 0.2
    weight_decay: float = 0.0  # never applied to biases or normalisation parameters
    backbone_lr_scale: float = 0.1  # paper: 10× smaller lr on the backbone than on the head
    train_backbone: bool = True  # False: head only (stage 1)
    freeze_bn: bool = False  # keep batch-norm running statistics fixed (fine-grained stage 2)

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"stage steps must be >= 0, got {self.steps}")
        if not self.lr > 0:
            raise ValueError(f"stage lr must be positive, got {self.lr}")
        if self.schedule == "step" and self.decay_every < 1:
            raise ValueError("a step schedule needs decay_every >= 1 (steps between decays)")

    def optim_config(self, momentum: float) -> OptimConfig:
        if self.schedule == "step":
            sched: dict[str, Any] = {"schedule": "step_decay", "decay_every": self.decay_every}
        else:
            sched = {"schedule": "warmup_cosine", "warmup_steps": 0, "total_steps": max(self.steps, 1)}
        return OptimConfig(
            name="sgd",
            lr=self.lr,
            momentum=momentum,
            weight_decay=self.weight_decay,
            decay_gamma=self.decay_gamma,
            lr_scales={"backbone.": self.backbone_lr_scale} if self.train_backbone else {},
            **sched,
        )


@dataclass
class FinetuneConfig:
    """Two-stage classification fine-tuning; defaults are the paper's fine-grained recipe."""

    head: StageConfig = field(
        default_factory=lambda: StageConfig(lr=1e-2, weight_decay=1e-5, train_backbone=False, backbone_lr_scale=0.0)
    )
    full: StageConfig = field(default_factory=lambda: StageConfig(lr=1e-3, weight_decay=1e-5, freeze_bn=True))
    batch_size: int = 256
    momentum: float = 0.9
    dropout: float = 0.0  # before the classifier
    num_workers: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.head.train_backbone:
            raise ValueError("the head stage trains only the classifier; set head.train_backbone to false")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FinetuneConfig:
        return from_dict(cls, data, "finetune")


def fine_grained_recipe(steps: int = 20_000, batch_size: int = 256) -> FinetuneConfig:
    """Paper: batch 256, wd 1e-5, lr 1e-2 (head) then 1e-3 (all, BN frozen), cosine over 20k steps each."""
    return FinetuneConfig(
        head=StageConfig(steps=steps, lr=1e-2, weight_decay=1e-5, train_backbone=False, backbone_lr_scale=0.0),
        full=StageConfig(steps=steps, lr=1e-3, weight_decay=1e-5, freeze_bn=True),
        batch_size=batch_size,
    )


def imagenet_recipe(steps_per_epoch: int, epochs: int = 100, batch_size: int = 1024) -> FinetuneConfig:
    """Paper: SGD 0.9, batch 1024, no wd, ×0.2 every 30 epochs, 100 epochs; lr 0.1 (head) then 0.01 (all)."""
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be at least 1, got {steps_per_epoch}")
    every = 30 * steps_per_epoch
    steps = epochs * steps_per_epoch
    return FinetuneConfig(
        head=StageConfig(
            steps=steps, lr=0.1, schedule="step", decay_every=every, train_backbone=False, backbone_lr_scale=0.0
        ),
        full=StageConfig(steps=steps, lr=0.01, schedule="step", decay_every=every),
        batch_size=batch_size,
    )
