"""VTAB-1k as the paper ran it: the 19 tasks and their groups, `eval vtab --root` on a tiny 19-task tree in the
released list-file layout (grouped table, missing tasks named), the paper sweep's trials, and resuming an
interrupted sweep trial by trial."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from openalign.cli import main
from openalign.eval.report import paper_reference
from openalign.eval.vtab import (
    PAPER_LRS,
    PAPER_STEPS,
    PAPER_WEIGHT_DECAYS,
    VTAB_TASKS,
    TrialLog,
    group_means,
    paper_trials,
    vtab_transfer,
)

GROUPS = {
    "natural": ["Caltech101", "CIFAR-100", "DTD", "Flowers102", "Pets", "SVHN", "SUN397"],
    "specialized": ["Camelyon", "EuroSAT", "Resisc45", "Retinopathy"],
    "structured": [
        "Clevr-count",
        "Clevr-dist",
        "DMLab",
        "KITTI-dist",
        "dSprites-loc",
        "dSprites-ori",
        "sNORB-azim",
        "sNORB-elev",
    ],
}
COLOURS = [(220, 30, 30), (30, 40, 220), (30, 200, 40)]


def test_the_19_tasks_and_their_groups() -> None:
    assert {g: [t.name for t in VTAB_TASKS if t.group == g] for g in GROUPS} == GROUPS
    folders = [t.folder for t in VTAB_TASKS]
    assert len(folders) == 19 == len(set(folders))
    # the folder names of the public VTAB-1k release (and of the shipped class-name lists)
    assert {"caltech101", "cifar", "oxford_flowers102", "oxford_iiit_pet", "patch_camelyon"} <= set(folders)
    assert {"diabetic_retinopathy", "clevr_count", "kitti", "smallnorb_azi", "smallnorb_ele"} <= set(folders)
    # the paper gives group means only, so no task carries a per-task number
    assert all(t.paper is None for t in VTAB_TASKS)
    ref = paper_reference("vtab", "vtab-1k")
    assert ref is not None and ref.align == {
        "all_mean": 79.99,
        "natural_mean": 83.38,
        "specialized_mean": 87.56,
        "structured_mean": 73.25,
    }
    assert dict(ref.clip) == {"all_mean": 78.72} and ref.baseline_name == "BiT-L"


def test_group_means_only_for_complete_groups() -> None:
    acc = {t.folder: float(i) for i, t in enumerate(VTAB_TASKS)}
    means, incomplete = group_means(acc)
    assert incomplete == [] and means["natural_mean"] == pytest.approx(3.0)  # tasks 0..6
    assert means["specialized_mean"] == pytest.approx(8.5) and means["structured_mean"] == pytest.approx(14.5)
    assert means["all_mean"] == pytest.approx(9.0)
    del acc["dmlab"]
    means, incomplete = group_means(acc)
    assert incomplete == ["structured"] and "structured_mean" not in means and "all_mean" not in means
    assert set(means) == {"natural_mean", "specialized_mean"}


def test_paper_sweep_trials() -> None:
    trials = paper_trials()
    assert len(trials) == 50 and len({json.dumps(t, sort_keys=True) for t in trials}) == 50
    for t in trials:
        assert t["lr"] in PAPER_LRS and t["steps"] in PAPER_STEPS and t["weight_decay"] in PAPER_WEIGHT_DECAYS
    assert paper_trials() == trials and paper_trials(seed=1) != trials
    with pytest.raises(ValueError, match="90 trials"):
        paper_trials(91)


class Interrupted(Exception):
    pass


def test_interrupted_sweep_resumes_per_trial(tmp_path: Path) -> None:
    trials = paper_trials(6)
    fits: list[tuple[float, int, float | None]] = []

    def fit(idx: torch.Tensor, lr: float, steps: int, weight_decay: float | None = None):
        if limit is not None and len(fits) == limit:
            raise Interrupted
        fits.append((lr, steps, weight_decay))
        return (lr, steps, weight_decay, len(idx))

    def score(model, idx) -> float:
        return 100.0 * model[0] if idx is not None else 1.0 + model[3]

    split = (torch.arange(8), torch.arange(8, 10))
    log = tmp_path / "trials" / "dtd.jsonl"
    context = {"task": "dtd", "model": "abc"}
    limit: int | None = 4
    with pytest.raises(Interrupted):
        vtab_transfer(10, fit, score, split=split, trials=trials, log=TrialLog(log, context))
    first = list(fits)
    assert len(first) == 4 and len(log.read_text().splitlines()) == 4
    with log.open("a") as f:
        f.write('{"key": "half a li')  # a write cut short by the interruption is ignored
    fits.clear()
    limit = None
    out = vtab_transfer(10, fit, score, split=split, trials=trials, log=TrialLog(log, context))
    swept = fits[:-1]
    assert len(swept) == 2 and not set(swept) & set(first)  # none of the finished trials ran again
    assert [(t["lr"], t["steps"], t["weight_decay"]) for t in trials[4:]] == swept
    assert out["trials_resumed"] == 4 and len(out["sweep"]) == 6
    best = max(trials, key=lambda t: t["lr"])
    assert fits[-1] == (best["lr"], best["steps"], best["weight_decay"])  # the retraining on all 10
    assert out["accuracy"] == 11.0 and out["best_weight_decay"] == best["weight_decay"]
    # another model's (or task's) records are never reused
    fits.clear()
    vtab_transfer(10, fit, score, split=split, trials=trials, log=TrialLog(log, {**context, "model": "xyz"}))
    assert len(fits) == 7


# ------------------------------------------------------------------------------------------ `eval vtab --root`


def _png(path: Path, label: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    base = np.array(COLOURS[label], dtype=np.int16)
    pixels = np.clip(base + rng.integers(-20, 20, (16, 16, 3)), 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


def write_vtab1k(root: Path, folders: list[str]) -> Path:
    """A VTAB-1k release in miniature: per task train800 / val200 / train800val200 / test lists of a few
    16 px images of 2 classes (the combined list names the same files as the other two, as released)."""
    for t, folder in enumerate(folders):
        task = root / folder
        rows: dict[str, list[str]] = {}
        for split, n in (("train", 4), ("val", 2), ("test", 2)):
            rows[split] = []
            for k in range(n):
                label = k % 2
                rel = f"images/{split}/{k}.png"
                _png(task / rel, label, seed=100 * t + 10 * len(split) + k)
                rows[split].append(f"{rel} {label}")
        lists = {
            "train800": rows["train"],
            "val200": rows["val"],
            "train800val200": rows["train"] + rows["val"],
            "test": rows["test"],
        }
        for name, lines in lists.items():
            (task / f"{name}.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from conftest import save_tiny_checkpoint

    captions = ["a photo of a red square", "a blue square"] * 20
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), captions, vocab_size=101, min_frequency=1)


def test_cli_vtab_root_grouped_table(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], one_thread: None
) -> None:
    root = write_vtab1k(tmp_path / "vtab-1k", [t.folder for t in VTAB_TASKS])
    out, trials = tmp_path / "res", tmp_path / "trials"
    argv = ["eval", "vtab", "--model", str(checkpoint), "--root", str(root), "--lrs", "0.1", "0.01", "--steps", "2"]
    assert main([*argv, "--trials-dir", str(trials), "--out", str(out)]) == 0
    [result] = [json.loads(p.read_text()) for p in out.glob("vtab-*.json")]
    m = result["metrics"]
    assert result["dataset"] == "vtab-1k" and m["tasks_run"] == 19 and m["missing_tasks"] == []
    for t in VTAB_TASKS:
        assert m[t.folder] in (0.0, 50.0, 100.0)  # 2 test images per task
    for group, names in GROUPS.items():
        folders = [t.folder for t in VTAB_TASKS if t.name in names]
        assert m[f"{group}_mean"] == pytest.approx(sum(m[f] for f in folders) / len(folders))
    assert m["all_mean"] == pytest.approx(sum(m[t.folder] for t in VTAB_TASKS) / 19)
    keys = list(m)
    assert keys.index("sun397") < keys.index("natural_mean") < keys.index("patch_camelyon")  # grouped rows
    report = (out / "results.md").read_text()
    assert "| metric | ours | ALIGN (paper) | BiT-L (paper) |" in report
    assert "| natural_mean |" in report and "| 83.38 |" in report and "| 79.99 | 78.72 |" in report
    # every trial was recorded; a rerun finds them all and records none again
    recorded = {p.name: p.read_text() for p in trials.glob("*.jsonl")}
    assert len(recorded) == 19 and all(len(text.splitlines()) == 2 for text in recorded.values())
    assert main([*argv, "--trials-dir", str(trials)]) == 0
    assert {p.name: p.read_text() for p in trials.glob("*.jsonl")} == recorded
    capsys.readouterr()

    # Missing tasks are named, their groups get no mean, and the overall mean is left out.
    import shutil

    shutil.rmtree(root / "dmlab")
    shutil.rmtree(root / "eurosat")
    assert main([*argv, "--out", str(tmp_path / "partial")]) == 0
    err = capsys.readouterr().err
    assert "dmlab (DMLab) not under" in err and "eurosat (EuroSAT) not under" in err
    [partial] = [json.loads(p.read_text()) for p in (tmp_path / "partial").glob("vtab-*.json")]
    pm = partial["metrics"]
    assert pm["tasks_run"] == 17 and pm["missing_tasks"] == ["eurosat", "dmlab"]
    assert pm["groups_without_mean"] == ["specialized", "structured"]
    assert "natural_mean" in pm and "structured_mean" not in pm and "all_mean" not in pm
    assert "| 83.38 |" in (tmp_path / "partial" / "results.md").read_text()


def test_cli_vtab_root_errors(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    base = ["eval", "vtab", "--model", str(checkpoint)]
    assert main([*base, "--root", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "none of the 19 VTAB-1k task folders" in err and len(err.strip().splitlines()) == 1
    assert main(base) == 2
    assert "--root DIR" in capsys.readouterr().err
    root = write_vtab1k(tmp_path / "v", ["dtd"])
    (root / "dtd" / "val200.txt").write_text("images/val/9.png 1\n")
    assert main([*base, "--root", str(root), "--lrs", "0.1", "--steps", "1"]) == 2
    assert "images/val/9.png" in capsys.readouterr().err


def test_cli_vtab_paper_sweep(
    checkpoint: Path, tmp_path: Path, one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import openalign.eval.vtab as vtab

    monkeypatch.setattr(vtab, "PAPER_STEPS", (1, 2))  # the paper's lengths, shortened for CI
    root = write_vtab1k(tmp_path / "v", ["dtd"])
    out = tmp_path / "res"
    argv = ["eval", "vtab", "--model", str(checkpoint), "--root", str(root), "--sweep", "paper", "--trials", "3"]
    assert main([*argv, "--out", str(out)]) == 0
    [result] = [json.loads(p.read_text()) for p in out.glob("vtab-*.json")]
    assert result["metrics"]["sweep"] == "paper" and result["metrics"]["trials_per_task"] == 3
    assert "_wd" in result["metrics"]["dtd_best"]


def test_cli_vtab_root_finetune_mode(checkpoint: Path, tmp_path: Path, one_thread: None) -> None:
    root = write_vtab1k(tmp_path / "v", ["dtd", "svhn"])
    out = tmp_path / "res"
    argv = ["eval", "vtab", "--model", str(checkpoint), "--root", str(root), "--mode", "finetune"]
    argv += ["--lrs", "0.1", "--steps", "1", "--image-size", "16", "--trials-dir", str(tmp_path / "t")]
    assert main([*argv, "--out", str(out)]) == 0
    [result] = [json.loads(p.read_text()) for p in out.glob("vtab-*.json")]
    m = result["metrics"]
    assert m["mode"] == "finetune" and m["tasks_run"] == 2 and m["dtd"] in (0.0, 50.0, 100.0)
    assert m["dtd_best"] == m["svhn_best"] == "lr0.1_steps1"
    # each task's trial is recorded under a context that names the mode, so linear records never stand in
    [line] = (tmp_path / "t" / "dtd.jsonl").read_text().splitlines()
    assert json.loads(json.loads(line)["key"])["mode"] == "finetune"
