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
   image, since a flip moves every keypoint), descriptor matches that pass Lowe's ratio test, and a
   RANSAC fit of a similarity transform (shift, scale, rotation: what crops, resizes, padding, rotation and
   embedding in a larger picture do). A copy keeps many matches consistent with one such transform; a
   different photo of similar colours keeps almost none. ``min_inliers`` consistent matches accept.

OpenCV (``opencv-python-headless``, the ``verify`` extra) is needed only for step 2 and imported only here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from openalign.config import ConfigError

__all__ = [
    "CHECKS",
    "Features",
    "VerifyConfig",
    "aligned_check",
    "decide",
    "features",
    "in_band",
    "phash",
    "require_opencv",
    "verify_pair",
]

CHECKS = ("aligned", "phash", "features")


@dataclass
class VerifyConfig:
    """How a pair in the uncertain band is verified."""

    phash_bits: int = 6  # accept at once when the 64-bit pHashes differ in at most this many bits
    min_inliers: int = 15  # accept when this many feature matches fit one similarity transform
    keypoints: int = 1000  # ORB keypoints per image
    max_side: int = 512  # larger images are scaled down to this longest side before feature extraction
    ratio: float = 0.8  # Lowe's ratio test on the two nearest descriptors
    # the checks that may accept a pair: aligned (registered pixels, all pairs at once), then phash, then
    # features (ORB + RANSAC, the one that needs OpenCV) on the pairs the earlier ones left
    checks: list[str] = field(default_factory=lambda: ["aligned", "phash", "features"])
    aligned_side: int = 64  # both images are resized to this square and their residual is scored there
    register_side: int = 48  # the affine fit runs on this smaller square (its maps hold at any size)
    # pairs whose unregistered 16 px luminance residual is above this skip the registration (not copies by
    # the aligned check). Unrelated pictures score about 1; a 12 % re-crop of a photo 0.87, a 4 % one of the
    # synthetic world at most 0.71: lower it to spare registrations when copies are only mildly edited
    max_coarse_residual: float = 0.95
    max_residual: float = 0.45  # aligned accepts when the worst region's residual / the query's variance is ≤ this
    # verify only each train image's this many highest-cosine pairs in the band (0: all); the rest are not
    # copies, since a copy's own original is what a copy detector ranks first (or nearly)
    nearest: int = 0

    def validate(self) -> None:
        """Raises ConfigError naming the bad field."""
        unknown = [c for c in self.checks if c not in CHECKS]
        if unknown or not self.checks or len(set(self.checks)) != len(self.checks):
            raise ConfigError(f"verify.checks must be distinct names of {', '.join(CHECKS)}, got {self.checks}")
        if not 16 <= self.register_side <= self.aligned_side:
            raise ConfigError("verify.register_side must be ≥ 16 and at most verify.aligned_side")
        if not self.max_residual > 0 or not self.max_coarse_residual > 0 or self.nearest < 0:
            raise ConfigError("verify.max_residual and verify.max_coarse_residual must be > 0, verify.nearest ≥ 0")
        if not 0 <= self.phash_bits <= 64:
            raise ConfigError(f"verify.phash_bits must be in [0, 64], got {self.phash_bits}")
        if self.min_inliers < 4 or self.keypoints < 10 or self.max_side < 32:
            raise ConfigError("verify.min_inliers must be ≥ 4, verify.keypoints ≥ 10 and verify.max_side ≥ 32")
        if not 0 < self.ratio <= 1:
            raise ConfigError(f"verify.ratio must be in (0, 1], got {self.ratio}")


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
    points: np.ndarray  # float32 [K, 2]
    descriptors: np.ndarray  # uint8 [K, 32]
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
    out = Features(phash(image), points, desc)
    if mirror:
        out.mirror_points, out.mirror_descriptors = _orb(cv2, np.ascontiguousarray(grey[:, ::-1]), cfg.keypoints)
    return out


def _inliers(cv2: Any, pa: np.ndarray, da: np.ndarray, pb: np.ndarray, db: np.ndarray, cfg: VerifyConfig) -> int:
    if len(da) < 2 or len(db) < 2:
        return 0
    matcher = cv2.BFMatcher(cv2.NORM_HAMMING)
    good = [m[0] for m in matcher.knnMatch(da, db, k=2) if len(m) == 2 and m[0].distance < cfg.ratio * m[1].distance]
    if len(good) < 4:
        return 0
    src = pa[[m.queryIdx for m in good]]
    dst = pb[[m.trainIdx for m in good]]
    transform, mask = cv2.estimateAffinePartial2D(
        src, dst, method=cv2.RANSAC, ransacReprojThreshold=5.0, maxIters=2000, confidence=0.99
    )
    if transform is None or mask is None:
        return 0
    # A copy is scaled by a bounded factor; a degenerate fit (everything onto a point) is not a copy.
    scale = float(np.hypot(transform[0, 0], transform[1, 0]))
    if not 0.05 < scale < 20:
        return 0
    return int(mask.sum())


def verify_pair(a: Features, b: Features, config: VerifyConfig | None = None) -> tuple[bool, str, int]:
    """(is a copy, what decided it: ``phash``, ``features`` or ``rejected``, feature inliers) by the pHash and
    feature checks that ``config.checks`` names (``aligned`` works on batches: ``pipeline/verify.py``)."""
    cfg = config or VerifyConfig()
    if "phash" in cfg.checks and bin(a.hash ^ b.hash).count("1") <= cfg.phash_bits:
        return True, "phash", 0
    if "features" not in cfg.checks:
        return False, "rejected", 0
    cv2 = require_opencv()
    inliers = _inliers(cv2, a.points, a.descriptors, b.points, b.descriptors, cfg)
    if b.mirror_points is not None and b.mirror_descriptors is not None and inliers < cfg.min_inliers:
        inliers = max(inliers, _inliers(cv2, a.points, a.descriptors, b.mirror_points, b.mirror_descriptors, cfg))
    if inliers >= cfg.min_inliers:
        return True, "features", inliers
    return False, "rejected", inliers


def aligned_check(queries: np.ndarray, references: np.ndarray, config: VerifyConfig | None = None) -> np.ndarray:
    """bool [B]: which pairs of uint8 [B, 3, S, S] thumbnails (``aligned_side``) the aligned check accepts: the
    coarse screen first, then registration at ``register_side`` and the worst region at full size."""
    from openalign.data.alignment import coarse_residual, register, worst_region_residual

    cfg = config or VerifyConfig()
    ok: np.ndarray = coarse_residual(queries, references) <= cfg.max_coarse_residual
    if ok.any():  # only the pairs that pass the screen are registered
        affine = register(queries[ok], references[ok], side=cfg.register_side)
        ok[ok] = worst_region_residual(queries[ok], references[ok], affine) <= cfg.max_residual
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
