"""The verification stage on real photographs: a heavy copy below the threshold is accepted, another picture of
the same scene above it rejected, the embedding alone decides outside the band, and OpenCV stays optional."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from openalign.bench.copy_detection import REFERENCES, _tiny, installed_photos
from openalign.config import ConfigError
from openalign.data.reposting import repost
from openalign.data.verification import VerifyConfig, decide, features, require_opencv, verify_pair

pytest.importorskip("cv2")


@pytest.fixture(scope="module")
def photos() -> dict[str, Image.Image]:
    return installed_photos(REFERENCES, 384)


def _heavy_copy(photo: Image.Image) -> Image.Image:
    # A 20 % re-crop, a caption bar, logo and watermark, a thumbnail and a low-quality JPEG at once.
    return repost(photo, [("crop", 1.0), ("overlay", 1.0), ("resize", 0.5), ("jpeg", 0.7)], random.Random(0))


def test_heavy_copy_below_threshold_is_accepted(photos: dict[str, Image.Image]) -> None:
    astronaut = photos["astronaut"]
    copy = _heavy_copy(astronaut)
    a, b = features(copy), features(astronaut, mirror=True)
    assert decide(0.95, a, b, threshold=0.975, band=0.05) == (True, "features")
    # Without verification the same cosine is a miss.
    assert decide(0.95, None, None, threshold=0.975, band=0.0) == (False, "embedding")
    # A mirrored copy matches the reference's mirrored features.
    mirrored = repost(astronaut, [("crop", 1.0), ("overlay", 0.7), ("mirror", 1.0)], random.Random(0))
    assert decide(0.95, features(mirrored), b, threshold=0.975, band=0.05) == (True, "features")


def test_other_half_of_the_scene_above_threshold_is_rejected(photos: dict[str, Image.Image]) -> None:
    china = photos["china"]
    w, h = china.size
    left, right = china.crop((0, 0, w // 2, h)), china.crop((w // 2, 0, w, h))
    # Same colours, same scene, no common pixels: not a copy even at a cosine above the threshold.
    assert decide(0.99, features(right), features(left, mirror=True), threshold=0.975, band=0.05) == (
        False,
        "rejected",
    )
    coffee, chelsea = photos["coffee"], photos["chelsea"]
    assert decide(0.99, features(coffee), features(chelsea, mirror=True), threshold=0.975, band=0.05)[0] is False
    # Above the band the embedding decides alone, without features.
    assert decide(0.999, None, None, threshold=0.975, band=0.01) == (True, "embedding")


def test_resized_recompressed_copy_takes_the_phash_shortcut(photos: dict[str, Image.Image]) -> None:
    chelsea = photos["chelsea"]
    copy = repost(chelsea, [("resize", 1.0), ("jpeg", 0.5)], random.Random(1))
    assert decide(0.96, features(copy), features(chelsea), threshold=0.975, band=0.05) == (True, "phash")


def test_missing_opencv_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from openalign.pipeline.dedup import DedupRunConfig, run_dedup

    monkeypatch.setitem(sys.modules, "cv2", None)  # import cv2 now raises ImportError
    with pytest.raises(ConfigError, match=r"verification needs OpenCV: pip install 'openalign\[verify\]'") as err:
        require_opencv()
    assert "\n" not in str(err.value)
    (tmp_path / "d").mkdir()
    cfg = DedupRunConfig(embedder=f"copy-detector:{tmp_path / 'd'}", verify=True)
    with pytest.raises(ConfigError, match="verification needs OpenCV"):
        run_dedup(tmp_path, tmp_path, tmp_path / "out", cfg)
    with pytest.raises(ConfigError, match=r"dedup\.verify needs the images"):
        DedupRunConfig(embedder="npy", verify=True).validate()
    with pytest.raises(ConfigError, match="verify_band"):
        DedupRunConfig(verify_band=1.5).validate()
    for combo in (0, 11):
        with pytest.raises(ConfigError, match="verify_combo"):
            DedupRunConfig(verify_combo=combo).validate()
    with pytest.raises(ConfigError, match="min_inliers"):
        VerifyConfig(min_inliers=2).validate()


def test_dedup_reports_who_decided_each_pair(photos: dict[str, Image.Image], tmp_path: Path) -> None:
    from openalign.model.copy_detector import CopyDetector
    from openalign.pipeline.dedup import DedupRunConfig, Embedder, EmbedderSpec, run_dedup

    china = photos["china"]
    w, h = china.size
    train_dir, test_dir = tmp_path / "train", tmp_path / "test"
    train_dir.mkdir()
    test_dir.mkdir()
    _heavy_copy(photos["astronaut"]).save(train_dir / "a_copy.png")
    china.crop((w // 2, 0, w, h)).save(train_dir / "china_right.png")
    photos["grace_hopper"].save(train_dir / "hopper.png")
    photos["astronaut"].save(test_dir / "astronaut.png")
    china.crop((0, 0, w // 2, h)).save(test_dir / "china_left.png")

    class TinyImages(Embedder):
        # The plain tiny-image descriptor spreads these photos' cosines, where an untrained network maps them
        # all within 0.001 of each other.
        def embed(self, images: Iterable[Image.Image], *, batch_size: int = 64, progress: bool = False) -> np.ndarray:
            return _tiny(list(images))

    embedder = TinyImages(EmbedderSpec("copy-detector", tmp_path), CopyDetector())
    # The band (0.075, 1.875]: every pair the search finds goes to verification, so the pixels decide here.
    cfg = DedupRunConfig(embedder=f"copy-detector:{tmp_path}", verify=True, verify_band=0.9)
    run = run_dedup(train_dir, test_dir, tmp_path / "out", cfg, embedder=embedder)
    table = run.result.pairs_table(run.train_keys, run.test_keys)
    pairs = set(zip(table["train_key"].to_pylist(), table["test_key"].to_pylist(), strict=True))
    assert pairs == {("a_copy", "astronaut")}
    assert run.dropped_keys == ["a_copy"]
    assert run.result.stats["combo"] == min(cfg.verify_combo, run.result.stats["nearest"])  # the widened search's
    v = run.result.stats["verification"]
    train = np.load(tmp_path / "out" / "train_emb.npy")
    test = np.load(tmp_path / "out" / "test_emb.npy")
    cos = train @ test.T
    assert v["pairs_by_embedding"] == 0
    assert v["pairs_verified"] == int((cos > 0.975 - 0.9).sum()) >= 2  # the copy and at least one other pair
    assert v["accepted_by_phash"] + v["accepted_by_features"] == 1
    assert v["rejected"] == v["pairs_verified"] - v["accepted_by_phash"] - v["accepted_by_features"]
    saved = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert saved["verification"]["pairs_verified"] == v["pairs_verified"]


def test_shown_fraction_is_the_reference_area_inside_the_query() -> None:
    from openalign.data.verification import overlap_fractions, shown_fraction

    identity = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    assert shown_fraction(identity, (200, 100), (200, 100)) == 1.0
    # A thumbnail at half size and the picture embedded in a page show it all. (Keypoints sit at pixel centres,
    # so the thumbnail's pixel x is the reference's 2x + 0.5.)
    assert shown_fraction(identity * 2 + np.array([[0, 0, 0.5], [0, 0, 0.5]]), (100, 50), (200, 100)) == 1.0
    assert shown_fraction(identity + np.array([[0, 0, -300], [0, 0, -80]]), (800, 400), (200, 100)) == 1.0
    # A re-crop to 80 % of each side shows 64 % of it; a fit that squeezes the query onto a tenth of each side
    # of the reference shows 1 %.
    crop = identity + np.array([[0, 0, 20], [0, 0, 10]])
    assert shown_fraction(crop, (160, 80), (200, 100)) == pytest.approx(0.64)
    assert shown_fraction(identity * 0.1, (200, 100), (200, 100)) == pytest.approx(0.01)
    assert shown_fraction(np.zeros((2, 3)), (200, 100), (200, 100)) == 0.0
    # Turned by 45° about the centre of a square: the overlap is the regular octagon, 2(√2 - 1) of the square.
    c, h = np.cos(np.pi / 4), 49.5
    turn = np.array([[c, -c, h - c * h + c * h], [c, c, h - c * h - c * h]])
    assert shown_fraction(turn, (100, 100), (100, 100)) == pytest.approx(2 * (np.sqrt(2) - 1))
    # The share of the query inside the reference: all of a re-crop, a quarter of a page twice the picture's size.
    assert overlap_fractions(crop, (160, 80), (200, 100)) == pytest.approx((0.64, 1.0))
    page = identity + np.array([[0, 0, -100], [0, 0, -50]])
    assert overlap_fractions(page, (400, 200), (200, 100)) == pytest.approx((1.0, 0.25))
    half = identity + np.array([[0, 0, 100], [0, 0, 0]])  # the query's left half is the reference's right half
    assert overlap_fractions(half, (200, 100), (200, 100)) == pytest.approx((0.5, 0.5))


def test_a_zoom_into_a_detail_is_not_a_copy(photos: dict[str, Image.Image]) -> None:
    # The middle quarter of a photo blown up to full size matches it everywhere, by a fit that shows only a
    # quarter of the original: a detail, not a copy. Three fifths of each side (0.36 of it) still is one.
    cfg, no_rule = VerifyConfig(checks=["features"]), VerifyConfig(checks=["features"], min_shown=0.0)
    for name in ("astronaut", "chelsea", "camera"):
        photo = photos[name]
        w, h = photo.size
        reference = features(photo, cfg, mirror=True)

        def zoom(side: float, photo: Image.Image = photo, w: int = w, h: int = h) -> Image.Image:
            box = (round(w * 0.2), round(h * 0.2), round(w * (0.2 + side)), round(h * (0.2 + side)))
            return photo.crop(box).resize((w, h), Image.Resampling.BICUBIC)

        detail = features(zoom(0.5), cfg)
        assert verify_pair(detail, reference, no_rule)[:2] == (True, "features")
        assert verify_pair(detail, reference, cfg)[:2] == (False, "rejected")
        assert verify_pair(features(zoom(0.6), cfg), reference, cfg)[:2] == (True, "features")


def test_half_overlapping_crops_are_not_copies_unless_partial_copies_are_asked_for(
    photos: dict[str, Image.Image],
) -> None:
    # Two crops of one photograph, each two thirds of its width, share half of each: the fit shows half of the
    # reference and places half of the query inside it. A copy either shows most of its original or lies mostly
    # inside it, whatever it was cropped, turned, padded or pasted into.
    cfg, partial = VerifyConfig(checks=["features"]), VerifyConfig(checks=["features"], partial_copies=True)
    copies = {
        "crop": [("crop", 1.0)],
        "crop+rotate": [("crop", 1.0), ("rotate", 1.0)],
        "crop+pad": [("crop", 1.0), ("pad", 1.0)],
        "embed": [("embed", 1.0)],
        "crop+embed": [("crop", 0.67), ("embed", 0.67)],
    }
    for name in ("astronaut", "chelsea", "coffee"):
        photo = photos[name]
        w, h = photo.size
        left, right = photo.crop((0, 0, 2 * w // 3, h)), photo.crop((w // 3, 0, w, h))
        query, reference = features(left, cfg), features(right, cfg, mirror=True)
        assert verify_pair(query, reference, partial)[:2] == (True, "features")
        assert verify_pair(query, reference, cfg)[:2] == (False, "rejected")
        original = features(photo, cfg, mirror=True)
        for label, edits in copies.items():
            copy = features(repost(photo, edits, random.Random(0)), cfg)
            assert verify_pair(copy, original, cfg)[:2] == (True, "features"), (name, label)


def test_each_reference_keypoint_is_matched_once() -> None:
    # Thirty query keypoints with one descriptor (a repeated texture) all pick the same reference keypoint: one
    # match, not thirty, so no transform is fitted to them.
    from openalign.data.verification import _similarity

    cv2 = require_opencv()
    rng = np.random.default_rng(0)
    reference = rng.integers(0, 256, (40, 32), dtype=np.uint8)
    query = np.repeat(reference[:1], 30, axis=0)
    points_q = rng.uniform(0, 100, (30, 2)).astype(np.float32)
    points_r = np.full((40, 2), 50.0, np.float32) + rng.normal(0, 0.5, (40, 2)).astype(np.float32)
    assert _similarity(cv2, points_q, query, points_r, reference, VerifyConfig()) == (0, None)
    # Distinct descriptors in a shifted layout fit, with every keypoint an inlier.
    inliers, transform = _similarity(
        cv2, points_r[:30] * 3, reference[:30], points_r[:30] * 3 + 5, reference[:30], VerifyConfig()
    )
    assert inliers == 30 and transform is not None and np.allclose(transform[:, 2], 5, atol=0.5)


def test_feature_votes_are_ratio_tested_nearest_descriptors_counted_by_hand(photos: dict[str, Image.Image]) -> None:
    from openalign.data.verification import FeatureVotes

    cfg = VerifyConfig(keypoints=200)
    refs = [features(photos[name], cfg, mirror=True) for name in ("astronaut", "chelsea", "coffee")]
    query = features(repost(photos["chelsea"], [("crop", 0.5), ("jpeg", 0.5)], random.Random(0)), cfg)
    votes = FeatureVotes(refs, cfg).votes(query)
    # By hand: every indexed descriptor's Hamming distance to every query descriptor, the two nearest, the ratio.
    pool = np.concatenate([d for f in refs for d in (f.descriptors, f.mirror_descriptors)])
    owner = np.concatenate(
        [np.full(len(d), i) for i, f in enumerate(refs) for d in (f.descriptors, f.mirror_descriptors)]
    )
    bits = np.unpackbits(query.descriptors[:, None, :] ^ pool[None, :, :], axis=2).sum(2)
    nearest = np.sort(bits, axis=1)[:, :2]
    passed = nearest[:, 0] < cfg.ratio * nearest[:, 1]
    # Ties for the nearest are left out of the comparison: which of two equal descriptors FAISS returns is its own.
    unique = (bits == nearest[:, :1]).sum(1) == 1
    expected = np.bincount(owner[bits.argmin(1)[passed & unique]], minlength=3)
    assert (
        votes.sum() == passed.sum()
        and np.all(votes >= expected)
        and votes.sum() - expected.sum() <= (passed & ~unique).sum()
    )
    assert votes.argmax() == 1 and votes[1] >= 10 * max(votes[0], votes[2], 1)


def test_a_picture_embedded_in_a_page_draws_the_votes_of_its_original(photos: dict[str, Image.Image]) -> None:
    from openalign.data.verification import FeatureVotes

    cfg = VerifyConfig()
    names = ["astronaut", "chelsea", "coffee", "camera", "coins"]
    refs = [features(photos[n], cfg, mirror=True) for n in names]
    votes = FeatureVotes(refs, cfg)
    rng = random.Random(1)
    for strength in (0.67, 1.0):  # the picture fills 60 % and 40 % of each side of the page
        page = features(repost(photos["coffee"], [("embed", strength)], rng), cfg)
        counted = votes.votes(page)
        # Its original draws hundreds (297 and 206 when this was written), any other photo about as many as
        # chance gives 1,000 keypoints (at most 11): a candidate or two more, which feature matching rejects.
        assert counted.argmax() == 2 and counted[2] >= 10 * np.delete(counted, 2).max()
        assert 2 in votes.candidates(page)
        assert [verify_pair(page, r, cfg)[0] for r in refs] == [n == "coffee" for n in names]
    # A photo that copies none of them draws no more than chance.
    assert votes.votes(features(photos["rocket"], cfg)).max() < 3 * cfg.min_votes
    with pytest.raises(ConfigError, match="min_votes"):
        VerifyConfig(min_votes=0).validate()


def test_a_test_image_present_twice_keeps_its_votes(photos: dict[str, Image.Image]) -> None:
    # Lowe's ratio test compares a descriptor's two nearest references: a twin of the original would be the
    # second nearest of every match and fail them all, so twins are indexed once and share the votes.
    from openalign.data.verification import FeatureVotes

    cfg = VerifyConfig()
    names = ["astronaut", "chelsea", "coffee"]
    refs = [features(photos[n], cfg, mirror=True) for n in names]
    twin = features(photos["chelsea"].copy(), cfg, mirror=True)  # the same pixels, decoded twice
    copy = features(repost(photos["chelsea"], [("crop", 0.5), ("jpeg", 0.5)], random.Random(0)), cfg)
    alone = FeatureVotes(refs, cfg).votes(copy)
    twinned = FeatureVotes([*refs, twin], cfg).votes(copy)
    assert alone[1] >= 10 * cfg.min_votes
    assert twinned.tolist() == [*alone.tolist(), alone[1]]
    assert set(FeatureVotes([*refs, twin], cfg).candidates(copy).tolist()) == {1, 3}


def test_dedup_with_votes_finds_a_picture_pasted_into_a_page(photos: dict[str, Image.Image], tmp_path: Path) -> None:
    from openalign.model.copy_detector import CopyDetector
    from openalign.pipeline.dedup import DedupRunConfig, Embedder, EmbedderSpec, run_dedup

    train_dir, test_dir = tmp_path / "train", tmp_path / "test"
    train_dir.mkdir()
    test_dir.mkdir()
    repost(photos["astronaut"], [("embed", 1.0)], random.Random(0)).save(train_dir / "page.png")
    repost(photos["chelsea"], [("resize", 1.0), ("jpeg", 0.5)], random.Random(0)).save(train_dir / "cat_copy.png")
    photos["grace_hopper"].save(train_dir / "hopper.png")
    for name in ("astronaut", "chelsea", "coffee"):
        photos[name].save(test_dir / f"{name}.png")

    class TinyImages(Embedder):
        def embed(self, images: Iterable[Image.Image], *, batch_size: int = 64, progress: bool = False) -> np.ndarray:
            return _tiny(list(images))

    embedder = TinyImages(EmbedderSpec("copy-detector", tmp_path), CopyDetector())
    runs = {}
    for votes in (False, True):
        cfg = DedupRunConfig(
            embedder=f"copy-detector:{tmp_path}", verify=True, verify_band=0.9, verify_votes=votes, threshold=0.975
        )
        runs[votes] = run_dedup(train_dir, test_dir, tmp_path / f"out{votes}", cfg, embedder=embedder)
    train = np.load(tmp_path / "outTrue" / "train_emb.npy")
    test = np.load(tmp_path / "outTrue" / "test_emb.npy")
    keys = runs[True].train_keys
    page, cat = keys.index("page"), keys.index("cat_copy")
    cos = train @ test.T
    # The tiny image of a page holding the astronaut is as far from it as from the others, below the band.
    astronaut = runs[True].test_keys.index("astronaut")
    # The tiny image of a page holding the astronaut is far from it (the search's widened threshold is 0.075),
    # while the thumbnail of the cat is close to its original.
    assert cos[page, astronaut] <= 0.975 - 0.9 < cos[cat, runs[True].test_keys.index("chelsea")]
    assert runs[False].dropped_keys == ["cat_copy"]
    assert runs[True].dropped_keys == ["cat_copy", "page"]
    v = runs[True].result.stats["verification"]
    assert v["accepted_voted"] == 1 and v["pairs_voted"] >= 1
    assert v["pairs_verified"] == runs[False].result.stats["verification"]["pairs_verified"]
    table = runs[True].result.pairs_table(runs[True].train_keys, runs[True].test_keys)
    row = table["train_key"].to_pylist().index("page")
    assert table["test_key"][row].as_py() == "astronaut"
    assert table["cosine"][row].as_py() == pytest.approx(
        float(cos[page, runs[True].test_keys.index("astronaut")]), abs=1e-5
    )
    with pytest.raises(ConfigError, match="verify_votes"):
        DedupRunConfig(verify_votes=True).validate()


def test_verify_votes_implies_verification(tmp_path: Path) -> None:
    """The pairs votes find are verified, so asking for votes turns verification on; they still need the
    images and the features check, each a one-line error naming verify_votes."""
    from openalign.pipeline.dedup import DedupRunConfig

    cfg = DedupRunConfig(embedder=f"copy-detector:{tmp_path}", verify_votes=True)
    cfg.validate()
    assert cfg.verify
    with pytest.raises(ConfigError, match="verify_votes needs the images"):
        DedupRunConfig(verify_votes=True).validate()
    phash_only = VerifyConfig(checks=["phash"])
    with pytest.raises(ConfigError, match="verify_votes needs the features check"):
        DedupRunConfig(embedder=f"copy-detector:{tmp_path}", verify_votes=True, verification=phash_only).validate()


def test_votes_bookkeeping_agrees_across_stdout_stats_and_csv(photos: dict[str, Image.Image], tmp_path: Path) -> None:
    """Every pair in duplicates.csv is counted once in stats.json and on stdout, each says which check accepted it
    and whether the search or the votes proposed it, and the summary calls only the pairs above the threshold
    pairs above it."""
    import csv

    from openalign.cli.data import dedup_summary
    from openalign.model.copy_detector import CopyDetector
    from openalign.pipeline.dedup import DedupRunConfig, Embedder, EmbedderSpec, run_dedup

    train_dir, test_dir = tmp_path / "train", tmp_path / "test"
    train_dir.mkdir()
    test_dir.mkdir()
    repost(photos["astronaut"], [("embed", 1.0)], random.Random(0)).save(train_dir / "page.png")
    repost(photos["chelsea"], [("resize", 1.0), ("jpeg", 0.5)], random.Random(0)).save(train_dir / "cat_copy.png")
    photos["coffee"].save(train_dir / "coffee_same.png")
    photos["grace_hopper"].save(train_dir / "hopper.png")
    for name in ("astronaut", "chelsea", "coffee"):
        photos[name].save(test_dir / f"{name}.png")

    class TinyImages(Embedder):
        def embed(self, images: Iterable[Image.Image], *, batch_size: int = 64, progress: bool = False) -> np.ndarray:
            return _tiny(list(images))

    embedder = TinyImages(EmbedderSpec("copy-detector", tmp_path), CopyDetector())
    # The exact copy of coffee (cosine 1) is above the band, where the embedding decides, the cat's thumbnail
    # (0.9996) in it, where the pixels decide, and the page far below it, where only the votes find it.
    cfg = DedupRunConfig(
        embedder=f"copy-detector:{tmp_path}", verify_band=0.0009, verify_votes=True, threshold=0.999, verify_combo=1
    )
    run = run_dedup(train_dir, test_dir, tmp_path / "out", cfg, embedder=embedder)
    with open(tmp_path / "out" / "duplicates.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    got = {(r["train_key"], r["test_key"]): (r["decided_by"], r["proposed_by"]) for r in rows}
    assert set(got) == {("page", "astronaut"), ("cat_copy", "chelsea"), ("coffee_same", "coffee")}
    assert got[("coffee_same", "coffee")] == ("embedding", "search")
    assert got[("cat_copy", "chelsea")][0] in {"aligned", "phash", "features"}
    assert got[("cat_copy", "chelsea")][1] == "search"
    assert got[("page", "astronaut")] == ("features", "votes")
    assert stats["duplicate_pairs"] == len(rows) == run.duplicate_pairs == 3
    above = sum(float(r["cosine"]) > 0.999 for r in rows)
    assert stats["pairs_above_threshold"] == above == 2
    v = stats["verification"]
    band = v["accepted_by_aligned_pixels"] + v["accepted_by_phash"] + v["accepted_by_features"] + v["rejected"]
    assert band == v["pairs_verified"]
    voted = v["voted"]
    assert sum(voted.values()) == v["pairs_voted"] >= 1 and v["accepted_voted"] == voted["features"] == 1
    summary = "\n".join(dedup_summary(run))
    assert f"{len(rows)} near-duplicate pairs ({above} with cosine > 0.9990" in summary
    assert f"{len(rows) - above} below it, accepted by their pixels; 1 proposed by votes" in summary
    assert f"proposed by votes: {v['pairs_voted']} pairs, " in summary
    assert f"(cosine in (0.998, 1.000]): {v['pairs_verified']} pairs, " in summary
