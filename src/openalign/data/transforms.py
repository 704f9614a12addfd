"""Image decoding and the paper's preprocessing: resize to 346, random 289 crop + flip to train, centre crop to eval.

Web images come in every mode PIL knows; decoding turns each into 8-bit RGB or raises ``BadImage`` with a
short reason, so a data pipeline can skip the sample and count why.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from openalign.config import ModelConfig
from openalign.data.bad_input import BadInput

# The paper resizes to 346 before cropping 289; other sizes keep the same ratio.
RESIZE_RATIO = 346 / 289
# Downscales by 3× or more first average whole blocks of pixels (PIL's ``reducing_gap``), then resample bicubically.
REDUCING_GAP = 3.0

Transform = Callable[[Image.Image], torch.Tensor]


class BadImage(BadInput):
    """An image that cannot be decoded; ``reason`` is a short slug for counting skipped samples."""


def decode_image(
    data: bytes, *, max_pixels: int = 64_000_000, min_side: int = 2, draft: tuple[int, int] | None = None
) -> Image.Image:
    """Decode encoded image bytes into an 8-bit RGB image.

    The pixel count is checked from the header before any pixel is decoded, so a decompression bomb
    (a small file declaring 20000×20000 pixels) costs nothing. Alpha is composited on white, as a
    browser would show a transparent alt-text image; 16-bit and float images are rescaled to 8 bits.
    ``draft``: a JPEG at least twice this size in both sides decodes at 1/2, 1/4 or 1/8 scale (``open_image``).

    A plain JPEG goes through ``decode_jpeg_pixels``: the same pixels without PIL's parsing of the file, which
    for the small pictures of a crawl's thumbnails is most of the time.
    """
    pixels = decode_jpeg_pixels(data, max_pixels=max_pixels, min_side=min_side, draft=draft)
    if pixels is not None:
        return Image.fromarray(pixels)
    return pil_decode_image(data, max_pixels=max_pixels, min_side=min_side, draft=draft)


def pil_decode_image(
    data: bytes, *, max_pixels: int = 64_000_000, min_side: int = 2, draft: tuple[int, int] | None = None
) -> Image.Image:
    """``decode_image`` by PIL alone: every format, and the reference the fast JPEG path is held to."""
    return to_rgb(load_pixels(open_image(data, max_pixels=max_pixels, min_side=min_side, draft=draft)))


def open_image(
    data: bytes, *, max_pixels: int = 64_000_000, min_side: int = 2, draft: tuple[int, int] | None = None
) -> Image.Image:
    """Read and check an image's header without decoding its pixels (``load_pixels`` does that).

    ``draft`` lets a JPEG decode straight at 1/2, 1/4 or 1/8 scale, as long as both sides stay at least
    that large: the pixels a big photo would take at full size are never allocated. Other formats ignore it.
    """
    if not data:
        raise BadImage("empty", "zero bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise BadImage("too_large", f"{width}x{height} exceeds {max_pixels} pixels")
            if min(width, height) < min_side:
                raise BadImage("too_small", f"{width}x{height} has a side under {min_side} pixels")
            if draft is not None:
                image.draft(image.mode, draft)
    except BadImage:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise BadImage("too_large", str(err)) from err
    except Exception as err:  # PIL raises many types (OSError, SyntaxError, ValueError...) for broken files
        raise BadImage("corrupt", f"{type(err).__name__}: {err}") from err
    return image


# Markers without a length field (restart markers); every other marker PIL knows before the scan has one.
_JPEG_STANDALONE = frozenset(range(0xD0, 0xD8))
# Start-of-frame markers: every 0xC0–0xCF but DHT (C4), JPG (C8) and DAC (CC).
_JPEG_FRAME = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def jpeg_size(head: bytes) -> tuple[int, int] | None:
    """(width, height) of a JPEG from the start of its bytes, when its markers up to the scan are all plain and
    its frame is one PIL opens (8-bit, 1, 3 or 4 components); None for anything else, including a head cut
    before the scan, so that the caller asks PIL (``open_image``). A few microseconds against PIL's ~150."""
    frame = jpeg_frame(head)
    return None if frame is None else (frame.width, frame.height)


@dataclasses.dataclass(frozen=True)
class JpegFrame:
    """What a JPEG's markers before its scan say: its size, its number of colour components, and whether it
    carries Adobe's APP14 marker (whose colour transform flag PIL and libjpeg may read differently)."""

    width: int
    height: int
    components: int
    adobe: bool


def jpeg_frame(head: bytes) -> JpegFrame | None:
    """``jpeg_size``'s walk over the markers, keeping the components and the Adobe marker as well."""
    if head[:3] != b"\xff\xd8\xff":
        return None
    i, n, frame, adobe = 2, len(head), None, False
    while i + 4 <= n:
        if head[i] != 0xFF:
            return None
        marker = head[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _JPEG_STANDALONE:
            i += 2
            continue
        if marker == 0xDA:  # start of scan: PIL stops reading the header here
            return None if frame is None else JpegFrame(*frame, adobe=adobe)
        if marker < 0xC0 or marker in (0xD8, 0xD9):
            return None  # not a header marker: PIL decides
        length = int.from_bytes(head[i + 2 : i + 4], "big")
        if length < 2:
            return None
        if marker in _JPEG_FRAME:
            if frame is not None or i + 10 > n or head[i + 4] != 8 or head[i + 9] not in (1, 3, 4):
                return None
            width, height = int.from_bytes(head[i + 7 : i + 9], "big"), int.from_bytes(head[i + 5 : i + 7], "big")
            frame = (width, height, head[i + 9])
        adobe = adobe or marker == 0xEE
        i += 2 + length
    return None


@functools.cache
def _simplejpeg() -> Any:
    try:
        import simplejpeg
    except ImportError:  # an optional speed-up: PIL decodes the same pixels
        return None
    return simplejpeg


def draft_scale(width: int, height: int, draft: tuple[int, int] | None) -> int:
    """The DCT scale PIL's ``draft`` picks: the largest of 1, 2, 4 and 8 that keeps both sides ≥ ``draft``."""
    if draft is None:
        return 1
    fits = min(width // draft[0], height // draft[1])
    return next((scale for scale in (8, 4, 2) if fits >= scale), 1)


def decode_jpeg_pixels(
    data: bytes, *, max_pixels: int = 64_000_000, min_side: int = 2, draft: tuple[int, int] | None = None
) -> np.ndarray | None:
    """A plain JPEG (8-bit grey or YCbCr, no Adobe marker) decoded straight to RGB pixels (height × width × 3,
    uint8) by libjpeg-turbo through simplejpeg, with ``decode_image``'s draft scale: the very pixels PIL
    returns (``pil_decode_image``), because PIL decodes with the same library and the same settings (the accurate
    integer IDCT, fancy upsampling; tested), in about three quarters of the time and with no PIL image in
    between. None whenever that equality is not certain (simplejpeg missing, another kind of image, a size
    ``decode_image`` would refuse, any warning or error from the decoder), so that the caller uses
    ``decode_image``, which then decodes by PIL and also names what is wrong."""
    codec = _simplejpeg()
    frame = jpeg_frame(data) if codec is not None else None
    if frame is None or frame.components == 4 or frame.adobe:
        return None
    width, height = frame.width, frame.height
    if width * height > max_pixels or min(width, height) < min_side:
        return None
    scale = draft_scale(width, height, draft)
    want = (-(-height // scale), -(-width // scale))
    try:
        pixels = codec.decode_jpeg(data, colorspace="RGB", min_height=want[0], min_width=want[1], strict=True)
    except Exception:  # simplejpeg raises ValueError for anything libjpeg warns about; PIL then decides
        return None
    return pixels if pixels.shape[:2] == want else None


def load_pixels(image: Image.Image) -> Image.Image:
    """Decode the pixels of an image from ``open_image``; BadImage("corrupt") when the data is broken."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise BadImage("too_large", str(err)) from err
    except Exception as err:
        raise BadImage("corrupt", f"{type(err).__name__}: {err}") from err
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """A decoded image in 8-bit RGB; BadImage("unsupported") for a mode that cannot be converted."""
    try:
        return _to_rgb(image)
    except Exception as err:
        raise BadImage("unsupported", f"mode {image.mode}: {err}") from err


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        # Modes PIL cannot convert to RGB without clipping everything above 255 to white.
        arr = np.asarray(image, dtype=np.float64)
        lo, hi = float(arr.min()), float(arr.max())
        scaled = (arr - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(arr)
        return Image.fromarray(scaled.astype(np.uint8), "L").convert("RGB")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def to_uint8(image: Image.Image) -> torch.Tensor:
    """RGB image → uint8 tensor [3, H, W]."""
    arr = np.asarray(image.convert("RGB") if image.mode != "RGB" else image, dtype=np.uint8)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1)


def to_tensor(image: Image.Image, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """RGB image → float tensor [3, H, W] holding (pixel / 255 - mean) / std."""
    return _to_float(to_uint8(image), mean, std)


def _to_float(pixels: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    x = pixels.float().div_(255.0)
    m = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
    return x.sub_(m).div_(s)


def normalize_pixels(pixels: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 pixels ``[N, 3, H, W]`` → float32 ``(pixel / 255 - mean) / std``, on the pixels' own device.

    The same arithmetic, in the same order, as ``to_tensor``: a batch that travels as uint8 and is normalised
    on the GPU chunk by chunk equals, bit for bit, one normalised on the CPU. Float pixels are taken to be
    normalised already and are returned as they are.
    """
    if pixels.dtype != torch.uint8:
        return pixels
    from torch._subclasses.fake_tensor import is_fake

    # Fake pixels (a memory plan) get fake constants of their own: a cached one would reach real steps later.
    scale = _scale.__wrapped__ if is_fake(pixels) else _scale
    m, s = scale(tuple(mean), tuple(std), pixels.device)
    return pixels.float().div_(255.0).sub_(m).div_(s)


@functools.lru_cache(maxsize=16)
def _scale(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Made once per device: a fresh tensor from a Python list is a blocking host-to-device copy every chunk.
    m = torch.tensor(mean, dtype=torch.float32, device=device).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=device).view(1, 3, 1, 1)
    return m, s


def _check_sizes(image_size: int, resize: int) -> None:
    if image_size < 1 or resize < image_size:
        raise ValueError(f"crop size {image_size} must be positive and no larger than the resize {resize}")


def _resize(image: Image.Image, size: int) -> Image.Image:
    if image.size == (size, size):
        return image
    # Square resize, as the paper does (346×346), so the crop sees the whole image whatever its aspect.
    return image.resize((size, size), Image.Resampling.BICUBIC, reducing_gap=REDUCING_GAP)


def resized_pixels(image: Image.Image | np.ndarray, size: int) -> torch.Tensor:
    """uint8 [3, size, size]: ``to_uint8(_resize(image, size))`` by torch's antialiased bicubic resize of uint8
    pixels: PIL's filter (the same kernel, a = -0.5, widened by the scale when shrinking), to within 2 levels of
    255 (a mean difference under 0.01), in vectorised kernels that are faster than PIL's on a photo.
    The decoded pixels (height × width × RGB, or ``decode_jpeg_pixels``'s array as it is) are already the
    channels-last layout those kernels read."""
    if isinstance(image, np.ndarray):
        x = torch.from_numpy(image)
    else:
        x = torch.from_numpy(np.array(image.convert("RGB") if image.mode != "RGB" else image, dtype=np.uint8))
    x = x.permute(2, 0, 1).unsqueeze(0)
    if x.shape[-2:] != (size, size):
        x = torch.nn.functional.interpolate(x, size=(size, size), mode="bicubic", antialias=True)
    return x[0]


def random_crop_pixels(pixels: torch.Tensor, image_size: int, flip: bool = True) -> torch.Tensor:
    """``train_transform``'s crop of ``resized_pixels``: a random ``image_size`` square, flipped half the time with
    ``flip``, drawn from torch's generator (``random_crop``)."""
    (left, top, right, bottom), flipped = random_crop(image_size, pixels.shape[-1], flip)
    crop = pixels[:, top:bottom, left:right]
    return crop.flip(-1) if flipped else crop.contiguous()


def train_transform(
    image_size: int = 289,
    resize: int = 346,
    mean: Sequence[float] = (0.5, 0.5, 0.5),
    std: Sequence[float] = (0.5, 0.5, 0.5),
    flip: bool = True,
    normalize: bool = True,
) -> Callable[[Image.Image | np.ndarray], torch.Tensor]:
    """Resize to ``resize``×``resize``, take a random ``image_size`` crop, flip half the images.

    Randomness comes from torch's global generator, so a seeded DataLoader worker is reproducible.
    ``normalize=False`` returns the crop as uint8 (``normalize_pixels`` makes the model's input of it later).
    The image may also be RGB pixels as ``decode_jpeg_pixels`` returns them.
    """
    _check_sizes(image_size, resize)

    def apply(image: Image.Image | np.ndarray) -> torch.Tensor:
        pixels = random_crop_pixels(resized_pixels(image, resize), image_size, flip)
        return _to_float(pixels, mean, std) if normalize else pixels

    return apply


def random_crop(image_size: int, resize: int, flip: bool = True) -> tuple[tuple[int, int, int, int], bool]:
    """``train_transform``'s draw: a (left, top, right, bottom) ``image_size`` box in the ``resize``-square image
    and whether to flip it, from torch's generator (the draws a GPU decode path repeats to get the same crops)."""
    top = int(torch.randint(0, resize - image_size + 1, ()).item())
    left = int(torch.randint(0, resize - image_size + 1, ()).item())
    flipped = flip and bool(torch.rand(()) < 0.5)
    return (left, top, left + image_size, top + image_size), flipped


def center_crop(image_size: int, resize: int) -> tuple[int, int, int, int]:
    """``eval_transform``'s box: the central ``image_size`` square of the ``resize``-square image."""
    offset = (resize - image_size) // 2
    return offset, offset, offset + image_size, offset + image_size


def eval_transform(
    image_size: int = 289,
    resize: int = 346,
    mean: Sequence[float] = (0.5, 0.5, 0.5),
    std: Sequence[float] = (0.5, 0.5, 0.5),
    normalize: bool = True,
) -> Callable[[Image.Image | np.ndarray], torch.Tensor]:
    """Resize to ``resize``×``resize`` and take the centre ``image_size`` crop (uint8 with ``normalize=False``).
    The image may also be RGB pixels as ``decode_jpeg_pixels`` returns them."""
    _check_sizes(image_size, resize)
    box = center_crop(image_size, resize)

    def apply(image: Image.Image | np.ndarray) -> torch.Tensor:
        if isinstance(image, np.ndarray):
            image = Image.fromarray(image, "RGB")
        image = _resize(image, resize)
        image = image.crop(box)
        return to_tensor(image, mean, std) if normalize else to_uint8(image)

    return apply


# The paper's evaluation crop for classification transfer: a single central crop of 0.875 of the image.
CROP_RATIO = 0.875


def center_crop_transform(
    image_size: int,
    crop_ratio: float = CROP_RATIO,
    mean: Sequence[float] = (0.5, 0.5, 0.5),
    std: Sequence[float] = (0.5, 0.5, 0.5),
) -> Transform:
    """Resize to ``image_size / crop_ratio`` square and take the central ``image_size`` crop (crop_ratio of
    each side): 0.875 at 360 resizes to 411 and keeps the middle 360."""
    if not 0.0 < crop_ratio <= 1.0:
        raise ValueError(f"crop_ratio must be in (0, 1], got {crop_ratio}")
    return eval_transform(image_size, max(image_size, round(image_size / crop_ratio)), mean=mean, std=std)


def inception_crop_box(
    width: int,
    height: int,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    attempts: int = 10,
) -> tuple[int, int, int, int]:
    """A random (left, top, right, bottom) box covering a uniform ``scale`` fraction of the image area with a
    log-uniform aspect ratio in ``ratio`` (Szegedy et al. 2015, the paper's training crop); after
    ``attempts`` boxes that do not fit, the central box of the clamped aspect ratio. Uses torch's generator."""
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(attempts):
        target = area * float(torch.empty(()).uniform_(scale[0], scale[1]))
        aspect = math.exp(float(torch.empty(()).uniform_(log_lo, log_hi)))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left = int(torch.randint(0, width - w + 1, ()).item())
            top = int(torch.randint(0, height - h + 1, ()).item())
            return left, top, left + w, top + h
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def inception_crop_transform(
    image_size: int,
    mean: Sequence[float] = (0.5, 0.5, 0.5),
    std: Sequence[float] = (0.5, 0.5, 0.5),
    *,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    flip: bool = True,
) -> Transform:
    """Inception-style training augmentation: a random-resized crop (``inception_crop_box``) resized to
    ``image_size`` square, flipped left-right half the time."""
    if image_size < 1:
        raise ValueError(f"crop size {image_size} must be positive")
    if not 0.0 < scale[0] <= scale[1] <= 1.0 or not 0.0 < ratio[0] <= ratio[1]:
        raise ValueError(f"bad inception crop bounds: scale {scale}, ratio {ratio}")

    def apply(image: Image.Image) -> torch.Tensor:
        box = inception_crop_box(image.width, image.height, scale, ratio)
        image = image.resize((image_size, image_size), Image.Resampling.BICUBIC, box=box)
        if flip and bool(torch.rand(()) < 0.5):
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return to_tensor(image, mean, std)

    return apply


def model_resize(image_size: int) -> int:
    """The pre-crop size for a crop of ``image_size`` (346 for the paper's 289)."""
    return round(image_size * RESIZE_RATIO)


def model_transform(config: ModelConfig, train: bool = False) -> Transform:
    """The train or eval transform at the model's input size and pixel normalisation."""
    size = config.image_size
    resize, mean, std = model_resize(size), config.pixel_mean, config.pixel_std
    if train:
        return train_transform(image_size=size, resize=resize, mean=mean, std=std)
    return eval_transform(image_size=size, resize=resize, mean=mean, std=std)
