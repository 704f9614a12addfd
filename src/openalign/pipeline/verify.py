"""The verification stage of a dedup run: the pairs whose cosine is near the threshold, decided by their pixels.

``run_dedup`` with ``verify`` finds the pairs above ``threshold - verify_band``; a pair above
``threshold + verify_band`` is a copy on the embedding alone, and the others go to verification. With
``nearest`` set, only each train image's best-ranked pairs in the band are verified and the rest are not
copies. The checks (``VerifyConfig.checks``) run cheapest per pair first: the registered pixels of many pairs
at once (``openalign.data.alignment``), then, for the pairs those leave, the pHash shortcut and ORB matches with
a RANSAC similarity fit (``openalign.data.verification``).

With votes (``DedupRunConfig.verify_votes``), local features propose pairs too: every train image's ORB
descriptors vote among all test images' (``FeatureVotes``), and a proposed pair the search did not decide is
verified like the band's, wherever its cosine lies.

The images are read a second time, test side first: what the checks need of the test images in some uncertain
pair is kept (a ``side``² thumbnail, and about 80 KB of features, its mirror's included, when feature matching
is on; at most one per test image). Then the train side streams past: each train image in an uncertain pair
leaves the same, and every ``batch`` pairs are decided together, so memory holds at most ``batch`` train
thumbnails.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from PIL import Image

from openalign.config import ConfigError
from openalign.data.augment import image_array
from openalign.data.dedup import DedupResult
from openalign.data.verification import Features, FeatureVotes, VerifyConfig, aligned_check, features, verify_pair

__all__ = ["verify_pairs"]

_BATCH = 1024  # pairs registered together: large enough for batched kernels, ~30 MB of float grids at 48 px


@dataclass
class _Side:
    """What the checks keep of one image."""

    thumb: np.ndarray | None  # uint8 [3, side, side] for the aligned check
    feats: Features | None  # pHash / ORB for the later checks


def _keep(image: Image.Image, cfg: VerifyConfig, *, mirror: bool) -> _Side:
    thumb = image_array(image, cfg.aligned_side) if "aligned" in cfg.checks else None
    later = "phash" in cfg.checks or "features" in cfg.checks
    return _Side(thumb, features(image, cfg, mirror=mirror) if later else None)


def _nearest_only(result: DedupResult, unsure: np.ndarray, nearest: int) -> tuple[np.ndarray, np.ndarray]:
    """(the unsure pairs among each train row's ``nearest`` highest cosines, the unsure pairs beyond them)."""
    if nearest <= 0 or not len(unsure):
        return unsure, unsure[:0]
    # Sort by train row, then by cosine falling; a pair's rank is its place within its row's run.
    order = unsure[np.lexsort((-result.cosine[unsure], result.train_idx[unsure]))]
    rows = result.train_idx[order]
    starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
    rank = np.arange(len(order)) - np.repeat(starts, np.diff(np.r_[starts, len(order)]))
    return np.sort(order[rank < nearest]), np.sort(order[rank >= nearest])


def verify_pairs(
    result: DedupResult,
    train_images: Iterator[Image.Image],
    test_images: Iterator[Image.Image],
    *,
    threshold: float,
    band: float,
    config: VerifyConfig | None = None,
    votes: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
) -> DedupResult:
    """``result`` (pairs found above ``threshold - band``) with the uncertain pairs verified: those the
    verification rejects are dropped, and ``stats["verification"]`` says who decided how many pairs.

    ``train_images`` / ``test_images`` yield the images in the row order of the embeddings. With ``votes``
    (``cosine(train_rows, test_rows)`` of the embeddings), every train image's ORB descriptors also vote among
    all test images' (``FeatureVotes``), and the pairs they propose that the search did not find are verified
    too: a picture embedded in a page, which a global embedding places far from its original. That reads every
    image's features, both sides, and keeps the test side's (about 80 KB an image, and 64 KB in the index).
    """
    cfg = config or VerifyConfig()
    if votes is not None and "features" not in cfg.checks:  # before any image is read
        raise ConfigError("dedup.verify_votes needs the features check in verification.checks")
    started = time.perf_counter()
    sure = result.cosine > threshold + band
    unsure, beyond = _nearest_only(result, np.flatnonzero(~sure), cfg.nearest)
    needed_test = set(result.test_idx[unsure].tolist())
    by_train: dict[int, list[int]] = defaultdict(list)
    for p in unsure.tolist():
        by_train[int(result.train_idx[p])].append(p)
    tests: dict[int, _Side] = {}
    if len(unsure) or votes is not None:
        for row, image in enumerate(test_images):
            if row in needed_test or votes is not None:
                tests[row] = _keep(image, cfg, mirror=True)
    voter = None
    known: set[tuple[int, int]] = set()  # pairs decided already: by the embedding, or in the band
    if votes is not None:
        voter = FeatureVotes([cast(Features, tests[row].feats) for row in range(len(tests))], cfg)
        decided = np.flatnonzero(sure).tolist() + unsure.tolist()
        known = set(zip(result.train_idx[decided].tolist(), result.test_idx[decided].tolist(), strict=True))
    # Pairs the votes add (train row, test row, verdict): decided like the band's, kept apart from the search's.
    added_train: list[int] = []
    added_test: list[int] = []
    added_accepted: list[bool] = []
    added_how: list[str] = []
    accepted = sure.copy()
    how_found = np.where(sure, "embedding", "rejected").astype(object)
    # What decided each pair, counted apart for the band's pairs and the votes' so each adds up to its total.
    counts = {origin: dict.fromkeys(("aligned", "phash", "features", "rejected"), 0) for origin in ("band", "votes")}
    pending: list[tuple[int, _Side]] = []  # (pair, the train image's side of it)

    n_found = len(result.train_idx)

    def test_row(p: int) -> int:  # pairs past the search's are the ones the votes added
        return int(result.test_idx[p]) if p < n_found else added_test[p - n_found]

    def settle(p: int, yes: bool, how: str) -> None:
        counts["band" if p < n_found else "votes"][how] += 1
        if p < n_found:
            accepted[p], how_found[p] = yes, how
        else:
            added_accepted[p - n_found], added_how[p - n_found] = yes, how

    def decide(batch: list[tuple[int, _Side]]) -> None:
        left = batch
        if "aligned" in cfg.checks:
            queries = np.stack([train.thumb for _, train in batch])  # type: ignore[misc]
            refs = np.stack([tests[test_row(p)].thumb for p, _ in batch])  # type: ignore[misc]
            ok = aligned_check(queries, refs, cfg).tolist()
            for (p, _), yes in zip(batch, ok, strict=True):
                if yes:
                    settle(p, True, "aligned")
            left = [item for item, yes in zip(batch, ok, strict=True) if not yes]
        for p, train in left:
            reference = tests[test_row(p)].feats
            if train.feats is None or reference is None:
                settle(p, False, "rejected")
                continue
            yes, how, _ = verify_pair(train.feats, reference, cfg)
            settle(p, yes, how)

    if len(unsure) or voter is not None:
        for row, image in enumerate(train_images):
            pairs = by_train.get(row, [])
            if not pairs and voter is None:
                continue
            mine = _keep(image, cfg, mirror=False)
            if voter is not None:
                for j in voter.candidates(cast(Features, mine.feats)).tolist():
                    if (row, j) not in known:
                        pairs.append(n_found + len(added_test))
                        added_train.append(row)
                        added_test.append(j)
                        added_accepted.append(False)
                        added_how.append("rejected")
            pending += [(p, mine) for p in pairs]
            if len(pending) >= _BATCH:
                decide(pending)
                pending = []
        if pending:
            decide(pending)
    keep = np.flatnonzero(accepted)
    train_idx, test_idx, cosine = result.train_idx[keep], result.test_idx[keep], result.cosine[keep]
    decided_by, proposed_by = how_found[keep], np.full(len(keep), "search", dtype=object)
    if votes is not None and added_train:
        yes = np.asarray(added_accepted)
        extra_train, extra_test = np.asarray(added_train, np.int64)[yes], np.asarray(added_test, np.int64)[yes]
        train_idx, test_idx = np.concatenate([train_idx, extra_train]), np.concatenate([test_idx, extra_test])
        cosine = np.concatenate([cosine, votes(extra_train, extra_test).astype(cosine.dtype)])
        decided_by = np.concatenate([decided_by, np.asarray(added_how, dtype=object)[yes]])
        proposed_by = np.concatenate([proposed_by, np.full(int(yes.sum()), "votes", dtype=object)])
        order = np.lexsort((test_idx, train_idx))
        train_idx, test_idx, cosine = train_idx[order], test_idx[order], cosine[order]
        decided_by, proposed_by = decided_by[order], proposed_by[order]
    band_counts, vote_counts = counts["band"], counts["votes"]
    stats: dict[str, Any] = {
        **result.stats,
        "threshold": threshold,
        "duplicate_pairs": len(train_idx),
        "pairs_above_threshold": int((cosine > threshold).sum()),
        "train_rows_removed": len(np.unique(train_idx)),
        "test_images_matched": len(np.unique(test_idx)),
        "verification": {
            "band": [threshold - band, threshold + band],
            "checks": list(cfg.checks),
            "pairs_by_embedding": int(sure.sum()),
            "pairs_verified": len(unsure),
            "pairs_beyond_nearest": len(beyond),
            "accepted_by_aligned_pixels": band_counts["aligned"],
            "accepted_by_phash": band_counts["phash"],
            "accepted_by_features": band_counts["features"],
            "rejected": band_counts["rejected"],
            "pairs_voted": len(added_train),
            "accepted_voted": int(sum(added_accepted)),
            "voted": vote_counts,  # what decided the voted pairs: the check that accepted, or rejected
            "seconds": round(time.perf_counter() - started, 3),
        },
    }
    return DedupResult(train_idx, test_idx, cosine, stats, list(result.notes), decided_by, proposed_by)
