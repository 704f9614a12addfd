"""The ``openalign ...`` command lines of README.md, for the tests that parse them and the one that runs them."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _section(text: str, heading: str) -> str:
    """The README text under ``heading`` (e.g. "## The pipeline, ...") up to the next heading of its level or
    above; ``#`` lines inside code blocks are shell comments, not headings."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.splitlines()
    start = lines.index(heading) + 1  # ValueError if the heading is gone: the caller's test fails loudly
    fenced = False
    for end in range(start, len(lines)):
        if lines[end].startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(rf"#{{1,{level}}} ", lines[end]):
            return "\n".join(lines[start:end])
    return "\n".join(lines[start:])


def readme_lines(section: str | None = None) -> list[str]:
    """Every ``openalign ...`` command line of the README (of one section when ``section`` names its heading),
    continuation lines joined and trailing comments removed; lines with "..." placeholders are left out."""
    text = README.read_text()
    if section is not None:
        text = _section(text, section)
    lines, joined = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if joined:
            line = joined + " " + line
            joined = ""
        if line.endswith("\\"):
            joined = line[:-1].strip()
            continue
        if line.startswith("openalign ") and not line.startswith("openalign.") and "..." not in line:
            lines.append(re.sub(r"\s+#.*$", "", line))
    return lines
