"""Decoding query images with bounded memory, whatever clients send and however many send it at once.

A 0.8 MB JPEG can declare 36 Mpx, which PIL holds as 144 MB of pixels, so a few of them at once can take the
server's memory past what a machine has. Two things bound that here. JPEGs are decoded straight at reduced
scale (``draft``) to the few hundred pixels a side the model looks at, and every decode first reserves the
bytes its pixels will take from a ``DecodeBudget`` shared by all requests, waiting its turn when the budget is spent.
"""

from __future__ import annotations

import base64
import binascii
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from PIL import Image

from openalign.data.transforms import load_pixels, model_resize, open_image, to_rgb

if TYPE_CHECKING:
    from openalign.model.dual_encoder import DualEncoder

# What ``reduce`` cannot average (palette indices, bits, 16-bit) is converted at full size first; modes
# with alpha are premultiplied into a full-size copy by ``reduce`` itself.
_CONVERT_FIRST = {"P": "RGB", "PA": "RGBA", "1": "L", "I;16": "I", "I;16L": "I", "I;16B": "I", "I;16N": "I"}
_FULL_SIZE_COPY = {*_CONVERT_FIRST, "LA", "RGBA"}


class Busy(Exception):
    """The decode budget stayed spent for longer than a request may wait."""


class DecodeBudget:
    """Bytes of decoded pixels allowed in memory at once across all requests: a weighted semaphore.

    Requests are served first come, first served, so a big image is not starved by a stream of small
    ones. A single image costing more than the whole budget waits until nothing else holds any of it and
    then runs alone; the per-image pixel limit, not the budget, is what refuses an image for its size.
    """

    def __init__(self, limit_bytes: int, wait_s: float = 30.0):
        if limit_bytes <= 0:
            raise ValueError(f"the decode budget must be positive, got {limit_bytes} bytes")
        self.limit = limit_bytes
        self.wait_s = wait_s
        self.used = 0
        self.peak = 0  # the most bytes ever held at once
        self._queue: deque[object] = deque()
        self._cond = threading.Condition()

    @contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        """Hold ``nbytes`` of the budget for the ``with`` block; Busy after ``wait_s`` without room."""
        need = max(0, min(nbytes, self.limit))
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            fits = self._cond.wait_for(
                lambda: self._queue[0] is ticket and self.used + need <= self.limit, timeout=self.wait_s
            )
            self._queue.remove(ticket)
            # Whoever is next in line may fit now (or, after a timeout, no longer waits behind this one).
            self._cond.notify_all()
            if not fits:
                raise Busy(f"the server is decoding other images; waited {self.wait_s:g} s")
            self.used += need
            self.peak = max(self.peak, self.used)
        try:
            yield
        finally:
            with self._cond:
                self.used -= need
                self._cond.notify_all()


def shrink_factors(width: int, height: int, side: int, keep_aspect: bool = False) -> tuple[int, int]:
    """Whole factors that bring each side down to between ``side`` and twice that (sides already under
    ``side`` stay), or with ``keep_aspect`` one factor that does so for the shorter side."""
    fx, fy = max(1, width // side), max(1, height // side)
    return (min(fx, fy), min(fx, fy)) if keep_aspect else (fx, fy)


def decode_side(model: DualEncoder | None) -> int:
    """The side query images are shrunk to: four times the model's pre-crop size, at least 256 pixels."""
    if model is None:
        return 1024
    return max(256, 4 * model_resize(model.config.image_size))


def decoded_bytes(image: Image.Image, side: int, keep_aspect: bool = False) -> int:
    """Bytes that decoding ``image`` (opened, maybe drafted), shrinking it and making it RGB hold at once.

    PIL keeps 1-byte modes in 1 byte a pixel, 16-bit ones in 2 and the rest (RGB included) in 4; a mode
    that needs a full-size copy before shrinking adds 4. Turning the shrunk image into RGB (compositing
    alpha makes a few copies) is counted at 16 bytes a pixel.
    """
    width, height = image.size
    native = 1 if image.mode in ("1", "L", "P") else 2 if image.mode.startswith("I;16") else 4
    extra = 4 if image.mode in _FULL_SIZE_COPY else 0
    fx, fy = shrink_factors(width, height, side, keep_aspect)
    return width * height * (native + extra) + 16 * (width // fx + 1) * (height // fy + 1)


def shrink(image: Image.Image, side: int, keep_aspect: bool = False) -> Image.Image:
    """``image`` box-averaged by whole factors (``shrink_factors``) down to about ``side`` a side.

    The model's transform squashes any image to a square of a few hundred pixels, box-averaging first in
    the same way (``reducing_gap``), so shrinking each side on its own changes little of what it sees and
    bounds the pixels kept whatever the aspect; pictures for people keep theirs.
    """
    fx, fy = shrink_factors(*image.size, side, keep_aspect)
    if fx == 1 and fy == 1:
        return image
    if image.mode in _CONVERT_FIRST:
        mode = _CONVERT_FIRST[image.mode]
        if image.mode == "P" and "transparency" in image.info:
            mode = "RGBA"
        image = image.convert(mode)
    return image.reduce((fx, fy))


def decode_base64(data: str, max_bytes: int) -> bytes:
    """A base64 string (or ``data:`` URL) → bytes; ValueError on bad base64, OverflowError over ``max_bytes``."""
    if data.startswith("data:"):
        _, _, data = data.partition(",")
    # Strict decoding first: the usual unwrapped string needs no whitespace-free copy made of it.
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        try:
            raw = base64.b64decode("".join(data.split()), validate=True)
        except (binascii.Error, ValueError) as err:
            raise ValueError(str(err)) from err
    if len(raw) > max_bytes:
        raise OverflowError(f"image is {len(raw)} bytes; the limit is {max_bytes}")
    return raw


def decode_bounded(
    data: bytes, budget: DecodeBudget, *, side: int, max_pixels: int, keep_aspect: bool = False
) -> Image.Image:
    """Encoded image bytes → an RGB image shrunk to about ``side`` a side (``shrink``), decoded within
    ``budget``. BadImage for bytes that are not a usable image, Busy when the budget stays spent too long.
    """
    image = open_image(data, max_pixels=max_pixels, draft=(side, side))
    with budget.hold(decoded_bytes(image, side, keep_aspect)):
        # Only the shrunk copy may outlive the reservation; the full-size pixels go with these names.
        pixels = load_pixels(image)
        del image
        small = shrink(pixels, side, keep_aspect)
        del pixels
        return to_rgb(small)


def unmap_large_frees(threshold: int = 4 * 2**20) -> bool:
    """Have glibc give every allocation over ``threshold`` bytes its own mapping, returned to the system
    when freed; False where the C library has no ``mallopt`` (not glibc).

    glibc raises that threshold after the first large free (up to 32 MB), after which the 16 MB blocks PIL
    decodes into come from per-thread arenas that keep them once freed, and a server stays at its largest
    burst's memory.
    """
    import ctypes

    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    m_mmap_threshold = -3  # from glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, threshold))
