from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import openalign
from openalign.config import merge


def tiny_overrides(**extra: object) -> dict[str, object]:
    """A dual encoder small enough to run a training step in milliseconds."""
    base: dict[str, object] = {
        "image": {"width_coefficient": 0.25, "depth_coefficient": 0.34, "drop_connect_rate": 0.2},
        "text": {"vocab_size": 101, "num_layers": 2, "hidden_size": 32, "num_heads": 4, "max_length": 16},
        "embed_dim": 24,
        "image_size": 32,
    }
    return merge(base, extra)


def save_tiny_checkpoint(out: Path, captions: list[str], *, vocab_size: int, **wordpiece: Any) -> Path:
    """A tiny model (seed 0) and a WordPiece vocabulary learnt from ``captions``, saved as a checkpoint in ``out``."""
    from openalign.text import train_wordpiece

    tokenizer = train_wordpiece(captions, vocab_size=vocab_size, **wordpiece)
    torch.manual_seed(0)
    model = openalign.create_model("nano", **tiny_overrides(text={"vocab_size": tokenizer.vocab_size}))
    openalign.save_model(model, out)
    tokenizer.save(out)
    return out


@pytest.fixture
def tiny_model() -> openalign.DualEncoder:
    torch.manual_seed(0)
    return openalign.create_model("nano", **tiny_overrides())


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local Spark session for every test that runs the Spark engine: a session takes ~14 s to start on two
    cores and its first job ~6 s more. The library's own sessions (``spark_session``) reuse the active one."""
    pytest.importorskip("pyspark")
    from openalign.data.filters.spark_engine import SparkSettings, spark_session

    session = spark_session(SparkSettings("local[2]", {"spark.sql.shuffle.partitions": "2"}))
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread for a test, then the old count back: on busy shared cores, intra-op threads of tiny
    models only wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Dynamo with no compiled code, recorded guard failures or counters, before the test and after it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


@pytest.fixture
def text_widths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The caption widths the text tower is called with, in order."""
    import openalign.model.bert as bert

    widths: list[int] = []
    forward = bert.Bert.forward

    def recorded(self: Any, ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        widths.append(ids.shape[1])
        return forward(self, ids, *args, **kwargs)

    monkeypatch.setattr(bert.Bert, "forward", recorded)
    return widths


def declare_accelerator(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Declares the device an accelerator (reading a value there waits for all queued work), so that training and
    the model take a GPU's paths on the CPU; returns the widths of the batches whose token values are read."""
    import openalign.model.bert as bert
    import openalign.model.captions as captions
    import openalign.model.dual_encoder as dual_encoder
    import openalign.train.towers as towers

    monkeypatch.setattr(towers, "reads_wait", lambda device: True)
    for module in (dual_encoder, bert, captions):
        monkeypatch.setattr(module, "host_readable", lambda t: False)
    checked: list[int] = []
    check = dual_encoder.DualEncoder.check_token_values

    def counted(self: Any, ids: torch.Tensor, mask: Any) -> Any:
        checked.append(ids.shape[1])
        return check(self, ids, mask)

    monkeypatch.setattr(dual_encoder.DualEncoder, "check_token_values", counted)
    return checked
