"""`openalign eval suite paper-transfer.yaml --root DATA`: the packaged suite runs the data sets present under
DATA (here Flowers-102, Food-101 and two VTAB-1k tasks, each in its released layout), skips the absent ones
with a line each, and writes one results.md with the paper's Tables 4-6 beside ours. Step counts are the
paper's in the suite; the test shortens them with --option."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from scipy.io import savemat

from openalign.cli import main
from openalign.eval.suite import packaged_suite, packaged_suites

COLOURS = [(220, 30, 30), (30, 40, 220)]


def _jpg(path: Path, label: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    pixels = np.clip(np.array(COLOURS[label]) + rng.integers(-20, 20, (16, 16, 3)), 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, format="JPEG")


def write_flowers(root: Path) -> None:
    labels = [1, 2, 1, 2, 1, 2, 1, 2]  # released 1-based class numbers of image_00001 ... image_00008
    for i, label in enumerate(labels, 1):
        _jpg(root / "jpg" / f"image_{i:05d}.jpg", label - 1, seed=i)
    savemat(root / "imagelabels.mat", {"labels": np.array([labels], dtype=np.uint8)})
    ids = {"trnid": [[1, 2, 3]], "valid": [[4]], "tstid": [[5, 6, 7, 8]]}
    savemat(root / "setid.mat", {k: np.array(v, np.uint16) for k, v in ids.items()})


def write_food(root: Path) -> None:
    classes = ["apple_pie", "baby_back_ribs"]
    (root / "meta").mkdir(parents=True)
    (root / "meta" / "classes.txt").write_text("\n".join(classes) + "\n")
    for split, ids in (("train", range(3)), ("test", range(3, 5))):
        rows = [f"{c}/{i}" for c in classes for i in ids]
        (root / "meta" / f"{split}.txt").write_text("\n".join(rows) + "\n")
        for row in rows:
            _jpg(root / "images" / f"{row}.jpg", classes.index(row.split("/")[0]), seed=len(row) + int(row[-1]))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from conftest import save_tiny_checkpoint

    captions = ["a photo of a red square", "a blue square"] * 20
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), captions, vocab_size=101, min_frequency=1)


QUICK = ["steps=1", "finetune_batch_size=4", "image_size=32", "eval_image_size=32", "sweep=light", "lrs=0.1"]


def test_paper_transfer_suite_on_the_present_datasets(
    checkpoint: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    one_thread: None,
) -> None:
    from openalign.eval import finetune as ft
    from test_eval_recipes import _fingerprint
    from test_eval_vtab import write_vtab1k

    starts: list[str] = []
    real = ft.finetune

    def recording(model, *args, **kw):
        starts.append(_fingerprint(model.image))
        return real(model, *args, **kw)

    monkeypatch.setattr(ft, "finetune", recording)

    data = tmp_path / "DATA"
    write_flowers(data / "flowers102")
    write_food(data / "food101")
    write_vtab1k(data / "vtab-1k", ["dtd", "eurosat"])
    out = tmp_path / "results"
    argv = ["eval", "suite", "paper-transfer.yaml", "--root", str(data), "--model", str(checkpoint)]
    argv += ["--out", str(out)] + [x for o in QUICK for x in ("--option", o)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    for absent in ("imagenet", "pets", "cars"):
        assert f"skipped, {data / absent} is not there" in err
    assert err.count("is not there") == 4  # ImageNet's two entries, Pets, Cars
    names = sorted(p.name for p in out.glob("*.json"))
    assert names == ["finetune-flowers102.json", "finetune-food101.json", "vtab-vtab-1k.json"]
    flowers = json.loads((out / "finetune-flowers102.json").read_text())["metrics"]
    assert flowers["runs"] == 3 and flowers["n"] == 4 and flowers["recipe"] == "paper-finegrained"
    assert flowers["num_train"] == 4  # trainval: the released train and val ids
    vtab = json.loads((out / "vtab-vtab-1k.json").read_text())["metrics"]
    assert vtab["tasks_run"] == 2 and len(vtab["missing_tasks"]) == 17 and "natural_mean" not in vtab
    assert len(list((out / "vtab-trials").glob("*.jsonl"))) == 2
    # the model is loaded once, and every run of every data set starts from its pre-trained weights
    assert len(starts) == 6 and len(set(starts)) == 1

    report = (out / "results.md").read_text()
    assert report.count("## Transfer: the paper's Tables 4-6 beside ours") == 1
    rows = [line for line in report.splitlines() if line.startswith("| Table ")]
    assert len(rows) == 1 + 2 + 4 + 4  # Table 4 (frozen; fine-tuned top-1, top-5), Table 5 (4 means), Table 6
    flowers_row = next(r for r in rows if r.startswith("| Table 6: Oxford Flowers |"))
    assert f"| {flowers['top1']:.2f} | 99.65 | no: n 4 (paper 6149); mean of 3 runs |" in flowers_row
    assert "| Table 6: Stanford Cars | top1 |  | 96.13 | not run |" in rows
    assert "| Table 4: ImageNet, frozen features | top1 |  | 85.5 | not run |" in rows
    assert "| Table 5: VTAB-1k | natural_mean |  | 83.38 | not measured" in report
    assert "| Table 6: Food101 | top1 |" in report and "| 95.88 |" in report


def test_packaged_suite_names_and_errors(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "paper-transfer.yaml" in packaged_suites() and packaged_suite("paper-transfer") is not None
    assert packaged_suite("some/dir/paper-transfer.yaml") is None
    base = ["eval", "suite", "--model", str(checkpoint)]
    assert main([*base, "no-such-suite.yaml"]) == 2
    err = capsys.readouterr().err
    assert "no such suite file, nor a packaged suite (paper-multilingual.yaml, paper-transfer.yaml)" in err
    assert len(err.splitlines()) == 1
    assert main([*base, "paper-transfer.yaml"]) == 2  # the entries need --root DATA
    assert "give --root DATA" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([*base, "paper-transfer.yaml", "--root", str(tmp_path / "empty"), "--option", "stepz=1"]) == 2
    assert "--option stepz: no task of" in capsys.readouterr().err
    # nothing present: every entry is skipped with its line, and that is not a failure
    out = tmp_path / "res"
    assert main([*base, "paper-transfer.yaml", "--root", str(tmp_path / "empty"), "--out", str(out)]) == 0
    assert capsys.readouterr().err.count("is not there") == 7


def test_suite_help_names_the_packaged_suite(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["eval", "suite", "--help"])
    text = capsys.readouterr().out
    assert "paper-transfer.yaml" in text and "--root" in text and "--option" in text
    for folder in ("imagenet/", "vtab-1k/", "flowers102/", "pets/", "cars/", "food101/"):
        assert folder in text
