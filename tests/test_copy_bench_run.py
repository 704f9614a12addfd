"""``run_copy_detection_bench`` end to end at a toy size (one strength, a detector trained for two steps),
and the verification stage's bookkeeping checked against counting by hand."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from openalign.bench.copy_detection import (
    REFERENCES,
    CopyBenchSettings,
    _FeatureCache,
    _verified,
    _with_votes,
    installed_photos,
    recall_at_fpr,
    run_copy_detection_bench,
)
from openalign.config import ConfigError
from openalign.data.reposting import TRANSFORMS, repost
from openalign.data.verification import VerifyConfig

METHODS = ["phash", "tiny-image", "detector-untrained", "detector", "detector+verify", "detector+verify+votes"]

pytest.importorskip("cv2")


def _tiny_settings(json_path: Path) -> CopyBenchSettings:
    return CopyBenchSettings(
        strengths=[1.0],
        mixed=1,
        distractor_copies=2,
        max_side=128,
        train_steps=2,
        train_batch=8,
        train_images=16,
        json_path=str(json_path),
    )


def test_bench_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = _tiny_settings(tmp_path / "copies.json")
    results = run_copy_detection_bench(s)
    printed = capsys.readouterr().out

    assert [m for m in results if m in METHODS] == METHODS
    kinds = sorted([*TRANSFORMS, "mixed"])
    for m in METHODS:
        r = results[m]
        assert 0 <= r["uAP"] <= 1 and 0 <= r["recall"] <= 1, m
        assert sorted(r["per_transform"]) == kinds, m
        for kind, cell in r["per_transform"].items():
            assert 0 <= cell["uAP"] <= 1 and 0 <= cell["recall"] <= 1, (m, kind)
    # A pure resize or JPEG re-encode keeps the perceptual hash almost whole.
    assert results["phash"]["per_transform"]["resize"]["recall"] >= 0.9
    assert results["phash"]["per_transform"]["jpeg"]["recall"] >= 0.9

    # Every pair is below the band, above it, or decided by exactly one verification step.
    header = printed.splitlines()[0]
    n_pairs = int(header.split(" pairs;")[0].rsplit(", ", 1)[1])
    n_refs, n_queries = int(header.split()[0]), int(header.split(", ")[1].split()[0])
    assert n_pairs == n_refs * n_queries
    v = results["verification"]
    assert v["below"] + v["by_embedding"] + v["aligned"] + v["phash"] + v["features"] + v["rejected"] == n_pairs
    assert v["band"][1] - v["band"][0] == pytest.approx(2 * s.verify_band)
    # The band is centred on the detector's operating threshold, read at the false-positive rate.
    assert (v["band"][0] + v["band"][1]) / 2 == pytest.approx(results["detector"]["threshold"])
    assert v["images_described"] <= n_refs + n_queries
    votes = results["votes"]
    assert votes["pairs_voted"] == votes["aligned"] + votes["phash"] + votes["features"] + votes["rejected"]
    assert votes["pairs_voted"] <= v["below"]  # only pairs the band left below it
    assert votes["images_described"] == n_refs + n_queries  # votes need every image's descriptors

    lines = printed.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("recall at"))) + 1 :]
    assert table[0].split() == METHODS
    assert [row.split()[0] for row in table[1 : 2 + len(kinds)]] == ["overall", *kinds]
    overall = table[1].split()
    assert float(overall[1]) == pytest.approx(results["phash"]["recall"], abs=0.005)
    assert any(line.startswith("verification in cosine band") for line in lines)

    written = json.loads((tmp_path / "copies.json").read_text())
    assert written["verification"] == v
    for m in METHODS:
        assert written[m]["uAP"] == pytest.approx(results[m]["uAP"])


def test_verification_counts_and_ranks_by_hand() -> None:
    photos = installed_photos(REFERENCES, 128)
    refs = [photos["astronaut"], photos["chelsea"], photos["coffee"]]
    rng = random.Random(0)
    queries = [
        repost(refs[0], [("resize", 1.0)], rng),  # pHash accepts
        repost(refs[1], [("crop", 0.6)], rng),  # a crop: features decide
        photos["camera"],  # not a copy of anything
    ]
    cosine = np.array([[0.95, 0.10, 0.50], [0.20, 0.85, 0.79], [0.30, 0.88, 0.40]])
    s = CopyBenchSettings(verify_band=0.1, verify=VerifyConfig(checks=["phash", "features"]))
    out, counts = _verified(cosine, queries, refs, 0.9, s)
    band = (cosine > 0.8) & (cosine <= 1.0)
    assert counts["by_embedding"] == 0 and counts["below"] == int((~band).sum())
    assert counts["phash"] + counts["features"] + counts["rejected"] == int(band.sum())
    # Features are computed once per image in the band: 3 queries and the 2 references they meet.
    assert counts["images_described"] == 3 + 2
    np.testing.assert_array_equal(out[~band], cosine[~band])
    assert out[0, 0] == pytest.approx(2.95)  # accepted: above every unverified pair
    assert out[2, 1] == pytest.approx(0.88 - 4)  # another photo: below every unverified pair
    assert counts["phash"] >= 1 and counts["rejected"] >= 1
    # Recall at the fpr only rises when verification keeps the copies and drops the other photo.
    positive = np.array([[True, False, False], [False, True, False], [False, False, False]])
    assert recall_at_fpr(out, positive, 0.0)[0] >= recall_at_fpr(cosine, positive, 0.0)[0]
    # With the aligned check first, both copies (a thumbnail, a 12 % re-crop) are accepted by their registered
    # pixels, and only the other photo's pairs are left for feature matching, which rejects them.
    out, counts = _verified(cosine, queries, refs, 0.9, CopyBenchSettings(verify_band=0.1))
    assert counts["aligned"] == 2 and counts["phash"] + counts["features"] == 0
    assert counts["rejected"] == int(band.sum()) - 2
    assert out[0, 0] == pytest.approx(2.95) and out[1, 1] == pytest.approx(2.85)
    assert out[2, 1] == pytest.approx(0.88 - 4)


def test_bad_settings() -> None:
    with pytest.raises(ConfigError, match="train_steps"):
        run_copy_detection_bench(CopyBenchSettings(train_steps=0))
    with pytest.raises(ConfigError, match="verify_band"):
        run_copy_detection_bench(CopyBenchSettings(verify_band=-0.1))
    with pytest.raises(ConfigError, match="train_seconds"):
        run_copy_detection_bench(CopyBenchSettings(train_seconds=0.0))


def test_fixed_threshold_and_zero_band_leave_scores_alone(tmp_path: Path) -> None:
    photos = installed_photos(REFERENCES, 64)
    refs = [photos["astronaut"], photos["chelsea"]]
    cosine = np.array([[0.99, 0.2], [0.3, 0.97]])
    out, counts = _verified(cosine, refs, refs, 0.975, CopyBenchSettings(verify_band=0.0))
    np.testing.assert_array_equal(out, cosine)
    assert counts == {
        "by_embedding": 1,
        "below": 3,
        "aligned": 0,
        "phash": 0,
        "features": 0,
        "rejected": 0,
        "images_described": 0,
    }


def test_votes_bring_a_picture_embedded_in_a_page_to_verification() -> None:
    photos = installed_photos(REFERENCES, 256)
    refs = [photos["astronaut"], photos["chelsea"], photos["coffee"]]
    rng = random.Random(0)
    queries = [repost(refs[2], [("embed", 1.0)], rng), photos["camera"]]
    # The embedding ranks the page's copy below the band, as the bench's detector does, and the unrelated
    # photo higher still.
    cosine = np.array([[0.40, 0.50, 0.45], [0.55, 0.60, 0.58]])
    s = CopyBenchSettings(verify_band=0.1)
    cache = _FeatureCache(queries, refs, s.verify)
    verified, counts = _verified(cosine, queries, refs, 0.9, s, cache)
    assert counts["below"] == cosine.size and counts["images_described"] == 0
    np.testing.assert_array_equal(verified, cosine)
    out, voted = _with_votes(verified, cosine, 0.8, cache, s)
    assert out[0, 2] == pytest.approx(2.45)  # voted for, then accepted by feature matching: above everything
    assert voted["features"] == 1 and voted["pairs_voted"] == 1 + voted["rejected"]
    decided = np.zeros_like(out, bool)
    decided[0, 2] = True
    assert np.all(
        (out[~decided] == cosine[~decided]) | (out[~decided] == cosine[~decided] - 4)
    )  # rejected or not voted
    positive = np.zeros_like(out, bool)
    positive[0, 2] = True
    assert recall_at_fpr(out, positive, 0.0)[0] == 1.0 and recall_at_fpr(cosine, positive, 0.0)[0] == 0.0
