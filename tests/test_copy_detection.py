from __future__ import annotations

import io
import json
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageEnhance

from openalign.config import ConfigError
from openalign.data.augment import AugmentConfig, augment_views, colour_jitter, crop_resize
from openalign.data.synthetic import SyntheticWorld, augment_near_duplicate
from openalign.model.copy_detector import CopyDetector, CopyDetectorConfig
from openalign.model.io import load_copy_detector, load_model, save_model
from openalign.pipeline.copy_detector import CopyDetectorTrainConfig, train_copy_detector

SIZE = 32


@pytest.fixture(scope="module")
def scenes() -> list[Image.Image]:
    world = SyntheticWorld(seed=3, image_size=SIZE)
    return [world.render(world.scene(i)) for i in range(48)]


@pytest.fixture(scope="module")
def trained(scenes: list[Image.Image]) -> CopyDetector:
    return train_copy_detector(scenes, _cfg(steps=40, batch_size=24, warmup_steps=4, seed=0))


def _cfg(**fields: object) -> CopyDetectorTrainConfig:
    # Views by the batched edits only: the copies scored here are the synthetic crawl's mild ones, and a run of
    # 40 steps on 32 px scenes is too short to learn the heavy reposted edits as well.
    fields.setdefault("augment", AugmentConfig(reposts=0))
    return CopyDetectorTrainConfig(image_size=SIZE, **fields)


def _random_images(n: int, seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)) for _ in range(n)]


# --------------------------------------------------------------------------------------------------
# Augmentation maths against plain references


def test_crop_resize_matches_crop_then_interpolate() -> None:
    x = torch.rand(2, 3, 40, 40)
    boxes_px = [(4, 2, 0, 6), (0, 0, 3, 3)]  # left, right, top, bottom in pixels
    out = crop_resize(x, torch.tensor(boxes_px, dtype=torch.float32) / 40)
    for i, (left, right, top, bottom) in enumerate(boxes_px):
        ref = F.interpolate(x[i : i + 1, :, top : 40 - bottom, left : 40 - right], size=(40, 40), mode="bilinear")
        # The first and last output pixels sample half a pixel outside the box, where a crop clamps.
        assert torch.allclose(out[i, :, 1:-1, 1:-1], ref[0, :, 1:-1, 1:-1], atol=1e-5)


def test_crop_resize_without_crop_is_identity() -> None:
    x = torch.rand(3, 3, 17, 17)
    assert torch.allclose(crop_resize(x, torch.zeros(3, 4)), x, atol=1e-5)


@pytest.mark.parametrize("factors", [(1.06, 1.0, 1.0), (1.0, 0.9, 1.0), (1.0, 1.0, 1.12), (0.93, 1.08, 0.9)])
def test_colour_jitter_matches_pil_image_enhance(factors: tuple[float, float, float]) -> None:
    world = SyntheticWorld(seed=5, image_size=SIZE)
    image = world.render(world.scene(0))
    b, c, s = factors
    ref = ImageEnhance.Color(ImageEnhance.Contrast(ImageEnhance.Brightness(image).enhance(b)).enhance(c)).enhance(s)
    x = torch.from_numpy(np.asarray(image).transpose(2, 0, 1).copy()).float()[None] / 255
    out = colour_jitter(x, *(torch.tensor([f]) for f in factors))[0].numpy().transpose(1, 2, 0) * 255
    # PIL rounds to 8 bits after every enhancer and takes an integer mean grey for contrast.
    assert np.abs(out - np.asarray(ref, dtype=np.float64)).max() <= 3.0


def test_augment_views_with_nothing_to_do_returns_the_pixels() -> None:
    x = torch.randint(0, 256, (4, 3, SIZE, SIZE), dtype=torch.uint8)
    cfg = AugmentConfig(crop=0, rescale_prob=0, brightness=0, contrast=0, saturation=0)
    out = augment_views(x, cfg, torch.Generator().manual_seed(0))
    assert torch.allclose(out, x.float() / 255 * 2 - 1, atol=1e-6)


def test_augment_views_range_shape_and_variety() -> None:
    x = torch.randint(0, 256, (8, 3, SIZE, SIZE), dtype=torch.uint8)
    out = augment_views(x, AugmentConfig(), torch.Generator().manual_seed(0))
    assert out.shape == x.shape and out.min() >= -1 and out.max() <= 1
    again = augment_views(x, AugmentConfig(), torch.Generator().manual_seed(0))
    other = augment_views(x, AugmentConfig(), torch.Generator().manual_seed(1))
    assert torch.equal(out, again) and not torch.equal(out, other)


# --------------------------------------------------------------------------------------------------
# Training


def test_training_decreases_the_loss(trained: CopyDetector) -> None:
    losses = trained.train_stats["losses"]
    assert len(losses) == 40 and trained.train_stats["steps"] == 40
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])


def test_augmented_copy_is_closer_to_its_source_than_to_other_images(
    scenes: list[Image.Image], trained: CopyDetector
) -> None:
    # The copies are made the way the synthetic crawl plants them, not by the training augmentation.
    copies = [augment_near_duplicate(im, random.Random(i)) for i, im in enumerate(scenes)]

    def margins(model: CopyDetector) -> tuple[float, np.ndarray]:
        sim = model.embed(copies) @ model.embed(scenes).T
        positive = np.diag(sim).copy()
        np.fill_diagonal(sim, -np.inf)
        return float((positive > sim.max(axis=1)).mean()), positive - sim.max(axis=1)

    with torch.random.fork_rng():
        torch.manual_seed(0)
        untrained = CopyDetector(trained.config).eval()
    top1, margin = margins(trained)
    top1_before, margin_before = margins(untrained)
    # 48 candidates, so chance is 2 %; a 40-step run on 48 images gets about 60 %.
    assert top1 >= 0.4, f"only {top1:.0%} of copies have their source as nearest image"
    assert np.median(margin) > np.median(margin_before) + 0.01, (np.median(margin), np.median(margin_before))
    assert top1 >= top1_before


def test_embeddings_are_normalised_and_deterministic(scenes: list[Image.Image], trained: CopyDetector) -> None:
    emb = trained.embed(scenes[:10], batch_size=4)
    assert emb.dtype == np.float32 and emb.shape == (10, trained.embed_dim)
    assert np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    assert np.allclose(trained.embed(iter(scenes[:10]), batch_size=7), emb, atol=1e-6)  # batching, iterators
    again = train_copy_detector(scenes, _cfg(steps=40, batch_size=24, warmup_steps=4, seed=0))
    assert np.allclose(again.embed(scenes[:10]), emb, atol=1e-5)
    other = train_copy_detector(scenes, _cfg(steps=3, batch_size=24, seed=1))
    assert not np.allclose(other.embed(scenes[:10]), emb, atol=1e-3)
    assert trained.embed([]).shape == (0, trained.embed_dim)


def test_exact_duplicates_and_unreadable_images_are_skipped_and_counted() -> None:
    images = _random_images(6, seed=0)
    detector = train_copy_detector([*images, images[0].copy(), "not an image", *images[:2]], _cfg(steps=1))
    stats = detector.train_stats
    assert stats["images_in"] == 10 and stats["images_used"] == 6
    assert stats["exact_duplicates"] == 3 and stats["unreadable"] == 1
    assert stats["batch_size"] == 6  # capped at the distinct images


def test_views_start_from_the_image_its_jpeg_round_trips_and_its_reposted_copies(scenes: list[Image.Image]) -> None:
    from openalign.data.augment import image_array
    from openalign.pipeline.copy_detector import _bank, _prepare

    cfg = AugmentConfig(jpeg_variants=1, reposts=3)
    arrays, reposted, _ = _prepare(scenes[:5], SIZE, 5, False, reposts=cfg.reposts, seed=0)
    bank = _bank(arrays, reposted, cfg, seed=0, progress=False).numpy()
    assert bank.shape == (5, 1 + 1 + 3, 3, SIZE, SIZE)
    np.testing.assert_array_equal(bank[:, 0], [image_array(im, SIZE) for im in scenes[:5]])
    np.testing.assert_array_equal(bank[:, 2:], reposted)
    # Each reposted copy is an edit of its own image: closer to it than to any other image of the batch.
    distance = np.abs(reposted.astype(np.float32)[:, :, None] - arrays.astype(np.float32)[None, None]).mean((3, 4, 5))
    assert (distance.argmin(-1) == np.arange(5)[:, None]).mean() >= 0.8
    assert (reposted != arrays[:, None]).any((2, 3, 4)).all()  # and never the image unchanged
    again = _prepare(scenes[:5], SIZE, 5, False, reposts=cfg.reposts, seed=0)[1]
    np.testing.assert_array_equal(again, reposted)
    assert _prepare(scenes[:5], SIZE, 5, False)[1].shape == (5, 0, 3, SIZE, SIZE)


def test_jpeg_round_trip_is_a_4_2_0_jpeg_at_its_quality(scenes: list[Image.Image]) -> None:
    from openalign.data.augment import image_array, jpeg_round_trip

    array = image_array(scenes[0], 48)
    errors = []
    for quality in (95, 60, 20):
        out = jpeg_round_trip(array, quality)
        assert out.shape == array.shape and out.dtype == np.uint8
        # Artefacts as large as those of PIL's JPEG at that quality with halved chroma (its default), the
        # same library behind another interface: a setting (quality scale, chroma) would change their size.
        buf = io.BytesIO()
        Image.fromarray(array.transpose(1, 2, 0)).save(buf, format="JPEG", quality=quality, subsampling=2)
        pil = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB")).transpose(2, 0, 1)
        error, pil_error = (np.abs(x.astype(int) - array).mean() for x in (out, pil))
        assert abs(error - pil_error) < 0.15 * pil_error, (quality, error, pil_error)
        assert np.abs(out.astype(int) - pil).mean() < 0.6 * pil_error, quality
        errors.append(error)
    assert 0 < errors[0] < errors[1] < errors[2], errors  # lower quality, larger artefacts


def test_seconds_budget_stops_training() -> None:
    detector = train_copy_detector(_random_images(8, seed=1), _cfg(steps=10_000, seconds=0.5))
    assert 1 <= detector.train_stats["steps"] < 10_000


def test_bad_arguments_are_one_line_errors() -> None:
    images = _random_images(4, seed=2)
    with pytest.raises(ValueError, match="at least 2 distinct"):
        train_copy_detector([images[0], images[0]], _cfg(steps=1))
    with pytest.raises(ConfigError, match="steps"):
        train_copy_detector(images, _cfg(steps=0))
    with pytest.raises(ConfigError, match="seconds"):
        train_copy_detector(images, _cfg(seconds=0))
    with pytest.raises(ConfigError, match=r"augment\.crop"):
        train_copy_detector(images, _cfg(augment=AugmentConfig(crop=0.7)))
    with pytest.raises(ConfigError, match="jpeg_quality"):
        AugmentConfig(jpeg_quality=(90, 40)).validate()
    with pytest.raises(ConfigError, match="image_size"):
        CopyDetector(CopyDetectorConfig(image_size=8))
    detector = CopyDetector(CopyDetectorConfig(image_size=SIZE))
    with pytest.raises(ValueError, match="image 1: expected a PIL image"):
        detector.embed([images[0], np.zeros((4, 4, 3))])


# --------------------------------------------------------------------------------------------------
# Save and load


def test_save_load_round_trip(tmp_path, scenes: list[Image.Image], trained: CopyDetector) -> None:
    # The detector saves like every openalign model: config.json (architecture + config) and safetensors.
    path = save_model(trained, tmp_path / "detector")
    assert (path / "model.safetensors").is_file()
    meta = json.loads((path / "config.json").read_text())
    assert meta["format"] == "openalign" and meta["architecture"] == "copy_detector"
    assert meta["model"]["grid"] == trained.config.grid and meta["train"]["steps"] == 40
    assert "losses" not in meta["train"]
    loaded = load_copy_detector(path)
    assert not loaded.training and loaded.config == trained.config and loaded.train_stats["steps"] == 40
    assert np.array_equal(loaded.embed(scenes[:8]), trained.embed(scenes[:8]))


def test_a_convolutional_detector_learns_saves_and_loads(tmp_path, scenes: list[Image.Image]) -> None:
    from openalign.model.convnet import ConvNet

    cfg = _cfg(steps=40, batch_size=24, warmup_steps=4, seed=0, family="convnet")
    detector = train_copy_detector(scenes, cfg)
    assert isinstance(detector.backbone, ConvNet) and detector.config.image.family == "convnet"
    losses = detector.train_stats["losses"]
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])
    copies = [augment_near_duplicate(im, random.Random(i)) for i, im in enumerate(scenes)]
    sim = detector.embed(copies) @ detector.embed(scenes).T
    assert (sim.argmax(axis=1) == np.arange(len(scenes))).mean() >= 0.4  # chance: 2 %
    loaded = load_copy_detector(save_model(detector, tmp_path / "detector"))
    assert isinstance(loaded.backbone, ConvNet) and loaded.config == detector.config
    assert np.array_equal(loaded.embed(scenes[:8]), detector.embed(scenes[:8]))


def test_detectors_saved_in_the_first_layout_still_load(tmp_path, scenes: list[Image.Image], trained) -> None:
    path = save_model(trained, tmp_path / "detector")
    meta = json.loads((path / "config.json").read_text())
    old = {"format": "openalign-copy-detector", "format_version": 1, "detector": meta["model"], "train": meta["train"]}
    (path / "config.json").write_text(json.dumps(old))
    assert np.array_equal(load_copy_detector(path).embed(scenes[:4]), trained.embed(scenes[:4]))


def test_load_rejects_missing_foreign_and_mismatched_directories(tmp_path, tiny_model, trained) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_copy_detector(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps({"format": "something-else", "model": {}}))
    with pytest.raises(ConfigError, match="neither an openalign checkpoint"):
        load_copy_detector(tmp_path)
    bad = {"format": "openalign", "format_version": 1, "architecture": "copy_detector", "model": {"image_sise": 64}}
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="image_sise"):
        load_copy_detector(tmp_path)
    save_model(tiny_model, tmp_path / "align")
    with pytest.raises(ConfigError, match="holds an ALIGN dual encoder, not a copy detector"):
        load_copy_detector(tmp_path / "align")
    save_model(trained, tmp_path / "detector")
    with pytest.raises(ConfigError, match="holds a copy detector, not an ALIGN dual encoder"):
        load_model(tmp_path / "detector")
