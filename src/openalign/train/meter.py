"""Training's rate and its wait for data, by logged window and over the run."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

__all__ = ["Meter"]

T = TypeVar("T")


class Meter:
    """Pairs per second and the share of training time spent waiting for the next batch.

    A window runs from one logged step to the next; time between steps spent evaluating or checkpointing
    (``paused``) is left out of it, so the rate is training's, not the run's.
    """

    def __init__(self, global_batch: int, step: int) -> None:
        self.global_batch = global_batch
        self.trained_s = self.waited_s = 0.0  # over the run: the windows' time, and the part spent waiting
        self.start(step)

    def start(self, step: int) -> None:
        """Begin a window now, at ``step`` (after a compiling step, whose minutes are not training)."""
        self.tick, self.tick_step, self.waited = time.perf_counter(), step, 0.0

    def next(self, batches: Iterator[T]) -> T:
        """The next batch, its wait counted: the loop blocked on the stream, a device left without work."""
        asked = time.perf_counter()
        batch = next(batches)
        self.waited += time.perf_counter() - asked
        return batch

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside is left out of the window."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.tick += time.perf_counter() - began

    def window(self, step: int) -> dict[str, float]:
        """Close the window at ``step``: its ``pairs_per_s`` and ``data_wait`` (none for an empty window), and
        begin the next. A data wait above a few percent on a GPU says the workers do not keep up."""
        now = time.perf_counter()
        out = {}
        if step > self.tick_step:
            seconds = max(now - self.tick, 1e-9)
            out = {
                "pairs_per_s": self.global_batch * (step - self.tick_step) / seconds,
                "data_wait": min(self.waited / seconds, 1.0),
            }
            self.trained_s += now - self.tick
            self.waited_s += self.waited
        self.tick, self.tick_step, self.waited = now, step, 0.0
        return out

    def data_wait_share(self) -> float | None:
        """The share of the run's training time spent waiting for data; None before a window closed."""
        return self.waited_s / self.trained_s if self.trained_s > 0 else None
