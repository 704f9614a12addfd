"""``openalign experiments``: the paper's ablations (§6, Tables 8–10) in miniature on the synthetic world.

Each ablation trains the ``nano`` dual encoder from the packaged ``nano_cpu`` recipe several times with one
factor changed and several seeds, evaluates every final model on the same held-out synthetic retrieval set,
and reports mean ± sample std per variant beside the direction the paper found:

  a  noisy data at 1×, 2×, 4× the size of a clean set (same number of steps)
  b  learned temperature vs fixed 1/32, 1/64, 1/128
  c  in-batch negatives 100 % / 50 % / 25 %
  d  embedding size 80 / 160 / 320 / 640
  e  label smoothing 0.1 vs 0

Every run lives in ``OUT/runs/<ablation>/<variant>/seed<k>``; its ``result.json`` is written only once it is
evaluated, so a second invocation reuses the finished runs and an interrupted one loses none of them. All runs
share one WordPiece vocabulary, learnt once into ``OUT/vocab``: learnt per run it differs by a few pieces
(the trainer breaks merge ties in hash-map order), which changes the embedding table and with it every
weight drawn after it, so runs of one seed would not start from the same weights.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from openalign.config import ConfigError
from openalign.data.sources import TOKENIZER_JSON

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
    "expand_grid",
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

# Full mode: the recipe's batch for a modest number of steps, scored on a Flickr-sized held-out set.
FULL_STEPS = 400
FULL_EVAL_IMAGES = 1000
# Quick mode: the smallest budget at which nano learns well above chance (t2i R@1 several times chance after
# 200 steps of 128), so the whole grid (17 variants × 3 seeds) takes about an hour on two idle cores.
QUICK_STEPS = 200
QUICK_BATCH = 128
QUICK_EVAL_IMAGES = 500

# Ablation (a): the paper's full run sees its data about 12 times (1.2M steps × 16384 pairs over 1.8B), so
# the clean set holds a quarter of the training budget / 12 scenes and the 4× noisy set is seen ~12 times.
EPOCHS_AT_4X = 12
NOISE = 0.25  # the noisy sets' caption noise, as in the recipe

ABLATIONS = ("a", "b", "c", "d", "e")
Expect = Literal["reference", "lower", "higher", "similar"]


@dataclass(frozen=True)
class Variant:
    """One setting of an ablation's factor."""

    name: str  # directory name
    label: str  # table row
    overrides: dict[str, Any]  # dotted train-config keys on top of the recipe
    expect: Expect  # the paper's finding relative to the ablation's reference variant
    paper: str  # the paper's numbers behind that finding


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
    batch_size: int | None = None  # None = the recipe's
    eval_images: int = FULL_EVAL_IMAGES  # held-out synthetic images, 5 captions each
    seeds: int = 3
    only: tuple[str, ...] = ABLATIONS
    overrides: dict[str, Any] = field(default_factory=dict)  # applied to every run, under each variant's

    def validate(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"experiments steps must be positive, got {self.steps}")
        if self.batch_size is not None and self.batch_size < 2:
            raise ConfigError(f"experiments batch size must be at least 2 (in-batch negatives), got {self.batch_size}")
        if self.eval_images < 1 or self.seeds < 1:
            raise ConfigError("experiments eval images and seeds must be positive")
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


def ablations(steps: int, batch_size: int) -> dict[str, Ablation]:
    """Every ablation's variants for a run of ``steps`` × ``batch_size`` pairs."""
    n = clean_scenes(steps, batch_size)

    def data(label: str, size: int, noise: float, expect: Expect, paper: str) -> Variant:
        name = label.split()[0] + f"-{size // n}x"
        over = {"data.synthetic.noise": noise, "data.synthetic.size": size}
        return Variant(name, f"{label} ({size:,} scenes)", over, expect, paper)

    def temperature(fixed: int | None, expect: Expect, paper: str) -> Variant:
        if fixed is None:
            over = {"model.learn_temperature": True, "model.temperature_init": 1.0}
            return Variant("learned", "learned (init 1.0)", over, expect, paper)
        over = {"model.learn_temperature": False, "model.temperature_init": 1.0 / fixed}
        return Variant(f"fixed-1-{fixed}", f"fixed 1/{fixed}", over, expect, paper)

    def negatives(percent: int, expect: Expect, paper: str) -> Variant:
        over = {"train.negatives_fraction": percent / 100}
        return Variant(f"neg-{percent}", f"{percent} % in-batch negatives", over, expect, paper)

    def dim(d: int, expect: Expect, paper: str) -> Variant:
        return Variant(f"dim-{d}", f"embed dim {d}", {"model.embed_dim": d}, expect, paper)

    def smoothing(value: float, expect: Expect, paper: str) -> Variant:
        return Variant(f"ls-{value:g}", f"label smoothing {value:g}", {"train.label_smoothing": value}, expect, paper)

    table8 = "Table 8: B5 + BERT-base, MSCOCO zero-shot R@1 I2T / T2I"
    return {
        "a": Ablation(
            "a",
            "Noisy data at 1×, 2×, 4× the size of a clean set",
            "Table 9 and the data-size study: B7 + BERT-base, MSCOCO zero-shot R@1 I2T / T2I; clean = CC-3M",
            (
                data("clean N", n, 0.0, "reference", "CC-3M: 18.9 / 15.5"),
                data("noisy N", n, NOISE, "lower", "lower: ALIGN 3M 8.1 / 6.3"),
                data("noisy 2N", 2 * n, NOISE, "lower", "lower: ALIGN 6M 15.8 / 11.9"),
                data("noisy 4N", 4 * n, NOISE, "higher", "higher: ALIGN 12M 23.8 / 17.5"),
            ),
        ),
        "b": Ablation(
            "b",
            "Learned vs fixed softmax temperature",
            table8,
            (
                temperature(None, "reference", "learned (→ ~1/64): 51.7 / 37.5"),
                temperature(32, "lower", "lower: 39.6 / 26.9"),
                temperature(64, "similar", "≈: 52.2 / 37.3"),
                temperature(128, "similar", "≈: 52.2 / 36.5"),
            ),
        ),
        "c": Ablation(
            "c",
            "Fraction of in-batch negatives",
            table8,
            (
                negatives(100, "reference", "all negatives: 51.7 / 37.5"),
                negatives(50, "lower", "lower: 50.2 / 37.0"),
                negatives(25, "lower", "lower: 48.7 / 35.8"),
            ),
        ),
        "d": Ablation(
            "d",
            "Embedding dimension",
            table8,
            (
                dim(80, "lower", "lower: 42.0 / 29.3"),
                dim(160, "lower", "lower: 47.0 / 34.4"),
                dim(320, "lower", "lower: 50.3 / 34.1"),
                dim(640, "reference", "640 (best): 51.7 / 37.5"),
            ),
        ),
        "e": Ablation(
            "e",
            "Label smoothing",
            "§4: the paper trains with 0.1; it publishes no ablation, so 'slightly lower without' is an expectation",
            (
                smoothing(0.1, "reference", "the paper's setting"),
                smoothing(0.0, "lower", "slightly lower (no published numbers)"),
            ),
        ),
    }


@dataclass(frozen=True)
class RunSpec:
    ablation: str
    variant: str
    seed: int
    run_dir: Path
    overrides: dict[str, Any]  # the complete overrides of the recipe for this run

    @property
    def name(self) -> str:
        return f"{self.ablation}/{self.variant}/seed{self.seed}"


def expand_grid(settings: ExperimentSettings) -> list[RunSpec]:
    """Every run the settings ask for, ablation by ablation, variant by variant, seed by seed."""
    settings.validate()
    steps, batch = settings.steps, _batch_size(settings)
    table = ablations(steps, batch)
    root = Path(settings.out) / "runs"
    specs = []
    for key in settings.only:
        for variant in table[key].variants:
            for seed in range(settings.seeds):
                run_dir = root / key / variant.name / f"seed{seed}"
                overrides = {
                    "data.batch_size": batch,
                    "optim.total_steps": steps,
                    "optim.warmup_steps": max(1, steps // 16),
                    "train.seed": seed,
                    "train.run_dir": str(run_dir),
                    "data.tokenizer": str(Path(settings.out) / VOCAB_DIR),
                    "train.keep_checkpoints": 1,
                    "eval.every": 0,
                    "eval.images": settings.eval_images,
                    "log.tensorboard": False,
                    **settings.overrides,
                    **variant.overrides,
                }
                specs.append(RunSpec(key, variant.name, seed, run_dir, overrides))
    return specs


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


def trend(expect: Expect, reference: Stat, variant: Stat, chance: float | None = None) -> str:
    """How the variant's mean moved from the reference's, judged against the paper's direction.

    A difference no larger than the pooled sample std of the two rows is "within noise"; with one seed
    there is no noise estimate and only the sign is reported. When both rows score under three times
    ``chance`` (R@1 of random embeddings) neither model learnt enough for a difference to mean anything.
    """
    if expect == "reference":
        return "reference"
    if variant.n == 0 or reference.n == 0:
        return "no result"
    if chance is not None and max(reference.mean, variant.mean) < 3 * chance:
        return f"no signal: both near chance ({chance:.1f}); train longer"
    diff = variant.mean - reference.mean
    pooled = None
    if reference.std is not None and variant.std is not None:
        pooled = math.sqrt((reference.std**2 + variant.std**2) / 2)
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


def _settings_record(spec: RunSpec, eval_images: int) -> dict[str, Any]:
    """What decides a run's result; a reused result must have been produced by the same."""
    overrides = {k: v for k, v in spec.overrides.items() if k not in ("train.run_dir", "data.tokenizer")}
    record: dict[str, Any] = json.loads(json.dumps({"overrides": overrides, "eval_images": eval_images}))
    return record


def _run_one(spec: RunSpec, eval_images: int, eval_sets: dict[tuple[int, int], Any]) -> dict[str, Any]:
    import torch

    import openalign
    from openalign.data.synthetic import retrieval_set
    from openalign.eval.retrieval import RetrievalSet, evaluate_retrieval
    from openalign.train.loop import NonFiniteError, train

    cfg = build_config(spec)
    record: dict[str, Any] = {"ablation": spec.ablation, "variant": spec.variant, "seed": spec.seed}
    start = time.perf_counter()
    try:
        result = train(cfg, resume="latest")
    except NonFiniteError as err:
        # A diverged run is an outcome of its setting: record it, and let the grid go on.
        return {**record, "error": str(err), "seconds": round(time.perf_counter() - start, 1)}
    if result.final_dir is None:
        raise RuntimeError(f"{spec.name}: training stopped at step {result.step} without a final model")
    # One held-out set for every run (its own seed space), rendered once per invocation.
    key = (eval_images, cfg.data.synthetic.image_size)
    if key not in eval_sets:
        eval_sets[key] = RetrievalSet(*retrieval_set(eval_images, 5, image_size=key[1]))
    model = openalign.load_model(result.final_dir)
    tokenizer = openalign.load_tokenizer(result.final_dir, max_length=model.config.text.max_length)
    device = "cuda" if cfg.train.device != "cpu" and torch.cuda.is_available() else "cpu"
    metrics = evaluate_retrieval(
        model, tokenizer, eval_sets[key], batch_size=cfg.eval.batch_size, device=device, progress=False
    )
    return {
        **record,
        "metrics": {k: float(v) for k, v in metrics.items()},
        "final_temperature": float(model.temperature.detach()),
        "steps": result.step,
        "seconds": round(time.perf_counter() - start, 1),
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
    eval_sets: dict[tuple[int, int], Any] = {}
    runs = []
    for i, spec in enumerate(specs, 1):
        path = spec.run_dir / RESULT_FILE
        expected = _settings_record(spec, settings.eval_images)
        if path.is_file():
            run = json.loads(path.read_text())
            if run.get("settings") != expected:
                raise ValueError(f"{spec.run_dir} holds a run with other settings; use another --out or delete it")
            log(f"[{i}/{len(specs)}] {spec.name}: finished earlier, reused")
        else:
            log(f"[{i}/{len(specs)}] {spec.name} ...")
            run = {**_run_one(spec, settings.eval_images, eval_sets), "settings": expected}
            _write_json(path, run)
            # The final model stays in final/; the resumable state is no longer needed.
            shutil.rmtree(spec.run_dir / ckpt.CHECKPOINT_DIR, ignore_errors=True)
            log(f"[{i}/{len(specs)}] {spec.name}: {_run_line(run)}")
        runs.append(run)
    batch = _batch_size(settings)
    summary = {
        "settings": {**asdict(settings), "batch_size": batch, "clean_scenes": clean_scenes(settings.steps, batch)},
        "wall_seconds": round(time.perf_counter() - wall, 1),
        "ablations": aggregate(runs, ablations(settings.steps, batch), settings.only),
        "runs": runs,
    }
    _write_json(out / "experiments.json", summary)
    markdown = render_markdown(summary)
    (out / "experiments.md").write_text(markdown)
    print(markdown, flush=True)
    log(f"wrote {out / 'experiments.json'} and {out / 'experiments.md'}")
    return summary


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
    return f"t2i R@1 {m['t2i_r1']:.1f}, i2t R@1 {m['i2t_r1']:.1f} ({run['seconds']:.0f} s)"


# --------------------------------------------------------------------------------------------------
# Reporting

METRICS = ("t2i_r1", "i2t_r1", "mean_recall")


def aggregate(runs: list[dict[str, Any]], table: dict[str, Ablation], only: Sequence[str]) -> dict[str, Any]:
    """Per ablation and variant: mean ± sample std of each metric over seeds, and the trend against the
    reference variant for both R@1s."""
    out: dict[str, Any] = {}
    for key in only:
        ablation = table[key]
        stats: dict[str, dict[str, Stat]] = {}
        rows = []
        for variant in ablation.variants:
            mine = [r for r in runs if r["ablation"] == key and r["variant"] == variant.name]
            done = [r for r in mine if "metrics" in r]
            stats[variant.name] = {m: mean_std([r["metrics"][m] for r in done]) for m in METRICS}
            rows.append(
                {
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
            )
        ref = stats[ablation.reference.name]
        sizes = {r["metrics"].get("num_images") for r in runs if r["ablation"] == key and "metrics" in r} - {None}
        chance = 100.0 / min(sizes) if sizes else None  # R@1 of random embeddings, in percent
        for row, variant in zip(rows, ablation.variants, strict=True):
            own = stats[variant.name]
            row["trend"] = {m: trend(variant.expect, ref[m], own[m], chance) for m in ("t2i_r1", "i2t_r1")}
        out[key] = {
            "title": ablation.title,
            "source": ablation.source,
            "reference": ablation.reference.name,
            "seconds": round(sum(r["seconds"] for r in runs if r["ablation"] == key), 1),
            "variants": rows,
        }
    return out


def _stat_dict(stat: Stat) -> dict[str, Any]:
    return {"mean": stat.mean if stat.n else None, "std": stat.std, "n": stat.n}


def _cell(stat: dict[str, Any]) -> str:
    if stat["n"] == 0:
        return "–"
    std = "n/a" if stat["std"] is None else f"{stat['std']:.1f}"
    return f"{stat['mean']:.1f} ± {std}"


def _trend_cell(trends: dict[str, str]) -> str:
    t2i, i2t = trends["t2i_r1"], trends["i2t_r1"]
    if t2i == i2t:
        return t2i
    return f"t2i: {t2i}; i2t: {i2t}"


def render_markdown(summary: dict[str, Any]) -> str:
    s = summary["settings"]
    lines = [
        "# ALIGN ablations in miniature",
        "",
        f"`nano` trained from the `{BASE_CONFIG}` recipe on the synthetic noisy alt-text world: {s['steps']} steps "
        f"× batch {s['batch_size']}, seeds 0–{s['seeds'] - 1}; zero-shot retrieval on {s['eval_images']} held-out "
        "images × 5 captions. Cells are mean ± sample std over seeds (R@1 and mean recall in %).",
        "",
        "*Trend here*: the variant's mean minus the reference row's, called within noise when it is no larger "
        "than the pooled sample std of the two rows, else compared with the paper's direction. "
        "*Paper's direction*: relative to the reference row, with the paper's MSCOCO R@1 (I2T / T2I).",
        "",
        f"Wall time of this invocation: {summary['wall_seconds']:.0f} s (reused runs cost nothing).",
        "",
    ]
    for key, ablation in summary["ablations"].items():
        lines += [
            f"## ({key}) {ablation['title']}",
            "",
            f"Paper: {ablation['source']}.",
        ]
        if key == "a":
            lines.append(f"N = {s['clean_scenes']:,} scenes, repeated every epoch; noise {NOISE:.0%} of captions.")
        lines += [
            "",
            "| variant | t2i R@1 | i2t R@1 | mean recall | paper's direction | trend here | s/run |",
            "|---|---:|---:|---:|---|---|---:|",
        ]
        for row in ablation["variants"]:
            label = row["label"] + (f" ({row['diverged']} of {row['runs']} diverged)" if row["diverged"] else "")
            lines.append(
                f"| {label} | {_cell(row['t2i_r1'])} | {_cell(row['i2t_r1'])} | {_cell(row['mean_recall'])} "
                f"| {row['paper']} | {_trend_cell(row['trend'])} | {row['seconds_per_run']:.0f} |"
            )
        runs = sum(row["runs"] for row in ablation["variants"])
        seconds = ablation["seconds"]
        lines += ["", f"Measured wall time: {seconds:.0f} s of training and evaluation over {runs} runs.", ""]
    return "\n".join(lines)
