"""Where a command writes: checked before the work starts, written whole or not at all.

A long job must not run for an hour and then fail on an output it could never write, and a failure must
not leave half a file under the name a later stage reads. So outputs are checked up front
(:func:`check_writable`), written to a hidden temporary name in their own folder and renamed into place
(:func:`atomic_write_text`), and an output that is, or holds, one of the command's inputs is refused
(:func:`refuse_input_as_output`) even with ``--overwrite``: it would be replaced while being read.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path


class OutputError(ValueError):
    """An output that cannot be written; the message names it and says why."""


def check_writable(path: str | os.PathLike[str], *, what: str = "output", directory: bool = False) -> None:
    """Raise :class:`OutputError` unless ``path`` (a file, or a folder when ``directory``) can be created.

    The nearest existing ancestor must be a writable folder, and an output must not be of the other kind.
    Writability is tried with a probe file, since permission bits say nothing for root or a read-only mount."""
    target = Path(path)
    if directory and target.exists() and not target.is_dir():
        raise OutputError(f"{what} {target} exists and is not a directory")
    if not directory and target.is_dir():
        raise OutputError(f"{what} {target} is a directory")
    folder = target if directory else target.parent
    if not directory and not folder.exists():  # a file's folder is not made for it
        raise OutputError(f"{what} {target}: no such directory {folder}")
    while not folder.exists():
        if folder.is_symlink() or folder == folder.parent:
            raise OutputError(f"{what} {target}: cannot create {folder}")
        folder = folder.parent
    if not folder.is_dir():
        raise OutputError(f"{what} {target}: {folder} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".openalign-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise OutputError(f"{what} {target}: cannot write in {folder} ({err.strerror or err})") from None


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to a temporary name beside ``path`` and rename it into place; nothing is left on error."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _within(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def refuse_input_as_output(output: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str]]) -> None:
    """Raise :class:`OutputError` when ``output`` is one of ``inputs`` or a folder holding one of them."""
    out = Path(output).resolve()
    for item in inputs:
        source = Path(item)
        if not source.exists():
            continue
        if _within(source.resolve(), out):
            raise OutputError(f"output {output} is, or holds, the input {item}; write it elsewhere")
