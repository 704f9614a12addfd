"""What the web does to a photo it reposts, as photo editing does it: one PIL image in, its copy out.

Each transformation takes a strength in [0, 1] (0 leaves the image as it is, 1 is the strongest edit a copy
detector is still asked to see through) and a ``random.Random`` for the details (which side is cut, which
way it turns), and they compose: ``repost(image, [("crop", 0.5), ("jpeg", 1.0)], rng)``. They are the edits
copies on the web carry — re-crop (up to 20 % of each side), resize by any factor, letterbox padding, mirror,
slight rotation, greyscale, re-toning, low-quality JPEG, a caption bar or watermark over the picture, and the
picture embedded in a larger one (a screenshot or collage) — so the benchmark's queries
(``openalign.bench.copy_detection``) and any detector training that wants harder views share one definition.
"""

from __future__ import annotations

import io
import random
from collections.abc import Callable, Sequence

from PIL import Image, ImageDraw, ImageEnhance, ImageFont, ImageOps

from openalign.config import ConfigError

__all__ = ["TRANSFORMS", "random_repost", "repost"]

Edit = Callable[[Image.Image, float, random.Random], Image.Image]


def _crop(im: Image.Image, s: float, r: random.Random) -> Image.Image:
    """Keep a window of (1 - 0.2 s) of each side, at a random place (a re-crop loses up to 20 % a side)."""
    w, h = im.size
    kw, kh = max(1, round(w * (1 - 0.2 * s))), max(1, round(h * (1 - 0.2 * s)))
    x, y = r.randint(0, w - kw), r.randint(0, h - kh)
    return im.crop((x, y, x + kw, y + kh))


def _resize(im: Image.Image, s: float, r: random.Random) -> Image.Image:
    """Scale by up to 4× down or 2× up (the aspect ratio kept): thumbnails and upscaled reposts."""
    factor = 1 / (1 + 3 * s) if r.random() < 0.7 else 1 + s
    w, h = im.size
    return im.resize((max(8, round(w * factor)), max(8, round(h * factor))), Image.Resampling.BICUBIC)


def _pad(im: Image.Image, s: float, r: random.Random) -> Image.Image:
    """Letterbox: bars of up to 30 % of the side on two opposite sides, black, white or a flat colour."""
    w, h = im.size
    colour = r.choice([(0, 0, 0), (255, 255, 255), (r.randrange(256), r.randrange(256), r.randrange(256))])
    if r.random() < 0.5:
        bar = round(h * 0.3 * s)
        return ImageOps.expand(im, border=(0, bar, 0, bar), fill=colour)
    bar = round(w * 0.3 * s)
    return ImageOps.expand(im, border=(bar, 0, bar, 0), fill=colour)


def _mirror(im: Image.Image, s: float, r: random.Random) -> Image.Image:
    """Left–right flip; a strength below 0.5 leaves the image as it is (a flip has no degree)."""
    return ImageOps.mirror(im) if s >= 0.5 else im


def _rotate(im: Image.Image, s: float, r: random.Random) -> Image.Image:
    """Turn by up to 10° either way and cut to the largest upright rectangle, as a straighten tool does."""
    import math

    angle = r.choice([-1, 1]) * 10 * s
    w, h = im.size
    turned = im.rotate(angle, Image.Resampling.BICUBIC, expand=False)
    # The upright rectangle with the image's aspect ratio that stays inside the turned picture.
    a = math.radians(abs(angle))
    scale = 1 / (math.cos(a) + math.sin(a) * max(w, h) / min(w, h))
    cw, ch = max(1, round(w * scale)), max(1, round(h * scale))
    left, top = (w - cw) // 2, (h - ch) // 2
    return turned.crop((left, top, left + cw, top + ch))


def _grey(im: Image.Image, s: float, r: random.Random) -> Image.Image:
    """Blend towards greyscale; strength 1 is a black-and-white copy."""
    return Image.blend(im, ImageOps.grayscale(im).convert("RGB"), s)


def _tone(im: Image.Image, s: float, r: random.Random) -> Image.Image:
    """A filter: brightness, contrast, saturation changed by up to ±40 %, ±50 %, ±60 %, and a colour cast."""

    def factor(amount: float) -> float:
        return 1 + r.uniform(-amount, amount) * s

    out = ImageEnhance.Brightness(im).enhance(factor(0.4))
    out = ImageEnhance.Contrast(out).enhance(factor(0.5))
    out = ImageEnhance.Color(out).enhance(factor(0.6))
    cast = Image.new("RGB", out.size, (r.randrange(256), r.randrange(256), r.randrange(256)))
    return Image.blend(out, cast, 0.2 * s)


def _jpeg(im: Image.Image, s: float, r: random.Random) -> Image.Image:
    """Re-encode as JPEG at quality 90 (strength 0) down to 8 (strength 1)."""
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=max(1, round(90 - 82 * s)))
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow before 10.1 has one bitmap size
        return ImageFont.load_default()


def _overlay(im: Image.Image, s: float, r: random.Random) -> Image.Image:
    """A caption bar over the bottom (up to 25 % of the height), a logo box in a corner and a half-transparent
    watermark across the middle, each larger with the strength."""
    out = im.copy()
    w, h = out.size
    draw = ImageDraw.Draw(out)
    bar = round(h * 0.25 * s)
    if bar:
        draw.rectangle((0, h - bar, w, h), fill=(r.randrange(60), r.randrange(60), r.randrange(60)))
        words = " ".join(
            r.choice(["share", "this", "amazing", "photo", "today", "look", "wow", "repost"]) for _ in range(5)
        )
        draw.text((bar // 4, h - bar + bar // 6), words, fill=(255, 255, 255), font=_font(max(8, bar // 2)))
    logo = round(min(w, h) * 0.2 * s)
    if logo:
        x = r.choice([0, w - logo])
        draw.rectangle((x, 0, x + logo, logo), fill=(r.randrange(256), r.randrange(256), r.randrange(256)))
    mark = Image.new("RGBA", out.size, (0, 0, 0, 0))
    ImageDraw.Draw(mark).text(
        (w // 6, h // 3), "© stock", fill=(255, 255, 255, round(160 * s)), font=_font(max(8, round(h * 0.15 * s)))
    )
    return Image.alpha_composite(out.convert("RGBA"), mark).convert("RGB")


def _embed(im: Image.Image, s: float, r: random.Random) -> Image.Image:
    """Place the picture inside a larger one (a screenshot or collage) of which it covers a side fraction of
    1 - 0.6 s: the rest is flat panels, bars of "text" and other tiles."""
    w, h = im.size
    frac = 1 - 0.6 * s
    cw, ch = max(w, round(w / frac)), max(h, round(h / frac))
    canvas = Image.new("RGB", (cw, ch), (r.randrange(200, 256),) * 3)
    draw = ImageDraw.Draw(canvas)
    for _ in range(12):
        x0, y0 = r.randrange(cw), r.randrange(ch)
        x1, y1 = x0 + r.randrange(8, max(9, cw // 3)), y0 + r.randrange(4, max(5, ch // 12))
        draw.rectangle((x0, y0, x1, y1), fill=(r.randrange(256), r.randrange(256), r.randrange(256)))
    canvas.paste(im, (r.randint(0, cw - w), r.randint(0, ch - h)))
    return canvas


TRANSFORMS: dict[str, Edit] = {
    "crop": _crop,
    "resize": _resize,
    "pad": _pad,
    "mirror": _mirror,
    "rotate": _rotate,
    "grey": _grey,
    "tone": _tone,
    "jpeg": _jpeg,
    "overlay": _overlay,
    "embed": _embed,
}


def repost(image: Image.Image, edits: Sequence[tuple[str, float]], rng: random.Random) -> Image.Image:
    """``image`` (RGB) with each (transformation, strength) of ``edits`` applied in order."""
    out = image.convert("RGB")
    for name, strength in edits:
        if name not in TRANSFORMS:
            raise ConfigError(f"reposting: unknown transformation {name!r} (one of {', '.join(TRANSFORMS)})")
        if not 0.0 <= strength <= 1.0:
            raise ConfigError(f"reposting: strength of {name} must be in [0, 1], got {strength}")
        out = TRANSFORMS[name](out, float(strength), rng)
    return out


def random_repost(
    image: Image.Image, rng: random.Random, *, edits: int = 3, max_strength: float = 1.0
) -> tuple[Image.Image, list[tuple[str, float]]]:
    """A copy made by ``edits`` distinct transformations at random strengths up to ``max_strength``, in the
    order a reposter applies them (geometry first, then tone, overlays, embedding and last the JPEG)."""
    names = list(TRANSFORMS)
    chosen = sorted(rng.sample(names, min(edits, len(names))), key=_ORDER.index)
    plan = [(name, rng.uniform(0.3, 1.0) * max_strength) for name in chosen]
    return repost(image, plan, rng), plan


_ORDER = ["crop", "rotate", "mirror", "resize", "pad", "grey", "tone", "overlay", "embed", "jpeg"]
