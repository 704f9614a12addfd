"""`openalign eval` end to end on a tiny random model with a trained tokenizer, on files written here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

import openalign
from conftest import save_tiny_checkpoint
from openalign.cli import main
from openalign.config import ConfigError
from openalign.embed import embed_images, embed_texts
from openalign.eval.datasets import load_karpathy
from openalign.eval.report import markdown
from openalign.eval.retrieval import recall_at_k
from openalign.eval.tasks import Option, Task, get_task, register, resolve_options

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 30)}


def _image(colour: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = np.array(COLOURS[colour], dtype=np.int16)
    pixels = np.clip(base + rng.integers(-20, 20, (24, 24, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    words = [f"a photo of a {c} square" for c in COLOURS] + ["a bad photo of the thing", "itap of my toy"]
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), words * 20, vocab_size=200, min_frequency=1)


@pytest.fixture(scope="module")
def karpathy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("flickr")
    (root / "imgs").mkdir()
    images = []
    for i, colour in enumerate(["red", "green", "blue", "yellow", "red", "blue"]):
        name = f"{i}.png"
        _image(colour, i).save(root / "imgs" / name)
        sentences = [{"raw": f"a {colour} square number {k}", "sentid": 10 * i + k} for k in range(1 + i % 3)]
        images.append({"split": "test", "filepath": "imgs", "filename": name, "imgid": i, "sentences": sentences})
    images.append({"split": "train", "filepath": "imgs", "filename": "0.png", "imgid": 99, "sentences": []})
    (root / "dataset_flickr30k.json").write_text(json.dumps({"dataset": "flickr30k", "images": images}))
    return root


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cls")
    for c, colour in enumerate(COLOURS):
        (root / f"{colour}_square").mkdir()
        for k in range(2 if colour != "yellow" else 0):
            _image(colour, 100 + 10 * c + k).save(root / f"{colour}_square" / f"{k}.jpg")
    return root


def _read(out: Path, name: str) -> dict:
    return json.loads((out / name).read_text())


def test_retrieval_cli_matches_library(checkpoint: Path, karpathy: Path, tmp_path: Path) -> None:
    out = tmp_path / "res"
    argv = ["eval", "retrieval", "--model", str(checkpoint), "--images", str(karpathy), "--out", str(out)]
    assert main([*argv, "--dataset", f"karpathy:{karpathy / 'dataset_flickr30k.json'}", "--batch-size", "4"]) == 0
    result = _read(out, "retrieval-flickr30k.json")
    assert result["task"] == "retrieval" and result["dataset"] == "flickr30k" and result["model"] == str(checkpoint)
    assert result["options"]["split"] == "test"

    model, tok = openalign.load_model(checkpoint), openalign.load_tokenizer(checkpoint)
    data = load_karpathy(karpathy / "dataset_flickr30k.json", karpathy)
    expected = recall_at_k(
        embed_images(model, data.images), embed_texts(model, tok, data.captions), data.text_image_ids
    )
    for key, value in expected.items():
        assert result["metrics"][key] == pytest.approx(value)
    assert result["metrics"]["num_images"] == 6 and result["metrics"]["num_captions"] == 12
    report = (out / "results.md").read_text()
    assert "## retrieval — flickr30k" in report and "| i2t_r1 |" in report
    # 6 images is not the paper's 1K test set: its numbers are withheld, with the reason.
    assert "Paper numbers not shown" in report and "88.6" not in report


def test_zeroshot_cli_reports_empty_class(checkpoint: Path, folders: Path, tmp_path: Path) -> None:
    out = tmp_path / "res"
    base = ["eval", "zeroshot", "--model", str(checkpoint), "--dataset", str(folders), "--out", str(out)]
    assert main(base) == 0
    assert main([*base, "--no-ensemble", "--name", "colours-single"]) == 0
    ens, single = _read(out, f"zeroshot-{folders.name}.json"), _read(out, "zeroshot-colours-single.json")
    assert ens["metrics"]["num_templates"] == 80 and single["metrics"]["num_templates"] == 1
    assert ens["metrics"]["empty_classes"] == ["yellow square"]
    assert ens["metrics"]["num_images"] == 6 and ens["metrics"]["num_classes"] == 4
    assert single["options"]["ensemble"] is False
    report = (out / "results.md").read_text()
    assert "colours-single" in report and folders.name in report


def test_knn_cli(checkpoint: Path, folders: Path, tmp_path: Path) -> None:
    out = tmp_path / "res"
    argv = [
        "eval",
        "knn",
        "--model",
        str(checkpoint),
        "--train",
        str(folders),
        "--val",
        str(folders),
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    metrics = _read(out, f"knn-{folders.name}.json")["metrics"]
    # Each query is its own nearest neighbour (similarity 1), so 1-NN is always right.
    assert metrics["accuracy"] == 100.0 and metrics["num_train"] == 6 and metrics["val_classes_not_in_train"] == []


def test_suite_runs_all_tasks_survives_a_failure_and_resumes(
    checkpoint: Path, karpathy: Path, folders: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "suite-out"
    suite = {
        "model": str(checkpoint),
        "out": str(out),
        "batch_size": 3,
        "tasks": [
            {
                "task": "retrieval",
                "dataset": f"karpathy:{karpathy / 'dataset_flickr30k.json'}",
                "images": str(karpathy),
            },
            {"task": "zeroshot", "dataset": str(folders), "name": "colours"},
            {"task": "zeroshot", "dataset": str(tmp_path / "missing"), "name": "gone"},
        ],
    }
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    assert main(["eval", "suite", str(path)]) == 1
    err = capsys.readouterr().err
    assert "1 task(s) failed" in err and "missing" in err
    assert (out / "retrieval-flickr30k.json").is_file() and (out / "zeroshot-colours.json").is_file()
    assert _read(out, "zeroshot-colours.json")["options"]["batch_size"] == 3
    first = (out / "zeroshot-colours.json").stat().st_mtime_ns

    suite["tasks"] = suite["tasks"][:2]
    path.write_text(yaml.safe_dump(suite))
    assert main(["eval", "suite", str(path), "--resume"]) == 0
    assert "already done" in capsys.readouterr().err
    assert (out / "zeroshot-colours.json").stat().st_mtime_ns == first


def test_suite_rejects_bad_entries_before_loading(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({"model": str(tmp_path), "tasks": [{"task": "zeroshot", "datset": "x"}]}))
    assert main(["eval", "suite", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("openalign eval: error:") and "tasks[0]" in err and "'datset'" in err and "dataset" in err
    path.write_text(yaml.safe_dump({"model": str(tmp_path), "tasks": [{"task": "nope"}]}))
    assert main(["eval", "suite", str(path)]) == 2
    assert "unknown eval task 'nope'" in capsys.readouterr().err
    path.write_text(yaml.safe_dump({"model": str(tmp_path), "taks": []}))
    assert main(["eval", "suite", str(path)]) == 2
    assert "'taks'" in capsys.readouterr().err


def test_bad_input_is_one_line_error(
    checkpoint: Path, karpathy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    json_path = tmp_path / "dataset_flickr30k.json"
    data = json.loads((karpathy / "dataset_flickr30k.json").read_text())
    data["images"][2]["filename"] = "nope.png"
    json_path.write_text(json.dumps(data))
    argv = ["eval", "retrieval", "--model", str(checkpoint), "--images", str(karpathy)]
    assert main([*argv, "--dataset", f"karpathy:{json_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(karpathy / "imgs" / "nope.png") in err

    assert main([*argv, "--dataset", f"karpathy:{json_path}", "--split", "val"]) == 2
    assert "no images in split 'val'; splits present: test (6), train (1)" in capsys.readouterr().err

    assert main(["eval", "nonsense", "--model", str(checkpoint)]) == 2
    assert "unknown eval task 'nonsense'; valid tasks:" in capsys.readouterr().err
    assert main(["eval"]) == 2
    assert "name a TASK" in capsys.readouterr().err
    assert main(["eval", "retrieval", "--model", str(checkpoint)]) == 2  # the required --dataset is missing
    assert "needs option 'dataset' (--dataset)" in capsys.readouterr().err
    assert main(["eval", "retrieval", "--model", str(tmp_path / "no-ckpt"), "--dataset", "x.json"]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err


def test_help_lists_tasks_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--help"]) == 0
    text = capsys.readouterr().out
    assert "retrieval" in text and "zeroshot" in text and "knn" in text and "suite" in text
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "zeroshot", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--no-ensemble" in text and "examples:" in text and "--layout" in text


def test_registry_options_are_strict() -> None:
    task = get_task("zeroshot")
    resolved = resolve_options(task, {"dataset": "d"})
    assert resolved["ensemble"] is True and resolved["templates"] == "imagenet" and resolved["batch_size"] == 64
    with pytest.raises(ConfigError, match=r"zeroshot\.ensemble: expected true or false"):
        resolve_options(task, {"dataset": "d", "ensemble": "no"})
    with pytest.raises(ConfigError, match="needs option 'dataset'"):
        resolve_options(task, {})
    with pytest.raises(ConfigError, match="not one of"):
        resolve_options(task, {"dataset": "d", "layout": "imagenet-x"})
    with pytest.raises(ValueError, match="already registered"):
        register(Task("zeroshot", lambda m, t, o: {}, "duplicate"))
    with pytest.raises(ValueError, match="clash"):
        register(Task("clashing", lambda m, t, o: {}, "x", options=(Option("device"),)))


def test_markdown_shows_paper_numbers_only_for_the_paper_protocol() -> None:
    same = {
        "task": "retrieval",
        "dataset": "Flickr30K",
        "model": "m",
        "metrics": {"i2t_r1": 50.0, "num_images": 1000, "num_captions": 5000},
    }
    text = markdown([same])
    assert "| i2t_r1 | 50.00 | 88.6 | 88.0 |" in text and "Table 1" in text
    coco = {"task": "zeroshot", "dataset": "imagenet", "model": "m", "metrics": {"top1": 10.0, "num_images": 50000}}
    assert "| top1 | 10.00 | 76.4 | 76.2 |" in markdown([coco])
    small = {**coco, "metrics": {"top1": 10.0, "num_images": 50}}
    assert "76.4" not in markdown([small]) and "num_images 50 (paper 50000)" in markdown([small])
