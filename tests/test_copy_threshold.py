"""The copy detector's fitted operating threshold: the fitting against sort-and-count references, the held-out
fit written by training, and dedup using it unless a threshold is given."""

from __future__ import annotations

import contextlib
import csv
import io
import itertools
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from openalign.cli import main
from openalign.data.synthetic import SyntheticWorld
from openalign.pipeline.copy_threshold import fit_threshold, negative_scores, operating_threshold

RATES = [0.0, 1e-4, 1e-3, 0.01, 0.05, 0.2, 0.5]


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _reference_threshold(negatives: np.ndarray, rate: float) -> float:
    """Lowest candidate t (−1 or a negative score) with #(negatives > t) ≤ rate × N, by sorting and counting."""
    for t in sorted({-1.0, *negatives.tolist()}):
        if (negatives > t).sum() <= rate * len(negatives) * (1 + 1e-12):
            return t
    raise AssertionError("the highest score always qualifies")


def _count_above(scores: np.ndarray, t: float, count: int, eps: float = 1e-6) -> bool:
    """``count`` is #(scores > t), up to scores within ``eps`` of t (float32 and float64 sums round apart)."""
    return bool((scores > t + eps).sum() <= count <= (scores > t - eps).sum())


def _all_negative_pairs(emb: np.ndarray, groups: np.ndarray) -> np.ndarray:
    scores = emb.astype(np.float64) @ emb.astype(np.float64).T
    return np.array([scores[i, j] for i in range(len(emb)) for j in range(i + 1, len(emb)) if groups[i] != groups[j]])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_operating_threshold_is_the_lowest_meeting_the_rate(seed: int) -> None:
    rng = np.random.default_rng(seed)
    negatives = np.round(rng.uniform(-1, 0.99, 3000), 2)  # rounded: many ties
    previous = 2.0
    for rate in RATES:
        t = operating_threshold(negatives, len(negatives), rate)
        assert t == pytest.approx(_reference_threshold(negatives, rate))
        assert (negatives > t).sum() <= rate * len(negatives) + 1e-9
        assert t <= previous  # a looser rate never raises the threshold
        previous = t


def test_operating_threshold_needs_enough_top_scores() -> None:
    with pytest.raises(ValueError, match="highest negative scores"):
        operating_threshold(np.array([0.9, 0.8]), 1000, 0.01)  # k = 10 needs 11 scores


@pytest.mark.parametrize("block", [1, 7, 64])
def test_negative_scores_match_all_pairs(block: int) -> None:
    rng = np.random.default_rng(block)
    emb = _unit(rng.normal(size=(40, 8)))
    groups = rng.integers(0, 12, 40)
    grid = np.linspace(-1, 1, 21)
    above, top, total = negative_scores(emb, groups, grid, keep=25, block=block)
    brute = _all_negative_pairs(emb, groups)
    assert total == len(brute)
    np.testing.assert_array_equal(above, [(brute > t).sum() for t in grid])
    np.testing.assert_allclose(np.sort(top), np.sort(brute)[-25:], atol=1e-6)


def test_fit_moves_with_the_rate_and_its_curve_is_monotone() -> None:
    rng = np.random.default_rng(5)
    base = _unit(rng.normal(size=(30, 16)))
    copies = _unit(np.repeat(base, 2, axis=0) + 0.3 * rng.normal(size=(60, 16)))
    emb = np.concatenate([base, copies])
    groups = np.concatenate([np.arange(30), np.repeat(np.arange(30), 2)])
    positives = (copies * np.repeat(base, 2, axis=0)).sum(-1)
    brute = _all_negative_pairs(emb, groups)
    previous = 2.0
    for rate in RATES:
        fit = fit_threshold(positives, emb, groups, rate, block=16)
        assert fit.threshold == pytest.approx(_reference_threshold(brute, rate), abs=1e-6)
        assert fit.threshold <= previous
        previous = fit.threshold
        assert fit.negative_pairs == len(brute) and _count_above(brute, fit.threshold, fit.false_positives)
        assert _count_above(positives, fit.threshold, fit.true_positives)
        assert fit.false_positive_rate <= rate + 1e-12
        thresholds = [row["threshold"] for row in fit.curve]
        assert thresholds == sorted(thresholds) and fit.threshold in thresholds
        for row in fit.curve:
            tp, fp = row["true_positives"], row["false_positives"]
            assert _count_above(positives, row["threshold"], tp) and _count_above(brute, row["threshold"], fp)
            assert row["precision"] == (pytest.approx(tp / (tp + fp)) if tp + fp else None)
            assert row["recall"] == pytest.approx(tp / len(positives))
            assert row["false_positive_rate"] == pytest.approx(fp / len(brute))
        recall = [row["recall"] for row in fit.curve]
        fpr = [row["false_positive_rate"] for row in fit.curve]
        assert all(a >= b for a, b in itertools.pairwise(recall))
        assert all(a >= b for a, b in itertools.pairwise(fpr))


# --------------------------------------------------------------------------------------------------
# Training writes the fit; dedup uses it


def _folder(root: Path, n: int, seed: int = 4) -> Path:
    world = SyntheticWorld(seed=seed, image_size=32)
    root.mkdir(parents=True)
    for i in range(n):
        world.render(world.scene(i)).save(root / f"s{i:02d}.png")
    return root


TINY = ["--image-size", "16", "--steps", "1", "--batch-size", "4", "--warmup-steps", "0", "--embed-dim", "16"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """One tiny detector trained on 8 images with 6 held out (the only training in this file), and what it said."""
    root = tmp_path_factory.mktemp("copy_threshold")
    images, detector = _folder(root / "images", 14), root / "detector"
    held = ["--max-images", "8", "--fit.holdout", "6", "--fit.copies", "2", "--fit.max_false_positive_rate", "0.05"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["copy-detector", "train", str(images), str(detector), *TINY, *held, "--quiet"]) == 0
    return images, detector, out.getvalue()


def test_training_fits_a_threshold_on_held_out_images(trained: tuple[Path, Path, str]) -> None:
    _, detector, said = trained
    assert "fitted threshold" in said and "on 6 held-out images" in said and "12 image–copy pairs" in said
    meta = json.loads((detector / "config.json").read_text())
    fit = meta["train"]["threshold"]
    # 18 rows (6 images + 12 copies), 153 pairs, 18 of them within an image's group (3 per image).
    assert fit["negative_pairs"] == 153 - 18 and fit["positive_pairs"] == 12 and fit["holdout_images"] == 6
    assert fit["false_positive_rate"] <= fit["max_false_positive_rate"] == 0.05
    assert fit["false_positives"] == math.floor(0.05 * 135)  # the rate allows 6; ties aside, exactly 6 are above
    with (detector / "threshold_curve.csv").open() as f:
        rows = list(csv.DictReader(f))
    recall = [float(r["recall"]) for r in rows]
    fpr = [float(r["false_positive_rate"]) for r in rows]
    assert any(float(r["threshold"]) == pytest.approx(fit["value"]) for r in rows)
    assert all(a >= b for a, b in itertools.pairwise(recall))
    assert all(a >= b for a, b in itertools.pairwise(fpr))


def test_holding_out_leaves_the_training_images_as_they_were(trained: tuple[Path, Path, str]) -> None:
    from PIL import Image

    from openalign.pipeline.copy_detector import _prepare

    images = [Image.open(p) for p in sorted(trained[0].glob("*.png"))]
    plain, plain_copies, _ = _prepare(images, 16, 8, False, reposts=2)
    held: list[Image.Image] = []
    arrays, copies, _ = _prepare(images, 16, 8, False, held, 6, reposts=2)
    np.testing.assert_array_equal(arrays, plain)  # same arrays, same order: training is unchanged
    np.testing.assert_array_equal(copies, plain_copies)  # and the same reposted copies of them
    assert copies.shape == (8, 2, 3, 16, 16)
    assert [im.tobytes() for im in held] == [im.convert("RGB").tobytes() for im in images[8:14]]
    fewer: list[Image.Image] = []
    _prepare(images, 16, 8, False, fewer, 3)
    assert len(fewer) == 3


def test_dedup_uses_the_fitted_threshold_unless_one_is_given(
    trained: tuple[Path, Path, str], tmp_path: Path, capsys
) -> None:
    images, test = trained[0], _folder(tmp_path / "test", 4, seed=9)
    detector = tmp_path / "detector"
    shutil.copytree(trained[1], detector)
    fitted = json.loads((detector / "config.json").read_text())["train"]["threshold"]["value"]
    capsys.readouterr()

    def dedup(out: str, *extra: str) -> dict:
        cmd = ["dedup", str(images), str(test), str(tmp_path / out), "--embedder", f"copy-detector:{detector}"]
        assert main([*cmd, "--clusters", "2", "--quiet", *extra]) == 0
        stats = json.loads((tmp_path / out / "stats.json").read_text())
        train_emb, test_emb = np.load(tmp_path / out / "train_emb.npy"), np.load(tmp_path / out / "test_emb.npy")
        cos = train_emb.astype(np.float64) @ test_emb.astype(np.float64).T
        # --clusters 2 --nearest 2 puts every pair in one bucket: the pairs are all those above the threshold.
        assert stats["duplicate_pairs"] == (cos > stats["threshold"]).sum()
        return stats

    stats = dedup("auto", "--nearest", "2", "--combo", "1")
    assert stats["threshold_source"] == "detector" and stats["threshold"] == pytest.approx(fitted)
    assert "fitted by the copy detector" in capsys.readouterr().out
    stats = dedup("given", "--nearest", "2", "--combo", "1", "--threshold", "0.5")
    assert stats["threshold_source"] == "setting" and stats["threshold"] == 0.5

    # A detector saved before thresholds were fitted: the default 0.975, and a note saying so.
    meta = json.loads((detector / "config.json").read_text())
    del meta["train"]["threshold"]
    (detector / "config.json").write_text(json.dumps(meta))
    stats = dedup("old", "--nearest", "2", "--combo", "1")
    assert stats["threshold_source"] == "default" and stats["threshold"] == 0.975
    assert any("no fitted threshold" in note for note in stats["notes"])
    assert "note: copy detector" in capsys.readouterr().err
