"""The type checker CI runs catches a wrong attribute on the stage results and the protocols."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import openalign

pytest.importorskip("mypy")

SRC = Path(openalign.__file__).resolve().parent.parent
CONFIG = SRC.parent / "pyproject.toml"

USES = """\
from openalign.data.shards import ShardResult
from openalign.eval.retrieval import RetrievalSet
from openalign.search.build import IndexBuildResult
from openalign.text.tokenizer import TextTokenizer


def fine(shards: ShardResult, index: IndexBuildResult, tok: TextTokenizer, data: RetrievalSet) -> int:
    ids = tok(["a cat"], max_length=tok.max_length)["input_ids"]
    return shards.successes + index.added_images + tok.vocab_size + len(data.captions) + ids.shape[1]


def wrong(shards: ShardResult, index: IndexBuildResult, tok: TextTokenizer, data: RetrievalSet) -> None:
    shards.no_such_field  # line 13
    index.image_count  # line 14
    tok.encode_batch(["a cat"])  # line 15
    data.image_ids  # line 16
"""


def test_the_checker_finds_wrong_attributes_and_only_those(tmp_path: Path) -> None:
    (tmp_path / "uses.py").write_text(USES)
    # A cache that outlives the test keeps reruns to a second; the first run analyses torch's stubs.
    cache = Path(tempfile.gettempdir()) / "openalign-mypy-cache"
    args = [sys.executable, "-m", "mypy", "--cache-dir", str(cache), "--no-error-summary", "--show-error-codes"]
    if CONFIG.is_file():
        args += ["--config-file", str(CONFIG)]
    env = {**os.environ, "MYPYPATH": str(SRC)}
    proc = subprocess.run([*args, str(tmp_path / "uses.py")], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    flagged = {int(line.split(":")[1]) for line in errors}
    assert flagged == {13, 14, 15, 16}, proc.stdout
    assert all("[attr-defined]" in line for line in errors), proc.stdout
    assert '"ShardResult" has no attribute "no_such_field"' in proc.stdout
