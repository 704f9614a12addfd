"""Crisscrossed Captions: file formats, the extended-positive rule, recall with positive sets, bootstrap ρ."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.stats import spearmanr

import openalign
from openalign.eval import cxc
from openalign.text import train_wordpiece

# The test split: 4 images × 2 captions (sentids 10..17); one val and one train image that CxC test rows
# must never resolve to.
IMAGES = [f"COCO_val2014_{i:012d}.jpg" for i in (101, 102, 103, 104)]
CAPTIONS = [
    "a red bus on a street",
    "a bus parked by the road",
    "a dog on a couch",
    "a puppy sleeping on a sofa",
    "a plate of pasta",
    "spaghetti on a white plate",
    "a man riding a wave",
    "a surfer in the ocean",
]


def sid(n: int) -> str:
    return f"COCO_val2014:sentid:{n}"


def write_karpathy(path: Path) -> Path:
    images = []
    for i, name in enumerate(IMAGES):
        sents = [{"sentid": 10 + 2 * i + j, "raw": CAPTIONS[2 * i + j] + " ", "tokens": []} for j in range(2)]
        images.append(
            {
                "filepath": "val2014",
                "filename": name,
                "split": "test",
                "sentids": [s["sentid"] for s in sents],
                "imgid": i,
                "sentences": sents,
                "cocoid": 101 + i,
            }
        )
    images.append(
        {
            "filepath": "val2014",
            "filename": "COCO_val2014_000000000900.jpg",
            "split": "val",
            "sentids": [90],
            "sentences": [{"sentid": 90, "raw": "a cat"}],
        }
    )
    images.append(
        {
            "filepath": "train2014",
            "filename": "COCO_train2014_000000000901.jpg",
            "split": "train",
            "sentids": [91],
            "sentences": [{"sentid": 91, "raw": "a kite"}],
        }
    )
    path.write_text(json.dumps({"images": images, "dataset": "coco"}))
    return path


def write_cxc(directory: Path, split: str = "test") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"sts_{split}.csv").write_text(
        "caption1,caption2,agg_score,sampling_method\n"
        f"{sid(10)},{sid(11)},4.2,c2c_cocaption\n"  # co-captions rated >= 3: a T2T positive
        f"{sid(12)},{sid(13)},2.9,c2c_cocaption\n"  # co-captions rated < 3: not a positive
        f"{sid(14)},{sid(16)},3.0,c2c_isim\n"  # exactly 3: positive
        f"{sid(15)},{sid(17)},0.4,c2c_isim\n"
    )
    (directory / f"sis_{split}.csv").write_text(
        "image1,image2,agg_score,sampling_method\n"
        f"{IMAGES[0]},{IMAGES[1]},3.5,i2i_csim\n"
        f"{IMAGES[2]},{IMAGES[3]},1.0,i2i_csim\n"
    )
    (directory / f"sits_{split}.csv").write_text(
        "caption,image,agg_score,sampling_method\n"
        f"{sid(12)},{IMAGES[3]},3.2,c2i_intrasim\n"  # a new cross-modal positive
        f"{sid(16)},{IMAGES[0]},1.1,c2i_intrasim\n"
        f"{sid(10)},{IMAGES[0]},4.9,c2i_original\n"
    )
    return directory


@pytest.fixture
def data(tmp_path: Path) -> cxc.CxCData:
    return cxc.load_cxc(write_cxc(tmp_path / "cxc"), write_karpathy(tmp_path / "dataset_coco.json"))


# ------------------------------------------------------------------------------------------ loading


def test_load_resolves_ids_to_split_indices(data: cxc.CxCData) -> None:
    assert data.image_files == IMAGES and data.image_paths[0] == f"val2014/{IMAGES[0]}"
    assert data.captions == CAPTIONS and data.caption_sentids == list(range(10, 18))
    assert data.caption_image == [0, 0, 1, 1, 2, 2, 3, 3]
    assert data.sts == [(0, 1, 4.2), (2, 3, 2.9), (4, 6, 3.0), (5, 7, 0.4)]
    assert data.sis == [(0, 1, 3.5), (2, 3, 1.0)]
    assert data.sits == [(2, 3, 3.2), (6, 0, 1.1), (0, 0, 4.9)]


def test_extended_positives_rule(data: cxc.CxCData) -> None:
    pos = cxc.extended_positives(data, threshold=3.0)
    # I2T: own captions plus SITS >= 3 (caption 2 describes image 3 too)
    assert pos["i2t"] == [{0, 1}, {2, 3}, {4, 5}, {6, 7, 2}]
    assert pos["t2i"][2] == {1, 3} and pos["t2i"][6] == {3}
    # T2T: only STS >= 3, symmetric; the 2.9 co-caption pair is not a positive
    assert pos["t2t"] == [{1}, {0}, set(), set(), {6}, set(), {4}, set()]
    assert pos["i2i"] == [{1}, {0}, set(), set()]
    assert cxc.extended_positives(data, threshold=3.01)["t2t"][4] == set()


def test_bad_files_are_reported(tmp_path: Path) -> None:
    karpathy = write_karpathy(tmp_path / "dataset_coco.json")
    d = write_cxc(tmp_path / "cxc")
    with pytest.raises(FileNotFoundError, match=r"sts_val\.csv"):
        cxc.load_cxc(d, karpathy, "val")
    with pytest.raises(ValueError, match="'val' and 'test'"):
        cxc.load_cxc(d, karpathy, "train")
    with pytest.raises(FileNotFoundError, match=r"nope\.json"):
        cxc.load_cxc(d, tmp_path / "nope.json")
    text = (d / "sts_test.csv").read_text()
    (d / "sts_test.csv").write_text(text + f"{sid(10)},{sid(90)},3.0,c2c_isim\n")  # 90 is a val caption
    with pytest.raises(ValueError, match=r"sts_test.csv:6: caption sentid 90 is not in the Karpathy 'test'"):
        cxc.load_cxc(d, karpathy)
    loose = cxc.load_cxc(d, karpathy, strict=False)
    assert loose.skipped == {"sts": 1, "sis": 0, "sits": 0} and len(loose.sts) == 4
    (d / "sts_test.csv").write_text(text + "COCO_val2014:10,COCO_val2014:sentid:11,3.0,c2c_isim\n")
    with pytest.raises(ValueError, match="caption id 'COCO_val2014:10'"):
        cxc.load_cxc(d, karpathy)
    (d / "sts_test.csv").write_text(text.replace("caption1,caption2", "image1,image2"))
    with pytest.raises(ValueError, match="expected the CxC header caption1,caption2"):
        cxc.load_cxc(d, karpathy)
    (d / "sts_test.csv").write_text(text)
    (d / "sis_test.csv").write_text("image1,image2,agg_score,sampling_method\nCOCO_x.jpg,COCO_y.jpg,abc,i2i_csim\n")
    with pytest.raises(ValueError, match="agg_score 'abc'"):
        cxc.load_cxc(d, karpathy)
    (d / "sis_test.csv").write_text(f"image1,image2,agg_score,sampling_method\nCOCO_y.jpg,{IMAGES[0]},3,i2i_csim\n")
    with pytest.raises(ValueError, match=r"image 'COCO_y\.jpg' is not in"):
        cxc.load_cxc(d, karpathy)


# ------------------------------------------------------------------------------------------ correlation


def test_bootstrap_spearman_matches_plain_loop_with_scipy() -> None:
    rng = np.random.default_rng(3)
    human = np.round(rng.uniform(0, 5, 60), 1)  # rounded: ties, as in agg_score
    model = human + rng.normal(0, 1.5, 60)
    mean, std = cxc.bootstrap_spearman(model, human, n_bootstrap=200, seed=7)
    draw = np.random.default_rng(7)
    rhos = []
    for _ in range(200):
        idx = draw.integers(0, 60, 60)
        rhos.append(spearmanr(model[idx], human[idx]).statistic)
    assert mean == pytest.approx(100 * np.mean(rhos), abs=1e-9)
    assert std == pytest.approx(100 * np.std(rhos, ddof=1), abs=1e-9)
    assert cxc.bootstrap_spearman(model, human, n_bootstrap=50, seed=1) != cxc.bootstrap_spearman(
        model, human, n_bootstrap=50, seed=2
    )
    with pytest.raises(ValueError, match="at least 2"):
        cxc.bootstrap_spearman([1.0], [2.0])


def test_evaluate_cxc_hand_built_embeddings(data: cxc.CxCData) -> None:
    # Images on the axes; each caption sits on its image's axis except caption 2, which points at image 3.
    img = torch.eye(4)
    txt = torch.zeros(8, 4)
    for c, i in enumerate(data.caption_image):
        txt[c, i] = 1.0
    txt[2] = torch.tensor([0.0, 0.6, 0.0, 0.8])
    m = cxc.evaluate_cxc(img, txt, data, n_bootstrap=20)
    # T2I: caption 2's positives are images 1 and 3 (SITS 3.2), so its top image 3 is a hit.
    assert m["t2i_r1"] == 100.0 and m["t2i_queries"] == 8
    # I2T: every image's top caption is one of its positives (image 3's top is caption 6 or 7 or 2).
    assert m["i2t_r1"] == 100.0 and m["i2t_queries"] == 4
    # T2T queries: captions 0, 1, 4, 6. 0<->1 are identical (hit); 4's positive 6 is orthogonal and tied with
    # every caption of other images, behind its co-caption 5 -> miss at 1.
    assert m["t2t_queries"] == 4 and m["t2t_r1"] == 50.0
    # I2I queries: images 0 and 1; their positive is orthogonal and tied with two other images -> rank 3
    assert m["i2i_queries"] == 2 and (m["i2i_r1"], m["i2i_r5"]) == (0.0, 100.0)
    assert m["sits_pairs"] == 3 and np.isfinite(m["sts_mean"]) and np.isfinite(m["sits_mean"])
    # Orthogonal images give every SIS pair cosine 0: no ranking, so no ρ and no mean over the three.
    assert np.isnan(m["sis_mean"]) and "mean_avg" not in m
    with pytest.raises(ValueError, match="caption embeddings"):
        cxc.evaluate_cxc(img, txt[:5], data)


def test_run_cxc_end_to_end(tmp_path: Path, tiny_model: openalign.DualEncoder) -> None:
    karpathy = write_karpathy(tmp_path / "dataset_coco.json")
    d = write_cxc(tmp_path / "cxc")
    root = tmp_path / "coco"
    (root / "val2014").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in IMAGES[:3]:
        Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(root / "val2014" / name)
    tok = train_wordpiece(CAPTIONS * 10, vocab_size=101, min_frequency=1)
    with pytest.raises(FileNotFoundError, match=IMAGES[3]):
        cxc.run_cxc(tiny_model, tok, d, karpathy, root)
    Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(root / "val2014" / IMAGES[3])
    m = cxc.run_cxc(tiny_model, tok, d, karpathy, root, n_bootstrap=10)
    for task in ("i2t", "t2i", "t2t", "i2i"):
        assert 0.0 <= m[f"{task}_r10"] <= 100.0
    assert m["i2t_r10"] == 100.0  # 8 captions: every image's positives are within its top 10


def test_cli_cxc(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from conftest import tiny_overrides
    from openalign.cli import main

    tok = train_wordpiece(CAPTIONS * 10, vocab_size=101, min_frequency=1)
    torch.manual_seed(0)
    model = openalign.create_model("nano", **tiny_overrides(text={"vocab_size": tok.vocab_size}))
    ckpt = tmp_path / "ckpt"
    openalign.save_model(model, ckpt)
    tok.save(ckpt)
    karpathy = write_karpathy(tmp_path / "dataset_coco.json")
    d = write_cxc(tmp_path / "cxc")
    root = tmp_path / "coco"
    (root / "val2014").mkdir(parents=True)
    rng = np.random.default_rng(1)
    for name in IMAGES:
        Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(root / "val2014" / name)
    out = tmp_path / "res"
    argv = ["eval", "cxc", "--model", str(ckpt), "--cxc", str(d), "--karpathy", str(karpathy), "--images", str(root)]
    assert main([*argv, "--bootstrap", "20", "--out", str(out)]) == 0
    [result] = [json.loads(p.read_text()) for p in out.glob("cxc-*.json")]
    assert result["dataset"] == "cxc-test"
    assert result["metrics"]["t2t_queries"] == 4 and result["options"]["bootstrap"] == 20
    assert main([*argv, "--split", "val"]) == 2
    assert "sts_val.csv: no such CxC file" in capsys.readouterr().err
