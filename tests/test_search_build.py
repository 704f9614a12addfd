"""Index building from folders and shards: embeddings, metadata, resume, growth, CLI."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

import openalign
from conftest import save_tiny_checkpoint
from openalign.cli import main
from openalign.data.transforms import model_transform
from openalign.embed import embed_images, embed_texts
from openalign.search import build as build_mod
from openalign.search.build import BuildConfig, build_index
from openalign.search.catalog import SearchIndex
from openalign.search.query import Query, Searcher

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 20)}


def picture(i: int) -> tuple[Image.Image, str]:
    name = list(COLOURS)[i % 4]
    rng = np.random.default_rng(i)
    arr = np.clip(np.array(COLOURS[name]) + rng.integers(-20, 20, (40 + i % 3, 48, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(arr), f"a {name} square number {i}"


def write_folder(root, indices) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for i in indices:
        image, caption = picture(i)
        image.save(root / f"img{i:03d}.png")
        (root / f"img{i:03d}.txt").write_text(caption)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    captions = [picture(i)[1] for i in range(40)] + ["red green blue yellow"]
    return save_tiny_checkpoint(tmp_path_factory.mktemp("model"), captions, vocab_size=90)


@pytest.fixture(scope="module")
def model_and_tokenizer(model_dir):
    return openalign.load_model(model_dir), openalign.load_tokenizer(model_dir)


def test_build_embeds_images_and_captions_in_id_order(tmp_path, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    write_folder(tmp_path / "imgs", range(12))
    (tmp_path / "imgs" / "broken.jpg").write_bytes(b"\xff\xd8\xff not a jpeg")
    (tmp_path / "imgs" / "empty.png").write_bytes(b"")
    stats = build_index(
        model, tokenizer, tmp_path / "imgs", tmp_path / "idx", BuildConfig(captions=True, chunk_size=5), progress=False
    )
    assert stats.images == 12 and stats.captions == 12
    assert stats.skipped == {"corrupt": 1, "empty": 1}
    index = SearchIndex.open(tmp_path / "idx")
    rows = index.meta["image"].to_pylist()
    assert [r["id"] for r in rows] == list(range(12))
    assert [r["key"] for r in rows] == [f"img{i:03d}.png" for i in range(12)]
    assert rows[4]["caption"] == "a red square number 4" and (rows[4]["width"], rows[4]["height"]) == (48, 41)
    # The stored vectors are exactly what the shared embedding path gives for the same images and texts.
    images = [picture(i)[0] for i in range(12)]
    want = embed_images(model, images, transform=model_transform(model.config)).numpy()
    np.testing.assert_allclose(np.asarray(index.stores["image"].vectors), want, atol=1e-5)
    texts = embed_texts(model, tokenizer, [picture(i)[1] for i in range(12)]).numpy()
    np.testing.assert_allclose(np.asarray(index.stores["text"].vectors), texts, atol=1e-5)
    assert index.meta["text"].column("image_id").to_pylist() == list(range(12))
    thumb = index.thumbnails.get(3)
    assert thumb is not None and Image.open(io.BytesIO(thumb)).size == picture(3)[0].size
    assert json.loads((tmp_path / "idx" / "index.json").read_text())["skipped"] == {"corrupt": 1, "empty": 1}
    assert not (tmp_path / "idx" / "pending").exists()


def test_search_kinds_over_a_built_index(tmp_path, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    write_folder(tmp_path / "imgs", range(16))
    build_index(model, tokenizer, tmp_path / "imgs", tmp_path / "idx", BuildConfig(captions=True), progress=False)
    searcher = Searcher(SearchIndex.open(tmp_path / "idx"), model, tokenizer)
    vectors = np.asarray(searcher.index.stores["image"].vectors)
    # text → image: the ranking is the exact cosine ranking of the text's embedding.
    q = embed_texts(model, tokenizer, ["a blue square"]).numpy()[0]
    hits = searcher.search(Query(text="a blue square", k=5))
    assert [h.id for h in hits] == list(np.argsort(-(vectors @ q), kind="stable")[:5])
    np.testing.assert_allclose([h.score for h in hits], np.sort(vectors @ q)[::-1][:5], atol=1e-5)
    # image → image finds the image itself first.
    image, _ = picture(7)
    assert searcher.search(Query(image=image, k=1))[0].id == 7
    assert searcher.search(Query(image_id=9, k=1))[0].score == pytest.approx(1.0, abs=1e-5)
    # image → text returns captions with the image they belong to.
    text_hits = searcher.search(Query(image_id=2, modality="text", k=3))
    assert all(h.row["image_id"] == h.id for h in text_hits)
    # image + text arithmetic uses the paper's weights.
    plus = embed_texts(model, tokenizer, ["yellow"]).numpy()[0]
    combined = vectors[2] + 2 * plus
    combined /= np.linalg.norm(combined)
    hits = searcher.search(Query(image_id=2, plus=["yellow"], k=4))
    assert [h.id for h in hits] == list(np.argsort(-(vectors @ combined), kind="stable")[:4])
    # dedup drops near copies: with threshold just below 1 every result differs from the better ones.
    deduped = searcher.search(Query(text="red", k=16, dedup=0.5))
    kept = vectors[[h.id for h in deduped]]
    assert len(deduped) < 16 and (np.triu(kept @ kept.T, 1) <= 0.5 + 1e-6).all()


def test_interrupted_build_resumes_after_the_last_finished_chunk(tmp_path, model_and_tokenizer, monkeypatch):
    model, tokenizer = model_and_tokenizer
    write_folder(tmp_path / "imgs", range(10))
    real = build_mod._embed_chunk
    calls: list[int] = []

    def dying(items, *args):
        calls.append(len(items))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(items, *args)

    monkeypatch.setattr(build_mod, "_embed_chunk", dying)
    cfg = BuildConfig(captions=True, chunk_size=3)
    with pytest.raises(KeyboardInterrupt):
        build_index(model, tokenizer, tmp_path / "imgs", tmp_path / "idx", cfg, progress=False)
    assert sorted(p.name for p in (tmp_path / "idx" / "pending").glob("chunk-*")) == ["chunk-000000", "chunk-000001"]
    calls.clear()
    monkeypatch.setattr(build_mod, "_embed_chunk", lambda items, *a: calls.append(len(items)) or real(items, *a))
    stats = build_index(model, tokenizer, tmp_path / "imgs", tmp_path / "idx", cfg, progress=False)
    assert calls == [3, 1]  # chunks 2 and 3 only
    assert stats.images == 10
    with pytest.raises(ValueError, match="chunk_size"):
        (tmp_path / "idx" / "pending").mkdir()
        (tmp_path / "idx" / "pending" / "manifest.json").write_text(json.dumps({"chunk_size": 99}))
        build_index(model, tokenizer, tmp_path / "imgs", tmp_path / "idx", cfg, progress=False)


@pytest.mark.parametrize(
    ("setting", "value", "shown"),
    [("max_file_mb", 0.001, "max_file_mb (was 64.0, now 0.001)"),
     ("allow_outside_root", True, "allow_outside_root (was False, now True)"),
     ("max_pixels", 100, "max_pixels (was 64000000, now 100)")],
)  # fmt: skip
def test_a_resume_under_other_limits_is_refused_naming_both_values(
    tmp_path, model_and_tokenizer, monkeypatch, setting, value, shown
):
    """Chunks already embedded kept the items their limits let through; resuming under other limits would
    mix two selections in one index, so it is refused before any chunk is embedded."""
    model, tokenizer = model_and_tokenizer
    write_folder(tmp_path / "imgs", range(6))
    real = build_mod._embed_chunk
    calls: list[int] = []

    def dying(items, *args):
        calls.append(len(items))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(items, *args)

    monkeypatch.setattr(build_mod, "_embed_chunk", dying)
    with pytest.raises(KeyboardInterrupt):
        build_index(model, tokenizer, tmp_path / "imgs", tmp_path / "idx", BuildConfig(chunk_size=3), progress=False)
    calls.clear()
    monkeypatch.setattr(build_mod, "_embed_chunk", lambda items, *a: calls.append(len(items)) or real(items, *a))
    changed = BuildConfig(chunk_size=3, **{setting: value})
    with pytest.raises(ValueError, match="unfinished build") as refused:
        build_index(model, tokenizer, tmp_path / "imgs", tmp_path / "idx", changed, progress=False)
    assert shown in str(refused.value) and "\n" not in str(refused.value)
    assert calls == []
    stats = build_index(
        model, tokenizer, tmp_path / "imgs", tmp_path / "idx", BuildConfig(chunk_size=3), progress=False
    )
    assert calls == [3] and stats.images == 6


def test_adding_items_keeps_ids_and_skips_known_keys(tmp_path, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    write_folder(tmp_path / "imgs", range(6))
    cfg = BuildConfig(captions=True)
    build_index(model, tokenizer, tmp_path / "imgs", tmp_path / "idx", cfg, progress=False)
    before = np.asarray(SearchIndex.open(tmp_path / "idx").stores["image"].vectors).copy()
    write_folder(tmp_path / "imgs", range(6, 9))
    stats = build_index(model, tokenizer, tmp_path / "imgs", tmp_path / "idx", cfg, progress=False)
    assert (stats.added_images, stats.already_indexed, stats.images) == (3, 6, 9)
    index = SearchIndex.open(tmp_path / "idx")
    np.testing.assert_array_equal(np.asarray(index.stores["image"].vectors)[:6], before)
    assert index.meta["image"].column("key").to_pylist()[6:] == ["img006.png", "img007.png", "img008.png"]
    assert index.meta["text"].column("image_id").to_pylist() == list(range(9))
    assert len(index.thumbnails) == 9 and index.thumbnails.get(8) is not None
    again = build_index(model, tokenizer, tmp_path / "imgs", tmp_path / "idx", cfg, progress=False)
    assert again.added_images == 0 and again.images == 9
    assert again.to_dict()["already_indexed"] == 9
    with pytest.raises(ValueError, match="captions"):
        build_index(model, tokenizer, tmp_path / "imgs", tmp_path / "idx", BuildConfig(), progress=False)


def test_build_from_webdataset_shards(tmp_path, model_and_tokenizer):
    from openalign.data.shards import write_shards

    model, tokenizer = model_and_tokenizer
    samples = [
        {"key": f"{i:05d}", "jpg": picture(i)[0], "txt": picture(i)[1], "json": {"url": f"http://x/{i}.jpg"}}
        for i in range(7)
    ]
    write_shards(samples, tmp_path / "shards", samples_per_shard=4)
    stats = build_index(
        model, tokenizer, str(tmp_path / "shards" / "{00000..00001}.tar"), tmp_path / "idx", progress=False
    )
    assert stats.images == 7
    table = pq.read_table(tmp_path / "idx" / "image" / "metadata.parquet").to_pylist()
    assert table[5]["key"] == "00001.tar/00005" and table[5]["url"] == "http://x/5.jpg"
    assert table[5]["caption"] == "a green square number 5"


def test_cli_index_build_and_search(tmp_path, model_dir, capsys):
    write_folder(tmp_path / "imgs", range(8))
    out = tmp_path / "idx"
    args = ["index", "build", "--model", str(model_dir), "--images", str(tmp_path / "imgs"), "--out", str(out)]
    assert main([*args, "--captions", "--quiet", "--chunk-size", "4"]) == 0
    assert "+8 images (+8 captions)" in capsys.readouterr().out
    assert main(["search", str(out), "--image-id", "3", "-k", "2", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results[0]["id"] == 3 and len(results) == 2
    picture(5)[0].save(tmp_path / "q.png")
    assert main(["search", str(out), "--image", str(tmp_path / "q.png"), "--plus", "red", "--modality", "text"]) == 0
    assert "square number" in capsys.readouterr().out
    assert main(["search", str(out), "-k", "0", "--text", "red"]) == 2
    assert "k must be" in capsys.readouterr().err
    assert main(["search", str(out)]) == 2
    assert "empty query" in capsys.readouterr().err
    bad = ["index", "build", "--model", str(model_dir), "--images", str(tmp_path / "nope"), "--out", str(out)]
    assert main(bad) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(["index", "info", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["images"] == 8


def test_search_and_serve_refuse_a_model_other_than_the_one_that_built_the_index(tmp_path, model_dir, capsys):
    import shutil

    import torch

    from conftest import tiny_overrides
    from openalign.search.api import load_searchers

    write_folder(tmp_path / "imgs", range(4))
    out = tmp_path / "idx"
    build = ["index", "build", "--model", str(model_dir), "--images", str(tmp_path / "imgs"), "--out", str(out)]
    assert main([*build, "--quiet"]) == 0
    # Another model of the same width (other weights), with the same tokenizer beside it.
    other = shutil.copytree(model_dir, tmp_path / "other")
    vocab = openalign.load_model(model_dir).config.text.vocab_size
    torch.manual_seed(1)
    openalign.save_model(openalign.create_model("nano", **tiny_overrides(text={"vocab_size": vocab})), other)
    capsys.readouterr()
    assert main(["search", str(out), "--model", str(other), "--text", "a red square"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"openalign search: error: {out / 'index.json'}: the index was built by ")
    assert f"but {other} has weights sha256 " in err and err.endswith("or pass --allow-other-model")
    assert main(["search", str(out), "--model", str(other), "--text", "a red square", "--allow-other-model"]) == 0
    assert main(["search", str(out), "--text", "a red square"]) == 0  # its own model
    assert "warning" not in capsys.readouterr().err
    with pytest.raises(ValueError, match="the index was built by"):  # serve's loader, the same check
        load_searchers({"idx": out}, other)
    # index.json naming another model is the same mismatch.
    info = json.loads((out / "index.json").read_text())
    (out / "index.json").write_text(json.dumps({**info, "model": str(other)}))
    assert main(["search", str(out), "--text", "a red square"]) == 2
    assert "the index was built by" in capsys.readouterr().err
    # An index from before fingerprints: a warning, and the search goes on.
    (out / "index.json").write_text(json.dumps({k: v for k, v in info.items() if k != "fingerprint"}))
    assert main(["search", str(out), "--model", str(other), "--text", "a red square"]) == 0
    assert capsys.readouterr().err.count("records no fingerprint of the model that built it") == 1
    # Adding to an index with another model would mix incomparable vectors.
    (out / "index.json").write_text(json.dumps(info))
    write_folder(tmp_path / "imgs", range(4, 6))
    assert main(["index", "build", "--model", str(other), "--images", str(tmp_path / "imgs"), "--out", str(out)]) == 2
    assert "built by another model" in capsys.readouterr().err


def test_an_output_holding_the_shards_a_spec_names_is_refused(tmp_path, model_dir, capsys):
    from openalign.data.shards import write_shards

    samples = [{"key": f"{i:05d}", "jpg": picture(i)[0], "txt": picture(i)[1]} for i in range(6)]
    shards = tmp_path / "shards"
    write_shards(samples, shards, samples_per_shard=3)
    before = sorted(p.name for p in shards.iterdir())
    for spec in (f"{shards}/{{00000..00001}}.tar", f"{shards}/*.tar", str(shards)):
        argv = ["index", "build", "--model", str(model_dir), "--images", spec, "--out", str(shards), "--quiet"]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "holds, the input" in err[0], err
        assert sorted(p.name for p in shards.iterdir()) == before
