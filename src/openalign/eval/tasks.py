"""The registry behind ``openalign eval TASK`` and ``openalign eval suite``.

Every evaluator declares itself as a :class:`Task`: a name, an argparse-free runner
``(model, tokenizer, options) -> metrics`` and the options it accepts. The CLI builds each task's flags
from those declarations and a suite YAML uses the same names, so one declaration serves both and a
typo is caught the same way in either place.

To add a task, define it in any module of the ``openalign.eval`` package and call :func:`register`
at import time; the package's modules are imported when the registry is first used, so the task
appears in ``openalign eval --help`` and in suites without touching this file::

    register(Task("knn", run_knn, "ImageNet-style KNN R@1", options=(Option("train", required=True),)))
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from openalign.config import ConfigError, coerce

if TYPE_CHECKING:
    from openalign.model import DualEncoder
    from openalign.text.tokenizer import TextTokenizer

Runner = Callable[["DualEncoder", "TextTokenizer", dict[str, Any]], dict[str, Any]]

_OPTION_TYPES = (str, int, float, bool, list)


@dataclass(frozen=True)
class Option:
    """One setting of a task: a key in ``options`` and in a suite entry, and the flag ``--<name-with-dashes>``.

    ``type`` is str, int, float, bool or list (a list of strings; several values after the flag). A bool
    that defaults to True becomes ``--no-<name>`` on the command line, one that defaults to False ``--<name>``.
    """

    name: str
    type: type = str
    default: Any = None
    help: str = ""
    required: bool = False
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None

    def __post_init__(self) -> None:
        if self.type not in _OPTION_TYPES:
            raise ValueError(f"option {self.name!r}: type must be one of str, int, float, bool, list")
        if not self.name.isidentifier():
            raise ValueError(f"option name {self.name!r} must be a Python identifier (snake_case)")

    @property
    def flag(self) -> str:
        dashed = self.name.replace("_", "-")
        return f"--no-{dashed}" if self.type is bool and self.default is True else f"--{dashed}"


@dataclass(frozen=True)
class Task:
    """An evaluation: ``run(model, tokenizer, options)`` returns a flat dict of metrics.

    Values should be numbers (percentages for recalls and accuracies); small JSON values such as a list
    of classes without samples or a count of skipped items are allowed and reported alongside. A runner
    may put the evaluated dataset's name under the key ``"dataset"``; it becomes the result's dataset.
    """

    name: str
    run: Runner
    help: str
    options: tuple[Option, ...] = ()
    examples: tuple[str, ...] = ()
    description: str = ""

    def all_options(self) -> tuple[Option, ...]:
        return (*self.options, *COMMON_OPTIONS)


# Settings every task understands; runners read them from ``options`` like their own.
COMMON_OPTIONS: tuple[Option, ...] = (
    Option("name", help="dataset name shown in reports (default: inferred from the data)"),
    Option("device", default="cpu", help="torch device to embed on (default cpu)"),
    Option("batch_size", int, 64, help="images per embedding batch (default 64)"),
    Option(
        "max_file_mb",
        float,
        64.0,
        help="an image file or shard member larger than this many MB is an error, never read (default 64)",
    ),
    Option(
        "max_annotation_mb",
        float,
        512.0,
        help="an annotation file (captions JSON, lists, .mat; a .gz once decompressed) larger than this many MB"
        " is an error, never read whole (default 512)",
    ),
)

TASKS: dict[str, Task] = {}
_RESERVED = {"task", "model", "tokenizer", "out", "suite"}


def register(task: Task) -> Task:
    """Add ``task`` to :data:`TASKS`; re-registering the same runner (a module re-import) is harmless."""
    old = TASKS.get(task.name)
    if old is not None and (old.run.__module__, old.run.__qualname__) != (task.run.__module__, task.run.__qualname__):
        raise ValueError(f"eval task {task.name!r} is already registered by {old.run.__module__}")
    if task.name in _RESERVED:
        raise ValueError(f"{task.name!r} is reserved and cannot name an eval task")
    names = [o.name for o in task.all_options()]
    dup = {n for n in names if names.count(n) > 1 or n in _RESERVED}
    if dup:
        raise ValueError(f"eval task {task.name!r}: option(s) {sorted(dup)} clash with common or reserved names")
    TASKS[task.name] = task
    return task


_loaded = False


def load_tasks() -> dict[str, Task]:
    """Import every module of ``openalign.eval`` so that all tasks have registered; returns :data:`TASKS`."""
    global _loaded
    if not _loaded:
        _loaded = True
        import openalign.eval as package

        for info in pkgutil.iter_modules(package.__path__):
            if not info.name.startswith("_") and info.name != "tasks":
                importlib.import_module(f"openalign.eval.{info.name}")
    return TASKS


def get_task(name: str) -> Task:
    tasks = load_tasks()
    if name not in tasks:
        raise ValueError(f"unknown eval task {name!r}; valid tasks: {', '.join(sorted(tasks)) or '(none)'}")
    return tasks[name]


def _coerce(option: Option, value: Any, where: str) -> Any:
    if value is None:
        return None
    tp = option.type
    if tp is list:
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            value = [value]  # one value where a list is expected (`lrs: 0.1` in YAML, --option lrs=0.1)
        if not isinstance(value, list | tuple) or not all(isinstance(v, str | int | float) for v in value):
            raise ConfigError(f"{where}: expected a list of strings, got {value!r}")
        return [str(v) for v in value]
    value = coerce(value, tp, where)
    if option.choices is not None and value not in option.choices:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, option.choices))}")
    return value


def resolve_options(task: Task, options: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """Check ``options`` against the task's declaration: unknown keys and ill-typed values are a ConfigError
    naming the key; missing ones get their defaults; a missing required one is an error."""
    declared = {o.name: o for o in task.all_options()}
    prefix = f"{where}: " if where else ""
    unknown = sorted(set(options) - set(declared))
    if unknown:
        raise ConfigError(
            f"{prefix}unknown option '{unknown[0]}' for eval task {task.name!r}; valid options: "
            + ", ".join(sorted(declared))
        )
    out: dict[str, Any] = {}
    for name, option in declared.items():
        value = _coerce(option, options.get(name, option.default), f"{prefix}{task.name}.{name}")
        if value is None and option.required:
            raise ConfigError(f"{prefix}eval task {task.name!r} needs option '{name}' ({option.flag}): {option.help}")
        out[name] = value
    if out["batch_size"] < 1:
        raise ConfigError(f"{prefix}{task.name}.batch_size must be at least 1, got {out['batch_size']}")
    for limit in ("max_file_mb", "max_annotation_mb"):
        if not out[limit] > 0:
            raise ConfigError(f"{prefix}{task.name}.{limit} must be positive, got {out[limit]}")
    return out


def max_annotation_bytes(options: Mapping[str, Any]) -> int:
    """The ``max_annotation_mb`` option of resolved task options, in bytes."""
    from openalign.data.sources import annotation_limit

    return annotation_limit(options["max_annotation_mb"])


def max_file_bytes(options: Mapping[str, Any]) -> int:
    """The ``max_file_mb`` option of resolved task options, in bytes."""
    from openalign.data.sources import file_limit

    return file_limit(options["max_file_mb"])


@dataclass
class EvalResult:
    """One evaluation, serialised like CLIP_benchmark's results: dataset, model, task, metrics."""

    task: str
    dataset: str
    model: str
    metrics: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "model": self.model,
            "task": self.task,
            "metrics": self.metrics,
            "options": self.options,
            "seconds": round(self.seconds, 3),
        }


def run_task(
    name: str, model: DualEncoder, tokenizer: TextTokenizer, options: Mapping[str, Any], *, model_name: str = ""
) -> EvalResult:
    """Validate ``options`` and run task ``name``; the result's dataset is the runner's, the ``name``
    option's, or the task's name, in that order."""
    import time

    task = get_task(name)
    resolved = resolve_options(task, options)
    start = time.perf_counter()
    metrics = dict(task.run(model, tokenizer, dict(resolved)))
    seconds = time.perf_counter() - start
    inferred = metrics.pop("dataset", None)
    dataset = resolved.get("name") or inferred or task.name
    return EvalResult(task.name, str(dataset), model_name, metrics, resolved, seconds)
