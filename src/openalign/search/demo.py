"""A ready-to-serve demo: an index over the synthetic world's held-out scenes and their captions.

Without a checkpoint the model is a randomly initialised ``nano`` dual encoder with a WordPiece vocabulary
learned from synthetic captions, so the page and the API work end to end on a fresh install; pass a
trained checkpoint to get meaningful rankings.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from openalign.search.build import BuildConfig, build_index

if TYPE_CHECKING:
    from openalign.model.dual_encoder import DualEncoder
    from openalign.text.tokenizer import Tokenizer


def default_demo_dir(n_images: int, seed: int, model: str | None) -> Path:
    """Where ``openalign serve`` keeps its demo index between runs."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "openalign"
    tag = "nano" if model is None else Path(model).resolve().name
    return cache / f"demo-index-{tag}-{n_images}-{seed}"


def demo_model(out: Path, seed: int = 0) -> tuple[DualEncoder, Tokenizer, Path]:
    """A ``nano`` model with a tokenizer trained on synthetic captions, saved under ``out``."""
    import openalign
    from openalign.data.synthetic import SyntheticWorld
    from openalign.text import train_wordpiece

    # Rows carry their captions without rendering the images, which the vocabulary does not need.
    captions = [row.caption for row in SyntheticWorld(seed + 1).iter_rows(2000)]
    tokenizer = train_wordpiece(captions, vocab_size=2000, min_frequency=1)
    torch.manual_seed(seed)
    model = openalign.create_model("nano", text={"vocab_size": tokenizer.vocab_size})
    tokenizer.max_length = model.config.text.max_length
    openalign.save_model(model, out)
    tokenizer.save(out)
    return model.eval(), tokenizer, out


def build_demo_index(
    out: str | Path,
    *,
    model_path: str | Path | None = None,
    n_images: int = 500,
    seed: int = 0,
    progress: bool = True,
) -> Path:
    """Write the synthetic retrieval scenes (PNG + caption files) in ``out/images`` and index them with
    captions in ``out/index`` (beside the images, since an index may not hold its input); returns the index."""
    import openalign
    from openalign.data.synthetic import SyntheticWorld

    out = Path(out)
    index = out / "index"
    if (index / "index.json").is_file():
        return index
    if n_images < 1:
        raise ValueError(f"n_images must be positive, got {n_images}")
    images_dir = out / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    if model_path is None:
        model, tokenizer, model_dir = demo_model(out / "model", seed)
    else:
        model_dir = Path(model_path).resolve()
        model = openalign.load_model(model_dir)
        tokenizer = openalign.load_tokenizer(model_dir, max_length=model.config.text.max_length)
    world = SyntheticWorld(seed, image_size=max(64, model.config.image_size))
    for i in range(n_images):
        png = images_dir / f"{i:05d}.png"
        if png.is_file():
            continue
        scene, captions = world.retrieval_item(i, 1)
        png.with_suffix(".txt").write_text(captions[0] + "\n")
        tmp = png.with_name(png.stem + ".tmp.png")
        world.render(scene).save(tmp)
        tmp.replace(png)
    build_index(
        model,
        tokenizer,
        images_dir,
        index,
        BuildConfig(captions=True, chunk_size=256),
        model_path=str(model_dir),
        tokenizer_path=str(model_dir),
        progress=progress,
    )
    return index
