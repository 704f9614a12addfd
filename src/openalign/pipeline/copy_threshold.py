"""The copy detector's operating threshold, fitted on held-out copies rather than assumed.

The ALIGN supplement's cosine threshold of 0.975 was fitted on human-rated pairs for *its* embedding model; a
detector trained here has its own scale. After training, ``openalign copy-detector train`` therefore measures
it on images it never trained on: each held-out image gets reposted copies
(``openalign.data.reposting.random_repost``), the image–copy pairs are the positives, every pair of rows
(originals and copies) that come from *different* images is a negative, and the operating threshold is the
lowest cosine whose false-positive rate on those negatives is at most ``max_false_positive_rate``.

With N negative pairs and rate r, at most k = floor(r·N) negatives may score above the threshold, so the
lowest such threshold is exactly the (k+1)-th highest negative score (a pair is a duplicate when cosine > t,
as in ``openalign.data.dedup``). Only those k+1 scores and the counts above a fixed grid are kept while the
negatives are scored block by block, so memory follows ``block`` and the asked rate, not N².
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from openalign.config import ConfigError
from openalign.data.reposting import random_repost

if TYPE_CHECKING:
    from PIL import Image

    from openalign.model.copy_detector import CopyDetector

__all__ = [
    "CURVE_FILE",
    "ThresholdFit",
    "ThresholdFitConfig",
    "fit_threshold",
    "fit_threshold_on_images",
    "negative_scores",
    "operating_threshold",
    "write_curve",
]

CURVE_FILE = "threshold_curve.csv"
# Thresholds the curve is written at (the fitted one and the paper's 0.975 are added).
GRID = np.round(np.linspace(0.0, 1.0, 201), 6)


@dataclass
class ThresholdFitConfig:
    """How the operating threshold is fitted on held-out images after training"""

    # distinct images read after the training ones (never trained on) to fit the threshold on; 0 = no fit.
    # Training uses the first max_images as before, so a source with no more images than that fits nothing
    holdout: int = 256
    copies: int = 2  # reposted copies of each held-out image (openalign.data.reposting.random_repost)
    edits: int = 2  # photo edits per copy
    max_strength: float = 0.5  # strongest edit of a copy, on reposting's [0, 1] scale
    # the threshold is the lowest cosine whose false-positive rate on pairs of different images is at most this
    max_false_positive_rate: float = 1e-4
    block: int = 256  # rows scored against all others at once (memory: block × rows floats)
    seed: int = 0  # which edits each copy gets

    def validate(self) -> None:
        """Raises ConfigError naming the bad field."""
        if not 0 <= self.holdout <= 100_000:
            raise ConfigError(f"copy_detector fit.holdout must be in [0, 100000], got {self.holdout}")
        if self.copies < 1 or self.edits < 1 or self.block < 1:
            raise ConfigError("copy_detector fit.copies, fit.edits and fit.block must be at least 1")
        if not 0 < self.max_strength <= 1:
            raise ConfigError(f"copy_detector fit.max_strength must be in (0, 1], got {self.max_strength}")
        if not 0 <= self.max_false_positive_rate < 1:
            raise ConfigError(
                f"copy_detector fit.max_false_positive_rate must be in [0, 1), got {self.max_false_positive_rate}"
            )


@dataclass
class ThresholdFit:
    """The fitted threshold, how it scores on the held-out pairs, and the curve around it."""

    threshold: float
    max_false_positive_rate: float  # what was asked
    false_positives: int  # negatives with cosine > threshold
    negative_pairs: int
    true_positives: int  # image–copy pairs with cosine > threshold
    positive_pairs: int
    holdout_images: int = 0
    curve: list[dict[str, float | None]] = field(default_factory=list)

    @property
    def false_positive_rate(self) -> float:
        return self.false_positives / self.negative_pairs if self.negative_pairs else 0.0

    @property
    def recall(self) -> float:
        return self.true_positives / self.positive_pairs if self.positive_pairs else 0.0

    @property
    def below_resolution(self) -> bool:
        """The asked rate allows no false positive at all among these pairs (r·N < 1)."""
        return _allowed(self.max_false_positive_rate, self.negative_pairs) == 0

    def to_dict(self) -> dict[str, Any]:
        """What the detector's config.json keeps (the curve goes to ``CURVE_FILE``)."""
        return {
            "value": self.threshold,
            "max_false_positive_rate": self.max_false_positive_rate,
            "false_positive_rate": self.false_positive_rate,
            "false_positives": self.false_positives,
            "negative_pairs": self.negative_pairs,
            "recall": self.recall,
            "true_positives": self.true_positives,
            "positive_pairs": self.positive_pairs,
            "holdout_images": self.holdout_images,
            "curve": CURVE_FILE,
        }

    def report(self) -> str:
        """One line: the threshold, recall at it, its false-positive rate and the pairs counted."""
        n = self.negative_pairs
        fpr = (
            f"no negative above it among {n:,} pairs (resolution 1/{n:,} = {1 / n:.1e}, coarser than the asked "
            f"{self.max_false_positive_rate:g})"
            if self.below_resolution and self.false_positives == 0
            else f"FPR {self.false_positives:,}/{n:,} = {self.false_positive_rate:.2e} "
            f"(asked ≤ {self.max_false_positive_rate:g}"
            + (
                "; not met: different images embed at cosine 1)"
                if self.false_positive_rate > self.max_false_positive_rate
                else ")"
            )
        )
        return (
            f"fitted threshold {self.threshold:.4f} on {self.holdout_images:,} held-out images: recall "
            f"{self.recall:.3f} ({self.true_positives:,}/{self.positive_pairs:,} image–copy pairs), {fpr}"
        )


def _allowed(rate: float, negatives: int) -> int:
    # The tiny relative slack keeps r·N that is an integer in exact arithmetic from rounding down below it.
    return min(negatives, math.floor(rate * negatives * (1 + 1e-12)))


def operating_threshold(top_negatives: np.ndarray, negative_pairs: int, max_false_positive_rate: float) -> float:
    """The lowest t with #(negatives > t) ≤ floor(rate × N): the (k+1)-th highest negative score.

    ``top_negatives`` holds at least the k+1 highest negative scores (all of them is fine); −1 when the rate
    allows every negative. The result stays below 1 so that ``DedupConfig`` accepts it.
    """
    allowed = _allowed(max_false_positive_rate, negative_pairs)
    if allowed >= negative_pairs:
        return -1.0
    top = np.sort(np.asarray(top_negatives, dtype=np.float64))[::-1]
    if len(top) <= allowed:
        raise ValueError(f"need the {allowed + 1} highest negative scores, got {len(top)}")
    return float(min(top[allowed], np.nextafter(1.0, 0.0)))


def negative_scores(
    emb: np.ndarray, groups: np.ndarray, thresholds: np.ndarray, keep: int, block: int = 256
) -> tuple[np.ndarray, np.ndarray, int]:
    """Over every pair i < j of rows from different groups: how many score above each threshold, the ``keep``
    highest scores, and the number of pairs. Scored ``block`` rows at a time."""
    emb = np.asarray(emb, dtype=np.float32)
    groups = np.asarray(groups)
    thresholds = np.asarray(thresholds, dtype=np.float64)
    above = np.zeros(len(thresholds), dtype=np.int64)
    top = np.zeros(0, dtype=np.float64)
    total = 0
    cols = np.arange(len(emb))
    for start in range(0, len(emb), block):
        rows = np.arange(start, min(start + block, len(emb)))
        scores = (emb[rows] @ emb.T).astype(np.float64)
        mask = (cols[None, :] > rows[:, None]) & (groups[None, :] != groups[rows][:, None])
        values = np.sort(scores[mask])
        total += len(values)
        above += len(values) - np.searchsorted(values, thresholds, side="right")
        top = np.concatenate([top, values[-keep:] if keep else values[:0]])
        if len(top) > keep:
            top = np.sort(top)[len(top) - keep :]
    return above, top, total


def fit_threshold(
    positives: np.ndarray,
    emb: np.ndarray,
    groups: np.ndarray,
    max_false_positive_rate: float,
    *,
    block: int = 256,
) -> ThresholdFit:
    """The operating threshold from image–copy scores and the embeddings whose cross-group pairs are the
    negatives, with the precision–recall curve over ``GRID`` and the fitted threshold."""
    positives = np.sort(np.asarray(positives, dtype=np.float64))
    n_rows = len(emb)
    # At most rate × (all pairs) false positives may be allowed, so that many + 1 top scores suffice.
    keep = _allowed(max_false_positive_rate, n_rows * (n_rows - 1) // 2) + 1
    above, top, total = negative_scores(emb, groups, GRID, keep, block)
    if total == 0 or len(positives) == 0:
        raise ValueError("fitting a threshold needs at least two held-out images and one copy")
    threshold = operating_threshold(top, total, max_false_positive_rate)
    # Every negative above the threshold is among the kept top scores (at most k of them).
    false_positives = total if threshold <= -1.0 else int((top > threshold).sum())
    curve_points = [(float(t), int(fp)) for t, fp in zip(GRID, above, strict=True)]
    curve_points.append((threshold, false_positives))
    curve = []
    for t, fp in sorted(set(curve_points)):
        tp = len(positives) - int(np.searchsorted(positives, t, side="right"))
        curve.append(
            {
                "threshold": t,
                "precision": tp / (tp + fp) if tp + fp else None,
                "recall": tp / len(positives),
                "false_positive_rate": fp / total,
                "true_positives": tp,
                "false_positives": fp,
            }
        )
    tp = len(positives) - int(np.searchsorted(positives, threshold, side="right"))
    return ThresholdFit(threshold, max_false_positive_rate, false_positives, total, tp, len(positives), curve=curve)


def fit_threshold_on_images(
    detector: CopyDetector, images: Sequence[Image.Image], config: ThresholdFitConfig, *, progress: bool = False
) -> ThresholdFit:
    """Repost each held-out image ``copies`` times, embed originals and copies, fit the threshold."""
    rng = random.Random(f"copy-threshold/{config.seed}")
    rows: list[Image.Image] = []
    groups: list[int] = []
    for g, image in enumerate(images):
        rows.append(image)
        groups.append(g)
        for _ in range(config.copies):
            rows.append(random_repost(image, rng, edits=config.edits, max_strength=config.max_strength)[0])
            groups.append(g)
    emb = detector.embed(rows, progress=progress)
    group_ids = np.asarray(groups)
    originals = np.arange(len(rows)) % (1 + config.copies) == 0
    source_row = np.repeat(np.flatnonzero(originals), 1 + config.copies)
    copies = ~originals
    positives = (emb[copies] * emb[source_row[copies]]).sum(-1)
    fit = fit_threshold(positives, emb, group_ids, config.max_false_positive_rate, block=config.block)
    fit.holdout_images = len(images)
    return fit


def write_curve(fit: ThresholdFit, folder: str | Path) -> Path:
    """``folder/threshold_curve.csv``: threshold, precision, recall, FPR and the counts, by threshold."""
    path = Path(folder) / CURVE_FILE
    names = ["threshold", "precision", "recall", "false_positive_rate", "true_positives", "false_positives"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for row in fit.curve:
            writer.writerow({k: "" if row[k] is None else row[k] for k in names})
    return path
