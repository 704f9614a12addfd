"""src/ says what the code does and why, not when or at which commit: no commit ids and no dates in it.

Commit ids: a run of 7 to 40 lower-case hex digits with at least one digit and one letter, standing alone (not
after ``0x``, not part of a longer word or of a UUID). In a comment or docstring any such run counts; in another
string literal (where generated ids and test data live) only one that names a commit of this repository, or one
in a string that says "commit". Dates: ``YYYY-MM-DD``, ``YYYY/MM/DD``, ``YYYY-MM`` and a month named with its
year, in comments, docstrings and YAML files under src/. Each finding is reported as file:line.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import subprocess
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

HEX_RUN = re.compile(r"(?<![0-9A-Za-z_])(?<!0x)[0-9a-f]{7,40}(?![0-9A-Za-z_])")
UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", re.IGNORECASE)
MONTHS = (
    "January|February|March|April|May|June|July|August|September|October|November|December"
    "|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec"
)
DATE = re.compile(
    r"\b(?:19|20)\d\d[-/](?:0[1-9]|1[0-2])(?:[-/](?:0[1-9]|[12]\d|3[01]))?\b(?!-\d)"
    rf"|\b\d{{1,2}}(?:st|nd|rd|th)? (?:{MONTHS})\.?,? (?:19|20)\d\d\b"
    rf"|\b(?:{MONTHS})\.? (?:\d{{1,2}}(?:st|nd|rd|th)?,? )?(?:19|20)\d\d\b"
)


def commit_like(text: str) -> Iterator[tuple[int, str]]:
    """(offset, run) of each hex run in ``text`` that could be an abbreviated or full git commit id."""
    text = UUID.sub(lambda m: "-" * len(m.group()), text)
    for m in HEX_RUN.finditer(text):
        run = m.group()
        if re.search(r"\d", run) and re.search(r"[a-f]", run):
            yield m.start(), run


def dates(text: str) -> Iterator[tuple[int, str]]:
    for m in DATE.finditer(text):
        yield m.start(), m.group()


class Text:
    """One piece of a source file: where it starts, its text, and whether it is prose (comment, docstring)."""

    def __init__(self, line: int, text: str, prose: bool):
        self.line, self.text, self.prose = line, text, prose

    def line_of(self, offset: int) -> int:
        return self.line + self.text.count("\n", 0, offset)


def python_texts(path: Path) -> Iterator[Text]:
    source = path.read_text(encoding="utf-8")
    docstrings = {
        (node.lineno, node.col_offset)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield Text(tok.start[0], tok.string, prose=True)
        elif tok.type == tokenize.STRING:
            yield Text(tok.start[0], tok.string, prose=tok.start in docstrings)
        elif tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            yield Text(tok.start[0], tok.string, prose=False)


def yaml_texts(path: Path) -> Iterator[Text]:
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        yield Text(number, line, prose=True)


def sources() -> list[Path]:
    return sorted(p for p in SRC.rglob("*") if p.suffix in (".py", ".yaml", ".yml") and p.is_file())


@functools.cache
def texts(path: Path) -> tuple[Text, ...]:
    return tuple(python_texts(path) if path.suffix == ".py" else yaml_texts(path))


def known_commits(runs: set[str]) -> set[str]:
    """The runs that name a commit of this repository (none where git or the repository is not there)."""
    if not runs:
        return set()
    ordered = sorted(runs)
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "cat-file", "--batch-check"],
            input="".join(f"{run}^{{commit}}\n" for run in ordered),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return set()
    return {
        run
        for run, answer in zip(ordered, out, strict=False)
        if not answer.endswith("missing") and "ambiguous" not in answer
    }


def where(path: Path, line: int) -> str:
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return f"{name}:{line}"


def commit_findings(paths: list[Path]) -> list[str]:
    found: list[str] = []
    in_code: list[tuple[str, str, str]] = []  # (place, run, its string) for strings that are not prose
    for path in paths:
        for piece in texts(path):
            for offset, run in commit_like(piece.text):
                place = where(path, piece.line_of(offset))
                if piece.prose or "commit" in piece.text.lower():
                    found.append(f"{place}: commit id {run!r}")
                else:
                    in_code.append((place, run, piece.text))
    commits = known_commits({run for _, run, _ in in_code})
    found += [f"{place}: commit id {run!r}" for place, run, _ in in_code if run in commits]
    return found


def date_findings(paths: list[Path]) -> list[str]:
    return [
        f"{where(path, piece.line_of(offset))}: date {text!r}"
        for path in paths
        for piece in texts(path)
        if piece.prose
        for offset, text in dates(piece.text)
    ]


def test_src_names_no_commit() -> None:
    found = commit_findings(sources())
    assert not found, "commit ids in src/ (the commit message is their place):\n" + "\n".join(found)


def test_src_has_no_dates() -> None:
    found = date_findings(sources())
    assert not found, "dates in src/ comments, docstrings or YAML:\n" + "\n".join(found)


def test_rules_catch_history_and_spare_constants(tmp_path: Path) -> None:
    dirty = tmp_path / "dirty.py"
    dirty.write_text(
        '"""Timed on 2026-11-28 (sped up in 3f67ca4)."""\n'
        "X = 1  # measured at e9833a0\n"
        'Y = "before commit 0dba500"\n'
        "# figures of 28 November 2026\n"
    )
    commit_lines = [f.split(": ", 1)[0] for f in commit_findings([dirty])]
    assert commit_lines == [where(dirty, 1), where(dirty, 2), where(dirty, 3)]
    date_lines = [f.split(": ", 1)[0] for f in date_findings([dirty])]
    assert date_lines == [where(dirty, 1), where(dirty, 4)]

    clean = tmp_path / "clean.py"
    clean.write_text(
        '"""Hashing by 0x9e3779b97f4a7c15; ids like 123e4567-e89b-12d3-a456-426614174000; ALIGN (Jia et al. 2021)."""\n'
        'JUNK = ("a8f3c2e1d4b7", "1200000", "decaf00d" * 8)  # 20210701 seeds the textures, 1.2M steps\n'
        "# default 16384 pairs, cosine 0.975, sha256 "
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855\n"
    )
    assert commit_findings([clean]) == []
    assert date_findings([clean]) == []
