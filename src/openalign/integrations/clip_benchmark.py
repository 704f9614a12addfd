"""openalign models as CLIP_benchmark expects them: ``load_openalign`` returns ``(model, transform,
tokenizer)`` with the same contract as CLIP_benchmark's own loaders, so its metric functions
(``clip_benchmark.metrics.zeroshot_retrieval.evaluate``, ``zeroshot_classification.evaluate``,
``linear_probe.evaluate``) run on an openalign checkpoint unchanged::

    from clip_benchmark.metrics import zeroshot_retrieval
    from openalign.integrations.clip_benchmark import load_openalign

    model, transform, tokenizer = load_openalign("runs/nano/final")
    metrics = zeroshot_retrieval.evaluate(model, loader, tokenizer, device="cpu", amp=False)

CLIP_benchmark's tokenizers return one tensor of token ids; ALIGN's BERT tower also needs to know which
tokens are padding. The ids are padded with the vocabulary's ``[PAD]``, which no caption contains, and a
dual encoder's ``encode_text(ids)`` recovers the mask from them, so the model and ``openalign.get_tokenizer``
already have CLIP's contract and the embeddings equal those of ``openalign.embed``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from openalign.model.dual_encoder import DualEncoder
    from openalign.text.tokenizer import IdTokenizer


def load_openalign(
    model_name: str,
    pretrained: str | None = None,
    cache_dir: str | None = None,
    device: str | torch.device = "cpu",
) -> tuple[DualEncoder, Callable[[Any], torch.Tensor], IdTokenizer]:
    """``(model, transform, tokenizer)`` for CLIP_benchmark from an openalign checkpoint, a transformers
    AlignModel directory or a hub id in the local cache: ``pretrained`` when it is a directory, else
    ``model_name``. ``cache_dir`` is accepted for the loader signature CLIP_benchmark calls and unused
    (nothing is downloaded)."""
    from openalign.model.pretrained import create_model_and_transforms, get_tokenizer

    del cache_dir
    path = pretrained if pretrained and Path(pretrained).is_dir() else model_name
    model, _, transform = create_model_and_transforms(path, device=device)
    return model, transform, get_tokenizer(path)
