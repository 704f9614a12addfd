"""VTAB-style transfer (Zhai et al. 2019) as in the paper's Table 5: 1000 training examples per task.

Protocol: split the 1000 examples into 800 train / 200 validation, try every (learning rate, steps) pair
of a small grid on that split, pick the pair with the best validation accuracy, retrain with it on all
1000 examples and report test accuracy. The paper ran a 50-trial sweep per task (``--sweep paper``, see
``paper_trials``); the default is VTAB's lightweight 2 × 2 grid (lr ∈ {0.1, 0.01}, steps ∈ {2500, 10000}).

``openalign eval vtab --root DIR`` runs every one of the 19 tasks (``VTAB_TASKS``) found under ``DIR`` in the
public VTAB-1k release's layout (``DIR/<folder>/{train800,val200,train800val200,test}.txt``): selection on
train800 / val200, retraining on train800val200, accuracy on test, then the natural / specialized /
structured / overall means. Each finished trial is appended to ``--trials-dir`` so an interrupted sweep
resumes trial by trial.

``vtab_transfer`` is the protocol for any trainer; ``vtab_linear`` trains a linear head on frozen
features (SGD, momentum 0.9, batch 512, lr ×0.1 at 30/60/90 % of the steps, as VTAB's fine-tuning
schedule) and ``vtab_finetune`` fine-tunes the whole image tower with the same schedule.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from openalign.config import from_dict
from openalign.eval.linear_probe import LinearClassifier, check_features, classification_metrics
from openalign.optim import OptimConfig, build_optimizer, build_scheduler

if TYPE_CHECKING:
    from openalign.eval.finetune import LabelledData
    from openalign.model.dual_encoder import DualEncoder
    from openalign.text.tokenizer import TextTokenizer

Model = TypeVar("Model")


@dataclass(frozen=True)
class VTABTask:
    """One VTAB-1k task: its name in the paper's Table 5 grouping, its group and its release folder."""

    name: str
    group: str  # natural, specialized or structured
    folder: str  # the task's folder in the public VTAB-1k release (and the metric key)
    # The paper's ALIGN accuracy on this task; the paper gives only the group means (Table 5), so None.
    paper: float | None = None


VTAB_GROUPS = ("natural", "specialized", "structured")
VTAB_TASKS: tuple[VTABTask, ...] = (
    VTABTask("Caltech101", "natural", "caltech101"),
    VTABTask("CIFAR-100", "natural", "cifar"),
    VTABTask("DTD", "natural", "dtd"),
    VTABTask("Flowers102", "natural", "oxford_flowers102"),
    VTABTask("Pets", "natural", "oxford_iiit_pet"),
    VTABTask("SVHN", "natural", "svhn"),
    VTABTask("SUN397", "natural", "sun397"),
    VTABTask("Camelyon", "specialized", "patch_camelyon"),
    VTABTask("EuroSAT", "specialized", "eurosat"),
    VTABTask("Resisc45", "specialized", "resisc45"),
    VTABTask("Retinopathy", "specialized", "diabetic_retinopathy"),
    VTABTask("Clevr-count", "structured", "clevr_count"),
    VTABTask("Clevr-dist", "structured", "clevr_dist"),
    VTABTask("DMLab", "structured", "dmlab"),
    VTABTask("KITTI-dist", "structured", "kitti"),
    VTABTask("dSprites-loc", "structured", "dsprites_loc"),
    VTABTask("dSprites-ori", "structured", "dsprites_ori"),
    VTABTask("sNORB-azim", "structured", "smallnorb_azi"),
    VTABTask("sNORB-elev", "structured", "smallnorb_ele"),
)
# The paper's Table 5 numbers (overall and group means) are in openalign.eval.report.PAPER.

# The --sweep paper search space. The paper follows the sweep of the VTAB paper's Appendix I (Zhai et al.,
# 2019) with 50 trials per task; that appendix's exact space was not available to this project, so the space
# below is this project's own: the lightweight sweep's SGD + momentum + step-decay trainer, widened to six
# learning rates, five training lengths (including both lightweight ones) and three weight decays, from which
# 50 of the 90 combinations are drawn, seeded, without replacement.
PAPER_LRS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)
PAPER_STEPS = (500, 1000, 2500, 5000, 10000)
PAPER_WEIGHT_DECAYS = (0.0, 1e-5, 1e-4)
PAPER_TRIALS = 50


def paper_trials(count: int = PAPER_TRIALS, seed: int = 0) -> list[dict[str, float]]:
    """``count`` distinct (lr, steps, weight_decay) trials drawn from the paper sweep's space."""
    space = [
        {"lr": lr, "steps": steps, "weight_decay": wd}
        for lr in PAPER_LRS
        for steps in PAPER_STEPS
        for wd in PAPER_WEIGHT_DECAYS
    ]
    if not 1 <= count <= len(space):
        raise ValueError(f"the paper sweep has {len(space)} trials to draw from; asked for {count}")
    order = torch.randperm(len(space), generator=torch.Generator().manual_seed(seed))[:count]
    return [space[int(i)] for i in order]


def light_trials(config: VTABConfig) -> list[dict[str, float]]:
    """The lightweight grid: every (lr, steps) pair of ``config``."""
    return [{"lr": lr, "steps": steps} for lr in config.lrs for steps in config.steps]


class TrialLog:
    """Finished sweep trials, one JSON line each, appended as they finish. A trial is found again by its
    settings plus ``context`` (task, mode, model fingerprint, ...); a line cut short by an interruption is
    ignored, so that trial simply runs again."""

    def __init__(self, path: str | Path, context: dict[str, Any]):
        self.path = Path(path)
        self.context = context
        self.done: dict[str, float] = {}
        if self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                    self.done[row["key"]] = float(row["val_accuracy"])
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    continue

    def key(self, trial: dict[str, Any]) -> str:
        return json.dumps({**self.context, **trial}, sort_keys=True)

    def get(self, trial: dict[str, Any]) -> float | None:
        return self.done.get(self.key(trial))

    def add(self, trial: dict[str, Any], val_accuracy: float) -> None:
        key = self.key(trial)
        self.done[key] = val_accuracy
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"key": key, "val_accuracy": val_accuracy}) + "\n")
            f.flush()


@dataclass
class VTABConfig:
    """The sweep grid and the 800/200 split; defaults are VTAB's lightweight sweep."""

    lrs: tuple[float, ...] = (0.1, 0.01)
    steps: tuple[int, ...] = (2500, 10000)
    train_size: int = 800  # examples the sweep trains on; the rest of the 1000 validate
    total_size: int = 1000  # examples per task (VTAB-1k)
    batch_size: int = 512
    momentum: float = 0.9
    weight_decay: float = 0.0
    seed: int = 0  # the 800/200 split and training order

    def __post_init__(self) -> None:
        if not self.lrs or not self.steps:
            raise ValueError("the VTAB sweep needs at least one learning rate and one step count")
        if any(not lr > 0 for lr in self.lrs) or any(s < 1 for s in self.steps):
            raise ValueError(f"VTAB lrs must be positive and steps >= 1, got {self.lrs} and {self.steps}")
        if not 0 < self.train_size < self.total_size:
            raise ValueError(f"train_size must be in (0, total_size={self.total_size}), got {self.train_size}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VTABConfig:
        return from_dict(cls, data, "vtab")


def split_800_200(n: int, config: VTABConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded disjoint (train, validation) index sets of sizes train_size and total_size - train_size."""
    if n != config.total_size:
        raise ValueError(f"VTAB transfer expects exactly {config.total_size} training examples, got {n}")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(config.seed))
    return order[: config.train_size], order[config.train_size :]


def vtab_transfer(
    n_train: int,
    fit: Callable[..., Model],
    score: Callable[[Model, torch.Tensor | None], float],
    config: VTABConfig | None = None,
    *,
    split: tuple[torch.Tensor, torch.Tensor] | None = None,
    trials: Sequence[dict[str, Any]] | None = None,
    log: TrialLog | None = None,
) -> dict[str, Any]:
    """Run the protocol for any trainer.

    ``fit(indices, lr, steps, **rest)`` trains a fresh model on the given training examples (``rest``: a
    trial's other settings, e.g. ``weight_decay``); ``score(model, indices)`` returns its accuracy (%) on
    those training examples (the validation split), or on the test set when ``indices`` is None.
    ``split`` gives the (train, validation) indices, as the released train800 / val200 lists do; without it
    the ``n_train`` examples (exactly ``total_size``) are split at random. ``trials`` default to the
    lightweight grid of ``config``. Ties in validation accuracy go to the earlier trial (the smaller budget
    when steps are listed in increasing order). With ``log``, trials already recorded are not run again
    and each new one is recorded as soon as it is scored.
    """
    cfg = config or VTABConfig()
    train_idx, val_idx = split if split is not None else split_800_200(n_train, cfg)
    sweep: list[dict[str, Any]] = []
    resumed = 0
    for trial in trials if trials is not None else light_trials(cfg):
        acc = log.get(trial) if log is not None else None
        if acc is None:
            rest = {k: v for k, v in trial.items() if k not in ("lr", "steps")}
            acc = float(score(fit(train_idx, trial["lr"], trial["steps"], **rest), val_idx))
            if log is not None:
                log.add(trial, acc)
        else:
            resumed += 1
        sweep.append({**trial, "val_accuracy": acc})
    if not sweep:
        raise ValueError("the VTAB sweep has no trials")
    best = max(sweep, key=lambda r: r["val_accuracy"])  # max keeps the first of equal values
    settings = {k: v for k, v in best.items() if k != "val_accuracy"}
    rest = {k: v for k, v in settings.items() if k not in ("lr", "steps")}
    final = fit(torch.arange(n_train), settings["lr"], settings["steps"], **rest)
    out = {
        "accuracy": float(score(final, None)),
        "best_lr": best["lr"],
        "best_steps": best["steps"],
        "best_val_accuracy": best["val_accuracy"],
        "sweep": sweep,
    }
    out.update({f"best_{k}": v for k, v in rest.items()})
    if log is not None:
        out["trials_resumed"] = resumed
    return out


def _vtab_optim(
    cfg: VTABConfig,
    lr: float,
    steps: int,
    lr_scales: dict[str, float] | None = None,
    weight_decay: float | None = None,
) -> OptimConfig:
    # Decays at 30, 60 and 90 % of training: gamma ** (step // ceil(0.3 * steps)).
    return OptimConfig(
        name="sgd",
        lr=lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay if weight_decay is None else weight_decay,
        schedule="step_decay",
        decay_every=max(1, math.ceil(0.3 * steps)),
        decay_gamma=0.1,
        lr_scales=lr_scales or {},
    )


def _batches(n: int, batch_size: int, steps: int, gen: torch.Generator) -> Any:
    """``steps`` index batches of up to ``batch_size``, reshuffled every epoch."""
    done = 0
    while True:
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, batch_size):
            if done == steps:
                return
            yield order[start : start + batch_size]
            done += 1


def vtab_linear(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    test_x: torch.Tensor,
    test_y: torch.Tensor,
    config: VTABConfig | None = None,
    *,
    split: tuple[torch.Tensor, torch.Tensor] | None = None,
    trials: Sequence[dict[str, Any]] | None = None,
    log: TrialLog | None = None,
    num_classes: int | None = None,
) -> dict[str, Any]:
    """VTAB-1k transfer of a linear head on frozen features (``train_x`` holds exactly 1000 rows, or any
    number with an explicit ``split``)."""
    cfg = config or VTABConfig()
    train_x, train_y = check_features(train_x, train_y)
    test_x, test_y = check_features(test_x, test_y, "test")
    num_classes = max(num_classes or 0, int(train_y.max()) + 1, int(test_y.max()) + 1)

    def fit(idx: torch.Tensor, lr: float, steps: int, weight_decay: float | None = None) -> LinearClassifier:
        gen = torch.Generator().manual_seed(cfg.seed)
        with torch.random.fork_rng(devices=[]):  # every grid point starts from the same head
            torch.manual_seed(cfg.seed)
            clf = LinearClassifier(train_x.shape[1], num_classes)
        optim_cfg = _vtab_optim(cfg, lr, steps, weight_decay=weight_decay)
        opt = build_optimizer(clf.linear, optim_cfg)
        sched = build_scheduler(opt, optim_cfg)
        x, y = train_x[idx], train_y[idx]
        for b in _batches(len(idx), cfg.batch_size, steps, gen):
            loss = F.cross_entropy(clf(x[b]), y[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        return clf

    def score(clf: LinearClassifier, idx: torch.Tensor | None) -> float:
        x, y = (test_x, test_y) if idx is None else (train_x[idx], train_y[idx])
        with torch.no_grad():
            return float(classification_metrics(clf(x), y, (1,))["top1"])

    return vtab_transfer(len(train_x), fit, score, cfg, split=split, trials=trials, log=log)


def vtab_finetune(
    classifier: nn.Module,
    train_data: LabelledData,
    test_data: LabelledData,
    config: VTABConfig | None = None,
    *,
    val_data: LabelledData | None = None,
    backbone_lr_scale: float = 1.0,
    device: str | torch.device = "cpu",
    split: tuple[torch.Tensor, torch.Tensor] | None = None,
    trials: Sequence[dict[str, Any]] | None = None,
    log: TrialLog | None = None,
) -> dict[str, Any]:
    """VTAB-1k transfer by fine-tuning every layer of ``classifier`` (e.g. ``ImageClassifier``), restarted
    from the same initial weights for every grid point. ``train_data`` holds 1000 (pixels, label) pairs
    (with the training augmentation); ``val_data``, if given, the same 1000 images with the evaluation
    transform, used to score the 200 held-out ones."""
    from openalign.eval.finetune import evaluate_classifier

    cfg = config or VTABConfig()
    val_source = val_data if val_data is not None else train_data
    if len(val_source) != len(train_data):
        raise ValueError(f"val_data has {len(val_source)} items for {len(train_data)} training images")
    initial = copy.deepcopy(classifier.state_dict())
    scales = {"backbone.": backbone_lr_scale} if hasattr(classifier, "backbone") and backbone_lr_scale != 1.0 else {}

    def fit(idx: torch.Tensor, lr: float, steps: int, weight_decay: float | None = None) -> nn.Module:
        with torch.random.fork_rng():  # the same dropout / stochastic-depth draws for every grid point
            torch.manual_seed(cfg.seed)
            return train(idx, lr, steps, weight_decay)

    def train(idx: torch.Tensor, lr: float, steps: int, weight_decay: float | None) -> nn.Module:
        gen = torch.Generator().manual_seed(cfg.seed)
        classifier.load_state_dict(initial)
        classifier.to(device).train()
        optim_cfg = _vtab_optim(cfg, lr, steps, scales, weight_decay)
        opt = build_optimizer(classifier, optim_cfg)
        sched = build_scheduler(opt, optim_cfg)
        for b in _batches(len(idx), cfg.batch_size, steps, gen):
            # Fetched per batch so a random-crop transform draws a new crop every time; unreadable images
            # (None from a skip_unreadable dataset) are left out of the batch.
            batch = [item for item in (train_data[int(idx[int(i)])] for i in b) if item is not None]
            if not batch:
                continue
            pixels = torch.stack([item[0] for item in batch]).to(device)
            labels = torch.tensor([int(item[1]) for item in batch], device=device)
            loss = F.cross_entropy(classifier(pixels), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        classifier.eval()
        return classifier

    def score(clf: nn.Module, idx: torch.Tensor | None) -> float:
        data = test_data if idx is None else [val_source[int(i)] for i in idx]
        return float(evaluate_classifier(clf, data, batch_size=cfg.batch_size, device=device)["top1"])

    return vtab_transfer(len(train_data), fit, score, cfg, split=split, trials=trials, log=log)


# --------------------------------------------------------------------------------------------------
# The `vtab` eval task


def _numbers(values: list[str], kind: type, name: str) -> tuple[Any, ...]:
    try:
        return tuple(kind(v) for v in values)
    except ValueError:
        raise ValueError(f"--{name} must be a list of {kind.__name__} values, got {values}") from None


def _sweep(options: dict[str, Any], cfg: VTABConfig) -> list[dict[str, Any]]:
    if options["sweep"] == "paper":
        return paper_trials(options["trials"], cfg.seed)
    return light_trials(cfg)


def _run(model: DualEncoder, tokenizer: TextTokenizer, options: dict[str, Any]) -> dict[str, Any]:
    cfg = VTABConfig(lrs=_numbers(options["lrs"], float, "lrs"), steps=_numbers(options["steps"], int, "steps"))
    if options["root"]:
        if options["train"] or options["val"]:
            raise ValueError("give either --root (every VTAB-1k task under it) or --train and --val (one task)")
        return run_root(model, options, cfg)
    if not options["train"] or not options["val"]:
        raise ValueError("name the tasks' folder with --root DIR, or one task with --train and --val")
    trials = _sweep(options, cfg)
    if options["mode"] == "linear":
        from openalign.embed import embed_images
        from openalign.eval.linear_probe import load_labelled_pair

        train, val, val_labels = load_labelled_pair(options)
        kw = {"batch_size": options["batch_size"], "device": options["device"], "progress": True}
        train_x = embed_images(model, train.images, **kw)
        val_x = embed_images(model, val.images, **kw)
        metrics = vtab_linear(train_x, torch.tensor(train.labels), val_x, torch.tensor(val_labels), cfg, trials=trials)
        name = val.name
    else:
        from openalign.eval.finetune import ImageClassifier, transfer_datasets

        train_set, test_set, num_classes, name = transfer_datasets(model, options)
        # The 200 held-out training images are scored like test images: centre crop, no flip.
        held_out = train_set.with_transform(test_set.transform)
        clf = ImageClassifier.from_dual_encoder(model, num_classes)
        metrics = vtab_finetune(
            clf, train_set, test_set, cfg, val_data=held_out, device=options["device"], trials=trials
        )
    sweep = metrics.pop("sweep")
    flat = {f"val_{_trial_name(r)}": r["val_accuracy"] for r in sweep}
    return {"dataset": name, **metrics, **flat, "mode": options["mode"]}


def _trial_name(trial: dict[str, Any]) -> str:
    name = f"lr{trial['lr']:g}_steps{trial['steps']}"
    return name + (f"_wd{trial['weight_decay']:g}" if "weight_decay" in trial else "")


def find_tasks(root: str | Path) -> tuple[list[VTABTask], list[VTABTask]]:
    """The (present, missing) VTAB-1k tasks under ``root``: a task is present when its folder holds test.txt."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such VTAB-1k directory")
    present = [t for t in VTAB_TASKS if (root / t.folder / "test.txt").is_file()]
    if not present:
        raise ValueError(
            f"{root}: none of the 19 VTAB-1k task folders (e.g. {VTAB_TASKS[0].folder}/test.txt) is there; "
            f"expected folders: {', '.join(t.folder for t in VTAB_TASKS)}"
        )
    return present, [t for t in VTAB_TASKS if t not in present]


def group_means(accuracy: dict[str, float]) -> tuple[dict[str, float], list[str]]:
    """``<group>_mean`` for every group whose tasks all have an accuracy in ``accuracy`` (keyed by folder),
    ``all_mean`` when all 19 do; and the groups left out for a missing task."""
    means, incomplete = {}, []
    for group in VTAB_GROUPS:
        folders = [t.folder for t in VTAB_TASKS if t.group == group]
        if all(f in accuracy for f in folders):
            means[f"{group}_mean"] = sum(accuracy[f] for f in folders) / len(folders)
        else:
            incomplete.append(group)
    if not incomplete:
        means["all_mean"] = sum(accuracy[t.folder] for t in VTAB_TASKS) / len(VTAB_TASKS)
    return means, incomplete


def _fingerprint(tensors: Iterable[torch.Tensor]) -> str:
    """A short hash of the weights or features a sweep starts from, so recorded trials of another model
    are never taken for this one's."""
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _split_of(all_names: list[str], part: list[str], listed: Path) -> torch.Tensor:
    position = {n: i for i, n in enumerate(all_names)}
    missing = [n for n in part if n not in position]
    if missing:
        raise ValueError(f"{listed}: {missing[0]} is not in train800val200.txt ({len(missing)} such images)")
    return torch.tensor([position[n] for n in part], dtype=torch.long)


def run_root(model: DualEncoder, options: dict[str, Any], cfg: VTABConfig) -> dict[str, Any]:
    """Every VTAB-1k task found under ``options["root"]``: per-task test accuracy and the group means."""
    root = Path(options["root"])
    present, missing = find_tasks(root)
    for task in missing:
        print(f"eval vtab: {task.folder} ({task.name}) not under {root}, skipped", file=sys.stderr)
    trials = _sweep(options, cfg)
    image = model.image
    pristine = None
    if options["mode"] == "finetune":
        pristine = {k: v.detach().to("cpu", copy=True) for k, v in image.state_dict().items()}
    model_id = _fingerprint(image.state_dict().values())
    accuracy: dict[str, float] = {}
    details: dict[str, Any] = {}
    for task in present:
        print(f"eval vtab: {task.folder} ({task.name}, {task.group})", file=sys.stderr)
        log = None
        if options["trials_dir"]:
            context = {
                "task": task.folder,
                "mode": options["mode"],
                "model": model_id,
                "seed": cfg.seed,
                "batch_size": cfg.batch_size,
                "image_size": options["image_size"],
            }
            log = TrialLog(Path(options["trials_dir"]) / f"{task.folder}.jsonl", context)
        try:
            result = _run_task(model, root / task.folder, options, cfg, trials, log)
        finally:
            if pristine is not None:
                image.load_state_dict(pristine)  # every task starts from the pre-trained weights
        accuracy[task.folder] = result["accuracy"]
        details[f"{task.folder}_best"] = _trial_name(
            {
                k.removeprefix("best_"): v
                for k, v in result.items()
                if k in ("best_lr", "best_steps", "best_weight_decay")
            }
        )
    means, incomplete = group_means(accuracy)
    metrics: dict[str, Any] = {"dataset": "vtab-1k"}
    for group in VTAB_GROUPS:  # per-task rows grouped, each group's mean after its tasks
        metrics.update({t.folder: accuracy[t.folder] for t in VTAB_TASKS if t.group == group and t.folder in accuracy})
        if f"{group}_mean" in means:
            metrics[f"{group}_mean"] = means[f"{group}_mean"]
    if "all_mean" in means:
        metrics["all_mean"] = means["all_mean"]
    metrics.update(
        {
            "tasks_run": len(present),
            "missing_tasks": [t.folder for t in missing],
            "groups_without_mean": incomplete,
            "sweep": options["sweep"],
            "trials_per_task": len(trials),
            "mode": options["mode"],
            **details,
        }
    )
    return metrics


def _run_task(
    model: DualEncoder,
    folder: Path,
    options: dict[str, Any],
    cfg: VTABConfig,
    trials: list[dict[str, Any]],
    log: TrialLog | None,
) -> dict[str, Any]:
    from openalign.eval.datasets import load_classification
    from openalign.eval.tasks import max_file_bytes

    limit = max_file_bytes(options)
    sets = {
        split: load_classification(f"vtab1k:{folder}:{split}", max_file_bytes=limit)
        for split in ("train800val200", "train800", "val200", "test")
    }
    full = sets["train800val200"]
    names = list(full.images.names)
    split = (
        _split_of(names, list(sets["train800"].images.names), folder / "train800.txt"),
        _split_of(names, list(sets["val200"].images.names), folder / "val200.txt"),
    )
    test = sets["test"]
    num_classes = len(full.classnames)
    if options["mode"] == "linear":
        from openalign.embed import embed_images

        kw = {"batch_size": options["batch_size"], "device": options["device"]}
        full_x = embed_images(model, full.images, **kw)
        test_x = embed_images(model, test.images, **kw)
        return vtab_linear(
            full_x,
            torch.tensor(full.labels),
            test_x,
            torch.tensor(test.labels),
            cfg,
            split=split,
            trials=trials,
            log=log,
            num_classes=num_classes,
        )
    from openalign.data.transforms import eval_transform, model_resize, train_transform
    from openalign.eval.finetune import ImageClassifier, LabelledImages

    mc = model.config
    size = options["image_size"] or mc.image_size
    train_t = train_transform(size, model_resize(size), mean=mc.pixel_mean, std=mc.pixel_std)
    eval_t = eval_transform(size, model_resize(size), mean=mc.pixel_mean, std=mc.pixel_std)
    train_set = LabelledImages(full.images, full.labels, train_t, skip_unreadable=True)
    clf = ImageClassifier.from_dual_encoder(model, num_classes)
    return vtab_finetune(
        clf,
        train_set,
        LabelledImages(test.images, test.labels, eval_t),
        cfg,
        val_data=train_set.with_transform(eval_t),
        device=options["device"],
        split=split,
        trials=trials,
        log=log,
    )


def _register() -> None:
    from openalign.eval.tasks import Option, Task, register

    register(
        Task(
            "vtab",
            _run,
            "VTAB-1k transfer: the 19 tasks under --root (or one task), sweep on 800/200, retrain on 1000, test",
            options=(
                Option(
                    "root",
                    metavar="DIR",
                    help="VTAB-1k release folder: runs every task folder found under it (caltech101, cifar, dtd, "
                    "oxford_flowers102, oxford_iiit_pet, svhn, sun397, patch_camelyon, eurosat, resisc45, "
                    "diabetic_retinopathy, clevr_count, clevr_dist, dmlab, kitti, dsprites_loc, dsprites_ori, "
                    "smallnorb_azi, smallnorb_ele)",
                ),
                Option("train", metavar="PATH", help="one task's 1000 training images (instead of --root)"),
                Option("val", metavar="PATH", help="that task's test images"),
                Option(
                    "layout",
                    default="auto",
                    choices=(
                        "auto",
                        "names",
                        "wnids",
                        "indices",
                        "imagenet",
                        "imagenet-r",
                        "imagenet-a",
                        "imagenet-v2",
                    ),
                    help="with --train/--val: how folders map to classes (see zeroshot)",
                ),
                Option("classnames", metavar="FILE", help="with --train/--val: class names file"),
                Option(
                    "mode",
                    default="linear",
                    choices=("linear", "finetune"),
                    help="linear head on frozen embeddings, or fine-tune the image tower (default linear)",
                ),
                Option(
                    "sweep",
                    default="light",
                    choices=("light", "paper"),
                    help="light: every --lrs x --steps pair; paper: 50 trials of lr x steps x weight decay, the "
                    "paper's trial count (default light)",
                ),
                Option("trials", int, 50, help="paper sweep: trials per task (default 50, the paper's)"),
                Option(
                    "lrs", list, ["0.1", "0.01"], metavar="LR", help="light sweep: learning rates (default 0.1 0.01)"
                ),
                Option(
                    "steps", list, ["2500", "10000"], metavar="N", help="light sweep: step counts (default 2500 10000)"
                ),
                Option(
                    "trials_dir",
                    metavar="DIR",
                    help="record each finished trial here (one JSONL per task); a rerun skips the recorded ones",
                ),
                Option("image_size", int, None, help="finetune mode with --root: resolution (default: the model's)"),
            ),
            examples=(
                "openalign eval vtab --model runs/b7-base/final --root vtab-1k --sweep paper --trials-dir vtab-trials "
                "--out results/",
                "openalign eval vtab --model runs/b7-base/final --train vtab/dtd/train800val200 --val vtab/dtd/test",
                "openalign eval vtab --model runs/nano/final --train t1000 --val test --mode finetune "
                "--lrs 0.01 --steps 500",
            ),
            description="With --root, every VTAB-1k task folder found under DIR is run: each trial trains on "
            "train800.txt and is scored on val200.txt, the best is retrained on train800val200.txt and scored on "
            "test.txt; the report gives per-task accuracy, the natural / specialized / structured means (a "
            "group's mean only when all its tasks ran) and the mean of all 19, beside the paper's Table 5. "
            "With --train/--val, one task of exactly 1000 images is split 800/200 at random (seeded).",
        )
    )


_register()
