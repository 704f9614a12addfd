"""Running evaluations on a checkpoint: one task (``openalign eval TASK``) or a YAML suite of them.

A suite loads the model once, checks every entry's options before anything runs (a typo fails in a
second, not after an hour), writes each result as soon as it is done, and carries on past a failing
task, reporting it at the end; ``resume`` skips entries whose result with the same options is on disk.

Suite YAML::

    model: runs/nano/final          # checkpoint directory (or --model)
    out: results/nano               # results directory (or --out)
    device: cpu                     # optional defaults for every entry
    batch_size: 64
    tasks:
      - {task: retrieval, name: flickr30k, dataset: karpathy:dataset_flickr30k.json, images: flickr30k-images}
      - {task: zeroshot, dataset: imagenet/val, layout: imagenet}
      - {task: knn, train: imagenet/train, val: imagenet/val}
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from openalign.config import ConfigError, from_dict, load_yaml
from openalign.eval.report import (
    CLIP_BENCHMARK_TASKS,
    clip_benchmark_result,
    markdown,
    result_filename,
    write_clip_benchmark,
    write_report,
    write_result,
)
from openalign.eval.tasks import EvalResult, get_task, resolve_options, run_task
from openalign.outputs import check_writable

if TYPE_CHECKING:
    from openalign.model.dual_encoder import DualEncoder
    from openalign.text.tokenizer import Tokenizer


@dataclass
class SuiteConfig:
    """A list of eval tasks for one model."""

    model: str = ""  # checkpoint directory; --model overrides
    tokenizer: str = ""  # tokenizer file or directory (default: the model directory)
    out: str = ""  # results directory; --out overrides; empty prints only
    device: str = ""  # default device for entries that do not set one
    batch_size: int = 0  # default batch size for entries that do not set one (0: each task's default)
    tasks: tuple[dict[str, Any], ...] = ()  # each {task: NAME, <option>: value, ...}


@dataclass
class SuiteSummary:
    results: list[dict[str, Any]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # "entry: reason" for every task that raised
    skipped: list[str] = field(default_factory=list)  # entries whose results were already on disk (resume)
    clip_benchmark: list[dict[str, Any]] = field(default_factory=list)  # the results in CLIP_benchmark's JSON
    markdown: str = ""


def load_checkpoint(model: str | Path, tokenizer: str | Path | None = None) -> tuple[DualEncoder, Tokenizer]:
    """The model in eval mode and its tokenizer (saved beside the checkpoint unless ``tokenizer`` is given)."""
    import openalign

    if not Path(model).is_dir():
        raise FileNotFoundError(f"{model}: no such checkpoint directory")
    net = openalign.load_model(model)
    tok = openalign.load_tokenizer(tokenizer or model, max_length=net.config.text.max_length)
    return net.eval(), tok


def run_eval(
    task: str,
    model: str | Path,
    options: dict[str, Any],
    *,
    tokenizer: str | Path | None = None,
    out: str | Path | None = None,
    format: str = "openalign",
) -> tuple[EvalResult, str]:
    """Evaluate checkpoint ``model`` on ``task``; with ``out`` write the result JSON and refresh results.md.
    Returns the result and its Markdown table.

    With ``format="clip_benchmark"`` the result is written (and returned as text) as CLIP_benchmark's JSON
    instead, under its file name, and results.md is left alone.
    """
    resolve_options(get_task(task), options)  # fail on bad options before loading the model
    _check_format(format, [task])
    if out:
        check_writable(out, what="--out", directory=True)
    net, tok = load_checkpoint(model, tokenizer)
    result = run_task(task, net, tok, options, model_name=str(model))
    if format == "clip_benchmark":
        converted = clip_benchmark_result(result.to_dict(), architecture=net.config.name)
        if out:
            write_clip_benchmark(converted, out)
        return result, json.dumps(converted, indent=2)
    if out:
        write_result(result.to_dict(), out)
        write_report(out)
    return result, markdown([result.to_dict()])


def _check_format(format: str, tasks: list[str], resume: bool = False) -> None:
    """ConfigError, before anything loads, for a format that is not known or cannot hold every task."""
    if format not in ("openalign", "clip_benchmark"):
        raise ConfigError(f"unknown result format {format!r}; expected openalign or clip_benchmark")
    if format != "clip_benchmark":
        return
    other = [t for t in tasks if t not in CLIP_BENCHMARK_TASKS]
    if other:
        raise ConfigError(
            f"eval task {other[0]!r} has no CLIP_benchmark counterpart; --format clip_benchmark covers "
            + ", ".join(CLIP_BENCHMARK_TASKS)
        )
    if resume:
        raise ConfigError("--resume finds openalign-format results; it does not combine with --format clip_benchmark")


def _entries(cfg: SuiteConfig, where: str, device: str | None) -> list[tuple[str, dict[str, Any]]]:
    if not cfg.tasks:
        raise ConfigError(f"{where}: the suite lists no tasks")
    entries = []
    for i, entry in enumerate(cfg.tasks):
        here = f"{where}: tasks[{i}]"
        if "task" not in entry:
            raise ConfigError(f"{here} has no 'task' key")
        options = {k: v for k, v in entry.items() if k != "task"}
        if device:
            options["device"] = device
        elif cfg.device and "device" not in options:
            options["device"] = cfg.device
        if cfg.batch_size and "batch_size" not in options:
            options["batch_size"] = cfg.batch_size
        try:
            task = get_task(str(entry["task"]))
        except ValueError as err:
            raise ConfigError(f"{here}: {err}") from None
        resolve_options(task, options, here)
        entries.append((task.name, options))
    return entries


def run_suite(
    suite: str | Path | dict[str, Any],
    *,
    model: str | Path | None = None,
    tokenizer: str | Path | None = None,
    out: str | Path | None = None,
    device: str | None = None,
    resume: bool = False,
    format: str = "openalign",
) -> SuiteSummary:
    """Run every task of ``suite`` (a YAML path or mapping) on one model; keyword arguments override it.
    With ``format="clip_benchmark"`` each result is written as CLIP_benchmark's JSON instead (every task
    must have a CLIP_benchmark counterpart)."""
    where = str(suite) if not isinstance(suite, dict) else "suite"
    data = load_yaml(suite) if not isinstance(suite, dict) else suite
    cfg = from_dict(SuiteConfig, data)
    model_path = str(model or cfg.model)
    if not model_path:
        raise ConfigError(f"{where}: no model (set 'model:' in the suite or pass --model)")
    out_dir = Path(out or cfg.out) if (out or cfg.out) else None
    if resume and out_dir is None:
        raise ConfigError("resume needs a results directory (--out or 'out:' in the suite)")
    entries = _entries(cfg, where, device)
    _check_format(format, [name for name, _ in entries], resume)
    if out_dir is not None:
        check_writable(out_dir, what="results directory", directory=True)
    net, tok = load_checkpoint(model_path, tokenizer or cfg.tokenizer or None)

    summary = SuiteSummary()
    for i, (name, options) in enumerate(entries):
        label = f"tasks[{i}] {name}" + (f" ({options['name']})" if options.get("name") else "")
        if resume and out_dir is not None:
            done = _finished(out_dir, name, resolve_options(get_task(name), options))
            if done is not None:
                summary.results.append(done)
                summary.skipped.append(label)
                print(f"eval suite: {label}: already done, skipped", file=sys.stderr)
                continue
        print(f"eval suite: {label} ...", file=sys.stderr)
        try:
            result = run_task(name, net, tok, options, model_name=model_path).to_dict()
        except Exception as err:  # one broken dataset must not cost the other tasks' results
            summary.failed.append(f"{label}: {type(err).__name__}: {err}")
            print(f"eval suite: {label} failed: {err}", file=sys.stderr)
            continue
        summary.results.append(result)
        if format == "clip_benchmark":
            converted = clip_benchmark_result(result, architecture=net.config.name)
            summary.clip_benchmark.append(converted)
            if out_dir is not None:
                write_clip_benchmark(converted, out_dir)
        elif out_dir is not None:
            write_result(result, out_dir)
            write_report(out_dir)
    summary.markdown = markdown(summary.results)
    return summary


def _finished(out_dir: Path, task: str, options: dict[str, Any]) -> dict[str, Any] | None:
    """A result on disk for the same task and options, if any (the dataset name is in the file name)."""
    for path in out_dir.glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if (
            isinstance(data, dict)
            and data.get("task") == task
            and data.get("options") == options
            and path.name == result_filename(data)
        ):
            return data
    return None
