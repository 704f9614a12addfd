"""``data.decode: cuda`` without a GPU: the workers' hand-over (encoded bytes, crop boxes, flips) and everything
after the decode, with PIL's decoder injected in place of torchvision's GPU decoder (tests/test_cuda.py runs the
real one)."""

from __future__ import annotations

import io
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from openalign.config import ConfigError, from_dict
from openalign.data.device_decode import DeviceDecoder, pil_decode, resize_crop_flip
from openalign.data.transforms import center_crop, random_crop
from openalign.text import train_wordpiece
from openalign.train.config import TrainConfig
from openalign.train.data import _TAG_AUGMENT, DataConfig, TrainStream, _Dataset, _mix, build_train_stream
from test_train_data import caption, encoded, take, write_tar

# Antialiased bicubic in torch (float, rounded once) against PIL's (rounded to 8 bits between its two passes,
# reducing_gap 3), after the same decode with draft mode off: measured 0.1-0.2 levels of 255 on average, at most 3
# on photo-like scenes and noise, 10 where a tiny image is upscaled over sharp edges (the passes' clipping). A crop
# one pixel off measures 4.6 on average, a missed flip 37. (Draft mode in the reference instead: 0.65, at most 33.)
MEAN_TOLERANCE, MAX_TOLERANCE = 0.5, 12


@pytest.fixture(scope="module")
def tokenizer():
    return train_wordpiece([caption(i) for i in range(300)] * 2, vocab_size=120, min_frequency=1)


def noise_jpeg(seed: int, width: int, height: int) -> bytes:
    # Noise survives JPEG well enough at quality 95 that a crop one pixel off, or a missed flip, shows.
    rng = np.random.default_rng(seed)
    return encoded(Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)), "JPEG", quality=95)


def scene_jpeg(seed: int, width: int, height: int) -> bytes:
    from openalign.data.synthetic import SyntheticWorld

    world = SyntheticWorld(seed, max(width, height))
    row = next(iter(world.iter_rows(1, 0.0)))
    return encoded(world.render(row.scene).resize((width, height)), "JPEG", quality=90)


def shards_of(path: Path, images: list[bytes], ext: str = "jpg") -> str:
    samples = [{"__key__": f"{i:06d}", ext: data, "txt": caption(i).encode()} for i, data in enumerate(images)]
    write_tar(path, samples)
    return str(path)


def pair(shards: str, tokenizer, **kw: object) -> tuple[TrainStream, TrainStream]:
    """The CPU path and the cuda path (PIL decoding on the CPU) over the same shards and seed."""
    base = {"shards": shards, "image_size": 16, "resize": 20, "max_text_length": 8, "draft": False, **kw}
    cpu = build_train_stream(from_dict(DataConfig, base), tokenizer, seed=7)
    cuda = build_train_stream(from_dict(DataConfig, {**base, "decode": "cuda"}), tokenizer, seed=7)
    image = cuda._plan.image
    cuda.decoder = DeviceDecoder(image["image_size"], image["resize"], "cpu", decode=pil_decode)
    return cpu, cuda


def test_workers_hand_over_the_bytes_and_the_crops_the_cpu_path_draws(tmp_path: Path, tokenizer) -> None:
    images = [noise_jpeg(i, 20, 20) for i in range(10)]
    shards = shards_of(tmp_path / "a.tar", images)
    order = {"shuffle_buffer": 0, "shuffle_shards": False}
    _, cuda = pair(shards, tokenizer, batch_size=5, workers=0, **order)
    piece = next(iter(_Dataset(cuda._plan)))[0]
    assert isinstance(piece, dict) and piece["rows"].numel() == 0  # every row left to the device
    offsets = piece["offsets"].tolist()
    assert [piece["data"][offsets[i] : offsets[i + 1]].numpy().tobytes() for i in range(5)] == images[:5]
    for pos in range(5):
        torch.manual_seed(_mix(7, _TAG_AUGMENT, pos))
        box, flip = random_crop(16, 20, True)
        assert piece["boxes"][pos].tolist() == list(box) and bool(piece["flips"][pos]) == flip
    # Sources already at the resize: no resampling on either path, so the same crops and flips give the same
    # pixels exactly, random crops or central ones, decoded in the training process or by workers.
    for kw in ({"workers": 0}, {"workers": 2, "piece_size": 2}, {"workers": 0, "crop": "center", "flip": False}):
        cpu, cuda = pair(shards, tokenizer, batch_size=5, **order, **kw)
        for a, b in zip(take(cpu, 4), take(cuda, 4), strict=True):
            assert torch.equal(a["input_ids"], b["input_ids"])
            assert torch.equal(a["pixel_values"], b["pixel_values"])
    assert center_crop(16, 20) == (2, 2, 18, 18)


def test_device_resize_crop_and_flip_match_the_cpu_path_within_rounding(tmp_path: Path, tokenizer) -> None:
    # Downscales by 1.6× to 6.4× (the last through the block average of PIL's reducing_gap) and an upscale.
    sizes = [(128, 96), (96, 128), (64, 64), (32, 24), (12, 16)]
    images = [scene_jpeg(i, *sizes[i % len(sizes)]) for i in range(10)] + [noise_jpeg(i, 96, 72) for i in range(5)]
    shards = shards_of(tmp_path / "a.tar", images)
    cpu, cuda = pair(shards, tokenizer, batch_size=15, workers=0, shuffle_buffer=0, shuffle_shards=False)
    a, b = take(cpu, 1)[0], take(cuda, 1)[0]
    assert torch.equal(a["input_ids"], b["input_ids"])
    diff = (a["pixel_values"].float() - b["pixel_values"].float()).abs()
    assert diff.mean() <= MEAN_TOLERANCE and diff.max() <= MAX_TOLERANCE, (diff.mean(), diff.max())
    # The tolerance is tight enough to see a crop one pixel off or a flip missed.
    shifted = torch.roll(b["pixel_values"], 1, dims=-1)
    assert (a["pixel_values"].float() - shifted.float()).abs().mean() > 4 * MEAN_TOLERANCE
    # The normalisation the loop applies is the one it applies to the CPU path's pixels.
    assert (cpu.pixels(a["pixel_values"]) - cuda.pixels(b["pixel_values"])).abs().max() <= MAX_TOLERANCE / 127.5


def test_resize_crop_flip_groups_images_of_one_size_and_writes_the_rows_asked() -> None:
    rng = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=rng) for h, w in [(30, 40), (20, 20)] * 3]
    boxes = [(1, 2, 17, 18), (0, 0, 16, 16), (4, 4, 20, 20), (3, 1, 19, 17), (2, 2, 18, 18), (4, 0, 20, 16)]
    flips = [False, True, True, False, False, True]
    out = torch.zeros((8, 3, 16, 16), dtype=torch.uint8)
    rows = [7, 0, 1, 2, 3, 5]
    resize_crop_flip(images, boxes, flips, 20, out, rows)
    for i in (1, 3, 5):  # at the resize already: plain crops
        left, top, right, bottom = boxes[i]
        crop = images[i][:, top:bottom, left:right]
        assert torch.equal(out[rows[i]], crop.flip(-1) if flips[i] else crop)
    assert out[4].eq(0).all() and out[6].eq(0).all()


def test_non_jpegs_go_through_the_cpu_path_and_broken_ones_are_counted(tmp_path: Path, tokenizer) -> None:
    good = noise_jpeg(0, 20, 20)
    rgb = Image.open(io.BytesIO(good)).convert("RGB")
    # A good header and an end-of-image marker, but a Huffman table no decoder accepts.
    broken = bytearray(good)
    dht = good.index(b"\xff\xc4")
    broken[dht + 5 : dht + 21] = b"\xff" * 16
    images = {
        "jpg0": good,
        "png": encoded(rgb, "PNG"),  # decoded by the worker
        "cmyk": encoded(rgb.convert("CMYK"), "JPEG"),  # JPEG, but not one the GPU decoder takes: the worker's
        "gray": encoded(rgb.convert("L"), "JPEG", quality=95),  # the device's, as RGB
        "truncated": good[: len(good) * 2 // 3],  # no end marker: the worker's, which finds it broken
        "jpg1": noise_jpeg(1, 20, 20),
        "broken": bytes(broken),  # found broken by the device decoder
        "jpg2": noise_jpeg(2, 20, 20),
    }
    samples = [
        {"__key__": key, "png" if key == "png" else "jpg": data, "txt": caption(i).encode()}
        for i, (key, data) in enumerate(images.items())
    ]
    write_tar(tmp_path / "a.tar", samples)
    order = {"shuffle_buffer": 0, "shuffle_shards": False}
    cpu, cuda = pair(str(tmp_path / "a.tar"), tokenizer, batch_size=4, workers=0, **order)
    piece = next(iter(_Dataset(cuda._plan)))[0]
    assert isinstance(piece, dict) and piece["rows"].tolist() == [1, 2]  # the PNG and the CMYK JPEG
    a, b = take(cpu, 2), take(cuda, 2)
    assert cpu.stats == cuda.stats == Counter(corrupt=2)
    for x, y in zip(a, b, strict=True):
        same = [i for i in range(4) if torch.equal(x["input_ids"][i], y["input_ids"][i])]
        # The CPU path refills a broken sample's slot from before the step; the device repeats one of its piece.
        assert len(same) >= 3
        for i in same:
            assert torch.equal(x["pixel_values"][i], y["pixel_values"][i])
    refilled = b[1]["pixel_values"]
    assert any(torch.equal(refilled[2], refilled[i]) for i in (0, 1, 3))  # "broken" was row 2 of step 2


def test_decode_cuda_settings_are_checked(tmp_path: Path, tokenizer) -> None:
    with pytest.raises(ConfigError, match="synthetic"):
        from_dict(DataConfig, {"source": "synthetic", "decode": "cuda"}).validate()
    with pytest.raises(ConfigError, match=r"train\.device is cpu"):
        from_dict(TrainConfig, {"data": {"shards": "x.tar", "decode": "cuda"}, "train": {"device": "cpu"}}).validate()
    if not torch.cuda.is_available():
        shards = shards_of(tmp_path / "a.tar", [noise_jpeg(0, 20, 20)])
        cfg = from_dict(DataConfig, {"shards": shards, "image_size": 16, "resize": 20, "decode": "cuda"})
        with pytest.raises(ConfigError, match="needs a CUDA device"):
            take(build_train_stream(cfg, tokenizer, seed=7), 1)


def test_a_missing_torchvision_is_one_clear_error(monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "torchvision", None)
    monkeypatch.setitem(sys.modules, "torchvision.io", None)
    decoder = DeviceDecoder(16, 20, "cpu")
    with pytest.raises(ImportError, match=r"needs torchvision \(pip install torchvision\)"):
        decoder([torch.frombuffer(bytearray(noise_jpeg(0, 20, 20)), dtype=torch.uint8)], [(0, 0, 16, 16)], [False])


def test_resampled_streams_hand_over_the_same_crops(tmp_path: Path, tokenizer) -> None:
    shards = shards_of(tmp_path / "a.tar", [noise_jpeg(i, 20, 20) for i in range(12)])
    cpu, cuda = pair(shards, tokenizer, batch_size=4, workers=0, resampled=True)
    for a, b in zip(take(cpu, 3), take(cuda, 3), strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["pixel_values"], b["pixel_values"])


@pytest.mark.usefixtures("one_thread")
def test_the_training_loop_takes_the_decoded_batches(tmp_path: Path, tokenizer) -> None:
    from openalign.train.loop import train
    from test_train_loop import tiny_config

    tokenizer.save(tmp_path / "tok")
    shards = shards_of(tmp_path / "a.tar", [scene_jpeg(i, 48, 36) for i in range(16)])
    data = {"shards": shards, "tokenizer": str(tmp_path / "tok"), "workers": 0, "max_text_length": 8}
    cfg = tiny_config(tmp_path / "run", data={**data, "decode": "cuda"}, train={"steps": 2, "device": "auto"})

    def injected(*args: object, **kw: object) -> TrainStream:
        stream = build_train_stream(*args, **kw)  # type: ignore[arg-type]
        image = stream._plan.image
        stream.decoder = DeviceDecoder(image["image_size"], image["resize"], "cpu", decode=pil_decode)
        return stream

    result = train(cfg, stream_factory=injected)
    assert result.step == 2 and result.skipped_steps == 0 and np.isfinite(result.metrics["loss"])
