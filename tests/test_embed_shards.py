"""``openalign embed``: shards (or a table) into clip-retrieval's inference layout, by one process or several
under a real ``torchrun``; resumed after a hard kill; read back by clip-retrieval's readers and our import;
vectors checked against ``embed_images``/``embed_texts`` on images read by the webdataset package."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

import openalign
from conftest import save_tiny_checkpoint
from openalign.cli import main
from openalign.data.shards import write_shards
from openalign.data.sources import BadInput
from openalign.data.transforms import decode_image
from openalign.embed import embed_images, embed_texts
from openalign.pipeline.embed_shards import EmbedShardsConfig, Rank, embed_shards, load_embed_model
from openalign.search.catalog import SearchIndex

ROOT = Path(__file__).resolve().parents[1]
CAPTIONS = ["a red circle", "two blue squares", "a green triangle on grass", "a small yellow star", "big red box"]
BROKEN = b"\xff\xd8\xff\xe0 this is not a jpeg"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny checkpoint and 3 shards (4, 3 and 4 samples); shard 1 also holds an undecodable image."""
    root = tmp_path_factory.mktemp("embed")
    ckpt = save_tiny_checkpoint(root / "ckpt", CAPTIONS * 4, vocab_size=80)
    rng = np.random.default_rng(0)
    samples = [
        {
            "key": f"{i:04d}",
            "jpg": Image.fromarray((rng.random((40, 36, 3)) * 255).astype(np.uint8)),
            "txt": CAPTIONS[i % len(CAPTIONS)],
            "json": {"url": f"https://example.org/{i}.jpg"},
        }
        for i in range(11)
    ]
    shards = root / "shards"
    write_shards(samples[:4], shards, samples_per_shard=4, prefix="a")
    write_shards(samples[4:7], shards, samples_per_shard=4, prefix="b")
    write_shards(samples[7:], shards, samples_per_shard=4, prefix="c")
    with tarfile.open(shards / "b00000.tar", "a") as tar:  # a sample whose image does not decode
        for name, data in (("zz_bad.jpg", BROKEN), ("zz_bad.txt", b"broken")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return {"ckpt": ckpt, "shards": shards, "root": root}


def _spec(world: dict[str, Path]) -> str:
    return str(world["shards"] / "*.tar")


def _files(out: Path) -> dict[str, bytes]:
    """Every output file but embed.json (which names the run's settings) by relative path."""
    return {
        p.relative_to(out).as_posix(): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != "embed.json"
    }


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


def _embed_argv(world: dict[str, Path], out: Path) -> list[str]:
    return ["embed", _spec(world), str(out), "--model", str(world["ckpt"]), "--batch-size", "2", "--dtype", "float32"]


def _one_process(world: dict[str, Path], out: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun worker (OMP_NUM_THREADS=1)
    try:
        assert main([*_embed_argv(world, out), "--quiet"]) == 0
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def single(world: dict[str, Path]) -> Path:
    """The output of one plain process, float32, in batches of 2."""
    out = world["root"] / "single"
    _one_process(world, out)
    return out


def test_torchrun_two_processes_write_what_one_process_writes(
    world: dict[str, Path], single: Path, tmp_path: Path
) -> None:
    double = tmp_path / "two"
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "openalign"]
    done = subprocess.run(
        [*run, *_embed_argv(world, double), "--quiet"], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0/2: embedded 2 parts" in done.stdout and "rank 1/2: embedded 1 parts" in done.stdout
    assert "all 3 parts done: 11 rows" in done.stdout
    one, two = _files(single), _files(double)
    assert sorted(one) == sorted(two) and "img_emb/img_emb_0002.npy" in one
    for name in one:
        assert one[name] == two[name], name
    info = json.loads((double / "embed.json").read_text())
    assert info["complete"] and info["totals"]["rows"] == 11 and sum(info["totals"]["skipped"].values()) == 1


def test_vectors_equal_embed_images_and_embed_texts(world: dict[str, Path], single: Path, one_thread: None) -> None:
    import webdataset as wds

    out = single
    model = openalign.load_model(world["ckpt"])
    tokenizer = openalign.load_tokenizer(world["ckpt"], max_length=model.config.text.max_length)
    for part, shard in enumerate(sorted(world["shards"].glob("*.tar"))):
        images, captions, keys = [], [], []
        for sample in wds.WebDataset(str(shard), shardshuffle=False):  # another project's reader of the shards
            try:
                images.append(decode_image(sample["jpg"]))
            except BadInput:
                continue
            captions.append(sample["txt"].decode())
            keys.append(sample["__key__"])
        want_img = torch.cat([embed_images(model, images[i : i + 2], batch_size=2) for i in range(0, len(images), 2)])
        want_txt = embed_texts(model, tokenizer, captions, batch_size=2)
        got_img = np.load(out / "img_emb" / f"img_emb_{part:04d}.npy")
        got_txt = np.load(out / "text_emb" / f"text_emb_{part:04d}.npy")
        assert got_img.dtype == np.float32 and np.array_equal(got_img, want_img.numpy())
        np.testing.assert_allclose(got_txt, want_txt.numpy(), rtol=0, atol=1e-6)
        meta = pq.read_table(out / "metadata" / f"metadata_{part:04d}.parquet").to_pydict()
        assert meta["image_path"] == keys and meta["caption"] == captions
        assert meta["key"] == [f"{shard.name}/{k}" for k in keys]
        assert meta["url"] == [f"https://example.org/{int(k)}.jpg" for k in keys]
    stats = json.loads((out / "stats" / "stats_0001.json").read_text())
    with pytest.raises(BadInput) as broken:
        decode_image(BROKEN)
    assert stats["rows"] == 3 and stats["skipped"] == {broken.value.reason: 1}


_KILL_AFTER = """
import os, sys
from openalign.pipeline import dedup
from openalign.cli import main
calls, embed = [0], dedup.Embedder.embed
def dying(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] > int(os.environ["KILL_AFTER_BATCHES"]):
        os._exit(9)  # no cleanup, no flush: as a SIGKILL would leave it
    return embed(self, *args, **kwargs)
dedup.Embedder.embed = dying
sys.exit(main(sys.argv[1:]))
"""


def test_a_killed_job_resumes_to_the_same_files(
    world: dict[str, Path], single: Path, tmp_path: Path, one_thread: None
) -> None:
    whole, resumed = single, tmp_path / "resumed"
    # Shard 0 is 2 batches of 2 images; the third batch is shard 1's first: killed there, half through it.
    argv = [sys.executable, "-c", _KILL_AFTER, *_embed_argv(world, resumed), "--quiet"]
    killed = subprocess.run(argv, env={**_env(), "KILL_AFTER_BATCHES": "3"}, capture_output=True, timeout=120)
    assert killed.returncode == 9
    assert (resumed / "metadata" / "metadata_0000.parquet").is_file()
    assert not (resumed / "metadata" / "metadata_0001.parquet").exists()
    first = (resumed / "img_emb" / "img_emb_0000.npy").stat()
    model = load_embed_model(str(world["ckpt"]), None)
    cfg = EmbedShardsConfig(batch_size=2, dtype="float32")
    result = embed_shards(_spec(world), resumed, model, cfg, rank=Rank())
    assert result.already_done == [0] and result.worked == [1, 2] and result.complete
    assert (resumed / "img_emb" / "img_emb_0000.npy").stat().st_mtime_ns == first.st_mtime_ns  # not redone
    assert _files(resumed) == _files(whole)
    assert not [p for p in resumed.rglob("*.tmp")]
    # A part whose outputs are partial (metadata not yet renamed into place) is redone, the others skipped.
    (resumed / "metadata" / "metadata_0002.parquet").unlink()
    (resumed / "img_emb" / "img_emb_0002.npy").write_bytes(b"half a file")
    again = embed_shards(_spec(world), resumed, model, cfg, rank=Rank())
    assert again.worked == [2] and again.already_done == [0, 1] and again.rows == 4
    assert _files(resumed) == _files(whole)
    # Another model, or other settings, cannot resume into this folder.
    with pytest.raises(openalign.config.ConfigError, match="another dtype"):
        embed_shards(_spec(world), resumed, model, EmbedShardsConfig(batch_size=2), rank=Rank())


def test_a_folder_is_resumed_only_by_the_job_that_wrote_it(
    world: dict[str, Path], single: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    import shutil

    model = load_embed_model(str(world["ckpt"]), None)
    cfg = EmbedShardsConfig(batch_size=2, dtype="float32")
    # Every setting that changes a byte is in embed.json, and a refusal names the one that differs.
    copy = tmp_path / "copy"
    shutil.copytree(single, copy)
    for other, named in (
        (EmbedShardsConfig(batch_size=3, dtype="float32"), r"another batch_size \(2 ≠ 3\)"),
        (EmbedShardsConfig(batch_size=2, dtype="float32", allow_outside_root=True), "another allow_outside_root"),
    ):
        with pytest.raises(openalign.config.ConfigError, match=named):
            embed_shards(_spec(world), copy, model, other, rank=Rank())
    # A part counts as done only when its stats carry this job's id: a part another job wrote is redone.
    stats = copy / "stats" / "stats_0001.json"
    stats.write_text(json.dumps({**json.loads(stats.read_text()), "job": "another job"}))
    redone = embed_shards(_spec(world), copy, model, cfg, rank=Rank())
    assert redone.worked == [1] and redone.already_done == [0, 2] and _files(copy) == _files(single)
    # Parts without embed.json say nothing about how they were made: the folder is refused, not adopted.
    (copy / "embed.json").unlink()
    before = _files(copy)
    with pytest.raises(openalign.config.ConfigError, match=r"no embed\.json"):
        embed_shards(_spec(world), copy, model, cfg, rank=Rank())
    assert _files(copy) == before and not (copy / "embed.json").exists()

    # A run that fails before its first part leaves nothing that would refuse the corrected rerun.
    def broken(*args: object, **kwargs: object) -> None:
        raise IndexError("index out of range in self")

    monkeypatch.setattr("openalign.embed.embed_texts", broken)
    for out, made in ((tmp_path / "new", False), (tmp_path / "given", True)):
        if made:
            out.mkdir()
        with pytest.raises(IndexError):
            embed_shards(_spec(world), out, model, cfg, rank=Rank())
        assert out.is_dir() == made and (not made or not list(out.iterdir()))
    monkeypatch.undo()
    fresh = embed_shards(_spec(world), tmp_path / "given", model, EmbedShardsConfig(batch_size=2), rank=Rank())
    assert fresh.complete and fresh.worked == [0, 1, 2]


def test_an_output_holding_the_shards_a_spec_names_is_refused(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    shards = tmp_path / "shards"
    shutil.copytree(world["shards"], shards)
    before = sorted(p.name for p in shards.iterdir())
    for spec in (f"{shards}/*.tar", f"{shards}/{{a,b,c}}00000.tar", f"{shards}/a00000.tar::{shards}/b00000.tar"):
        assert main(["embed", spec, str(shards), "--model", str(world["ckpt"]), "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "holds, the input" in err[0], err
        assert sorted(p.name for p in shards.iterdir()) == before


_KILL_A_WORKER = """
import os, signal, sys
from openalign.pipeline import embed_shards
from openalign.cli import main
make = embed_shards._preparer
def preparer(*args, **kwargs):
    prepare, seen = make(*args, **kwargs), [0]
    def dying(part, event):
        from torch.utils.data import get_worker_info
        seen[0] += 1
        if get_worker_info() is not None and seen[0] == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return prepare(part, event)
    return dying
embed_shards._preparer = preparer
sys.exit(main(sys.argv[1:]))
"""


def test_a_killed_decoding_worker_is_one_line_and_the_rerun_resumes(
    world: dict[str, Path], single: Path, tmp_path: Path, one_thread: None
) -> None:
    out = tmp_path / "out"
    argv = [sys.executable, "-c", _KILL_A_WORKER, *_embed_argv(world, out), "--workers", "2", "--quiet"]
    killed = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=120)
    assert killed.returncode == 2, killed.stderr
    lines = killed.stderr.strip().splitlines()
    assert len(lines) == 1 and "a decoding worker (pid" in lines[0] and "run the command again" in lines[0], lines
    _one_process(world, out)
    assert _files(out) == _files(single)


def test_clip_retrieval_readers_and_index_import_read_the_output(
    world: dict[str, Path], single: Path, tmp_path: Path, one_thread: None
) -> None:
    out = tmp_path / "out"
    assert main(["embed", _spec(world), str(out), "--model", str(world["ckpt"]), "--batch-size", "2", "--quiet"]) == 0
    parts = [np.load(out / "img_emb" / f"img_emb_{i:04d}.npy") for i in range(3)]
    for i, part in enumerate(parts):  # clip-retrieval's own dtype, by default: the float32 vectors, rounded
        assert np.array_equal(part, np.load(single / "img_emb" / f"img_emb_{i:04d}.npy").astype(np.float16))
    vectors = np.concatenate(parts).astype(np.float32)
    tables = [pq.read_table(out / "metadata" / f"metadata_{i:04d}.parquet") for i in range(3)]
    captions = [caption for table in tables for caption in table["caption"].to_pylist()]
    reader = pytest.importorskip("embedding_reader")  # what clip-retrieval's indexing (autofaiss) reads with
    read = reader.EmbeddingReader(
        str(out / "img_emb"), file_format="parquet_npy", meta_columns=["caption"], metadata_folder=str(out / "metadata")
    )
    assert read.count == 11 and read.dimension == vectors.shape[1]
    got, meta = next(iter(read(batch_size=100, start=0, end=read.count, show_progress=False)))
    np.testing.assert_array_equal(got, vectors)
    assert meta["caption"].tolist() == captions
    # openalign's import of clip-retrieval folders: an index queried by one of the vectors finds its row.
    index = tmp_path / "idx"
    assert main(["index", "build", "--embeddings", str(out), "--out", str(index)]) == 0
    stored = np.asarray(SearchIndex.open(index).stores["image"].vectors)
    np.testing.assert_allclose(stored, vectors / np.linalg.norm(vectors, axis=1, keepdims=True), atol=1e-6)


def test_a_table_is_cut_into_row_chunks(world: dict[str, Path], tmp_path: Path) -> None:
    import pyarrow as pa

    rng = np.random.default_rng(3)
    for i in range(5):
        Image.fromarray((rng.random((30, 30, 3)) * 255).astype(np.uint8)).save(tmp_path / f"im{i}.png")
    (tmp_path / "im5.png").write_bytes(BROKEN)
    table = {"image_path": [f"im{i}.png" for i in range(6)], "caption": [CAPTIONS[i % 5] for i in range(6)]}
    pq.write_table(pa.table(table), tmp_path / "crawl.parquet")
    out = tmp_path / "out"
    cfg = EmbedShardsConfig(batch_size=2, dtype="float32", table_chunk_rows=4)
    model = load_embed_model(str(world["ckpt"]), None)
    done = [embed_shards(tmp_path / "crawl.parquet", out, model, cfg, rank=Rank(r, 2)) for r in (1, 0)]
    assert [d.worked for d in done] == [[1], [0]] and not done[0].complete and done[1].complete
    with pytest.raises(BadInput) as broken:
        decode_image(BROKEN)
    assert done[1].totals == {"rows": 5, "skipped": {broken.value.reason: 1}}
    meta = [pq.read_table(out / "metadata" / f"metadata_{i:04d}.parquet").to_pydict() for i in (0, 1)]
    assert [m["key"] for m in meta] == [["000000000", "000000001", "000000002", "000000003"], ["000000004"]]
    images = [Image.open(tmp_path / f"im{i}.png").convert("RGB") for i in range(5)]
    want = embed_images(openalign.load_model(world["ckpt"]), images, batch_size=2).numpy()
    got = np.concatenate([np.load(out / "img_emb" / f"img_emb_{i:04d}.npy") for i in (0, 1)])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_bad_model_and_settings_are_one_line_errors(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def error(*extra: str) -> str:
        capsys.readouterr()
        assert main(["embed", _spec(world), str(tmp_path / "out"), *extra]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    assert "/no/such/model" in error("--model", "/no/such/model")
    assert "either --model" in error()
    assert "no such directory" in error("--embedder", "copy-detector:/no/such/dir")
    assert "nothing to embed" in error("--model", str(world["ckpt"]), "--no-images", "--no-captions")
    assert "dtype" in error("--model", str(world["ckpt"]), "--dtype", "int8")


def test_copy_detector_embeds_as_dedup_does(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], one_thread: None
) -> None:
    from openalign.model.copy_detector import CopyDetector, CopyDetectorConfig
    from openalign.model.io import save_model
    from openalign.pipeline.dedup import load_embedder
    from openalign.search.fingerprint import weights_sha256

    torch.manual_seed(0)
    save_model(CopyDetector(CopyDetectorConfig(image_size=32)).eval(), tmp_path / "detector")
    spec = f"copy-detector:{tmp_path / 'detector'}"
    out = tmp_path / "out"
    argv = ["embed", str(world["shards"] / "a00000.tar"), str(out), "--embedder", spec, "--dtype", "float32"]
    assert main([*argv, "--no-captions", "--quiet"]) == 0
    assert not (out / "text_emb").exists()
    import webdataset as wds

    images = [decode_image(s["jpg"]) for s in wds.WebDataset(str(world["shards"] / "a00000.tar"), shardshuffle=False)]
    embedder = load_embedder(spec)
    assert embedder is not None
    np.testing.assert_allclose(np.load(out / "img_emb" / "img_emb_0000.npy"), embedder.embed(images), atol=1e-6)
    info = json.loads((out / "embed.json").read_text())
    assert info["fingerprint"]["weights"] == weights_sha256(embedder.model)
    capsys.readouterr()
    assert main([*argv, "--quiet"]) == 2  # captions need a text tower
    assert "embeds images only; pass --no-captions" in capsys.readouterr().err


def test_decoding_workers_write_the_in_process_files(
    world: dict[str, Path], single: Path, tmp_path: Path, one_thread: None
) -> None:
    """Two DataLoader workers decode alternate chunks (of 2 events: shard 1's broken image is in one of them);
    the files are those of decoding in the embedding process, rows in the same order."""
    for workers in ("0", "2"):
        out = tmp_path / f"w{workers}"
        assert main([*_embed_argv(world, out), "--workers", workers, "--quiet"]) == 0
        assert _files(out) == _files(single), workers
    assert not list(tmp_path.rglob("*.tmp"))


_PEAK = """
import re, sys
from pathlib import Path
from openalign.pipeline.embed_shards import EmbedShardsConfig, Rank, embed_shards, load_embed_model

def status(field):  # kB
    return int(re.search(field + r":\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1))

shards, detector, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
model = load_embed_model(None, "copy-detector:" + detector, captions=False)
for n, (batch, workers) in enumerate([(2, 0), (2, 1), (int(sys.argv[4]), 0)]):
    cfg = EmbedShardsConfig(batch_size=batch, workers=workers, captions=False)
    embed_shards(shards + "/small.tar", out / f"warm{n}", model, cfg, rank=Rank())  # allocator warm
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the present size
    before = status("VmRSS")
    result = embed_shards(shards + "/big.tar", out / f"big{n}", model, cfg, rank=Rank())
    print(result.rows, (status("VmHWM") - before) * 1024)
"""


def test_memory_is_bounded_by_the_batch_not_the_part(tmp_path: Path) -> None:
    """One shard of 24 smooth 1600x1600 JPEGs (under 200 kB each, 7.7 MB each decoded: 184 MB for the part)
    through the copy detector, which takes decoded images a batch at a time: embedded 2 at a time, the process
    grows by well under half the decoded part, with or without a worker; 24 at a time, it holds the part."""
    from openalign.model.copy_detector import CopyDetector, CopyDetectorConfig
    from openalign.model.io import save_model

    save_model(CopyDetector(CopyDetectorConfig(image_size=32)).eval(), tmp_path / "detector")
    side, count = 1600, 24
    ramp = np.linspace(0, 255, side, dtype=np.float32)
    red, green = np.meshgrid(ramp, ramp)
    pixels = np.stack([red, green, np.full_like(red, 128)], -1)
    image = Image.fromarray(pixels.astype(np.uint8))
    shards = tmp_path / "shards"
    for name, n in (("small", 2), ("big", count)):
        samples = [{"key": f"{i:04d}", "jpg": image, "txt": CAPTIONS[i % 5], "json": {}} for i in range(n)]
        write_shards(samples, shards, samples_per_shard=n, prefix=name)
        (shards / f"{name}00000.tar").rename(shards / f"{name}.tar")
    decoded = count * side * side * 3
    assert (shards / "big.tar").stat().st_size < decoded / 20
    argv = [sys.executable, "-c", _PEAK, str(shards), str(tmp_path / "detector"), str(tmp_path / "out"), str(count)]
    done = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # Each line: rows, and how far the process's peak resident size rose above its size before the run.
    (rows0, grown0), (rows1, grown1), (rows_all, grown_all) = [
        map(int, line.split()) for line in done.stdout.splitlines()
    ]
    assert rows0 == rows1 == rows_all == count
    # With a worker the process also holds the chunks fetched ahead (two per worker) and one arriving, pickled and
    # unpickled at once: ~4 batches of 15 MB, 50-67 MB measured (the most on a loaded machine, where the worker
    # runs ahead), against 227 MB for the part at once.
    assert grown0 < decoded / 2 and grown1 < decoded / 2, (grown0 / 2**20, grown1 / 2**20, grown_all / 2**20)
    assert grown_all > decoded * 3 / 4, (grown0 / 2**20, grown1 / 2**20, grown_all / 2**20)  # a whole part held shows


def test_npy_written_block_by_block_is_what_numpy_saves(tmp_path: Path) -> None:
    from openalign.pipeline.embed_stream import NpyAppender

    rng = np.random.default_rng(1)
    blocks = [rng.standard_normal((n, 7)).astype(np.float32) for n in (3, 0, 5, 1)]
    for dtype in ("float16", "float32"):
        for kept in (blocks, []):
            writer = NpyAppender(tmp_path / f"{dtype}.npy", 7, dtype)
            for block in kept:
                writer.append(block)
            writer.close()
            got = np.load(tmp_path / f"{dtype}.npy")
            want = np.concatenate(kept).astype(dtype) if kept else np.zeros((0, 7), dtype)
            assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
            # rows at their place for a reader that maps the file (as embedding_reader does)
            mapped = np.load(tmp_path / f"{dtype}.npy", mmap_mode="r")
            assert np.array_equal(np.asarray(mapped), want)


def test_a_parquet_rank_reads_only_the_row_groups_of_its_parts(
    world: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    """10 rows of image bytes in row groups of 2, parts of 4 rows: rank 1 of 2 (part 1, rows 4..7) reads row
    groups 2 and 3 and nothing else; the two ranks together write what one process writes."""
    import pyarrow as pa

    rng = np.random.default_rng(5)
    images = [Image.fromarray((rng.random((24, 20, 3)) * 255).astype(np.uint8)) for _ in range(10)]
    encoded = []
    for im in images:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        encoded.append(buf.getvalue())
    encoded[6] = BROKEN
    table = pa.table({"jpg": encoded, "caption": [CAPTIONS[i % 5] for i in range(10)]})
    pq.write_table(table, tmp_path / "crawl.parquet", row_group_size=2)
    read: list[list[int] | None] = []
    iter_batches = pq.ParquetFile.iter_batches

    def spy(self: pq.ParquetFile, *args: object, **kwargs: object) -> object:
        groups = kwargs.get("row_groups")
        read.append(None if groups is None else list(groups))  # type: ignore[call-overload]
        return iter_batches(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    model = load_embed_model(str(world["ckpt"]), None)
    cfg = EmbedShardsConfig(batch_size=2, dtype="float32", table_chunk_rows=4, workers=0)
    one = embed_shards(tmp_path / "crawl.parquet", tmp_path / "one", model, cfg, rank=Rank())
    assert one.complete and one.totals["rows"] == 9 and read == [[0, 1], [2, 3], [4]]
    read.clear()
    ranks = [embed_shards(tmp_path / "crawl.parquet", tmp_path / "two", model, cfg, rank=Rank(r, 2)) for r in (1, 0)]
    assert read == [[2, 3], [0, 1], [4]] and [r.worked for r in ranks] == [[1], [0, 2]]
    assert _files(tmp_path / "two") == _files(tmp_path / "one")
    meta = [pq.read_table(tmp_path / "one" / "metadata" / f"metadata_{i:04d}.parquet").to_pydict() for i in range(3)]
    assert [k for m in meta for k in m["key"]] == [f"{i:09d}" for i in range(10) if i != 6]
    want = embed_images(openalign.load_model(world["ckpt"]), [im for i, im in enumerate(images) if i != 6])
    got = np.concatenate([np.load(tmp_path / "one" / "img_emb" / f"img_emb_{i:04d}.npy") for i in range(3)])
    np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-6)


def test_a_part_without_rows_has_stats_only_and_readers_read_the_rest(
    world: dict[str, Path], tmp_path: Path, one_thread: None
) -> None:
    """Shard 1 of 3 holds only a broken image: its part is done with stats and no files, which
    embedding_reader (npy + parquet, where an empty pair breaks it) and our import read past; a rerun skips it."""
    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("a00000.tar", "c00000.tar"):
        (shards / name).write_bytes((world["shards"] / name).read_bytes())
    with tarfile.open(shards / "b00000.tar", "w") as tar:
        for member, data in (("zz_bad.jpg", BROKEN), ("zz_bad.txt", b"broken")):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = tmp_path / "out"
    model = load_embed_model(str(world["ckpt"]), None)
    cfg = EmbedShardsConfig(batch_size=2, workers=0)
    result = embed_shards(str(shards / "*.tar"), out, model, cfg, rank=Rank())
    assert result.complete and result.totals["rows"] == 8 and result.rows == 8
    assert json.loads((out / "stats" / "stats_0001.json").read_text())["rows"] == 0
    assert sorted(p.name for p in (out / "img_emb").iterdir()) == ["img_emb_0000.npy", "img_emb_0002.npy"]
    assert not (out / "metadata" / "metadata_0001.parquet").exists() and not list(out.rglob("*.tmp"))
    again = embed_shards(str(shards / "*.tar"), out, model, cfg, rank=Rank())
    assert again.worked == [] and again.already_done == [0, 1, 2]
    reader = pytest.importorskip("embedding_reader")
    read = reader.EmbeddingReader(
        str(out / "img_emb"), file_format="parquet_npy", meta_columns=["key"], metadata_folder=str(out / "metadata")
    )
    got, meta = next(iter(read(batch_size=100, start=0, end=read.count, show_progress=False)))
    assert read.count == 8 and meta["key"].tolist()[:1] == ["a00000.tar/0000"]
    parts = [np.load(out / "img_emb" / f"img_emb_{i:04d}.npy") for i in (0, 2)]
    np.testing.assert_array_equal(got, np.concatenate(parts))
    assert main(["index", "build", "--embeddings", str(out), "--out", str(tmp_path / "idx")]) == 0
    assert len(SearchIndex.open(tmp_path / "idx").stores["image"].vectors) == 8
