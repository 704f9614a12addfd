"""Zero-shot image tags for CC12M's image-text filter, with an ALIGN checkpoint in place of Cloud Vision.

CC3M (whose image-text filter CC12M keeps) asked Google Cloud Vision for each image's labels and kept a
pair only when the alt-text mentioned enough of them. Here the labels come from zero-shot classification
with any openalign checkpoint or transformers ``AlignModel`` directory over a tag vocabulary (a text file,
one tag per line): each tag is embedded through the prompt templates (averaged, as in zero-shot
evaluation), each image through the image tower, and an image's tags are its ``top_k`` best-scoring ones.

:class:`ZeroShotTagger` is the ``ImageTagger`` the filter takes (encoded images in, tags out); the overlap
rule itself lives with the other rules in ``openalign.data.filters``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from openalign.data.sources import BadInput, read_file

TEMPLATES = ("a photo of a {}.", "a photo of the {}.", "{}")


def read_tag_vocab(path: str | Path) -> list[str]:
    """Tags, one per line (blank lines and ``#`` comments skipped, duplicates dropped); at least one."""
    text = read_file(path).decode("utf-8")
    tags = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    tags = list(dict.fromkeys(tags))
    if not tags:
        raise ValueError(f"{path}: no tags (one tag per line)")
    return tags


class ZeroShotTagger:
    """Encoded images -> their ``top_k`` tags, best first; an image that does not decode gets None."""

    def __init__(
        self,
        checkpoint: str | Path,
        tags: Sequence[str],
        top_k: int = 5,
        *,
        templates: Sequence[str] = TEMPLATES,
        batch_size: int = 32,
        device: str = "cpu",
    ) -> None:
        from openalign.eval.suite import load_checkpoint
        from openalign.eval.zeroshot import zeroshot_classifier

        if top_k < 1:
            raise ValueError(f"--tag-top-k must be at least 1, got {top_k}")
        if not tags:
            raise ValueError("the tag vocabulary is empty")
        self.model, tokenizer = load_checkpoint(checkpoint)
        self.model.to(device)
        self.tags = list(tags)
        self.top_k = min(top_k, len(self.tags))
        self.batch_size = batch_size
        self.device = device
        self.classifier = zeroshot_classifier(self.model, tokenizer, self.tags, templates, device=device)

    @classmethod
    def from_files(cls, checkpoint: str, vocab: str | None, top_k: int) -> ZeroShotTagger:
        if vocab is None:
            raise ValueError("--tagger needs --tag-vocab FILE (the tags to choose from, one per line)")
        return cls(checkpoint, read_tag_vocab(vocab), top_k)

    def scores(self, images: Sequence[bytes | None]) -> tuple[torch.Tensor, list[int]]:
        """Image-tag cosine similarities [N, tags] for the images that decode, and their positions."""
        from openalign.data.transforms import decode_image
        from openalign.embed import embed_images

        decoded, where = [], []
        for i, data in enumerate(images):
            if data is None:
                continue
            try:
                decoded.append(decode_image(data))
                where.append(i)
            except BadInput:
                continue
        emb = embed_images(self.model, decoded, batch_size=self.batch_size, device=self.device)
        return emb @ self.classifier.T, where

    def __call__(self, images: Sequence[bytes | None]) -> list[list[str] | None]:
        scores, where = self.scores(images)
        out: list[list[str] | None] = [None] * len(images)
        if where:
            best = scores.topk(self.top_k, dim=1).indices.tolist()
            for i, row in zip(where, best, strict=True):
                out[i] = [self.tags[j] for j in row]
        return out
