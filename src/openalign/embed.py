"""Batched embedding of images and captions with any dual encoder: the one path evaluation, search and
deduplication share, so an embedding means the same thing everywhere."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from PIL import Image
from tqdm import tqdm

from openalign.data.sources import batched
from openalign.data.transforms import model_transform
from openalign.model.dual_encoder import DualEncoder

if TYPE_CHECKING:
    from openalign.text.tokenizer import TextTokenizer


def _check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")


@torch.no_grad()
def embed_images(
    model: DualEncoder,
    images: Iterable[Image.Image | torch.Tensor],
    *,
    batch_size: int = 64,
    transform: Callable[[Image.Image], torch.Tensor] | None = None,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> torch.Tensor:
    """L2-normalised image embeddings [N, D] (float32, CPU), in input order.

    ``images`` are PIL images (run through ``transform``, by default the model's eval transform) or
    tensors [3, H, W] that are already transformed.
    """
    _check_batch_size(batch_size)
    transform = transform or model_transform(model.config, train=False)
    was_training = model.training
    model.eval()
    total = len(images) if isinstance(images, Sequence) else None
    out: list[torch.Tensor] = []
    try:
        with tqdm(total=total, unit="img", desc="embed images", disable=not progress) as bar:
            for batch in batched(images, batch_size):
                pixels = torch.stack([x if isinstance(x, torch.Tensor) else transform(x) for x in batch])
                out.append(model.encode_image(pixels.to(device)).float().cpu())
                bar.update(len(batch))
    finally:
        model.train(was_training)
    if not out:
        return torch.empty(0, model.embed_dim)
    return torch.cat(out)


@torch.no_grad()
def embed_texts(
    model: DualEncoder,
    tokenizer: TextTokenizer,
    texts: Iterable[str],
    *,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> torch.Tensor:
    """L2-normalised caption embeddings [N, D] (float32, CPU), in input order.

    Each batch is padded only to its longest caption; padding is masked, so the result equals padding
    to the full 64 tokens.
    """
    _check_batch_size(batch_size)
    was_training = model.training
    model.eval()
    total = len(texts) if isinstance(texts, Sequence) else None
    out: list[torch.Tensor] = []
    max_length = min(getattr(tokenizer, "max_length", 64), model.config.text.max_position_embeddings)
    try:
        with tqdm(total=total, unit="text", desc="embed texts", disable=not progress) as bar:
            for batch in batched(texts, batch_size):
                tokens = tokenizer(list(batch), max_length=max_length, pad_to_max=False)
                emb = model.encode_text(tokens["input_ids"].to(device), tokens["attention_mask"].to(device))
                out.append(emb.float().cpu())
                bar.update(len(batch))
    finally:
        model.train(was_training)
    if not out:
        return torch.empty(0, model.embed_dim)
    return torch.cat(out)
