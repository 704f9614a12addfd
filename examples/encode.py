"""Encode an image and a few captions with a randomly initialised `nano` model (no download).

The model is untrained, so the similarities are meaningless: the example shows the API end to end.
"""

import numpy as np
import torch

import openalign
from openalign.text import train_wordpiece

captions = ["a red circle on green grass", "a blue square beside a circle", "an astronaut in a white suit"]
tokenizer = train_wordpiece(captions * 50, vocab_size=200)
model = openalign.create_model("nano", **{"text.vocab_size": tokenizer.vocab_size}).eval()

# A 64 × 64 gradient stands in for a photo; any RGB array in [0, 1] works the same way.
h = w = model.config.image_size
xx, yy = np.meshgrid(np.linspace(0, 1, w), np.linspace(0, 1, h))
rgb = np.stack([xx, yy, np.full((h, w), 0.5)])
pixels = torch.tensor(rgb, dtype=torch.float32)[None]
mean = torch.tensor(model.config.pixel_mean)[:, None, None]
std = torch.tensor(model.config.pixel_std)[:, None, None]
pixels = (pixels - mean) / std

tokens = tokenizer(captions)
with torch.no_grad():
    image_emb = model.encode_image(pixels)
    text_emb = model.encode_text(**tokens)
logits = image_emb @ text_emb.T / model.temperature
print(f"image embedding {tuple(image_emb.shape)}, text embeddings {tuple(text_emb.shape)}")
for caption, score in zip(captions, logits[0].tolist(), strict=True):
    print(f"{score:+.3f}  {caption}")
