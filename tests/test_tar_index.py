"""The headers-only tar index against ``read_samples``: the same samples from a plain tar, None for anything else."""

from __future__ import annotations

import gzip
import io
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from openalign.data.shards import read_samples, write_shards
from openalign.data.tar_index import MemberRef, TarWindow, index_samples

LIMIT = 1 << 20


def _image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8))


def _write(path: Path, members: list[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT, dirs: bool = False) -> Path:
    with tarfile.open(path, "w", format=fmt) as tf:
        if dirs:
            info = tarfile.TarInfo("sub")
            info.type = tarfile.DIRTYPE
            tf.addfile(info)
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def _members(n: int, prefix: str = "") -> list[tuple[str, bytes]]:
    out = []
    for i in range(n):
        buf = io.BytesIO()
        _image(i).save(buf, format="JPEG")
        out += [(f"{prefix}{i:06d}.jpg", buf.getvalue()), (f"{prefix}{i:06d}.txt", f"caption {i}".encode())]
    return out


def _read(url: str) -> tuple[list[dict], list[str]]:
    errors: list[str] = []
    return list(read_samples(url, on_error=lambda r, d: errors.append(r), max_member_bytes=LIMIT)), errors


def _materialized(samples: list[dict]) -> list[dict]:
    return [{k: v.read() if isinstance(v, MemberRef) else v for k, v in s.items()} for s in samples]


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    return _write(tmp_path / "plain.tar", _members(5))


@pytest.mark.parametrize(
    "make",
    [
        lambda d: write_shards([{"key": f"{i:04d}", "jpg": _image(i), "txt": f"c {i}"} for i in range(7)], d / "w")[0],
        lambda d: _write(d / "pax.tar", _members(3)),
        lambda d: _write(d / "ustar.tar", _members(3), fmt=tarfile.USTAR_FORMAT),
        lambda d: _write(d / "gnu.tar", _members(3), fmt=tarfile.GNU_FORMAT),
        lambda d: _write(d / "dirs.tar", _members(3, prefix="sub/"), dirs=True),
        # over 100 characters: ustar's prefix field holds the folders
        lambda d: _write(d / "prefix.tar", _members(2, prefix="a" * 60 + "/" + "b" * 60 + "/"), tarfile.USTAR_FORMAT),
    ],
    ids=["write_shards", "pax", "ustar", "gnu", "directories", "ustar_prefix"],
)
def test_plain_tars_are_indexed_to_the_samples_read_samples_gives(tmp_path: Path, make: Callable) -> None:
    url = str(make(tmp_path))
    indexed = index_samples(url, LIMIT)
    expected, errors = _read(url)
    assert errors == [] and expected
    assert indexed is not None, "a plain tar must take the fast path"
    assert _materialized(indexed) == expected


def _gzip(p: Path) -> Path:
    out = p.with_suffix(".tar.gz")
    out.write_bytes(gzip.compress(p.read_bytes()))
    return out


def _cut(at: Callable[[dict[str, tarfile.TarInfo]], int]) -> Callable[[Path], Path]:
    def make(p: Path) -> Path:
        with tarfile.open(p) as tf:
            members = {m.name: m for m in tf.getmembers()}
        out = p.with_name("cut.tar")
        out.write_bytes(p.read_bytes()[: at(members)])
        return out

    return make


def _damage(name: str) -> Callable[[Path], Path]:
    def make(p: Path) -> Path:
        data = bytearray(p.read_bytes())
        with tarfile.open(p) as tf:
            offset = tf.getmember(name).offset
        data[offset : offset + 100] = b"x" * 100
        out = p.with_name("damaged.tar")
        out.write_bytes(bytes(data))
        return out

    return make


def _append(extra: bytes) -> Callable[[Path], Path]:
    def make(p: Path) -> Path:
        out = p.with_name("appended.tar")
        out.write_bytes(p.read_bytes() + extra)
        return out

    return make


def _rewrite(members: Callable[[list[tuple[str, bytes]]], list[tuple[str, bytes]]], **kw: object):
    return lambda p: _write(p.with_name("rewritten.tar"), members(_members(5)), **kw)  # type: ignore[arg-type]


def _symlink(p: Path) -> Path:
    out = p.with_name("link.tar")
    with tarfile.open(p) as src, tarfile.open(out, "w") as tf:
        for m in src.getmembers():
            tf.addfile(m, src.extractfile(m))
        link = tarfile.TarInfo("000009.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, "000000.jpg"
        tf.addfile(link)
    return out


@pytest.mark.parametrize(
    "make",
    [
        _gzip,
        _cut(lambda m: m["000002.jpg"].offset_data + 100),
        _cut(lambda m: m["000002.txt"].offset),
        _cut(lambda m: m["000002.txt"].offset + 256),
        _cut(lambda m: m["000004.txt"].offset_data + 512),
        _damage("000002.txt"),
        _damage("000003.jpg"),
        _append(b"junk after the end" * 40),
        _rewrite(lambda m: [*m, ("huge.jpg", b"\xff" * (LIMIT + 1))]),
        _rewrite(lambda m: [*m[:2], m[0], *m[2:]]),  # a member repeated in a row
        _rewrite(lambda m: [*m[:4], ("README", b"no extension"), *m[4:]]),
        _rewrite(lambda m: [(n.replace("000001", "ünï"), d) for n, d in m]),  # a PAX header for the name
        _rewrite(lambda m: [(n.replace("000001", "x" * 120), d) for n, d in m], fmt=tarfile.GNU_FORMAT),
        _symlink,
        lambda p: (p.with_name("empty.tar").write_bytes(b"\0" * 10240), p.with_name("empty.tar"))[1],
    ],
    ids=[
        "gzip",
        "cut_in_data",
        "cut_at_member",
        "cut_in_header",
        "no_end_marker",
        "damaged_text_header",
        "damaged_image_header",
        "trailing_junk",
        "member_over_limit",
        "repeated_member",
        "no_extension",
        "pax_header",
        "gnu_long_name",
        "symlink",
        "empty",
    ],
)
def test_anything_but_a_plain_tar_is_left_to_read_samples(plain: Path, make: Callable[[Path], Path]) -> None:
    url = str(make(plain))
    assert index_samples(url, LIMIT) is None


def test_urls_it_cannot_seek_are_left_to_read_samples(plain: Path, tmp_path: Path) -> None:
    assert index_samples(f"file://{plain}", LIMIT) is not None
    assert index_samples(f"pipe:cat {plain}", LIMIT) is None
    assert index_samples("https://example.com/a.tar", LIMIT) is None
    assert index_samples(str(tmp_path / "missing.tar"), LIMIT) is None
    assert index_samples(str(tmp_path), LIMIT) is None


def test_member_refs_read_heads_and_report_a_changed_file_by_a_short_read(plain: Path) -> None:
    indexed = index_samples(str(plain), LIMIT)
    assert indexed is not None
    ref = indexed[1]["jpg"]
    whole = ref.read()
    assert len(whole) == ref.size and whole[:2] == b"\xff\xd8"
    assert ref.read(16) == whole[:16]
    with open(plain, "rb") as f:
        window = TarWindow(f.fileno())
        assert window.read(ref, 16) == whole[:16] and window.read(ref) == whole
        assert [window.read(s["txt"]) for s in indexed] == [f"caption {i}".encode() for i in range(5)]
    plain.write_bytes(plain.read_bytes()[: ref.offset + 10])
    assert ref.read() == whole[:10]
