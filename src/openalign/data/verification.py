"""Deciding a candidate copy pair by its pixels, where the embedding cosine is too close to the threshold to tell.

Three checks, each able to accept a pair (``VerifyConfig.checks`` names those that run), cheapest per pair first:

0. aligned pixels (``openalign.data.alignment``, run on many pairs at once by ``pipeline/verify.py``): the
   pair registered by an affine map, accepted when even its worst region matches after a brightness and
   contrast fit — what a re-crop, rescale, re-tone or re-compression leaves, and what a different picture on
   the same background does not;
1. a perceptual hash (pHash: the signs of the 8 × 8 lowest frequencies of a 32 × 32 grey DCT against their
   median): a resized or re-compressed copy keeps almost every bit, so a Hamming distance of at most
   ``phash_bits`` accepts the pair without further work;
2. local features with geometric verification: ORB keypoints of both images (and of the mirrored second
   image, since a flip moves every keypoint), descriptor matches that pass Lowe's ratio test, at most one per
   reference keypoint, and a RANSAC fit of a similarity transform (shift, scale, rotation: what crops,
   resizes, padding, rotation and embedding in a larger picture do). A copy keeps many matches consistent
   with one such transform; a different photo of similar colours keeps almost none. ``min_inliers``
   consistent matches accept, provided the fit shows at least ``min_shown`` of the reference. Both rules stop
   the same failure: repeated texture (text, foliage, gravel) lets many query keypoints match one reference
   keypoint, and a fit that squeezes the whole query onto that patch of the reference then "explains" them
   all; with one match per reference keypoint such false pairs stay far below the copies' counts. Unless
   ``partial_copies`` is set, the fit must also show ``WHOLE_COPY`` of the reference or place as much of the
   query inside it: two crops of one photo that share half of each are different pictures, not copies.

Which pairs reach the checks is the embedding's call, except where ``FeatureVotes`` adds its own: a picture
pasted into a page or collage fills a fraction of the copy, and a global embedding then barely knows it (the
copy detector of ``openalign bench copy-detection`` put such copies below most false pairs), while its ORB
descriptors still find their match in the original. Each query descriptor whose nearest reference descriptor
passes the ratio test votes for that reference: copies, embedded ones above all, draw many more votes than
false pairs.

OpenCV (``opencv-python-headless``, the ``verify`` extra) is needed only for step 2 and imported only here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from openalign.config import ConfigError

__all__ = [
    "CHECKS",
    "WHOLE_COPY",
    "FeatureVotes",
    "Features",
    "VerifyConfig",
    "aligned_check",
    "decide",
    "features",
    "in_band",
    "overlap_fractions",
    "phash",
    "require_opencv",
    "shown_fraction",
    "verify_pair",
]

CHECKS = ("aligned", "phash", "features")
# Without partial_copies, a feature fit must show this share of the reference or place this share of the query
# inside it: a re-crop, turn, letterbox or paste of a picture does, two crops sharing half of each do not.
WHOLE_COPY = 0.6


@dataclass
class VerifyConfig:
    """How a pair in the uncertain band is verified."""

    phash_bits: int = 6  # accept at once when the 64-bit pHashes differ in at most this many bits
    min_inliers: int = 15  # accept when this many feature matches fit one similarity transform
    # feature matching also needs the fitted transform to show at least this fraction of the reference's area
    # inside the query: a copy shows most of its original (a re-crop to 80 % of each side, straightened by
    # 10°, still shows 0.4 of it)
    min_shown: float = 0.3
    # also count as copies pictures that share only part of each other (two crops of one photo overlapping by
    # half): catches copies cut down to a part of a test image, at the cost of also dropping other crops of it.
    # Off, feature matching needs the fit to show 0.6 of the reference or place 0.6 of the query inside it
    partial_copies: bool = False
    keypoints: int = 1000  # ORB keypoints per image
    max_side: int = 512  # larger images are scaled down to this longest side before feature extraction
    ratio: float = 0.8  # Lowe's ratio test on the two nearest descriptors
    # the checks that may accept a pair: aligned (registered pixels, all pairs at once), then phash, then
    # features (ORB + RANSAC, the one that needs OpenCV) on the pairs the earlier ones left
    checks: list[str] = field(default_factory=lambda: ["aligned", "phash", "features"])
    aligned_side: int = 64  # both images are resized to this square and their residual is scored there
    register_side: int = 48  # the affine fit runs on this smaller square (its maps hold at any size)
    # pairs whose unregistered 16 px luminance residual is above this skip the registration (not copies by
    # the aligned check). Unrelated pictures score about 1 and a re-crop somewhat less: lower it to spare
    # registrations when copies are only mildly edited
    max_coarse_residual: float = 0.95
    # aligned accepts when its worst window's residual, over that window's detail (worst_region_residual), is ≤
    # this, both images low-passed by a Gaussian of aligned_blur pixels (at aligned_side) first: grain at the
    # pixel scale does not survive a repost, so re-crops and re-encodes score well below a picture with one object
    # painted over
    max_residual: float = 0.3
    aligned_blur: float = 1.0
    # verify only each train image's this many highest-cosine pairs in the band (0: all); the rest are not
    # copies, since a copy's own original is what a copy detector ranks first (or nearly)
    nearest: int = 0
    # FeatureVotes: a pair the embedding leaves out becomes a candidate when this many of the query's ORB
    # descriptors have their ratio-tested nearest match in that reference (a copy keeps tens to hundreds)
    min_votes: int = 10

    def validate(self) -> None:
        """Raises ConfigError naming the bad field."""
        unknown = [c for c in self.checks if c not in CHECKS]
        if unknown or not self.checks or len(set(self.checks)) != len(self.checks):
            raise ConfigError(f"verify.checks must be distinct names of {', '.join(CHECKS)}, got {self.checks}")
        if not 16 <= self.register_side <= self.aligned_side:
            raise ConfigError("verify.register_side must be ≥ 16 and at most verify.aligned_side")
        if not self.max_residual > 0 or not self.max_coarse_residual > 0 or self.nearest < 0 or self.aligned_blur < 0:
            raise ConfigError(
                "verify.max_residual and verify.max_coarse_residual must be > 0, verify.nearest and "
                "verify.aligned_blur ≥ 0"
            )
        if not 0 <= self.phash_bits <= 64:
            raise ConfigError(f"verify.phash_bits must be in [0, 64], got {self.phash_bits}")
        if self.min_inliers < 4 or self.keypoints < 10 or self.max_side < 32:
            raise ConfigError("verify.min_inliers must be ≥ 4, verify.keypoints ≥ 10 and verify.max_side ≥ 32")
        if not 0 <= self.min_shown <= 1:
            raise ConfigError(f"verify.min_shown must be in [0, 1], got {self.min_shown}")
        if not 0 < self.ratio <= 1:
            raise ConfigError(f"verify.ratio must be in (0, 1], got {self.ratio}")
        if self.min_votes < 1:
            raise ConfigError(f"verify.min_votes must be at least 1, got {self.min_votes}")


def require_opencv() -> Any:
    """The cv2 module, or a one-line ConfigError saying how to install it."""
    try:
        import cv2
    except ImportError:
        raise ConfigError(
            "verification needs OpenCV: pip install 'openalign[verify]' (opencv-python-headless)"
        ) from None
    return cv2


def _dct_matrix(n: int) -> np.ndarray:
    """Orthonormal DCT-II as a matrix: row k is cos(π (2i + 1) k / 2n), scaled."""
    i = np.arange(n)
    m: np.ndarray = np.cos(np.pi * (2 * i[None, :] + 1) * np.arange(n)[:, None] / (2 * n)) * np.sqrt(2 / n)
    m[0] /= np.sqrt(2)
    return m


_DCT32 = _dct_matrix(32)


def phash(image: Image.Image) -> int:
    """64-bit perceptual hash: grey 32 × 32, 2-d DCT, the 8 × 8 lowest frequencies above their median."""
    grey = np.asarray(image.convert("L").resize((32, 32), Image.Resampling.LANCZOS), dtype=np.float64)
    low = (_DCT32 @ grey @ _DCT32.T)[:8, :8].ravel()
    bits = low > np.median(low[1:])  # the DC term sets the median off, as in the usual pHash
    return int(sum(1 << i for i, b in enumerate(bits) if b))


@dataclass
class Features:
    """What verification keeps of one image: its pHash, ORB keypoints and descriptors, and the mirror's."""

    hash: int
    points: np.ndarray  # float32 [K, 2], in the pixels of the (scaled-down) image ORB saw
    descriptors: np.ndarray  # uint8 [K, 32]
    size: tuple[int, int] = (0, 0)  # (width, height) of that image
    mirror_points: np.ndarray | None = None
    mirror_descriptors: np.ndarray | None = None


def _orb(cv2: Any, grey: np.ndarray, keypoints: int) -> tuple[np.ndarray, np.ndarray]:
    orb = cv2.ORB_create(nfeatures=keypoints, fastThreshold=10, edgeThreshold=15, patchSize=15)
    kps, desc = orb.detectAndCompute(grey, None)
    if desc is None or not kps:
        return np.zeros((0, 2), np.float32), np.zeros((0, 32), np.uint8)
    return np.array([k.pt for k in kps], dtype=np.float32), desc


def features(image: Image.Image, config: VerifyConfig | None = None, *, mirror: bool = False) -> Features:
    """pHash and ORB features of ``image`` (with ``mirror``, of its left–right flip too); the pHash alone
    when the ``features`` check is off."""
    cfg = config or VerifyConfig()
    if "features" not in cfg.checks:
        return Features(phash(image), np.zeros((0, 2), np.float32), np.zeros((0, 32), np.uint8))
    cv2 = require_opencv()
    im = image.convert("L")
    scale = cfg.max_side / max(im.size)  # bounds the cost per image
    if scale < 1:
        im = im.resize((max(1, round(im.width * scale)), max(1, round(im.height * scale))), Image.Resampling.BILINEAR)
    grey = np.asarray(im, dtype=np.uint8)
    points, desc = _orb(cv2, grey, cfg.keypoints)
    out = Features(phash(image), points, desc, (grey.shape[1], grey.shape[0]))
    if mirror:
        out.mirror_points, out.mirror_descriptors = _orb(cv2, np.ascontiguousarray(grey[:, ::-1]), cfg.keypoints)
    return out


def _descriptor_digest(f: Features) -> bytes:
    """A digest of an image's descriptors and its mirror's: equal for the same picture read twice."""
    digest = hashlib.blake2b(digest_size=16)
    for d in (f.descriptors, f.mirror_descriptors):
        arr = np.zeros((0, 32), np.uint8) if d is None else np.ascontiguousarray(d)
        digest.update(np.int64(len(arr)).tobytes())
        digest.update(arr.tobytes())
    return digest.digest()


class FeatureVotes:
    """The references' ORB descriptors, and their mirrors', in one FAISS binary index (exact Hamming search):
    ``votes(query)`` counts, per reference, the query descriptors whose nearest indexed descriptor is that
    reference's and passes Lowe's ratio test against the second nearest. The memory is 32 bytes per reference
    keypoint (``keypoints`` per image, twice with the mirror) and each query costs a search of all of them, so it
    suits a test set of thousands of images, not a crawl.

    References with identical descriptors (the same picture twice in a test set) are indexed once and each gets
    the votes: two copies of every descriptor would make each other the second nearest and fail every ratio
    test."""

    def __init__(self, references: Sequence[Features], config: VerifyConfig | None = None):
        import faiss

        self.config = config or VerifyConfig()
        self.references = len(references)
        # group[i]: the first reference with i's descriptors; only those first ones are indexed.
        first: dict[bytes, int] = {}
        self.group = np.array([first.setdefault(_descriptor_digest(f), i) for i, f in enumerate(references)], np.int64)
        parts = [
            (i, d)
            for i, f in enumerate(references)
            if self.group[i] == i
            for d in (f.descriptors, f.mirror_descriptors)
            if d is not None and len(d)
        ]
        self.owner = (
            np.concatenate([np.full(len(d), i, np.int64) for i, d in parts]) if parts else np.zeros(0, np.int64)
        )
        self.index = faiss.IndexBinaryFlat(256)
        if parts:
            self.index.add(np.ascontiguousarray(np.concatenate([d for _, d in parts])))

    def votes(self, query: Features) -> np.ndarray:
        """int64 [references]: the query's ratio-tested nearest-descriptor votes for each reference."""
        out = np.zeros(self.references, np.int64)
        if len(query.descriptors) == 0 or self.index.ntotal < 2:
            return out
        distances, labels = self.index.search(np.ascontiguousarray(query.descriptors), 2)
        passed = distances[:, 0] < self.config.ratio * distances[:, 1]
        np.add.at(out, self.owner[labels[passed, 0]], 1)
        return out[self.group]

    def candidates(self, query: Features) -> np.ndarray:
        """The references with at least ``min_votes`` votes from ``query``."""
        return np.flatnonzero(self.votes(query) >= self.config.min_votes)


def _similarity(
    cv2: Any, pa: np.ndarray, da: np.ndarray, pb: np.ndarray, db: np.ndarray, cfg: VerifyConfig
) -> tuple[int, np.ndarray | None]:
    """(inliers, the 2 × 3 map of a's pixels into b's) of the RANSAC similarity fit to a's matches in b, each
    of b's keypoints matched at most once (by the closest of the descriptors that pick it)."""
    if len(da) < 2 or len(db) < 2:
        return 0, None
    closest: dict[int, Any] = {}
    for pair in cv2.BFMatcher(cv2.NORM_HAMMING).knnMatch(da, db, k=2):
        if len(pair) == 2 and pair[0].distance < cfg.ratio * pair[1].distance:
            m = pair[0]
            if m.trainIdx not in closest or m.distance < closest[m.trainIdx].distance:
                closest[m.trainIdx] = m
    if len(closest) < 4:
        return 0, None
    good = list(closest.values())
    cv2.setRNGSeed(0)  # each pair's fit is the same whatever pairs were fitted before it
    transform, mask = cv2.estimateAffinePartial2D(
        pa[[m.queryIdx for m in good]],
        pb[[m.trainIdx for m in good]],
        method=cv2.RANSAC,
        ransacReprojThreshold=5.0,
        maxIters=2000,
        confidence=0.99,
    )
    if transform is None or mask is None:
        return 0, None
    return int(mask.sum()), transform


def _clip(polygon: list[tuple[float, float]], axis: int, bound: float, keep_below: bool) -> list[tuple[float, float]]:
    """Sutherland–Hodgman: the part of a convex polygon on one side of the line ``point[axis] = bound``."""
    out: list[tuple[float, float]] = []
    for k, current in enumerate(polygon):
        previous = polygon[k - 1]
        inside_now = (current[axis] <= bound) == keep_below
        inside_before = (previous[axis] <= bound) == keep_below
        if inside_now != inside_before:
            t = (bound - previous[axis]) / (current[axis] - previous[axis])
            out.append((previous[0] + t * (current[0] - previous[0]), previous[1] + t * (current[1] - previous[1])))
        if inside_now:
            out.append(current)
    return out


def overlap_fractions(
    transform: np.ndarray, query_size: tuple[int, int], reference_size: tuple[int, int]
) -> tuple[float, float]:
    """(the fraction of the reference's area that ``transform`` (2 × 3, query pixels → reference pixels) places
    inside the query, the fraction of the query's area it places inside the reference). Exact: the query's
    outline mapped into the reference, clipped to it, and its area taken by the shoelace formula."""
    m = np.asarray(transform, np.float64)
    (qw, qh), (rw, rh) = query_size, reference_size
    mapped_area = abs(float(np.linalg.det(m[:, :2]))) * qw * qh
    corners = [(-0.5, -0.5), (qw - 0.5, -0.5), (qw - 0.5, qh - 0.5), (-0.5, qh - 0.5)]
    polygon = [(m[0, 0] * x + m[0, 1] * y + m[0, 2], m[1, 0] * x + m[1, 1] * y + m[1, 2]) for x, y in corners]
    for axis, low, high in ((0, -0.5, rw - 0.5), (1, -0.5, rh - 0.5)):
        polygon = _clip(_clip(polygon, axis, low, keep_below=False), axis, high, keep_below=True)
        if not polygon:
            return 0.0, 0.0
    xs, ys = np.array([p[0] for p in polygon]), np.array([p[1] for p in polygon])
    area = 0.5 * abs(float(np.dot(xs, np.roll(ys, -1)) - np.dot(ys, np.roll(xs, -1))))
    return area / (rw * rh), (area / mapped_area if mapped_area > 0 else 0.0)


def shown_fraction(transform: np.ndarray, query_size: tuple[int, int], reference_size: tuple[int, int]) -> float:
    """The fraction of the reference's area that ``transform`` (2 × 3, query pixels → reference pixels) places
    inside the query: 1 for a resize, padding or embedding of the whole picture, 0.64 for a re-crop to 80 % of
    each side, near 0 for a fit that squeezes the query onto a small patch (``overlap_fractions``)."""
    return overlap_fractions(transform, query_size, reference_size)[0]


def _consistent(
    cv2: Any, a: Features, b_points: np.ndarray, b_desc: np.ndarray, size: tuple[int, int], cfg: VerifyConfig
) -> int:
    """Inliers of a's fit into b, or 0 when that fit shows less than ``min_shown`` of b or, without
    ``partial_copies``, neither shows ``WHOLE_COPY`` of b nor places that much of a inside b."""
    inliers, transform = _similarity(cv2, a.points, a.descriptors, b_points, b_desc, cfg)
    if transform is None:
        return 0
    shown, covered = overlap_fractions(transform, a.size, size)
    if shown < cfg.min_shown or (not cfg.partial_copies and max(shown, covered) < WHOLE_COPY):
        return 0
    return inliers


def verify_pair(a: Features, b: Features, config: VerifyConfig | None = None) -> tuple[bool, str, int]:
    """(is a copy, what decided it: ``phash``, ``features`` or ``rejected``, feature inliers) by the pHash and
    feature checks that ``config.checks`` names (``aligned`` works on batches: ``pipeline/verify.py``)."""
    cfg = config or VerifyConfig()
    if "phash" in cfg.checks and bin(a.hash ^ b.hash).count("1") <= cfg.phash_bits:
        return True, "phash", 0
    if "features" not in cfg.checks:
        return False, "rejected", 0
    cv2 = require_opencv()
    inliers = _consistent(cv2, a, b.points, b.descriptors, b.size, cfg)
    if b.mirror_points is not None and b.mirror_descriptors is not None and inliers < cfg.min_inliers:
        inliers = max(inliers, _consistent(cv2, a, b.mirror_points, b.mirror_descriptors, b.size, cfg))
    if inliers >= cfg.min_inliers:
        return True, "features", inliers
    return False, "rejected", inliers


def aligned_check(queries: np.ndarray, references: np.ndarray, config: VerifyConfig | None = None) -> np.ndarray:
    """bool [B]: which pairs of uint8 [B, 3, S, S] thumbnails (``aligned_side``) the aligned check accepts: the
    coarse screen first, then registration at ``register_side`` and the worst region at full size."""
    import torch

    from openalign.data.alignment import _as_float, coarse_residual, register, worst_region_residual

    cfg = config or VerifyConfig()
    # To [0, 1] floats once: each step below would otherwise convert the same uint8 pixels again.
    q, r = _as_float(queries), _as_float(references)
    ok: np.ndarray = coarse_residual(q, r) <= cfg.max_coarse_residual
    if ok.any():  # only the pairs that pass the screen are registered
        picked = torch.from_numpy(ok)
        q, r = q[picked], r[picked]
        affine = register(q, r, side=cfg.register_side)
        ok[ok] = worst_region_residual(q, r, affine, blur=cfg.aligned_blur) <= cfg.max_residual
    return ok


def in_band(cosine: float, threshold: float, band: float) -> bool:
    """Whether verification decides a pair: its cosine lies in (threshold - band, threshold + band]."""
    return threshold - band < cosine <= threshold + band


def decide(
    cosine: float,
    a: Features | None,
    b: Features | None,
    threshold: float,
    band: float,
    config: VerifyConfig | None = None,
) -> tuple[bool, str]:
    """(is a copy, who decided: ``embedding``, ``phash``, ``features`` or ``rejected``) for one pair.

    Outside the band the cosine decides alone (above the threshold a copy); inside it, the pixels do
    (``verify_pair`` on the two images' ``features``, which must then be given).
    """
    if not in_band(cosine, threshold, band):
        return cosine > threshold, "embedding"
    if a is None or b is None:
        raise ValueError("a pair in the verification band needs the features of both images")
    accepted, how, _ = verify_pair(a, b, config)
    return accepted, how
