from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import openalign
from openalign.data.transforms import model_transform
from openalign.embed import embed_images, embed_texts
from openalign.text import train_wordpiece


def test_embed_images_matches_one_batch(tiny_model: openalign.DualEncoder) -> None:
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (40, 36, 3), dtype=np.uint8), "RGB") for _ in range(7)]
    tiny_model.train()
    out = embed_images(tiny_model, images, batch_size=3)
    assert tiny_model.training  # mode restored
    tiny_model.eval()
    t = model_transform(tiny_model.config)
    with torch.no_grad():
        ref = tiny_model.encode_image(torch.stack([t(im) for im in images]))
    assert out.shape == (7, tiny_model.embed_dim) and out.dtype == torch.float32
    assert torch.allclose(out, ref, atol=1e-5)
    pre = embed_images(tiny_model, [t(im) for im in images], batch_size=4)
    assert torch.allclose(pre, ref, atol=1e-5)
    assert embed_images(tiny_model, []).shape == (0, tiny_model.embed_dim)


def test_embed_texts_padding_invariant(tiny_model: openalign.DualEncoder) -> None:
    texts = ["a red circle", "two blue squares on sand beside a green star", "grass", "a ring"]
    tok = train_wordpiece(texts * 20, vocab_size=101, min_frequency=1)
    tok.max_length = 16
    out = embed_texts(tiny_model, tok, texts, batch_size=3)
    tiny_model.eval()
    with torch.no_grad():
        ref = tiny_model.encode_text(**tok(texts, max_length=16))
    assert torch.allclose(out, ref, atol=1e-5)
    assert torch.allclose(out.norm(dim=1), torch.ones(4), atol=1e-5)
    with pytest.raises(ValueError):
        embed_texts(tiny_model, tok, texts, batch_size=0)
