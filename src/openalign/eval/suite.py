"""Running evaluations on a checkpoint: one task (``openalign eval TASK``) or a YAML suite of them.

A suite loads the model once, checks every entry's options before anything runs (a typo fails in a
second, not after an hour), writes each result as soon as it is done, and carries on past a failing
task, reporting it at the end; ``resume`` skips entries whose result with the same options is on disk.

A bare file name that is not on disk names a suite shipped with the package (``paper-transfer.yaml``). With
``root`` (``--root DATA``), ``{root}`` in an entry's values is replaced by DATA (and ``{out}`` by the results
directory), and an entry with ``needs: FOLDER`` runs only when DATA/FOLDER exists: otherwise it is skipped
with a line saying so. ``options`` (``--option NAME=VALUE``) set NAME in every entry whose task has it.

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
    Failure,
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
    root: str = ""  # data folder that {root} stands for and `needs:` folders are looked up in; --root overrides
    tasks: tuple[dict[str, Any], ...] = ()  # each {task: NAME, [needs: FOLDER,] <option>: value, ...}


@dataclass
class SuiteSummary:
    results: list[dict[str, Any]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # "entry: reason" for every task that raised
    failures: list[Failure] = field(default_factory=list)  # the same, as the report lists them
    skipped: list[str] = field(default_factory=list)  # entries whose results were already on disk (resume)
    absent: list[str] = field(default_factory=list)  # entries whose `needs:` folder is not under the root
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


def packaged_suite(name: str) -> Path | None:
    """The suite shipped with the package under ``name`` (``.yaml`` optional), if any."""
    from importlib import resources

    if Path(name).parent != Path("."):
        return None
    stem = name if name.endswith(".yaml") else f"{name}.yaml"
    packaged = resources.files("openalign.eval").joinpath("data").joinpath(stem)
    return Path(str(packaged)) if packaged.is_file() else None


def packaged_suites() -> list[str]:
    from importlib import resources

    folder = resources.files("openalign.eval").joinpath("data")
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".yaml"))


def parse_options(items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``["steps=2", "sweep=light"]`` -> {"steps": 2, "sweep": "light"} (values read as YAML scalars)."""
    from openalign.config import parse_yaml

    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"--option expects NAME=VALUE, got {item!r}")
        out[name.strip().replace("-", "_")] = parse_yaml(value) if value.strip() else ""
    return out


def _substitute(value: Any, names: dict[str, str], where: str) -> Any:
    if isinstance(value, list | tuple):
        return [_substitute(v, names, where) for v in value]
    if not isinstance(value, str):
        return value
    for name, replacement in names.items():
        token = "{" + name + "}"
        if token in value:
            if not replacement:
                flag = "--root DATA" if name == "root" else "--out DIR"
                raise ConfigError(f"{where}: {value!r} uses {token}; give {flag}")
            value = value.replace(token, replacement)
    return value


def _entries(
    cfg: SuiteConfig,
    where: str,
    device: str | None,
    *,
    root: str = "",
    out: str = "",
    overrides: dict[str, Any] | None = None,
) -> list[tuple[str, dict[str, Any], Path | None]]:
    if not cfg.tasks:
        raise ConfigError(f"{where}: the suite lists no tasks")
    overrides = overrides or {}
    used: set[str] = set()
    entries = []
    for i, entry in enumerate(cfg.tasks):
        here = f"{where}: tasks[{i}]"
        if "task" not in entry:
            raise ConfigError(f"{here} has no 'task' key")
        names = {"root": root, "out": out}
        options = {k: _substitute(v, names, here) for k, v in entry.items() if k not in ("task", "needs")}
        needs = None
        if entry.get("needs"):
            if not root:
                raise ConfigError(f"{here} needs the folder {entry['needs']!r} of a data root; give --root DATA")
            needs = Path(root) / str(entry["needs"])
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
        declared = {o.name for o in task.all_options()}
        for name, value in overrides.items():
            if name in declared:
                options[name] = value
                used.add(name)
        resolve_options(task, options, here)
        entries.append((task.name, options, needs))
    unused = sorted(set(overrides) - used)
    if unused:
        raise ConfigError(f"--option {unused[0]}: no task of {where} has that option")
    return entries


def run_suite(
    suite: str | Path | dict[str, Any],
    *,
    model: str | Path | None = None,
    tokenizer: str | Path | None = None,
    out: str | Path | None = None,
    device: str | None = None,
    resume: bool = False,
    root: str | Path | None = None,
    options: dict[str, Any] | None = None,
    format: str = "openalign",
) -> SuiteSummary:
    """Run every task of ``suite`` (a YAML path, the name of a packaged suite, or a mapping) on one model;
    keyword arguments override it.
    With ``format="clip_benchmark"`` each result is written as CLIP_benchmark's JSON instead (every task
    must have a CLIP_benchmark counterpart)."""
    if not isinstance(suite, dict) and not Path(suite).is_file():
        packaged = packaged_suite(str(suite))
        if packaged is None:
            raise FileNotFoundError(
                f"{suite}: no such suite file, nor a packaged suite ({', '.join(packaged_suites())})"
            )
        suite = packaged
    where = str(suite) if not isinstance(suite, dict) else "suite"
    data = load_yaml(suite) if not isinstance(suite, dict) else suite
    cfg = from_dict(SuiteConfig, data)
    model_path = str(model or cfg.model)
    if not model_path:
        raise ConfigError(f"{where}: no model (set 'model:' in the suite or pass --model)")
    out_dir = Path(out or cfg.out) if (out or cfg.out) else None
    if resume and out_dir is None:
        raise ConfigError("resume needs a results directory (--out or 'out:' in the suite)")
    data_root = str(root or cfg.root)
    if data_root and not Path(data_root).is_dir():
        raise FileNotFoundError(f"{data_root}: no such data root")
    entries = _entries(cfg, where, device, root=data_root, out=str(out_dir) if out_dir else "", overrides=options)
    _check_format(format, [entry[0] for entry in entries], resume)
    if out_dir is not None:
        check_writable(out_dir, what="results directory", directory=True)
    net, tok = load_checkpoint(model_path, tokenizer or cfg.tokenizer or None)

    summary = SuiteSummary()
    for i, (name, options_i, needs) in enumerate(entries):
        label = f"tasks[{i}] {name}" + (f" ({options_i['name']})" if options_i.get("name") else "")
        if needs is not None and not needs.is_dir():
            summary.absent.append(f"{label}: {needs}")
            print(f"eval suite: {label}: skipped, {needs} is not there", file=sys.stderr)
            continue
        if resume and out_dir is not None:
            done = _finished(out_dir, name, resolve_options(get_task(name), options_i))
            if done is not None:
                summary.results.append(done)
                summary.skipped.append(label)
                print(f"eval suite: {label}: already done, skipped", file=sys.stderr)
                continue
        print(f"eval suite: {label} ...", file=sys.stderr)
        try:
            result = run_task(name, net, tok, options_i, model_name=model_path).to_dict()
        except Exception as err:  # one broken dataset must not cost the other tasks' results
            reason = " ".join(f"{type(err).__name__}: {err}".split())
            summary.failed.append(f"{label}: {reason}")
            summary.failures.append(Failure(label, name, _entry_dataset(name, options_i), reason))
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
            write_report(out_dir, summary.failures)
    if out_dir is not None and format != "clip_benchmark":
        out_dir.mkdir(parents=True, exist_ok=True)
        write_report(out_dir, summary.failures)
    summary.markdown = markdown(summary.results, summary.failures)
    return summary


def _entry_dataset(task: str, options: dict[str, Any]) -> str:
    """The dataset an entry's result would have been reported under, as far as its options tell: its ``name``,
    else the layout of the first ``NAME:DIR[:SPLIT]`` spec it evaluates on ("" when none)."""
    from openalign.eval.released import parse_spec

    if options.get("name"):
        return str(options["name"])
    if task == "vtab":
        return "vtab-1k"  # the name every VTAB-1k result has
    for key in ("val", "dataset", "train"):
        value = options.get(key)
        try:
            spec = parse_spec(value) if isinstance(value, str) else None
        except ValueError:
            spec = None
        if spec is not None:
            return spec.name
    return ""


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
