"""``openalign bench copy-detection``: finding reposted copies of real photographs, ours against baselines.

The photographs are the ones installed packages ship (scikit-image's ``skimage.data``, scikit-learn's sample
images, matplotlib's sample photo), read from their package folders, so the run needs no network. Some are
references (the "test images" dedup protects); every reference is reposted many times with each
transformation of ``openalign.data.reposting`` at several strengths, and a few times with three at once.
The distractor queries are the other photographs, reposted too, and — the hard case — the other half of four
references whose reference is only their left half (the same scene, not the same picture).

Every query is scored against every reference, as DISC21's matching track does: μAP is the average precision
of all query–reference pairs pooled and sorted by score, and recall at a 0.1 % false-positive rate is the
fraction of true pairs scoring above all but 0.1 % of the false ones; both overall and per transformation
(that transformation's true pairs against all false pairs). The detectors scored, in one run: a perceptual
hash, a tiny-image descriptor, the copy detector untrained, the copy detector trained on synthetic images
only (``openalign.pipeline.copy_detector``; never on these photographs), that detector followed by
verification (``openalign.data.verification``) of the pairs in a narrow band around its operating threshold,
and the same with the pairs below the band that local features vote for (``FeatureVotes``) verified too.

Cost is bounded by settings: the in-run training is small by default (``--detector DIR`` scores a detector
trained properly instead), and only the pairs in the band, or voted for, are verified, each image's ORB
features computed once however many pairs it is in, since ORB matching costs tens of milliseconds a pair.
"""

from __future__ import annotations

import importlib.util
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from openalign.config import ConfigError
from openalign.data.reposting import TRANSFORMS, random_repost, repost
from openalign.data.verification import Features, VerifyConfig, features

__all__ = [
    "CopyBenchSettings",
    "installed_photos",
    "make_queries",
    "micro_average_precision",
    "recall_at_fpr",
    "run_copy_detection_bench",
]

# (package, file inside it) of every real photograph used; scikit-image's synthetic test pictures are left out.
REFERENCES = [
    ("skimage", "data/astronaut.png"), ("skimage", "data/chelsea.png"), ("skimage", "data/coffee.png"),
    ("skimage", "data/rocket.jpg"), ("skimage", "data/motorcycle_left.png"), ("sklearn", "datasets/images/china.jpg"),
    ("sklearn", "datasets/images/flower.jpg"), ("matplotlib", "mpl-data/sample_data/grace_hopper.jpg"),
    ("skimage", "data/camera.png"), ("skimage", "data/coins.png"), ("skimage", "data/retina.jpg"),
    ("skimage", "data/hubble_deep_field.jpg"),
]  # fmt: skip
DISTRACTORS = [
    ("skimage", "data/ihc.png"), ("skimage", "data/moon.png"), ("skimage", "data/text.png"),
    ("skimage", "data/page.png"), ("skimage", "data/cell.png"), ("skimage", "data/grass.png"),
    ("skimage", "data/gravel.png"), ("skimage", "data/brick.png"), ("skimage", "data/clock_motion.png"),
]  # fmt: skip
HALVED = ("coffee", "rocket", "motorcycle_left", "china")  # reference = left half; the right half is a distractor


@dataclass
class CopyBenchSettings:
    """What ``openalign bench copy-detection`` builds and scores."""

    strengths: list[float] = field(default_factory=lambda: [0.33, 0.67, 1.0])  # of every single transformation
    mixed: int = 4  # copies per reference made by three transformations at once
    distractor_copies: int = 6  # reposts of each distractor photo (and of each reference's other half)
    max_side: int = 512  # photos are scaled down to this longest side first
    fpr: float = 0.001  # the false-positive rate recall is read at
    detector: str | None = None  # a saved copy detector to score (default: train one on synthetic images)
    train_steps: int = 150  # training steps of that detector (openalign copy-detector train: 300)
    train_batch: int = 64  # distinct images per training step (openalign copy-detector train: 128)
    train_images: int = 1000  # synthetic images it trains on
    train_seconds: float | None = None  # also stop its training after this much time (figures then vary by machine)
    threshold: float | None = None  # centre of the verification band (default: the detector's at the fpr)
    verify_band: float = 0.3  # verification decides the pairs with cosine within this of the threshold
    # also verify the pairs below the band that at least verify.min_votes of the query's ORB descriptors vote
    # for (FeatureVotes; needs the features check): a column of its own, so the table shows what it buys
    # (--no-feature-votes: no such column)
    feature_votes: bool = True
    seed: int = 0  # which edits, strengths and detector weights
    json_path: str | None = None  # also write the results to this JSON file
    verify: VerifyConfig = field(default_factory=VerifyConfig)

    def validate(self) -> None:
        if not self.strengths or not all(0 < s <= 1 for s in self.strengths):
            raise ConfigError(f"strengths must be a non-empty list in (0, 1], got {self.strengths}")
        if self.mixed < 0 or self.distractor_copies < 1 or self.max_side < 64:
            raise ConfigError("mixed must be ≥ 0, distractor_copies ≥ 1 and max_side ≥ 64")
        if not 0 < self.fpr < 1 or self.verify_band < 0:
            raise ConfigError("fpr must be in (0, 1) and verify_band ≥ 0")
        if self.train_steps < 1 or self.train_batch < 2 or self.train_images < 2:
            raise ConfigError("train_steps must be ≥ 1, train_batch ≥ 2 and train_images ≥ 2")
        if self.train_seconds is not None and not self.train_seconds > 0:
            raise ConfigError(f"train_seconds must be positive or none, got {self.train_seconds}")
        self.verify.validate()


# --------------------------------------------------------------------------------------------------
# Photos and queries


def _package_file(package: str, relative: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    return path if path.is_file() else None


def installed_photos(entries: list[tuple[str, str]], max_side: int) -> dict[str, Image.Image]:
    """name → RGB photo (longest side at most ``max_side``) of each entry whose package ships it."""
    out: dict[str, Image.Image] = {}
    for package, relative in entries:
        path = _package_file(package, relative)
        if path is None:
            continue
        with Image.open(path) as im:
            photo = im.convert("RGB")
        photo.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
        out[Path(relative).stem] = photo
    return out


@dataclass
class Queries:
    images: list[Image.Image]
    source: list[int]  # reference index each query copies, -1 for a distractor
    kind: list[str]  # the transformation (or "mixed", or "distractor")


def make_queries(references: list[Image.Image], distractors: list[Image.Image], s: CopyBenchSettings) -> Queries:
    """Copies of every reference by each transformation at each strength and ``mixed`` combined ones, then the
    distractors' reposts."""
    rng = random.Random(f"copy-bench/{s.seed}")
    q = Queries([], [], [])
    for ref, image in enumerate(references):
        for name in TRANSFORMS:
            for strength in [1.0] if name == "mirror" else s.strengths:
                q.images.append(repost(image, [(name, strength)], rng))
                q.source.append(ref)
                q.kind.append(name)
        for _ in range(s.mixed):
            q.images.append(random_repost(image, rng, edits=3)[0])
            q.source.append(ref)
            q.kind.append("mixed")
    for image in distractors:
        q.images.append(image)
        q.source.append(-1)
        q.kind.append("distractor")
        for _ in range(s.distractor_copies - 1):
            q.images.append(random_repost(image, rng, edits=2, max_strength=0.7)[0])
            q.source.append(-1)
            q.kind.append("distractor")
    return q


# --------------------------------------------------------------------------------------------------
# Scores


def micro_average_precision(scores: np.ndarray, positive: np.ndarray) -> float:
    """DISC21's μAP: every pair pooled and sorted by score (highest first), precision averaged over the ranks
    of the true pairs, divided by the number of true pairs."""
    order = np.argsort(-scores.ravel(), kind="stable")
    hits = positive.ravel()[order].astype(np.float64)
    n = hits.sum()
    if n == 0:
        return float("nan")
    precision = np.cumsum(hits) / np.arange(1, len(hits) + 1)
    return float((precision * hits).sum() / n)


def recall_at_fpr(scores: np.ndarray, positive: np.ndarray, fpr: float) -> tuple[float, float]:
    """(recall, threshold): the fraction of true pairs scoring strictly above the score that at most ``fpr`` of
    the false pairs exceed."""
    neg = np.sort(scores[~positive])[::-1]
    pos = scores[positive]
    if not len(pos):
        return float("nan"), float("nan")
    allowed = int(np.floor(fpr * len(neg)))
    threshold = float(neg[allowed]) if allowed < len(neg) else -np.inf
    return float((pos > threshold).mean()), threshold


def _pair_masks(q: Queries, n_refs: int) -> np.ndarray:
    source = np.asarray(q.source)
    mask: np.ndarray = source[:, None] == np.arange(n_refs)[None, :]
    return mask


def _report(scores: np.ndarray, positive: np.ndarray, kinds: np.ndarray, fpr: float) -> dict[str, Any]:
    recall, threshold = recall_at_fpr(scores, positive, fpr)
    out: dict[str, Any] = {
        "uAP": micro_average_precision(scores, positive),
        "recall": recall,
        "threshold": threshold,
        "per_transform": {},
    }
    negatives = ~positive
    for kind in sorted(set(kinds) - {"distractor"}):
        rows = kinds == kind
        mask = positive & rows[:, None]
        keep = mask | negatives
        out["per_transform"][kind] = {
            "uAP": micro_average_precision(scores[keep], mask[keep]),
            "recall": float((scores[mask] > threshold).mean()),
        }
    return out


def _tiny(images: list[Image.Image]) -> np.ndarray:
    """Grey 16 × 16 thumbnails, mean removed, unit length: the plainest global descriptor."""
    rows = np.stack(
        [np.asarray(im.convert("L").resize((16, 16), Image.Resampling.BOX), np.float32).ravel() for im in images]
    )
    rows -= rows.mean(1, keepdims=True)
    unit: np.ndarray = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-6)
    return unit


def _phash_scores(queries: list[Image.Image], refs: list[Image.Image]) -> np.ndarray:
    from openalign.data.verification import phash

    def bits(images: list[Image.Image]) -> np.ndarray:
        hashes = [phash(im) for im in images]
        return np.array([[(h >> i) & 1 for i in range(64)] for h in hashes], dtype=np.int8)

    a, b = bits(queries), bits(refs)
    hamming = (a[:, None, :] != b[None, :, :]).sum(-1)
    similarity: np.ndarray = 1.0 - hamming / 64.0
    return similarity


def _synthetic_detector(s: CopyBenchSettings) -> Any:
    from openalign.data.synthetic import SyntheticWorld
    from openalign.pipeline.copy_detector import CopyDetectorTrainConfig, train_copy_detector

    world = SyntheticWorld(seed=s.seed, image_size=64)
    images = (world.render(world.scene(i)) for i in range(s.train_images))
    config = CopyDetectorTrainConfig(
        steps=s.train_steps, batch_size=s.train_batch, seconds=s.train_seconds, seed=s.seed
    )
    return train_copy_detector(images, config)


class _FeatureCache:
    """Each image's verification features, computed once (references with their mirror's keypoints, since a
    query may be a flipped copy)."""

    def __init__(self, queries: list[Image.Image], refs: list[Image.Image], config: VerifyConfig):
        self.queries, self.refs, self.config = queries, refs, config
        self.query: dict[int, Features] = {}
        self.ref: dict[int, Features] = {}

    def of_query(self, i: int) -> Features:
        if i not in self.query:
            self.query[i] = features(self.queries[i], self.config)
        return self.query[i]

    def of_ref(self, i: int) -> Features:
        if i not in self.ref:
            self.ref[i] = features(self.refs[i], self.config, mirror=True)
        return self.ref[i]

    @property
    def described(self) -> int:
        return len(self.query) + len(self.ref)


def _decide(
    scores: np.ndarray, cosine: np.ndarray, pending: np.ndarray, cache: _FeatureCache, s: CopyBenchSettings
) -> dict[str, int]:
    """Verify the ``pending`` pairs in place of their scores: a verified pair ranks above every unverified one
    (by cosine among themselves), a rejected one below every pair not verified. The pairs are registered
    together first (the aligned check); features are computed only for images in some pair that check left."""
    from openalign.data.alignment import aligned_arrays
    from openalign.data.verification import aligned_check, verify_pair

    pending = pending.copy()
    counts = {"aligned": 0, "phash": 0, "features": 0, "rejected": 0}
    if "aligned" in s.verify.checks and pending.any():
        side = s.verify.aligned_side
        qs, rs = np.nonzero(pending)
        uq, ur = np.unique(qs).tolist(), np.unique(rs).tolist()
        q_arr = dict(zip(uq, aligned_arrays([cache.queries[i] for i in uq], side), strict=True))
        r_arr = dict(zip(ur, aligned_arrays([cache.refs[i] for i in ur], side), strict=True))
        for start in range(0, len(qs), 1024):
            q_batch, r_batch = qs[start : start + 1024], rs[start : start + 1024]
            ok = aligned_check(
                np.stack([q_arr[i] for i in q_batch.tolist()]), np.stack([r_arr[i] for i in r_batch.tolist()]), s.verify
            )
            for qi, ri in zip(q_batch[ok].tolist(), r_batch[ok].tolist(), strict=True):
                scores[qi, ri] = cosine[qi, ri] + 2.0
                pending[qi, ri] = False  # decided
            counts["aligned"] += int(ok.sum())
    for qi in np.flatnonzero(pending.any(1)).tolist():
        for ri in np.flatnonzero(pending[qi]).tolist():
            accepted, how, _ = verify_pair(cache.of_query(qi), cache.of_ref(ri), s.verify)
            counts[how] += 1
            scores[qi, ri] = cosine[qi, ri] + (2.0 if accepted else -4.0)
    return counts


def _verified(
    cosine: np.ndarray,
    queries: list[Image.Image],
    refs: list[Image.Image],
    centre: float,
    s: CopyBenchSettings,
    cache: _FeatureCache | None = None,
) -> tuple[np.ndarray, dict[str, int]]:
    """Scores after verifying the pairs with cosine in (centre - band, centre + band] (``_decide``), with the
    counts of who decided them."""
    lo, hi = centre - s.verify_band, centre + s.verify_band
    band = (cosine > lo) & (cosine <= hi)
    out = cosine.copy()
    cache = cache or _FeatureCache(queries, refs, s.verify)
    counts = {"by_embedding": int((cosine > hi).sum()), "below": int((cosine <= lo).sum())}
    counts.update(_decide(out, cosine, band, cache, s))
    counts["images_described"] = cache.described
    return out, counts


def _with_votes(
    verified: np.ndarray, cosine: np.ndarray, lo: float, cache: _FeatureCache, s: CopyBenchSettings
) -> tuple[np.ndarray, dict[str, int]]:
    """``verified`` with the pairs below the band (cosine ≤ ``lo``) that local features vote for
    (``FeatureVotes``) verified too: the candidates a global embedding misses, a picture embedded in a page above
    all. Every image's features are needed here, so ``cache`` ends up describing them all."""
    from openalign.data.verification import FeatureVotes

    votes = FeatureVotes([cache.of_ref(i) for i in range(len(cache.refs))], s.verify)
    pending = np.zeros(cosine.shape, bool)
    for qi in range(len(cache.queries)):
        pending[qi, votes.candidates(cache.of_query(qi))] = True
    pending &= cosine <= lo
    out = verified.copy()
    counts = {"pairs_voted": int(pending.sum()), **_decide(out, cosine, pending, cache, s)}
    counts["images_described"] = cache.described
    return out, counts


def run_copy_detection_bench(s: CopyBenchSettings) -> dict[str, Any]:
    """Build the photos' copies, score every detector on them, print a table; returns the figures."""
    import torch

    from openalign.model.copy_detector import CopyDetector

    s.validate()
    started = time.perf_counter()
    refs_by_name = installed_photos(REFERENCES, s.max_side)
    others = installed_photos(DISTRACTORS, s.max_side)
    if len(refs_by_name) < 4:
        raise ConfigError(f"bench copy-detection: only {len(refs_by_name)} reference photos installed (need 4)")
    refs, distractors = [], list(others.values())
    for name, photo in refs_by_name.items():
        if name in HALVED:  # the left half is the reference, the right half (not a copy) a distractor
            w, h = photo.size
            refs.append(photo.crop((0, 0, w // 2, h)))
            distractors.append(photo.crop((w // 2, 0, w, h)))
        else:
            refs.append(photo)
    q = make_queries(refs, distractors, s)
    positive, kinds = _pair_masks(q, len(refs)), np.asarray(q.kind)
    print(
        f"{len(refs)} reference photos, {len(q.images)} queries ({int(positive.any(1).sum())} copies, "
        f"{int((kinds == 'distractor').sum())} distractors), {positive.size} pairs; built in "
        f"{time.perf_counter() - started:.1f} s"
    )
    results: dict[str, Any] = {}
    scores: dict[str, np.ndarray] = {"phash": _phash_scores(q.images, refs)}
    tq, tr = _tiny(q.images), _tiny(refs)
    scores["tiny-image"] = tq @ tr.T
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s.seed)
        untrained = CopyDetector().eval()
    scores["detector-untrained"] = untrained.embed(q.images) @ untrained.embed(refs).T
    t = time.perf_counter()
    if s.detector:
        from openalign.model.io import load_copy_detector

        trained = load_copy_detector(s.detector)
    else:
        trained = _synthetic_detector(s)
    train_s = time.perf_counter() - t
    cosine = trained.embed(q.images) @ trained.embed(refs).T
    scores["detector"] = cosine
    for name, sc in scores.items():
        results[name] = _report(sc, positive, kinds, s.fpr)
    # The band sits around the detector's operating point: the cosine it needs for the false-positive rate.
    centre = results["detector"]["threshold"] if s.threshold is None else s.threshold
    if not np.isfinite(centre):
        centre = float(cosine.min())
    t = time.perf_counter()
    cache = _FeatureCache(q.images, refs, s.verify)
    verified, counts = _verified(cosine, q.images, refs, centre, s, cache)
    verify_s = time.perf_counter() - t
    results["detector+verify"] = _report(verified, positive, kinds, s.fpr)
    results["verification"] = {
        **counts,
        "seconds": round(verify_s, 1),
        "band": [centre - s.verify_band, centre + s.verify_band],
    }
    if s.feature_votes and "features" in s.verify.checks:
        t = time.perf_counter()
        voted, vote_counts = _with_votes(verified, cosine, centre - s.verify_band, cache, s)
        results["detector+verify+votes"] = _report(voted, positive, kinds, s.fpr)
        results["votes"] = {**vote_counts, "seconds": round(time.perf_counter() - t, 1)}
    results["detector_train_s"] = round(train_s, 1)
    results["seconds"] = round(time.perf_counter() - started, 1)
    _print(results, s)
    if s.json_path:
        Path(s.json_path).write_text(json.dumps(results, indent=2) + "\n")
    return results


def _print(results: dict[str, Any], s: CopyBenchSettings) -> None:
    methods = [m for m in results if isinstance(results[m], dict) and "uAP" in results[m]]
    kinds = list(results[methods[0]]["per_transform"])
    width = max(len(m) for m in methods) + 2
    print(f"\nrecall at {s.fpr:.1%} false positives (μAP in brackets)")
    print(" " * 10 + "".join(f"{m:>{width + 6}}" for m in methods))
    rows = [("overall", {m: results[m] for m in methods})]
    rows += [(k, {m: results[m]["per_transform"][k] for m in methods}) for k in kinds]
    for label, cells in rows:
        print(f"{label:<10}" + "".join(f"{c['recall']:>{width - 2}.2f} ({c['uAP']:.2f})" for c in cells.values()))
    v = results["verification"]
    print(
        f"\nverification in cosine band ({v['band'][0]:.3f}, {v['band'][1]:.3f}]: {v['by_embedding']} pairs above it "
        f"decided by the embedding alone; {v.get('aligned', 0)} accepted by aligned pixels, {v['phash']} by pHash, "
        f"{v['features']} by feature matching, "
        f"{v['rejected']} rejected ({v['images_described']} images described), {v['below']} below, "
        f"in {v['seconds']} s"
    )
    if "votes" in results:
        v = results["votes"]
        print(
            f"feature votes (at least {s.verify.min_votes}) below the band: {v['pairs_voted']} pairs, "
            f"{v['aligned']} accepted by aligned pixels, {v['phash']} by pHash, {v['features']} by feature "
            f"matching, {v['rejected']} rejected ({v['images_described']} images described in all), in {v['seconds']} s"
        )
    print(f"detector ready in {results['detector_train_s']} s; whole run {results['seconds']} s")
