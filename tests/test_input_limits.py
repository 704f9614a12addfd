"""No input file can drive a stage out of memory or out of its image root.

Reads of devices, FIFOs and huge files run the real CLI in a subprocess under an address-space limit
(RLIMIT_AS), so a regression fails with a MemoryError or a kill instead of exhausting the machine, and
under a timeout, so a FIFO opened for reading fails the test instead of hanging it.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import openalign
from conftest import save_tiny_checkpoint
from openalign.cli import main
from openalign.data.sources import (
    BadInput,
    ImageRoot,
    open_source,
    read_file,
    read_samples,
    resolve_image_path,
)

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs and /dev/zero")

# Address space for a child, far below what reading /dev/zero or a 30 GB file would take: 2 GB for shard;
# commands that load torch and a model (index build, dedup) map about 2.2 GB before reading anything.
MEMORY_LIMIT = 2 * 2**30
MODEL_MEMORY_LIMIT = 4 * 2**30
HUGE = 30 * 2**30  # a sparse file: no disk, but os.stat and a whole read see 30 GB


def _image(i: int, size: tuple[int, int] = (24, 20)) -> Image.Image:
    rng = np.random.default_rng(i)
    return Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype(np.uint8))


def _jpeg(i: int, size: tuple[int, int] = (24, 20)) -> bytes:
    buf = io.BytesIO()
    _image(i, size).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _sparse(path: Path, size: int = HUGE) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def _table(path: Path, image_paths: dict[str, str]) -> Path:
    keys = list(image_paths)
    pq.write_table(
        pa.table({"key": keys, "caption": [f"caption {k}" for k in keys], "image_path": list(image_paths.values())}),
        path,
    )
    return path


def _add_members(tf: tarfile.TarFile, members: list[tuple[str, bytes]]) -> None:
    for name, data in members:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))


def _cli_limited(*args: str, limit: int = MEMORY_LIMIT) -> subprocess.CompletedProcess[str]:
    """``openalign ARGS`` in a child process that cannot map more than ``limit`` bytes."""
    code = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))\n"
        "from openalign.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    src = str(Path(openalign.__file__).resolve().parents[1])
    # One malloc arena and one OpenMP thread: their reserved address space would otherwise grow with the cores.
    env = {**os.environ, "PYTHONPATH": src, "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=240, env=env, check=False
    )


def _tar_images(out: Path) -> dict[str, bytes]:
    """The stored image of every sample in the shards of ``out`` by key, read with tarfile itself rather than
    our reader."""
    images = {}
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tf:
            for member in tf.getmembers():
                handle = tf.extractfile(member)
                if member.name.endswith(".jpg") and handle is not None:
                    images[member.name.split(".")[0]] = handle.read()
    return images


def _tar_keys(out: Path) -> list[str]:
    return list(_tar_images(out))


def _failures(out: Path) -> dict[str, int]:
    totals: Counter[str] = Counter()
    for stats in out.glob("*_stats.json"):
        totals.update(json.loads(stats.read_text())["failures"])
    return dict(totals)


@pytest.fixture
def crawl(tmp_path: Path) -> Path:
    """``crawl/img`` with two good images, a FIFO and a 30 GB sparse file named like images, a symlink to a
    good image, and beside the crawl a ``secret`` folder the table must not reach."""
    root = tmp_path / "crawl"
    (root / "img").mkdir(parents=True)
    for i in range(2):
        (root / "img" / f"good{i}.jpg").write_bytes(_jpeg(i))
    os.mkfifo(root / "img" / "pipe.jpg")
    _sparse(root / "img" / "huge.jpg")
    (root / "img" / "inside.jpg").symlink_to(root / "img" / "good0.jpg")
    (tmp_path / "secret").mkdir()
    _image(9).save(tmp_path / "secret" / "secret.png")
    (root / "img" / "leak.png").symlink_to(tmp_path / "secret" / "secret.png")
    return root


# --------------------------------------------------------------------------------------------------
# shard


def test_shard_skips_devices_fifos_and_huge_files_under_a_memory_limit(crawl: Path, tmp_path: Path) -> None:
    table = _table(
        tmp_path / "rows.parquet",
        {
            "a": "img/good0.jpg",
            "zero": "/dev/zero",
            "pipe": "img/pipe.jpg",
            "huge": "img/huge.jpg",
            "b": "img/good1.jpg",
        },
    )
    out = tmp_path / "shards"
    # --allow-outside-root: /dev/zero must be refused as a device, not only for where it lies.
    args = ["shard", str(table), str(out), "--image-root", str(crawl), "--allow-outside-root", "--quiet"]
    run = _cli_limited(*args)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "wrote 2 samples" in run.stdout and "not_a_file 2" in run.stdout and "too_large_file 1" in run.stdout
    assert _failures(out) == {"not_a_file": 2, "too_large_file": 1}
    assert _tar_keys(out) == ["a", "b"]
    # No .tmp left behind.
    assert sorted(p.name for p in out.iterdir()) == ["00000.parquet", "00000.tar", "00000_stats.json"]


def test_shard_max_file_mb_is_what_skips_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "img").mkdir()
    small, large = _jpeg(0, (8, 8)), _jpeg(1, (64, 64))
    assert len(small) < len(large)
    (tmp_path / "img" / "small.jpg").write_bytes(small)
    (tmp_path / "img" / "large.jpg").write_bytes(large)
    table = _table(tmp_path / "rows.parquet", {"small": "img/small.jpg", "large": "img/large.jpg"})
    cap = (len(small) + 0.5) / 2**20  # the small file fits exactly, the large one does not
    code = main(["shard", str(table), str(tmp_path / "capped"), "--max-file-mb", str(cap), "--quiet"])
    assert code == 0 and "too_large_file 1" in capsys.readouterr().out
    assert _tar_keys(tmp_path / "capped") == ["small"]
    assert main(["shard", str(table), str(tmp_path / "default"), "--quiet"]) == 0
    assert _tar_keys(tmp_path / "default") == ["small", "large"]
    assert main(["shard", str(table), str(tmp_path / "bad"), "--max-file-mb", "0", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "max_file_mb must be a positive" in err and err.count("\n") == 1


@pytest.mark.parametrize("root_from", ["image_root_flag", "table_folder"])
def test_shard_keeps_table_paths_inside_the_image_root(
    crawl: Path, tmp_path: Path, root_from: str, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = tmp_path / "secret" / "secret.png"
    rows = {
        "a": "img/good0.jpg",
        "dotdot": "../secret/secret.png",
        "absolute": str(secret),
        "symlink_out": "img/leak.png",
        "symlink_in": "img/inside.jpg",
        "absolute_in": str(crawl / "img" / "good1.jpg"),
    }
    if root_from == "table_folder":  # no --image-root: the table's own folder is the root
        table, extra = _table(crawl / "rows.parquet", rows), []
    else:
        table, extra = _table(tmp_path / "rows.parquet", rows), ["--image-root", str(crawl)]
    out = tmp_path / "confined"
    assert main(["shard", str(table), str(out), *extra, "--quiet"]) == 0
    assert "outside_root 3" in capsys.readouterr().out
    assert _failures(out) == {"outside_root": 3}
    # the secret's pixels are nowhere in the shard either: every stored image is one of the crawl's
    assert _tar_images(out) == {"a": _jpeg(0), "symlink_in": _jpeg(0), "absolute_in": _jpeg(1)}

    allowed = tmp_path / "allowed"
    assert main(["shard", str(table), str(allowed), *extra, "--allow-outside-root", "--quiet"]) == 0
    assert _failures(allowed) == {}
    assert _tar_keys(allowed) == list(rows)


def test_a_tar_member_over_the_limit_is_skipped_unread(tmp_path: Path) -> None:
    """A shard whose first sample's image claims 30 GB (a hole in a sparse file): re-sharding it skips that
    sample from its header and keeps the next one."""
    shard = tmp_path / "in" / "00000.tar"
    shard.parent.mkdir()
    with open(shard, "wb") as f:
        big = tarfile.TarInfo("big.jpg")
        big.size = HUGE
        f.write(big.tobuf(tarfile.PAX_FORMAT))
        f.seek(HUGE, os.SEEK_CUR)  # the member's data: a hole, never written
        with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tf:
            _add_members(tf, [("big.txt", b"a huge image"), ("ok.jpg", _jpeg(3)), ("ok.txt", b"a small image")])
    out = tmp_path / "out"
    run = _cli_limited("shard", str(shard), str(out), "--quiet")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "wrote 1 samples" in run.stdout and "too_large_member 1" in run.stdout
    assert _tar_keys(out) == ["ok"] and _failures(out) == {"too_large_member": 1}


def _pax_bomb(path: Path, claimed: int = 3 * 2**30) -> Path:
    """A shard: sample ``a``, then a PAX extended header (typeflag ``x``) whose size field claims ``claimed``
    bytes followed by a few bytes of it, then sample ``c``. tarfile alone reads such a header whole."""
    with open(path, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        _add_members(tf, [("a.jpg", _jpeg(0)), ("a.txt", b"first")])
        pax = tarfile.TarInfo("././@PaxHeader")
        pax.type = tarfile.XHDTYPE
        pax.size = claimed
        f.write(pax.tobuf(tarfile.USTAR_FORMAT))
        f.write(b"27 path=b.jpg\n".ljust(tarfile.BLOCKSIZE, b"\0"))  # the claimed header, cut short
        tf.offset = f.tell()
        _add_members(tf, [("c.jpg", _jpeg(2)), ("c.txt", b"after")])
    return path


def test_a_huge_pax_header_ends_its_shard_unread_under_a_memory_limit(tmp_path: Path) -> None:
    """tarfile reads a PAX header in one allocation of the size it claims: 3 GB here, over the child's
    2 GB address space. The header is refused from its size field, the rest of that shard is skipped with
    one counted reason, and the next shard is read. Sample ``a`` goes too: the header may have described one
    of its members."""
    shards = tmp_path / "in"
    shards.mkdir()
    _pax_bomb(shards / "00000.tar")
    with tarfile.open(shards / "00001.tar", "w") as tf:
        _add_members(tf, [("d.jpg", _jpeg(3)), ("d.txt", b"next shard")])
    out = tmp_path / "out"
    run = _cli_limited("shard", str(shards), str(out), "--quiet")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    assert "wrote 1 samples" in run.stdout and "too_large_header 1" in run.stdout, run.stdout
    assert _tar_keys(out) == ["d"] and _failures(out) == {"too_large_header": 1}


@pytest.mark.parametrize("how", ["file", "pipe"])
def test_read_samples_refuses_a_huge_pax_header(tmp_path: Path, how: str) -> None:
    bomb = _pax_bomb(tmp_path / "00000.tar")
    url = f"pipe:cat {bomb}" if how == "pipe" else str(bomb)
    code = (
        "import json, resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT}, {MEMORY_LIMIT}))\n"
        "from openalign.data.sources import read_samples\n"
        "errors = []\n"
        "kept = [s['__key__'] for s in read_samples(sys.argv[1], on_error=lambda r, d: errors.append([r, d]))]\n"
        "print(json.dumps({'kept': kept, 'errors': errors}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(openalign.__file__).resolve().parents[1]), "MALLOC_ARENA_MAX": "1"}
    run = subprocess.run([sys.executable, "-c", code, url], capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    assert result["kept"] == [] and [r for r, _ in result["errors"]] == ["too_large_header"]
    assert "3.0 GB" in result["errors"][0][1]


def test_read_samples_counts_members_over_the_limit(tmp_path: Path) -> None:
    shard = tmp_path / "00000.tar"
    with tarfile.open(shard, "w") as tf:
        _add_members(tf, [("a.jpg", _jpeg(0, (8, 8))), ("a.txt", b"a"), ("b.jpg", _jpeg(1, (64, 64))), ("b.txt", b"b")])
    errors: list[str] = []
    limit = len(_jpeg(0, (8, 8)))
    kept = list(read_samples(str(shard), on_error=lambda reason, detail: errors.append(reason), max_member_bytes=limit))
    assert [s["__key__"] for s in kept] == ["a"] and errors == ["too_large_member"]
    assert [s["__key__"] for s in read_samples(str(shard))] == ["a", "b"]

    # eval is strict: the same member is an error naming it
    from openalign.eval.datasets import load_retrieval_wds

    with pytest.raises(ValueError, match="too_large_member"):
        load_retrieval_wds(str(shard), max_file_bytes=limit)
    assert len(load_retrieval_wds(str(shard)).captions) == 2


# --------------------------------------------------------------------------------------------------
# The two enforcement points


def test_read_file_refuses_what_is_not_a_regular_file_within_the_limit(tmp_path: Path) -> None:
    data = _jpeg(0)
    (tmp_path / "a.jpg").write_bytes(data)
    (tmp_path / "link.jpg").symlink_to(tmp_path / "a.jpg")
    assert read_file(tmp_path / "a.jpg") == data and read_file(tmp_path / "link.jpg") == data
    assert read_file(tmp_path / "a.jpg", max_bytes=len(data)) == data
    for path, limit, reason in [
        (tmp_path / "a.jpg", len(data) - 1, "too_large_file"),
        (tmp_path, 1 << 20, "not_a_file"),
        (tmp_path / "nope.jpg", 1 << 20, "missing_file"),
        (str(tmp_path / "nul\0.jpg"), 1 << 20, "unreadable_file"),  # a skip, not a crash of the stream
    ]:
        with pytest.raises(BadInput) as err:
            read_file(path, max_bytes=limit)
        assert err.value.reason == reason


def test_resolve_image_path_confines_to_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "img").mkdir(parents=True)
    (root / "img" / "a.jpg").write_bytes(b"x")
    (tmp_path / "out.jpg").write_bytes(b"y")
    (root / "img" / "out.jpg").symlink_to(tmp_path / "out.jpg")
    (root / "img" / "in.jpg").symlink_to(root / "img" / "a.jpg")
    assert resolve_image_path(root, "img/a.jpg") == (root / "img" / "a.jpg").resolve()
    assert resolve_image_path(root, "img/in.jpg") == (root / "img" / "a.jpg").resolve()
    assert resolve_image_path(root, "img/../img/missing.jpg") == (root / "img" / "missing.jpg").resolve()
    for value in ["../out.jpg", str(tmp_path / "out.jpg"), "img/out.jpg", "img/../../out.jpg", "/etc/passwd"]:
        with pytest.raises(BadInput) as err:
            resolve_image_path(root, value)
        assert err.value.reason == "outside_root"
        assert resolve_image_path(root, value, allow_outside_root=True) is not None
    with pytest.raises(BadInput, match="unreadable_file"):
        resolve_image_path(root, "img/nul\0.jpg")


def test_image_root_resolves_as_path_resolve_does_while_remembering_folders(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "x.jpg").write_bytes(b"x")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "y.jpg").write_bytes(b"y")
    (root / "alias").symlink_to(root / "a")  # a folder symlink that stays inside
    (root / "escape").symlink_to(tmp_path / "outside")  # a folder symlink that leads out
    (root / "a" / "b" / "link.jpg").symlink_to(tmp_path / "outside" / "y.jpg")  # a file symlink that leads out
    (root / "a" / "b" / "same.jpg").symlink_to("x.jpg")  # a relative file symlink that stays inside
    (root / "loop").symlink_to(root / "loop")
    values = [
        "a/b/x.jpg", "alias/b/x.jpg", "alias/b/same.jpg", "a/b/../b/x.jpg", "a/b/missing.jpg", "a/b/..",
        "a/./b/x.jpg", "escape/y.jpg", "a/b/link.jpg", "alias/../escape/y.jpg", "loop/x.jpg", "a/b/nul\0.jpg",
        str(root / "a" / "b" / "x.jpg"), str(tmp_path / "outside" / "y.jpg"),
    ]  # fmt: skip

    def outcome(resolve: Callable[[str], Path], value: str) -> object:
        try:
            return resolve(value)
        except BadInput as err:
            return err.reason

    def reference(value: str) -> object:  # the whole path through Path.resolve, every time
        try:
            resolved = (root / value).resolve()
        except (OSError, RuntimeError, ValueError):
            return "unreadable_file"
        return resolved if resolved.is_relative_to(root.resolve()) else "outside_root"

    images = ImageRoot(root)
    for value in values * 2:  # the second round answers from the remembered folders
        assert outcome(images.resolve, value) == reference(value), value
    assert outcome(images.resolve, "a/b/x.jpg") == (root / "a" / "b" / "x.jpg").resolve()
    assert {outcome(images.resolve, v) for v in ("escape/y.jpg", "a/b/link.jpg")} == {"outside_root"}

    # Another pass sees a folder that became a symlink leading out.
    shutil.rmtree(root / "a" / "b")
    (root / "a" / "b").symlink_to(tmp_path / "outside")
    assert outcome(ImageRoot(root).resolve, "a/b/y.jpg") == "outside_root"


def test_a_folder_source_carries_the_limit_to_its_records(tmp_path: Path) -> None:
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.jpg").write_bytes(_jpeg(0, (64, 64)))
    (tmp_path / "photos" / "a.txt").write_text("caption")
    (record,) = open_source(tmp_path / "photos", max_file_bytes=100).records()
    with pytest.raises(BadInput, match="too_large_file"):
        record.read()
    (record,) = open_source(tmp_path / "photos").records()
    assert record.read() == _jpeg(0, (64, 64))
    with pytest.raises(ValueError, match="max_file_bytes"):
        open_source(tmp_path / "photos", max_file_bytes=0)


# --------------------------------------------------------------------------------------------------
# index build


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    captions = ["caption a", "caption b", "a huge image"] * 5
    return save_tiny_checkpoint(tmp_path_factory.mktemp("model"), captions, vocab_size=60, min_frequency=1)


def _index_keys(index: Path) -> list[str]:
    return pq.read_table(index / "image" / "metadata.parquet").column("key").to_pylist()


def test_index_build_skips_fifos_and_huge_files_under_a_memory_limit(
    crawl: Path, tmp_path: Path, model_dir: Path
) -> None:
    (crawl / "img" / "leak.png").unlink()  # a folder is the user's own: its symlinks are not confined
    out = tmp_path / "idx"
    args = ["index", "build", "--model", str(model_dir), "--images", str(crawl), "--out", str(out), "--quiet"]
    run = _cli_limited(*args, limit=MODEL_MEMORY_LIMIT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "+3 images" in run.stdout and "not_a_file 1" in run.stdout and "too_large_file 1" in run.stdout
    assert sorted(_index_keys(out)) == ["img/good0.jpg", "img/good1.jpg", "img/inside.jpg"]
    assert json.loads((out / "index.json").read_text())["skipped"] == {"not_a_file": 1, "too_large_file": 1}


def test_index_build_keeps_table_paths_inside_the_table_folder(
    crawl: Path, tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = {
        "a": "img/good0.jpg",
        "dotdot": "../secret/secret.png",
        "absolute": str(tmp_path / "secret" / "secret.png"),
        "symlink_out": "img/leak.png",
        "symlink_in": "img/inside.jpg",
    }
    table = _table(crawl / "rows.parquet", rows)
    base = ["index", "build", "--model", str(model_dir), "--images", str(table), "--quiet"]
    assert main([*base, "--out", str(tmp_path / "confined")]) == 0
    assert "skipped 3 (outside_root 3)" in capsys.readouterr().out
    assert _index_keys(tmp_path / "confined") == ["a", "symlink_in"]
    assert main([*base, "--out", str(tmp_path / "allowed"), "--allow-outside-root", "--max-file-mb", "1"]) == 0
    assert _index_keys(tmp_path / "allowed") == list(rows)
    assert main([*base, "--out", str(tmp_path / "bad"), "--max-file-mb", "-1"]) == 2
    assert "max_file_mb" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# dedup


def test_dedup_skips_outside_and_huge_files_under_a_memory_limit(crawl: Path, tmp_path: Path, model_dir: Path) -> None:
    rows = {
        "a": "img/good0.jpg",
        "b": "img/good1.jpg",
        "c": "img/inside.jpg",
        "dotdot": "../secret/secret.png",
        "symlink_out": "img/leak.png",
        "huge": "img/huge.jpg",
    }
    table = _table(crawl / "rows.parquet", rows)
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "t.jpg").write_bytes(_jpeg(1))
    out = tmp_path / "dedup"
    args = ["dedup", str(table), str(tmp_path / "test"), str(out), "--embedder", f"align:{model_dir}", "--quiet"]
    run = _cli_limited(*args, limit=MODEL_MEMORY_LIMIT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "skipped train images: outside_root 2, too_large_file 1" in run.stdout
    assert json.loads((out / "train_keys.json").read_text()) == ["a", "b", "c"]


# --------------------------------------------------------------------------------------------------
# train


def test_the_training_stream_skips_members_over_data_max_file_mb(tmp_path: Path) -> None:
    from openalign.config import ConfigError
    from openalign.text import train_wordpiece
    from openalign.train.data import DataConfig, build_train_stream

    small, large = _jpeg(0, (16, 16)), _jpeg(1, (64, 64))
    with tarfile.open(tmp_path / "00000.tar", "w") as tf:
        _add_members(tf, [("a.jpg", small), ("a.txt", b"red"), ("b.jpg", large), ("b.txt", b"blue")])
        _add_members(tf, [("c.jpg", small), ("c.txt", b"green")])
    tokenizer = train_wordpiece(["red blue green"] * 5, vocab_size=40, min_frequency=1)
    cfg = DataConfig(shards=str(tmp_path / "00000.tar"), batch_size=2, image_size=8, resize=10, workers=0)
    cfg.shuffle_buffer, cfg.shuffle_shards = 0, False
    cfg.max_file_mb = (len(small) + 0.5) / 2**20
    stream = build_train_stream(cfg, tokenizer, seed=0)
    batch = next(iter(stream))
    assert batch["input_ids"].tolist() == tokenizer(["red", "green"], max_length=64)["input_ids"].tolist()
    assert stream.stats == Counter(shard_too_large_member=1)
    cfg.max_file_mb = 0
    with pytest.raises(ConfigError, match=r"data\.max_file_mb"):
        cfg.validate()


# --------------------------------------------------------------------------------------------------
# Tables read a batch at a time, annotation files within their own limit


def test_a_jsonl_table_is_read_a_line_at_a_time_under_a_memory_limit(crawl: Path, tmp_path: Path) -> None:
    """A JSON Lines table with a 3 GB line (a hole in a sparse file) between good rows, beside lines that are
    not JSON, not an object, or hold a caption that is not text: each such line is skipped and counted, the
    rows around them are sharded, and the child never holds the long line."""
    table = tmp_path / "rows.jsonl"
    with open(table, "wb") as f:
        f.write(json.dumps({"key": "a", "caption": "first", "image_path": "img/good0.jpg"}).encode() + b"\n")
        f.write(b'{"key": "huge", "caption": "')
        f.seek(3 * 2**30, os.SEEK_CUR)
        f.write(b'"}\n{not json\n[1, 2]\n')
        f.write(json.dumps({"key": "n", "caption": 5, "image_path": "img/good1.jpg"}).encode() + b"\n")
        f.write(json.dumps({"key": "b", "caption": "last", "image_path": "img/good1.jpg"}).encode() + b"\n")
    out = tmp_path / "shards"
    run = _cli_limited("shard", str(table), str(out), "--image-root", str(crawl), "--quiet")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "wrote 2 samples" in run.stdout, run.stdout
    assert _failures(out) == {"bad_json": 3, "caption_not_text": 1}
    assert _tar_keys(out) == ["a", "b"]


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.jsonl.gz"])
def test_a_line_over_the_limit_is_stepped_over_in_plain_and_gzipped_tables(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gzip

    from openalign.data import sources

    monkeypatch.setattr(sources, "MAX_LINE_BYTES", 1000)
    good = [{"key": str(i), "caption": f"row {i}"} for i in range(3)]
    lines = [json.dumps(good[0]), '{"key": "long", "caption": "' + "x" * 5000 + '"}', *map(json.dumps, good[1:])]
    data = "\n".join(lines).encode() + b"\n"
    (tmp_path / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    skipped: list[tuple[str, str]] = []
    rows = list(sources._jsonl_rows(tmp_path / name, lambda reason, detail: skipped.append((reason, detail))))
    assert rows == good
    assert skipped == [("bad_json", f"{tmp_path / name}: line 2: longer than 1000 bytes")]


def test_a_jsonl_table_without_a_text_caption_is_an_error_and_lines_are_named(tmp_path: Path) -> None:
    from openalign.data.sources import read_table_batches

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"key": "a", "caption": 1, "jpg": null}\n{"key": "b", "caption": [2], "jpg": null}\n')
    with pytest.raises(ValueError, match="column 'caption' holds"):
        list(open_source(rows).records())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"key": "a"}\n\n{"key": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl: line 3: not JSON"):
        _, batches = read_table_batches(bad)  # without a way to count it, a bad line is an error naming it
        list(batches)


def test_an_image_bytes_cell_over_max_file_mb_is_skipped_as_a_file_would_be(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small, large = _jpeg(0, (8, 8)), _jpeg(1, (64, 64))
    table = tmp_path / "images.parquet"
    pq.write_table(pa.table({"key": ["small", "large"], "caption": ["s", "l"], "jpg": [small, large]}), table)
    cap = (len(small) + 0.5) / 2**20
    assert main(["shard", str(table), str(tmp_path / "capped"), "--max-file-mb", str(cap), "--quiet"]) == 0
    assert "too_large_file 1" in capsys.readouterr().out
    assert _tar_keys(tmp_path / "capped") == ["small"]
    assert _failures(tmp_path / "capped") == {"too_large_file": 1}


def test_parquet_batches_of_large_rows_are_cut_short(tmp_path: Path) -> None:
    from openalign.data.sources import _parquet_batch_rows, open_parquet

    blobs = [np.random.default_rng(i).bytes(2**20) for i in range(40)]  # random: no encoding makes them small
    pq.write_table(pa.table({"key": [str(i) for i in range(40)], "jpg": blobs}), tmp_path / "big.parquet")
    pq.write_table(pa.table({"key": [str(i) for i in range(40)]}), tmp_path / "small.parquet")
    big = _parquet_batch_rows(open_parquet(tmp_path / "big.parquet"), 4096, None)
    assert 100 <= big <= 300  # about 256 MB of 1 MB rows, not 4096 of them
    assert _parquet_batch_rows(open_parquet(tmp_path / "small.parquet"), 4096, None) == 4096


def _limited_python(code: str, limit: int = MEMORY_LIMIT) -> subprocess.CompletedProcess[str]:
    prelude = f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))\n"
    env = {**os.environ, "PYTHONPATH": str(Path(openalign.__file__).resolve().parents[1]), "MALLOC_ARENA_MAX": "1"}
    return subprocess.run(
        [sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120, env=env, check=False
    )


@pytest.mark.parametrize(
    ("reader", "name"),
    [
        ("from openalign.eval.datasets import load_karpathy as f; f(P, R)", "dataset_flickr30k.json"),
        ("from openalign.eval.datasets import load_coco_captions as f; f(P, R)", "captions_val2014.json"),
        ("from openalign.eval.sets import read_classnames as f; f(P)", "classnames.txt"),
        ("from openalign.eval.cxc import read_karpathy_split as f; f(P, 'test')", "dataset_coco.json"),
        ("from openalign.eval.datasets import load_retrieval_csv as f; f(P, R)", "pairs.csv"),
        ("from openalign.data.dedup import load_keys as f; f(P)", "keys.json"),
    ],
)
def test_a_huge_annotation_file_is_refused_from_its_size_under_a_memory_limit(
    tmp_path: Path, reader: str, name: str
) -> None:
    """Annotation files are read whole (or kept whole): a 30 GB one is refused by ``stat`` before any read,
    with a one-line error naming the setting that raises the limit."""
    huge = _sparse(tmp_path / name)
    (tmp_path / "img").mkdir()
    code = f"P, R = {str(huge)!r}, {str(tmp_path / 'img')!r}\n"
    code += f"try:\n    {reader}\nexcept ValueError as err:\n    print(err)\nelse:\n    print('read')\n"
    run = _limited_python(code)
    assert run.returncode == 0, run.stderr[-2000:]
    message = run.stdout.strip()
    assert "\n" not in message and str(huge) in message, message
    assert "30.0 GB, over the 512.0 MB limit" in message and "max_annotation_mb" in message, message


def test_a_gzip_bomb_among_annotation_files_fails_in_one_line(tmp_path: Path) -> None:
    """Multi30K captions may be gzip-compressed: 64 MB of zeros in 64 KB decompress within a 1 MB limit to an
    error, as do a damaged stream and one cut short; concatenated members read as one."""
    import gzip as gz

    from openalign.data.sources import read_annotation
    from openalign.eval.multilingual import load_multi30k

    bomb = tmp_path / "test_2016_flickr.en.gz"
    bomb.write_bytes(gz.compress(b"\0" * 64 * 2**20))
    assert bomb.stat().st_size < 2**20
    with pytest.raises(ValueError, match=r"decompresses to more than the 1.0 MB limit .*max_annotation_mb"):
        read_annotation(bomb, max_bytes=2**20)
    (tmp_path / "images.txt").write_text("a.jpg\n")
    with pytest.raises(ValueError, match="decompresses to more than"):
        load_multi30k(tmp_path, tmp_path / "images.txt", ["en"], max_annotation_bytes=2**20)
    two = tmp_path / "two.gz"
    two.write_bytes(gz.compress(b"one\n") + gz.compress(b"two\n"))
    assert read_annotation(two) == b"one\ntwo\n"
    cut = tmp_path / "cut.gz"
    cut.write_bytes(gz.compress(b"x" * 10_000)[:-12])
    with pytest.raises(ValueError, match="ends early"):
        read_annotation(cut)
    damaged = tmp_path / "damaged.gz"
    damaged.write_bytes(b"\x1f\x8b" + b"\x00" * 30)
    with pytest.raises(ValueError, match="not gzip data"):
        read_annotation(damaged)


def test_max_annotation_mb_is_an_option_of_every_eval_task() -> None:
    from openalign.config import ConfigError
    from openalign.eval.tasks import get_task, max_annotation_bytes, resolve_options

    task = get_task("retrieval")
    options = resolve_options(task, {"dataset": "x.json", "max_annotation_mb": 1.5})
    assert max_annotation_bytes(options) == int(1.5 * 2**20)
    assert resolve_options(task, {"dataset": "x.json"})["max_annotation_mb"] == 512.0
    with pytest.raises(ConfigError, match="max_annotation_mb must be positive"):
        resolve_options(task, {"dataset": "x.json", "max_annotation_mb": 0})
