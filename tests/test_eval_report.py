"""The report's paper columns: shown for the paper's benchmark only, under the metric and dataset names the
tasks really write."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from openalign.eval import cxc, multilingual, simlex
from openalign.eval.report import PAPER, markdown, paper_reference
from openalign.eval.tasks import run_task


def _unit(rng: np.random.Generator, n: int, d: int = 8) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.as_tensor(rng.normal(size=(n, d)), dtype=torch.float32), dim=1)


def cxc_metrics() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    data = cxc.CxCData(
        split="test",
        image_files=[f"COCO_val2014_{i:012d}.jpg" for i in range(4)],
        image_paths=[f"val2014/COCO_val2014_{i:012d}.jpg" for i in range(4)],
        captions=[f"caption {c}" for c in range(8)],
        caption_sentids=list(range(8)),
        caption_image=[0, 0, 1, 1, 2, 2, 3, 3],
        sts=[(0, 1, 4.0), (2, 4, 1.0), (3, 6, 3.5), (5, 7, 2.0)],
        sis=[(0, 1, 3.5), (2, 3, 1.0), (0, 3, 2.5)],
        sits=[(0, 0, 4.5), (2, 3, 3.2), (6, 1, 0.5)],
    )
    return cxc.evaluate_cxc(_unit(rng, 4), _unit(rng, 8), data, n_bootstrap=20)


def simlex_metrics() -> dict[str, Any]:
    rng = np.random.default_rng(1)
    pairs = [
        simlex.SimLexPair(f"a{i}", f"b{i}", float(rng.uniform(0, 10)), "ANV"[i % 3], 1 + i % 4, i % 2 == 0)
        for i in range(36)
    ]
    return simlex.evaluate_simlex(pairs, lambda words: _unit(rng, len(words)))


def multilingual_metrics() -> dict[str, Any]:
    rng = np.random.default_rng(2)
    return multilingual.evaluate_multilingual(_unit(rng, 6), {lang: _unit(rng, 6) for lang in multilingual.LANGUAGES})


# task -> (module, its runner to replace, the required options, the metrics, the size key and the paper's size)
CASES = {
    "cxc": (cxc, "run_cxc", {"cxc": "d", "karpathy": "k.json", "images": "i"}, cxc_metrics, "i2t_queries", 5000),
    "simlex": (simlex, "run_simlex", {"file": "SimLex-999.txt"}, simlex_metrics, "n_all", 999),
    "multilingual": (
        multilingual,
        "run_multilingual",
        {"captions": "c", "image_list": "l.txt", "images": "i"},
        multilingual_metrics,
        "num_images",
        1000,
    ),
}


def fake_result(monkeypatch: pytest.MonkeyPatch, task: str, size: int) -> dict[str, Any]:
    """What ``openalign eval <task>`` would write with default options, with metrics from the task's own
    evaluator on tiny inputs and the size key set to ``size``."""
    module, runner, options, metrics, size_key, _ = CASES[task]
    values = {**metrics(), size_key: size}
    monkeypatch.setattr(module, runner, lambda *args, **kwargs: dict(values))
    return run_task(task, None, None, options).to_dict()  # type: ignore[arg-type]


@pytest.mark.parametrize("task", sorted(CASES))
def test_paper_numbers_are_keyed_like_the_task_output(task: str) -> None:
    [ref] = [p for p in PAPER if p.task == task]
    _, _, _, metrics, size_key, _ = CASES[task]
    written = metrics()
    assert set(ref.align) | set(ref.clip) | set(ref.requires) <= set(written), "a paper key the task never writes"
    assert size_key in ref.requires


@pytest.mark.parametrize("task", sorted(CASES))
def test_paper_column_only_at_the_paper_size(task: str, monkeypatch: pytest.MonkeyPatch) -> None:
    size = CASES[task][5]
    result = fake_result(monkeypatch, task, size)
    ref = paper_reference(task, result["dataset"])
    assert ref is not None, f"no paper reference for the dataset name {result['dataset']!r} the task writes"
    report = markdown([result])
    assert "ALIGN (paper)" in report and "Paper numbers: ALIGN paper" in report
    for key, value in ref.align.items():
        assert f"| {key} | " in report and f"| {value:.1f} |" in report
    # A different size is a different benchmark: no paper column, and the reason is given.
    other = markdown([fake_result(monkeypatch, task, size - 1)])
    assert "ALIGN (paper)" not in other and f"(paper {size})" in other
    assert all(f"| {v:.1f} |" not in other for v in ref.align.values())


def test_paper_rows_hold_the_papers_values(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = {}
    for task in CASES:
        for line in markdown([fake_result(monkeypatch, task, CASES[task][5])]).splitlines():
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) >= 3 and cells[2] and cells[0] not in ("metric", "---"):
                rows[(task, cells[0])] = cells[2:]
    assert rows[("cxc", "i2t_r1")] == ["78.1"] and rows[("cxc", "t2t_r1")] == ["45.4"]
    assert rows[("cxc", "i2i_r1")] == ["49.4"] and rows[("cxc", "t2i_r1")] == ["61.8"]
    assert rows[("cxc", "sits_mean")] == ["67.6"] and rows[("cxc", "mean_avg")] == ["72.6"]
    # SimLex-999: our task reports ρ × 100, the paper's scale; GloVe is the second column.
    assert rows[("simlex", "all")] == ["39.8", "40.8"] and rows[("simlex", "conc_q4")] == ["57.8", "40.2"]
    assert rows[("simlex", "hard")] == ["31.7", "27.2"]
    assert rows[("multilingual", "cs_mean_recall")] == ["63.2"] and rows[("multilingual", "en_mean_recall")] == ["90.2"]


def test_baseline_column_is_named_per_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    header = next(line for line in markdown([fake_result(monkeypatch, "simlex", 999)]).splitlines() if "metric" in line)
    assert header == "| metric | ours | ALIGN (paper) | GloVe (paper) |"
    # Without baseline numbers there is no baseline column at all.
    header = next(
        line for line in markdown([fake_result(monkeypatch, "multilingual", 1000)]).splitlines() if "metric" in line
    )
    assert header == "| metric | ours | ALIGN (paper) |"
    retrieval = {"task": "retrieval", "dataset": "flickr30k", "metrics": {"i2t_r1": 1.0, "num_images": 1000}}
    retrieval["metrics"]["num_captions"] = 5000
    assert "| metric | ours | ALIGN (paper) | CLIP (paper) |" in markdown([retrieval])
