"""The paper's classification transfer recipes (Sec. 5.2) as named presets of ``eval linear-probe`` and
``eval finetune`` (``--recipe NAME``).

- ``paper-imagenet-frozen`` (linear-probe, Table 4 "w/ frozen features"): train/eval resolution 289/360;
  the head trained by SGD (momentum 0.9, lr 0.1 ×0.2 every 30 epochs, 100 epochs, batch 1024, no weight
  decay) on features of augmented views recomputed every epoch.
- ``paper-imagenet-finetune`` (finetune, Table 4 Acc@1/Acc@5): 475/600; head (lr 0.1) then all layers
  (lr 0.01, 10× smaller on the backbone), ×0.2 every 30 epochs, 100 epochs each, batch 1024, no weight decay.
- ``paper-finegrained`` (finetune, Table 6: Flowers, Pets, Cars, Food-101): 289/360; head (lr 1e-2) then
  all layers with batch-norm statistics frozen (lr 1e-3), cosine decay over 20k steps each, batch 256,
  weight decay 1e-5; the mean of three runs is reported, as Table 6 is.

All three train on Inception-style random-resized crops with flips and evaluate a single central crop of
ratio 0.875. A flag given on the command line (``--steps``, ``--image-size``, ...) overrides the recipe's value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from openalign.data.transforms import CROP_RATIO
from openalign.eval.transfer_config import FinetuneConfig, LinearProbeConfig, fine_grained_recipe, imagenet_recipe


@dataclass(frozen=True)
class Recipe:
    name: str
    task: Literal["linear-probe", "finetune"]
    train_size: int  # training crop
    eval_size: int  # evaluation crop
    batch_size: int
    schedule: Literal["imagenet", "fine-grained", "probe"]
    steps: int = 0  # fine-grained: steps per stage
    epochs: int = 0  # imagenet and probe: epochs (per stage)
    runs: int = 1  # independent runs whose mean is reported
    crop_ratio: float = CROP_RATIO  # the evaluation central crop's share of the image side
    train_crop: Literal["inception"] = "inception"
    features: Literal["fixed", "augmented"] = "fixed"  # linear-probe: features recomputed per epoch or not

    def finetune_config(
        self, steps_per_epoch: int, *, steps: int | None = None, epochs: int | None = None, batch: int | None = None
    ) -> FinetuneConfig:
        """The two-stage config; ``steps_per_epoch`` sizes the ImageNet schedule's epochs."""
        if self.schedule == "imagenet":
            return imagenet_recipe(
                steps_per_epoch, self.epochs if epochs is None else epochs, self.batch_size if batch is None else batch
            )
        if self.schedule == "fine-grained":
            return fine_grained_recipe(
                self.steps if steps is None else steps, self.batch_size if batch is None else batch
            )
        raise ValueError(f"recipe {self.name!r} is a linear-probe recipe, not a fine-tuning one")

    def probe_config(self) -> LinearProbeConfig:
        if self.schedule != "probe":
            raise ValueError(f"recipe {self.name!r} is a fine-tuning recipe, not a linear-probe one")
        return LinearProbeConfig(
            method="sgd",
            epochs=self.epochs,
            batch_size=self.batch_size,
            lr=0.1,
            momentum=0.9,
            weight_decay=0.0,
            decay_every_epochs=30,
            decay_gamma=0.2,
        )


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("paper-imagenet-frozen", "linear-probe", 289, 360, 1024, "probe", epochs=100, features="augmented"),
        Recipe("paper-imagenet-finetune", "finetune", 475, 600, 1024, "imagenet", epochs=100),
        Recipe("paper-finegrained", "finetune", 289, 360, 256, "fine-grained", steps=20_000, runs=3),
    )
}


def get_recipe(name: str, task: str) -> Recipe:
    """The named preset, which must be one of ``task``'s."""
    recipe = RECIPES.get(name)
    if recipe is None or recipe.task != task:
        valid = ", ".join(n for n, r in RECIPES.items() if r.task == task)
        raise ValueError(f"unknown {task} recipe {name!r}; valid: {valid}")
    return recipe
