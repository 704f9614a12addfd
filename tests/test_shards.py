from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from openalign.data.shards import expand_urls, iter_samples, read_samples, read_stats, split_member_name, write_shards


def _image(seed: int, size: tuple[int, int] = (48, 40)) -> Image.Image:
    """A smooth image (JPEG keeps it close) that differs per seed."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0 : size[1], 0 : size[0]]
    phase = rng.uniform(0, 6.28, 3)
    channels = [128 + 100 * np.sin(xx / 9.0 + yy / 13.0 + p) for p in phase]
    return Image.fromarray(np.stack(channels, -1).astype(np.uint8))


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def _samples(n: int) -> list[dict]:
    return [
        {"key": f"{i:06d}", "jpg": _image(i), "txt": f"a caption number {i} ünïcode", "json": {"url": f"https://x/{i}"}}
        for i in range(n)
    ]


def _collect(url: str) -> tuple[list[dict], list[tuple[str, str]]]:
    errors: list[tuple[str, str]] = []
    samples = list(read_samples(url, on_error=lambda reason, detail: errors.append((reason, detail))))
    return samples, errors


def test_round_trip_keys_captions_json_and_images(tmp_path: Path) -> None:
    jpeg = _encoded(_image(100, (30, 20)), "JPEG")
    png_rgba = _encoded(_image(101).convert("RGBA"), "PNG")
    samples = [
        *_samples(5),
        {"key": "jpegbytes", "jpg": jpeg, "txt": "stored unchanged", "json": {"width": 800, "height": 600}},
        {"key": "pngbytes", "jpg": png_rgba, "txt": "re-encoded", "json": {"n": np.int64(7), "x": float("nan")}},
    ]
    paths = write_shards(samples, tmp_path, samples_per_shard=3)
    assert [p.name for p in paths] == ["00000.tar", "00001.tar", "00002.tar"]
    got = [s for p in paths for s in _collect(str(p))[0]]
    assert [s["__key__"] for s in got] == [s["key"] for s in samples]
    by_key = {s["__key__"]: s for s in got}
    for i in range(5):
        s = by_key[f"{i:06d}"]
        assert s["txt"].decode("utf-8") == f"a caption number {i} ünïcode"
        meta = json.loads(s["json"])
        assert meta["url"] == f"https://x/{i}" and meta["key"] == f"{i:06d}"
        assert meta["caption"] == f"a caption number {i} ünïcode"
        decoded = Image.open(io.BytesIO(s["jpg"]))
        assert decoded.format == "JPEG" and decoded.size == (48, 40)
        diff = np.abs(np.asarray(decoded.convert("RGB"), dtype=int) - np.asarray(_image(i), dtype=int))
        assert diff.mean() < 3
    assert by_key["jpegbytes"]["jpg"] == jpeg  # no second lossy encode
    meta = json.loads(by_key["jpegbytes"]["json"])
    # img2dataset's meaning: width/height are the stored JPEG's, the caller's (crawl) sizes are the originals
    assert (meta["width"], meta["height"]) == (30, 20)
    assert (meta["original_width"], meta["original_height"]) == (800, 600)
    assert meta["status"] == "success"
    meta = json.loads(by_key["000000"]["json"])
    assert (meta["width"], meta["height"], meta["original_width"], meta["original_height"]) == (48, 40, 48, 40)
    meta = json.loads(by_key["pngbytes"]["json"])
    assert meta["n"] == 7 and meta["x"] is None
    assert Image.open(io.BytesIO(by_key["pngbytes"]["jpg"])).format == "JPEG"


def test_max_side_and_quality(tmp_path: Path) -> None:
    big = _image(3, (200, 100))
    (path,) = write_shards([{"key": "k", "jpg": big, "txt": "t"}], tmp_path / "a", max_side=64, jpeg_quality=50)
    (sample,) = _collect(str(path))[0]
    assert Image.open(io.BytesIO(sample["jpg"])).size == (64, 32)
    meta = json.loads(sample["json"])
    assert (meta["width"], meta["height"], meta["original_width"], meta["original_height"]) == (64, 32, 200, 100)
    (hi,) = write_shards([{"key": "k", "jpg": big}], tmp_path / "b", jpeg_quality=95)
    (lo,) = write_shards([{"key": "k", "jpg": big}], tmp_path / "c", jpeg_quality=20)
    assert len(_collect(str(lo))[0][0]["jpg"]) < len(_collect(str(hi))[0][0]["jpg"])
    # small images are never upscaled
    (small,) = write_shards([{"key": "k", "jpg": _image(4, (20, 10))}], tmp_path / "d", max_side=64)
    assert Image.open(io.BytesIO(_collect(str(small))[0][0]["jpg"])).size == (20, 10)


def test_bad_samples_are_skipped_and_counted_in_stats(tmp_path: Path) -> None:
    samples = _samples(4)
    samples.insert(1, {"key": "corrupt", "jpg": b"\xff\xd8\xff not really a jpeg"})
    samples.insert(2, {"key": "empty", "jpg": b""})
    samples.insert(3, {"key": "has.dot", "jpg": _image(9)})
    samples.insert(4, {"key": "000000", "jpg": _image(9)})  # duplicate within the shard
    samples.insert(5, {"key": "noimage", "txt": "caption only"})
    samples.append({"key": "badtext", "jpg": _image(9), "txt": b"\xff\xfe"})
    samples.append({"key": "badjson", "jpg": _image(9), "json": {"blob": b"raw"}})
    paths = write_shards(samples, tmp_path, samples_per_shard=100)
    got, errors = _collect(str(paths[0]))
    assert errors == []
    assert [s["__key__"] for s in got] == [f"{i:06d}" for i in range(4)]
    stats = json.loads((tmp_path / "00000_stats.json").read_text())
    assert stats["successes"] == 4 and stats["failed"] == 7 and stats["count"] == 11
    assert stats["failures"] == {
        "bad_json": 1,
        "bad_key": 1,
        "bad_text": 1,
        "corrupt": 1,
        "duplicate_key": 1,
        "empty": 1,
        "missing_image": 1,
    }
    assert stats["bytes"] == paths[0].stat().st_size
    assert read_stats(tmp_path).failed == 7


def test_stats_per_shard_and_totals(tmp_path: Path) -> None:
    samples = _samples(7)
    samples.insert(4, {"key": "bad", "jpg": b"junk"})
    paths = write_shards(samples, tmp_path, samples_per_shard=3, prefix="train-")
    assert [p.name for p in paths] == ["train-00000.tar", "train-00001.tar", "train-00002.tar"]
    per_shard = [json.loads((tmp_path / f"train-{i:05d}_stats.json").read_text()) for i in range(3)]
    assert [s["successes"] for s in per_shard] == [3, 3, 1]
    assert [s["failed"] for s in per_shard] == [0, 1, 0]
    assert per_shard[1]["failures"] == {"corrupt": 1}
    total = read_stats(tmp_path, prefix="train-")
    assert (total.shards, total.successes, total.failed, total.count) == (3, 7, 1, 8)
    assert total.bytes == sum(p.stat().st_size for p in paths)
    assert total.to_dict() == {
        "shards": 3,
        "count": 8,
        "successes": 7,
        "failed": 1,
        "bytes": total.bytes,
        "failures": {"corrupt": 1},
    }


def test_each_tar_has_its_parquet_table_with_one_row_per_stored_sample(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    samples = _samples(5)
    samples[1]["jpg"] = _image(1, (200, 100))  # resized to 64x32 below
    samples[0]["json"]["n"] = 1
    samples[2]["json"] = {"url": "https://x/2", "n": "seven", "extra": {"nested": [1, 2]}}
    for s in samples[3:]:
        s["json"] = {"url": s["json"]["url"], "n": 1, "width": 1600, "height": 1200}  # a crawl's sizes
    samples.insert(2, {"key": "broken", "jpg": b"junk"})  # skipped: no row
    paths = write_shards(samples, tmp_path, samples_per_shard=3, max_side=64)
    assert sorted(p.name for p in tmp_path.glob("*.parquet")) == ["00000.parquet", "00001.parquet"]
    for tar in paths:
        table = pq.read_table(tar.with_suffix(".parquet"))
        first = ["key", "caption", "url", "width", "height", "original_width", "original_height", "status"]
        assert table.column_names[:8] == first
        stored = _collect(str(tar))[0]
        rows = table.to_pylist()
        assert [r["key"] for r in rows] == [s["__key__"] for s in stored]
        for row, sample in zip(rows, stored, strict=True):
            meta = json.loads(sample["json"])
            assert row["caption"] == sample["txt"].decode() == meta["caption"] and row["status"] == "success"
            assert (row["width"], row["height"]) == Image.open(io.BytesIO(sample["jpg"])).size
            assert (row["original_width"], row["original_height"]) == (meta["original_width"], meta["original_height"])
    rows = {r["key"]: r for p in paths for r in pq.read_table(p.with_suffix(".parquet")).to_pylist()}
    assert (rows["000001"]["width"], rows["000001"]["original_width"]) == (64, 200)
    assert (rows["000003"]["width"], rows["000003"]["original_width"]) == (48, 1600)
    # in a shard whose values of a column disagree in kind, or hold objects, they are kept as JSON text
    assert [rows[k]["n"] for k in ("000000", "000001", "000002", "000003")] == ["1", None, "seven", 1]
    assert rows["000002"]["extra"] == '{"nested": [1, 2]}' and rows["000000"]["extra"] is None


def test_writing_is_deterministic(tmp_path: Path) -> None:
    a = write_shards(_samples(4), tmp_path / "a", samples_per_shard=10)
    b = write_shards(_samples(4), tmp_path / "b", samples_per_shard=10)
    assert hashlib.sha256(a[0].read_bytes()).digest() == hashlib.sha256(b[0].read_bytes()).digest()
    assert a[0].with_suffix(".parquet").read_bytes() == b[0].with_suffix(".parquet").read_bytes()
    with tarfile.open(a[0]) as tf:
        members = tf.getmembers()
    assert [m.name for m in members[:3]] == ["000000.jpg", "000000.json", "000000.txt"]
    assert {m.mtime for m in members} == {members[0].mtime} and {m.uid for m in members} == {0}


def test_interrupted_writer_keeps_finished_shards_only(tmp_path: Path) -> None:
    def samples():
        yield from _samples(5)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_shards(samples(), tmp_path, samples_per_shard=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "00000.parquet",
        "00000.tar",
        "00000_stats.json",
        "00001.parquet",
        "00001.tar",
        "00001_stats.json",
    ]


def test_writer_rejects_bad_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="samples_per_shard"):
        write_shards([], tmp_path, samples_per_shard=0)
    with pytest.raises(ValueError, match="jpeg_quality"):
        write_shards([], tmp_path, jpeg_quality=0)
    with pytest.raises(ValueError, match="max_side"):
        write_shards([], tmp_path, max_side=0)
    assert write_shards([], tmp_path) == []


def test_expand_urls(tmp_path: Path) -> None:
    assert expand_urls("d/{00000..00003}.tar") == [f"d/{i:05d}.tar" for i in range(4)]
    assert expand_urls("d/{8..11}.tar") == ["d/8.tar", "d/9.tar", "d/10.tar", "d/11.tar"]
    assert expand_urls("d/{a,b}-{0..1}.tar") == ["d/a-0.tar", "d/a-1.tar", "d/b-0.tar", "d/b-1.tar"]
    assert expand_urls("d/{x{1..2},y}.tar") == ["d/x1.tar", "d/x2.tar", "d/y.tar"]
    assert expand_urls("a.tar,b.tar::c.tar") == ["a.tar", "b.tar", "c.tar"]
    assert expand_urls(["a.tar", "d/{1..2}.tar"]) == ["a.tar", "d/1.tar", "d/2.tar"]
    assert expand_urls("file:///x/a.tar") == ["/x/a.tar"]
    assert expand_urls("pipe:cat a.tar,b.tar") == ["pipe:cat a.tar,b.tar"]
    for name in ("00001.tar", "00000.tar", "00002.tar.gz", "00000_stats.json"):
        (tmp_path / name).write_bytes(b"")
    expected = [str(tmp_path / n) for n in ("00000.tar", "00001.tar", "00002.tar.gz")]
    assert expand_urls(str(tmp_path)) == expected
    assert expand_urls(str(tmp_path / "*.tar*")) == expected
    with pytest.raises(FileNotFoundError, match="no shards match"):
        expand_urls(str(tmp_path / "*.tgz"))
    with pytest.raises(ValueError, match="unbalanced"):
        expand_urls("d/{0..3.tar")
    with pytest.raises(ValueError, match="empty"):
        expand_urls([])


def test_split_member_name_follows_webdataset() -> None:
    assert split_member_name("dir/000123.JPG") == ("dir/000123", "jpg")
    assert split_member_name("./k.seg.png") == ("k", "seg.png")
    assert split_member_name("README") is None


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    return write_shards(_samples(6), tmp_path / "src", samples_per_shard=100)[0]


def test_missing_and_not_a_tar_are_reported(tmp_path: Path) -> None:
    samples, errors = _collect(str(tmp_path / "nope.tar"))
    assert samples == [] and [e[0] for e in errors] == ["missing"]
    (tmp_path / "junk.tar").write_bytes(b"this is not a tar file" * 100)
    samples, errors = _collect(str(tmp_path / "junk.tar"))
    assert samples == [] and [e[0] for e in errors] == ["not_a_tar"]
    assert "\n" not in errors[0][1]
    samples, errors = _collect("https://example.com/a.tar")
    assert samples == [] and [e[0] for e in errors] == ["unsupported_url"]


@pytest.mark.parametrize(
    ("cut", "kept"),
    [
        ("inside_data", 2),  # inside 000002.jpg's data
        ("member_boundary", 2),  # right before 000002.txt: clean cut, no end-of-archive marker
        ("inside_header", 2),  # half of 000002.txt's header
        ("before_end_marker", 5),  # all members, no end marker: the last sample may be incomplete
    ],
)
def test_truncated_tar_keeps_complete_samples(shard: Path, tmp_path: Path, cut: str, kept: int) -> None:
    data = shard.read_bytes()
    with tarfile.open(shard) as tf:
        members = {m.name: m for m in tf.getmembers()}
    last = members["000005.txt"]
    offset = {
        "inside_data": members["000002.jpg"].offset_data + 100,
        "member_boundary": members["000002.txt"].offset,
        "inside_header": members["000002.txt"].offset + 256,
        "before_end_marker": last.offset_data + 512,
    }[cut]
    path = tmp_path / "cut.tar"
    path.write_bytes(data[:offset])
    samples, errors = _collect(str(path))
    assert [s["__key__"] for s in samples] == [f"{i:06d}" for i in range(kept)]
    assert [e[0] for e in errors] == ["truncated"]
    assert all(set(s) == {"__key__", "__url__", "jpg", "json", "txt"} for s in samples)


@pytest.mark.parametrize(("member", "dropped"), [("000002.json", {"000002"}), ("000003.jpg", {"000002", "000003"})])
def test_corrupt_member_header_is_skipped(shard: Path, tmp_path: Path, member: str, dropped: set[str]) -> None:
    data = bytearray(shard.read_bytes())
    with tarfile.open(shard) as tf:
        offset = tf.getmember(member).offset
    data[offset : offset + 100] = b"x" * 100
    path = tmp_path / "bad.tar"
    path.write_bytes(bytes(data))
    samples, errors = _collect(str(path))
    # the lost member's sample is dropped; when the damage sits between two keys both neighbours go
    assert [s["__key__"] for s in samples] == [f"{i:06d}" for i in range(6) if f"{i:06d}" not in dropped]
    assert [e[0] for e in errors] == ["corrupt"]
    assert all(set(s) == {"__key__", "__url__", "jpg", "json", "txt"} for s in samples)


def test_gzip_and_pipe_urls(shard: Path, tmp_path: Path) -> None:
    import gzip

    gz = tmp_path / "s.tar.gz"
    gz.write_bytes(gzip.compress(shard.read_bytes()))
    assert [s["__key__"] for s in _collect(str(gz))[0]] == [f"{i:06d}" for i in range(6)]
    samples, errors = _collect(f"pipe:cat {shard}")
    assert len(samples) == 6 and errors == []
    samples, errors = _collect(f"pipe:cat {tmp_path / 'missing.tar'}")
    assert samples == [] and "pipe_failed" in [e[0] for e in errors]


def test_iter_samples_goes_on_after_a_bad_shard(shard: Path, tmp_path: Path) -> None:
    errors: list[tuple[str, str]] = []
    spec = [str(shard), str(tmp_path / "gone.tar"), str(shard)]
    keys = [s["__key__"] for s in iter_samples(spec, on_error=lambda r, d: errors.append((r, d)))]
    assert len(keys) == 12 and [e[0] for e in errors] == ["missing"]


def test_webdataset_reads_our_shards(tmp_path: Path) -> None:
    wds = pytest.importorskip("webdataset")
    write_shards(_samples(7), tmp_path, samples_per_shard=3)
    dataset = wds.WebDataset(str(tmp_path / "{00000..00002}.tar"), shardshuffle=False).decode("pil")
    got = list(dataset)
    assert [s["__key__"] for s in got] == [f"{i:06d}" for i in range(7)]
    assert got[3]["txt"] == "a caption number 3 ünïcode"
    assert got[3]["json"]["url"] == "https://x/3"
    assert got[3]["jpg"].size == (48, 40)


# --------------------------------------------------------------------------------------------------
# openalign shard


def _run_cli(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from openalign.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _read_all(out: Path) -> list[dict]:
    return [s for url in expand_urls(str(out)) for s in _collect(url)[0]]


def test_cli_shard_image_folder_with_sidecars(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "photos"
    (src / "sub").mkdir(parents=True)
    _image(1, (300, 200)).save(src / "cat.png")
    (src / "cat.txt").write_text("a cat on a mat\n")
    (src / "cat.json").write_text(json.dumps({"license": "cc-by"}))
    _image(2).save(src / "sub" / "dog.jpg", quality=90)
    (src / "sub" / "dog.txt").write_text("a dog")
    (src / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    (src / "broken.txt").write_text("never stored")
    _image(3).save(src / "nocaption.jpg")
    code, out, _ = _run_cli("shard", str(src), str(tmp_path / "out"), "--max-side", "100", "--quiet", capsys=capsys)
    assert code == 0 and "wrote 2 samples in 1 shards" in out and "corrupt 1" in out and "missing_caption 1" in out
    samples = {json.loads(s["json"])["filename"]: s for s in _read_all(tmp_path / "out")}
    assert set(samples) == {"cat.png", "sub/dog.jpg"}
    cat = samples["cat.png"]
    assert cat["txt"] == b"a cat on a mat" and json.loads(cat["json"])["license"] == "cc-by"
    assert Image.open(io.BytesIO(cat["jpg"])).size == (100, 67)
    stats = read_stats(tmp_path / "out")
    assert stats.failures == {"corrupt": 1, "missing_caption": 1} and stats.count == 4


def test_cli_shard_image_folder_with_captions_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "photos"
    src.mkdir()
    for i in range(3):
        _image(i).save(src / f"{i}.jpg")
    (tmp_path / "captions.csv").write_text('filename,caption\n0.jpg,"zero, with a comma"\n1.jpg,1920\n')
    code, out, _ = _run_cli(
        "shard", str(src), str(tmp_path / "out"), "--captions", str(tmp_path / "captions.csv"), "--quiet", capsys=capsys
    )
    assert code == 0 and "missing_caption 1" in out  # 2.jpg has no row
    got = {json.loads(s["json"])["filename"]: s["txt"].decode() for s in _read_all(tmp_path / "out")}
    assert got == {"0.jpg": "zero, with a comma", "1.jpg": "1920"}


def test_cli_shard_parquet_with_image_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    images = [_encoded(_image(i), "PNG") for i in range(4)]
    table = pa.table(
        {
            "key": ["a", "b", "c", "d"],
            "text": ["first", "second", "third", "fourth"],
            "image": [{"bytes": images[0], "path": "x.png"}, {"bytes": images[1], "path": None}, None, None],
            "jpg": [None, None, images[2], b"garbage"],
            "score": [0.5, 0.25, 1.0, 2.0],
        }
    )
    pq.write_table(table, tmp_path / "pairs.parquet")
    code, out, _ = _run_cli("shard", str(tmp_path / "pairs.parquet"), str(tmp_path / "out"), "--quiet", capsys=capsys)
    assert code == 0 and "corrupt 1" in out
    got = _read_all(tmp_path / "out")
    assert [s["__key__"] for s in got] == ["a", "b", "c"]
    shard_table = pq.read_table(tmp_path / "out" / "00000.parquet")
    assert shard_table.column("key").to_pylist() == ["a", "b", "c"]
    assert shard_table.column("score").to_pylist() == [0.5, 0.25, 1.0]
    assert [s["txt"].decode() for s in got] == ["first", "second", "third"]
    meta = json.loads(got[2]["json"])
    assert meta["score"] == 1.0 and "jpg" not in meta and "image" not in meta
    assert np.abs(np.asarray(Image.open(io.BytesIO(got[1]["jpg"])), dtype=int) - np.asarray(_image(1))).mean() < 3


def test_cli_shard_synthetic_corpus_keeps_metadata(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import pyarrow.parquet as pq

    from openalign.data.synthetic import write_corpus

    metadata = write_corpus(tmp_path / "corpus", 120, seed=0, test_duplicates=2)
    rows = pq.read_table(metadata).to_pylist()
    (tmp_path / "corpus" / rows[5]["image_path"]).unlink()  # a download that went missing
    code, out, _ = _run_cli(
        "shard", str(metadata), str(tmp_path / "out"), "--samples-per-shard", "50", "--quiet", capsys=capsys
    )
    assert code == 0 and "wrote 119 samples in 3 shards" in out and "missing_file 1" in out
    got = _read_all(tmp_path / "out")
    assert [s["__key__"] for s in got] == [r["key"] for i, r in enumerate(rows) if i != 5]
    by_key = {r["key"]: r for r in rows}
    for s in got:
        row, meta = by_key[s["__key__"]], json.loads(s["json"])
        assert s["txt"].decode() == row["caption"]
        sizes = {"width", "height"}
        assert {k: meta[k] for k in row if k not in sizes} == {k: v for k, v in row.items() if k not in sizes}
        # the crawl's sizes become the originals; width/height are the stored JPEG's, as in img2dataset
        assert (meta["original_width"], meta["original_height"]) == (row["width"], row["height"])
        assert (meta["width"], meta["height"]) == Image.open(io.BytesIO(s["jpg"])).size
        assert hashlib.sha256(s["jpg"]).hexdigest() == row["sha256"]  # JPEG bytes stored unchanged
    # the same corpus written through the CSV form of the table gives the same samples
    import pyarrow.csv as pcsv

    pcsv.write_csv(pq.read_table(metadata), tmp_path / "corpus" / "metadata.csv")
    csv_args = ["shard", str(tmp_path / "corpus" / "metadata.csv"), str(tmp_path / "csv"), "--quiet"]
    code, _, _ = _run_cli(*csv_args, capsys=capsys)
    assert code == 0
    assert [s["__key__"] for s in _read_all(tmp_path / "csv")] == [s["__key__"] for s in got]


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "no such input"),
        ("no_caption_column", "no caption column"),
        ("no_image_column", "no image bytes column"),
        ("bad_quality", "jpeg_quality"),
        ("not_empty", "already holds"),
    ],
)
def test_cli_shard_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: str, message: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = tmp_path / "t.parquet"
    columns = {"caption": ["x"], "jpg": [_encoded(_image(0), "PNG")]}
    if setup == "no_caption_column":
        columns.pop("caption")
    if setup == "no_image_column":
        columns.pop("jpg")
    pq.write_table(pa.table(columns), table)
    out = tmp_path / "out"
    if setup == "not_empty":
        write_shards(_samples(1), out)
    args = ["shard", str(tmp_path / "nope.parquet" if setup == "missing" else table), str(out), "--quiet"]
    if setup == "bad_quality":
        args += ["--jpeg-quality", "0"]
    code, _, err = _run_cli(*args, capsys=capsys)
    assert code == 2 and err.startswith("openalign shard: error:") and message in err
    assert err.count("\n") == 1
