"""data/sources.py: every stage reads the same folders, tables and shards, and skips the same items."""

from __future__ import annotations

import ast
import io
import json
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from openalign.data import sources
from openalign.data.sources import (
    IMAGE_MEMBERS,
    BadInput,
    batched,
    decode_records,
    find_tokenizer_file,
    open_source,
    scan_folder,
)


def _encoded(i: int, fmt: str) -> bytes:
    rng = np.random.default_rng(i)
    image = Image.fromarray((rng.random((12, 10 + i % 3, 3)) * 255).astype(np.uint8))
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


# Every suffix in several spellings, nested folders; a JPEG under .jfif (which eval always read and other
# stages used to skip), a non-image file, an undecodable image and hidden files that no stage reads.
IMAGES = {
    "cats/a.jpg": "JPEG",
    "cats/B.JPG": "JPEG",
    "cats/deep/c.jpeg": "JPEG",
    "cats/deep/g.jfif": "JPEG",
    "dogs/d.png": "PNG",
    "dogs/E.WEBP": "WEBP",
    "dogs/deeper/more/f.Png": "PNG",
}
BROKEN = "cats/broken.jpg"
NOT_AN_IMAGE = "dogs/notes.md"


def mixed_folder(root: Path) -> Path:
    for i, (rel, fmt) in enumerate(IMAGES.items()):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(_encoded(i, fmt))
    (root / BROKEN).write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    for rel in [*IMAGES, BROKEN]:
        (root / rel).with_suffix(".txt").write_text(f"caption of {rel}\n")  # sidecars are not skipped items
    (root / NOT_AN_IMAGE).write_text("a note")
    (root / "dogs" / ".DS_Store").write_bytes(b"\x00\x01")
    (root / "cats" / ".thumbs").mkdir()
    (root / "cats" / ".thumbs" / "a.jpg").write_bytes(_encoded(0, "JPEG"))
    return root


def _no_suffix(rel: str) -> str:
    return str(Path(rel).with_suffix("").as_posix())


def test_every_stage_reads_a_folder_the_same_way(tmp_path: Path) -> None:
    from openalign.data.dedup import iter_source_images
    from openalign.data.shards import read_samples, read_stats, shard_input
    from openalign.data.transforms import decode_image
    from openalign.eval.datasets import load_class_folders
    from openalign.search.build import iter_source

    root = mixed_folder(tmp_path / "photos")
    good = sorted(IMAGES)
    expected_skips = {"not_an_image": 1, "corrupt": 1}

    # eval: lists the same images (strict: the broken one is an error naming it, not a skip) and the same
    # non-image file.
    data = load_class_folders(root)
    assert sorted(Path(n).relative_to(root).as_posix() for n in data.images.names) == sorted([*good, BROKEN])
    assert [Path(p).relative_to(root).as_posix() for p in data.skipped_files] == [NOT_AN_IMAGE]
    with pytest.raises(ValueError, match=r"broken\.jpg"):
        list(data.images)

    # index build: the reader, then the decoding its chunks do.
    index_skips: Counter[str] = Counter()
    items = list(iter_source(root, lambda reason, detail: index_skips.update([reason])))
    index_keys = []
    for item in items:
        try:
            decode_image(item.read())
            index_keys.append(item.key)
        except BadInput as err:
            index_skips[err.reason] += 1
    assert sorted(index_keys) == good and dict(index_skips) == expected_skips
    assert {i.key: i.caption for i in items}["cats/B.JPG"] == "caption of cats/B.JPG"

    # dedup (keys are the relative paths without suffix)
    dedup_skips: Counter[str] = Counter()
    dedup_keys = [key for key, _ in iter_source_images(str(root), lambda reason, detail: dedup_skips.update([reason]))]
    assert sorted(dedup_keys) == sorted(_no_suffix(k) for k in good) and dict(dedup_skips) == expected_skips

    # shard writing
    totals = shard_input(root, tmp_path / "shards")
    assert totals.successes == len(good) and totals.failures == expected_skips
    written = [json.loads(s["json"]) for s in read_samples(str(tmp_path / "shards" / "00000.tar"))]
    assert sorted(m["filename"] for m in written) == good
    assert read_stats(tmp_path / "shards").count == len(good) + 2


def _member_tar(path: Path) -> list[tuple[str, str]]:
    """A shard whose samples use different image members and extension cases; returns (key, caption)."""
    members = [("s0", "jpg", "JPEG"), ("s1", "PNG", "PNG"), ("s2", "webp", "WEBP"), ("s3", "jpeg", "JPEG")]
    samples = []
    with tarfile.open(path, "w") as tf:
        for i, (key, ext, fmt) in enumerate(members):
            caption = f"sample {key}"
            for name, data in ((f"{key}.{ext}", _encoded(i, fmt)), (f"{key}.txt", caption.encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            samples.append((key, caption))
    return samples


def test_shards_round_trip_through_every_reader(tmp_path: Path) -> None:
    from openalign.data.dedup import iter_source_images
    from openalign.data.shards import shard_input
    from openalign.eval.datasets import load_retrieval_wds
    from openalign.search.build import iter_source
    from openalign.text import train_wordpiece
    from openalign.text.vocab import iter_captions
    from openalign.train.data import DataConfig, build_train_stream

    root = mixed_folder(tmp_path / "photos")
    shard_input(root, tmp_path / "shards", samples_per_shard=4)
    extra = _member_tar(tmp_path / "shards" / "00009.tar")  # written by hand: other members, other cases
    spec = str(tmp_path / "shards")
    stored = open_source(spec)
    assert stored.kind == "shards" and [Path(u).name for u in stored.urls] == ["00000.tar", "00001.tar", "00009.tar"]
    records = list(stored.records(on_skip=lambda reason, detail: pytest.fail(f"{reason}: {detail}")))
    keys = [(Path(r.origin).name, r.key) for r in records]
    captions = [r.caption for r in records]
    assert len(records) == len(IMAGES) + len(extra) and captions[-4:] == [c for _, c in extra]
    assert sorted(r.metadata()["filename"] for r in records if r.origin.endswith(("00000.tar", "00001.tar"))) == sorted(
        IMAGES
    )

    errors: Counter[str] = Counter()
    index_items = list(iter_source(spec, lambda reason, detail: errors.update([reason])))
    assert [tuple(i.key.split("/")) for i in index_items] == keys and [i.caption for i in index_items] == captions
    assert [key for key, _ in iter_source_images(spec, lambda r, d: errors.update([r]))] == [k for _, k in keys]
    wds = load_retrieval_wds(str(tmp_path / "shards" / "*.tar"))
    assert wds.captions == captions and len(list(wds.images)) == len(records)
    assert list(iter_captions(spec, skipped=errors)) == captions
    assert not errors

    assert DataConfig().image_keys == IMAGE_MEMBERS
    tokenizer = train_wordpiece([*captions] * 3, vocab_size=60, min_frequency=1)
    cfg = DataConfig(shards=spec, batch_size=len(records), image_size=8, resize=10, max_text_length=8, workers=0)
    cfg.shuffle_buffer, cfg.shuffle_shards = 0, False
    stream = build_train_stream(cfg, tokenizer, seed=0)
    batch = next(iter(stream))
    assert batch["pixel_values"].shape[0] == len(records) and not stream.stats
    want = tokenizer(captions, max_length=8)["input_ids"]
    assert batch["input_ids"].tolist() == want.tolist()


def test_tables_are_a_source_for_every_image_stage(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from openalign.data.dedup import iter_source_images
    from openalign.search.build import iter_source

    (tmp_path / "img").mkdir()
    for i in range(3):
        (tmp_path / "img" / f"{i}.png").write_bytes(_encoded(i, "PNG"))
    rows = {
        "key": ["a", "b", "c", "d"],
        "caption": ["zero", "one", "two", "gone"],
        "image_path": ["img/0.png", "img/1.png", "img/2.png", "img/missing.png"],
        "url": ["http://x/0", None, None, None],
    }
    pq.write_table(pa.table(rows), tmp_path / "t.parquet")
    source = open_source(tmp_path / "t.parquet")
    assert source.kind == "table"
    skips: Counter[str] = Counter()
    decoded = list(decode_records(source.records(), lambda reason, detail: skips.update([reason])))
    assert [r.key for r, _ in decoded] == ["a", "b", "c"] and dict(skips) == {"missing_file": 1}
    assert decoded[0][0].caption == "zero" and decoded[0][0].metadata()["url"] == "http://x/0"
    items = list(iter_source(tmp_path / "t.parquet", lambda r, d: None))
    assert [i.key for i in items] == ["a", "b", "c", "d"] and items[0].url == "http://x/0"
    assert [k for k, _ in iter_source_images(str(tmp_path / "t.parquet"), lambda r, d: None)] == ["a", "b", "c"]


def test_table_sources_are_strict_about_csv_quotes_and_caption_types(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from openalign.cli import main
    from openalign.text.vocab import iter_captions

    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "0.png").write_bytes(_encoded(0, "PNG"))
    rows = [f"{i:06d},img/0.png,a caption number {i},{640 + i},480" for i in range(20)]
    rows[4] = '000004,img/0.png,"a stray quote,644,480'
    (tmp_path / "t.csv").write_text("\n".join(["key,image_path,caption,width,height", *rows]) + "\n")
    # shard (and every stage reading tables through sources), vocab: the line is named, nothing is written
    with pytest.raises(ValueError, match=r"t\.csv: line 6: a quoted value opened on this line is never closed"):
        list(open_source(tmp_path / "t.csv").events())
    assert main(["shard", str(tmp_path / "t.csv"), str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 6" in err and not list((tmp_path / "out").glob("*.tar"))
    with pytest.raises(ValueError, match=r"line 6: a quoted value"):
        list(iter_captions(tmp_path / "t.csv"))
    # well-formed, keys stay text and sizes become numbers, as Parquet would give them
    rows[4] = '000004,img/0.png,"a quoted, caption",644,480'
    (tmp_path / "t.csv").write_text("\n".join(["key,image_path,caption,width,height", *rows]) + "\n")
    records = list(open_source(tmp_path / "t.csv").records())
    assert [r.key for r in records] == [f"{i:06d}" for i in range(20)] and records[4].caption == "a quoted, caption"
    assert records[4].metadata()["width"] == 644
    # a caption column that is not text is named, for a table source and for a captions table
    for values, held in ((pa.array([1]), "int64"), (pa.array([["a", "b"]]), "list<")):
        pq.write_table(pa.table({"caption": values, "image_path": ["img/0.png"]}), tmp_path / "bad.parquet")
        with pytest.raises(ValueError, match=f"column 'caption' holds {held}"):
            list(open_source(tmp_path / "bad.parquet").events())
        pq.write_table(pa.table({"caption": values, "file": ["0.png"]}), tmp_path / "captions.parquet")
        with pytest.raises(ValueError, match=f"column 'caption' holds {held}"):
            open_source(tmp_path / "img", captions=tmp_path / "captions.parquet")


def test_open_source_recognises_inputs_and_refuses_the_rest(tmp_path: Path) -> None:
    mixed_folder(tmp_path / "photos")
    assert open_source(tmp_path / "photos").kind == "folder"
    with pytest.raises(FileNotFoundError, match="no such input"):
        open_source(tmp_path / "nope")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.md").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"no images or \.tar shards"):
        open_source(tmp_path / "notes")
    np.save(tmp_path / "emb.npy", np.zeros((2, 2)))
    with pytest.raises(ValueError, match="not an image folder, a table"):
        open_source(tmp_path / "emb.npy")
    with pytest.raises(ValueError, match="table input"):
        open_source(tmp_path / "photos", caption_column="alt")
    with pytest.raises(FileNotFoundError, match="no such shard"):
        open_source(str(tmp_path / "{00000..00002}.tar"))


def test_folder_scan_and_case_insensitive_suffixes(tmp_path: Path) -> None:
    root = mixed_folder(tmp_path / "photos")
    scan = scan_folder(root)
    assert [p.relative_to(root).as_posix() for p in scan.images] == sorted([*IMAGES, BROKEN], key=Path)
    assert [p.relative_to(root).as_posix() for p in scan.other] == [NOT_AN_IMAGE]
    assert sources.is_image_file("X.TIFF") and sources.is_image_file("a.b.Jpeg") and not sources.is_image_file("a.txt")
    assert sources.image_member({"txt": b"", "png": b"", "jpg": b""}) == "jpg"
    assert sources.image_member({"txt": b""}) is None
    assert sources.split_member_name("dir/000.JPG") == ("dir/000", "jpg")


def test_tokenizer_json_is_found_before_vocab_txt(tmp_path: Path) -> None:
    from openalign.text import load_tokenizer, train_wordpiece

    assert find_tokenizer_file(tmp_path) is None
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\na\n")
    assert find_tokenizer_file(tmp_path) == tmp_path / "vocab.txt"
    tok = train_wordpiece(["a red square", "a blue circle"] * 5, vocab_size=40, min_frequency=1)
    tok.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(sources.TOKENIZER_FILES)
    assert find_tokenizer_file(tmp_path) == tmp_path / "tokenizer.json"
    assert find_tokenizer_file(tmp_path / "vocab.txt") == tmp_path / "vocab.txt"
    (tmp_path / "vocab.txt").write_text("[PAD]\n")  # a broken vocab.txt is never looked at
    assert load_tokenizer(tmp_path).vocab_size == tok.vocab_size


def test_batched_and_bad_batch_size() -> None:
    assert list(batched(range(5), 2)) == [[0, 1], [2, 3], [4]]
    assert list(batched([], 3)) == []
    with pytest.raises(ValueError, match="at least 1"):
        list(batched(range(3), 0))


def test_sources_is_model_free() -> None:
    tree = ast.parse(Path(sources.__file__).read_text())
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]
    assert not [m for m in imported if m and m.split(".")[:2] in (["openalign", "model"], ["openalign", "train"])]
    assert not [m for m in imported if m in ("openalign.loss", "openalign.optim", "torch")]
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    # At import, only ``BadInput``'s own module (the standard library alone) beside it.
    top_modules = [n.module for n in top if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("openalign")]
    assert top_modules == ["openalign.data.bad_input"]
    bad_input = ast.parse(Path(sources.__file__).with_name("bad_input.py").read_text())
    assert not [n for n in ast.walk(bad_input) if isinstance(n, ast.ImportFrom) and n.module != "__future__"]
    assert not [n for n in ast.walk(bad_input) if isinstance(n, ast.Import)]
