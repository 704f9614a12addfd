"""JPEG decoding, cropping, resizing and flipping on the device (``data.decode: cuda``), for when CPU workers
are what limits training.

The workers read each JPEG's header only and draw its crop box and flip exactly as the CPU transform draws them
(``transforms.random_crop``), so the same seed gives the same crops either way; ``DeviceDecoder`` then decodes a
batch of encoded images at once (``torchvision.io.decode_jpeg`` on the GPU) and repeats the CPU transform's
steps on the device: the ``resize``-square resize (blocks of pixels averaged first for a downscale of 3× or more,
as PIL's ``reducing_gap``, then antialiased bicubic, PIL's filter), the crop and the flip. Against the CPU path
with draft mode off the pixels differ by rounding only (a few levels of 255 at most on photos, more on a tiny
image upscaled over sharp edges; tests/test_device_decode.py bounds it); the GPU's JPEG decoder
adds its own IDCT and chroma upsampling (tests/test_cuda.py bounds the two together).

The decode function is a parameter: ``pil_decode`` decodes on the CPU with PIL, so everything after the decode
runs, and is tested, without a GPU or torchvision.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from openalign.data.transforms import REDUCING_GAP

# Encoded images (1-D uint8 CPU tensors) → decoded RGB images (uint8 [3, H, W]) on the device; a failure raises.
Decode = Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]]
# Errors that say nothing about an image: no decoder installed, or no device memory.
_FATAL = (ImportError, torch.OutOfMemoryError)
# Images of one size resized in one call (bounding the float copy a group takes).
_GROUP = 32

__all__ = ["Decode", "DeviceDecoder", "device_decodable", "pil_decode", "resize_crop_flip", "torchvision_decode"]


def device_decodable(data: bytes, image: Image.Image) -> bool:
    """Whether a GPU JPEG decoder takes this image (``image``: its header, opened by PIL): a baseline or
    progressive JPEG in RGB or grey, ending in its end-of-image marker. Everything else (other formats, CMYK, a
    file cut short) is decoded by the CPU path, which finds a broken file as it always does."""
    return image.format == "JPEG" and image.mode in ("RGB", "L") and data.rstrip(b"\0").endswith(b"\xff\xd9")


def torchvision_decode(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Batched ``torchvision.io.decode_jpeg`` onto ``device``, in RGB."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError as err:
        raise ImportError("data.decode: cuda needs torchvision (pip install torchvision)") from err
    out = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    return list(out) if isinstance(out, list | tuple) else [out]


def pil_decode(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """PIL's decode of each image (full size, no draft mode), as uint8 [3, H, W] on ``device``."""
    out = []
    for item in data:
        with Image.open(io.BytesIO(item.numpy().tobytes())) as image:
            rgb = np.asarray(image.convert("RGB"), dtype=np.uint8)
        out.append(torch.from_numpy(rgb.copy()).permute(2, 0, 1).to(device))
    return out


def _reduce(x: torch.Tensor, resize: int) -> torch.Tensor:
    """PIL's ``reducing_gap`` step: a downscale by ``REDUCING_GAP``× or more first averages whole blocks."""
    h, w = x.shape[-2:]
    fx, fy = int(w / resize / REDUCING_GAP) or 1, int(h / resize / REDUCING_GAP) or 1
    if fx == 1 and fy == 1:
        return x
    # ceil_mode: the blocks cut by the right and bottom edges average the pixels they hold, as PIL's reduce.
    return F.avg_pool2d(x, (fy, fx), ceil_mode=True)


def resize_crop_flip(
    images: Sequence[torch.Tensor],
    boxes: Sequence[Sequence[int]],
    flips: Sequence[bool],
    resize: int,
    out: torch.Tensor,
    rows: Sequence[int] | None = None,
) -> torch.Tensor:
    """``transforms.train_transform`` (and ``eval_transform``) on decoded uint8 [3, H, W] images: each resized to
    ``resize`` square, cropped to its (left, top, right, bottom) box and flipped where ``flips`` says, into row
    ``rows[i]`` (default ``i``) of ``out`` (uint8 [n, 3, S, S] on the images' device). Images of one size are
    resized together, up to ``_GROUP`` at a time."""
    rows = range(len(images)) if rows is None else rows
    by_size: dict[tuple[int, int], list[int]] = {}
    for i, image in enumerate(images):
        by_size.setdefault((image.shape[-2], image.shape[-1]), []).append(i)
    for (h, w), same in by_size.items():
        for start in range(0, len(same), _GROUP):
            group = same[start : start + _GROUP]
            x = torch.stack([images[i] for i in group])
            if (h, w) != (resize, resize):
                x = _reduce(x.float(), resize)
                x = F.interpolate(x, size=(resize, resize), mode="bicubic", antialias=True, align_corners=False)
                x = x.round_().clamp_(0, 255).to(torch.uint8)
            for j, i in enumerate(group):
                left, top, right, bottom = boxes[i]
                crop = x[j, :, top:bottom, left:right]
                out[rows[i]] = crop.flip(-1) if flips[i] else crop
    return out


class DeviceDecoder:
    """Encoded JPEGs plus their boxes and flips → the uint8 crops on ``device``, as the CPU transform makes them.

    ``decode`` defaults to torchvision's GPU decoder (imported at the first batch); pass ``pil_decode`` to run
    the rest on any device.
    """

    def __init__(self, image_size: int, resize: int, device: torch.device | str, decode: Decode | None = None):
        self.image_size, self.resize, self.device = image_size, resize, torch.device(device)
        self.decode = decode or torchvision_decode

    def __call__(
        self,
        data: list[torch.Tensor],
        boxes: Sequence[Sequence[int]],
        flips: Sequence[bool],
        out: torch.Tensor | None = None,
        rows: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """Decode ``data`` (1-D uint8 CPU tensors) and write image ``i``'s crop into row ``rows[i]`` (default
        ``i``) of ``out`` (a new uint8 [n, 3, S, S] on the device by default). Returns ``out`` and the indices
        ``i`` no decoder could read: a batch the decoder refuses is decoded image by image, an image it refuses is
        tried with PIL, and the rows of those neither reads are left as they were for the caller to fill."""
        if out is None:
            out = torch.zeros((len(data), 3, self.image_size, self.image_size), dtype=torch.uint8, device=self.device)
        if not data:
            return out, []
        rows = range(len(data)) if rows is None else rows
        try:
            images: list[torch.Tensor | None] = list(self.decode(data, self.device))
        except _FATAL:
            raise
        except Exception:  # one broken image fails the whole batched call: find which
            images = [self._one(item) for item in data]
        good = [i for i, image in enumerate(images) if image is not None]
        decoded = [image for image in images if image is not None]
        good_boxes, good_flips = [boxes[i] for i in good], [bool(flips[i]) for i in good]
        resize_crop_flip(decoded, good_boxes, good_flips, self.resize, out, [rows[i] for i in good])
        return out, [i for i, image in enumerate(images) if image is None]

    def _one(self, item: torch.Tensor) -> torch.Tensor | None:
        for decode in (self.decode, pil_decode):
            try:
                return decode([item], self.device)[0]
            except _FATAL:
                raise
            except Exception:  # a broken image is skipped whatever its decoder raises
                continue
        return None
