"""Indexes from embeddings made elsewhere: a .npy with a Parquet table, and the folders clip-retrieval's
inference writes (made here by its own ``NumpyWriter``); validation; search by embedding, and by text once
a model of the same width is attached."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import openalign
from conftest import save_tiny_checkpoint
from openalign.cli import main
from openalign.embed import embed_texts
from openalign.search.catalog import SearchIndex


def _clip_retrieval_writer():
    """clip-retrieval's inference writer, loaded by file path: the package's __init__ imports its whole back end."""
    package = importlib.util.find_spec("clip_retrieval")
    if package is None or package.origin is None:
        pytest.skip("clip-retrieval is not installed (.ci/run installs it with --no-deps)")
    writer = Path(package.origin).parent / "clip_inference" / "writer.py"
    spec = importlib.util.spec_from_file_location("clip_retrieval_writer", writer)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _vectors(n: int, d: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, d))


def _search_json(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict]:
    capsys.readouterr()
    assert main(["search", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_npy_and_parquet_become_an_index_searchable_by_embedding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    emb = _vectors(30, 12, 0) * 3.0  # not unit length: normalised on the way in
    np.save(tmp_path / "emb.npy", emb)
    meta = {
        "image_path": [f"/photos/{i}.jpg" for i in range(30)],
        "caption": [f"photo {i}" for i in range(30)],
        "url": [f"https://example.org/{i}.jpg" for i in range(30)],
        "NSFW": ["UNLIKELY"] * 30,
    }
    pq.write_table(pa.table(meta), tmp_path / "meta.parquet")
    out = tmp_path / "idx"
    argv = ["index", "build", "--embeddings", str(tmp_path / "emb.npy"), "--metadata", str(tmp_path / "meta.parquet")]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "30 images" in printed and "normalised 30 rows" in printed and "no model attached" in printed

    index = SearchIndex.open(out)
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    np.testing.assert_allclose(np.asarray(index.stores["image"].vectors), unit, atol=1e-6)
    assert index.rows("image", [7])[0] | {} == {
        "id": 7, "key": "/photos/7.jpg", "path": "/photos/7.jpg", "url": "https://example.org/7.jpg",
        "caption": "photo 7", "width": None, "height": None,
    }  # fmt: skip

    query = _vectors(1, 12, 1)[0]
    np.save(tmp_path / "q.npy", query)
    hits = _search_json(capsys, str(out), "--embedding", str(tmp_path / "q.npy"), "-k", "5")
    expected = np.argsort(-(unit @ query))[:5]
    assert [h["id"] for h in hits] == expected.tolist()
    assert hits[0]["score"] == pytest.approx(float(unit[expected[0]] @ query / np.linalg.norm(query)), abs=1e-5)
    inline = _search_json(capsys, str(out), "--embedding", json.dumps(query.tolist()), "-k", "5")
    assert [h["id"] for h in inline] == expected.tolist()

    err = _error(capsys, ["search", str(out), "--text", "a photo"])
    assert "has none attached" in err and "12-d" in err
    err = _error(capsys, ["search", str(out), "--embedding", json.dumps([1.0, 2.0])])
    assert "has 2 numbers" in err and "12-d" in err


def test_clip_retrieval_inference_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    writer_module = _clip_retrieval_writer()
    folder = tmp_path / "embeddings"
    image_emb = np.concatenate([_vectors(7, 16, 2), _vectors(5, 16, 3)]).astype(np.float16)
    text_emb = np.concatenate([_vectors(7, 16, 4), _vectors(5, 16, 5)]).astype(np.float16)
    image_emb /= np.linalg.norm(image_emb.astype(np.float32), axis=1, keepdims=True).astype(np.float16)
    text_emb /= np.linalg.norm(text_emb.astype(np.float32), axis=1, keepdims=True).astype(np.float16)
    for part, rows in enumerate([range(0, 7), range(7, 12)]):
        writer = writer_module.NumpyWriter(part, str(folder), True, True, True, 2)
        writer(
            {
                "image_embs": image_emb[rows.start : rows.stop],
                "image_filename": [f"img/{i}.jpg" for i in rows],
                "text_embs": text_emb[rows.start : rows.stop],
                "text": [f"caption {i}" for i in rows],
                "metadata": [json.dumps({"url": f"http://example.org/{i}", "key": f"{i:05d}"}) for i in rows],
            }
        )
        writer.flush()
    assert sorted(p.name for p in (folder / "img_emb").iterdir()) == ["img_emb_0.npy", "img_emb_1.npy"]

    out = tmp_path / "idx"
    assert main(["index", "build", "--embeddings", str(folder), "--out", str(out)]) == 0
    assert "12 images and 12 captions" in capsys.readouterr().out
    index = SearchIndex.open(out)
    assert index.size("image") == 12 and index.size("text") == 12
    row = index.rows("image", [9])[0]
    assert (row["key"], row["path"], row["url"], row["caption"]) == (
        "00009", "img/9.jpg", "http://example.org/9", "caption 9",
    )  # fmt: skip
    assert index.rows("text", [9])[0] == {"id": 9, "image_id": 9, "key": "00009", "caption": "caption 9"}

    query = text_emb[9].astype(np.float32)
    for modality, store in (("image", image_emb), ("text", text_emb)):
        hits = _search_json(capsys, str(out), "--embedding", json.dumps(query.tolist()), "--modality", modality)
        unit = store.astype(np.float32)
        unit /= np.linalg.norm(unit, axis=1, keepdims=True)
        assert [h["id"] for h in hits] == np.argsort(-(unit @ query), kind="stable")[:10].tolist()


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("rows", "has 5 rows but"),
        ("one_d", "expected a 2-D"),
        ("ints", "floating-point"),
        ("nan", "row 2 holds NaN"),
        ("zero", "row 1 is all zeros"),
        ("no_metadata", "--metadata"),
        ("pickle", "not a NumPy .npy"),
        ("width", "column 'width' is not whole numbers"),
    ],
)
def test_bad_embeddings_are_one_line_errors_and_leave_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, message: str
) -> None:
    emb = _vectors(5, 4, 0)
    if case == "one_d":
        emb = emb[:, 0]
    elif case == "ints":
        emb = np.ones((5, 4), np.int32)
    elif case == "nan":
        emb[2, 1] = np.nan
    elif case == "zero":
        emb[1] = 0
    if case == "pickle":
        (tmp_path / "emb.npy").write_bytes(b"not an array")
    else:
        np.save(tmp_path / "emb.npy", emb)
    columns = {"caption": [str(i) for i in range(4 if case == "rows" else 5)]}
    if case == "width":
        columns["width"] = ["wide"] * 5
    pq.write_table(pa.table(columns), tmp_path / "m.parquet")
    argv = ["index", "build", "--embeddings", str(tmp_path / "emb.npy"), "--out", str(tmp_path / "idx")]
    if case != "no_metadata":
        argv += ["--metadata", str(tmp_path / "m.parquet")]
    assert message in _error(capsys, argv)
    assert not (tmp_path / "idx").exists()


def test_shards_of_different_widths_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for part, dim in enumerate([8, 6]):
        (tmp_path / "e" / "img_emb").mkdir(parents=True, exist_ok=True)
        (tmp_path / "e" / "metadata").mkdir(exist_ok=True)
        np.save(tmp_path / "e" / "img_emb" / f"img_emb_{part}.npy", _vectors(3, dim, part).astype(np.float32))
        pq.write_table(pa.table({"caption": ["a", "b", "c"]}), tmp_path / "e" / "metadata" / f"metadata_{part}.parquet")
    err = _error(capsys, ["index", "build", "--embeddings", str(tmp_path / "e"), "--out", str(tmp_path / "idx")])
    assert "6-d embeddings" in err and "8-d" in err


def test_attached_model_answers_text_queries_and_must_match_the_width(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    captions = [f"a {c} square" for c in ("red", "green", "blue", "yellow", "white", "black")]
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", captions * 10, vocab_size=80, min_frequency=1)
    model, tokenizer = openalign.load_model(ckpt), openalign.load_tokenizer(ckpt)
    # Stand-ins for image embeddings made elsewhere with the same model: its caption embeddings.
    emb = embed_texts(model, tokenizer, captions).numpy()
    np.save(tmp_path / "emb.npy", emb)
    pq.write_table(pa.table({"caption": captions}), tmp_path / "m.parquet")
    base = ["index", "build", "--embeddings", str(tmp_path / "emb.npy"), "--metadata", str(tmp_path / "m.parquet")]
    assert main([*base, "--model", str(ckpt), "--out", str(tmp_path / "idx")]) == 0
    hits = _search_json(capsys, str(tmp_path / "idx"), "--text", "a blue square", "-k", "1")
    assert hits[0]["caption"] == "a blue square" and hits[0]["score"] == pytest.approx(1.0, abs=1e-5)

    np.save(tmp_path / "wide.npy", np.concatenate([emb, emb], axis=1))
    wide = ["index", "build", "--embeddings", str(tmp_path / "wide.npy"), "--metadata", str(tmp_path / "m.parquet")]
    err = _error(capsys, [*wide, "--model", str(ckpt), "--out", str(tmp_path / "idx2")])
    assert "the model makes 24-d embeddings" in err and "48-d" in err


def test_image_files_are_served_only_inside_the_declared_image_root(tmp_path: Path) -> None:
    """The metadata of an imported index names files; /image/{id} reads one only if, with ``..`` and links
    resolved, it lies inside ``--image-root``, and answers every other case with the same 404."""
    from fastapi.testclient import TestClient
    from PIL import Image

    from openalign.search.api import create_app
    from openalign.search.query import Searcher

    photos, private = tmp_path / "photos", tmp_path / "private"
    (photos / "sub").mkdir(parents=True)
    private.mkdir()
    Image.new("RGB", (40, 30), (200, 20, 20)).save(photos / "sub" / "in.jpg")
    Image.new("RGB", (40, 30), (20, 200, 20)).save(private / "secret.jpg")
    (photos / "notes.jpg").write_text("not an image")
    (photos / "link.jpg").symlink_to(private / "secret.jpg")
    paths = [
        "sub/in.jpg",  # 0: relative, inside: served
        str(photos / "sub" / "in.jpg"),  # 1: absolute, inside: served
        str(private / "secret.jpg"),  # 2: absolute, outside
        "../private/secret.jpg",  # 3: relative, climbs out
        "sub/../../private/secret.jpg",  # 4: climbs out through a folder
        "link.jpg",  # 5: a link inside that points outside
        "notes.jpg",  # 6: inside, not an image
        "sub/missing.jpg",  # 7: inside, no such file
        "",  # 8: no path
    ]
    np.save(tmp_path / "emb.npy", _vectors(len(paths), 8, 0))
    pq.write_table(pa.table({"image_path": paths, "caption": ["x"] * len(paths)}), tmp_path / "meta.parquet")
    argv = ["index", "build", "--embeddings", str(tmp_path / "emb.npy"), "--metadata", str(tmp_path / "meta.parquet")]
    assert main([*argv, "--out", str(tmp_path / "rooted"), "--image-root", str(photos)]) == 0
    assert main([*argv, "--out", str(tmp_path / "rootless")]) == 0

    rooted = TestClient(create_app(Searcher(SearchIndex.open(tmp_path / "rooted"))))
    for image_id in (0, 1):
        served = rooted.get(f"/image/{image_id}")
        assert served.status_code == 200 and served.headers["content-type"] == "image/jpeg"
    bodies = {rooted.get(f"/image/{i}").text.replace(str(i), "N") for i in (*range(2, len(paths)), 999)}
    assert bodies == {'{"detail":"image N is not available"}'}
    rootless = TestClient(create_app(Searcher(SearchIndex.open(tmp_path / "rootless"))))
    assert {rootless.get(f"/image/{i}").status_code for i in range(len(paths))} == {404}
    assert main([*argv, "--out", str(tmp_path / "bad"), "--image-root", str(tmp_path / "nope")]) == 2
