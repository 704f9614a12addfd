"""`openalign dedup` end to end: each embedder (npy, copy-detector:DIR, align:DIR), the outputs, the errors."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from openalign.cli import main
from openalign.config import ConfigError
from openalign.data.synthetic import SyntheticWorld
from openalign.pipeline.dedup import parse_embedder

THRESHOLD = 0.975


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _brute(train: np.ndarray, test: np.ndarray, threshold: float = THRESHOLD) -> set[tuple[int, int]]:
    """Every (train row, test row) whose cosine exceeds the threshold, by comparing all pairs."""
    cos = _unit(train).astype(np.float64) @ _unit(test).astype(np.float64).T
    return {(int(i), int(j)) for i, j in zip(*np.nonzero(cos > threshold), strict=True)}


def _pairs(out: Path) -> list[dict]:
    return pq.read_table(out / "duplicates.parquet").to_pylist()


# --------------------------------------------------------------------------------------------------
# --embedder npy


def test_npy_embedder_finds_exactly_the_brute_force_pairs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rng = np.random.default_rng(4)
    centres = rng.standard_normal((6, 32))
    train = centres[rng.integers(0, 6, 400)] + 0.8 * rng.standard_normal((400, 32))
    test = centres[rng.integers(0, 6, 80)] + 0.8 * rng.standard_normal((80, 32))
    # Copies at a range of distances, some on each side of the threshold, unnormalised on purpose.
    src = rng.choice(400, 30, replace=False)
    test[:30] = 3.0 * train[src] + rng.uniform(0.3, 1.3, (30, 1)) * rng.standard_normal((30, 32))
    truth = _brute(train, test)
    assert 5 < len(truth) < 30  # the planted copies straddle the threshold
    np.save(tmp_path / "train.npy", train.astype(np.float32))
    np.save(tmp_path / "test.npy", test.astype(np.float32))
    out = tmp_path / "out"
    argv = ["dedup", str(tmp_path / "train.npy"), str(tmp_path / "test.npy"), str(out), "--embedder", "npy"]
    assert main([*argv, "--clusters", "8", "--quiet"]) == 0
    pairs = _pairs(out)
    assert {(p["train_idx"], p["test_idx"]) for p in pairs} == truth
    with open(out / "duplicates.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {(int(r["train_idx"]), int(r["test_idx"])) for r in rows} == truth
    assert {(r["decided_by"], r["proposed_by"]) for r in rows} == {("embedding", "search")}
    assert json.loads((out / "stats.json").read_text())["duplicate_pairs"] == len(rows)
    assert json.loads((out / "drop.json").read_text()) == sorted({i for i, _ in truth})
    assert f"{len(truth)} near-duplicate pairs" in capsys.readouterr().out


def test_npy_with_keys_and_metadata(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    train = _unit(rng.standard_normal((60, 16)))
    test = _unit(rng.standard_normal((10, 16)))
    test[3] = train[7]
    np.save(tmp_path / "train.npy", train)
    np.save(tmp_path / "test.npy", test)
    keys = [f"img{i:03d}" for i in range(60)]
    (tmp_path / "keys.json").write_text(json.dumps(keys))
    pq.write_table(pa.table({"key": keys, "caption": [f"c{i}" for i in range(60)]}), tmp_path / "meta.parquet")
    out = tmp_path / "out"
    argv = ["dedup", str(tmp_path / "train.npy"), str(tmp_path / "test.npy"), str(out), "--quiet"]
    argv += ["--train-keys", str(tmp_path / "keys.json"), "--metadata", str(tmp_path / "meta.parquet")]
    assert main([*argv, "--metadata-out", str(tmp_path / "kept.parquet")]) == 0
    assert json.loads((out / "drop.json").read_text()) == ["img007"]
    kept = pq.read_table(tmp_path / "kept.parquet").column("key").to_pylist()
    assert len(kept) == 59 and "img007" not in kept
    assert json.loads((out / "stats.json").read_text())["metadata"]["rows_removed"] == 1


# --------------------------------------------------------------------------------------------------
# --embedder copy-detector:DIR


def _scene_folders(root: Path) -> tuple[Path, Path, set[tuple[str, str]]]:
    """24 distinct synthetic scenes as train images; the test folder holds exact copies of three of them
    (lossless PNG, so their pixels and embeddings are the same) and four scenes of its own."""
    world = SyntheticWorld(seed=11, image_size=32)
    train_dir, test_dir = root / "train", root / "test"
    (train_dir / "sub").mkdir(parents=True)
    test_dir.mkdir()
    for i in range(24):
        world.render(world.scene(i)).save(train_dir / ("sub" if i % 3 == 0 else ".") / f"s{i:02d}.png")
    (train_dir / "broken.png").write_bytes(b"not an image")
    planted = {("sub/s03", "copy_a.png"), ("s10", "copy_b.png"), ("s17", "copy_c.png")}
    for key, name in planted:
        Image.open(train_dir / f"{key}.png").save(test_dir / name)
    for i in range(4):
        world.render(world.scene(i, split="retrieval")).save(test_dir / f"other{i}.png")
    return train_dir, test_dir, {(key, Path(name).stem) for key, name in planted}


def test_copy_detector_trained_on_the_command_line_finds_the_planted_copies(tmp_path: Path, capsys) -> None:
    train_dir, test_dir, planted = _scene_folders(tmp_path)
    detector = tmp_path / "detector"
    argv = ["copy-detector", "train", str(train_dir), str(detector), "--image-size", "32", "--steps", "3"]
    assert main([*argv, "--batch-size", "8", "--warmup-steps", "1", "--quiet"]) == 0
    said = capsys.readouterr().out
    assert "trained 3 steps" in said and "24 distinct images" in said and "1 unreadable: corrupt 1" in said
    meta = json.loads((detector / "config.json").read_text())
    assert meta["architecture"] == "copy_detector" and meta["train"]["skipped"] == {"corrupt": 1}

    out = tmp_path / "out"
    argv = ["dedup", str(train_dir), str(test_dir), str(out), "--embedder", f"copy-detector:{detector}", "--quiet"]
    assert main(argv) == 0
    pairs = _pairs(out)
    found = {(p["train_key"], p["test_key"]) for p in pairs}
    assert planted <= found
    # Exact copies embed to the same point; nothing else is that close.
    assert {(p["train_key"], p["test_key"]) for p in pairs if p["cosine"] > 0.9999} == planted
    stats = json.loads((out / "stats.json").read_text())
    assert stats["train_n"] == 24 and stats["test_n"] == 7 and stats["images_skipped"]["train"] == {"corrupt": 1}
    assert np.load(out / "train_emb.npy").shape == (24, meta["model"]["embed_dim"])
    assert len(json.loads((out / "test_keys.json").read_text())) == 7


def test_copy_detector_train_names_the_reasons_it_skipped(tmp_path: Path, capsys) -> None:
    world = SyntheticWorld(seed=3, image_size=32)
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(6):
        world.render(world.scene(i)).save(folder / f"s{i}.png")
    (folder / "text.png").write_bytes(b"not an image")
    (folder / "empty.png").write_bytes(b"")
    whole = (folder / "s0.png").read_bytes()
    (folder / "cut.png").write_bytes(whole[: len(whole) // 2])  # a truncated file
    argv = ["copy-detector", "train", str(folder), str(tmp_path / "det"), "--image-size", "32", "--steps", "1"]
    assert main([*argv, "--batch-size", "4", "--warmup-steps", "0", "--quiet"]) == 0
    assert "(skipped 3 unreadable: corrupt 2, empty 1)" in capsys.readouterr().out


def test_copy_detector_trains_from_shards(tmp_path: Path) -> None:
    from openalign.data.shards import write_shards
    from openalign.pipeline.copy_detector import CopyDetectorTrainConfig, train_copy_detector_from_source

    world = SyntheticWorld(seed=2, image_size=32)
    samples = [{"key": f"{i:04d}", "jpg": world.render(world.scene(i)), "txt": "x", "json": {}} for i in range(10)]
    write_shards(samples, tmp_path / "shards", samples_per_shard=4)
    cfg = CopyDetectorTrainConfig(image_size=32, steps=2, batch_size=4, warmup_steps=0)
    run = train_copy_detector_from_source(str(tmp_path / "shards" / "{00000..00002}.tar"), tmp_path / "det", cfg)
    assert run.steps == 2 and run.images_used == 10 and run.skipped == {}
    assert (tmp_path / "det" / "model.safetensors").is_file()


# --------------------------------------------------------------------------------------------------
# --embedder align:DIR (and its older spelling, --model)


def test_align_embedder_embeds_a_folder(tmp_path: Path, tiny_model) -> None:
    from openalign.model.io import save_model

    save_model(tiny_model, tmp_path / "ckpt")
    rng = np.random.default_rng(0)
    train_dir, test_dir = tmp_path / "train", tmp_path / "test"
    (train_dir / "sub").mkdir(parents=True)
    test_dir.mkdir()
    for i in range(12):
        pixels = (rng.random((40, 40, 3)) * 255).astype(np.uint8)
        Image.fromarray(pixels).save(train_dir / ("sub" if i % 2 else ".") / f"im{i}.png")
    Image.open(train_dir / "sub" / "im3.png").save(test_dir / "copy.png")  # an exact duplicate
    Image.fromarray((rng.random((40, 40, 3)) * 255).astype(np.uint8)).save(test_dir / "other.png")
    for flags in (["--embedder", f"align:{tmp_path / 'ckpt'}"], ["--model", str(tmp_path / "ckpt")]):
        out = tmp_path / f"out{len(flags[0])}"
        assert main(["dedup", str(train_dir), str(test_dir), str(out), *flags, "--quiet"]) == 0
        assert "sub/im3" in json.loads((out / "drop.json").read_text())
        assert {("sub/im3", "copy")} <= {(p["train_key"], p["test_key"]) for p in _pairs(out)}
        assert np.load(out / "train_emb.npy").shape == (12, tiny_model.embed_dim)


def test_align_embedder_reads_webdataset_shards(tmp_path: Path, tiny_model) -> None:
    from openalign.data.shards import iter_samples, write_shards
    from openalign.model.io import save_model

    save_model(tiny_model, tmp_path / "ckpt")
    rng = np.random.default_rng(1)
    images = [Image.fromarray((rng.random((36, 36, 3)) * 255).astype(np.uint8)) for _ in range(6)]
    samples = [{"key": f"{i:04d}", "jpg": im, "txt": f"image {i}", "json": {}} for i, im in enumerate(images)]
    write_shards(samples, tmp_path / "shards", samples_per_shard=4)
    (tmp_path / "test").mkdir()
    spec = str(tmp_path / "shards" / "{00000..00001}.tar")
    stored = {s["__key__"]: s["jpg"] for s in iter_samples(spec)}
    for key in ("0002", "0005"):  # the very images the shards hold, as test images
        (tmp_path / "test" / f"t{key}.jpg").write_bytes(stored[key])
    out = tmp_path / "out"
    argv = ["dedup", spec, str(tmp_path / "test"), str(out), "--embedder", f"align:{tmp_path / 'ckpt'}", "--quiet"]
    assert main(argv) == 0
    assert {("0002", "t0002"), ("0005", "t0005")} <= {(p["train_key"], p["test_key"]) for p in _pairs(out)}
    assert json.loads((out / "stats.json").read_text())["train_n"] == 6


# --------------------------------------------------------------------------------------------------
# Errors


def test_embedder_specs_parse_in_one_place(tmp_path: Path) -> None:
    assert str(parse_embedder("npy")) == "npy"
    spec = parse_embedder(f"copy-detector:{tmp_path}")
    assert spec.kind == "copy-detector" and spec.path == tmp_path
    assert parse_embedder("align:/no/such/dir", check_dir=False).kind == "align"
    for bad, needle in [
        ("clip:x", "expected npy, copy-detector:DIR or align:DIR"),
        ("copy-detector", "needs a model directory"),
        ("align:", "needs a model directory"),
        ("npy:x", "npy takes no directory"),
        ("align:/no/such/dir", "no such directory"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            parse_embedder(bad)


@pytest.mark.parametrize(
    ("embedder", "needle"),
    [
        ("clip:model", "expected npy, copy-detector:DIR or align:DIR"),
        ("copy-detector:{tmp}/missing", "no such directory"),
        ("copy-detector:{tmp}/ckpt", "holds an ALIGN dual encoder, not a copy detector"),
        ("npy", "not a .npy embeddings file; pass --embedder"),
    ],
)
def test_bad_embedders_are_one_line_errors(tmp_path: Path, tiny_model, capsys, embedder: str, needle: str) -> None:
    from openalign.model.io import save_model

    save_model(tiny_model, tmp_path / "ckpt")
    (tmp_path / "images").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "images" / "a.png")
    images = str(tmp_path / "images")
    argv = ["dedup", images, images, str(tmp_path / "out"), "--embedder", embedder.format(tmp=tmp_path), "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("openalign dedup: error:") and needle in err and "\n" not in err


def test_bad_embedder_from_a_shell_has_no_traceback(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.ones((3, 4), np.float32))
    argv = ["dedup", str(tmp_path / "a.npy"), str(tmp_path / "a.npy"), str(tmp_path / "out"), "--embedder", "clip"]
    done = subprocess.run([sys.executable, "-m", "openalign.cli", *argv], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and "embedder 'clip'" in done.stderr
