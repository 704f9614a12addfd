"""The verification stage of a dedup run: the pairs whose cosine is near the threshold, decided by their pixels.

``run_dedup`` with ``verify`` finds the pairs above ``threshold - verify_band``; a pair above
``threshold + verify_band`` is a copy on the embedding alone, and the others go to
``openalign.data.verification`` (pHash shortcut, then ORB matches with a RANSAC similarity fit). The images
are read a second time, test side first: the features of the test images in some uncertain pair are kept
(about 40 KB each, at most one per test image), then the train side streams past and each train image in an
uncertain pair is verified against its partners as it arrives, so memory holds no train image beyond the one
being checked.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import numpy as np
from PIL import Image

from openalign.data.dedup import DedupResult
from openalign.data.verification import Features, VerifyConfig, features, verify_pair

__all__ = ["verify_pairs"]


def verify_pairs(
    result: DedupResult,
    train_images: Iterator[Image.Image],
    test_images: Iterator[Image.Image],
    *,
    threshold: float,
    band: float,
    config: VerifyConfig | None = None,
) -> DedupResult:
    """``result`` (pairs found above ``threshold - band``) with the uncertain pairs verified: those the
    verification rejects are dropped, and ``stats["verification"]`` says who decided how many pairs.

    ``train_images`` / ``test_images`` yield the images in the row order of the embeddings.
    """
    cfg = config or VerifyConfig()
    started = time.perf_counter()
    cos = result.cosine
    sure = cos > threshold + band
    unsure = np.flatnonzero(~sure)
    needed_test = set(result.test_idx[unsure].tolist())
    by_train: dict[int, list[int]] = defaultdict(list)
    for p in unsure.tolist():
        by_train[int(result.train_idx[p])].append(p)
    test_features: dict[int, Features] = {}
    if len(unsure):
        for row, image in enumerate(test_images):
            if row in needed_test:
                test_features[row] = features(image, cfg, mirror=True)
    accepted = sure.copy()
    counts = {"phash": 0, "features": 0, "rejected": 0}
    if len(unsure):
        for row, image in enumerate(train_images):
            pairs = by_train.get(row)
            if not pairs:
                continue
            mine = features(image, cfg)
            for p in pairs:
                ok, how, _ = verify_pair(mine, test_features[int(result.test_idx[p])], cfg)
                counts[how] += 1
                accepted[p] = ok
    keep = np.flatnonzero(accepted)
    train_idx, test_idx, cosine = result.train_idx[keep], result.test_idx[keep], result.cosine[keep]
    stats: dict[str, Any] = {
        **result.stats,
        "threshold": threshold,
        "duplicate_pairs": len(keep),
        "train_rows_removed": len(np.unique(train_idx)),
        "test_images_matched": len(np.unique(test_idx)),
        "verification": {
            "band": [threshold - band, threshold + band],
            "pairs_by_embedding": int(sure.sum()),
            "pairs_verified": len(unsure),
            "accepted_by_phash": counts["phash"],
            "accepted_by_features": counts["features"],
            "rejected": counts["rejected"],
            "seconds": round(time.perf_counter() - started, 3),
        },
    }
    return DedupResult(train_idx, test_idx, cosine, stats, list(result.notes))
