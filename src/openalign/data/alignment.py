"""Is one picture a copy of another, by their aligned pixels: register the pair, then find the worst region.

A copy reposted on the web is the same photograph re-cropped a little, rescaled, re-toned and re-compressed.
Once the crop and scale are undone, every region of it matches the original up to a change of brightness and
contrast and some compression noise. A different picture that an embedding confuses with it — the same
background with another object on it, the same scene from a burst a moment later — matches in most places
and fails in some. So the decision here is about the *worst* region, not the average:

1. ``register``: an affine map of each query's pixel grid into its reference, found by Gauss–Newton on the
   photometrically fitted residual, coarse to fine (scales and shifts at half size, the whole map at full
   size), many pairs at once. It starts from the identity, so it undoes what mild edits do (a re-crop of a
   few percent a side, rescaling, a slight shift); large transforms (mirror, embedding in a larger picture)
   are left to feature matching.
2. ``worst_region_residual``: with the reference warped onto the query, both taken to luminance, low-passed
   (grain at the pixel scale does not survive a repost) and a gain and offset fitted (brightness and contrast
   edits cost nothing, and a saturation edit leaves luminance as it is), the squared residual averaged over
   windows of ``1/window`` of the side, each over the window's own detail, and the largest of them. A copy
   scores a few tenths at most; a picture with one object changed scores on that object.

   Each window is scored over its own detail because resampling leaves residual where the detail is, so a
   copy's busiest texture would score high against a flat picture's variance. The low-pass and the anti-aliased
   half-size level let one limit (0.3, the one photos take) pass more copies with fewer other pictures
   (docs/decisions/copy-verification.md).

Pure torch on small grids, many pairs at once.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from openalign.data.augment import image_array, luma

__all__ = ["aligned_arrays", "coarse_residual", "register", "worst_region_residual"]

# (shrink, Gauss–Newton steps, free parameters, blur in pixels) per level: at half size only the scales and
# shifts that a re-crop and resize make, then at full size the whole affine map. Enough for the few-percent crops
# and shifts above to converge from the identity (more steps changed no decision on the synthetic world's
# copies); with all six parameters free at half size too, a copy of a striped or periodic texture could slide
# into a shear that lines the stripes up elsewhere. The half-size level is low-passed first: shrinking stripes or
# bricks a few pixels apart aliases them into a coarser false pattern, on which Gauss–Newton can lock a copy into
# the wrong period; blurred, the picture's larger shapes pull the fit.
_LEVELS = ((2, 8, 4, 1.0), (1, 5, 6, 0.0))
_SHEARS = [1, 3]  # a12 and a21 of the row-major 2 × 3 map: held at their value by a 4-parameter level
_MAX_STEP = 0.5  # no parameter moves further from the identity than this (a diverging fit stays bounded)
_FLOOR = 0.1  # of the picture's variance, added to each window's own detail when its residual is scored


def aligned_arrays(images: list[Image.Image], side: int) -> np.ndarray:
    """uint8 [N, 3, side, side]: each whole image resized to ``side``², the grid ``register`` works on."""
    if not images:
        return np.zeros((0, 3, side, side), np.uint8)
    return np.stack([image_array(image, side) for image in images])


def _as_float(x: torch.Tensor | np.ndarray) -> torch.Tensor:
    t = torch.as_tensor(x)
    # Divided in place: the same values as ``t.float() / 255`` without a second batch-sized allocation, which
    # for the thumbnails verification converts is also faster.
    return t.float().div_(255.0) if t.dtype == torch.uint8 else t.float()


def _luminance(x: torch.Tensor) -> torch.Tensor:
    """ITU-R 601 luma of RGB [B, 3, H, W] (what a saturation or colour-balance edit barely moves); else ``x``."""
    return luma(x) if x.shape[1] == 3 else x


def _grid(side: int) -> torch.Tensor:
    """[side², 3]: (x, y, 1) of each pixel centre in the [-1, 1] coordinates ``grid_sample`` reads."""
    c = (torch.arange(side, dtype=torch.float32) + 0.5) / side * 2 - 1
    ys, xs = torch.meshgrid(c, c, indexing="ij")
    return torch.stack([xs.reshape(-1), ys.reshape(-1), torch.ones(side * side)], 1)


def _fit(q: torch.Tensor, w: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per image and channel, the gain that best maps ``w`` onto ``q`` inside mask ``m``, and both means."""
    count = m.sum((2, 3), keepdim=True).clamp_min(1)
    mq = (q * m).sum((2, 3), keepdim=True) / count
    mw = (w * m).sum((2, 3), keepdim=True) / count
    gain = ((q - mq) * (w - mw) * m).sum((2, 3), keepdim=True) / (((w - mw) ** 2 * m).sum((2, 3), keepdim=True) + 1e-6)
    return gain, mq, mw, count


def _warp(ref: torch.Tensor, affine: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ref`` (with any extra channels) sampled at the query's pixels, and the mask of those inside it."""
    b, _, h, w = ref.shape
    where = torch.einsum("bij,pj->bpi", affine, grid).view(b, h, w, 2)
    inside = (where.abs() <= 1).all(-1).unsqueeze(1).float()
    return F.grid_sample(ref, where, mode="bilinear", padding_mode="border", align_corners=False), inside


def _gradients(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Central differences of ``t`` per unit of the [-1, 1] coordinates (a pixel is 2/side of them)."""
    gx, gy = torch.zeros_like(t), torch.zeros_like(t)
    gx[..., 1:-1] = (t[..., 2:] - t[..., :-2]) * (t.shape[-1] / 4)
    gy[..., 1:-1, :] = (t[..., 2:, :] - t[..., :-2, :]) * (t.shape[-2] / 4)
    return gx, gy


@functools.lru_cache(maxsize=16)
def _blur_matrix(side: int, sigma: float) -> torch.Tensor:
    """[side, side]: a separable Gaussian of ``sigma`` pixels along one axis as a matrix, edges replicated (a tap
    that falls outside the image adds its weight to the nearest edge pixel)."""
    radius = max(1, int(np.ceil(2.5 * sigma)))
    taps = np.exp(-(np.arange(-radius, radius + 1) ** 2) / (2 * sigma**2))
    taps /= taps.sum()
    matrix = np.zeros((side, side))
    rows = np.arange(side)
    for offset, tap in zip(range(-radius, radius + 1), taps, strict=True):
        np.add.at(matrix, (rows, np.clip(rows + offset, 0, side - 1)), tap)
    return torch.from_numpy(matrix.astype(np.float32))


def _low_pass(t: torch.Tensor, sigma: float) -> torch.Tensor:
    """``t`` [B, C, H, W] blurred by a Gaussian of ``sigma`` pixels (separable, edges replicated); ``t`` itself at
    0. Two matrix products over the whole batch, which on a CPU are far faster than a depthwise convolution of the
    same taps."""
    if sigma <= 0:
        return t
    rows, columns = (_blur_matrix(n, float(sigma)).to(t.dtype) for n in t.shape[-2:])
    return rows @ t @ columns.T


def register(
    queries: torch.Tensor | np.ndarray,
    references: torch.Tensor | np.ndarray,
    side: int | None = None,
) -> torch.Tensor:
    """[B, 2, 3] affine maps, in ``affine_grid``'s convention, taking each query's pixels into its reference.

    ``queries`` and ``references`` are [B, C, S, S] (uint8 or float in [0, 1]), fitted at ``side`` pixels
    when that is smaller than S (the maps work in [-1, 1] coordinates, so they hold at any size). Each step
    solves the 6 × 6 normal equations of the linearised residual ``q - (g · ref(A x) + b)`` with the channel
    gains ``g`` refitted at the current map; the 6 × 6 matrix is built from per-pixel sums over the 6 products of
    (x, y, 1), so no [B, 6, pixels] Jacobian is ever materialised.
    """
    q_full, r_full = _as_float(queries), _as_float(references)
    if q_full.shape != r_full.shape or q_full.dim() != 4:
        raise ValueError(f"register needs two [B, C, S, S] batches of one shape, got {q_full.shape} and {r_full.shape}")
    if side is not None and side < q_full.shape[-1]:
        q_full = F.interpolate(q_full, size=(side, side), mode="area")
        r_full = F.interpolate(r_full, size=(side, side), mode="area")
    b, c, side, _ = q_full.shape
    identity = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    affine = identity.expand(b, 2, 3)
    for shrink, steps, free, blur in _LEVELS:
        size = max(4, side // shrink)
        q = _low_pass(F.interpolate(q_full, size=(size, size), mode="area") if size != side else q_full, blur)
        r = _low_pass(F.interpolate(r_full, size=(size, size), mode="area") if size != side else r_full, blur)
        stack = torch.cat([r, *_gradients(r)], 1)
        grid = _grid(size)
        x, y, one = grid.unbind(1)
        products = torch.stack([x * x, x * y, x, y * y, y, one], 1)  # the 6 distinct entries of (x,y,1)(x,y,1)ᵀ
        for _ in range(steps):
            sampled, m = _warp(stack, affine, grid)
            w, gx, gy = sampled[:, :c], sampled[:, c : 2 * c], sampled[:, 2 * c :]
            gain, mq, mw, _ = _fit(q, w, m)
            residual = ((q - mq) - gain * (w - mw)) * m
            ax, ay = gain * gx * m, gain * gy * m  # d(fitted ref)/d(x), d/d(y) at each pixel
            sums = torch.stack([(ax * ax).sum(1), (ax * ay).sum(1), (ay * ay).sum(1)], 1).view(b, 3, -1) @ products
            rhs = torch.cat([(ax * residual).sum(1).view(b, -1) @ grid, (ay * residual).sum(1).view(b, -1) @ grid], 1)
            sym = sums[..., [0, 1, 2, 1, 3, 4, 2, 4, 5]].view(b, 3, 3, 3)  # [B, block, 3, 3]
            hessian = torch.cat([torch.cat([sym[:, 0], sym[:, 1]], 2), torch.cat([sym[:, 1], sym[:, 2]], 2)], 1)
            # Levenberg damping: a flat image (no gradient) gets a zero step, not a singular solve.
            scale = hessian.diagonal(dim1=1, dim2=2).mean(1).view(b, 1, 1)
            hessian = hessian + torch.eye(6) * (1e-3 * scale + 1e-8)
            if free == 4:  # solve for the other four alone: zero rows and columns, a unit diagonal, no pull
                hessian[:, _SHEARS, :] = 0.0
                hessian[:, :, _SHEARS] = 0.0
                hessian[:, _SHEARS, _SHEARS] = 1.0
                rhs[:, _SHEARS] = 0.0
            step = torch.linalg.solve(hessian, rhs.unsqueeze(-1)).view(b, 2, 3)
            affine = identity + (affine + step - identity).clamp(-_MAX_STEP, _MAX_STEP)
    return affine


def coarse_residual(
    queries: torch.Tensor | np.ndarray, references: torch.Tensor | np.ndarray, side: int = 16
) -> np.ndarray:
    """float [B]: the whole-image luminance residual at ``side`` pixels, unregistered, after a gain and offset
    fit, over the query's variance. At 16 px a re-crop of a few percent moves nothing by more than a pixel, so
    a mild copy stays low while most pictures an embedding merely confuses with it do not; unrelated pictures
    score about 1. A screen that spares such pairs the registration."""
    q, r = (F.interpolate(_luminance(_as_float(x)), size=(side, side), mode="area") for x in (queries, references))
    qm, rm = q - q.mean((2, 3), keepdim=True), r - r.mean((2, 3), keepdim=True)
    gain = (qm * rm).sum((2, 3), keepdim=True) / ((rm * rm).sum((2, 3), keepdim=True) + 1e-6)
    score: np.ndarray = (((qm - gain * rm) ** 2).mean((1, 2, 3)) / ((qm * qm).mean((1, 2, 3)) + 1e-4)).numpy()
    return score


def worst_region_residual(
    queries: torch.Tensor | np.ndarray,
    references: torch.Tensor | np.ndarray,
    affine: torch.Tensor,
    window: int = 8,
    floor: float = _FLOOR,
    blur: float = 0.0,
) -> np.ndarray:
    """float [B]: each pair's worst window (``1/window`` of the side, half-overlapping) after warping the
    reference by ``affine``, low-passing both images by a Gaussian of ``blur`` pixels and fitting a gain and
    offset to the reference's luminance (each channel's, for images that are not RGB): the window's mean squared
    residual over its own detail — the mean of the query's and the fitted reference's variances inside it — plus
    ``floor`` times the query's variance over the whole picture.

    Why the low-pass: grain at the pixel scale (sand, film grain, sensor noise) does not survive a repost — a
    resize averages it away and a JPEG re-encode replaces it with block artefacts of its own — so sharp, a copy of
    a grainy picture left a residual as large as its detail everywhere. Low-passed, what a repost keeps (shapes,
    edges, shading) decides instead; at the check's default of 1 px at 64 px, a disc of a tenth of the side
    painted over a photo still scores above the check's limit.

    Resampling and re-compression leave residual in proportion to the detail they blur, so a copy scores a
    few tenths even in its busiest texture, while a window showing something else scores about 1 or more
    whatever its contrast; the floor keeps flat windows, where a little noise would be divided by almost
    nothing, from deciding. Regions the warp leaves uncovered count for nothing, and a window at least half
    covered is scored on its covered part."""
    q, r = _luminance(_as_float(queries)), _luminance(_as_float(references))
    b, c, side, _ = q.shape
    w, m = _warp(r, affine, _grid(side))
    q, w = _low_pass(q, blur), _low_pass(w, blur)
    gain, mq, mw, count = _fit(q, w, m)
    fitted = mq + gain * (w - mw)
    variance = (((q - mq) ** 2) * m).sum((1, 2, 3)) / count.view(b) / c
    k = max(1, side // window)
    stride = max(1, k // 2)
    covered = F.avg_pool2d(m, k, stride)

    def local_mean(t: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(t * m, k, stride) / covered.clamp_min(0.5)

    residual = local_mean((q - fitted) ** 2)
    detail = (local_mean(q * q) - local_mean(q) ** 2 + local_mean(fitted * fitted) - local_mean(fitted) ** 2) / 2
    local = (residual / (detail.clamp_min(0) + floor * variance.view(b, 1, 1, 1) + 1e-6)).mean(1, keepdim=True)
    local = torch.where(covered >= 0.5, local, torch.zeros_like(local))
    score: np.ndarray = local.amax((1, 2, 3)).numpy()
    return score
