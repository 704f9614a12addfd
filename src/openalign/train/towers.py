"""How training runs the model's towers: compiled or eager, the image tower in bf16, captions cut on the host.

The model itself computes embeddings of the tensors it is given. What makes a training step fast is decided
here, once per run: ``Towers`` compiles the towers (one graph per tower and grad mode), runs the image tower
under autocast while the model trains (``train.precision: bf16-image``), and measures every chunk's captions on
the host, where reading them costs no wait, so that the text tower reads no padding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from openalign.model.captions import bucket_widths, length_buckets
from openalign.model.dual_encoder import DualEncoder

__all__ = ["ChunkCaptions", "Towers", "caption_widths", "compile_towers", "eager_towers", "reads_wait"]

Batch = dict[str, torch.Tensor]


def reads_wait(device: torch.device) -> bool:
    """Whether the host reading a tensor's values on ``device`` waits for the work queued there (an accelerator's:
    a synchronisation) rather than reading memory it already holds (the CPU's)."""
    return device.type != "cpu"


@dataclass(frozen=True)
class ChunkCaptions:
    """How one chunk's captions reach the text tower: cut to ``width`` columns, and ``groups`` (row indices,
    width) encoded apart, or None."""

    width: int
    groups: list[tuple[torch.Tensor, int]] | None = None


def caption_widths(batch: Batch, chunk_size: int | None = None, floor: int = 2) -> list[int] | None:
    """Each chunk's caption width in a batch still on the host: the columns its ``chunk_size`` rows (default: the
    whole batch) attend to, at least ``floor`` (a compiled text tower takes any width from two up). None without
    a mask. The batch itself moves whole and is cut on the device by views, as a cut host tensor is no longer
    contiguous and would move through a pageable copy."""
    mask = batch.get("attention_mask")
    if mask is None:
        return None
    n, columns = mask.shape
    size = chunk_size or n
    # The last attended column of each row, then the largest of each chunk: one pass, one read of n numbers.
    last = (mask.ne(0) * torch.arange(1, columns + 1, device=mask.device)).amax(1).tolist()
    least = min(floor, columns)
    return [max(max(last[i : i + size]), least) for i in range(0, n, size)]


class Towers:
    """The towers of ``model`` as one training run calls them.

    ``compiled``: ``torch.compile`` both towers (``mode`` is its mode). ``image_dtype``: the image tower computes
    under autocast to it while the model trains. Short captions are encoded apart from long ones
    (``length_buckets``) only eager on a CPU, where arithmetic is the cost and lengths are free to read, and not
    under FSDP (``sharded``), whose ranks must run the text tower the same number of times.
    """

    def __init__(
        self,
        model: DualEncoder,
        *,
        device: torch.device,
        compiled: bool = False,
        mode: str = "default",
        image_dtype: torch.dtype | None = None,
        sharded: bool = False,
    ) -> None:
        self.model = model
        self.compiled = compiled
        self.buckets = not (compiled or sharded or reads_wait(device))
        if compiled:
            compile_towers(model, **({} if mode == "default" else {"mode": mode}))
        if image_dtype is not None:
            autocast_image(model, image_dtype)

    def captions(self, batch: Batch, chunk_size: int | None = None) -> list[ChunkCaptions] | None:
        """Check a host batch's tokens and say how each chunk's captions reach the text tower; None without a
        mask (the captions are then taken whole)."""
        mask = batch.get("attention_mask")
        self.model.check_token_values(batch["input_ids"], mask)
        widths = caption_widths(batch, chunk_size, floor=2 if self.compiled else 1)
        if mask is None or widths is None:
            return None
        size = chunk_size or mask.shape[0]
        out = []
        for i, width in enumerate(widths):
            rows = mask[i * size : (i + 1) * size]
            groups = length_buckets(rows) if self.buckets else None
            out.append(ChunkCaptions(width, bucket_widths(rows, groups)))
        return out


@contextmanager
def eager_towers() -> Iterator[None]:
    """Inside, compiled towers run uncompiled: for occasional calls whose shapes or modes differ from training's
    (in-training evaluation), which would otherwise compile graphs of their own."""
    with torch.compiler.set_stance("force_eager"):
        yield


def compile_towers(model: DualEncoder, **options: Any) -> None:
    """``torch.compile`` both towers, each as one graph (``fullgraph=True``: a graph break is an error) per grad
    mode, so that gradient caching's no-graph pass and its graph pass each compile once. The text tower's graph
    takes any caption width from two columns up. ``options`` go to ``torch.compile`` (``backend``, ``mode``)."""

    def compiled(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return torch.compile(fn, fullgraph=True, **options)

    _set_forward(model.image, _CompiledTower(model.image, compiled(_image_with_graph), compiled(_image_without_graph)))
    _set_forward(model.text, _CompiledText(model.text, compiled(_text_with_graph), compiled(_text_without_graph)))


def autocast_image(model: DualEncoder, dtype: torch.dtype) -> None:
    """Run the image tower under autocast to ``dtype`` while ``model`` trains (its backward follows), its output
    back in float32; the projection, the text tower, evaluation and serving keep the weights' precision."""
    _set_forward(model.image, _AutocastTower(model, model.image.forward, dtype))


def _set_forward(tower: nn.Module, forward: Callable[..., torch.Tensor]) -> None:
    """Make ``forward`` what calling ``tower`` runs, its hooks kept: an instance attribute, as the weights (and
    so the checkpoints' names) stay the tower's own."""
    object.__setattr__(tower, "forward", forward)


class _AutocastTower:
    def __init__(self, model: nn.Module, forward: Callable[..., torch.Tensor], dtype: torch.dtype) -> None:
        self.model, self.forward, self.dtype = model, forward, dtype

    def __call__(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if not self.model.training:
            return self.forward(pixel_values)
        with torch.autocast(pixel_values.device.type, dtype=self.dtype):
            x = self.forward(pixel_values)
        return x.float()


class _CompiledTower:
    """A tower's forward as its compiled function for the grad mode it is called in."""

    def __init__(self, tower: nn.Module, with_graph: Callable[..., Any], without_graph: Callable[..., Any]) -> None:
        self.tower, self.functions = tower, {True: with_graph, False: without_graph}

    def __call__(self, *inputs: Any) -> torch.Tensor:
        out: torch.Tensor = self.functions[torch.is_grad_enabled()](self.tower, *inputs)
        return out


class _CompiledText(_CompiledTower):
    def __call__(self, input_ids: torch.Tensor, mask: torch.Tensor | None = None, buckets: Any = None) -> torch.Tensor:
        """The compiled text tower on captions of any width: the width is marked a symbol before the first call
        compiles, so that one graph serves the widths; widths 0 and 1 stay fixed, as Dynamo specialises them.
        The mark promises nothing (``maybe_mark_dynamic``), so a backend may still narrow the widths it compiles.
        """
        if buckets is not None:
            raise ValueError("a compiled text tower takes its captions whole, without length buckets")
        # Dynamo guards on a tensor's row stride and storage offset: captions that are views (cut below their
        # padded width, or a chunk rows into the batch) are copied so that every call looks the same.
        input_ids = _own_storage(input_ids)
        mask = _own_storage(mask) if mask is not None else None
        for t in (input_ids, mask):
            if t is not None and t.shape[1] >= 2:
                torch._dynamo.maybe_mark_dynamic(t, 1)
        return super().__call__(input_ids, mask)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous at the start of its storage: itself if it is, else a copy."""
    return t if t.is_contiguous() and t.storage_offset() == 0 else t.clone(memory_format=torch.contiguous_format)


# The compiled towers' entry points, one per tower and grad mode: Dynamo keeps its graphs per code object, guarded
# on grad mode, so one function called with and without a graph would compile twice. The tower is an argument so
# that a copy of the model calls its own weights; its class's forward is called, as its own is this wrapper.
def _image_with_graph(tower: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    return type(tower).forward(tower, pixel_values)  # type: ignore[no-any-return]


def _image_without_graph(tower: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    return type(tower).forward(tower, pixel_values)  # type: ignore[no-any-return]


def _text_with_graph(tower: nn.Module, input_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return type(tower).forward(tower, input_ids, mask)  # type: ignore[no-any-return]


def _text_without_graph(tower: nn.Module, input_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return type(tower).forward(tower, input_ids, mask)  # type: ignore[no-any-return]
