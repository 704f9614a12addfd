"""End to end at CI size: `nano` trained from WebDataset shards of the synthetic noisy world learns.

The real path a user takes: noisy (image, alt-text) pairs written as img2dataset-style shards, a WordPiece
vocabulary learnt from their captions, `openalign train` on the shards with the packaged `nano_cpu` recipe,
then zero-shot retrieval on held-out scenes that were never trained on. A model that learnt nothing scores
chance (R@K = K / images); a broken loss, tokenizer, pixel pipeline or eval-mode batch norm lands there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import openalign
from openalign.data.shards import write_shards
from openalign.data.synthetic import SyntheticWorld, retrieval_set
from openalign.eval.retrieval import RetrievalSet, evaluate_retrieval
from openalign.text import load_tokenizer, train_wordpiece
from openalign.train.config import load_train_config
from openalign.train.loop import train

PAIRS = 4096  # distinct training pairs, a quarter of them alt-text noise; seen ~1.5 times
STEPS = 50  # held-out t2i R@1 20 % and i2t R@10 64 % on two AVX2 cores, where 4 % and 30 % are asked
BATCH = 128
EVAL_IMAGES = 100


@pytest.mark.slow
def test_nano_learns_the_synthetic_world_from_shards(tmp_path: Path) -> None:
    world = SyntheticWorld(seed=1, image_size=64)
    rows = list(world.iter_rows(PAIRS, noise=0.25))
    samples = ({"key": f"{i:06d}", "jpg": world.render(row.scene), "txt": row.caption} for i, row in enumerate(rows))
    write_shards(samples, tmp_path / "shards", samples_per_shard=1024)
    train_wordpiece((row.caption for row in rows), vocab_size=2048).save(tmp_path / "vocab")

    cfg = load_train_config(
        "nano_cpu",
        {
            "data": {
                "source": "shards",
                "shards": str(tmp_path / "shards"),
                "tokenizer": str(tmp_path / "vocab"),
                "batch_size": BATCH,
                "workers": 1,
                "shuffle_buffer": 2048,
            },
            "optim": {"warmup_steps": 20, "total_steps": STEPS},
            "train": {"run_dir": str(tmp_path / "run"), "seed": 0, "checkpoint_every": 0, "checkpoint_minutes": 0},
            "eval": {"every": 0},
            "log": {"tensorboard": False, "progress": False},
        },
    )
    result = train(cfg)
    assert result.step == STEPS and result.skipped_steps == 0
    assert result.metrics["temperature"] < 0.5  # it falls from 1.0 only once the towers agree on something

    model = openalign.load_model(result.final_dir)
    held_out = RetrievalSet(*retrieval_set(EVAL_IMAGES, 5, seed=0))
    metrics = evaluate_retrieval(model, load_tokenizer(result.final_dir), held_out, batch_size=100, progress=False)
    chance_r1, chance_r10 = 100 / EVAL_IMAGES, 1000 / EVAL_IMAGES
    assert metrics["num_images"] == EVAL_IMAGES and metrics["num_captions"] == 5 * EVAL_IMAGES
    # Far above chance in both directions, on scenes the model has never seen.
    assert metrics["t2i_r1"] > 4 * chance_r1, metrics
    assert metrics["t2i_r10"] > 3 * chance_r10, metrics
    assert metrics["i2t_r10"] > 3 * chance_r10, metrics
