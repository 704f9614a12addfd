"""Linear classification on frozen image features (the paper's "Acc@1 w/ frozen features", Table 4).

Two ways to fit the linear head:

- ``"sgd"``: the paper's recipe (Sec. 5.2): SGD with momentum 0.9, lr 0.1 decayed ×0.2 every 30 epochs,
  100 epochs, batch 1024, no weight decay; driven by ``openalign.optim`` (SGD + ``step_decay``).
- ``"lbfgs"``: multinomial logistic regression solved to convergence with full-batch L-BFGS, minimising
  ``0.5·||W||² + C·Σ cross-entropy`` with an unpenalised bias: the objective of scikit-learn's
  ``LogisticRegression(C=C)``, so the two give the same classifier on the same features. It has no
  schedule to tune, which makes it the stable choice for small transfer sets.

Features are fixed by default: the training images are embedded once (one central crop each) and the head
trains on those vectors for every epoch, which costs one forward pass of the image tower per image. The
paper's frozen-feature ImageNet run trains on random crops and flips instead (``--features augmented``):
every epoch re-embeds each training image from a new augmented view, so the head sees what the paper's
does, at ``epochs`` forward passes per image (100× the fixed mode for the paper's 100 epochs; the SGD on
the vectors is negligible beside it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from openalign.eval.transfer_config import LinearProbeConfig
from openalign.optim import OptimConfig, build_optimizer, build_scheduler

if TYPE_CHECKING:
    from openalign.model.dual_encoder import DualEncoder
    from openalign.text.tokenizer import TextTokenizer


class LinearClassifier(nn.Module):
    """``logits = ((x - mean) / std) @ W.T + b``; the standardisation is part of the model so that
    predictions never depend on remembering to preprocess test features the same way."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, dim: int, num_classes: int):
        super().__init__()
        self.linear = nn.Linear(dim, num_classes)
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("std", torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.linear((x - self.mean) / self.std)
        return logits

    @torch.no_grad()
    def predict_proba(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self(x.to(self.linear.weight.dtype))
        return logits.softmax(-1)


def check_features(x: torch.Tensor, y: torch.Tensor, what: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a feature matrix [N, D] and integer labels [N]; return them as float tensors and int64 labels."""
    x = torch.as_tensor(x)
    y = torch.as_tensor(y)
    if x.ndim != 2:
        raise ValueError(f"{what} features must have shape [N, D], got {list(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError(f"{what} set is empty")
    if y.ndim != 1 or y.shape[0] != x.shape[0]:
        raise ValueError(f"{what} labels must have shape [{x.shape[0]}], got {list(y.shape)}")
    if y.is_floating_point() or y.dtype == torch.bool:
        raise ValueError(f"{what} labels must be integers, got {y.dtype}")
    if int(y.min()) < 0:
        raise ValueError(f"{what} labels must be >= 0, got {int(y.min())}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{what} features contain NaN or infinite values")
    return x.float(), y.long()


def _init_classifier(x: torch.Tensor, num_classes: int, standardize: bool, dtype: torch.dtype) -> LinearClassifier:
    clf = LinearClassifier(x.shape[1], num_classes).to(dtype)
    if standardize:
        clf.mean.copy_(x.mean(0))
        # Constant features would divide by zero; leaving them unscaled keeps them inert.
        std = x.std(0)
        clf.std.copy_(torch.where(std > 0, std, torch.ones_like(std)))
    return clf


def fit_lbfgs(
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    *,
    C: float = 1.0,
    max_iter: int = 1000,
    tol: float = 1e-6,
    standardize: bool = False,
) -> LinearClassifier:
    """Multinomial logistic regression by full-batch L-BFGS in float64 (scikit-learn's objective).

    The objective is divided by ``C·N`` (mean cross-entropy + ||W||²/(2CN)), which has the same minimiser
    and keeps gradient magnitudes independent of the data set size for the stopping tolerance.
    """
    x, y = check_features(x, y)
    x = x.double()
    clf = _init_classifier(x, num_classes, standardize, torch.float64)
    nn.init.zeros_(clf.linear.weight)
    nn.init.zeros_(clf.linear.bias)
    z = (x - clf.mean) / clf.std
    n = x.shape[0]
    opt = torch.optim.LBFGS(
        clf.linear.parameters(),
        lr=1.0,
        max_iter=max_iter,
        tolerance_grad=tol,
        tolerance_change=1e-12,
        history_size=20,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(clf.linear(z), y) + clf.linear.weight.pow(2).sum() / (2.0 * C * n)
        loss.backward()
        return loss

    opt.step(closure)
    return clf


def fit_sgd(
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    config: LinearProbeConfig | None = None,
    *,
    progress: bool = False,
    views: Callable[[int], torch.Tensor] | None = None,
) -> LinearClassifier:
    """The paper's frozen-feature recipe: SGD + momentum with a ×gamma step decay every few epochs.

    With ``views``, epoch ``e > 0`` trains on the features ``views(e)`` (the same images, in the same order,
    embedded from new augmented views) instead of ``x``, which is epoch 0's (and sets the standardisation).
    """
    cfg = config or LinearProbeConfig()
    x, y = check_features(x, y)
    gen = torch.Generator().manual_seed(cfg.seed)
    with torch.random.fork_rng(devices=[]):  # seed the head's init without touching the caller's RNG
        torch.manual_seed(cfg.seed)
        clf = _init_classifier(x, num_classes, cfg.standardize, torch.float32)
    n = x.shape[0]
    steps_per_epoch = math.ceil(n / cfg.batch_size)
    optim_cfg = OptimConfig(
        name="sgd",
        lr=cfg.lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
        schedule="step_decay",
        decay_every=cfg.decay_every_epochs * steps_per_epoch,
        decay_gamma=cfg.decay_gamma,
    )
    optimizer = build_optimizer(clf.linear, optim_cfg)
    scheduler = build_scheduler(optimizer, optim_cfg)
    features = x
    for epoch in tqdm(range(cfg.epochs), desc="linear probe", unit="epoch", disable=not progress):
        if views is not None and epoch > 0:
            features = views(epoch).float()
            if features.shape != x.shape:
                raise ValueError(
                    f"augmented features of epoch {epoch} have shape {list(features.shape)}, not {list(x.shape)}"
                )
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, cfg.batch_size):
            idx = order[start : start + cfg.batch_size]
            loss = F.cross_entropy(clf(features[idx]), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
    return clf


def train_linear_probe(
    x: torch.Tensor,
    y: torch.Tensor,
    config: LinearProbeConfig | None = None,
    *,
    num_classes: int | None = None,
    progress: bool = False,
    views: Callable[[int], torch.Tensor] | None = None,
) -> LinearClassifier:
    """Fit a linear classifier on frozen features ``x`` [N, D] with labels ``y`` [N] in ``[0, num_classes)``."""
    cfg = config or LinearProbeConfig()
    x, y = check_features(x, y)
    k = int(y.max()) + 1
    num_classes = num_classes or k
    if k > num_classes:
        raise ValueError(f"label {k - 1} is outside num_classes={num_classes}")
    if cfg.method == "lbfgs":
        if views is not None:
            raise ValueError("augmented views need the sgd method (lbfgs fits one fixed feature matrix)")
        return fit_lbfgs(
            x, y, num_classes, C=cfg.C, max_iter=cfg.max_iter, tol=cfg.tol, standardize=cfg.standardize
        ).float()
    if cfg.method == "sgd":
        return fit_sgd(x, y, num_classes, cfg, progress=progress, views=views)
    raise ValueError(f"unknown linear probe method {cfg.method!r}; valid: sgd, lbfgs")


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> dict[str, Any]:
    """Top-k accuracy (%) and mean per-class recall (%) over the classes that have test samples.

    A class with no test samples has no recall; it is left out of the mean and counted in
    ``classes_without_samples`` rather than silently scored 0 or 100.
    """
    logits = torch.as_tensor(logits)
    labels = torch.as_tensor(labels).long()
    if logits.ndim != 2 or logits.shape[0] != labels.shape[0]:
        raise ValueError(f"logits {list(logits.shape)} do not match labels {list(labels.shape)}")
    if labels.numel() == 0:
        raise ValueError("cannot score an empty test set")
    if not torch.isfinite(logits).all():
        raise ValueError("logits contain NaN or infinite values")
    n, c = logits.shape
    if int(labels.max()) >= c:
        raise ValueError(f"label {int(labels.max())} is outside the {c} classes of the classifier")
    out: dict[str, Any] = {}
    # The true class ranks behind every other class scoring at least as high: ties count against the
    # prediction, so a constant classifier scores 0, not 100, and index order never decides.
    true_score = logits.gather(1, labels[:, None])
    rank = (logits >= true_score).sum(1) - 1
    for k in ks:
        out[f"top{k}"] = 100.0 * float((rank < k).float().mean())
    correct = (rank == 0).double()
    counts = torch.bincount(labels, minlength=c)
    hits = torch.zeros(c, dtype=torch.float64).index_add_(0, labels, correct)
    present = counts > 0
    out["mean_per_class_recall"] = 100.0 * float((hits[present] / counts[present]).mean())
    out["classes_without_samples"] = int((~present).sum())
    out["n"] = n
    return out


def linear_probe(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    test_x: torch.Tensor,
    test_y: torch.Tensor,
    config: LinearProbeConfig | None = None,
    *,
    num_classes: int | None = None,
    progress: bool = False,
    views: Callable[[int], torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Train on frozen train features, report top-1/top-5 accuracy and mean per-class recall on test
    (``views``: per-epoch features of augmented views, see ``fit_sgd``)."""
    test_x, test_y = check_features(test_x, test_y, "test")
    train_x, train_y = check_features(train_x, train_y)
    if test_x.shape[1] != train_x.shape[1]:
        raise ValueError(f"test features have {test_x.shape[1]} dims, train features {train_x.shape[1]}")
    k = max(int(train_y.max()), int(test_y.max())) + 1
    clf = train_linear_probe(train_x, train_y, config, num_classes=num_classes or k, progress=progress, views=views)
    with torch.no_grad():
        logits = clf(test_x)
    ks = tuple(k for k in (1, 5) if k <= logits.shape[1])
    return classification_metrics(logits, test_y, ks)


# --------------------------------------------------------------------------------------------------
# The `linear-probe` eval task (also the data loading the other transfer tasks share)


def load_labelled_pair(options: dict[str, Any]) -> tuple[Any, Any, list[int]]:
    """The train and val ClassificationSets of a transfer task and val labels in the train set's class order.

    Classes are matched by folder / id; a val class the train set lacks cannot be learned, so it is an
    error naming the classes rather than a silent zero.
    """
    from openalign.eval.datasets import load_classification
    from openalign.eval.tasks import max_annotation_bytes, max_file_bytes

    limits = {"max_file_bytes": max_file_bytes(options), "max_annotation_bytes": max_annotation_bytes(options)}
    train = load_classification(options["train"], options["layout"], options["classnames"], **limits)
    val = load_classification(options["val"], options["layout"], options["classnames"], **limits)
    ids = {cid: i for i, cid in enumerate(train.class_ids)}
    unseen = sorted({val.class_ids[y] for y in val.labels} - set(ids))
    if unseen:
        raise ValueError(
            f"{options['val']}: {len(unseen)} class(es) have no training images in {options['train']}: "
            + ", ".join(unseen[:5])
        )
    return train, val, [ids[val.class_ids[y]] for y in val.labels]


def classification_options() -> tuple[Any, ...]:
    from openalign.eval.tasks import Option

    return (
        Option(
            "train",
            required=True,
            metavar="PATH",
            help="labelled training set: class folders, wds:SHARDS or NAME:DIR[:SPLIT] (pets:DIR:trainval)",
        ),
        Option("val", required=True, metavar="PATH", help="labelled evaluation set in the same form"),
        Option(
            "layout",
            default="auto",
            choices=("auto", "names", "wnids", "indices", "imagenet", "imagenet-r", "imagenet-a", "imagenet-v2"),
            help="how folders map to classes (see zeroshot)",
        ),
        Option("classnames", metavar="FILE", help="class names file for numeric folders or WebDataset"),
    )


def _run(model: DualEncoder, tokenizer: TextTokenizer, options: dict[str, Any]) -> dict[str, Any]:
    from openalign.data.transforms import center_crop_transform, eval_transform, inception_crop_transform, model_resize
    from openalign.embed import embed_images

    recipe = None
    if options["recipe"]:
        from openalign.eval.recipes import get_recipe

        recipe = get_recipe(options["recipe"], "linear-probe")
    features = options["features"] or (recipe.features if recipe else "fixed")
    method = options["method"]
    if features == "augmented" and method != "sgd":
        raise ValueError("--features augmented recomputes features every epoch: it needs --method sgd")
    mc = model.config
    size = options["image_size"] or (recipe.train_size if recipe else mc.image_size)
    eval_size = options["eval_image_size"] or (recipe.eval_size if recipe else size)
    mean, std = mc.pixel_mean, mc.pixel_std
    if recipe is not None:
        train_t = center_crop_transform(size, recipe.crop_ratio, mean, std)
        val_t = center_crop_transform(eval_size, recipe.crop_ratio, mean, std)
    else:
        train_t = eval_transform(size, model_resize(size), mean, std)
        val_t = eval_transform(eval_size, model_resize(eval_size), mean, std)

    train, val, val_labels = load_labelled_pair(options)
    kw = {"batch_size": options["batch_size"], "device": options["device"]}
    base = recipe.probe_config() if recipe is not None else LinearProbeConfig()
    cfg = LinearProbeConfig(
        method=method,
        epochs=base.epochs if options["epochs"] is None else options["epochs"],
        lr=base.lr if options["lr"] is None else options["lr"],
        batch_size=base.batch_size if options["probe_batch_size"] is None else options["probe_batch_size"],
        C=options["C"],
        standardize=options["standardize"],
        momentum=base.momentum,
        weight_decay=base.weight_decay,
        decay_every_epochs=base.decay_every_epochs,
        decay_gamma=base.decay_gamma,
    )
    views = None
    if features == "augmented":
        augment = inception_crop_transform(size, mean, std)

        def views(epoch: int) -> torch.Tensor:
            with torch.random.fork_rng(devices=[]):  # the crops of an epoch are the same on every rerun
                torch.manual_seed(cfg.seed * 1_000_003 + epoch)
                return embed_images(model, train.images, transform=augment, **kw)

        train_x = views(0)
    else:
        train_x = embed_images(model, train.images, transform=train_t, progress=True, **kw)
    val_x = embed_images(model, val.images, transform=val_t, progress=True, **kw)
    metrics = linear_probe(
        train_x,
        torch.tensor(train.labels),
        val_x,
        torch.tensor(val_labels),
        cfg,
        num_classes=len(train.classnames),
        progress=True,
        views=views,
    )
    return {
        "dataset": val.name,
        **metrics,
        "num_train": len(train.labels),
        "method": cfg.method,
        "features": features,
        "recipe": options["recipe"] or "",
        "train_size": size,
        "eval_size": eval_size,
    }


def _register() -> None:
    from openalign.eval.tasks import Option, Task, register

    register(
        Task(
            "linear-probe",
            _run,
            "linear classifier on frozen image embeddings (paper: ImageNet frozen-feature top-1)",
            options=(
                *classification_options(),
                Option(
                    "method",
                    default="sgd",
                    choices=("sgd", "lbfgs"),
                    help="sgd: the paper's recipe; lbfgs: logistic regression to convergence (default sgd)",
                ),
                Option(
                    "recipe",
                    choices=("paper-imagenet-frozen",),
                    help="the paper's preset: paper-imagenet-frozen (289/360, crop 0.875, augmented features, "
                    "sgd lr 0.1 ×0.2 every 30 of 100 epochs, batch 1024); flags override it",
                ),
                Option(
                    "features",
                    choices=("fixed", "augmented"),
                    help="fixed: embed each training image once (fast); augmented: re-embed random-resized crops "
                    "and flips every epoch, as the paper (epochs × the embedding cost) (default fixed)",
                ),
                Option("epochs", int, None, help="sgd epochs (default and paper 100; lr ×0.2 every 30)"),
                Option("lr", float, None, help="sgd learning rate (default and paper 0.1)"),
                Option("probe_batch_size", int, None, help="sgd batch size (default and paper 1024)"),
                Option("image_size", int, None, help="training resolution (default: the model's; paper 289)"),
                Option("eval_image_size", int, None, help="evaluation resolution (default: training's; paper 360)"),
                Option("C", float, 1.0, help="lbfgs inverse L2 strength, as scikit-learn's C (default 1)"),
                Option("standardize", bool, False, help="z-score features with training statistics"),
            ),
            examples=(
                "openalign eval linear-probe --model runs/b7-base/final --train imagenet/train --val imagenet/val",
                "openalign eval linear-probe --model runs/nano/final --train shapes/train --val shapes/val "
                "--method lbfgs --C 0.5 --out results/",
            ),
            description="Embeds both sets with the frozen image tower and trains a linear classifier on the "
            "L2-normalised embeddings; reports top-1/top-5 accuracy and mean per-class recall on val.",
        )
    )


_register()
