"""A synthetic noisy alt-text world: procedurally drawn scenes, accurate captions and web-style alt-text noise.

It stands in for the paper's 1.8B web pairs wherever a run must fit on a CPU in minutes: scenes are one or
two kinds of shapes (colour, size, position, count, relation) on textured backgrounds, and a caption must
name all of those for retrieval to work. With probability ``noise`` a training row's alt-text is replaced by
one of the noise kinds the paper shows (boilerplate shared by many images, a photographer's name, another
image's caption, too short, too long, a rare junk token) or its image is a "hub" carrying many alt-texts;
independently some images get web metadata the image filters remove (small, very wide, unsafe). Every row
records its ground truth (``noise``, ``image_noise``, ``planted_duplicate_of``) so tests can score filters
and decontamination.

Scene ``i`` of a split depends only on (seed, split, i), so any row can be regenerated on its own (workers
can split a stream by index), and the held-out retrieval and classification sets come from their own
random streams: none of their scenes is a training scene, except for the augmented near-duplicates that
``write_corpus`` plants on purpose for the decontamination stage to find.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import math
import random
import re
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

import numpy as np
from PIL import Image, ImageDraw, ImageEnhance

from openalign.data import synthetic_languages
from openalign.data.synthetic_languages import LANGUAGES

# --------------------------------------------------------------------------------------------------
# Vocabulary of the world. The first synonym of each entry is its canonical name.

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "orange": (245, 140, 20),
    "yellow": (250, 225, 30),
    "green": (30, 170, 50),
    "blue": (30, 80, 230),
    "purple": (140, 40, 190),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
COLOUR_WORDS: dict[str, tuple[str, ...]] = {
    "red": ("red", "crimson", "scarlet"),
    "orange": ("orange", "amber"),
    "yellow": ("yellow", "golden"),
    "green": ("green", "emerald"),
    "blue": ("blue", "cobalt"),
    "purple": ("purple", "violet"),
    "white": ("white", "ivory"),
    "black": ("black", "ebony"),
}
SHAPES = ("circle", "square", "triangle", "star", "cross", "ring", "diamond")
SHAPE_WORDS: dict[str, tuple[tuple[str, str], ...]] = {  # (singular, plural)
    "circle": (("circle", "circles"), ("disc", "discs")),
    "square": (("square", "squares"), ("box", "boxes")),
    "triangle": (("triangle", "triangles"),),
    "star": (("star", "stars"),),
    "cross": (("cross", "crosses"), ("plus sign", "plus signs")),
    "ring": (("ring", "rings"), ("hoop", "hoops")),
    "diamond": (("diamond", "diamonds"), ("rhombus", "rhombuses")),
}
SIZE_WORDS: dict[str, tuple[str, ...]] = {"small": ("small", "little", "tiny"), "large": ("large", "big", "huge")}
POSITIONS = ("left", "right", "top", "bottom", "centre")
POSITION_WORDS: dict[str, tuple[str, ...]] = {
    "left": ("on the left", "at the left", "in the left half"),
    "right": ("on the right", "at the right", "in the right half"),
    "top": ("at the top", "near the top", "in the upper half"),
    "bottom": ("at the bottom", "near the bottom", "in the lower half"),
    "centre": ("in the centre", "in the middle", "in the center"),
}
_POSITION_XY = {
    "left": (0.27, 0.5),
    "right": (0.73, 0.5),
    "top": (0.5, 0.27),
    "bottom": (0.5, 0.73),
    "centre": (0.5, 0.5),
}
RELATIONS = ("left of", "right of", "above", "below")
RELATION_WORDS: dict[str, tuple[str, ...]] = {
    "left of": ("to the left of", "left of"),
    "right of": ("to the right of", "right of"),
    "above": ("above", "higher than"),
    "below": ("below", "under", "beneath"),
}
BACKGROUNDS = ("grass", "sand", "water", "stripes", "dots", "bricks")
BACKGROUND_WORDS: dict[str, tuple[str, ...]] = {  # no colour words here, so a caption's colours are the shapes'
    "grass": ("on grass", "on a lawn", "on a grassy field"),
    "sand": ("on sand", "on a sandy beach", "on sandy ground"),
    "water": ("on water", "over the sea", "on rippling water"),
    "stripes": ("on stripes", "on a striped background"),
    "dots": ("on polka dots", "on a dotted background"),
    "bricks": ("on bricks", "on a brick wall"),
}
# Texture palettes: a shape colour too close to any of its background's colours is never drawn on it.
PALETTES: dict[str, tuple[tuple[int, int, int], ...]] = {
    "grass": ((34, 100, 34), (100, 170, 60)),
    "sand": ((194, 160, 100), (235, 210, 160)),
    "water": ((20, 70, 140), (80, 150, 210)),
    "stripes": ((40, 140, 140), (180, 220, 220)),
    "dots": ((245, 200, 210), (225, 120, 150)),
    "bricks": ((160, 70, 50), (210, 200, 190)),
}
_MIN_CONTRAST = 80.0
COUNT_WORDS = {2: ("two", "a pair of"), 3: ("three",)}
PREFIXES = ("", "", "a photo of ", "photo of ", "an image of ", "a picture of ", "a drawing of ")


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# Noise vocabulary. Boilerplate is drawn Zipf-like so the head strings are shared by many images even in
# a small corpus; the long ones pass the length rules, so only the shared-text rule catches them.
BOILERPLATE = (
    "1920x1080",
    "alt_img",
    "IMG_4031.jpg",
    "click here to view the full size image",
    "image",
    "stock photo royalty free image download",
    "thumbnail",
    "DSC_0042.JPG",
    "image not available for this product",
    "untitled",
    "a8f3c2e1d4b7",
    "see more pictures in our gallery",
    "product_img_12345",
    "this image may be subject to copyright",
)
FIRST_NAMES = _words(
    "John Mary James Linda Robert Susan Michael Karen David Lisa William Nancy Richard Betty Thomas Sandra Daniel "
    "Ashley Paul Emily Mark Donna Steven Carol Andrew Ruth Kevin Sharon Brian Laura"
)
LAST_NAMES = _words(
    "Smith Johnson Williams Brown Jones Garcia Miller Davis Rodriguez Martinez Hernandez Lopez Wilson Anderson "
    "Thomas Taylor Moore Jackson Martin Lee Thompson White Harris Clark Lewis Robinson Walker Young Allen King"
)
NAME_TEMPLATES = (
    "photo by {name}",
    "{name} photography",
    "image courtesy of {name}",
    "photographed by {name} in {year}",
    "copyright {year} {name} all rights reserved",
)
SHORT_TEXTS = ("nice", "wow", "cool pic", "lovely", "my photo", "pic")
SPAM_WORDS = _words(
    "best free hd wallpaper download high quality image for your desktop phone tablet background cheap sale "
    "online buy now new amazing top deals"
)

# Row kinds. ``hub``: the row's image is one of a few images that carry many different alt-texts.
NOISE_WEIGHTS: dict[str, float] = {
    "boilerplate": 0.20,
    "name": 0.10,
    "mismatch": 0.20,
    "short": 0.12,
    "long": 0.12,
    "junk": 0.12,
    "hub": 0.14,
}
NOISE_KINDS = ("clean", *NOISE_WEIGHTS)
# Image-level web metadata noise, as a fraction of ``noise`` (exclusive kinds).
IMAGE_NOISE_WEIGHTS: dict[str, float] = {"small": 0.10, "wide": 0.10, "unsafe": 0.05}
HUB_TEXTS = 40  # alt-texts per hub image on average
HUB_BLOCK = 10_000  # hubs are drawn per block of rows so a stream of any length keeps ~HUB_TEXTS per hub

Split = Literal["train", "hub", "retrieval", "classification"]
_DOMAINS = {
    "train": 1,
    "hub": 2,
    "retrieval": 3,
    "classification": 4,
    "duplicate": 5,
    "caption": 6,
    "plant": 7,
    "language": 8,
}
ClassMode = Literal["shape_colour", "shape"]


def _allowed_colours(background: str) -> tuple[str, ...]:
    def dist(a: Sequence[int], b: Sequence[int]) -> float:
        return math.dist(a, b)

    return tuple(c for c, rgb in COLOURS.items() if min(dist(rgb, p) for p in PALETTES[background]) >= _MIN_CONTRAST)


ALLOWED_COLOURS: dict[str, tuple[str, ...]] = {bg: _allowed_colours(bg) for bg in BACKGROUNDS}


# --------------------------------------------------------------------------------------------------
# Scenes


@dataclass(frozen=True)
class Shape:
    """One drawn object; coordinates are fractions of the image side."""

    kind: str
    colour: str
    size: str  # "small" | "large"
    x: float
    y: float
    radius: float
    angle: float  # degrees
    rgb: tuple[int, int, int]  # the jittered colour actually drawn


@dataclass(frozen=True)
class Scene:
    """What an image shows. ``layout``: "single" (one object at ``position``), "count" (2–3 identical
    objects) or "pair" (``objects[0]`` is ``relation`` ``objects[1]``)."""

    layout: str
    background: str
    objects: tuple[Shape, ...]
    position: str = ""
    relation: str = ""
    texture: tuple[int, int, int] = (0, 0, 0)  # (variant, row offset, column offset) into the texture bank

    def fingerprint(self) -> tuple:
        """Identity up to float noise: two scenes with the same fingerprint draw the same image."""
        objs = tuple((o.kind, o.colour, round(o.x, 6), round(o.y, 6), round(o.radius, 6)) for o in self.objects)
        return (self.layout, self.background, self.texture, objs)


def _rng(seed: int, domain: str, index: int, *within: str) -> random.Random:
    # String seeds are hashed with SHA-512 by random.Random: stable across runs and platforms. ``within``
    # names a stream inside one item's (a language's captions of one scene), leaving the item's own unchanged.
    return random.Random("/".join(("openalign-synthetic", str(seed), str(_DOMAINS[domain]), str(index), *within)))


def _jitter_rgb(r: random.Random, colour: str) -> tuple[int, int, int]:
    return tuple(min(255, max(0, c + r.randint(-18, 18))) for c in COLOURS[colour])  # type: ignore[return-value]


def _radius(r: random.Random, size: str) -> float:
    return r.uniform(0.085, 0.11) if size == "small" else r.uniform(0.16, 0.2)


def _angle(r: random.Random, kind: str) -> float:
    return 0.0 if kind in ("circle", "ring") else r.uniform(-15.0, 15.0)


def _texture_choice(r: random.Random, image_size: int) -> tuple[int, int, int]:
    margin = _texture_side(image_size) - image_size
    return (r.randrange(_TEXTURE_VARIANTS), r.randint(0, margin), r.randint(0, margin))


def _make_shape(r: random.Random, kind: str, colour: str, size: str, x: float, y: float) -> Shape:
    return Shape(kind, colour, size, x, y, _radius(r, size), _angle(r, kind), _jitter_rgb(r, colour))


def sample_scene(r: random.Random, image_size: int, layout: str | None = None) -> Scene:
    """Draw a random scene from ``r`` (single 50 %, count 20 %, pair 30 % unless ``layout`` is given)."""
    layout = layout or r.choices(("single", "count", "pair"), weights=(0.5, 0.2, 0.3))[0]
    background = r.choice(BACKGROUNDS)
    colours = ALLOWED_COLOURS[background]
    if layout == "single":
        position = r.choice(POSITIONS)
        cx, cy = _POSITION_XY[position]
        size = r.choice(("small", "large"))
        obj = _make_shape(
            r, r.choice(SHAPES), r.choice(colours), size, cx + r.uniform(-0.04, 0.04), cy + r.uniform(-0.04, 0.04)
        )
        return Scene(layout, background, (obj,), position=position, texture=_texture_choice(r, image_size))
    if layout == "count":
        kind, colour, count = r.choice(SHAPES), r.choice(colours), r.choice((2, 3))
        size = "small" if count == 3 else r.choice(("small", "large"))
        for _attempt in range(100):
            objs: list[Shape] = []
            for _ in range(count):
                radius = _radius(r, size)
                x, y = r.uniform(radius + 0.03, 1 - radius - 0.03), r.uniform(radius + 0.03, 1 - radius - 0.03)
                if all(math.hypot(x - o.x, y - o.y) > radius + o.radius + 0.04 for o in objs):
                    objs.append(Shape(kind, colour, size, x, y, radius, _angle(r, kind), _jitter_rgb(r, colour)))
            if len(objs) == count:
                break
            size = "small"  # large objects did not fit without touching; small ones always do quickly
        else:  # pragma: no cover - 100 failed attempts at three small objects do not happen in practice
            raise RuntimeError("could not place objects")
        return Scene(layout, background, tuple(objs), texture=_texture_choice(r, image_size))
    # pair: two objects that differ in shape or colour, on opposite sides of the image
    first = (r.choice(SHAPES), r.choice(colours))
    second = first
    while second == first:
        second = (r.choice(SHAPES), r.choice(colours))
    relation = r.choice(RELATIONS)
    near, far = r.uniform(0.2, 0.32), r.uniform(0.68, 0.8)
    a_main, b_main = (near, far) if relation in ("left of", "above") else (far, near)
    a_cross, b_cross = r.uniform(0.3, 0.7), r.uniform(0.3, 0.7)
    if relation in ("left of", "right of"):
        (ax, ay), (bx, by) = (a_main, a_cross), (b_main, b_cross)
    else:
        (ax, ay), (bx, by) = (a_cross, a_main), (b_cross, b_main)
    a = _make_shape(r, *first, r.choice(("small", "large")), ax, ay)
    b = _make_shape(r, *second, r.choice(("small", "large")), bx, by)
    if math.hypot(ax - bx, ay - by) < a.radius + b.radius + 0.04:
        b = _make_shape(r, *second, "small", bx, by)  # two large shapes would touch; the relation must stay clear
    return Scene(layout, background, (a, b), relation=relation, texture=_texture_choice(r, image_size))


# --------------------------------------------------------------------------------------------------
# Captions


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _noun_phrase(r: random.Random, obj: Shape, with_size: bool = True) -> str:
    words = []
    if with_size:
        words.append(r.choice(SIZE_WORDS[obj.size]))
    words.append(r.choice(COLOUR_WORDS[obj.colour]))
    words.append(r.choice(SHAPE_WORDS[obj.kind])[0])
    return f"{_article(words[0])} {' '.join(words)}"


def caption_scene(scene: Scene, r: random.Random, language: str = "en") -> str:
    """An accurate caption (3–20 words) naming colours, shapes, background and position/count/relation,
    in ``language`` (one of ``LANGUAGES``)."""
    if language != "en":
        return synthetic_languages.caption(scene, r, language)
    prefix = r.choice(PREFIXES)
    bg = r.choice(BACKGROUND_WORDS[scene.background])
    if scene.layout == "single":
        np_ = _noun_phrase(r, scene.objects[0], with_size=r.random() < 0.8)
        pos = r.choice(POSITION_WORDS[scene.position])
        template = r.randrange(3)
        if template == 0:
            return f"{prefix}{np_} {pos} {bg}"
        if template == 1:
            return f"{prefix}{np_} {bg}, {pos}"
        return f"{prefix}{np_} {bg} {pos}"
    if scene.layout == "count":
        obj = scene.objects[0]
        count = r.choice(COUNT_WORDS[len(scene.objects)])
        size = r.choice(SIZE_WORDS[obj.size]) + " " if r.random() < 0.6 else ""
        plural = r.choice(SHAPE_WORDS[obj.kind])[1]
        return f"{prefix}{count} {size}{r.choice(COLOUR_WORDS[obj.colour])} {plural} {bg}"
    a, b = scene.objects
    rel = r.choice(RELATION_WORDS[scene.relation])
    return f"{prefix}{_noun_phrase(r, a, r.random() < 0.7)} {rel} {_noun_phrase(r, b, r.random() < 0.7)} {bg}"


def _junk_token(r: random.Random) -> str:
    letters = "".join(r.choice("bcdfghjklmnpqrstvwxz") for _ in range(4))
    pos = r.randrange(5)
    return letters[:pos] + str(r.randrange(10)) + letters[pos:]


def _noise_text(kind: str, r: random.Random, accurate: str, other: str) -> str:
    if kind == "boilerplate":
        weights = [1.0 / (rank + 1) for rank in range(len(BOILERPLATE))]
        return r.choices(BOILERPLATE, weights=weights)[0]
    if kind == "name":
        name = f"{r.choice(FIRST_NAMES)} {r.choice(LAST_NAMES)}"
        return r.choice(NAME_TEMPLATES).format(name=name, year=r.randint(1998, 2021))
    if kind in ("mismatch", "hub"):
        return other
    if kind == "short":
        choice = r.randrange(4)
        if choice == 0:
            return f"{r.choice(COLOUR_WORDS[r.choice(tuple(COLOURS))])} {r.choice(SHAPES)}"  # one-word shape names
        if choice == 1:
            return r.choice(SHORT_TEXTS)
        if choice == 2:
            return f"img {r.randrange(10000):04d}"
        return r.choice(SHAPES)
    if kind == "long":
        spam = " ".join(r.choice(SPAM_WORDS) for _ in range(r.randint(21, 30)))
        return f"{accurate} {spam}"
    if kind == "junk":
        words = accurate.split(" ")
        words.insert(r.randrange(len(words) + 1), _junk_token(r))
        return " ".join(words)
    raise ValueError(f"unknown noise kind {kind!r}")


# --------------------------------------------------------------------------------------------------
# Rendering

_TEXTURE_VARIANTS = 6


def _texture_side(image_size: int) -> int:
    return image_size + image_size // 2


def _smooth(rng: np.random.Generator, side: int, cells: int) -> np.ndarray:
    low = Image.fromarray(rng.random((cells, cells)).astype(np.float32), mode="F")
    return np.asarray(low.resize((side, side), Image.Resampling.BICUBIC), dtype=np.float32)


def _lerp(t: np.ndarray, lo: Sequence[int], hi: Sequence[int]) -> np.ndarray:
    t = np.clip(t, 0.0, 1.0)[..., None]
    out: np.ndarray = (np.asarray(lo, np.float32) * (1 - t) + np.asarray(hi, np.float32) * t).astype(np.uint8)
    return out


def _make_texture(background: str, rng: np.random.Generator, side: int, image_size: int) -> np.ndarray:
    lo, hi = PALETTES[background]
    yy, xx = np.mgrid[0:side, 0:side].astype(np.float32)
    if background == "grass":
        blades = np.repeat(rng.random((side // 4 + 1, side)), 4, axis=0)[:side]  # short vertical strokes
        return _lerp(0.45 * _smooth(rng, side, 5) + 0.55 * blades, lo, hi)
    if background == "sand":
        return _lerp(0.6 * _smooth(rng, side, 4) + 0.4 * rng.random((side, side)), lo, hi)
    if background == "water":
        period = image_size / rng.uniform(4.0, 6.0)
        wave = np.sin(2 * np.pi * (yy / period + 0.2 * np.sin(2 * np.pi * xx / (2.5 * period))) + rng.uniform(0, 6.3))
        return _lerp(0.5 + 0.45 * wave + 0.1 * (rng.random((side, side)) - 0.5), lo, hi)
    if background == "stripes":
        theta = math.radians(rng.choice([0, 45, 90, 135]))
        period = image_size / rng.uniform(5.0, 7.0)
        phase = (xx * math.cos(theta) + yy * math.sin(theta)) / period + rng.uniform(0, 1)
        return _lerp((phase % 1.0 < 0.5).astype(np.float32), lo, hi)
    if background == "dots":
        period = image_size / rng.uniform(4.5, 6.0)
        ox, oy = rng.uniform(0, period, 2)
        dx = (xx + ox) % period - period / 2
        dy = (yy + oy) % period - period / 2
        return _lerp((np.hypot(dx, dy) < period * 0.25).astype(np.float32), lo, hi)
    if background == "bricks":
        height = max(3, round(image_size / rng.uniform(7.0, 9.0)))
        width = 2 * height
        row = (yy // height).astype(np.int64)
        col = ((xx + (row % 2) * (width // 2)) // width).astype(np.int64)
        shade = rng.uniform(-25, 25, (row.max() + 1, col.max() + 2)).astype(np.float32)
        brick = np.asarray(lo, np.float32) + shade[row, col][..., None]
        mortar = ((yy % height) < max(1, height // 6)) | (
            ((xx + (row % 2) * (width // 2)) % width) < max(1, height // 6)
        )
        out = np.where(mortar[..., None], np.asarray(hi, np.float32), brick)
        return np.clip(out, 0, 255).astype(np.uint8)
    raise ValueError(f"unknown background {background!r}")


@cache
def texture_bank(image_size: int) -> dict[str, tuple[np.ndarray, ...]]:
    """Pre-drawn textures per background (shared by every seed: grass looks like grass in every split)."""
    side = _texture_side(image_size)
    bank = {}
    for b_index, background in enumerate(BACKGROUNDS):
        rng = np.random.default_rng([20210701, b_index, image_size])
        bank[background] = tuple(_make_texture(background, rng, side, image_size) for _ in range(_TEXTURE_VARIANTS))
    return bank


def _polygon(obj: Shape, side: int) -> list[tuple[float, float]]:
    cx, cy, r = obj.x * side, obj.y * side, obj.radius * side
    pts: list[tuple[float, float]]
    if obj.kind == "square":
        pts = [(-1, -1), (1, -1), (1, 1), (-1, 1)]
        r *= 0.85
    elif obj.kind == "triangle":
        pts = [(math.cos(math.radians(a)), math.sin(math.radians(a))) for a in (-90, 30, 150)]
        r *= 1.1
    elif obj.kind == "star":
        pts = [
            (
                (1.0 if k % 2 == 0 else 0.42) * math.cos(math.radians(-90 + 36 * k)),
                (1.0 if k % 2 == 0 else 0.42) * math.sin(math.radians(-90 + 36 * k)),
            )
            for k in range(10)
        ]
        r *= 1.15
    elif obj.kind == "cross":
        w = 0.34
        pts = [
            (-w, -1),
            (w, -1),
            (w, -w),
            (1, -w),
            (1, w),
            (w, w),
            (w, 1),
            (-w, 1),
            (-w, w),
            (-1, w),
            (-1, -w),
            (-w, -w),
        ]
    elif obj.kind == "diamond":
        pts = [(0, -1.2), (0.75, 0), (0, 1.2), (-0.75, 0)]
    else:
        raise ValueError(f"{obj.kind} is not a polygon")
    ca, sa = math.cos(math.radians(obj.angle)), math.sin(math.radians(obj.angle))
    return [(cx + r * (px * ca - py * sa), cy + r * (px * sa + py * ca)) for px, py in pts]


def render_scene(scene: Scene, image_size: int) -> Image.Image:
    """Draw ``scene`` as an RGB image of ``image_size``² pixels."""
    variant, oy, ox = scene.texture
    texture = texture_bank(image_size)[scene.background][variant]
    image = Image.fromarray(np.ascontiguousarray(texture[oy : oy + image_size, ox : ox + image_size]))
    draw = ImageDraw.Draw(image)
    for obj in scene.objects:
        cx, cy, r = obj.x * image_size, obj.y * image_size, obj.radius * image_size
        if obj.kind == "circle":
            draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=obj.rgb)
        elif obj.kind == "ring":
            draw.ellipse((cx - r, cy - r, cx + r, cy + r), outline=obj.rgb, width=max(2, round(r * 0.38)))
        else:
            draw.polygon(_polygon(obj, image_size), fill=obj.rgb)
    return image


def augment_near_duplicate(image: Image.Image, r: random.Random) -> Image.Image:
    """A near-duplicate as the web makes them: a slightly different crop, a colour tweak, a JPEG re-encode."""
    side_w, side_h = image.size
    m = max(1, round(min(side_w, side_h) * 0.04))
    box = (r.randint(0, m), r.randint(0, m), side_w - r.randint(0, m), side_h - r.randint(0, m))
    out = image.crop(box).resize(image.size, Image.Resampling.BICUBIC)
    out = ImageEnhance.Brightness(out).enhance(r.uniform(0.93, 1.07))
    out = ImageEnhance.Color(out).enhance(r.uniform(0.9, 1.1))
    buf = io.BytesIO()
    out.save(buf, format="JPEG", quality=r.randint(70, 90))
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


# --------------------------------------------------------------------------------------------------
# The world


@dataclass
class Row:
    """One training row before rendering: the image's scene, its alt-text and the ground truth."""

    index: int
    scene: Scene
    caption: str
    noise: str  # "clean" or a key of NOISE_WEIGHTS
    image_noise: str | None  # None, "small", "wide" or "unsafe"
    image_id: str  # rows with the same image_id show the same image (hubs)
    width: int  # the web image's original size, as crawl metadata reports it
    height: int
    punsafe: float
    planted_duplicate_of: str | None = None  # "retrieval/12" or "classification/3" for planted copies
    language: str = "en"  # the language of an accurate caption (noise kinds are the web's, in any language)


def _web_size(r: random.Random, image_noise: str | None) -> tuple[int, int]:
    if image_noise == "small":
        short, aspect = r.randint(32, 200), r.uniform(1.0, 2.0)
    elif image_noise == "wide":
        short, aspect = r.randint(220, 800), r.uniform(3.05, 6.0)
    else:
        short, aspect = r.randint(220, 1200), r.uniform(1.0, 2.5)
    long = round(short * aspect)
    return (long, short) if r.random() < 0.7 else (short, long)


class SyntheticWorld:
    """The generator behind every function of this module; ``seed`` picks the training stream.

    ``languages``: the caption languages of training rows. Row ``i`` gets one of them, drawn from its own
    random stream (seed, i), so its scene is the same whatever the languages; with the default ``("en",)``
    no draw is made, so an English world's rows do not depend on this option."""

    def __init__(self, seed: int = 0, image_size: int = 64, languages: Sequence[str] = ("en",)):
        if image_size < 16:
            raise ValueError(f"image_size must be at least 16, got {image_size}")
        self.seed = int(seed)
        self.image_size = int(image_size)
        self.languages = check_languages(languages)

    # scenes -------------------------------------------------------------------------------------
    def scene(self, index: int, split: Split = "train") -> Scene:
        """Scene ``index`` of ``split`` (train, hub, retrieval); classification scenes come from ``class_scene``."""
        return sample_scene(_rng(self.seed, split, index), self.image_size)

    def render(self, scene: Scene) -> Image.Image:
        """The image of ``scene`` at this world's size."""
        return render_scene(scene, self.image_size)

    def caption(self, scene: Scene, r: random.Random, language: str = "en") -> str:
        """An accurate caption of ``scene`` in ``language`` using randomness from ``r``."""
        return caption_scene(scene, r, language)

    def language(self, index: int) -> str:
        """The caption language of training row ``index``."""
        if len(self.languages) == 1:
            return self.languages[0]
        return self.languages[_rng(self.seed, "language", index).randrange(len(self.languages))]

    # training rows ------------------------------------------------------------------------------
    def row(self, index: int, noise: float = 0.25, n_rows: int | None = None) -> Row:
        """Training row ``index``; ``n_rows`` (the corpus size, if finite) sizes the hub population."""
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise must be in [0, 1], got {noise}")
        r = _rng(self.seed, "train", index)
        scene = sample_scene(r, self.image_size)
        language = self.language(index)
        accurate = caption_scene(scene, r, language)
        kind = "clean"
        if r.random() < noise:
            kind = r.choices(tuple(NOISE_WEIGHTS), weights=tuple(NOISE_WEIGHTS.values()))[0]
        image_noise = None
        u = r.random()
        for name, weight in IMAGE_NOISE_WEIGHTS.items():
            if u < noise * weight:
                image_noise = name
                break
            u -= noise * weight
        image_id = f"train/{index}"
        other = ""
        if kind in ("mismatch", "hub"):
            other_index = r.randrange(1 << 40)
            o = _rng(self.seed, "caption", other_index)
            other = caption_scene(sample_scene(o, self.image_size), o, language)
        if kind == "hub":
            block = min(n_rows, HUB_BLOCK) if n_rows else HUB_BLOCK
            hubs = max(1, round(block * noise * NOISE_WEIGHTS["hub"] / HUB_TEXTS))
            hub = (index // HUB_BLOCK) * HUB_BLOCK + r.randrange(hubs)
            image_id = f"hub/{hub}"
            hr = _rng(self.seed, "hub", hub)
            scene = sample_scene(hr, self.image_size)
            image_noise = None  # one image, one set of metadata, whatever row it appears in
            width, height = _web_size(hr, None)
            punsafe = round(hr.betavariate(1, 40), 4)
        else:
            width, height = _web_size(r, image_noise)
            punsafe = round(r.uniform(0.6, 1.0) if image_noise == "unsafe" else r.betavariate(1, 40), 4)
        caption = accurate if kind == "clean" else _noise_text(kind, r, accurate, other)
        return Row(index, scene, caption, kind, image_noise, image_id, width, height, punsafe, language=language)

    def iter_rows(self, n: int | None, noise: float = 0.25, start: int = 0) -> Iterator[Row]:
        """Rows ``start``, ``start + 1``, … (``n`` of them, or forever)."""
        index = start
        while n is None or index < start + n:
            yield self.row(index, noise, n_rows=n)
            index += 1

    def iter_pairs(self, n: int | None, noise: float = 0.25) -> Iterator[tuple[Image.Image, str]]:
        """(image, alt-text) training pairs, rendered on the fly."""
        for row in self.iter_rows(n, noise):
            yield self.render(row.scene), row.caption

    # held-out sets ------------------------------------------------------------------------------
    def retrieval_set(
        self, n_images: int = 1000, captions_per_image: int = 5
    ) -> tuple[list[Image.Image], list[str], list[int]]:
        """Flickr-style test set: images, ``captions_per_image`` distinct accurate captions each, and for every
        caption the index of its image."""
        if n_images < 1 or captions_per_image < 1:
            raise ValueError("n_images and captions_per_image must be positive")
        images, captions, ids = [], [], []
        for i in range(n_images):
            scene, texts = self.retrieval_item(i, captions_per_image)
            images.append(self.render(scene))
            captions.extend(texts)
            ids.extend([i] * len(texts))
        return images, captions, ids

    def retrieval_item(self, index: int, captions_per_image: int = 5, language: str = "en") -> tuple[Scene, list[str]]:
        """Scene and distinct captions of retrieval image ``index``, in ``language``: the scene is the same in
        every language, as Multi30K's images are (one wording per concept outside English, so a caption
        in another language has fewer distinct variants)."""
        r = _rng(self.seed, "retrieval", index)
        scene = sample_scene(r, self.image_size)
        if language != "en":
            check_languages([language])
            r = _rng(self.seed, "retrieval", index, language)
        texts: list[str] = []
        for _ in range(50 * captions_per_image):
            text = caption_scene(scene, r, language)
            if text not in texts:
                texts.append(text)
            if len(texts) == captions_per_image:
                return scene, texts
        raise ValueError(f"could not write {captions_per_image} distinct captions for retrieval image {index}")

    @staticmethod
    def class_names(classes: ClassMode = "shape_colour") -> list[str]:
        """Class names in label order (alphabetical, so class folders sort into label order)."""
        if classes == "shape":
            return sorted(SHAPES)
        if classes == "shape_colour":
            return sorted(f"{c} {s}" for c in COLOURS for s in SHAPES)
        raise ValueError(f"classes must be 'shape_colour' or 'shape', got {classes!r}")

    def class_scene(self, index: int, classes: ClassMode = "shape_colour") -> tuple[Scene, int]:
        """Classification image ``index``: one object of class ``index % n_classes`` on a random background."""
        names = self.class_names(classes)
        label = index % len(names)
        r = _rng(self.seed, "classification", index)
        if classes == "shape":
            kind = names[label]
            background = r.choice(BACKGROUNDS)
            colour = r.choice(ALLOWED_COLOURS[background])
        else:
            colour, kind = names[label].split(" ")
            background = r.choice([b for b in BACKGROUNDS if colour in ALLOWED_COLOURS[b]])
        position = r.choice(POSITIONS)
        cx, cy = _POSITION_XY[position]
        size = r.choice(("small", "large"))
        obj = _make_shape(r, kind, colour, size, cx + r.uniform(-0.04, 0.04), cy + r.uniform(-0.04, 0.04))
        return Scene("single", background, (obj,), position, texture=_texture_choice(r, self.image_size)), label

    def classification_set(
        self, n_per_class: int = 10, classes: ClassMode = "shape_colour"
    ) -> tuple[list[Image.Image], list[int], list[str]]:
        """Images, labels and class names (for zero-shot prompts such as "a photo of a {}.")."""
        if n_per_class < 1:
            raise ValueError(f"n_per_class must be positive, got {n_per_class}")
        names = self.class_names(classes)
        images, labels = [], []
        for i in range(n_per_class * len(names)):
            scene, label = self.class_scene(i, classes)
            images.append(self.render(scene))
            labels.append(label)
        return images, labels, names

    def planted_duplicate(self, source: str) -> Image.Image:
        """An augmented copy of test image ``source`` ("retrieval/12" or "classification/3")."""
        split, _, number = source.partition("/")
        index = int(number)
        if split == "retrieval":
            scene = self.retrieval_item(index, 1)[0]
        elif split == "classification":
            scene = self.class_scene(index)[0]
        else:
            raise ValueError(f"unknown test split in {source!r}")
        return augment_near_duplicate(self.render(scene), _rng(self.seed, "duplicate", hash_index(source)))


def check_languages(languages: Sequence[str]) -> tuple[str, ...]:
    """``languages`` as a tuple; ValueError for none, a repeat or one the world has no lexicon for."""
    out = tuple(languages)
    if not out:
        raise ValueError("no caption languages given")
    unknown = [lang for lang in out if lang not in LANGUAGES]
    if unknown:
        raise ValueError(f"no synthetic captions in {unknown[0]!r}; languages: {', '.join(LANGUAGES)}")
    if len(set(out)) != len(out):
        raise ValueError(f"caption languages repeat: {', '.join(out)}")
    return out


def hash_index(text: str) -> int:
    """A stable integer for a string (Python's ``hash`` of a str changes between runs)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


# --------------------------------------------------------------------------------------------------
# Module-level API


def iter_pairs(
    n: int | None, *, seed: int = 0, noise: float = 0.25, image_size: int = 64, languages: Sequence[str] = ("en",)
) -> Iterator[tuple[Image.Image, str]]:
    """``n`` (or endless, with None) noisy (image, alt-text) training pairs, generated in memory; each
    caption in one of ``languages``."""
    return SyntheticWorld(seed, image_size, languages).iter_pairs(n, noise)


def retrieval_set(
    n_images: int = 1000, captions_per_image: int = 5, *, seed: int = 0, image_size: int = 64
) -> tuple[list[Image.Image], list[str], list[int]]:
    """Held-out retrieval test set: (images, captions, text_image_ids), ``captions_per_image`` per image."""
    return SyntheticWorld(seed, image_size).retrieval_set(n_images, captions_per_image)


def classification_set(
    n_per_class: int = 10, *, seed: int = 0, image_size: int = 64, classes: ClassMode = "shape_colour"
) -> tuple[list[Image.Image], list[int], list[str]]:
    """Held-out classification set: (images, labels, class_names); classes are "colour shape" or shapes."""
    return SyntheticWorld(seed, image_size).classification_set(n_per_class, classes)


def _jpeg(image: Image.Image, quality: int = 95) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


@dataclass(frozen=True)
class _CorpusPlan:
    """What ``write_corpus`` draws a row from besides its index: every process that renders rows rebuilds its
    worlds from this, so a row is the same whichever process drew it."""

    seed: int
    noise: float
    image_size: int
    languages: tuple[str, ...]
    test_seed: int
    n: int
    planted: dict[int, str]  # row index -> the held-out image ("retrieval/12") it is a copy of


class _CorpusRenderer:
    """Row ``index`` of a corpus and its JPEG bytes. Rows come in rising order, so a hub this renderer drew before
    was written at an earlier row: its later rows get no bytes (the writer keeps the first row's file)."""

    def __init__(self, plan: _CorpusPlan) -> None:
        self.plan = plan
        self.world = SyntheticWorld(plan.seed, plan.image_size, plan.languages)
        self.test_world = SyntheticWorld(plan.test_seed, plan.image_size)
        self.hubs_drawn: set[str] = set()

    def __call__(self, index: int) -> tuple[Row, bytes]:
        plan = self.plan
        row = self.world.row(index, plan.noise, n_rows=plan.n)
        source = plan.planted.get(index)
        if source is None:
            if row.image_id.startswith("hub/"):
                if row.image_id in self.hubs_drawn:
                    return row, b""
                self.hubs_drawn.add(row.image_id)
            return row, _jpeg(self.world.render(row.scene))
        # A test image reposted on the web with its own alt-text and crawl metadata.
        r = _rng(plan.seed, "plant", index + 1)
        split, _, number = source.partition("/")
        scene = (
            self.test_world.retrieval_item(int(number), 1)[0]
            if split == "retrieval"
            else self.test_world.class_scene(int(number))[0]
        )
        width, height = _web_size(r, None)
        planted = Row(
            index=index,
            scene=scene,
            caption=caption_scene(scene, r, row.language),
            noise="clean",
            image_noise=None,
            image_id=f"planted/{index}",
            width=width,
            height=height,
            punsafe=round(r.betavariate(1, 40), 4),
            planted_duplicate_of=source,
            language=row.language,
        )
        return planted, _jpeg(self.test_world.planted_duplicate(source))


_RENDERER: _CorpusRenderer | None = None  # a worker process's own


def _start_renderer(plan: _CorpusPlan) -> None:
    global _RENDERER
    _RENDERER = _CorpusRenderer(plan)


def _render_rows(start: int, stop: int) -> list[tuple[Row, bytes]]:
    assert _RENDERER is not None, "worker started without _start_renderer"
    return [_RENDERER(index) for index in range(start, stop)]


def _rendered_in_pool(pool: Any, n: int, workers: int, chunk: int = 64) -> Iterator[tuple[Row, bytes]]:
    """Rows 0..n-1 from the pool's workers, in order, with at most 4 chunks per worker drawn ahead of the writer
    (a slow disk holds back the drawing, never fills memory)."""
    starts = iter(range(0, n, chunk))
    pending: deque[Any] = deque()
    for start in itertools.islice(starts, 4 * workers):
        pending.append(pool.apply_async(_render_rows, (start, min(n, start + chunk))))
    while pending:
        rows = pending.popleft().get()
        following = next(starts, None)
        if following is not None:
            pending.append(pool.apply_async(_render_rows, (following, min(n, following + chunk))))
        yield from rows


def _add_corpus_row(
    out: Path, row: Row, data: bytes, hub_files: dict[str, tuple[str, str]], columns: dict[str, list]
) -> None:
    """Write a row's image (a hub's only at its first row) and append its metadata to ``columns``."""
    key = f"{row.index:09d}"
    if row.image_id in hub_files:
        rel, digest = hub_files[row.image_id]
        url = f"https://img.example/static/{row.image_id.replace('/', '_')}.jpg"
    else:
        digest = hashlib.sha256(data).hexdigest()
        rel = f"images/{key[:6]}/{key}.jpg"
        (out / rel).parent.mkdir(exist_ok=True)
        (out / rel).write_bytes(data)
        if row.image_id.startswith("hub/"):
            hub_files[row.image_id] = (rel, digest)
            url = f"https://img.example/static/{row.image_id.replace('/', '_')}.jpg"
        else:
            url = f"https://img.example/{digest[:2]}/{digest[2:14]}.jpg"
    values = (key, url, row.caption, row.width, row.height, digest, row.punsafe, rel, row.noise, row.image_noise)
    for name, value in zip(columns, (*values, row.planted_duplicate_of), strict=True):
        columns[name].append(value)


def write_corpus(
    out_dir: str | Path,
    n: int,
    *,
    seed: int = 0,
    noise: float = 0.25,
    image_size: int = 64,
    test_duplicates: int | None = None,
    test_seed: int = 0,
    retrieval_images: int = 1000,
    classification_per_class: int = 10,
    progress: bool = False,
    languages: Sequence[str] = ("en",),
    workers: int = 1,
) -> Path:
    """Write a crawl-like training corpus: ``images/`` (JPEG files) and ``metadata.parquet``.

    Columns: key, url, caption, width, height (the web image's original size), sha256 (of the stored bytes),
    punsafe, image_path (relative to ``out_dir``), and the ground truth noise, image_noise and
    planted_duplicate_of. ``test_duplicates`` rows (default: 1 % of ``n`` up to 100, none when ``noise`` is 0)
    are augmented copies of images of the held-out sets with ``test_seed``, half from the first
    ``retrieval_images`` retrieval images and half from the classification set of
    ``classification_per_class`` per class. Returns the metadata path. The same arguments give the same files.
    With several ``languages`` each row's caption is in one of them and a ``language`` column says which.
    ``workers`` processes draw and encode the rows (this process writes them, in order): the files are the same
    for any number.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if test_duplicates is None:
        test_duplicates = 0 if noise == 0 else min(100, n // 100)
    n_cls = classification_per_class * len(SyntheticWorld.class_names())
    if not 0 <= test_duplicates <= min(n, retrieval_images + n_cls):
        raise ValueError(f"test_duplicates must be in 0..{min(n, retrieval_images + n_cls)}, got {test_duplicates}")
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    world = SyntheticWorld(seed, image_size, languages)
    plant_rng = _rng(seed, "plant", 0)
    positions = plant_rng.sample(range(n), test_duplicates)
    n_ret = (test_duplicates + 1) // 2
    sources = [f"retrieval/{i}" for i in plant_rng.sample(range(retrieval_images), min(n_ret, retrieval_images))]
    sources += [f"classification/{i}" for i in plant_rng.sample(range(n_cls), test_duplicates - len(sources))]
    planted = dict(zip(positions, sources, strict=True))

    columns: dict[str, list] = {
        k: []
        for k in (
            "key",
            "url",
            "caption",
            "width",
            "height",
            "sha256",
            "punsafe",
            "image_path",
            "noise",
            "image_noise",
            "planted_duplicate_of",
        )
    }
    hub_files: dict[str, tuple[str, str]] = {}
    languages_seen: list[str] = []
    plan = _CorpusPlan(seed, noise, image_size, world.languages, test_seed, n, planted)
    pool = None
    if workers > 1:
        import multiprocessing

        # spawn: the caller may hold threads (torch's) that a forked child would inherit mid-lock
        pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_start_renderer, initargs=(plan,))
        items: Iterable[tuple[Row, bytes]] = _rendered_in_pool(pool, n, workers)
    else:
        items = map(_CorpusRenderer(plan), range(n))
    if progress:
        from tqdm import tqdm

        items = tqdm(items, total=n, desc="corpus", unit="img", dynamic_ncols=True)
    try:
        for row, data in items:
            _add_corpus_row(out, row, data, hub_files, columns)
            languages_seen.append(row.language)
    finally:
        if pool is not None:
            pool.terminate()
    table = pa.table(
        {
            **{k: pa.array(v, pa.string()) for k, v in columns.items() if k not in ("width", "height", "punsafe")},
            "width": pa.array(columns["width"], pa.int64()),
            "height": pa.array(columns["height"], pa.int64()),
            "punsafe": pa.array(columns["punsafe"], pa.float64()),
        }
    ).select(list(columns))
    if world.languages != ("en",):  # an English corpus keeps the columns it always had
        table = table.append_column("language", pa.array(languages_seen, pa.string()))
    path = out / "metadata.parquet"
    pq.write_table(table, path)
    return path


def karpathy_tokens(text: str) -> list[str]:
    """Lowercased words without punctuation, as the Karpathy split files store them."""
    return re.findall(r"[a-z0-9]+(?:'[a-z]+)?", text.lower())


def write_retrieval_set(
    out_dir: str | Path, n_images: int = 1000, captions_per_image: int = 5, *, seed: int = 0, image_size: int = 64
) -> Path:
    """Write the retrieval set in the Karpathy split format: ``dataset_synthetic.json`` + ``images/*.jpg``."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    world = SyntheticWorld(seed, image_size)
    entries, sentid = [], 0
    for i in range(n_images):
        scene, texts = world.retrieval_item(i, captions_per_image)
        filename = f"{i:06d}.jpg"
        (out / "images" / filename).write_bytes(_jpeg(world.render(scene)))
        sentences = [
            {"raw": t, "tokens": karpathy_tokens(t), "imgid": i, "sentid": sentid + j} for j, t in enumerate(texts)
        ]
        entries.append(
            {
                "split": "test",
                "filepath": "images",
                "filename": filename,
                "imgid": i,
                "sentids": [s["sentid"] for s in sentences],
                "sentences": sentences,
            }
        )
        sentid += len(texts)
    path = out / "dataset_synthetic.json"
    path.write_text(json.dumps({"images": entries, "dataset": "synthetic"}))
    return path


def write_classification_set(
    out_dir: str | Path,
    n_per_class: int = 10,
    *,
    seed: int = 0,
    image_size: int = 64,
    classes: ClassMode = "shape_colour",
) -> Path:
    """Write ImageNet-style ``val/<class_folder>/NNNNN.jpg`` plus ``classnames.txt`` (line i = class i's name).

    Class folders are the names with spaces as underscores; they sort in label order. Returns ``out_dir/val``.
    """
    out = Path(out_dir)
    world = SyntheticWorld(seed, image_size)
    names = world.class_names(classes)
    folders = [name.replace(" ", "_") for name in names]
    assert folders == sorted(folders)
    for folder in folders:
        (out / "val" / folder).mkdir(parents=True, exist_ok=True)
    for i in range(n_per_class * len(names)):
        scene, label = world.class_scene(i, classes)
        (out / "val" / folders[label] / f"{i:05d}.jpg").write_bytes(_jpeg(world.render(scene)))
    (out / "classnames.txt").write_text("\n".join(names) + "\n")
    return out / "val"


def write_multi30k_set(
    out_dir: str | Path,
    n_images: int = 1000,
    languages: Sequence[str] = LANGUAGES,
    *,
    seed: int = 0,
    image_size: int = 64,
    split: str = "test_2016_flickr",
    image_dir: str | Path | None = None,
) -> Path:
    """Write the retrieval set in Multi30K's task-1 layout, one caption per image in each language:
    ``image_splits/<split>.txt`` (line i names image i), ``raw/<split>.<lang>`` (line i is its caption) and
    the images in ``image_dir`` (default ``out_dir/images``; Multi30K keeps them apart, in Flickr30K's
    folder, and so does the packaged ``paper-multilingual.yaml`` suite). The scenes are the retrieval set's,
    so the English captions are the first of ``write_retrieval_set``'s. Returns ``out_dir``;
    ``eval/multilingual.py`` reads it as it reads Multi30K."""
    languages = check_languages(languages)
    if n_images < 1:
        raise ValueError(f"n_images must be positive, got {n_images}")
    if not split or "/" in split or split.startswith("."):
        raise ValueError(f"split must be a plain file stem, got {split!r}")
    out = Path(out_dir)
    images = Path(image_dir) if image_dir is not None else out / "images"
    for folder in (images, out / "image_splits", out / "raw"):
        folder.mkdir(parents=True, exist_ok=True)
    world = SyntheticWorld(seed, image_size)
    names: list[str] = []
    captions: dict[str, list[str]] = {lang: [] for lang in languages}
    for i in range(n_images):
        name = f"{i:06d}.jpg"
        scene = world.retrieval_item(i, 1)[0]
        (images / name).write_bytes(_jpeg(world.render(scene)))
        names.append(name)
        for lang in languages:
            captions[lang].extend(world.retrieval_item(i, 1, lang)[1])
    (out / "image_splits" / f"{split}.txt").write_text("\n".join(names) + "\n")
    for lang, lines in captions.items():
        (out / "raw" / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out
