"""Compiled training: on by default on CUDA only, one graph per tower and grad mode, no recompilation across
caption lengths, grad modes and steps, the same losses and weights as eager."""

from __future__ import annotations

import json
from functools import partialmethod
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters, guard_failures

from conftest import tiny_overrides
from openalign.model.dual_encoder import DualEncoder
from openalign.train.config import compile_enabled, load_train_config
from openalign.train.loop import train
from test_train_loop import factory, tiny_config, weights

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def fresh_dynamo() -> Any:
    torch._dynamo.reset()  # compiled code and recorded guard failures
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def test_compile_is_on_by_default_on_cuda_only() -> None:
    auto = load_train_config({"data": {"source": "synthetic"}})
    assert auto.train.compile is None
    assert not compile_enabled(auto, "cpu") and not compile_enabled(auto, torch.device("cpu"))
    assert compile_enabled(auto, "cuda") and compile_enabled(auto, "cuda:1")
    assert compile_enabled(auto, torch.device("cuda", 1))  # a device object needs no GPU
    # A setting wins over the device; YAML's true/false as before, null is the default.
    for value in (True, False):
        cfg = load_train_config({"data": {"source": "synthetic"}, "train": {"compile": value}})
        assert compile_enabled(cfg, "cpu") is value and compile_enabled(cfg, "cuda") is value
    assert load_train_config("nano_cpu", {"train.compile": None}).train.compile is None


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [row["loss"] for row in map(json.loads, lines) if "loss" in row]


def test_compiled_cached_training_compiles_once_and_never_again_and_matches_eager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fresh_dynamo: Any
) -> None:
    # Dynamo's "eager" backend: graph capture, guards and recompilation are Dynamo's whatever the backend, and
    # this one skips minutes of C++ builds (inductor's graphs of these towers: tests/test_compile.py, slow).
    monkeypatch.setattr(DualEncoder, "compile_towers", partialmethod(DualEncoder.compile_towers, backend="eager"))
    # Captions of 3 to 11 tokens in 12 columns: eager trims each batch (and chunk) to its longest; gradient
    # caching in chunks of 4 runs every tower twice a step, without and with a graph. Dropout and stochastic
    # depth stay on: both passes must draw the same masks, compiled or not.
    # Plain SGD: Adam-like steps move a weight whose gradient is rounding noise by a whole lr either way.
    sgd = {"name": "sgd", "lr": 0.01, "schedule": "constant", "warmup_steps": 0}
    options = {"steps": 3, "chunk_size": 4}
    eager = train(
        tiny_config(tmp_path / "eager", optim=sgd, train={**options, "compile": False}), stream_factory=factory()
    )
    assert "compiled towers" not in capsys.readouterr().err
    assert not counters["stats"]

    compiled = train(
        tiny_config(tmp_path / "compiled", optim=sgd, train={**options, "compile": True}), stream_factory=factory()
    )
    err = capsys.readouterr().err
    assert err.count("compiled towers in ") == 1  # reported once, at the first step

    assert not counters["graph_break"]  # fullgraph=True would have raised on one anyway
    # One graph per tower and grad mode (gradient caching's no-graph pass and its graph pass), each compiled once:
    # no caption width, chunk, step or switch of grad mode compiled anything again.
    assert counters["stats"]["unique_graphs"] == 4
    assert not guard_failures, {code.co_name: reasons for code, reasons in guard_failures.items()}

    # Compiled or not, the same arithmetic up to rounding: eager's text tower reads each batch cut to its longest
    # caption, the compiled one all 12 columns, and the sums differ in their last bits (with eager also reading
    # 12 columns, the two runs here agree to the bit). Two updates later the loss differs by what the CPU's kernels
    # make of those bits: 2.0e-5 of it on an AVX-512 AMD EPYC, under 1e-5 on the machines before it.
    assert _losses(tmp_path / "compiled") == pytest.approx(_losses(tmp_path / "eager"), rel=5e-5)
    assert compiled.step == eager.step == 3
    assert eager.final_dir is not None and compiled.final_dir is not None
    want, got = weights(eager.final_dir), weights(compiled.final_dir)
    assert want.keys() == got.keys()
    # Weights and batch-norm statistics after three updates: within 2e-4 (the largest difference seen is 1e-4, in
    # running variances near 1). The bound is absolute: tensors that sit at rounding noise (a bias ahead of a
    # batch norm, whose true gradient is zero) differ by their whole size.
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-3, atol=2e-4, msg=name)


def test_evaluation_runs_compiled_towers_eager_and_trims_captions(fresh_dynamo: Any) -> None:
    torch.manual_seed(0)
    cfg = load_train_config({"data": {"source": "synthetic"}, "model": {"preset": "nano", **tiny_overrides()}})
    model = DualEncoder(cfg.model.resolve())
    model.compile_towers(backend="eager")
    assert model.fixed_text_width
    model.eval()
    ids = torch.randint(5, 101, (3, 12))
    mask = torch.ones_like(ids)
    mask[:, 6:] = 0
    trimmed: list[int] = []
    hook = model.text.register_forward_pre_hook(lambda _, args: trimmed.append(args[0].shape[1]))
    with torch.no_grad(), model.eager_towers():
        assert not model.fixed_text_width
        model(torch.randn(3, 3, 32, 32), ids, mask)
    hook.remove()
    assert model.fixed_text_width  # back to training's fixed width
    assert trimmed == [6]
    assert not counters["stats"]  # nothing compiled
