from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from openalign.data.synthetic import SyntheticWorld
from openalign.text import train_wordpiece
from openalign.train.batch_cache import CachedStream, cached_stream_factory, sequence_key
from openalign.train.config import from_dict
from openalign.train.data import DataConfig, build_train_stream

STEPS = 3


@pytest.fixture(scope="module")
def tokenizer():
    return train_wordpiece((row.caption for row in SyntheticWorld(5, 32).iter_rows(500)), vocab_size=400)


def data(**kw: object) -> DataConfig:
    fields = {"source": "synthetic", "image_size": 16, "resize": 20, "max_text_length": 32, "workers": 0}
    return from_dict(DataConfig, {**fields, "batch_size": 4, **kw})


def take(stream: object, n: int) -> list[dict[str, torch.Tensor]]:
    return list(itertools.islice(iter(stream), n))  # type: ignore[call-overload]


def same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    if len(a) != len(b):
        return False
    return all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b, strict=True))


def test_a_recorded_sequence_replays_the_same_batches_and_goes_on_past_its_end(tmp_path: Path, tokenizer) -> None:
    cfg = data()
    plain = take(build_train_stream(cfg, tokenizer, seed=5), STEPS + 2)
    make = cached_stream_factory(tmp_path, STEPS)

    first = make(cfg, tokenizer, seed=5)
    assert not first.recorded
    recorded = take(first, STEPS)  # a run of STEPS steps asks for exactly STEPS batches
    assert first.recorded and len(list(first.folder.iterdir())) == STEPS
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # the working copy was published whole
    assert same(recorded, plain[:STEPS])

    second = make(cfg, tokenizer, seed=5)
    replayed = take(second, STEPS + 2)  # past the recording, the real stream at the same position
    assert same(replayed, plain)
    assert second.state_dict()["position"] == (STEPS + 2) * 4

    # A resumed run replays from its position, and its state is the plain stream's.
    resumed = make(cfg, tokenizer, seed=5)
    resumed.load_state_dict(first.state_dict())
    assert resumed.state_dict() == first.state_dict()
    resumed.load_state_dict({**first.state_dict(), "position": 4})
    assert same(take(resumed, 2), plain[1:3])


def test_only_the_same_sequence_is_replayed(tmp_path: Path, tokenizer) -> None:
    cfg = data()
    take(cached_stream_factory(tmp_path, STEPS)(cfg, tokenizer, seed=5), STEPS)
    key = sequence_key(cfg, 5, None, STEPS)
    assert (tmp_path / key).is_dir()
    # Another seed, data setting or length of run is another sequence; how batches are produced is not.
    assert sequence_key(cfg, 6, None, STEPS) != key
    assert sequence_key(data(synthetic={"noise": 0.0}), 5, None, STEPS) != key
    assert sequence_key(cfg, 5, None, STEPS + 1) != key
    assert sequence_key(data(workers=2, piece_size=3, prefetch_gb=1.0), 5, None, STEPS) == key
    other = cached_stream_factory(tmp_path, STEPS)(cfg, tokenizer, seed=6)
    assert not other.recorded
    assert same(take(other, 2), take(build_train_stream(cfg, tokenizer, seed=6), 2))


def test_unfinished_recordings_are_never_read(tmp_path: Path, tokenizer) -> None:
    cfg = data()
    make = cached_stream_factory(tmp_path, STEPS)
    stopped = make(cfg, tokenizer, seed=5)
    batches = iter(stopped)
    next(batches)
    batches.close()  # a run that stopped after one step
    assert not stopped.recorded and not list(tmp_path.iterdir())
    # A run that resumes mid-way into an unrecorded sequence trains on the real stream and records nothing.
    resumed = make(cfg, tokenizer, seed=5)
    resumed.load_state_dict({**resumed.state_dict(), "position": 4})
    assert same(take(resumed, STEPS), take(build_train_stream(cfg, tokenizer, seed=5), STEPS + 1)[1:])
    assert not resumed.recorded


def test_a_rank_of_several_is_refused(tmp_path: Path, tokenizer) -> None:
    stream = build_train_stream(data(), tokenizer, rank=0, world_size=2, seed=5)
    with pytest.raises(ValueError, match="one rank of several"):
        CachedStream(stream, tmp_path, "key", STEPS)
