"""Reposting transformations, the copy-detection benchmark's scores and the pHash, checked against plain
references (sklearn's average precision, scipy's DCT, brute-force counting)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from PIL import Image

from openalign.bench.copy_detection import (
    REFERENCES,
    CopyBenchSettings,
    installed_photos,
    make_queries,
    micro_average_precision,
    recall_at_fpr,
)
from openalign.config import ConfigError
from openalign.data.reposting import TRANSFORMS, random_repost, repost
from openalign.data.verification import phash


@pytest.fixture(scope="module")
def photo() -> Image.Image:
    photos = installed_photos(REFERENCES, 256)
    assert "astronaut" in photos and "chelsea" in photos  # scikit-image is a dev dependency
    return photos["astronaut"]


def test_every_transformation_changes_the_photo_and_strength_zero_is_identity_for_geometry(photo: Image.Image) -> None:
    base = np.asarray(photo, np.int16)
    for name in TRANSFORMS:
        out = repost(photo, [(name, 1.0)], random.Random(0))
        assert out.mode == "RGB"
        same_shape = out.size == photo.size and np.array_equal(np.asarray(out, np.int16), base)
        assert not same_shape, name
    for name in ("crop", "pad", "rotate", "grey", "embed", "mirror"):
        out = repost(photo, [(name, 0.0)], random.Random(0))
        assert out.size == photo.size and np.array_equal(np.asarray(out, np.int16), base), name


def test_transformation_geometry(photo: Image.Image) -> None:
    w, h = photo.size
    crop = repost(photo, [("crop", 1.0)], random.Random(1))
    assert crop.size == (round(w * 0.8), round(h * 0.8))
    # The crop is a window of the photo: it equals the photo at some offset.
    arr, small = np.asarray(photo), np.asarray(crop)
    found = any(
        np.array_equal(arr[y : y + small.shape[0], x : x + small.shape[1]], small)
        for y in range(h - small.shape[0] + 1)
        for x in range(w - small.shape[1] + 1)
    )
    assert found
    mirrored = repost(photo, [("mirror", 1.0)], random.Random(0))
    assert np.array_equal(np.asarray(mirrored), np.asarray(photo)[:, ::-1])
    grey = np.asarray(repost(photo, [("grey", 1.0)], random.Random(0)), np.int16)
    assert np.abs(grey[..., 0] - grey[..., 1]).max() <= 1
    embedded = repost(photo, [("embed", 1.0)], random.Random(2))
    assert embedded.size == (round(w / 0.4), round(h / 0.4))
    padded = repost(photo, [("pad", 1.0)], random.Random(3))
    assert padded.size in {(w, h + 2 * round(h * 0.3)), (w + 2 * round(w * 0.3), h)}


def test_compose_and_bad_input(photo: Image.Image) -> None:
    a = repost(photo, [("crop", 0.5), ("jpeg", 1.0)], random.Random(5))
    b = repost(repost(photo, [("crop", 0.5)], random.Random(5)), [("jpeg", 1.0)], random.Random(0))
    assert np.array_equal(np.asarray(a), np.asarray(b))  # the JPEG edit draws nothing from the rng
    out, plan = random_repost(photo, random.Random(0), edits=3)
    assert len(plan) == 3 and len({n for n, _ in plan}) == 3 and out.mode == "RGB"
    with pytest.raises(ConfigError, match="unknown transformation 'blur'"):
        repost(photo, [("blur", 0.5)], random.Random(0))
    with pytest.raises(ConfigError, match="strength of crop"):
        repost(photo, [("crop", 1.5)], random.Random(0))


def test_micro_average_precision_matches_sklearn() -> None:
    from sklearn.metrics import average_precision_score

    rng = np.random.default_rng(0)
    for _ in range(5):
        scores = rng.standard_normal((40, 7))
        positive = rng.random((40, 7)) < 0.1
        positive[0, 0] = True
        assert micro_average_precision(scores, positive) == pytest.approx(
            average_precision_score(positive.ravel(), scores.ravel()), abs=1e-12
        )


def test_recall_at_fpr_by_counting() -> None:
    rng = np.random.default_rng(1)
    scores = rng.standard_normal((200, 10))
    positive = rng.random((200, 10)) < 0.2
    for fpr in (0.0, 0.001, 0.01, 0.1):
        recall, threshold = recall_at_fpr(scores, positive, fpr)
        neg, pos = scores[~positive], scores[positive]
        # At most fpr of the false pairs score above the threshold, and no lower threshold keeps that true.
        assert (neg > threshold).sum() <= fpr * len(neg)
        assert (neg >= threshold).sum() > fpr * len(neg)
        assert recall == pytest.approx((pos > threshold).sum() / len(pos))


def test_phash_matches_scipy_dct(photo: Image.Image) -> None:
    from scipy.fft import dctn

    grey = np.asarray(photo.convert("L").resize((32, 32), Image.Resampling.LANCZOS), dtype=np.float64)
    low = dctn(grey, norm="ortho")[:8, :8].ravel()
    expected = sum(1 << i for i, b in enumerate(low > np.median(low[1:])) if b)
    assert phash(photo) == expected
    # A resized, re-compressed copy keeps the hash almost whole; another photo does not.
    copy = repost(photo, [("resize", 1.0), ("jpeg", 0.6)], random.Random(0))
    other = installed_photos(REFERENCES, 256)["chelsea"]
    assert bin(phash(copy) ^ phash(photo)).count("1") <= 6
    assert bin(phash(other) ^ phash(photo)).count("1") > 16


def test_queries_cover_every_transformation(photo: Image.Image) -> None:
    s = CopyBenchSettings(strengths=[0.5, 1.0], mixed=2, distractor_copies=2)
    refs = [photo.resize((64, 64)), photo.rotate(90).resize((64, 64))]
    q = make_queries(refs, [photo.crop((0, 0, 60, 60))], s)
    per_ref = (len(TRANSFORMS) - 1) * 2 + 1 + 2
    assert len(q.images) == 2 * per_ref + 2
    assert q.source.count(0) == q.source.count(1) == per_ref and q.source.count(-1) == 2
    assert set(q.kind) == {*TRANSFORMS, "mixed", "distractor"}
