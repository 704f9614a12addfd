"""Aligned-pixel verification: the registration recovers a known re-crop, a copy's worst region matches and a
picture with one thing changed does not, and the verification stage decides batches and each image's nearest
pairs as a plain per-pair reference would."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageEnhance

from openalign.bench.copy_detection import REFERENCES, installed_photos
from openalign.data.alignment import _low_pass, aligned_arrays, coarse_residual, register, worst_region_residual
from openalign.data.dedup import DedupResult
from openalign.data.verification import VerifyConfig, aligned_check
from openalign.pipeline.verify import _nearest_only, verify_pairs

SIDE = 48


@pytest.fixture(scope="module")
def photos() -> dict[str, Image.Image]:
    out = installed_photos(REFERENCES, 192)
    if len(out) < 4:
        pytest.skip("the sample photographs of scikit-image / scikit-learn are not installed")
    return out


def _recrop(image: Image.Image, box: tuple[float, float, float, float]) -> Image.Image:
    """``image`` with fractions (left, top, right, bottom) of its sides cut off, resized back."""
    w, h = image.size
    left, top, right, bottom = box
    return image.crop((left * w, top * h, w - right * w, h - bottom * h)).resize(image.size, Image.Resampling.BICUBIC)


def _repost(
    image: Image.Image, box: tuple[float, float, float, float], brightness: float, quality: int, colour: float = 1.0
) -> Image.Image:
    out = ImageEnhance.Brightness(_recrop(image, box)).enhance(brightness)
    out = ImageEnhance.Color(out).enhance(colour)
    buf = io.BytesIO()
    out.save(buf, format="JPEG", quality=quality)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def _square(photo: Image.Image) -> Image.Image:
    side = min(photo.size)
    return photo.crop((0, 0, side, side)).resize((192, 192), Image.Resampling.LANCZOS)


def test_registration_recovers_a_known_recrop(photos: dict[str, Image.Image]) -> None:
    boxes = [(0.04, 0.0, 0.0, 0.03), (0.0, 0.04, 0.03, 0.0), (0.02, 0.02, 0.02, 0.02), (0.0, 0.0, 0.0, 0.0)]
    names = sorted(photos)[: len(boxes)]
    refs = [_square(photos[n]) for n in names]
    queries = [_recrop(r, b) for r, b in zip(refs, boxes, strict=True)]
    affine = register(aligned_arrays(queries, SIDE), aligned_arrays(refs, SIDE))
    # A query pixel at u ∈ [-1, 1] shows the reference at left·2 - 1 + (u + 1)(1 - left - right):
    # scale 1 - left - right, offset left - right (and the same for top and bottom in y).
    truth = torch.tensor([[[1 - lf - rt, 0.0, lf - rt], [0.0, 1 - tp - bt, tp - bt]] for lf, tp, rt, bt in boxes])
    assert torch.allclose(affine, truth, atol=0.012), (affine - truth).abs().amax((1, 2))
    # Fitted on a smaller grid than the images', the same maps: they are in [-1, 1] coordinates, whatever the size.
    finer = register(aligned_arrays(queries, 64), aligned_arrays(refs, 64), side=SIDE)
    assert torch.allclose(finer, truth, atol=0.012), (finer - truth).abs().amax((1, 2))


def test_a_copy_matches_everywhere_and_one_changed_object_does_not(photos: dict[str, Image.Image]) -> None:
    refs, copies, changed = [], [], []
    r = random.Random(0)
    for name in sorted(photos)[:6]:
        ref = _square(photos[name])
        box = (r.uniform(0, 0.04), r.uniform(0, 0.04), r.uniform(0, 0.04), r.uniform(0, 0.04))
        refs.append(ref)
        # Saturation ±50 %: a re-toned copy, which the luminance residual does not see.
        copies.append(_repost(ref, box, r.uniform(0.93, 1.07), r.randint(70, 90), r.choice([0.5, 1.5])))
        # The same photo, the same re-post, with one thing of a tenth of the side painted over it: what an
        # embedding of the whole scene hardly sees, and what makes it a different picture.
        other = copies[-1].copy()
        x, y = r.randint(20, 140), r.randint(20, 140)
        under = np.asarray(other.crop((x, y, x + 22, y + 22))).reshape(-1, 3).mean(0)
        ImageDraw.Draw(other).ellipse((x, y, x + 22, y + 22), fill=tuple(int(255 - v) for v in under))
        changed.append(other)
    # Scored at the check's own size, registered at its smaller one.
    cfg = VerifyConfig()
    ref_arrays = aligned_arrays(refs, cfg.aligned_side)
    for queries, is_copy in ((copies, True), (changed, False)):
        q = aligned_arrays(queries, cfg.aligned_side)
        affine = register(q, ref_arrays, side=cfg.register_side)
        scores = worst_region_residual(q, ref_arrays, affine, blur=cfg.aligned_blur)
        assert ((scores <= cfg.max_residual) == is_copy).all(), scores
    # Unregistered (the identity map), a re-crop of a few percent already fails: the registration is what
    # lets the copies through.
    q = aligned_arrays(copies, cfg.aligned_side)
    identity = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]).expand(len(q), 2, 3)
    assert (worst_region_residual(q, ref_arrays, identity) > VerifyConfig().max_residual).any()


def _striped(period: int, r: random.Random) -> Image.Image:
    """Stripes ``period`` px apart at 192 px (6–7 px at the check's 64) with two rings over them."""
    image = Image.new("RGB", (192, 192), (170, 220, 220))
    draw = ImageDraw.Draw(image)
    for y in range(0, 192, period):
        draw.rectangle((0, y, 192, y + period // 2), fill=(40, 130, 130))
    for _ in range(2):
        x, y, size = r.randint(20, 120), r.randint(20, 120), r.randint(30, 50)
        draw.ellipse((x, y, x + size, y + size), outline=(r.randrange(256), r.randrange(256), 0), width=8)
    return image


def test_registration_is_not_fooled_by_fine_stripes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Re-crops of up to 4 % a side of striped pictures (a period is 0.19–0.22 of the [-1, 1] frame). At the
    # half-size level the stripes are 2–3 px apart, where shrinking aliases them into a false coarser pattern;
    # the level's low-pass leaves the rings to pull the fit, and the maps land on the true one, not on a
    # neighbouring period (all but one of the twelve here; without the low-pass, seven of them fail).
    r = random.Random(0)
    refs, boxes = [], []
    for period in (18, 21) * 6:
        refs.append(_striped(period, r))
        boxes.append((r.uniform(0, 0.04), r.uniform(0, 0.04), r.uniform(0, 0.04), r.uniform(0, 0.04)))
    q = aligned_arrays([_recrop(ref, box) for ref, box in zip(refs, boxes, strict=True)], 64)
    ref_arrays = aligned_arrays(refs, 64)
    truth = torch.tensor([[[1 - lf - rt, 0.0, lf - rt], [0.0, 1 - tp - bt, tp - bt]] for lf, tp, rt, bt in boxes])
    cfg = VerifyConfig()
    affine = register(q, ref_arrays, side=cfg.register_side)
    right = (affine - truth).abs().amax((1, 2)) < 0.06
    assert right.sum() >= 11, (affine - truth).abs().amax((1, 2))
    accepted = worst_region_residual(q, ref_arrays, affine, blur=cfg.aligned_blur) <= cfg.max_residual
    assert accepted[right.numpy()].all()
    # Without that low-pass, several of the same copies lock into a wrong period.
    import openalign.data.alignment as alignment

    monkeypatch.setattr(alignment, "_LEVELS", tuple((*level[:3], 0.0) for level in alignment._LEVELS))
    aliased = register(q, ref_arrays, side=cfg.register_side)
    assert ((aliased - truth).abs().amax((1, 2)) > 0.1).sum() >= 4


def test_a_copy_of_a_grainy_picture_matches_once_both_are_low_passed() -> None:
    # Pictures of 64 px whose flat ground carries grain at the pixel scale (sand, film grain), reposted at the
    # same size: the re-crop's resampling smooths the grain and the JPEG adds blocks of its own, so pixel by
    # pixel a copy's ground differs as much as it varies. Low-passed, the copies match and a picture with one
    # more object still does not.
    r, rng = random.Random(1), np.random.default_rng(0)

    def disc(draw: ImageDraw.ImageDraw) -> None:
        x, y, size = r.randint(6, 40), r.randint(6, 40), r.randint(10, 18)
        draw.ellipse((x, y, x + size, y + size), fill=(r.randrange(256), r.randrange(256), r.randrange(100)))

    refs, copies, changed = [], [], []
    yy, xx = np.mgrid[0:64, 0:64] / 64.0
    for _ in range(8):
        shade = 200 + 25 * np.sin(2 * np.pi * (xx * r.uniform(0.5, 1.5) + yy * r.uniform(0.5, 1.5)))
        ground = np.stack([shade, shade * 0.85, shade * 0.6], -1) + rng.normal(0, 14, (64, 64))[..., None]
        ref = Image.fromarray(ground.clip(0, 255).astype(np.uint8))
        disc(ImageDraw.Draw(ref))
        box = (r.uniform(0, 0.04), r.uniform(0, 0.04), r.uniform(0, 0.04), r.uniform(0, 0.04))
        copies.append(_repost(ref, box, r.uniform(0.93, 1.07), r.randint(70, 90)))
        other = ref.copy()
        disc(ImageDraw.Draw(other))
        changed.append(_repost(other, box, 1.0, 80))
        refs.append(ref)
    cfg = VerifyConfig()
    ref_arrays = aligned_arrays(refs, cfg.aligned_side)
    q = aligned_arrays(copies, cfg.aligned_side)
    affine = register(q, ref_arrays, side=cfg.register_side)
    assert (worst_region_residual(q, ref_arrays, affine, blur=cfg.aligned_blur) <= cfg.max_residual / 2).all()
    assert (worst_region_residual(q, ref_arrays, affine, blur=0.0) > cfg.max_residual).sum() >= 3
    np.testing.assert_array_equal(aligned_check(q, ref_arrays, cfg), [True] * 8)
    changed_arrays = aligned_arrays(changed, cfg.aligned_side)
    np.testing.assert_array_equal(aligned_check(changed_arrays, ref_arrays, cfg), [False] * 8)


@pytest.mark.parametrize("sigma", [0.7, 1.0, 2.0])
def test_low_pass_is_scipys_gaussian_with_replicated_edges(sigma: float) -> None:
    from scipy.ndimage import gaussian_filter1d

    x = torch.rand(3, 2, 20, 28, generator=torch.Generator().manual_seed(0))
    radius = max(1, int(np.ceil(2.5 * sigma)))  # the same taps as scipy's truncated kernel
    want = x.double().numpy()
    for axis in (2, 3):
        want = gaussian_filter1d(want, sigma, axis=axis, mode="nearest", truncate=radius / sigma)
    np.testing.assert_allclose(_low_pass(x, sigma).numpy(), want, atol=1e-6)
    assert _low_pass(x, 0.0) is x


def test_nearest_keeps_each_rows_best_cosines() -> None:
    rng = np.random.default_rng(3)
    train = rng.integers(0, 7, 60)
    result = DedupResult(train, rng.integers(0, 9, 60), rng.random(60).astype(np.float32))
    unsure = np.flatnonzero(rng.random(60) < 0.8)
    for nearest in (1, 2, 0):
        kept, beyond = _nearest_only(result, unsure, nearest)
        expected = []
        for row in np.unique(train[unsure]):
            mine = unsure[train[unsure] == row]
            best = mine[np.argsort(-result.cosine[mine], kind="stable")]
            expected += best[: nearest or len(best)].tolist()
        assert kept.tolist() == sorted(expected)
        assert sorted(kept.tolist() + beyond.tolist()) == unsure.tolist()


def test_verification_stage_decides_by_aligned_pixels_in_batches(
    photos: dict[str, Image.Image], monkeypatch: pytest.MonkeyPatch
) -> None:
    import openalign.pipeline.verify as verify

    monkeypatch.setattr(verify, "_BATCH", 3)  # several batches and a partial last one
    names = sorted(photos)[:4]
    tests = [_square(photos[n]) for n in names]
    trains = [_repost(t, (0.03, 0.01, 0.0, 0.02), 1.05, 80) for t in tests]  # train i copies test i
    # Every train image pairs with every test image; train i's own original has the best cosine but for
    # train 3, whose best-ranked pair is a wrong one.
    tr, te = np.meshgrid(np.arange(4), np.arange(4), indexing="ij")
    tr, te = tr.ravel(), te.ravel()
    cosine = np.where(tr == te, 0.95, 0.9).astype(np.float32)
    cosine[(tr == 3) & (te == 0)] = 0.97
    result = DedupResult(tr, te, cosine, {})
    cfg = VerifyConfig(checks=["aligned"], nearest=0)
    everything = verify_pairs(result, iter(trains), iter(tests), threshold=0.975, band=0.2, config=cfg)
    assert sorted(zip(everything.train_idx.tolist(), everything.test_idx.tolist(), strict=True)) == [
        (i, i) for i in range(4)
    ]
    v = everything.stats["verification"]
    assert (v["pairs_verified"], v["accepted_by_aligned_pixels"], v["rejected"]) == (16, 4, 12)
    cfg.nearest = 1
    nearest = verify_pairs(result, iter(trains), iter(tests), threshold=0.975, band=0.2, config=cfg)
    assert sorted(zip(nearest.train_idx.tolist(), nearest.test_idx.tolist(), strict=True)) == [(0, 0), (1, 1), (2, 2)]
    v = nearest.stats["verification"]
    assert (v["pairs_verified"], v["pairs_beyond_nearest"], v["accepted_by_aligned_pixels"]) == (4, 12, 3)


def test_a_saturation_edit_costs_nothing() -> None:
    # A saturated disc on a grey textured ground, and the same picture with its colours halved: luminance is
    # unchanged, so the copy's worst region (the disc) still matches; each channel's gain alone cannot undo
    # the edit, because the grey ground pins the gains at one.
    rng = np.random.default_rng(0)
    ground = (128 + 30 * rng.standard_normal((64, 64, 1))).clip(0, 255).repeat(3, 2).astype(np.uint8)
    image = Image.fromarray(ground)
    ImageDraw.Draw(image).ellipse((20, 20, 44, 44), fill=(230, 30, 40))
    copy = ImageEnhance.Color(image).enhance(0.5)
    q, r = aligned_arrays([copy], 64), aligned_arrays([image], 64)
    identity = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])
    assert worst_region_residual(q, r, identity)[0] < 0.05
    assert worst_region_residual(q.astype(np.float32) / 255, r.astype(np.float32) / 255, identity)[0] < 0.05


def test_the_coarse_screen_passes_copies_and_only_saves_work(photos: dict[str, Image.Image]) -> None:
    r = random.Random(2)
    refs = [_square(photos[n]) for n in sorted(photos)[:5]]
    copies = [_repost(ref, (0.04, 0.0, 0.02, 0.03), r.uniform(0.93, 1.07), 75, 1.2) for ref in refs]
    q, ref_arrays = aligned_arrays(copies, 64), aligned_arrays(refs, 64)
    cfg = VerifyConfig(max_coarse_residual=0.8)
    assert (coarse_residual(q, ref_arrays) <= cfg.max_coarse_residual).all()
    # Each copy against another photo: the screen turns most away, and the check's decisions are those of
    # registering and scoring every pair.
    others = np.roll(ref_arrays, 1, axis=0)
    assert (coarse_residual(q, others) > cfg.max_coarse_residual).sum() >= 3
    both = np.concatenate([ref_arrays, others])
    queries = np.concatenate([q, q])
    affine = register(queries, both, side=cfg.register_side)
    full = worst_region_residual(queries, both, affine, blur=cfg.aligned_blur) <= cfg.max_residual
    np.testing.assert_array_equal(aligned_check(queries, both, cfg), full)
    assert full.tolist() == [True] * 5 + [False] * 5
