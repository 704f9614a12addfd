"""``openalign <command>``: parse the command line into the command's settings, call the library, print.

One module per command group (``data``: filter, dedup, vocab, shard; ``copy_detector``: copy-detector train;
``train``: train, plot; ``plan``; ``eval``; ``search``: index, search, serve; ``bench``; ``convert``; ``demo``: demo,
experiments), each registering
its commands with :func:`register`. Settings flags come from the config dataclasses through
:mod:`openalign.cli.options`; a command's parser is only built when that command runs (or asks for
``--help``), and heavy modules are imported inside the command, so ``openalign --help`` loads no torch.
"""

from __future__ import annotations

import sys

from openalign.cli import bench, convert, copy_detector, data, demo, eval, plan, search, train
from openalign.cli.options import Parser
from openalign.config import ConfigError

GROUPS = (data, copy_detector, train, plan, eval, search, convert, bench, demo)


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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), "")
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except (ConfigError, FileNotFoundError, ValueError, ImportError) as err:
        print(f"openalign {command}: error: {err}", file=sys.stderr)
        return 2


__all__ = ["build_parser", "main"]
