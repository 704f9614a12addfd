"""``openalign bench gpu --device cpu --tiny``: the GPU check end to end at toy sizes, without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openalign.bench import gpu
from openalign.bench.gpu_memory import tree_memory
from openalign.cli import main


def test_the_check_runs_every_part_and_records_a_broken_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gc"
    # l2 gets an unknown option: it must fail, be recorded with its error, and the parts after it still run.
    # bench and compiled start several interpreters each: their limits leave room for a busy machine.
    args = ["bench", "gpu", "--device", "cpu", "--tiny", "--out", str(out), "--break-part", "l2", "--paper", "--l2"]
    limits = '{"bench": 220, "compiled": 100, "towers": 60, "compiled_loop": 100}'
    code = main([*args, "--limits", limits, "--budget-s", "860"])
    printed = capsys.readouterr().out
    assert code == 1  # a part failed
    summary = json.loads((out / "gpu_check.json").read_text())
    parts = summary["parts"]
    assert list(parts) == ["tests", "paper", "bench", "loop", "l2", "compiled", "towers", "compiled_loop", "plan"]
    assert parts["l2"]["status"] == "failed" and "--no-such-option" in parts["l2"]["tail"]
    for name, part in parts.items():
        if name != "l2":
            assert part["status"] == "ok", (name, part.get("tail"))
    assert parts["tests"]["figures"]["skipped"] >= 7  # no CUDA here: every test skips, none fails
    bench = parts["bench"]["figures"]
    assert bench["training"]["openalign"]["pairs_per_s"] > 0 and bench["training"]["transformers"]["pairs_per_s"] > 0
    assert bench["training"]["recipe"]["pairs_per_s"] > 0 and bench["recipe_ratio"] > 0
    compiled = parts["compiled"]["figures"]["results"]
    assert compiled["openalign"]["pairs_per_s"] > 0
    for which in ("openalign", "transformers"):  # each contender's step profiled, its table written beside bench's
        assert compiled[which]["profile"]["ops"] > 0 and compiled[which]["profile"]["wall_s"] > 0
        assert "bench model: " in (out / "profile" / f"model-{which}-eager.txt").read_text()
        assert compiled[which]["first_step_s"] > 0  # built and warmed up together, then timed one at a time
        assert len(compiled[which]["steps_s"]) == 1
    loop = parts["compiled_loop"]["figures"]  # the loop beside its bare step, its data wait as a share
    assert set(loop["training"]) == {"openalign", "recipe"} and 0 <= loop["recipe_data_share"] < 1
    assert loop["recipe_ratio"] > 0 and len(loop["training"]["recipe"]["steps_s"]) == 1
    towers = parts["towers"]["figures"]
    assert towers["text"][0]["median_ms"] > 0 and towers["text"][1]["model"].startswith("transformers BertModel")
    for run in ("paper", "loop"):
        figures = parts[run]["figures"]
        assert figures["finished"] and figures["steps_done"] >= 1 and figures["pairs_per_s_compute"] > 0
        assert parts[run]["host_memory"]["peak_pss_gib"] > 0
        assert summary["parts"]["plan"]["figures"][run]["peak_gib"] > 0
    assert parts["paper"]["figures"]["measurement"]["chunk"] == 16
    assert sum(p["limit_s"] for n, p in parts.items() if n != "plan") <= 860

    text = (out / "gpu_check.md").read_text()
    assert text in printed
    for heading in ("## Parts", "## Training step against transformers", "## Training runs", "## Plan against"):
        assert heading in text
    assert "| l2 | pretrain_align batch 32, chunk 16 | failed |" in text
    assert "`bench train --recipe`: the training loop" in text and "| text tower alone, fwd + bwd ms" in text
    # Each timed step profiled: bench's bare steps (ours beside transformers'), the loop, the compiled part, the
    # compiled loop's bare step and loop.
    assert text.count("| the same, profiled | wall ") == 5
    # ... and each one's host during its timed steps, the compiled part's contenders too.
    assert text.count("| the same, on the host | main thread busy ") == 5
    assert "| `bench train`'s bare step, eager, from JPEG shards |" in text and "; first step " in text
    assert (out / "profile" / "recipe-eager.txt").is_file()
    assert "`openalign train`'s loop, eager (not compiled here), from JPEG shards" in text
    assert "--no-such-option needs a value" in text


def test_the_gpu_check_fits_two_calls_of_a_short_lease() -> None:
    """The command the GPU holder runs: by default every part gets its whole share (at least what it took on a
    freshly started H200); the CUDA tests and the compiled contenders fit one call of a GPU lent for minutes, the
    rest runs in a second one, and a budget given scales the shares down to fit it."""
    s = gpu.GpuCheckSettings()
    parts = gpu.build_parts(s, Path("out"), Path("work"), "h200-141gb", Path("vocab"))
    limits = gpu._limits(s, parts)
    assert set(limits) == {"tests", "bench", "compiled", "towers", "compiled_loop", "loop"}
    assert limits == {name: gpu.WEIGHTS[name] for name in limits}
    assert limits["compiled_loop"] >= 175 and limits["bench"] >= 120 and limits["tests"] >= 78
    # A 15-minute lease: first the CUDA tests and the compiled contenders in one call of at most eight minutes,
    # then the rest with what is left (--budget-s).
    first = gpu.GpuCheckSettings(bench=False, towers=False, loop=False, compiled_loop=False)
    rest = gpu.GpuCheckSettings(tests=False, compiled=False)
    assert first.budget() + rest.budget() == s.budget() + gpu.RESERVE_S
    assert first.budget() <= 480 and limits["compiled"] >= 270
    short = gpu.GpuCheckSettings(budget_s=300)
    assert sum(gpu._limits(short, parts).values()) == pytest.approx(300 - gpu.RESERVE_S)
    s = gpu.GpuCheckSettings(paper=True)
    parts = gpu.build_parts(s, Path("out"), Path("work"), "h200-141gb", Path("vocab"))
    paper = next(p for p in parts if p.name == "paper")
    for flag in ("--train.batch_size", "16384", "--train.chunk_size", "64", "--data.workers", "14"):
        assert flag in paper.argv
    assert not any("prefetch_factor" in a for p in parts for a in p.argv)


def test_gpu_names_map_to_plan_devices() -> None:
    assert gpu.device_key("NVIDIA H200") == "h200-141gb"
    assert gpu.device_key("NVIDIA H100 80GB HBM3") == "h100-80gb"
    assert gpu.device_key("NVIDIA GeForce RTX 4090") is None and gpu.device_key(None) is None


def test_tree_memory_counts_this_process() -> None:
    import os

    now = tree_memory(os.getpid())
    assert now["processes"] >= 1 and 0 < now["pss"] <= now["rss"]


def test_the_table_is_left_alone_for_toy_or_unknown_devices(tmp_path: Path) -> None:
    base = {"settings": {"tiny": True, "device": "cpu"}, "environment": {}, "parts": {}, "date": "2026-01-01"}
    assert gpu.update_table(base, tmp_path / "t.json").startswith("not written: toy sizes")
    base["settings"] = {"tiny": False, "device": "cuda"}
    base["environment"] = {"gpu": "NVIDIA L40S", "device_key": None}
    assert "not a device plans know" in gpu.update_table(base, tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()


def test_a_gpu_run_is_recorded_in_the_throughput_table(tmp_path: Path) -> None:
    from openalign.train.throughput import load_measurements

    row = {"config": "pretrain_align_b7", "image": "b7", "text": "bert-base", "batch": 16384, "chunk": 64,
           "image_size": 289, "text_length": 64, "precision": "bf16", "compiled": False,
           "grad_checkpointing": False}  # fmt: skip
    figures = {"measurement": row, "pairs_per_s_compute": 61.23, "steps_done": 2, "gpu_peak_gib": 36.2}
    summary = {
        "settings": {"tiny": False, "device": "cuda"},
        "environment": {"gpu": "NVIDIA H200", "device_key": "h200-141gb", "commit": "abc1234"},
        "parts": {"paper": {"figures": figures}, "l2": {"figures": {"measurement": row}}},  # l2: no step ended
        "date": "2026-11-27",
    }
    assert gpu.update_table(summary, tmp_path / "t.json").startswith("wrote 1 row(s)")
    (m,) = load_measurements(tmp_path / "t.json")
    assert (m.device, m.gpu, m.batch, m.chunk, m.pairs_per_s, m.commit, m.peak_gib) == (
        "h200-141gb",
        "NVIDIA H200",
        16384,
        64,
        61.2,
        "abc1234",
        36.2,
    )


def test_the_compiled_loop_trains_the_model_the_compiled_part_leaves_in_the_caches() -> None:
    """Same preset, size, batch, precision and batch norm: the loop's towers are the graphs `bench model --compile`
    compiled just before it, so that a fresh machine compiles them once."""
    s = gpu.GpuCheckSettings()
    model, loop = gpu._bench_settings(s, "compiled"), gpu._bench_settings(s, "compiled_loop")
    for key in ("preset", "batch_size", "bf16", "device", "compile", "image_size", "virtual_batch_size"):
        assert model.get(key) == loop.get(key), key
    assert loop["compile"] and loop["recipe"] and loop.get("bare", True)  # compiled once, for both
    assert gpu.PARTS.index("compiled") < gpu.PARTS.index("compiled_loop")


def test_a_timed_rows_steps_show_their_spread() -> None:
    """The median step's figures, and with several timed steps the shortest and longest: a loop whose mean is far
    from its median (a slow step in a few, or two kinds of step) shows which."""
    from openalign.bench.gpu_report import _steps

    loop = {"pairs_per_s": 258.3, "parts_s": {"data": 0.001, "compute": 0.247}, "steps_s": [0.248, 0.151, 0.26]}
    assert _steps(loop) == "258.3 (data 0.001 s, compute 0.247 s; 3 steps of 0.151–0.260 s)"
    assert _steps({**loop, "steps_s": [0.248]}) == "258.3 (data 0.001 s, compute 0.247 s)"
    assert _steps({"pairs_per_s": 20.0, "steps_s": [0.3, 0.5]}) == "20.0 (2 steps of 0.300–0.500 s)"
