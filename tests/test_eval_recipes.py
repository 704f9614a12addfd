"""The paper's transfer recipes: each preset's resolved settings, and the behaviours they name checked on tiny
sizes: the 0.875 central crop, Inception-style random-resized crops with flips, frozen batch-norm statistics
in fine-grained fine-tuning, the head-then-all cosine schedule, the mean of three runs, and the linear probe's
augmented mode."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import openalign
from openalign.data.transforms import (
    center_crop_transform,
    eval_transform,
    inception_crop_box,
    inception_crop_transform,
    to_tensor,
)
from openalign.eval import finetune as ft
from openalign.eval.recipes import RECIPES, get_recipe

# ------------------------------------------------------------------------------------------ resolved presets


def test_paper_imagenet_frozen_preset() -> None:
    r = get_recipe("paper-imagenet-frozen", "linear-probe")
    assert (r.train_size, r.eval_size, r.crop_ratio, r.train_crop) == (289, 360, 0.875, "inception")
    assert r.features == "augmented"
    p = r.probe_config()
    assert (p.method, p.epochs, p.lr, p.batch_size, p.momentum, p.weight_decay) == ("sgd", 100, 0.1, 1024, 0.9, 0.0)
    assert (p.decay_every_epochs, p.decay_gamma) == (30, 0.2)


def test_paper_imagenet_finetune_preset() -> None:
    r = get_recipe("paper-imagenet-finetune", "finetune")
    assert (r.train_size, r.eval_size, r.crop_ratio, r.train_crop, r.runs) == (475, 600, 0.875, "inception", 1)
    cfg = r.finetune_config(steps_per_epoch=10)
    assert cfg.batch_size == 1024 and cfg.momentum == 0.9
    assert (cfg.head.lr, cfg.full.lr) == (0.1, 0.01) and not cfg.head.train_backbone
    for stage in (cfg.head, cfg.full):
        assert (stage.schedule, stage.decay_every, stage.decay_gamma, stage.steps) == ("step", 300, 0.2, 1000)
        assert stage.weight_decay == 0.0
    assert cfg.full.backbone_lr_scale == 0.1


def test_paper_finegrained_preset() -> None:
    r = get_recipe("paper-finegrained", "finetune")
    assert (r.train_size, r.eval_size, r.crop_ratio, r.train_crop, r.runs) == (289, 360, 0.875, "inception", 3)
    cfg = r.finetune_config(steps_per_epoch=1)
    assert cfg.batch_size == 256 and cfg.momentum == 0.9
    assert (cfg.head.lr, cfg.full.lr) == (1e-2, 1e-3)
    for stage in (cfg.head, cfg.full):
        assert (stage.schedule, stage.steps, stage.weight_decay) == ("cosine", 20_000, 1e-5)
    assert not cfg.head.train_backbone and cfg.full.train_backbone and cfg.full.freeze_bn
    # flags override the preset's step counts and batch, nothing else
    small = r.finetune_config(1, steps=3, batch=4)
    assert (small.head.steps, small.full.steps, small.batch_size, small.full.lr) == (3, 3, 4, 1e-3)


def test_recipe_names_are_checked() -> None:
    assert set(RECIPES) == {"paper-imagenet-frozen", "paper-imagenet-finetune", "paper-finegrained"}
    with pytest.raises(ValueError, match="valid: paper-imagenet-finetune, paper-finegrained"):
        get_recipe("paper-imagenet-frozen", "finetune")


# ------------------------------------------------------------------------------------------ crops


def _pattern(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_central_crop_of_ratio_0875() -> None:
    image = _pattern(64, 64)
    # 56 / 0.875 = 64: no resize, and the crop is the middle 56 pixels, 4 cut from each side
    got = center_crop_transform(56, 0.875)(image)
    assert torch.equal(got, to_tensor(image.crop((4, 4, 60, 60)), (0.5,) * 3, (0.5,) * 3))
    big = _pattern(500, 400)
    assert torch.equal(center_crop_transform(360)(big), eval_transform(360, 411)(big))  # 360 / 0.875 = 411.4
    assert center_crop_transform(600)(big).shape == (3, 600, 600)
    with pytest.raises(ValueError, match="crop_ratio"):
        center_crop_transform(32, 1.5)


def test_inception_crop_boxes() -> None:
    torch.manual_seed(0)
    width, height = 120, 90
    fractions, aspects = [], []
    for _ in range(300):
        left, top, right, bottom = inception_crop_box(width, height)
        assert 0 <= left < right <= width and 0 <= top < bottom <= height
        w, h = right - left, bottom - top
        fractions.append(w * h / (width * height))
        aspects.append(w / h)
    assert min(fractions) >= 0.07 and max(fractions) <= 1.0
    assert min(fractions) < 0.2 and max(fractions) > 0.8  # the scale is drawn over the whole range
    assert min(aspects) > 0.7 and max(aspects) < 1.4
    # a box that can never fit falls back to the central box of the clamped aspect ratio
    assert inception_crop_box(100, 10, scale=(1.0, 1.0)) == (43, 0, 56, 10)  # 13 = round(10 * 4 / 3) wide


def test_inception_crop_transform_flips_half_and_varies() -> None:
    torch.manual_seed(0)
    left_red = np.zeros((32, 32, 3), np.uint8)
    left_red[:, :16, 0] = 255
    left_red[:, 16:, 2] = 255
    image = Image.fromarray(left_red)
    whole = inception_crop_transform(16, scale=(1.0, 1.0), ratio=(1.0, 1.0))
    flipped = 0
    for _ in range(60):
        x = whole(image)
        assert x.shape == (3, 16, 16)
        red_left = x[0, :, :4].mean() > x[0, :, -4:].mean()
        flipped += int(not red_left)
    assert 15 <= flipped <= 45
    crops = inception_crop_transform(16)
    first, second = crops(_pattern(48, 40)), crops(_pattern(48, 40))
    assert first.shape == second.shape == (3, 16, 16) and not torch.equal(first, second)


# ------------------------------------------------------------------------------------------ fine-grained behaviour


def colour_images(n: int, size: int = 16) -> list[tuple[torch.Tensor, int]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        x = torch.rand(3, size, size, generator=g) * 0.6 - 0.3
        x[0 if i % 2 == 0 else 2] += 0.7
        out.append((x, i % 2))
    return out


def bn_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.named_buffers() if "running" in k or "num_batches" in k}


@pytest.mark.parametrize("freeze", [True, False])
def test_finegrained_keeps_bn_statistics_while_weights_change(freeze: bool) -> None:
    from test_eval_transfer import small_backbone

    cfg = RECIPES["paper-finegrained"].finetune_config(1, steps=3, batch=4)
    if not freeze:  # the control: the same run with batch norm left to update must move the statistics
        cfg.full.freeze_bn = False
    clf = ft.ImageClassifier(small_backbone(), 8, num_classes=2)
    stats = bn_buffers(clf.backbone)
    weights = {k: p.detach().clone() for k, p in clf.backbone.named_parameters()}
    ft.finetune(clf, colour_images(8, size=12), 2, cfg)
    after = bn_buffers(clf.backbone)
    assert set(stats) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    same = all(torch.equal(stats[k], after[k]) for k in stats)
    assert same is freeze  # bit-identical only when frozen
    changed = {k for k, p in clf.backbone.named_parameters() if not torch.equal(weights[k], p.detach())}
    # stage 2 trained the backbone either way (a conv bias before a batch norm in training mode gets no gradient)
    assert {"0.weight", "1.weight", "1.bias"} <= changed


def test_finegrained_freezes_bn_of_the_image_tower(tiny_model: openalign.DualEncoder, one_thread: None) -> None:
    cfg = RECIPES["paper-finegrained"].finetune_config(1, steps=2, batch=4)
    clf = ft.ImageClassifier.from_dual_encoder(tiny_model, num_classes=2)
    stats = bn_buffers(clf.backbone)
    ft.finetune(clf, colour_images(8), 2, cfg)
    assert len(stats) > 10 and all(torch.equal(v, bn_buffers(clf.backbone)[k]) for k, v in stats.items())


def test_head_then_all_cosine_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, list[float]]] = []
    real = ft.build_scheduler

    def recording(optimizer, cfg):
        sched = real(optimizer, cfg)
        rows: dict[str, list[float]] = {"head": [], "backbone": [], "wd": [], "momentum": []}
        seen.append(rows)
        step = sched.step

        def step_and_record() -> None:
            for g in optimizer.param_groups:
                key = "backbone" if g.get("lr_scale", 1.0) != 1.0 else "head"
                if not rows[key] or len(rows[key]) < len(rows["momentum"]) + 1:
                    rows[key].append(g["lr"])
            rows["wd"] = sorted({g["weight_decay"] for g in optimizer.param_groups})
            rows["momentum"].append(optimizer.param_groups[0]["momentum"])
            step()

        sched.step = step_and_record
        return sched

    monkeypatch.setattr(ft, "build_scheduler", recording)
    steps = 4
    cfg = RECIPES["paper-finegrained"].finetune_config(1, steps=steps, batch=4)
    from test_eval_transfer import small_backbone

    clf = ft.ImageClassifier(small_backbone(), 8, num_classes=2)
    ft.finetune(clf, colour_images(8, size=12), 2, cfg)
    head, full = seen
    cosine = [0.5 * (1 + math.cos(math.pi * t / steps)) for t in range(steps)]
    assert head["head"] == pytest.approx([1e-2 * c for c in cosine]) and head["backbone"] == []
    assert full["head"] == pytest.approx([1e-3 * c for c in cosine])
    assert full["backbone"] == pytest.approx([1e-4 * c for c in cosine])  # 10x smaller on the backbone
    assert head["wd"] == [0.0, 1e-5] and full["wd"] == [0.0, 1e-5]  # none on biases and norms
    assert set(head["momentum"] + full["momentum"]) == {0.9}


# ------------------------------------------------------------------------------------------ CLI


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from conftest import save_tiny_checkpoint

    captions = ["a photo of a red square", "a blue square"] * 20
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), captions, vocab_size=101, min_frequency=1)


def _fingerprint(module: torch.nn.Module) -> str:
    import hashlib

    h = hashlib.sha1()
    for v in module.state_dict().values():
        h.update(v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_cli_finegrained_mean_of_three_runs(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    from openalign.cli import main
    from test_eval_transfer import write_folders

    starts: list[tuple[str, int, bool]] = []
    real = ft.finetune

    def recording(model, train, num_classes, config, **kw):
        starts.append((_fingerprint(model.image), config.seed, config.full.freeze_bn))
        return real(model, train, num_classes, config, **kw)

    monkeypatch.setattr(ft, "finetune", recording)
    write_folders(tmp_path / "train", 3)
    write_folders(tmp_path / "val", 2)
    out = tmp_path / "res"
    argv = ["eval", "finetune", "--model", str(checkpoint), "--train", str(tmp_path / "train")]
    argv += ["--val", str(tmp_path / "val"), "--recipe", "paper-finegrained", "--steps", "1"]
    argv += ["--finetune-batch-size", "4", "--image-size", "32", "--eval-image-size", "40", "--out", str(out)]
    assert main(argv) == 0
    [result] = [json.loads(p.read_text()) for p in out.glob("finetune-*.json")]
    m = result["metrics"]
    assert m["runs"] == 3 and len(m["top1_runs"]) == 3 and m["top1"] == pytest.approx(np.mean(m["top1_runs"]))
    assert m["top1_std"] == pytest.approx(float(np.std(m["top1_runs"], ddof=1)))
    assert (m["recipe"], m["train_size"], m["eval_size"]) == ("paper-finegrained", 32, 40)
    assert [s[1] for s in starts] == [0, 1, 2] and all(s[2] for s in starts)
    assert len({s[0] for s in starts}) == 1  # every run starts from the same pre-trained weights


def test_cli_linear_probe_augmented_features(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    import openalign.embed
    from openalign.cli import main
    from test_eval_transfer import write_folders

    calls: list[tuple[int, torch.Tensor]] = []
    real = openalign.embed.embed_images

    def counting(model, images, **kw):
        out = real(model, images, **kw)
        calls.append((len(images), out))
        return out

    monkeypatch.setattr(openalign.embed, "embed_images", counting)
    write_folders(tmp_path / "train", 3)
    write_folders(tmp_path / "val", 2)
    base = ["eval", "linear-probe", "--model", str(checkpoint), "--train", str(tmp_path / "train")]
    base += ["--val", str(tmp_path / "val"), "--epochs", "3", "--probe-batch-size", "4"]
    out = tmp_path / "aug"
    argv = [*base, "--recipe", "paper-imagenet-frozen", "--image-size", "24", "--eval-image-size", "32"]
    assert main([*argv, "--out", str(out)]) == 0
    train_calls = [x for n, x in calls if n == 6]
    assert len(train_calls) == 3 and len(calls) == 4  # the training set re-embedded every epoch, val once
    assert not torch.equal(train_calls[0], train_calls[1])  # new random crops each epoch
    [result] = [json.loads(p.read_text()) for p in out.glob("linear-probe-*.json")]
    assert result["metrics"]["features"] == "augmented" and result["metrics"]["eval_size"] == 32
    calls.clear()
    assert main([*base, "--out", str(tmp_path / "fixed")]) == 0
    assert len(calls) == 2  # fixed features: each set embedded once
    assert main([*base, "--features", "augmented", "--method", "lbfgs"]) == 2
