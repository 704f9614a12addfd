"""Batches recorded once and replayed: runs that draw the same batch sequence (a sweep over model or loss
settings with one data config and seed) decode, augment and tokenise it only once.

The first run of a sequence writes each batch it trains on into ``root/<key>.tmp-<pid>/`` and, after
``steps`` batches, publishes the folder as ``root/<key>/`` in one rename. Later runs read it back: the same
tensors, so the same training, without the data work. A sequence is keyed by everything that decides it
(``sequence_key``); a folder is used only once complete, so concurrent recorders and interrupted ones are
harmless. Past the recorded steps, and for a run that resumes mid-way into an unrecorded sequence, the real
stream takes over at the same position.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from openalign.train.data import DataConfig, TrainStream, build_train_stream, image_options

if TYPE_CHECKING:
    from openalign.config import ModelConfig
    from openalign.text.tokenizer import TextTokenizer

# Settings that change how batches are produced, never which.
_EXECUTION = ("workers", "piece_size", "prefetch_gb", "pin_memory", "cache_mb")
_BATCH = "{:07d}.pt"


def sequence_key(cfg: DataConfig, seed: int, model_config: ModelConfig | None, steps: int) -> str:
    """A name for the first ``steps`` batches of the single-process stream of ``cfg`` and ``seed``."""
    data = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _EXECUTION}
    fields = [data, seed, image_options(cfg, model_config), steps]
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:20]


class CachedStream:
    """``TrainStream``'s interface over a recording of its first ``steps`` batches."""

    def __init__(self, stream: TrainStream, root: Path, key: str, steps: int):
        if stream.global_batch_size != stream.batch_size:
            raise ValueError("a recorded batch sequence is one process's; this stream is one rank of several")
        self.stream, self.steps = stream, steps
        self.folder = Path(root) / key

    @property
    def batch_size(self) -> int:
        return self.stream.batch_size

    @property
    def global_batch_size(self) -> int:
        return self.stream.global_batch_size

    @property
    def epoch_length(self) -> int | None:
        return self.stream.epoch_length

    @property
    def pixels(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return self.stream.pixels

    @property
    def stats(self) -> Counter[str]:
        return self.stream.stats

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)

    @property
    def recorded(self) -> bool:
        return self.folder.is_dir()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.recorded:
            yield from self._replay()
        elif self.stream.position == 0:
            yield from self._record()
        yield from self.stream

    def _replay(self) -> Iterator[dict[str, torch.Tensor]]:
        while (step := self.stream.position // self.batch_size) < self.steps:
            saved = torch.load(self.folder / _BATCH.format(step), weights_only=True)
            self.stream.position += self.batch_size
            self.stream.stats = Counter({k: int(v) for k, v in saved.pop("skipped").items()})
            yield saved

    def _record(self) -> Iterator[dict[str, torch.Tensor]]:
        tmp = self.folder.with_name(f"{self.folder.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            for step, batch in zip(range(self.steps), self.stream, strict=False):
                torch.save({**batch, "skipped": dict(self.stream.stats)}, tmp / _BATCH.format(step))
                if step + 1 == self.steps:
                    # Published before the last batch is handed out: a run stops asking after its last step.
                    with contextlib.suppress(OSError):  # another run published the same sequence first
                        os.rename(tmp, self.folder)
                yield batch
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def cached_stream_factory(root: Path, steps: int) -> Any:
    """A ``stream_factory`` for ``openalign.train.loop.train`` that records to / replays from ``root``."""

    def make(cfg: DataConfig, tokenizer: TextTokenizer | None = None, **where: Any) -> CachedStream:
        # ``where``: rank, world_size, seed and model_config, as ``build_train_stream`` takes them.
        stream = build_train_stream(cfg, tokenizer, **where)
        key = sequence_key(cfg, where.get("seed", 0), where.get("model_config"), steps)
        return CachedStream(stream, root, key, steps)

    return make
