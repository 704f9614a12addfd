"""The documentation as a user reads it: README.md and every page under docs/.

Two checks keep it from rotting:

- Every ``openalign ...`` command line in a fenced code block parses with the real command-line parser
  (``openalign.cli.build_parser``): unknown flags, renamed commands and ill-typed values fail, naming the file,
  the line and the parser's message. ``python -m openalign ...``, ``torchrun ... -m openalign ...``, a leading
  ``$ ``, ``FOO=1`` prefixes, ``\\`` continuations, pipes, ``&&`` and ``#`` comments are understood. Blocks
  marked ``text`` (or any other language than a shell's) show output and are not read; in a block that uses
  ``$ `` prompts, only the prompted lines are commands. Upper-case placeholders (``CONFIG``, ``DIR``) and
  ``...`` stand for any value.
- Every relative link and image resolves to a file of the repository, and a ``page.md#anchor`` to a heading of
  that page (GitHub's slugs).

Nothing is run and torch is not imported: the parser reads the settings from source.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELLS = {"", "bash", "sh", "shell", "console", "zsh"}  # fenced blocks read for commands
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*|\.\.\.|…")  # CONFIG, DIR, LEFT, ...: any value


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# --------------------------------------------------------------------------------------------------
# Fenced blocks and the command lines in them


@dataclass(frozen=True)
class Command:
    page: str
    line: int  # 1-based, where the command starts
    text: str  # as written, continuations joined
    argv: list[str]  # what follows ``openalign``

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def fenced_blocks(text: str) -> Iterator[tuple[str, int, list[str]]]:
    """(language, line number of the first line inside, lines) of every fenced code block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"\s*(`{3,}|~{3,})\s*([^\s`]*)", lines[i])
        if not opening:
            i += 1
            continue
        fence, language = opening.group(1), opening.group(2).lower()
        end = i + 1
        while end < len(lines) and not re.match(rf"\s*{fence[0]}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        yield language, i + 2, lines[i + 1 : end]
        i = end + 1


def _statements(block: list[str], first: int) -> Iterator[tuple[int, str]]:
    """(line number, text) of each shell statement, continuation lines joined; with ``$ `` prompts only the
    prompted ones."""
    prompted = any(line.lstrip().startswith("$ ") for line in block)
    i = 0
    while i < len(block):
        start, line = i, block[i].strip()
        while line.endswith("\\") and i + 1 < len(block):
            i += 1
            line = line[:-1] + " " + block[i].strip()
        i += 1
        if prompted:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        yield first + start, line


_OPERATORS = {"|", "||", "&&", ";", "&", "(", ")", "|&", ";;"}
_REDIRECTS = {">", ">>", "<", ">&", "&>", "<<", "<&", ">|"}
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def _words(statement: str) -> list[list[str]]:
    """The simple commands of a shell statement (split at pipes, ``&&``, ``;``), comments and redirections
    removed."""
    lexer = shlex.shlex(statement, posix=True, punctuation_chars=";&|<>()")
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    tokens = list(lexer)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token in _OPERATORS:
            commands.append([])
        elif token in _REDIRECTS:
            if commands[-1] and commands[-1][-1].isdigit():  # 2>, 1>>
                commands[-1].pop()
            i += 1  # and its target
        else:
            commands[-1].append(token)
        i += 1
    return [c for c in commands if c]


def openalign_argv(words: list[str]) -> list[str] | None:
    """The arguments after ``openalign`` when this simple command runs openalign, else None."""
    while words and (_ASSIGNMENT.match(words[0]) or words[0] in ("env", "time", "exec", "command")):
        words = words[1:]
    if not words:
        return None
    program = words[0].rsplit("/", 1)[-1]
    if program == "openalign":
        return words[1:]
    if re.fullmatch(r"python[0-9.]*|torchrun", program):
        for i, word in enumerate(words[:-1]):
            if word == "-m":
                return words[i + 2 :] if words[i + 1] in ("openalign", "openalign.cli") else None
    return None


def commands(path: Path) -> list[Command]:
    found = []
    for language, first, block in fenced_blocks(path.read_text()):
        if language not in SHELLS:
            continue
        for line, statement in _statements(block, first):
            try:
                simple = _words(statement)
            except ValueError as err:  # an unclosed quote
                found.append(Command(_name(path), line, statement, ["<shell>", str(err)]))
                continue
            for words in simple:
                argv = openalign_argv(words)
                if argv is not None:
                    found.append(Command(_name(path), line, statement, argv))
    return found


ALL_COMMANDS = [c for page in PAGES for c in commands(page)]


# --------------------------------------------------------------------------------------------------
# Parsing a command line as `openalign` does, without running it


@cache
def _parser() -> argparse.ArgumentParser:
    from openalign.cli import build_parser

    return build_parser()


def _leaf(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)parser that read the options of ``argv``: the one its command words lead to."""
    for word in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if word.startswith("-") or not subs or word not in subs[0].choices:
            break
        parser = subs[0].choices[word]
    return parser


def _type_error(knob: Any, value: Any) -> str | None:
    """Why ``value`` cannot be field ``knob``'s (the strict loader's checks, made without importing the
    dataclass), or None."""
    if value is None or (isinstance(value, str) and PLACEHOLDER.fullmatch(value)):
        return None
    if knob.choices and value not in knob.choices:
        return f"{value!r} is not one of {', '.join(map(repr, knob.choices))}"
    expected = {
        "bool": (lambda v: isinstance(v, bool), "true or false"),
        "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
        "float": (lambda v: isinstance(v, int | float) and not isinstance(v, bool), "a number"),
        "str": (lambda v: isinstance(v, str), "a string"),
        "list": (lambda v: isinstance(v, list | tuple), "a list"),
        "dict": (lambda v: isinstance(v, dict), "a mapping"),
    }.get(knob.kind)
    if expected is None or expected[0](value):
        return None
    return f"expected {expected[1]}, got {value!r}"


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | None:
    """``parser.parse_args(argv)``; None when it printed help and exited 0. Errors raise."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exit:
        if exit.code in (0, None):
            return None
        raise


def parse_error(argv: list[str]) -> str | None:
    """What is wrong with ``openalign ARGV`` as the parser sees it, or None when it parses."""
    from openalign.cli import eval as eval_cli
    from openalign.cli.options import overrides
    from openalign.config import ConfigError

    if argv[:1] == ["<shell>"]:
        return f"cannot split the line as a shell does: {argv[1]}"
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            parser = _parser()
            args = _parse(parser, argv)
            if args is None:
                return None
            if args.command == "eval":  # eval reads a task's options once it knows the task
                if args.task is None or args.help:
                    return None
                if args.task == "suite":
                    parser = eval_cli.suite_parser()
                else:
                    tasks = eval_cli.tasks()
                    if args.task not in tasks:
                        return f"unknown eval task {args.task!r}; valid tasks: {', '.join(sorted(tasks))}"
                    parser = eval_cli.task_parser(tasks[args.task])
                args = _parse(parser, list(args.rest))
                if args is None:
                    return None
            else:
                parser = _leaf(parser, argv)
    except SystemExit:
        message = err.getvalue()
        at = message.find("error:")  # argparse's message, after its usage lines
        return " ".join((message[at:] if at >= 0 else message).split()) or "the parser exited"
    except (ConfigError, argparse.ArgumentError, argparse.ArgumentTypeError) as error:
        return str(error)
    schema = getattr(parser, "schema", None)
    knobs = {k.path: k for k in schema.knobs} if schema is not None else {}
    for path, value in overrides(args).items():
        knob = knobs.get(path) if isinstance(path, str) else None
        problem = _type_error(knob, value) if knob is not None else None
        if problem:
            return f"--{path}: {problem}"
    return None


def test_the_pages_show_commands() -> None:
    """The extraction finds the README's pipeline (if it found nothing, the test below would pass on nothing)."""
    readme = [c for c in ALL_COMMANDS if c.page == "README.md"]
    assert {c.argv[0] for c in readme} >= {"filter", "dedup", "vocab", "shard", "train", "eval", "serve"}


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=str)
def test_documented_command_parses(command: Command) -> None:
    problem = parse_error(command.argv)
    assert problem is None, f"{command}: `{command.text}` does not parse: {problem}"


def test_parsing_loads_no_torch() -> None:
    """The check stays fast: the parser reads settings from source, so parsing every documented line in a fresh
    process (this suite's conftest loads torch) imports no torch."""
    script = (
        "import sys, test_docs\n"
        "for command in test_docs.ALL_COMMANDS: test_docs.parse_error(command.argv)\n"
        "print(sorted(m for m in ('torch', 'numpy', 'pandas') if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch" not in done.stdout, done.stdout


@pytest.mark.parametrize(
    ("line", "wrong"),
    [
        ("openalign train --config nano_cpu --train.no_such_key 1", "no_such_key"),
        ("openalign filter a.parquet b.parquet --no-such-flag", "no-such-flag"),
        ("openalign trian --config nano_cpu", "trian"),
        ("openalign train --config nano_cpu --optim.total_steps many", "total_steps"),
        ("openalign eval retrieval --model ckpt --no-such-option 3", "no"),
        ("openalign eval no-such-task --model ckpt", "no-such-task"),
    ],
)
def test_a_broken_command_fails(line: str, wrong: str) -> None:
    words = _words(line)
    argv = openalign_argv(words[0])
    assert argv is not None
    problem = parse_error(argv)
    assert problem is not None and wrong.replace("-", "_") in problem.replace("-", "_"), problem


def test_the_shell_forms_are_understood() -> None:
    block = [
        "$ FOO=1 openalign train --config nano_cpu \\",
        "    --train.run_dir runs/x   # a comment",
        "trained 10 steps; model: runs/x/final",
        "$ PYTHONPATH=src python3 -m openalign plan --device cpu | tee plan.txt && echo done",
        "$ torchrun --nproc-per-node 8 -m openalign.cli train --config CONFIG 2> log.txt",
    ]
    found = [
        (line, argv)
        for line, statement in _statements(block, 10)
        for words in _words(statement)
        if (argv := openalign_argv(words)) is not None
    ]
    assert found == [
        (10, ["train", "--config", "nano_cpu", "--train.run_dir", "runs/x"]),
        (13, ["plan", "--device", "cpu"]),
        (14, ["train", "--config", "CONFIG"]),
    ]


# --------------------------------------------------------------------------------------------------
# Links and images


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    text = path.read_text()
    fenced = {n for _, first, block in fenced_blocks(text) for n in range(first - 1, first + len(block) + 1)}
    seen: dict[str, int] = {}
    out = set()
    for number, line in enumerate(text.splitlines(), 1):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading and number not in fenced:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return frozenset(out)


@dataclass(frozen=True)
class Link:
    page: Path
    line: int
    target: str

    def __str__(self) -> str:
        return f"{_name(self.page)}:{self.line}"


_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")


def links(path: Path) -> list[Link]:
    """Every link and image target outside code: inline ones, reference definitions and ``<img src>``."""
    text = path.read_text()
    fenced = {n for _, first, block in fenced_blocks(text) for n in range(first - 1, first + len(block) + 1)}
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if number in fenced:
            continue
        line = re.sub(r"`[^`]*`", "", line)  # inline code is not a link
        targets = [m.group(1) for m in _LINK.finditer(line)]
        targets += re.findall(r"<img\s[^>]*src=\"([^\"]+)\"", line)
        if reference := _REFERENCE.match(line):
            targets.append(reference.group(1))
        out += [Link(path, number, t) for t in targets]
    return out


ALL_LINKS = [link for page in PAGES for link in links(page)]


def link_error(link: Link) -> str | None:
    target = link.target
    if not target or re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
        return None  # an address, mailto:, ...
    file, _, anchor = target.partition("#")
    resolved = (link.page.parent / file).resolve() if file else link.page
    if file.startswith("/"):
        resolved = (ROOT / file.lstrip("/")).resolve()
    if not resolved.exists():
        return f"{target}: no such file ({resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved})"
    if not resolved.is_relative_to(ROOT):
        return f"{target}: outside the repository"
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return f"{target}: no heading with anchor #{anchor} in {_name(resolved)}"
    return None


def test_the_pages_have_links() -> None:
    assert any(link.page.name == "README.md" and link.target.startswith("docs/") for link in ALL_LINKS)


@pytest.mark.parametrize("link", ALL_LINKS, ids=lambda link: f"{link}:{link.target}")
def test_relative_link_resolves(link: Link) -> None:
    problem = link_error(link)
    assert problem is None, f"{link}: {problem}"


def test_a_broken_link_fails(tmp_path: Path) -> None:
    assert slug("The paper's findings in miniature") == "the-papers-findings-in-miniature"
    assert slug("(a) Noisy data at 1×, 2×, 4×") == "a-noisy-data-at-1-2-4"
    assert slug("`openalign plan`: a run's memory") == "openalign-plan-a-runs-memory"
    readme = ROOT / "README.md"
    assert link_error(Link(readme, 1, "docs/no-such-page.md")) is not None
    assert link_error(Link(readme, 1, "README.md#no-such-heading")) is not None
    assert link_error(Link(readme, 1, "https://example.org/missing")) is None
