"""``openalign experiments``: the paper's ablations (§6, Tables 8–10, Figure 3) in miniature on the synthetic world.

Each ablation trains the ``nano`` dual encoder (its EfficientNet image tower) from the packaged ``nano_cpu`` recipe
several times with one factor changed and several seeds, evaluates every final model on the same held-out synthetic
retrieval set (and KNN classification of its image embeddings, the paper's vision-only probe), and reports mean ±
sample std per variant beside the direction the paper found, with the verdict computed from the seeds:

  a  noisy data at 1×, 2×, 4× the size of a clean set (same number of steps), with learning curves
  b  learned temperature vs fixed 1/32, 1/64, 1/128
  c  in-batch negatives 100 % / 50 % / 25 %
  d  embedding size 80 / 160 / 320 / 640
  e  label smoothing 0.1 vs 0
  f  model scaling: 3 image-tower sizes × 3 text-tower sizes derived from ``nano``

Ablations b–f share one reference configuration (the paper's ablation base: learned temperature, all
negatives, 640-d embeddings, label smoothing 0.1, ``nano``'s towers), trained once per seed. Every run lives
in ``OUT/runs/<variant>/seed<k>``; its ``result.json`` is written only once it is evaluated, so a second
invocation reuses the finished runs and an interrupted one loses none of them. All runs share one WordPiece
vocabulary, learnt once into ``OUT/vocab``: learnt per run it differs by a few pieces (the trainer breaks
merge ties in hash-map order), which changes the embedding table and with it every weight drawn after it,
so runs of one seed would not start from the same weights.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from openalign.config import ConfigError
from openalign.data.sources import TOKENIZER_JSON
from openalign.pipeline.tower_grid import IMAGE_TOWERS, TEXT_TOWERS, tower_overrides
from openalign.process import skip_exit_collection

__all__ = [
    "ABLATIONS",
    "Ablation",
    "ExperimentSettings",
    "RunSpec",
    "Stat",
    "Variant",
    "ablations",
    "aggregate",
    "build_config",
    "clean_scenes",
    "diagnose",
    "expand_grid",
    "lagging_seed",
    "mean_std",
    "parse_only",
    "quick_settings",
    "render_markdown",
    "run_experiments",
    "trend",
]

BASE_CONFIG = "nano_cpu"
RESULT_FILE = "result.json"
VOCAB_DIR = "vocab"
BATCHES_DIR = "batches"  # batch sequences shared by runs, recorded once (removed when the grid is done)
PLOTS_DIR = "plots"

# The default budget, sized for two cores (docs/decisions/experiments-budget.md):
# - batch 512, which learns more per pair than 256 or 1024 in a run this short;
# - captions cut at 32 wordpieces, nano's own text length, so the longest caption of a batch (a noisy one) does
#   not set the text tower's width;
# - 48 px crops: smaller crops train more pairs in the same time but reach no higher R@1 for it;
# - a warmup of 100 of the 140 steps: a run spends its first steps near chance, and a high rate early makes that
#   wait longer;
# - two single-threaded runs at a time (``parallel``).
FULL_STEPS = 140
FULL_BATCH = 512
FULL_EVAL_IMAGES = 1000
TEXT_LENGTH = 32
WARMUP_STEPS = 100  # at most three quarters of a shorter run
# Quick mode: a smoke test of the whole grid (far below the reference's learning; most trends read "no signal").
QUICK_STEPS = 60
QUICK_BATCH = 128
QUICK_EVAL_IMAGES = 300

# Ablation (a) is about data-limited training: the clean set must run out (many epochs) while the larger noisy
# sets still teach: with the 4× set seen only a few times, training is limited by steps rather than data and the
# clean set stays ahead. The clean set is never smaller than a batch (512 scenes at the default budget).
EPOCHS_AT_4X = 48
NOISE = 0.25  # the noisy sets' caption noise, as in the recipe
CURVE_POINTS = 7  # held-out evaluations along each run of (a), for its learning curves

# KNN probe: a labelled index and query set of one-object scenes ("colour shape" classes), drawn apart from
# the retrieval set and from each other.
KNN_INDEX_PER_CLASS = 10
KNN_QUERY_PER_CLASS = 5
KNN_INDEX_SEED, KNN_QUERY_SEED = 1, 2

# The reference of ablations b–f, spelt out so that a change of the recipe cannot move it silently.
REFERENCE: dict[str, Any] = {
    # The paper's ablations are of EfficientNet + BERT dual encoders, and (f) scales the EfficientNet's width and
    # depth: the recipe's plain convolutional tower would make its image-tower sizes all the same model.
    "model.image.family": "efficientnet",
    "model.learn_temperature": True,
    "model.temperature_init": 1.0,
    "train.negatives_fraction": 1.0,
    "model.embed_dim": 640,
    "train.label_smoothing": 0.1,
}
ABLATIONS = ("a", "b", "c", "d", "e", "f")
# A grid cell has no direction of its own: (f) is judged by its verdicts, which compare cells.
Expect = Literal["reference", "lower", "higher", "similar", "grid"]


@dataclass(frozen=True)
class Variant:
    """One setting of an ablation's factor."""

    name: str  # directory name; one name is one configuration, shared by the ablations that contain it
    label: str  # table row
    overrides: dict[str, Any]  # dotted train-config keys on top of the recipe
    expect: Expect  # the paper's finding relative to the ablation's reference variant
    paper: str  # the paper's numbers behind that finding
    paper_r1: tuple[float, float] | None = None  # those numbers: MSCOCO zero-shot R@1 (I2T, T2I), where published


@dataclass(frozen=True)
class Ablation:
    key: str
    title: str
    source: str  # where the paper's numbers come from
    variants: tuple[Variant, ...]

    @property
    def reference(self) -> Variant:
        return next(v for v in self.variants if v.expect == "reference")


@dataclass
class ExperimentSettings:
    """What to run. The defaults are the full grid; ``quick_settings`` is the small one."""

    out: str = "runs/experiments"
    steps: int = FULL_STEPS
    batch_size: int | None = FULL_BATCH  # None = the recipe's
    eval_images: int = FULL_EVAL_IMAGES  # held-out synthetic images, 5 captions each
    seeds: int = 3
    only: tuple[str, ...] = ABLATIONS
    overrides: dict[str, Any] = field(default_factory=dict)  # applied to every run, under each variant's
    # Runs trained at once, each in its own process on one thread with its data read in that thread: on two
    # cores two such runs train more pairs per second between them than one run on both cores.
    parallel: int = 2

    def validate(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"experiments steps must be positive, got {self.steps}")
        if self.batch_size is not None and self.batch_size < 2:
            raise ConfigError(f"experiments batch size must be at least 2 (in-batch negatives), got {self.batch_size}")
        if self.eval_images < 1 or self.seeds < 1 or self.parallel < 1:
            raise ConfigError("experiments eval images, seeds and parallel runs must be positive")
        parse_only(",".join(self.only))


def quick_settings(out: str = "runs/experiments") -> ExperimentSettings:
    return ExperimentSettings(out=out, steps=QUICK_STEPS, batch_size=QUICK_BATCH, eval_images=QUICK_EVAL_IMAGES)


def parse_only(text: str) -> tuple[str, ...]:
    """``"a,c"`` -> ``("a", "c")`` in grid order; unknown names are an error naming the valid ones."""
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in ABLATIONS]
    if unknown or not names:
        raise ConfigError(f"unknown ablation {unknown[0] if unknown else text!r}; valid: {', '.join(ABLATIONS)}")
    return tuple(a for a in ABLATIONS if a in names)


# --------------------------------------------------------------------------------------------------
# The grid


def _batch_size(settings: ExperimentSettings) -> int:
    if settings.batch_size is not None:
        return settings.batch_size
    from openalign.train.config import load_train_config

    return load_train_config(BASE_CONFIG, settings.overrides).data.batch_size


def clean_scenes(steps: int, batch_size: int) -> int:
    """Size N of ablation (a)'s clean set; never below a batch, so no batch holds the same scene twice."""
    return max(batch_size, round(steps * batch_size / (4 * EPOCHS_AT_4X)))


def _reference(label: str, paper: str, r1: tuple[float, float] | None = None) -> Variant:
    return Variant("reference", label, dict(REFERENCE), "reference", _with_r1(paper, r1), r1)


def _changed(
    name: str, label: str, change: dict[str, Any], expect: Expect, paper: str, r1: tuple[float, float] | None = None
) -> Variant:
    return Variant(name, label, {**REFERENCE, **change}, expect, _with_r1(paper, r1), r1)


def _with_r1(paper: str, r1: tuple[float, float] | None) -> str:
    return paper if r1 is None else f"{paper}: {r1[0]} / {r1[1]}"


def ablations(steps: int, batch_size: int) -> dict[str, Ablation]:
    """Every ablation's variants for a run of ``steps`` × ``batch_size`` pairs."""
    n = clean_scenes(steps, batch_size)
    curve = {"eval.every": max(1, steps // CURVE_POINTS)}

    def data(label: str, size: int, noise: float, expect: Expect, paper: str, r1: tuple[float, float]) -> Variant:
        name = label.split()[0] + f"-{size // n}x"
        over = {**REFERENCE, "data.synthetic.noise": noise, "data.synthetic.size": size, **curve}
        return Variant(name, f"{label} ({size:,} scenes)", over, expect, _with_r1(paper, r1), r1)

    def temperature(fixed: int, expect: Expect, paper: str, r1: tuple[float, float]) -> Variant:
        over = {"model.learn_temperature": False, "model.temperature_init": 1.0 / fixed}
        return _changed(f"fixed-1-{fixed}", f"fixed 1/{fixed}", over, expect, paper, r1)

    def negatives(percent: int, expect: Expect, paper: str, r1: tuple[float, float]) -> Variant:
        over = {"train.negatives_fraction": percent / 100}
        return _changed(f"neg-{percent}", f"{percent} % in-batch negatives", over, expect, paper, r1)

    def dim(d: int, expect: Expect, paper: str, r1: tuple[float, float]) -> Variant:
        return _changed(f"dim-{d}", f"embed dim {d}", {"model.embed_dim": d}, expect, paper, r1)

    def towers(image: str, text: str) -> Variant:
        label = f"image {image} × text {text}"
        if (image, text) == ("M", "M"):
            return _reference(label + " (nano)", "the paper's grid: B1–L2 × BERT-Mini–Large")
        return _changed(f"towers-{image}{text}", label, tower_overrides(image, text), "grid", "see the verdicts")

    table8 = "Table 8: B5 + BERT-base, MSCOCO zero-shot R@1 I2T / T2I"
    return {
        "a": Ablation(
            "a",
            "Noisy data at 1×, 2×, 4× the size of a clean set",
            "Table 9 and the data-size study: B7 + BERT-base, MSCOCO zero-shot R@1 I2T / T2I; clean = CC-3M",
            (
                data("clean N", n, 0.0, "reference", "CC-3M", (18.9, 15.5)),
                data("noisy N", n, NOISE, "lower", "lower, ALIGN 3M", (8.1, 6.3)),
                data("noisy 2N", 2 * n, NOISE, "lower", "lower, ALIGN 6M", (15.8, 11.9)),
                data("noisy 4N", 4 * n, NOISE, "higher", "higher, ALIGN 12M", (23.8, 17.5)),
            ),
        ),
        "b": Ablation(
            "b",
            "Learned vs fixed softmax temperature",
            table8,
            (
                _reference("learned (init 1.0)", "learned (→ ~1/64)", (51.7, 37.5)),
                temperature(32, "lower", "lower", (39.6, 26.9)),
                temperature(64, "similar", "≈", (52.2, 37.3)),
                temperature(128, "similar", "≈", (52.2, 36.5)),
            ),
        ),
        "c": Ablation(
            "c",
            "Fraction of in-batch negatives",
            table8,
            (
                _reference("100 % in-batch negatives", "all negatives", (51.7, 37.5)),
                negatives(50, "lower", "lower", (50.2, 37.0)),
                negatives(25, "lower", "lower", (48.7, 35.8)),
            ),
        ),
        "d": Ablation(
            "d",
            "Embedding dimension",
            table8,
            (
                dim(80, "lower", "lower", (42.0, 29.3)),
                dim(160, "lower", "lower", (47.0, 34.4)),
                dim(320, "lower", "lower", (50.3, 34.1)),
                _reference("embed dim 640", "640 (best)", (51.7, 37.5)),
            ),
        ),
        "e": Ablation(
            "e",
            "Label smoothing",
            "§4: the paper trains with 0.1; it publishes no ablation, so 'slightly lower without' is an expectation",
            (
                _reference("label smoothing 0.1", "the paper's setting"),
                _changed(
                    "ls-0",
                    "label smoothing 0",
                    {"train.label_smoothing": 0.0},
                    "lower",
                    "slightly lower (no published numbers)",
                ),
            ),
        ),
        "f": Ablation(
            "f",
            "Model scaling: image tower × text tower",
            "Figure 3 and §6.2: EfficientNet B1–L2 × BERT-Mini–Large; image capacity matters more for "
            "vision-only tasks (ImageNet KNN), both alike for retrieval",
            tuple(towers(image, text) for image in IMAGE_TOWERS for text in TEXT_TOWERS),
        ),
    }


@dataclass(frozen=True)
class RunSpec:
    variant: str
    seed: int
    run_dir: Path
    overrides: dict[str, Any]  # the complete overrides of the recipe for this run
    ablations: tuple[str, ...]  # the ablations whose tables use it

    @property
    def name(self) -> str:
        return f"{self.variant}/seed{self.seed}"


def expand_grid(settings: ExperimentSettings) -> list[RunSpec]:
    """Every distinct run the settings ask for, ablation by ablation, variant by variant, seed by seed; a
    variant that several ablations share (the reference) is one run per seed."""
    settings.validate()
    steps, batch = settings.steps, _batch_size(settings)
    table = ablations(steps, batch)
    root = Path(settings.out) / "runs"
    specs: dict[tuple[str, int], RunSpec] = {}
    for key in settings.only:
        for variant in table[key].variants:
            for seed in range(settings.seeds):
                run_dir = root / variant.name / f"seed{seed}"
                overrides = {
                    "data.batch_size": batch,
                    "optim.total_steps": steps,
                    "optim.warmup_steps": min(WARMUP_STEPS, steps * 3 // 4),
                    "data.max_text_length": TEXT_LENGTH,
                    "train.seed": seed,
                    "train.run_dir": str(run_dir),
                    "data.tokenizer": str(Path(settings.out) / VOCAB_DIR),
                    "train.keep_checkpoints": 1,
                    "eval.every": 0,
                    "eval.images": settings.eval_images,
                    "log.tensorboard": False,
                    **({"train.threads": 1, "data.workers": 0} if settings.parallel > 1 else {}),
                    **settings.overrides,
                    **variant.overrides,
                }
                earlier = specs.get((variant.name, seed))
                if earlier is None:
                    specs[(variant.name, seed)] = RunSpec(variant.name, seed, run_dir, overrides, (key,))
                elif earlier.overrides != overrides:
                    raise AssertionError(f"variant {variant.name} is configured two ways")
                else:
                    specs[(variant.name, seed)] = dataclasses.replace(earlier, ablations=(*earlier.ablations, key))
    return list(specs.values())


def build_config(spec: RunSpec) -> Any:
    """The TrainConfig of one run."""
    from openalign.train.config import load_train_config

    return load_train_config(BASE_CONFIG, spec.overrides)


# --------------------------------------------------------------------------------------------------
# Statistics


@dataclass(frozen=True)
class Stat:
    mean: float
    std: float | None  # sample standard deviation (n - 1); None with a single value
    n: int


def mean_std(values: Sequence[float]) -> Stat:
    n = len(values)
    if n == 0:
        return Stat(math.nan, None, 0)
    mean = sum(values) / n
    if n == 1:
        return Stat(mean, None, 1)
    return Stat(mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)), n)


def pooled_std(a: Stat, b: Stat) -> float | None:
    """The seed noise two rows are compared against: the root mean square of their sample stds."""
    if a.std is None or b.std is None:
        return None
    return math.sqrt((a.std**2 + b.std**2) / 2)


def trend(expect: Expect, reference: Stat, variant: Stat, chance: float | None = None) -> str:
    """How the variant's mean moved from the reference's, judged against the paper's direction.

    A difference no larger than the pooled sample std of the two rows is "within noise"; with one seed
    there is no noise estimate and only the sign is reported. When both rows score under three times
    ``chance`` (R@1 of random embeddings) neither model learnt enough for a difference to mean anything.
    """
    if expect in ("reference", "grid"):
        return {"reference": "reference", "grid": "–"}[expect]
    if variant.n == 0 or reference.n == 0:
        return "no result"
    if chance is not None and max(reference.mean, variant.mean) < 3 * chance:
        return f"no signal: both near chance ({chance:.1f}); train longer"
    diff = variant.mean - reference.mean
    pooled = pooled_std(reference, variant)
    if pooled is not None and abs(diff) <= pooled:
        moved = "within noise"
    else:
        moved = "higher" if diff > 0 else "lower" if diff < 0 else "equal"
    if expect == "similar":
        verdict = {"within noise": "≈ as in paper", "equal": "≈ as in paper"}.get(moved, f"{moved} (paper ≈)")
    elif moved in ("within noise", "equal"):
        verdict = moved
    else:
        verdict = "same direction as paper" if moved == expect else "opposite"
    detail = f"Δ {diff:+.1f}, noise {pooled:.1f}" if pooled is not None else f"Δ {diff:+.1f}, 1 seed: no noise estimate"
    return f"{verdict} ({detail})"


# --------------------------------------------------------------------------------------------------
# Running


def _log(message: str) -> None:
    print(f"[experiments] {message}", flush=True)


# Where and how a run executes, not what it learns: a finished run is reused whatever these were.
EXECUTION_KEYS = ("train.run_dir", "data.tokenizer", "train.threads", "data.workers")


def _settings_record(spec: RunSpec, eval_images: int) -> dict[str, Any]:
    """What decides a run's result; a reused result must have been produced by the same."""
    overrides = {k: v for k, v in spec.overrides.items() if k not in EXECUTION_KEYS}
    record: dict[str, Any] = json.loads(json.dumps({"overrides": overrides, "eval_images": eval_images}))
    return record


@dataclass
class _EvalSets:
    """The held-out sets every run is scored on, rendered once per invocation and image size."""

    retrieval: dict[tuple[int, int], Any] = field(default_factory=dict)
    knn: dict[int, Any] = field(default_factory=dict)

    def retrieval_set(self, images: int, image_size: int) -> Any:
        from openalign.data.synthetic import retrieval_set
        from openalign.eval.sets import RetrievalSet

        if (images, image_size) not in self.retrieval:
            self.retrieval[images, image_size] = RetrievalSet(*retrieval_set(images, 5, image_size=image_size))
        return self.retrieval[images, image_size]

    def knn_sets(self, image_size: int) -> Any:
        from openalign.data.synthetic import classification_set

        if image_size not in self.knn:
            index = classification_set(KNN_INDEX_PER_CLASS, seed=KNN_INDEX_SEED, image_size=image_size)
            query = classification_set(KNN_QUERY_PER_CLASS, seed=KNN_QUERY_SEED, image_size=image_size)
            self.knn[image_size] = (index, query)
        return self.knn[image_size]


def _logged(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The run's ``metrics.jsonl`` as ``read_metrics`` gives it; empty when it logged nothing."""
    from openalign.train.logging import read_metrics

    try:
        return read_metrics(run_dir)
    except (FileNotFoundError, ValueError):
        return {}


def _curve(run_dir: Path) -> list[list[float]]:
    """[step, t2i R@1, i2t R@1] of each held-out evaluation the run logged while training."""
    logged = _logged(run_dir)
    i2t = dict(logged.get("eval/i2t_r1", []))
    return [[step, t2i, i2t[step]] for step, t2i in logged.get("eval/t2i_r1", []) if step in i2t]


def training_log(spec: RunSpec) -> dict[str, float]:
    """What the run's training loss did: its highest and its last logged values (the mean of the last three
    logs, one batch each), beside the loss of scoring every candidate alike (``uniform_loss``)."""
    from openalign.loss import uniform_loss

    cfg = build_config(spec)
    out = {
        "uniform_loss": uniform_loss(cfg.data.batch_size, cfg.train.negatives_fraction),
        "label_smoothing": cfg.train.label_smoothing,
    }
    losses = [value for _, value in _logged(spec.run_dir).get("loss", [])]
    if losses:
        out |= {"peak_loss": max(losses), "end_loss": sum(losses[-3:]) / len(losses[-3:])}
    return out


def _shared_sequences(specs: Sequence[RunSpec]) -> set[str]:
    """Names of the runs whose batch sequence another run of the grid also trains on (one seed's ablations of
    the model or loss all read the same data)."""
    from openalign.train.batch_cache import sequence_key

    keys = {}
    for spec in specs:
        cfg = build_config(spec)
        keys[spec.name] = sequence_key(cfg.data, cfg.train.seed, cfg.model.resolve(), cfg.total_steps)
    counts = Counter(keys.values())
    return {name for name, key in keys.items() if counts[key] > 1}


def _run_one(spec: RunSpec, eval_images: int, sets: _EvalSets, batches: Path | None = None) -> dict[str, Any]:
    import torch

    import openalign
    from openalign.embed import embed_images
    from openalign.eval.knn import knn_accuracy
    from openalign.eval.retrieval import evaluate_retrieval
    from openalign.train.batch_cache import cached_stream_factory
    from openalign.train.loop import NonFiniteError, train

    cfg = build_config(spec)
    record: dict[str, Any] = {"variant": spec.variant, "seed": spec.seed}
    start = time.perf_counter()
    try:
        factory = cached_stream_factory(batches, cfg.total_steps) if batches is not None else None
        result = train(cfg, resume="latest", stream_factory=factory)
    except NonFiniteError as err:
        # A diverged run is an outcome of its setting: record it, and let the grid go on.
        return {**record, "error": str(err), "seconds": round(time.perf_counter() - start, 1)}
    if result.final_dir is None:
        raise RuntimeError(f"{spec.name}: training stopped at step {result.step} without a final model")
    scoring = time.perf_counter()
    side = cfg.data.synthetic.image_size
    model = openalign.load_model(result.final_dir)
    tokenizer = openalign.load_tokenizer(result.final_dir, max_length=model.config.text.max_length)
    device = "cuda" if cfg.train.device != "cpu" and torch.cuda.is_available() else "cpu"
    metrics = evaluate_retrieval(
        model,
        tokenizer,
        sets.retrieval_set(eval_images, side),
        batch_size=cfg.eval.batch_size,
        device=device,
        progress=False,
    )
    (index_images, index_labels, _), (query_images, query_labels, _) = sets.knn_sets(side)
    kw = {"batch_size": cfg.eval.batch_size, "device": device}
    knn = knn_accuracy(
        embed_images(model, index_images, **kw), index_labels, embed_images(model, query_images, **kw), query_labels
    )
    return {
        **record,
        "metrics": {**{k: float(v) for k, v in metrics.items()}, "knn_top1": knn},
        "curve": _curve(spec.run_dir),
        "final_temperature": float(model.temperature.detach()),
        "steps": result.step,
        # Training over every process a resumed run took, then scoring.
        "seconds": round(result.seconds + time.perf_counter() - scoring, 1),
    }


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def run_experiments(settings: ExperimentSettings, *, log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Run (or finish) the grid in ``settings.out``; writes experiments.json and experiments.md and returns
    the summary that went into the JSON."""
    from openalign.train import checkpoint as ckpt

    specs = expand_grid(settings)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    _shared_vocabulary(settings, log)
    wall = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    pending = []
    for i, spec in enumerate(specs, 1):
        path = spec.run_dir / RESULT_FILE
        if path.is_file():
            run = json.loads(path.read_text())
            if run.get("settings") != _settings_record(spec, settings.eval_images):
                raise ValueError(f"{spec.run_dir} holds a run with other settings; use another --out or delete it")
            log(f"[{i}/{len(specs)}] {spec.name}: finished earlier, reused")
            runs[spec.name] = run
        else:
            pending.append(spec)
    shared = _shared_sequences(specs)
    for spec, run in _execute(pending, settings, shared, log):
        run = {**run, "settings": _settings_record(spec, settings.eval_images)}
        _write_json(spec.run_dir / RESULT_FILE, run)
        # The final model stays in final/; the resumable state is no longer needed.
        shutil.rmtree(spec.run_dir / ckpt.CHECKPOINT_DIR, ignore_errors=True)
        log(f"[{len(runs) + 1}/{len(specs)}] {spec.name}: {_run_line(run)}")
        runs[spec.name] = run
    shutil.rmtree(out / BATCHES_DIR, ignore_errors=True)
    # Read from the run's own log, so runs finished by an earlier invocation get it too.
    ordered = [{**runs[spec.name], "training": training_log(spec)} for spec in specs]
    from openalign.pipeline.experiment_plots import write_plots

    batch = _batch_size(settings)
    summary = {
        "settings": {**asdict(settings), "batch_size": batch, "clean_scenes": clean_scenes(settings.steps, batch)},
        "wall_seconds": round(time.perf_counter() - wall, 1),
        "run_seconds": round(sum(r["seconds"] for r in ordered), 1),
        "ablations": aggregate(ordered, ablations(settings.steps, batch), settings.only),
        "runs": ordered,
    }
    summary["plots"] = {key: str(path.relative_to(out)) for key, path in write_plots(summary, out / PLOTS_DIR).items()}
    _write_json(out / "experiments.json", summary)
    markdown = render_markdown(summary)
    (out / "experiments.md").write_text(markdown)
    print(markdown, flush=True)
    log(f"wrote {out / 'experiments.json'} and {out / 'experiments.md'}")
    return summary


def _execute(
    specs: list[RunSpec], settings: ExperimentSettings, shared: set[str], log: Callable[[str], None]
) -> Iterator[tuple[RunSpec, dict[str, Any]]]:
    """Train and evaluate ``specs``, ``settings.parallel`` at a time, yielding each as it finishes; the runs
    named in ``shared`` record or replay their batches."""
    root = Path(settings.out) / BATCHES_DIR
    jobs = [(spec, settings.eval_images, root if spec.name in shared else None) for spec in specs]
    if settings.parallel == 1:
        sets = _EvalSets()
        for spec, eval_images, batches in jobs:
            log(f"{spec.name} ...")
            yield spec, _run_one(spec, eval_images, sets, batches)
        return
    import multiprocessing

    log(f"training {len(specs)} runs, {settings.parallel} at a time")
    # A fresh interpreter per run: no thread pool or allocator state carries from one run to the next.
    context = multiprocessing.get_context("spawn")
    with context.Pool(settings.parallel, maxtasksperchild=1) as pool:
        for index, run in pool.imap_unordered(_run_job, list(enumerate(jobs)), chunksize=1):
            yield specs[index], run


def _run_job(job: tuple[int, tuple[RunSpec, int, Path | None]]) -> tuple[int, dict[str, Any]]:
    index, (spec, eval_images, batches) = job
    run = _run_one(spec, eval_images, _EvalSets(), batches)
    skip_exit_collection()  # the worker's one task: it ends once the result is sent
    return index, run


def _shared_vocabulary(settings: ExperimentSettings, log: Callable[[str], None]) -> None:
    """Learn the grid's vocabulary from the recipe's synthetic captions, unless an earlier invocation did."""
    from openalign.train.config import load_train_config
    from openalign.train.loop import _synthetic_tokenizer

    path = Path(settings.out) / VOCAB_DIR
    if (path / TOKENIZER_JSON).is_file():
        return
    overrides = {k: v for k, v in settings.overrides.items() if k != "data.tokenizer"}
    tokenizer = _synthetic_tokenizer(load_train_config(BASE_CONFIG, overrides))
    tmp = path.with_name(VOCAB_DIR + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save(tmp)
    shutil.rmtree(path, ignore_errors=True)  # a partial copy from an interrupted invocation
    os.replace(tmp, path)
    log(f"learnt the shared vocabulary ({tokenizer.vocab_size} pieces) into {path}")


def _run_line(run: dict[str, Any]) -> str:
    if "error" in run:
        return f"diverged after {run['seconds']:.0f} s"
    m = run["metrics"]
    return f"t2i R@1 {m['t2i_r1']:.1f}, i2t R@1 {m['i2t_r1']:.1f}, KNN {m['knn_top1']:.1f} ({run['seconds']:.0f} s)"


# --------------------------------------------------------------------------------------------------
# Reporting

METRICS = ("t2i_r1", "i2t_r1", "mean_recall", "knn_top1")
TREND_METRICS = ("t2i_r1", "i2t_r1")
# Ablation (f)'s verdicts: (metric, the paper's finding for image capacity against text capacity, its words).
CAPACITY: tuple[tuple[str, Expect, str], ...] = (
    ("knn_top1", "higher", "image capacity matters more for vision-only tasks (ImageNet KNN)"),
    ("t2i_r1", "similar", "image and text capacity matter alike for retrieval"),
    ("i2t_r1", "similar", "image and text capacity matter alike for retrieval"),
)


def _metric_values(runs: list[dict[str, Any]], metric: str) -> list[float]:
    return [r["metrics"][metric] for r in runs if "metrics" in r and r["metrics"].get(metric) is not None]


def _by_seed(runs: list[dict[str, Any]], variant: str, metric: str) -> dict[int, float]:
    return {
        r["seed"]: r["metrics"][metric]
        for r in runs
        if r["variant"] == variant and "metrics" in r and r["metrics"].get(metric) is not None
    }


def _mean_curve(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per evaluated step, t2i and i2t R@1 as mean ± std over the seeds that reached it."""
    steps = sorted({point[0] for r in runs for point in r.get("curve", [])})
    out = []
    for step in steps:
        points = [p for r in runs for p in r.get("curve", []) if p[0] == step]
        t2i, i2t = mean_std([p[1] for p in points]), mean_std([p[2] for p in points])
        out.append({"step": step, "t2i_r1": _stat_dict(t2i), "i2t_r1": _stat_dict(i2t)})
    return out


def capacity_gains(runs: list[dict[str, Any]], metric: str) -> tuple[Stat, Stat]:
    """Ablation (f): what scaling each tower from S to L buys at the other's middle size, per seed (paired):
    (image L minus image S with text M, text L minus text S with image M), as mean ± std over seeds."""
    image = (_by_seed(runs, "towers-SM", metric), _by_seed(runs, "towers-LM", metric))
    text = (_by_seed(runs, "towers-MS", metric), _by_seed(runs, "towers-ML", metric))
    seeds = set(image[0]) & set(image[1]) & set(text[0]) & set(text[1])
    image_gain = mean_std([image[1][s] - image[0][s] for s in sorted(seeds)])
    text_gain = mean_std([text[1][s] - text[0][s] for s in sorted(seeds)])
    return image_gain, text_gain


# Thresholds of ``diagnose``: a training loss this many nats above the uniform one is confidently wrong; one
# run memorises when its loss, as a fraction of the uniform loss, is below this share of the other's while it
# retrieves worse; temperatures this many times apart are far apart.
CONFIDENTLY_WRONG = 0.5
MEMORISING = 0.75
FIT_APART = 0.02  # training losses, as fractions of the uniform loss, at least this far apart differ
TEMPERATURE_APART = 2.0


def _unresolved(
    variant: Variant, reference: Variant, ref: Stat, own: Stat, row: dict[str, Any], ref_row: dict[str, Any]
) -> list[str]:
    """Why a gap the paper found is within the seed noise here: the paper's T2I gap, as a share of its
    reference's R@1, scaled to this reference's; the training logs as well when that gap should have shown."""
    noise = pooled_std(ref, own)
    if variant.paper_r1 is None or reference.paper_r1 is None or noise is None:
        return diagnose(row, ref_row)
    share = (variant.paper_r1[1] - reference.paper_r1[1]) / reference.paper_r1[1]
    expected = share * ref.mean
    note = (
        f"the paper's T2I gap, {share:+.0%} of its reference's R@1, would be {expected:+.1f} points at this "
        f"reference's {ref.mean:.1f}"
    )
    if abs(expected) <= noise:
        return [f"{note}: within the seed noise of {noise:.1f}, so three seeds cannot resolve it"]
    return [f"{note}, beyond the seed noise of {noise:.1f}", *diagnose(row, ref_row)]


def _training_stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean ± std over seeds of the training loss's peak and end and of the final temperature."""
    logs = [r["training"] for r in runs if "training" in r]
    out: dict[str, Any] = {k: _stat_dict(mean_std([t[k] for t in logs if k in t])) for k in ("peak_loss", "end_loss")}
    for key in ("uniform_loss", "label_smoothing"):
        out[key] = logs[0].get(key) if logs else None
    out["temperature"] = _stat_dict(mean_std([r["final_temperature"] for r in runs if "final_temperature" in r]))
    return out


def lagging_seed(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The seed that learnt slower than the others of its variant: its training loss ends ``FIT_APART`` of the
    uniform loss above every other seed's and its t2i R@1 is the lowest; None without one, or below 3 seeds."""
    logs = [r for r in runs if "metrics" in r and "end_loss" in r.get("training", {})]
    if len(logs) < 3:
        return None
    worst = max(logs, key=lambda r: r["training"]["end_loss"])
    others = [r for r in logs if r is not worst]
    gap = worst["training"]["end_loss"] - max(r["training"]["end_loss"] for r in others)
    if gap < FIT_APART * worst["training"]["uniform_loss"]:
        return None
    if worst["metrics"]["t2i_r1"] >= min(r["metrics"]["t2i_r1"] for r in others):
        return None
    return {
        "seed": worst["seed"],
        "end_loss": worst["training"]["end_loss"],
        "t2i_r1": worst["metrics"]["t2i_r1"],
        "others_end_loss": [r["training"]["end_loss"] for r in others],
        "others_t2i_r1": [r["metrics"]["t2i_r1"] for r in others],
    }


def _against_paper(verdict: str) -> bool:
    return verdict.startswith("opposite") or "(paper ≈)" in verdict


def diagnose(
    row: dict[str, Any],
    reference: dict[str, Any],
    names: tuple[str, str] = ("the variant", "the reference"),
    metric: str = "t2i_r1",
) -> list[str]:
    """Measured reasons, read from the training logs, why a variant's ``metric`` moved against the paper's
    direction from the reference's (the two rows called ``names`` in the notes); says so when the logs show
    none."""
    mine, theirs = names
    notes = []
    fit = {}
    for who, r in ((mine, row), (theirs, reference)):
        t = r.get("training", {})
        peak, end, uniform = (
            t.get("peak_loss", {}).get("mean"),
            t.get("end_loss", {}).get("mean"),
            t.get("uniform_loss"),
        )
        if peak is not None and uniform is not None and peak > uniform + CONFIDENTLY_WRONG:
            notes.append(
                f"{who}'s training loss rose to {peak:.1f}, above the {uniform:.1f} of scoring every candidate "
                "alike: it was confidently wrong while it learnt"
            )
        if end is not None and uniform:
            fit[who] = (end / uniform, end, r[metric]["mean"])
    smoothing = [r.get("training", {}).get("label_smoothing") for r in (row, reference)]
    if smoothing[0] != smoothing[1]:
        # Smoothing raises the lowest loss a run can reach: end losses of runs that differ in it do not compare.
        notes.append(f"the training losses do not compare: label smoothing {smoothing[0]} against {smoothing[1]}")
    elif len(fit) == 2 and None not in (fit[mine][2], fit[theirs][2]):
        memorised = False
        for who, other in ((mine, theirs), (theirs, mine)):
            (share, end, r1), (other_share, other_end, other_r1) = fit[who], fit[other]
            if share < MEMORISING * other_share and r1 < other_r1:
                memorised = True
                notes.append(
                    f"{who} fits its training pairs better than {other} (training loss {end:.1f} against "
                    f"{other_end:.1f}, {share:.0%} and {other_share:.0%} of uniform) yet retrieves held-out pairs "
                    "worse: it memorises them"
                )
        (share, end, r1), (ref_share, ref_end, ref_r1) = fit[mine], fit[theirs]
        if not memorised and abs(share - ref_share) >= FIT_APART:
            lower, better = share < ref_share, r1 > ref_r1
            ends = f"{mine}'s training loss ends {'lower' if lower else 'higher'} ({end:.1f} against {ref_end:.1f})"
            if lower == better:
                notes.append(
                    f"{ends}: it fits its training pairs {'faster' if lower else 'slower'} in this run's steps, and "
                    "held-out pairs with them, so the gap is one of learning speed, not of generalisation"
                )
            else:
                notes.append(
                    f"{ends} while it retrieves held-out pairs {'better' if better else 'worse'}: it generalises "
                    f"{'better' if better else 'worse'} from what it fits"
                )
    for who, r in ((mine, row), (theirs, reference)):
        lag = r.get("lagging_seed")
        if lag:
            notes.append(
                f"{who}'s seed {lag['seed']} lags the others: its training loss ends at {lag['end_loss']:.1f} against "
                + " and ".join(f"{v:.1f}" for v in lag["others_end_loss"])
                + f", its t2i R@1 at {lag['t2i_r1']:.1f} against "
                + " and ".join(f"{v:.1f}" for v in lag["others_t2i_r1"])
            )
    temps = [r.get("training", {}).get("temperature", {}).get("mean") for r in (row, reference)]
    if None not in temps and max(temps) > TEMPERATURE_APART * min(temps):
        notes.append(
            f"{mine}'s temperature ends at 1/{1 / temps[0]:.0f}, {theirs}'s at 1/{1 / temps[1]:.0f}: "
            f"logits {temps[1] / temps[0]:.1f}× as sharp"
        )
    return notes or [
        "the training logs show no cause: neither loss rose above uniform, both end within "
        f"{FIT_APART:.0%} of uniform of each other, and the temperatures within {TEMPERATURE_APART:g}×"
    ]


AS_IN_PAPER = ("same direction as paper", "≈ as in paper", "no result")
# Ablation (f)'s scaling steps: (larger cell, smaller cell) for the image tower and for the text tower.
SCALING_PAIRS = (("towers-LM", "towers-SM"), ("towers-ML", "towers-MS"))


def _capacity_why(metric: str, rows: list[dict[str, Any]]) -> list[str]:
    """Why a capacity verdict differs from the paper's: how far the metric spreads over the grid against the
    seed noise, and for retrieval what the training logs say of each tower's S → L step."""
    cells = [row[metric] for row in rows if row[metric]["n"]]
    stds = [cell["std"] for cell in cells if cell["std"] is not None]
    means = [cell["mean"] for cell in cells]
    spread = f"{metric} spans {min(means):.1f}–{max(means):.1f} over the {len(cells)} cells"
    notes = [spread + (f", against a seed std of {sum(stds) / len(stds):.1f} on average" if stds else "")]
    if metric in TREND_METRICS:
        by_name = {row["variant"]: row for row in rows}
        for large, small in SCALING_PAIRS:
            if large in by_name and small in by_name:
                names = (by_name[large]["label"], by_name[small]["label"])
                notes.append(
                    f"{names[1]} → {names[0]}: " + "; ".join(diagnose(by_name[large], by_name[small], names, metric))
                )
    return notes


def aggregate(runs: list[dict[str, Any]], table: dict[str, Ablation], only: Sequence[str]) -> dict[str, Any]:
    """Per ablation and variant: mean ± sample std of each metric over seeds, and the trend against the
    reference variant for both R@1s; for (a) the mean learning curves, for (f) the capacity verdicts."""
    out: dict[str, Any] = {}
    for key in only:
        ablation = table[key]
        names = {v.name for v in ablation.variants}
        used = [r for r in runs if r["variant"] in names]
        stats: dict[str, dict[str, Stat]] = {}
        rows = []
        for variant in ablation.variants:
            mine = [r for r in used if r["variant"] == variant.name]
            done = [r for r in mine if "metrics" in r]
            stats[variant.name] = {m: mean_std(_metric_values(done, m)) for m in METRICS}
            row: dict[str, Any] = {
                "variant": variant.name,
                "label": variant.label,
                "overrides": variant.overrides,
                "expect": variant.expect,
                "paper": variant.paper,
                "runs": len(mine),
                "diverged": len(mine) - len(done),
                "seconds_per_run": mean_std([r["seconds"] for r in mine]).mean,
                **{m: _stat_dict(s) for m, s in stats[variant.name].items()},
            }
            if key == "a":
                row["curve"] = _mean_curve(done)
            row["training"] = _training_stats(done)
            row["lagging_seed"] = lagging_seed(done)
            rows.append(row)
        ref = stats[ablation.reference.name]
        ref_row = rows[ablation.variants.index(ablation.reference)]
        sizes = {r["metrics"].get("num_images") for r in used if "metrics" in r} - {None}
        chance = 100.0 / min(sizes) if sizes else None  # R@1 of random embeddings, in percent
        for row, variant in zip(rows, ablation.variants, strict=True):
            own = stats[variant.name]
            row["trend"] = {m: trend(variant.expect, ref[m], own[m], chance) for m in TREND_METRICS}
            verdict = row["trend"]["t2i_r1"]
            if _against_paper(verdict):
                row["why"] = diagnose(row, ref_row)
            elif verdict.startswith("within noise"):
                row["why"] = _unresolved(variant, ablation.reference, ref["t2i_r1"], own["t2i_r1"], row, ref_row)
        entry: dict[str, Any] = {
            "title": ablation.title,
            "source": ablation.source,
            "reference": ablation.reference.name,
            "seconds": round(sum(r["seconds"] for r in used), 1),
            "variants": rows,
        }
        if key == "f":
            entry["verdicts"] = []
            for metric, expect, paper in CAPACITY:
                image_gain, text_gain = capacity_gains(used, metric)
                verdict = trend(expect, text_gain, image_gain) if image_gain.n and text_gain.n else "no result"
                entry["verdicts"].append(
                    {
                        "metric": metric,
                        "image_gain": _stat_dict(image_gain),
                        "text_gain": _stat_dict(text_gain),
                        "paper": paper,
                        "verdict": verdict,
                        **({} if verdict.startswith(AS_IN_PAPER) else {"why": _capacity_why(metric, rows)}),
                    }
                )
        out[key] = entry
    return out


def _stat_dict(stat: Stat) -> dict[str, Any]:
    return {"mean": stat.mean if stat.n else None, "std": stat.std, "n": stat.n}


def _cell(stat: dict[str, Any], sign: str = "") -> str:
    """``mean ± std``; ``sign="+"`` signs the mean (a gain)."""
    if stat["n"] == 0:
        return "–"
    std = "n/a" if stat["std"] is None else f"{stat['std']:.1f}"
    return f"{stat['mean']:{sign}.1f} ± {std}"


def _loss_cell(training: dict[str, Any]) -> str:
    peak, end, uniform = training.get("peak_loss"), training.get("end_loss"), training.get("uniform_loss")
    if not peak or not end or not peak["n"] or uniform is None:
        return "–"
    return f"{peak['mean']:.1f} → {end['mean']:.1f} ({uniform:.1f})"


def _temperature_cell(training: dict[str, Any]) -> str:
    temperature = training.get("temperature")
    if not temperature or not temperature["n"]:
        return "–"
    return f"1/{1 / temperature['mean']:.0f}"


def _trend_cell(trends: dict[str, str]) -> str:
    t2i, i2t = trends["t2i_r1"], trends["i2t_r1"]
    if t2i == i2t:
        return t2i
    return f"t2i: {t2i}; i2t: {i2t}"


def render_markdown(summary: dict[str, Any]) -> str:
    s = summary["settings"]
    distinct = len(summary["runs"])
    lines = [
        "# ALIGN ablations in miniature",
        "",
        f"`nano` trained from the `{BASE_CONFIG}` recipe on the synthetic noisy alt-text world: {s['steps']} steps "
        f"× batch {s['batch_size']}, seeds 0–{s['seeds'] - 1}; zero-shot retrieval on {s['eval_images']} held-out "
        "images × 5 captions, and KNN (k = 1) classification of one-object scenes by their image embeddings "
        f"({KNN_INDEX_PER_CLASS} labelled and {KNN_QUERY_PER_CLASS} query images per colour-and-shape class). "
        "Cells are mean ± sample std over seeds (in %). Ablations b–f share one reference run per seed.",
        "",
        "*Trend here*: the variant's mean minus the reference row's, called within noise when it is no larger "
        "than the pooled sample std of the two rows, else compared with the paper's direction. "
        "*Paper's direction*: relative to the reference row, with the paper's MSCOCO R@1 (I2T / T2I).",
        "",
        f"{distinct} distinct runs took {summary['run_seconds']:.0f} s of training and evaluation; "
        f"{s['parallel']} at a time, that is about {summary['run_seconds'] / s['parallel'] / 3600:.2f} h of wall "
        f"time for the whole grid at once. This invocation took {summary['wall_seconds']:.0f} s (reused runs "
        "cost nothing).",
        "",
    ]
    plots = summary.get("plots", {})
    for key, ablation in summary["ablations"].items():
        lines += [
            f"## ({key}) {ablation['title']}",
            "",
            f"Paper: {ablation['source']}.",
        ]
        if key == "a":
            n = s["clean_scenes"]
            epochs = s["steps"] * s["batch_size"] / n
            lines.append(
                f"N = {n:,} scenes: a run sees the clean set {epochs:.0f} times and the 4N set {epochs / 4:.0f} times; "
                f"noise {NOISE:.0%} of captions; the learning curves are the held-out t2i R@1 along training."
            )
        lines += [
            "",
            "| variant | t2i R@1 | i2t R@1 | mean recall | KNN top-1 | paper's direction | trend here "
            "| training loss: peak → end (uniform) | τ at end | s/run |",
            "|---|---:|---:|---:|---:|---|---|---:|---:|---:|",
        ]
        for row in ablation["variants"]:
            label = row["label"] + (f" ({row['diverged']} of {row['runs']} diverged)" if row["diverged"] else "")
            lines.append(
                f"| {label} | {_cell(row['t2i_r1'])} | {_cell(row['i2t_r1'])} | {_cell(row['mean_recall'])} "
                f"| {_cell(row['knn_top1'])} | {row['paper']} | {_trend_cell(row['trend'])} "
                f"| {_loss_cell(row.get('training', {}))} | {_temperature_cell(row.get('training', {}))} "
                f"| {row['seconds_per_run']:.0f} |"
            )
        why = [row for row in ablation["variants"] if row.get("why")]
        if why:
            lines += ["", "Where t2i R@1 does not move as the paper's did, what was measured:", ""]
            lines += [f"- **{row['label']}**: " + "; ".join(row["why"]) + "." for row in why]
        if key == "f":
            lines += [
                "",
                "Scaling one tower from S to L with the other at M (per seed, then mean ± std); the verdict compares "
                "the image tower's gain with the text tower's:",
                "",
                "| metric | image S → L | text S → L | paper | verdict |",
                "|---|---:|---:|---|---|",
            ]
            for v in ablation["verdicts"]:
                lines.append(
                    f"| {v['metric']} | {_cell(v['image_gain'], '+')} | {_cell(v['text_gain'], '+')} | {v['paper']} "
                    f"| {v['verdict']} |"
                )
            why = [v for v in ablation["verdicts"] if v.get("why")]
            if why:
                lines += ["", "Where a verdict differs from the paper's finding, what was measured:", ""]
                lines += [f"- **{v['metric']}**: " + "; ".join(v["why"]) + "." for v in why]
        runs = sum(row["runs"] for row in ablation["variants"])
        lines += ["", f"Measured: {ablation['seconds']:.0f} s of training and evaluation over {runs} runs.", ""]
        if key in plots:
            lines += [f"![({key}) {ablation['title']}]({plots[key]})", ""]
    return "\n".join(lines)
