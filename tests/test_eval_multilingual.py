"""Multi30K multilingual retrieval: file layout, per-language recall and the paper's mean recall."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import openalign
from openalign.eval import multilingual as ml
from openalign.text import train_wordpiece

IMAGES = ["1000092795.jpg", "10002456.jpg", "1000268201.jpg"]
CAPTIONS = {
    "en": ["two young men outside", "several men in hard hats", "a child in a pink dress"],
    "de": ["zwei junge männer im freien", "mehrere männer mit schutzhelmen", "ein kind in einem rosa kleid"],
    "fr": ["deux jeunes hommes dehors", "plusieurs hommes en casque", "une enfant en robe rose"],
}


def write_multi30k(root: Path) -> tuple[Path, Path]:
    raw = root / "raw"
    raw.mkdir(parents=True)
    splits = root / "image_splits"
    splits.mkdir()
    (splits / "test_2016_flickr.txt").write_text("\n".join(IMAGES) + "\n")
    (raw / "test_2016_flickr.en").write_text("\n".join(CAPTIONS["en"]) + "\n")
    (raw / "test_2016_flickr.de").write_text("\n".join(CAPTIONS["de"]) + "\n", encoding="utf-8")
    # The Multi30K repository ships its caption files gzipped.
    (raw / "test_2016_flickr.fr.gz").write_bytes(gzip.compress(("\n".join(CAPTIONS["fr"]) + "\n").encode()))
    return raw, splits / "test_2016_flickr.txt"


def test_load_multi30k(tmp_path: Path) -> None:
    raw, image_list = write_multi30k(tmp_path)
    data = ml.load_multi30k(raw, image_list, ["en", "de", "fr"])
    assert data.image_files == IMAGES and data.captions == CAPTIONS
    with pytest.raises(FileNotFoundError, match=r"test_2016_flickr\.cs"):
        ml.load_multi30k(raw, image_list, ["cs"])
    (raw / "test_2016_flickr.de").write_text("zwei junge männer im freien\n")
    with pytest.raises(ValueError, match="1 captions for the 3 images"):
        ml.load_multi30k(raw, image_list, ["de"])
    (raw / "test_2016_flickr.de").write_text("a\n\nc\n")
    with pytest.raises(ValueError, match=r"test_2016_flickr\.de:2: empty caption"):
        ml.load_multi30k(raw, image_list, ["de"])
    (raw / "test_2016_flickr.de").write_bytes(b"\xff\xfe\n\n\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        ml.load_multi30k(raw, image_list, ["de"])
    with pytest.raises(ValueError, match="no languages"):
        ml.load_multi30k(raw, image_list, [])
    (image_list).write_text("")
    with pytest.raises(ValueError, match="image list is empty"):
        ml.load_multi30k(raw, image_list, ["en"])


def test_mean_recall_hand_computed() -> None:
    img = torch.eye(3)
    # en: perfect. de: caption 0 points at image 1 and caption 1 at image 0 (a swap), caption 2 right.
    en = torch.eye(3)
    de = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    m = ml.evaluate_multilingual(img, {"en": en, "de": de}, ks=(1, 2))
    assert m["en_mean_recall"] == 100.0
    # de, caption 0: its image 0 scores 0, image 1 scores 1 and image 2 ties at 0; ties count against, so
    # its rank is 2 and it misses at K=2 too. Caption 1 likewise; caption 2 is first. I2T mirrors this.
    assert (m["de_t2i_r1"], m["de_t2i_r2"]) == pytest.approx((100 / 3, 100 / 3))
    assert (m["de_i2t_r1"], m["de_i2t_r2"]) == pytest.approx((100 / 3, 100 / 3))
    assert m["de_mean_recall"] == pytest.approx(100 / 3)
    assert m["num_images"] == 3
    assert ml.mean_recall({"i2t_r1": 10, "i2t_r5": 20, "i2t_r10": 30, "t2i_r1": 40, "t2i_r5": 50, "t2i_r10": 60}) == 35
    with pytest.raises(ValueError, match="t2i_r10"):
        ml.mean_recall({"i2t_r1": 1.0})
    with pytest.raises(ValueError, match="de: 2 caption embeddings for 3 images"):
        ml.evaluate_multilingual(img, {"de": de[:2]})


def test_run_multilingual_end_to_end(tmp_path: Path, tiny_model: openalign.DualEncoder) -> None:
    raw, image_list = write_multi30k(tmp_path)
    images = tmp_path / "flickr30k-images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for name in IMAGES[:2]:
        Image.fromarray(rng.integers(0, 255, (36, 36, 3), dtype=np.uint8)).save(images / name)
    tok = train_wordpiece([c for caps in CAPTIONS.values() for c in caps] * 5, vocab_size=101, min_frequency=1)
    with pytest.raises(FileNotFoundError, match=IMAGES[2]):
        ml.run_multilingual(tiny_model, tok, raw, image_list, images, languages=["en", "fr"])
    Image.fromarray(rng.integers(0, 255, (36, 36, 3), dtype=np.uint8)).save(images / IMAGES[2])
    m = ml.run_multilingual(tiny_model, tok, raw, image_list, images, languages=["en", "fr"])
    assert {"en_mean_recall", "fr_mean_recall", "en_i2t_r10", "fr_t2i_r1"} <= set(m)
    assert m["en_i2t_r10"] == 100.0  # only 3 candidates


def test_cli_multilingual(tmp_path: Path) -> None:
    import json

    from conftest import tiny_overrides
    from openalign.cli import main

    raw, image_list = write_multi30k(tmp_path)
    images = tmp_path / "imgs"
    images.mkdir()
    rng = np.random.default_rng(0)
    for name in IMAGES:
        Image.fromarray(rng.integers(0, 255, (36, 36, 3), dtype=np.uint8)).save(images / name)
    tok = train_wordpiece([c for caps in CAPTIONS.values() for c in caps] * 5, vocab_size=101, min_frequency=1)
    torch.manual_seed(0)
    model = openalign.create_model("nano", **tiny_overrides(text={"vocab_size": tok.vocab_size}))
    openalign.save_model(model, tmp_path / "ckpt")
    tok.save(tmp_path / "ckpt")
    argv = ["eval", "multilingual", "--model", str(tmp_path / "ckpt"), "--captions", str(raw)]
    argv += ["--image-list", str(image_list), "--images", str(images), "--out", str(tmp_path / "res")]
    assert main([*argv, "--languages", "en", "de", "fr"]) == 0
    [result] = [json.loads(p.read_text()) for p in (tmp_path / "res").glob("multilingual-*.json")]
    assert result["dataset"] == "multi30k-test_2016_flickr"
    assert {"en_mean_recall", "de_mean_recall", "fr_mean_recall"} <= set(result["metrics"])
    assert main([*argv, "--languages", "cs"]) == 2
