"""``openalign <command>``: parse the command line into the command's settings, call the library, print.

One module per command group (``data``: filter, dedup, vocab, shard; ``copy_detector``: copy-detector train;
``train``: train, plot; ``plan``; ``eval``; ``search``: index, search, serve; ``embed``; ``bench``; ``convert``;
``demo``: demo, experiments), each registering
its commands with :func:`register`. Settings flags come from the config dataclasses through
:mod:`openalign.cli.options`; a command's parser is only built when that command runs (or asks for
``--help``), and heavy modules are imported inside the command, so ``openalign --help`` loads no torch.
"""

from __future__ import annotations

import sys

from openalign.cli import bench, convert, copy_detector, data, demo, embed, eval, plan, search, train
from openalign.cli.allocator import retain_freed_memory
from openalign.cli.options import Parser
from openalign.cli.threads import sleep_when_idle
from openalign.config import ConfigError
from openalign.process import skip_exit_collection

GROUPS = (data, copy_detector, train, plan, eval, search, embed, convert, bench, demo)


def build_parser() -> Parser:
    parser = Parser(
        prog="openalign",
        description="ALIGN image-text dual encoders: data filtering and dedup (with a copy detector), vocabulary, "
        "shards, training, evaluation, search, conversion and benchmarks. `openalign COMMAND --help` lists a "
        "command's settings.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for group in GROUPS:
        group.register(sub)
    return parser


# Errors of libraries a command may have loaded (looked up only once loaded, so parsing imports none):
# a damaged Parquet or CSV file, a malformed YAML file, a query DuckDB cannot run on the input, a batch the GPU's
# memory cannot hold.
_LIBRARY_ERRORS = (
    ("yaml", "YAMLError"),
    ("pyarrow", "ArrowException"),
    ("duckdb", "Error"),
    ("torch", "OutOfMemoryError"),
)


def _known_errors() -> tuple[type[BaseException], ...]:
    known: list[type[BaseException]] = [ConfigError, OSError, ValueError, ImportError]
    for module, name in _LIBRARY_ERRORS:
        error = getattr(sys.modules.get(module), name, None)
        if isinstance(error, type) and issubclass(error, BaseException):
            known.append(error)
    return tuple(known)


def one_line(err: BaseException) -> str:
    """The error as one line: an OSError names its file; an error re-raised from a DataLoader worker (whose
    message carries the worker's traceback) is its last line."""
    if isinstance(err, OSError) and err.strerror and err.filename is not None:
        text = f"{err.filename}: {err.strerror}"
    elif type(err).__name__ == "OutOfMemoryError" and "Tried to allocate" in str(err):
        text = _out_of_gpu_memory(str(err))
    else:
        text = str(err) or type(err).__name__
    if "Traceback (most recent call last)" in text:
        text = [line for line in text.splitlines() if line.strip()][-1]
    return " ".join(text.split())


def _out_of_gpu_memory(message: str) -> str:
    """PyTorch's paragraph of allocator figures as what a user changes: the command's batch size."""
    from openalign.hardware import out_of_memory_figures

    asked, total, free = out_of_memory_figures(message)
    held = f"; the GPU holds {total}, {free} of it free" if total else ""
    return f"out of GPU memory (allocating {asked or 'more'}{held}): lower the batch size"


def main(argv: list[str] | None = None) -> int:
    """Runs the command ``argv`` names; without ``argv``, the process's own command line, in a process whose
    allocator keeps freed memory for reuse (``openalign.cli.allocator``), whose idle compute threads sleep
    rather than spin (``openalign.cli.threads``), and whose exit skips the garbage collector's last pass."""
    if argv is None:
        retain_freed_memory()
        sleep_when_idle()
        try:
            return _run(sys.argv[1:])
        finally:
            # The command is done and has closed what it wrote; the collector's last pass over every object would
            # only add to a short command's wall time.
            skip_exit_collection()
    return _run(argv)


def _run(argv: list[str]) -> int:
    command = next((a for a in argv if not a.startswith("-")), "")
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except Exception as err:
        if not isinstance(err, _known_errors()):
            raise
        print(f"openalign {command}: error: {one_line(err)}", file=sys.stderr)
        return 2


__all__ = ["build_parser", "main"]
