from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import openalign
from openalign.data.transforms import (
    BadImage,
    decode_image,
    decode_jpeg_pixels,
    eval_transform,
    jpeg_size,
    model_resize,
    model_transform,
    pil_decode_image,
    random_crop,
    to_tensor,
    train_transform,
)


def encode(image: Image.Image, fmt: str = "PNG", **kw: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def gradient(w: int = 40, h: int = 30) -> Image.Image:
    arr = np.zeros((h, w, 3), dtype=np.uint8)
    arr[..., 0] = np.linspace(0, 255, w, dtype=np.uint8)[None, :]
    arr[..., 1] = np.linspace(0, 255, h, dtype=np.uint8)[:, None]
    arr[..., 2] = 77
    return Image.fromarray(arr, "RGB")


def test_decode_rgb_roundtrip() -> None:
    img = gradient()
    out = decode_image(encode(img))
    assert out.mode == "RGB" and out.size == (40, 30)
    assert np.array_equal(np.asarray(out), np.asarray(img))


@pytest.mark.parametrize("mode", ["L", "P", "CMYK", "RGBA", "LA", "I;16"])
def test_decode_every_mode_gives_rgb(mode: str) -> None:
    base = gradient()
    if mode == "I;16":
        img = Image.fromarray(np.asarray(base.convert("L"), dtype=np.uint16) * 257)
    else:
        img = base.convert(mode)
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    out = decode_image(encode(img, fmt))
    assert out.mode == "RGB" and out.size == (40, 30)
    if mode == "I;16":
        # 16-bit is rescaled, not clipped to white: the darkest row stays dark, the brightest bright.
        grey = np.asarray(out)[..., 0]
        assert grey.min() < 10 and grey.max() > 245


def test_alpha_composited_on_white() -> None:
    img = Image.new("RGBA", (8, 8), (255, 0, 0, 0))  # fully transparent red
    out = np.asarray(decode_image(encode(img)))
    assert (out == 255).all()


def test_bad_images_raise_with_reason() -> None:
    with pytest.raises(BadImage) as e:
        decode_image(b"")
    assert e.value.reason == "empty"
    with pytest.raises(BadImage) as e:
        decode_image(b"definitely not an image")
    assert e.value.reason == "corrupt"
    data = encode(gradient(), "JPEG")
    with pytest.raises(BadImage) as e:
        decode_image(data[: len(data) // 2])
    assert e.value.reason == "corrupt"
    with pytest.raises(BadImage) as e:
        decode_image(encode(Image.new("RGB", (1, 1))))
    assert e.value.reason == "too_small"
    # A decompression bomb: a few hundred bytes declaring 20000 x 20000 pixels.
    bomb = encode(Image.new("1", (20000, 20000)))
    assert len(bomb) < 100_000
    with pytest.raises(BadImage) as e:
        decode_image(bomb)
    assert e.value.reason == "too_large"


def test_to_tensor_normalisation() -> None:
    img = Image.fromarray(np.array([[[0, 255, 51]]], dtype=np.uint8), "RGB")
    x = to_tensor(img, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert x.shape == (3, 1, 1)
    assert torch.allclose(x.flatten(), torch.tensor([-1.0, 1.0, 51 / 255 * 2 - 1]))


def test_eval_transform_is_resize_then_centre_crop() -> None:
    img = gradient(50, 70)
    x = eval_transform(image_size=20, resize=24)(img)
    ref = img.resize((24, 24), Image.BICUBIC, reducing_gap=3.0).crop((2, 2, 22, 22))
    assert torch.equal(x, to_tensor(ref, (0.5,) * 3, (0.5,) * 3))


def test_train_transform_crops_flips_and_is_seeded() -> None:
    img = gradient(64, 48)
    t = train_transform(image_size=16, resize=20)
    torch.manual_seed(3)
    a = t(img)
    torch.manual_seed(3)
    b = t(img)
    assert a.shape == (3, 16, 16) and torch.equal(a, b)
    resized = to_tensor(img.resize((20, 20), Image.BICUBIC, reducing_gap=3.0), (0.5,) * 3, (0.5,) * 3)
    crops = {(i, j, f) for i in range(5) for j in range(5) for f in (False, True)}
    seen = set()
    for seed in range(60):
        torch.manual_seed(seed)
        x = t(img)
        for i, j, f in crops:
            ref = resized[:, i : i + 16, j : j + 16]
            if torch.equal(x, ref.flip(-1) if f else ref):
                seen.add((i, j, f))
                break
        else:
            raise AssertionError("a train crop is not a flipped or plain window of the resized image")
    assert any(f for *_, f in seen) and any(not f for *_, f in seen)
    assert len({(i, j) for i, j, _ in seen}) > 5


def test_bad_sizes_and_model_transform() -> None:
    with pytest.raises(ValueError):
        eval_transform(image_size=300, resize=289)
    assert model_resize(289) == 346
    cfg = openalign.model_config("nano")
    x = model_transform(cfg)(gradient(90, 90))
    assert x.shape == (3, cfg.image_size, cfg.image_size)


def test_uint8_pixels_normalised_later_equal_the_float_transform_bit_for_bit() -> None:
    from openalign.data.transforms import normalize_pixels, train_transform

    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (40, 50, 3), dtype=np.uint8))
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    floats, raw = [], []
    for normalize, out in ((True, floats), (False, raw)):
        torch.manual_seed(11)
        transform = train_transform(24, 30, mean, std, normalize=normalize)
        out.extend(transform(image) for _ in range(4))
    assert raw[0].dtype == torch.uint8
    assert torch.equal(normalize_pixels(torch.stack(raw), mean, std), torch.stack(floats))
    assert torch.equal(normalize_pixels(torch.stack(floats), mean, std), torch.stack(floats))  # float: as it is


def test_normalising_fake_pixels_first_leaves_real_ones_right() -> None:
    # A memory plan normalises fake pixels; the real steps after it in the same process must not see fakes.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from openalign.data.transforms import normalize_pixels

    mean, std = (0.1, 0.2, 0.3), (0.9, 0.8, 0.7)
    with FakeTensorMode():
        assert normalize_pixels(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), mean, std).shape == (2, 3, 4, 4)
    white = normalize_pixels(torch.full((1, 3, 1, 1), 255, dtype=torch.uint8), mean, std).flatten()
    assert torch.allclose(white, torch.tensor([(1 - 0.1) / 0.9, (1 - 0.2) / 0.8, (1 - 0.3) / 0.7]))


def _jpegs() -> list[tuple[str, bytes]]:
    """JPEGs as PIL writes them in every layout its opener reads, and headers PIL must judge itself."""
    base = gradient(37, 23)
    exif = Image.Exif()
    exif[0x010E] = "a described picture " * 40
    cases = [
        ("rgb", encode(base, "JPEG")),
        ("grey", encode(base.convert("L"), "JPEG")),
        ("cmyk", encode(base.convert("CMYK"), "JPEG")),
        ("progressive", encode(base, "JPEG", progressive=True)),
        ("restart_markers", encode(base, "JPEG", restart_marker_blocks=1)),
        ("exif", encode(base, "JPEG", exif=exif.tobytes())),
        ("icc", encode(base, "JPEG", icc_profile=b"\0" * 70_000)),  # split over two APP2 markers
        ("subsampled", encode(gradient(301, 7), "JPEG", subsampling=2)),
    ]
    rng = np.random.default_rng(0)
    for i in range(200):  # corrupted headers: either read exactly as PIL reads them, or left to PIL
        data = bytearray(cases[i % len(cases)][1][:1024])
        for _ in range(1 + i % 3):
            data[int(rng.integers(2, 300))] = int(rng.integers(0, 256))
        cases.append((f"mutated_{i}", bytes(data)))
    return cases


def test_jpeg_size_reads_what_pil_reads_or_leaves_it_to_pil() -> None:
    read = []
    for name, data in _jpegs():
        size = jpeg_size(data)
        if size is not None:
            read.append(name)
            assert Image.open(io.BytesIO(data)).size == size, name
    assert all(not name.startswith("mutated") for name in read[:8]), "every plain layout is read without PIL"
    assert len(read) >= 8 + 20, "so are mutations that leave the markers' structure whole"
    png = encode(gradient(), "PNG")
    assert jpeg_size(png) is None and jpeg_size(b"") is None and jpeg_size(b"\xff\xd8\xff") is None
    whole = encode(gradient(), "JPEG")
    sos = whole.index(b"\xff\xda")
    assert jpeg_size(whole[:sos]) is None, "a head cut before the scan is PIL's to judge"
    assert jpeg_size(whole[: sos + 4]) == (40, 30)


def _photo(w: int, h: int, seed: int = 0) -> Image.Image:
    """Smooth colour waves plus sensor-like noise: every DCT frequency carries energy, as in a photo."""
    yy, xx = np.mgrid[0:h, 0:w]
    waves = [np.sin(xx / (11 + 7 * c) + c) * 60 + np.cos(yy / (5 + 9 * c)) * 60 + 128 for c in range(3)]
    noise = np.random.default_rng(seed).normal(0, 14, (h, w, 3))
    return Image.fromarray(np.clip(np.stack(waves, -1) + noise, 0, 255).astype(np.uint8), "RGB")


def test_decode_jpeg_pixels_are_pils_pixels_or_left_to_pil() -> None:
    pytest.importorskip("simplejpeg")
    photos = [
        ("444", encode(_photo(700, 530), "JPEG", quality=92, subsampling=0)),
        ("422", encode(_photo(768, 576, 1), "JPEG", quality=75, subsampling=1)),
        ("420_portrait", encode(_photo(577, 1031, 2), "JPEG", quality=60, subsampling=2)),
        ("progressive", encode(_photo(900, 700, 3), "JPEG", progressive=True)),
        ("grey", encode(_photo(820, 410, 4).convert("L"), "JPEG")),
        ("restarts", encode(_photo(733, 351, 5), "JPEG", restart_marker_blocks=3)),
        ("odd_sides", encode(_photo(1399, 747, 6), "JPEG", subsampling=2)),
    ]
    fast = 0
    for name, data in photos + _jpegs():
        for draft in (None, (346, 346), (100, 100), (40, 40), (5, 5)):
            pixels = decode_jpeg_pixels(data, draft=draft)
            if pixels is None:
                continue
            fast += 1
            # Equal, not close: the stream's batches must not depend on whether simplejpeg is installed.
            reference = np.asarray(pil_decode_image(data, draft=draft))
            assert pixels.dtype == np.uint8 and pixels.shape == reference.shape, (name, draft)
            assert np.array_equal(pixels, reference), (name, draft, np.abs(pixels - reference.astype(int)).max())
            decoded = decode_image(data, draft=draft)
            assert decoded.mode == "RGB" and np.array_equal(np.asarray(decoded), reference), (name, draft)
    assert fast >= 5 * (len(photos) + 6), "every plain layout, at every draft scale, takes the fast path"
    cmyk = dict(_jpegs())["cmyk"]
    assert decode_jpeg_pixels(cmyk) is None, "Adobe CMYK is PIL's (its inverted ink)"
    whole = photos[0][1]
    assert decode_jpeg_pixels(whole[: len(whole) // 2]) is None, "a cut-off file is PIL's to name"
    assert decode_jpeg_pixels(encode(gradient(), "PNG")) is None
    assert decode_jpeg_pixels(whole, max_pixels=700 * 529) is None, "decode_image names a refused size"
    assert decode_jpeg_pixels(whole, min_side=531) is None


def test_without_simplejpeg_everything_is_left_to_pil(monkeypatch: pytest.MonkeyPatch) -> None:
    from openalign.data import transforms

    data = encode(_photo(64, 48), "JPEG")
    fast = np.asarray(decode_image(data))
    monkeypatch.setattr(transforms, "_simplejpeg", lambda: None)
    assert decode_jpeg_pixels(data) is None
    assert np.array_equal(np.asarray(decode_image(data)), fast)


def test_decode_image_takes_plain_jpegs_past_pil(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("simplejpeg")
    from openalign.data import transforms

    data, png = encode(_photo(64, 48), "JPEG"), encode(gradient(), "PNG")
    reference = np.asarray(pil_decode_image(data))
    monkeypatch.setattr(transforms, "open_image", lambda *a, **k: pytest.fail("a plain JPEG reached PIL"))
    assert np.array_equal(np.asarray(decode_image(data)), reference)
    with pytest.raises(pytest.fail.Exception):
        decode_image(png)  # anything else still goes through PIL


@pytest.mark.parametrize("size", [(256, 192), (200, 300), (768, 576), (1500, 1000), (30, 20), (346, 346)])
@pytest.mark.parametrize("noise", [0, 40])
def test_train_transform_resizes_as_pil_resizes_then_crops(size: tuple[int, int], noise: int) -> None:
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    waves = np.stack([128 + 100 * np.sin(xx / (3 + 3 * i) + yy / (5 + i)) for i in range(3)], -1)
    noisy = waves + np.random.default_rng(0).normal(0, noise, waves.shape)
    image = Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))
    transform = train_transform(289, 346, normalize=False, flip=True)
    for seed in range(4):
        torch.manual_seed(seed)
        got = transform(image).numpy().astype(int)
        torch.manual_seed(seed)
        box, flipped = random_crop(289, 346, True)
        pil = image.resize((346, 346), Image.Resampling.BICUBIC, reducing_gap=3.0).crop(box)
        if flipped:
            pil = pil.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        diff = np.abs(got - np.asarray(pil).transpose(2, 0, 1).astype(int))
        # The same kernel in other arithmetic: a level or two on a few pixels, never a shifted crop or a
        # missed flip (those differ by tens of levels on most pixels).
        assert diff.mean() < 0.02 and diff.max() <= 2, (size, seed, diff.mean(), diff.max())
