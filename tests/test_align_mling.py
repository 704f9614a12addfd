"""Multilingual ALIGN: the packaged recipe, the multilingual synthetic source as a training setting, Multi30K
in the eval suite, and a short CPU run that retrieves above chance in every language."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from openalign.config import ConfigError
from openalign.model.bert import Bert
from openalign.train.config import load_train_config, parse_overrides

SHARDS = {"data.shards": "shards/{00000..00009}.tar", "data.tokenizer": "vocab"}


def test_mling_recipe_is_the_english_one_with_a_250k_vocabulary() -> None:
    from openalign.train.loop import _check_vocab

    mling = load_train_config("pretrain_align_mling", SHARDS)
    mling.validate()
    english = load_train_config("pretrain_align", SHARDS)
    # Whatever size the learnt vocabulary has, BERT-Large's table has the recipe's 250k rows.
    for learnt in (None, 120_000, 250_000):
        model = mling.model.resolve(learnt)
        assert model.text.vocab_size == 250_000
    eng_model = english.model.resolve(100_000)
    assert eng_model.text.vocab_size == 100_000
    # Everything else is the English recipe: towers, loss, optimizer, schedule, data pipeline.
    assert dataclasses.replace(model.text, vocab_size=100_000) == eng_model.text
    assert model.image == eng_model.image and model.embed_dim == eng_model.embed_dim == 1376
    assert (model.text.num_layers, model.text.hidden_size) == (24, 1024) and model.image.width_coefficient == 4.3
    assert mling.optim == english.optim and mling.data == english.data
    assert dataclasses.replace(mling.train, run_dir="x") == dataclasses.replace(english.train, run_dir="x")
    # The table on the meta device: the vocabulary size reaches the embedding, with no memory spent.
    with torch.device("meta"):
        bert = Bert(model.text)
    assert tuple(bert.embeddings.word.weight.shape) == (250_000, 1024)
    # A vocabulary larger than the table is refused before training starts.
    _check_vocab(model, SimpleNamespace(vocab_size=249_000))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="250001 tokens"):
        _check_vocab(model, SimpleNamespace(vocab_size=250_001))  # type: ignore[arg-type]


def test_languages_setting_of_the_synthetic_source() -> None:
    cfg = load_train_config("nano_cpu", parse_overrides(["--data.synthetic.languages", "[en, de, fr, cs]"]))
    assert cfg.data.synthetic.languages == ("en", "de", "fr", "cs")
    assert load_train_config("nano_cpu").data.synthetic.languages == ("en",)
    with pytest.raises(ConfigError, match=r"data\.synthetic\.languages: .*'xx'"):
        load_train_config("nano_cpu", {"data.synthetic.languages": ["en", "xx"]})


def test_languages_flag_comes_from_the_config_comment() -> None:
    from openalign.cli.train import train_schema

    [knob] = [k for k in train_schema().knobs if k.path == "data.synthetic.languages"]
    assert knob.default == ("en",) or list(knob.default) == ["en"]
    assert "caption languages" in knob.help


def test_source_fingerprint_keeps_english_runs_resumable() -> None:
    from openalign.train.data import DataConfig, _SyntheticSource

    english = _SyntheticSource(DataConfig(source="synthetic"), 0).fingerprint()
    assert json.loads(english) == ["synthetic", 0, 0.25, 64, None]
    mling = DataConfig(source="synthetic")
    mling.synthetic.languages = ("en", "de")
    assert json.loads(_SyntheticSource(mling, 0).fingerprint())[-1] == ["en", "de"]


def test_synthetic_tokenizer_keeps_accents_for_several_languages() -> None:
    from openalign.train.loop import _synthetic_tokenizer

    over = {"data.synthetic.image_size": 32}
    english = _synthetic_tokenizer(load_train_config("nano_cpu", over), captions=300)
    mling = _synthetic_tokenizer(
        load_train_config("nano_cpu", {**over, "data.synthetic.languages": ["en", "cs"]}), captions=300
    )
    assert english.lowercase and not mling.lowercase
    ids = mling(["dvě červené hvězdy"])["input_ids"][0].tolist()
    assert "č" in mling.decode(ids) and "[UNK]" not in mling.decode(ids)


FOUR = ["en", "de", "fr", "cs"]


def test_paper_multilingual_suite_runs_multi30k_under_a_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The packaged suite finds DATA/multi30k (Multi30K's task-1 folder) and DATA/flickr30k-images, evaluates
    every language through the `multilingual` task, and skips with a line when the folder is absent."""
    from conftest import save_tiny_checkpoint
    from openalign.cli import main
    from openalign.data.synthetic import SyntheticWorld, write_multi30k_set
    from openalign.eval.multilingual import run_multilingual
    from openalign.eval.suite import load_checkpoint, packaged_suites

    assert "paper-multilingual.yaml" in packaged_suites()
    captions = [r.caption for r in SyntheticWorld(0, 32, FOUR).iter_rows(300, noise=0.0)]
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", captions, vocab_size=400, min_frequency=1, lowercase=False)
    data = tmp_path / "DATA"
    write_multi30k_set(data / "multi30k", 6, FOUR, seed=1, image_size=32, image_dir=data / "flickr30k-images")
    out = tmp_path / "results"
    argv = ["eval", "suite", "paper-multilingual.yaml", "--root", str(data), "--model", str(ckpt), "--out", str(out)]
    assert main(argv) == 0
    [path] = out.glob("multilingual-*.json")
    metrics = json.loads(path.read_text())["metrics"]
    assert metrics["num_images"] == 6
    # The suite passed the root's files to the task: the same numbers as the task run on them directly.
    model, tok = load_checkpoint(ckpt)
    m30k = data / "multi30k"
    direct = run_multilingual(
        model, tok, m30k / "raw", m30k / "image_splits" / "test_2016_flickr.txt", data / "flickr30k-images"
    )
    for lang in FOUR:
        assert metrics[f"{lang}_mean_recall"] == pytest.approx(direct[f"{lang}_mean_recall"])
        assert metrics[f"{lang}_t2i_r10"] == 100.0  # 6 candidates
    assert "multilingual" in (out / "results.md").read_text()

    empty = tmp_path / "EMPTY"
    empty.mkdir()
    capsys.readouterr()
    argv = ["eval", "suite", "paper-multilingual.yaml", "--root", str(empty), "--model", str(ckpt)]
    assert main([*argv, "--out", str(tmp_path / "r2")]) == 0
    assert f"skipped, {empty / 'multi30k'} is not there" in capsys.readouterr().err


STEPS, BATCH, SIZE, EVAL_IMAGES = 150, 64, 32, 50


@pytest.mark.slow  # ~15 s of CPU; well over 20 s of wall time on a busy two-core machine
def test_short_cpu_run_retrieves_above_chance_in_every_language(tmp_path: Path) -> None:
    """A tiny dual encoder trained for 150 steps on the four-language synthetic world, evaluated zero-shot on
    held-out scenes written by `openalign multi30k-world` and read by `openalign eval multilingual` (the
    Multi30K loader and mean recall): every language retrieves far above chance. A text tower that learnt only
    English, a tokenizer that mangled accented words or a caption file out of line with its images would sit
    at chance in some language."""
    from openalign.cli import main
    from openalign.train.loop import train

    cfg = load_train_config(
        "nano_cpu",
        {
            "model": {
                "image_size": SIZE,
                "image": {"width_coefficient": 0.25, "depth_coefficient": 0.34},
                "text": {"hidden_size": 64, "num_heads": 2, "max_length": 24},
                "embed_dim": 64,
            },
            "data": {
                "batch_size": BATCH,
                "workers": 0,
                "resize": SIZE,
                "crop": "center",
                "synthetic": {"languages": FOUR, "noise": 0.0, "image_size": SIZE},
            },
            "optim": {"warmup_steps": 15, "total_steps": STEPS},
            # One thread: on a shared machine, a second one spends its time waiting for the first.
            "train": {"run_dir": str(tmp_path / "run"), "checkpoint_every": 0, "checkpoint_minutes": 0, "threads": 1},
            "eval": {"every": 0},
            "log": {"tensorboard": False, "progress": False},
        },
    )
    result = train(cfg)
    assert result.step == STEPS
    m30k = tmp_path / "m30k"
    argv = ["multi30k-world", str(m30k), "--images", str(EVAL_IMAGES), "--image-size", str(SIZE)]
    assert main(argv) == 0
    argv = ["eval", "multilingual", "--model", str(result.final_dir), "--captions", str(m30k / "raw")]
    argv += ["--image-list", str(m30k / "image_splits" / "test_2016_flickr.txt"), "--images", str(m30k / "images")]
    assert main([*argv, "--out", str(tmp_path / "res")]) == 0
    [path] = (tmp_path / "res").glob("multilingual-*.json")
    metrics = json.loads(path.read_text())["metrics"]
    assert metrics["num_images"] == EVAL_IMAGES
    chance_r1 = 100 / EVAL_IMAGES
    chance_mean_recall = 100 * (1 + 5 + 10) / 3 / EVAL_IMAGES
    for lang in FOUR:
        assert metrics[f"{lang}_t2i_r1"] > 3 * chance_r1, (lang, metrics)
        assert metrics[f"{lang}_i2t_r1"] > 3 * chance_r1, (lang, metrics)
        assert metrics[f"{lang}_mean_recall"] > 3 * chance_mean_recall, (lang, metrics)
