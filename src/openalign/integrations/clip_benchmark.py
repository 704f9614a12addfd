"""openalign models as CLIP_benchmark expects them: ``load_openalign`` returns ``(model, transform,
tokenizer)`` with the same contract as CLIP_benchmark's own loaders, so its metric functions
(``clip_benchmark.metrics.zeroshot_retrieval.evaluate``, ``zeroshot_classification.evaluate``,
``linear_probe.evaluate``) run on an openalign checkpoint unchanged::

    from clip_benchmark.metrics import zeroshot_retrieval
    from openalign.integrations.clip_benchmark import load_openalign

    model, transform, tokenizer = load_openalign("runs/nano/final")
    metrics = zeroshot_retrieval.evaluate(model, loader, tokenizer, device="cpu", amp=False)

CLIP_benchmark's tokenizers return one tensor of token ids; ALIGN's BERT tower also needs to know which
tokens are padding. The ids are padded with the vocabulary's ``[PAD]``, which no caption contains, so the
attention mask is recovered from the ids and the embeddings equal those of ``openalign.embed``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from openalign.model.dual_encoder import DualEncoder
    from openalign.text.tokenizer import Tokenizer


class ClipBenchmarkModel(nn.Module):
    """A dual encoder with CLIP's ``encode_image(pixels)`` and ``encode_text(token_ids)``."""

    def __init__(self, model: DualEncoder, pad_id: int):
        super().__init__()
        self.model = model
        self.pad_id = pad_id

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """L2-normalised image embeddings of transformed images [B, 3, H, W]."""
        return self.model.encode_image(pixels)

    def encode_text(self, token_ids: torch.Tensor) -> torch.Tensor:
        """L2-normalised text embeddings of ``ClipBenchmarkTokenizer`` output [B, L]."""
        return self.model.encode_text(token_ids, (token_ids != self.pad_id).long())


class ClipBenchmarkTokenizer:
    """Captions → a [N, max_length] tensor of token ids padded with ``[PAD]``, as CLIP tokenizers return."""

    def __init__(self, tokenizer: Tokenizer, max_length: int):
        self.tokenizer = tokenizer
        self.max_length = max_length

    def __call__(self, texts: str | list[str]) -> torch.Tensor:
        ids: torch.Tensor = self.tokenizer(texts, max_length=self.max_length)["input_ids"]
        return ids


def _load(path: str | Path, device: str | torch.device) -> tuple[DualEncoder, Callable[[Any], torch.Tensor], Tokenizer]:
    """The model in eval mode on ``device``, its eval transform and its tokenizer, loaded as
    ``openalign.create_model_and_transforms`` loads them (a directory or a hub id in the local cache)."""
    from openalign.model.hub import resolve
    from openalign.model.pretrained import create_model_and_transforms
    from openalign.text.tokenizer import load_tokenizer

    model, _, transform = create_model_and_transforms(path, device=device)
    tokenizer = load_tokenizer(resolve(path), max_length=model.config.text.max_length)
    return model, transform, tokenizer


def load_openalign(
    model_name: str,
    pretrained: str | None = None,
    cache_dir: str | None = None,
    device: str | torch.device = "cpu",
) -> tuple[ClipBenchmarkModel, Callable[[Any], torch.Tensor], ClipBenchmarkTokenizer]:
    """``(model, transform, tokenizer)`` for CLIP_benchmark from an openalign checkpoint, a transformers
    AlignModel directory or a hub id in the local cache: ``pretrained`` when it is a directory, else
    ``model_name``. ``cache_dir`` is
    accepted for the loader signature CLIP_benchmark calls and unused (nothing is downloaded)."""
    del cache_dir
    path = pretrained if pretrained and Path(pretrained).is_dir() else model_name
    model, transform, tokenizer = _load(path, device)
    max_length = min(tokenizer.max_length, model.config.text.max_position_embeddings)
    return ClipBenchmarkModel(model, tokenizer.pad_id), transform, ClipBenchmarkTokenizer(tokenizer, max_length)
