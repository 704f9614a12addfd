from __future__ import annotations

import dataclasses
import io
import itertools
import json
import pickle
import struct
import tarfile
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from openalign.config import ConfigError, from_dict, model_config
from openalign.text import train_wordpiece
from openalign.train.data import DataConfig, TrainStream, build_train_stream, probe_image

WORDS = ["red", "green", "blue", "cyan", "plum", "gold", "teal", "pink", "gray", "navy", "lime", "rust"]


def caption(i: int) -> str:
    # Distinct captions made of whole vocabulary words, so token rows identify samples.
    return f"{WORDS[i % 12]} {WORDS[(i // 12) % 12]} {WORDS[(i // 144) % 12]} scene"


@pytest.fixture(scope="module")
def tokenizer():
    return train_wordpiece([caption(i) for i in range(300)] * 2, vocab_size=120, min_frequency=1)


def encoded(image: Image.Image, fmt: str = "PNG", **kw: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def picture(seed: int, size: int = 24) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def write_tar(path: Path, samples: list[dict[str, bytes]]) -> Path:
    """A WebDataset tar as img2dataset writes it: key.ext members, one sample after another."""
    with tarfile.open(path, "w") as tf:
        for sample in samples:
            key = sample["__key__"]
            for ext, data in sample.items():
                if ext == "__key__":
                    continue
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


def good_sample(i: int) -> dict[str, bytes]:
    return {"__key__": f"{i:06d}", "png": encoded(picture(i)), "txt": caption(i).encode()}


def write_dataset(root: Path, n: int, per_shard: int) -> str:
    root.mkdir(parents=True, exist_ok=True)
    for s in range(0, n, per_shard):
        write_tar(root / f"{s // per_shard:05d}.tar", [good_sample(i) for i in range(s, min(n, s + per_shard))])
    return str(root / f"{{00000..{(n - 1) // per_shard:05d}}}.tar")


def stream(shards: str, tokenizer, **kw: object) -> TrainStream:
    rank, world = kw.pop("rank", 0), kw.pop("world_size", 1)
    cfg = from_dict(DataConfig, {"shards": shards, "image_size": 16, "resize": 20, "max_text_length": 8, **kw})
    return build_train_stream(cfg, tokenizer, rank=rank, world_size=world, seed=7)


def take(s: TrainStream, n: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for batch in s:
        out.append(batch)
        if len(out) == n:
            break
    return out


def rows(batches: list[dict[str, torch.Tensor]]) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    return [
        (b["pixel_values"][j], tuple(b["input_ids"][j].tolist())) for b in batches for j in range(len(b["input_ids"]))
    ]


def huge_blank_png(width: int, height: int) -> bytes:
    """A valid 1-bit PNG declaring width × height pixels, a few kB on disk (a decompression bomb)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z = zlib.compressobj(9)
    row = b"\x00" * (1 + (width + 7) // 8)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


# ----------------------------------------------------------------------------------------------- config


def test_config_is_strict_and_validated(tokenizer) -> None:
    with pytest.raises(ConfigError, match="batch_sise"):
        from_dict(DataConfig, {"batch_sise": 4})
    with pytest.raises(ConfigError, match=r"data\.shards"):
        build_train_stream(DataConfig(), tokenizer)
    with pytest.raises(ConfigError, match="resize"):
        build_train_stream(DataConfig(shards="x.tar", image_size=32, resize=16), tokenizer)
    with pytest.raises(ConfigError, match="tokenizer"):
        build_train_stream(DataConfig(shards="x.tar"), None)
    with pytest.raises(ValueError, match="rank 2"):
        build_train_stream(DataConfig(shards="x.tar"), tokenizer, rank=2, world_size=2)
    nano = model_config("nano")
    with pytest.raises(ConfigError, match="max_text_length"):
        build_train_stream(DataConfig(shards="x.tar", max_text_length=65), tokenizer, model_config=nano)
    cfg = from_dict(DataConfig, {"shards": ["a.tar", "b.tar"], "pixel_mean": [0.4, 0.4, 0.4]})
    assert cfg.shards == ("a.tar", "b.tar") and cfg.pixel_mean == (0.4, 0.4, 0.4)


def test_sizes_and_pixel_scaling_come_from_the_model(tmp_path: Path, tokenizer) -> None:
    shards = write_dataset(tmp_path, 8, 8)
    mc = model_config("nano", image_size=24, pixel_mean=(0.0, 0.0, 0.0), pixel_std=(1.0, 1.0, 1.0))
    cfg = DataConfig(shards=shards, batch_size=4, workers=0, max_text_length=8)
    s = build_train_stream(cfg, tokenizer, model_config=mc)
    (batch,) = take(s, 1)
    # Pixels travel as uint8; the stream's pixels() makes the model's input of them, with the model's scaling.
    assert batch["pixel_values"].shape == (4, 3, 24, 24) and batch["pixel_values"].dtype == torch.uint8
    x = s.pixels(batch["pixel_values"])
    assert x.dtype == torch.float32 and torch.equal(x, batch["pixel_values"].float() / 255)  # mean 0, std 1: [0, 1]
    assert batch["input_ids"].shape == (4, 8) and batch["input_ids"].dtype == torch.long
    assert batch["attention_mask"].dtype == torch.long and bool(batch["attention_mask"][:, 0].all())
    cfg = DataConfig(shards=shards, batch_size=4, workers=0, max_text_length=8, crop="center")
    s = build_train_stream(cfg, tokenizer)
    (batch,) = take(s, 1)  # no model: the paper's 289 of 346, [-1, 1]
    assert batch["pixel_values"].shape == (4, 3, 289, 289)
    assert torch.equal(s.pixels(batch["pixel_values"]), batch["pixel_values"].float() / 127.5 - 1)


# ------------------------------------------------------------------------------------------ bad input


def test_probe_image_reasons() -> None:
    assert probe_image(b"", max_pixels=100, min_side=2) == "empty"
    assert probe_image(b"garbage", max_pixels=100, min_side=2) == "corrupt"
    assert probe_image(encoded(picture(0, 1)), max_pixels=100, min_side=2) == "too_small"
    assert probe_image(encoded(picture(0, 11)), max_pixels=100, min_side=2) == "too_large"
    assert probe_image(encoded(picture(0, 10)), max_pixels=100, min_side=2) is None


def test_every_kind_of_bad_input_is_skipped_and_counted_once(tmp_path: Path, tokenizer) -> None:
    base = picture(1, 48)
    jpeg = encoded(base, "JPEG", quality=95)
    rgba = base.convert("RGBA")
    rgba.putalpha(128)
    sixteen = Image.fromarray((np.arange(24 * 24, dtype=np.uint16).reshape(24, 24) * 97).astype(np.uint16))
    good_images = {
        "rgb_jpeg": jpeg,
        "cmyk": encoded(base.convert("CMYK"), "JPEG"),
        "sixteen_bit": encoded(sixteen, "PNG"),
        "palette": encoded(base.convert("P"), "PNG"),
        "alpha": encoded(rgba, "PNG"),
        "gray": encoded(base.convert("L"), "PNG"),
    }
    assert Image.open(io.BytesIO(good_images["sixteen_bit"])).mode.startswith("I")
    good = [
        {"__key__": f"g{i}", "jpg": data, "txt": caption(i).encode()} for i, data in enumerate(good_images.values())
    ]
    bad = [
        {"__key__": "corrupt", "jpg": b"this is not an image", "txt": b"corrupt bytes"},
        {"__key__": "truncated", "jpg": jpeg[: len(jpeg) * 2 // 3], "txt": b"cut short"},
        {"__key__": "zero", "jpg": b"", "txt": b"zero bytes"},
        {"__key__": "tiny", "png": encoded(picture(2, 1)), "txt": b"one pixel"},
        {"__key__": "bomb", "png": huge_blank_png(20_000, 20_000), "txt": b"twenty thousand squared"},
        {"__key__": "emptycap", "jpg": jpeg, "txt": b"   "},
        {"__key__": "latin1", "jpg": jpeg, "txt": "caf\xe9 cr\xe8me".encode("latin-1")},
        {"__key__": "noimage", "txt": b"text only", "json": b"{}"},
        {"__key__": "notext", "jpg": jpeg, "json": b"{}"},
    ]
    assert len(bad[4]["png"]) < 100_000
    write_tar(tmp_path / "00000.tar", [good[0], *bad[:5], good[1], good[2]])
    write_tar(tmp_path / "00001.tar", [good[3], *bad[5:], good[4], good[5]])
    (tmp_path / "00002.tar").write_bytes(b"definitely not a tar archive" * 50)
    shards = [str(tmp_path / f"{i:05d}.tar") for i in range(3)] + [str(tmp_path / "gone.tar")]
    expected = Counter(
        corrupt=2,  # an unreadable header, and a good header over cut-off data (found only by decoding)
        empty=1,
        too_small=1,
        too_large=1,
        caption_empty=1,
        caption_not_utf8=1,
        missing_image=1,
        missing_text=1,
        shard_not_a_tar=1,
        shard_missing=1,
    )
    good_rows = {tuple(r) for r in tokenizer([caption(i) for i in range(6)], max_length=8)["input_ids"].tolist()}
    # Seven places per epoch: six good samples and the truncated one, whose slot is refilled. With the cache on,
    # later epochs replay the shards' records, skips included, and count them again.
    for workers, cache_mb in [(0, 0.0), (2, 0.0), (0, 64.0), (2, 64.0)]:
        s = stream(shards, tokenizer, batch_size=7, workers=workers, shuffle_buffer=4, cache_mb=cache_mb)
        batches = take(s, 2)
        assert all(b["pixel_values"].shape == (7, 3, 16, 16) for b in batches)
        assert all(torch.isfinite(b["pixel_values"]).all() for b in batches)
        for b in batches:
            got = [tuple(r) for r in b["input_ids"].tolist()]
            assert set(got) == good_rows  # only good samples, every one of them, plus one refill
        assert s.stats == Counter({k: 2 * v for k, v in expected.items()})  # two epochs, each counted once
        assert s.state_dict()["stats"] == dict(s.stats) and s.epoch_length == 7
    resampled = stream(shards, tokenizer, batch_size=6, workers=0, shuffle_buffer=0, resampled=True)
    for b in take(resampled, 3):
        assert {tuple(r) for r in b["input_ids"].tolist()} <= good_rows
    assert set(resampled.stats) <= set(expected) and resampled.stats.total() >= 3


def test_skips_are_counted_once_across_ranks_and_workers(tmp_path: Path, tokenizer) -> None:
    samples = [good_sample(i) for i in range(12)]
    for i in (2, 5, 9):
        samples[i]["txt"] = b""
    samples[7]["png"] = b""
    write_tar(tmp_path / "a.tar", samples)
    total: Counter[str] = Counter()
    for rank in range(2):
        s = stream(str(tmp_path / "a.tar"), tokenizer, batch_size=2, workers=2, rank=rank, world_size=2)
        take(s, 2)  # 2 steps × 2 ranks × 2 = the 8 usable samples: exactly one epoch
        total += s.stats
    assert total == Counter(caption_empty=3, empty=1)


# ------------------------------------------------------------------------------ order, ranks, resume


def test_global_order_is_independent_of_world_size_and_workers(tmp_path: Path, tokenizer) -> None:
    shards = write_dataset(tmp_path, 30, 7)
    single = rows(take(stream(shards, tokenizer, batch_size=4, workers=0), 9))  # crosses into epoch 2
    assert len({r[1] for r in single[:30]}) == 30  # one epoch: every sample once
    assert [r[1] for r in single[:4]] != [tuple(tokenizer(caption(i), max_length=8)["input_ids"][0]) for i in range(4)]
    with_workers = rows(take(stream(shards, tokenizer, batch_size=4, workers=2), 9))
    per_rank = [
        rows(take(stream(shards, tokenizer, batch_size=2, workers=w, rank=r, world_size=2), 9))
        for r, w in ((0, 2), (1, 0))
    ]
    for i, (pixels, ids) in enumerate(single):
        assert ids == with_workers[i][1] and torch.equal(pixels, with_workers[i][0])
        step, offset = divmod(i, 4)
        rank, j = offset % 2, offset // 2
        other = per_rank[rank][2 * step + j]
        assert ids == other[1] and torch.equal(pixels, other[0])  # same sample, same crop and flip


def test_epochs_reshuffle_and_reaugment(tmp_path: Path, tokenizer) -> None:
    shards = write_dataset(tmp_path, 12, 4)
    batches = rows(take(stream(shards, tokenizer, batch_size=12, workers=0), 2))
    first, second = batches[:12], batches[12:]
    assert {r[1] for r in first} == {r[1] for r in second}
    assert [r[1] for r in first] != [r[1] for r in second]
    by_id = {ids: pixels for pixels, ids in first}
    assert sum(not torch.equal(by_id[ids], pixels) for pixels, ids in second) > 6  # new random crops
    again = rows(take(stream(shards, tokenizer, batch_size=12, workers=0), 1))
    assert all(torch.equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(first, again, strict=True))
    assert [r[1] for r in rows(take(stream(shards, tokenizer, batch_size=12, workers=0, seed=3), 1))] != [
        r[1] for r in first
    ]


@pytest.mark.parametrize("steps_before", [3, 8])
def test_resume_on_another_world_size_continues_at_the_right_sample(tmp_path: Path, tokenizer, steps_before) -> None:
    shards = write_dataset(tmp_path, 26, 5)
    straight = rows(take(stream(shards, tokenizer, batch_size=4, workers=0), steps_before + 3))
    two = [stream(shards, tokenizer, batch_size=2, workers=1, rank=r, world_size=2) for r in range(2)]
    for s in two:
        take(s, steps_before)
    state = two[0].state_dict()
    assert state["position"] == 4 * steps_before
    resumed = stream(shards, tokenizer, batch_size=4, workers=2)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON checkpoint
    after = rows(take(resumed, 3))
    assert resumed.state_dict()["position"] == 4 * (steps_before + 3)
    for (p1, i1), (p2, i2) in zip(straight[4 * steps_before :], after, strict=True):
        assert i1 == i2 and torch.equal(p1, p2)
    if steps_before == 8:  # past the first epoch: the epoch length travelled with the state
        assert state["epoch_length"] == 26


def test_a_broken_image_is_refilled_from_an_earlier_step_also_after_resume(tmp_path: Path, tokenizer) -> None:
    samples = [good_sample(i) for i in range(20)]
    jpeg = encoded(picture(99, 64), "JPEG")
    samples[9] = {"__key__": "cut", "jpg": jpeg[: len(jpeg) // 2], "txt": caption(99).encode()}
    write_tar(tmp_path / "a.tar", samples)
    shards = str(tmp_path / "a.tar")
    straight = stream(shards, tokenizer, batch_size=4, workers=0, shuffle_buffer=0, shuffle_shards=False)
    rows_straight = rows(take(straight, 4))
    ids = [r[1] for r in rows_straight]
    assert ids[9] == ids[7] and not torch.equal(rows_straight[9][0], rows_straight[7][0])  # its own crop
    assert ids.count(ids[7]) == 2 and tuple(tokenizer(caption(99), max_length=8)["input_ids"][0].tolist()) not in ids
    assert straight.stats == Counter(corrupt=1)
    resumed = stream(shards, tokenizer, batch_size=4, workers=2, shuffle_buffer=0, shuffle_shards=False)
    resumed.load_state_dict({"position": 8})
    again = rows(take(resumed, 2))
    assert all(a[1] == b[1] and torch.equal(a[0], b[0]) for a, b in zip(rows_straight[8:], again, strict=True))
    assert resumed.stats == Counter(corrupt=1)


def test_a_batch_in_pieces_is_the_batch_whatever_the_pieces_and_workers(tmp_path: Path, tokenizer) -> None:
    # Pieces of 3 pairs (the last of each batch of 8 holds 2) built by 1 or 3 workers, on one rank or as rank 1 of
    # 2: the same batches, sample for sample, as whole batches decoded in the training process.
    shards = write_dataset(tmp_path, 60, 7)
    for rank, world in ((0, 1), (1, 2)):
        whole = rows(take(stream(shards, tokenizer, batch_size=8, workers=0, rank=rank, world_size=world), 4))
        for workers in (1, 3):
            s = stream(shards, tokenizer, batch_size=8, piece_size=3, workers=workers, rank=rank, world_size=world)
            pieces = rows(take(s, 4))
            assert all(a[1] == b[1] and torch.equal(a[0], b[0]) for a, b in zip(whole, pieces, strict=True))
            assert s.state_dict()["position"] == 4 * 8 * world


def test_batches_assembled_ahead_are_the_batches_and_count_as_the_loop_takes_them(tmp_path: Path, tokenizer) -> None:
    # pin_memory on a host without CUDA: batches assembled ahead in a thread, in ordinary memory. Skips in every
    # batch (empty captions, broken images): a checkpoint taken after step k must hold step k's position, counts and
    # epoch length, never those of the batch already assembled behind it.
    import threading

    samples = [good_sample(i) for i in range(45)]
    for i in range(0, 45, 5):
        samples[i]["txt"] = b""
    for i in (3, 17, 31):
        jpeg = encoded(picture(i, 32), "JPEG")
        samples[i] = {"__key__": samples[i]["__key__"], "jpg": jpeg[: len(jpeg) // 2], "txt": caption(i).encode()}
    for s in range(0, 45, 9):
        write_tar(tmp_path / f"{s // 9:05d}.tar", samples[s : s + 9])
    shards = str(tmp_path / "{00000..00004}.tar")
    kw = {"batch_size": 8, "piece_size": 3, "workers": 2}
    plain, ahead = stream(shards, tokenizer, pin_memory=False, **kw), stream(shards, tokenizer, pin_memory=True, **kw)
    states = []
    for a, b in zip(plain, ahead, strict=True):
        assert torch.equal(a["pixel_values"], b["pixel_values"]) and torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["attention_mask"], b["attention_mask"])
        time.sleep(0.3)  # for the thread to have assembled the next batch (milliseconds of work)
        states.append((plain.state_dict(), ahead.state_dict(), plain.epoch_length, ahead.epoch_length))
        if len(states) == 7:  # crosses into the second epoch (36 usable samples)
            break
    assert all(p == q and m == n for p, q, m, n in states), states
    # The counts grow step by step (so counting a batch early would show), to the plain stream's after 56 samples.
    assert len({json.dumps(s[1]["stats"], sort_keys=True) for s in states}) >= 5 and states[-1][3] == 36
    assert [s[1]["position"] for s in states] == [8 * (k + 1) for k in range(7)]
    # The thread ends once the stream's iterator is let go of (here when the zip above was).
    threads = [t for t in threading.enumerate() if t.name == "openalign-batch-assembly"]
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)


def test_one_ahead_makes_the_next_result_while_the_caller_uses_this_one_and_raises_its_errors() -> None:
    import threading

    from openalign.train.data import _one_ahead

    started = [threading.Event() for _ in range(4)]
    callers: list[str] = []

    def make() -> int:
        n = len(callers)
        callers.append(threading.current_thread().name)
        started[n].set()
        if n == 2:
            raise ValueError("a broken piece")
        return n

    results = _one_ahead(make)
    assert next(results) == 0
    assert started[1].wait(timeout=30)  # made while the caller holds result 0, without being asked
    assert not started[2].wait(timeout=0.3) and len(callers) == 2  # never more than one ahead
    assert next(results) == 1
    with pytest.raises(ValueError, match="a broken piece"):
        next(results)
    assert set(callers) == {"openalign-batch-assembly"}


def test_batches_are_pinned_when_unset_on_a_gpu_for_batches_that_fit_the_limit() -> None:
    from openalign.train.data import pin_batches

    small = DataConfig(shards="x.tar", batch_size=64, image_size=289)
    large = DataConfig(shards="x.tar", batch_size=16_384, image_size=289)  # 4.1 GB of pixels
    assert pin_batches(small, "cuda") and pin_batches(small, torch.device("cuda", 1))
    assert not pin_batches(large, "cuda") and not pin_batches(small, "cpu")
    # Without a crop size of its own, the model's decides.
    at_model = DataConfig(shards="x.tar", batch_size=2_048)  # 0.51 GB at the paper's 289 px, 25 MB at nano's 64
    assert pin_batches(at_model, "cuda", model_config("nano")) and not pin_batches(at_model, "cuda")
    for setting in (True, False):  # as set, whatever the device and the batch
        for cfg in (small, large):
            explicit = dataclasses.replace(cfg, pin_memory=setting)
            assert pin_batches(explicit, "cpu") is setting and pin_batches(explicit, "cuda") is setting


def test_plain_tars_read_from_their_headers_give_the_batches_tarfile_gives(
    tmp_path: Path, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # JPEGs (sized from their header without PIL) and PNGs (probed by PIL), a broken image and an empty caption.
    samples = [good_sample(i) for i in range(40)]
    for i in range(0, 40, 3):
        samples[i] = {"__key__": samples[i]["__key__"], "jpg": encoded(picture(i), "JPEG"), "txt": caption(i).encode()}
    samples[5]["png"] = samples[5]["png"][:60]
    samples[9]["txt"] = b"  "
    for s in range(0, 40, 8):
        write_tar(tmp_path / f"{s // 8:05d}.tar", samples[s : s + 8])
    shards = str(tmp_path / "{00000..00004}.tar")
    fast = stream(shards, tokenizer, batch_size=6, piece_size=4, workers=2)
    indexed = rows(take(fast, 6))
    monkeypatch.setattr("openalign.train.data.index_samples", lambda url, limit: None)
    slow = stream(shards, tokenizer, batch_size=6, piece_size=4, workers=2)
    read = rows(take(slow, 6))
    assert all(a[1] == b[1] and torch.equal(a[0], b[0]) for a, b in zip(indexed, read, strict=True))
    assert fast.stats == slow.stats == Counter(caption_empty=1, corrupt=1)


def test_a_worker_reads_whole_only_the_images_it_decodes(tmp_path: Path, tokenizer, monkeypatch) -> None:
    from openalign.data.tar_index import MemberRef
    from openalign.train.data import _Reader

    shards = write_dataset(tmp_path, 96, 16)
    plan = stream(shards, tokenizer, batch_size=8, piece_size=4)._plan
    whole: list[tuple[str, int]] = []
    read = MemberRef.read

    def counting(self: MemberRef, limit: int | None = None) -> bytes:
        whole.append((self.path, self.offset))  # the walk reads captions and image heads through a TarWindow
        return read(self, limit)

    monkeypatch.setattr(MemberRef, "read", counting)
    # Worker 1 of 4 builds pieces 1, 5, 9 …: one piece of every other batch.
    pieces = list(itertools.islice(iter(_Reader(plan, 1, 4, in_main_process=True)), 5))
    assert sum(len(p[0]) for p in pieces) == 20
    assert len(whole) == 20 and len(set(whole)) == 20


def test_broken_images_in_several_pieces_are_refilled_by_different_samples(tmp_path: Path, tokenizer) -> None:
    samples = [good_sample(i) for i in range(40)]
    jpeg = encoded(picture(99, 64), "JPEG")
    for i in (17, 21):  # step 2 of batches of 8, in its pieces 0 and 1 (pieces of 3)
        samples[i] = {"__key__": f"cut{i}", "jpg": jpeg[: len(jpeg) // 2], "txt": caption(99).encode()}
    write_tar(tmp_path / "a.tar", samples)
    shards = str(tmp_path / "a.tar")
    order = {"shuffle_buffer": 0, "shuffle_shards": False}
    for workers in (0, 2):
        s = stream(shards, tokenizer, batch_size=8, piece_size=3, workers=workers, **order)
        batch = rows(take(s, 3))[16:]
        ids = [r[1] for r in batch]
        assert len(set(ids)) == 8  # no pair twice in the batch
        earlier = {r[1] for r in rows(take(stream(shards, tokenizer, batch_size=8, workers=0, **order), 2))}
        assert ids[1] in earlier and ids[5] in earlier  # the refills come from before the batch
        assert s.stats == Counter(corrupt=2)


def test_large_jpegs_decoded_in_draft_mode_match_full_decoding(tmp_path: Path, tokenizer) -> None:
    # Photos of 640×480 (img2dataset's keep-ratio sizes) for a 100 px resize: decoded at 1/4 scale in the DCT.
    from openalign.data.synthetic import SyntheticWorld

    world = SyntheticWorld(0, 640)
    samples = [
        {"__key__": f"{i:06d}", "jpg": encoded(world.render(row.scene).resize((640, 480)), "JPEG", quality=90),
         "txt": caption(i).encode()}
        for i, row in enumerate(world.iter_rows(12, 0.0))
    ]  # fmt: skip
    write_tar(tmp_path / "a.tar", samples)
    shards = str(tmp_path / "a.tar")
    kw = {"batch_size": 12, "workers": 0, "image_size": 84, "resize": 100}
    full = take(stream(shards, tokenizer, draft=False, **kw), 1)[0]
    draft = take(stream(shards, tokenizer, **kw), 1)[0]
    assert torch.equal(full["input_ids"], draft["input_ids"])  # the same samples in the same order
    diff = (full["pixel_values"].float() - draft["pixel_values"].float()).abs()
    # The same crops and flips (one seed per sample): only the downscaling differs, DCT then bicubic against
    # bicubic alone (here a mean of 0.8 levels of 255). A crop off by one pixel would make it 4.6, a missed flip 37.
    assert diff.mean() <= 2.0 and torch.quantile(diff.flatten(), 0.99) <= 16, (diff.mean(), diff.max())


def test_batches_do_not_depend_on_which_library_decodes_the_jpegs(
    tmp_path: Path, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # simplejpeg is a speed-up only: with or without it, the same bytes in every batch (half the images draft
    # to 1/2 scale, half decode at full size).
    pytest.importorskip("simplejpeg")
    from openalign.data import transforms
    from openalign.data.synthetic import SyntheticWorld

    world = SyntheticWorld(0, 320)
    sizes = [(320 - 9 * i, 240 - 90 * (i % 2)) for i in range(8)]
    samples = [
        {"__key__": f"{i:06d}", "jpg": encoded(world.render(row.scene).resize(sizes[i]), "JPEG"),
         "txt": caption(i).encode()}
        for i, row in enumerate(world.iter_rows(8, 0.0))
    ]  # fmt: skip
    write_tar(tmp_path / "a.tar", samples)
    shards, kw = str(tmp_path / "a.tar"), {"batch_size": 8, "workers": 0, "image_size": 84, "resize": 100}
    for crop in ("random", "center"):
        fast = take(stream(shards, tokenizer, crop=crop, **kw), 2)
        with monkeypatch.context() as patch:
            patch.setattr(transforms, "_simplejpeg", lambda: None)
            pil = take(stream(shards, tokenizer, crop=crop, **kw), 2)
        for a, b in zip(fast, pil, strict=True):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["pixel_values"], b["pixel_values"])


def test_works_with_spawned_workers(tmp_path: Path, tokenizer) -> None:
    # Spawned (or forkserver) DataLoader workers receive the stream's plan pickled.
    shards = write_dataset(tmp_path, 8, 4)
    s = stream(shards, tokenizer, batch_size=4, workers=0)
    plan = pickle.loads(pickle.dumps(s._plan))
    assert plan.image == {"image_size": 16, "resize": 20, "mean": (0.5,) * 3, "std": (0.5,) * 3}
    direct = rows(take(s, 2))
    spawned = rows(take(TrainStream(plan), 2))
    assert all(a[1] == b[1] and torch.equal(a[0], b[0]) for a, b in zip(direct, spawned, strict=True))


def test_load_state_dict_rejects_garbage(tmp_path: Path, tokenizer) -> None:
    s = stream(write_dataset(tmp_path, 4, 4), tokenizer)
    with pytest.raises(ValueError, match="position"):
        s.load_state_dict({"position": -3})
    s.load_state_dict({"position": 4, "epoch_length": 99, "source": "another data set"})
    assert s.epoch_length is None  # measured on other data: not trusted


def test_resampled_mode_gives_each_rank_its_own_draws(tmp_path: Path, tokenizer) -> None:
    shards = write_dataset(tmp_path, 40, 5)
    runs = [
        rows(take(stream(shards, tokenizer, batch_size=5, workers=0, resampled=True, rank=r, world_size=2), 4))
        for r in (0, 1)
    ]
    again = rows(take(stream(shards, tokenizer, batch_size=5, workers=0, resampled=True, rank=0, world_size=2), 4))
    assert [r[1] for r in runs[0]] == [r[1] for r in again]
    assert [r[1] for r in runs[0]] != [r[1] for r in runs[1]]
    s = stream(shards, tokenizer, batch_size=5, workers=2, resampled=True)
    batches = take(s, 3)
    assert all(b["input_ids"].shape == (5, 8) for b in batches) and s.state_dict()["position"] == 15
    # Pieces of 2, 2 and 1 pairs from 2 workers (each worker's share of a batch differs from step to step).
    s = stream(shards, tokenizer, batch_size=5, piece_size=2, workers=2, resampled=True)
    batches = take(s, 4)
    assert all(b["input_ids"].shape == (5, 8) for b in batches) and s.state_dict()["position"] == 20
    assert all(len({r[1] for r in rows([b])}) > 1 for b in batches)  # filled from several draws


def test_json_caption_field(tmp_path: Path, tokenizer) -> None:
    samples = [
        {"__key__": f"{i}", "png": encoded(picture(i)), "json": json.dumps({"caption": caption(i)}).encode()}
        for i in range(3)
    ]
    samples.append({"__key__": "x", "png": encoded(picture(9)), "json": b"{not json"})
    write_tar(tmp_path / "j.tar", samples)
    s = stream(str(tmp_path / "j.tar"), tokenizer, batch_size=3, workers=0, caption_key="json:caption")
    (batch,) = take(s, 1)
    want = tokenizer([caption(i) for i in range(3)], max_length=8)["input_ids"].tolist()
    assert sorted(batch["input_ids"].tolist()) == sorted(want) and s.stats == Counter(bad_json=1)


def test_no_usable_sample_is_a_clear_error(tmp_path: Path, tokenizer) -> None:
    write_tar(tmp_path / "bad.tar", [{"__key__": "a", "txt": b"no image"}])
    with pytest.raises(ValueError, match="no usable training samples"):
        take(stream(str(tmp_path / "bad.tar"), tokenizer, workers=0), 1)


# -------------------------------------------------------------------------------------------- synthetic


@pytest.fixture(scope="module")
def world_tokenizer():
    from openalign.data.synthetic import SyntheticWorld

    return train_wordpiece((row.caption for row in SyntheticWorld(5, 32).iter_rows(1500)), vocab_size=600)


def synthetic(tokenizer, **kw: object) -> TrainStream:
    rank, world = kw.pop("rank", 0), kw.pop("world_size", 1)
    data = {"source": "synthetic", "image_size": 16, "resize": 20, "max_text_length": 32, "workers": 0, **kw}
    return build_train_stream(from_dict(DataConfig, data), tokenizer, rank=rank, world_size=world, seed=5)


def test_synthetic_source_serves_the_worlds_rows_in_a_world_size_independent_order(world_tokenizer) -> None:
    tokenizer = world_tokenizer
    from openalign.data.synthetic import SyntheticWorld

    world = SyntheticWorld(5, 32)
    size = 10
    single = rows(take(synthetic(tokenizer, batch_size=5, synthetic={"size": size, "image_size": 32}), 4))
    expected = {
        tuple(r)
        for r in tokenizer([world.row(i, 0.25, n_rows=size).caption for i in range(size)], max_length=32)[
            "input_ids"
        ].tolist()
    }
    for epoch in (single[:10], single[10:]):
        assert {r[1] for r in epoch} <= expected and len({r[1] for r in epoch}) == len(expected)
    assert [r[1] for r in single[:10]] != [r[1] for r in single[10:]]  # reshuffled per epoch
    per_rank = [
        rows(
            take(
                synthetic(
                    tokenizer, batch_size=1, workers=w, rank=r, world_size=5, synthetic={"size": size, "image_size": 32}
                ),
                4,
            )
        )
        for r, w in ((0, 0), (1, 0), (2, 2), (3, 0), (4, 1))
    ]
    for i, (pixels, ids) in enumerate(single):
        step, rank = divmod(i, 5)
        assert ids == per_rank[rank][step][1] and torch.equal(pixels, per_rank[rank][step][0])


def test_synthetic_endless_stream_resumes_at_its_position(world_tokenizer) -> None:
    tokenizer = world_tokenizer
    straight = rows(take(synthetic(tokenizer, batch_size=3), 6))
    s = synthetic(tokenizer, batch_size=2, world_size=2, rank=1, workers=1)
    take(s, 3)
    assert s.state_dict()["position"] == 12
    resumed = synthetic(tokenizer, batch_size=6)
    resumed.load_state_dict(s.state_dict())
    after = rows(take(resumed, 1))
    assert all(a[1] == b[1] and torch.equal(a[0], b[0]) for a, b in zip(straight[12:], after, strict=True))
    noisy = synthetic(tokenizer, batch_size=4, resampled=True, synthetic={"noise": 1.0})
    assert take(noisy, 2)[1]["pixel_values"].shape == (4, 3, 16, 16)


# ----------------------------------------------------------------------------------------------- decoded cache


@pytest.mark.parametrize(
    ("options", "all_kept"),
    [
        ({"flip": True}, True),  # random crops of the cached resize, flipped half the time
        ({"crop": "center"}, True),  # the centre crop itself is kept
        ({"cache_mb": 20 * 3 * 20 * 20 / 2**20}, False),  # room for fewer than 20 of 36: the rest decoded every epoch
        ({"workers": 1, "shuffle_buffer": 8}, True),  # a DataLoader worker keeps its own
    ],
)
def test_cached_decodes_give_the_batches_of_decoding_every_epoch(
    tmp_path: Path, tokenizer, monkeypatch, options: dict, all_kept: bool
) -> None:
    import openalign.train.data as train_data
    from openalign.train.data import _Reader

    shards = write_dataset(tmp_path, 36, 12)
    kw = {"batch_size": 9, "workers": 0, **options}
    plain = rows(take(stream(shards, tokenizer, **kw), 12))  # three epochs
    decodes: list[int] = []
    readers: set[_Reader] = set()
    tokenised: list[str] = []
    indexed: list[str] = []
    decode, index_samples = _Reader._decode, train_data.index_samples

    def counting(self: _Reader, record: tuple) -> object:
        decodes.append(1)
        readers.add(self)
        return decode(self, record)

    def counting_tokenizer(texts: list[str], **kw: object) -> dict[str, torch.Tensor]:
        tokenised.extend(texts)
        return tokenizer(texts, **kw)

    def counting_index(url: str, limit: int) -> object:
        indexed.append(url)
        return index_samples(url, limit)

    monkeypatch.setattr(_Reader, "_decode", counting)
    monkeypatch.setattr(train_data, "index_samples", counting_index)
    cached_stream = stream(shards, counting_tokenizer, **{"cache_mb": 64.0, **kw})
    cached = rows(take(cached_stream, 12))
    assert len(cached) == len(plain) == 108
    assert all(a[1] == b[1] and torch.equal(a[0], b[0]) for a, b in zip(plain, cached, strict=True))
    if kw["workers"] == 0:  # a worker process counts in its own memory
        (reader,) = readers
        kept = len(reader.cache)
        assert kept == 36 if all_kept else 0 < kept < 20
        assert len(decodes) == kept + 3 * (36 - kept)
        if all_kept:  # each shard's headers are read once and each caption tokenised once, however many epochs
            assert sorted(indexed) == sorted(set(indexed)) and len(indexed) == 3
            assert sorted(tokenised) == sorted(caption(i) for i in range(36))
        else:  # no room for a shard's records: read every epoch
            assert len(indexed) >= 9
    if options.get("crop") != "center":
        assert len({r[0].numpy().tobytes() for r in cached}) > 100  # crops still differ from epoch to epoch


def test_the_cache_holds_at_most_its_size_and_keys_samples_by_where_they_lie(
    tmp_path: Path, tokenizer, world_tokenizer
) -> None:
    from openalign.data.tar_index import MemberRef
    from openalign.train.data import _Reader

    shards = write_dataset(tmp_path, 36, 12)
    cache_mb = 20 * 3 * 20 * 20 / 2**20
    plan = stream(shards, tokenizer, batch_size=9, cache_mb=cache_mb)._plan
    reader = _Reader(plan, 0, 1, in_main_process=True)
    list(itertools.islice(iter(reader), 8))
    # Images and their captions' token rows share the room; the shards' records have a 32nd of cache_mb.
    images = sum(pixels.nbytes for _, pixels in reader.cache.values())
    token_rows = sum(len(c) + 49 + ids.nbytes + mask.nbytes for c, (ids, mask) in reader.tokens.items())
    assert 0 < len(reader.cache) < 36 and images == len(reader.cache) * 3 * 20 * 20
    assert reader.cache_bytes == images + token_rows <= reader.cache_limit == int(cache_mb * 2**20 * 31 / 32)
    assert plan.source._records == {}  # a shard's 12 records take more than a 32nd of room for 20 small images
    ref = MemberRef("a.tar", 512, 100)
    assert plan.source.cache_key(("a caption", ref)) is ref
    assert plan.source.cache_key(("a caption", b"\xff\xd8")) is None  # bytes from a stream: no stable identity
    assert synthetic(world_tokenizer, synthetic={"size": 10})._plan.source.cache_key(7) == 7
    with pytest.raises(ConfigError, match="cache_mb"):
        from_dict(DataConfig, {"shards": shards, "cache_mb": -1}).validate()
