"""``openalign bench train --recipe``: the real loop timed beside the bare step, at toy size."""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from torch._dynamo.utils import counters, guard_failures

from conftest import declare_accelerator
from openalign.cli import main
from openalign.train import towers


def test_recipe_prints_the_loop_beside_the_bare_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "train", "--preset", "nano", "--image-size", "32", "--batch-size", "8", "--steps", "1",
            "--warmup", "1", "--rounds", "1", "--workers", "0", "--shard-samples", "16", "--pipeline-samples", "8",
            "--no-baseline", "--recipe", "--grad-clip", "1.0", "--json", str(out),
            "--profile", str(tmp_path / "profile")]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("loop (recipe)"))
    assert " pairs/s vs bare step " in line and "x; step " in line and "data wait" in line
    summary = json.loads(out.read_text())
    loop, bare = summary["training"]["recipe"], summary["training"]["openalign"]
    # Each step profiled after its timing: the bare step and the loop's (which runs its optimizer, LAMB, in it).
    for name, file in (("openalign", "openalign"), ("recipe", "recipe-eager")):
        table = (tmp_path / "profile" / f"{file}.txt").read_text()
        assert "2 steps profiled on cpu" in table and "host synchronisations in one step: 0" in table
        assert "aten::convolution_backward" in table and "Optimizer.step#Lamb.step" in table
        # The table's totals in the results, and a line under the printed table.
        totals = summary["training"][name]["profile"]
        assert totals["ops"] > 0 and totals["host_syncs"] == 0 and f"{name:>12} profiled: wall " in printed
        # The timed steps on the host: the stepping thread's share of them, a line under the table too.
        host = summary["training"][name]["host"]
        assert host["steps"] == 1 and 0 < host["busy"] <= 1.05 and host["thread_cpu_s"] > 0
        assert f"{name:>12} on the host: main thread busy " in printed
    assert loop["skipped_steps"] == 0 and loop["pairs_per_s"] > 0 and bare["pairs_per_s"] > 0
    assert 0 <= loop["parts_s"]["data"] <= loop["step_s"]
    assert summary["recipe_ratio"] == pytest.approx(loop["pairs_per_s"] / bare["pairs_per_s"])


def test_compiled_the_loop_runs_in_its_bare_steps_process_on_the_graphs_it_compiled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fresh_dynamo: None
) -> None:
    """Compiled, ``--recipe``'s loop runs after the bare step in the bare step's process, and its model (a second
    one of the same config) passes the guards of the graphs the first compiled: one compilation serves both, where
    each costs minutes on a GPU."""
    from openalign.bench import train as bench_train
    from openalign.bench.train import run_train_bench
    from openalign.bench.train_setup import TrainBenchSettings

    # Dynamo's eager backend: graph capture and guards are Dynamo's whatever the backend (tests/test_train_compile).
    monkeypatch.setattr(towers, "compile_towers", partial(towers.compile_towers, backend="eager"))
    processes: list[str] = []

    def in_this_process(fn: Any, *args: Any) -> Any:
        processes.append(fn.__name__)
        if fn is bench_train.measure_pipeline:  # not what this test is about
            return {"samples_per_s": 1.0, "cpu_ms": 1.0}
        return fn(*args)

    monkeypatch.setattr(bench_train, "in_own_process", in_this_process)
    s = TrainBenchSettings(preset="nano", image_size=32, batch_size=8, steps=2, warmup=1, rounds=1, workers=0,
                           shard_samples=16, pipeline_samples=8, compile=True, recipe=True, baseline=False)  # fmt: skip
    summary = run_train_bench(s)
    assert processes == ["measure_bare_then_loop", "measure_pipeline"]
    # The image and the text tower's graphs with gradients, compiled by the bare step; the loop compiled nothing.
    assert counters["stats"]["unique_graphs"] == 2
    assert not guard_failures, {code.co_name: reasons for code, reasons in guard_failures.items()}
    loop, bare = summary["training"]["recipe"], summary["training"]["openalign"]
    assert len(loop["steps_s"]) == 2 and len(bare["steps_s"]) == 2
    assert bare["first_step_s"] > 0 and loop["first_step_s"] > 0  # the bare step's first compiled the towers
    assert summary["recipe_ratio"] == pytest.approx(loop["pairs_per_s"] / bare["pairs_per_s"])
    printed = capsys.readouterr()
    assert printed.err.count("compiled towers in ") == 1  # the loop's first step, on ready graphs
    # The bare step's compiled gradients against its eager ones, after the warm-up (the check compiles nothing).
    assert bare["gradients"]["agree"] and set(bare["gradients"]["groups"]) >= {"image", "text"}
    assert "   openalign compiled gradients against eager, one step: " in printed.out


def test_the_loop_trains_the_bare_step_model(tmp_path: Path) -> None:
    from openalign.bench.model import bench_config
    from openalign.bench.recipe import recipe_config
    from openalign.bench.train_setup import TrainBenchSettings, _model_settings, model_cfg

    s = TrainBenchSettings(preset="nano", image_size=32, batch_size=8, recipe=True, virtual_batch_size=4)
    cfg = recipe_config(s, "a.tar", "tok", str(tmp_path))
    # The loop resolves its model with the tokenizer's size and cuts captions at data.max_text_length.
    model = cfg.model.resolve(vocab_size=100)
    assert model == model_cfg(s) and model.image.batch_norm == "virtual" and model.image.virtual_batch_size == 4
    assert model_cfg(dataclasses.replace(s, virtual_batch_size=None)) == bench_config(_model_settings(s))
    assert cfg.data.max_text_length == model.text.max_length
    assert cfg.train.batch_size == 8 and cfg.train.steps == s.warmup + s.steps + 1
    assert cfg.train.compile is False  # eager on every device, as the bare step
    compiled = recipe_config(dataclasses.replace(s, compile=True), "a.tar", "tok", str(tmp_path))
    assert compiled.train.compile is True


def test_grad_clip_must_be_positive() -> None:
    from openalign.bench.train_setup import TrainBenchSettings

    with pytest.raises(ValueError, match="--grad-clip"):
        TrainBenchSettings(grad_clip=0.0).validate()


def test_bench_model_runs_ours_on_a_gpu_as_training_does(
    monkeypatch: pytest.MonkeyPatch, text_widths: list[int]
) -> None:
    """Where reading values waits (a GPU; declared here), ours takes captions cut to the batch's longest as measured
    on the host, and its forward reads nothing, as in `openalign train`; on the CPU too its captions are cut on the
    host."""
    from openalign.bench.model import BenchSettings, measure

    settings = BenchSettings(preset="nano", image_size=32, batch_size=8, steps=1, warmup=1)
    measure("openalign", settings)
    on_cpu = set(text_widths)
    assert max(on_cpu) < 64  # trimmed by the model itself (and short rows apart)

    text_widths.clear()
    checked = declare_accelerator(monkeypatch)
    measure("openalign", settings)
    assert set(text_widths) == {max(on_cpu)}  # the batch's longest caption, measured on the host, every pass
    assert len(checked) == 2  # the FLOP count's eager pass, then the batch on the host, as training checks it
