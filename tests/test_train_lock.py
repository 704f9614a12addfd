"""Locked towers (LiT) and starting one tower from a checkpoint, in the training loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import openalign
from conftest import tiny_overrides
from openalign.config import ConfigError
from openalign.model.dual_encoder import DualEncoder
from openalign.train.checkpoint import load_trainer_state
from openalign.train.config import load_train_config
from openalign.train.loop import train
from test_train_loop import _transformers_align, factory, tiny_config, weights

pytestmark = pytest.mark.usefixtures("one_thread")

ADAMW = {"name": "adamw", "lr": 1e-2, "warmup_steps": 0, "schedule": "constant", "total_steps": 4}


def _initial(cfg) -> dict[str, torch.Tensor]:
    """The weights the loop starts from: seed train.seed, then the configured model."""
    torch.manual_seed(cfg.train.seed)
    return {k: v.clone() for k, v in DualEncoder(cfg.model.resolve()).state_dict().items()}


def _tower(state: dict[str, torch.Tensor], tower: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k.startswith(DualEncoder.tower_prefixes(tower))}


def _run(tmp_path: Path, chunk: int | None = None, **model: object):
    cfg = tiny_config(tmp_path / "run", optim=ADAMW, train={"steps": 4, "chunk_size": chunk})
    for key, value in model.items():
        setattr(cfg.model, key, value)
    return cfg, train(cfg, stream_factory=factory())


@pytest.mark.parametrize(
    ("locked", "free", "chunk"), [("image", "text", None), ("text", "image", None), ("image", "text", 4)]
)
def test_a_locked_tower_ends_bit_identical_while_the_other_trains(
    tmp_path: Path, locked: str, free: str, chunk: int | None
) -> None:
    # chunk: gradient caching, whose two passes over each chunk must leave a locked tower alone too
    cfg, result = _run(tmp_path, chunk, **{f"lock_{locked}": True})
    start, end = _initial(cfg), weights(result.final_dir)
    assert result.step == 4
    frozen = _tower(start, locked)
    assert any(k.endswith("running_mean") for k in frozen) == (locked == "image")
    for key, value in frozen.items():
        assert torch.equal(end[key], value), key  # weights and batch-norm statistics, bit for bit
    moved = [k for k, v in _tower(start, free).items() if v.is_floating_point() and not torch.equal(end[k], v)]
    assert moved and all(k in moved for k in _tower(start, free) if k.endswith(("weight", "running_mean")))
    trainer, _ = load_trainer_state(result.run_dir / "checkpoints" / "step_0000004")
    names = [n for group in trainer["optimizer"]["param_groups"] for n in group["names"]]
    trainable = [n for n in names if not n.startswith(DualEncoder.tower_prefixes(locked))]
    assert names == trainable and "temperature_param" in names
    assert len(trainer["optimizer"]["state"]) == len(names)  # AdamW state only for what trains


def test_unlocked_batch_norm_statistics_do_move(tmp_path: Path) -> None:
    """The check above would pass vacuously if training never touched the statistics."""
    cfg, result = _run(tmp_path)
    start, end = _initial(cfg), weights(result.final_dir)
    means = [k for k in start if k.startswith("image.") and k.endswith("running_mean")]
    assert means and not all(torch.equal(end[k], start[k]) for k in means)


def test_a_locked_tower_stays_in_eval_mode_through_train() -> None:
    model = openalign.create_model("nano", **tiny_overrides())
    model.lock_image()
    model.train()
    assert model.training and model.text.training
    assert not any(m.training for m in model.image.modules())
    assert not any(p.requires_grad for p in model.image.parameters())
    assert all(p.requires_grad for p in model.text.parameters())


def test_init_image_loads_that_tower_exactly_and_the_text_tower_starts_fresh(tmp_path: Path) -> None:
    torch.manual_seed(7)
    source = openalign.create_model("nano", **tiny_overrides())
    source.save_pretrained(tmp_path / "src")
    cfg, result = _run(tmp_path, init_image=str(tmp_path / "src"), lock_image=True)
    end, want = weights(result.final_dir), source.state_dict()
    for key, value in _tower(want, "image").items():
        assert torch.equal(end[key], value), key
    fresh = _initial(cfg)
    assert not torch.equal(fresh["text.embeddings.word.weight"], want["text.embeddings.word.weight"])
    assert not torch.equal(end["text_proj.weight"], want["text_proj.weight"])


def test_init_text_from_a_transformers_checkpoint(tmp_path: Path) -> None:
    _transformers_align(tmp_path / "hf")
    cfg = tiny_config(
        tmp_path / "run",
        model={
            "embed_dim": 80,
            "text": {"vocab_size": 128, "intermediate_size": 64, "max_position_embeddings": 512, "pooling": "cls"},
        },
        train={"steps": 1},
    )
    cfg.model.init_text = str(tmp_path / "hf")
    cfg.model.lock_text = True
    end = weights(train(cfg, stream_factory=factory()).final_dir)
    want = openalign.load_model(tmp_path / "hf").state_dict()
    text = _tower(want, "text")
    assert "text_proj.weight" in text
    for key, value in text.items():
        assert torch.equal(end[key], value), key


def test_a_tower_that_does_not_fit_is_one_line_naming_the_tensor(tmp_path: Path) -> None:
    _transformers_align(tmp_path / "hf")
    cfg = tiny_config(tmp_path / "run", train={"steps": 1})
    cfg.model.init_text = str(tmp_path / "hf")
    with pytest.raises(ConfigError) as caught:
        train(cfg, stream_factory=factory())
    message = str(caught.value)
    assert "\n" not in message
    assert message.endswith(
        "its text tower does not fit the configured model: text.embeddings.word.weight has shape [128, 32], "
        "the model expects [101, 32]"
    )


def test_lock_and_init_flags_parse_and_round_trip(tmp_path: Path) -> None:
    from openalign.cli.train import train_schema

    paths = {k.path for k in train_schema().knobs}
    assert {"model.lock_image", "model.lock_text", "model.init_image", "model.init_text"} <= paths
    cfg = load_train_config("nano_cpu", {"model.lock_image": True, "model.init_text": "ckpt"})
    assert cfg.model.lock_image and not cfg.model.lock_text and cfg.model.init_text == "ckpt"
    again = load_train_config(cfg.to_dict())
    assert again.model.lock_image and again.model.init_text == "ckpt" and again.model.overrides == cfg.model.overrides
    with pytest.raises(ConfigError, match=r"model\.lock_text: expected true or false"):
        load_train_config("nano_cpu", {"model.lock_text": "yes please"})


def test_resuming_with_other_locks_is_one_line(tmp_path: Path) -> None:
    cfg, _ = _run(tmp_path, lock_image=True)
    cfg.model.lock_image = False
    cfg.train.steps = 6
    with pytest.raises(ConfigError, match=r"was the run started with other model\.lock_image / model\.lock_text"):
        train(cfg, resume="latest", stream_factory=factory())
