"""What ``openalign bench gpu`` runs in its child processes: a timed training run, plans, the two benches.

Each writes its figures to a JSON report as it goes (the training run every two seconds), so a part stopped
at its time limit still leaves what it measured.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["bench", "plan_run", "train_run"]

GiB = 2**30


def _write(report: Path, data: dict[str, Any]) -> None:
    tmp = report.with_name(report.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(report)  # the parent may read it at any moment


# ---------------------------------------------------------------------------------------------- training


class _Watch:
    """What the run has done so far: batches handed over (asked, received), rows embedded with and without
    a graph (gradient caching embeds every row twice), and when the first no-graph pass ended."""

    def __init__(self, global_batch: int) -> None:
        self.global_batch = global_batch
        self.batches: list[tuple[float, float]] = []
        self.rows = {"no_grad": 0, "grad": 0}
        self.first_pass_end: float | None = None
        self.lock = threading.Lock()

    def stream(self, inner: Any) -> Any:
        watch = self

        class Timed:
            """The loop's stream, its batches timed; everything else is the stream's own."""

            def __getattr__(self, name: str) -> Any:
                return getattr(inner, name)

            def __iter__(self) -> Iterator[Any]:
                it = iter(inner)
                while True:
                    asked = time.time()
                    try:
                        batch = next(it)
                    except StopIteration:
                        return
                    with watch.lock:
                        watch.batches.append((asked, time.time()))
                    yield batch

        return Timed()

    def embedded(self, rows: int, grad: bool) -> None:
        with self.lock:
            self.rows["grad" if grad else "no_grad"] += rows
            if not grad and self.first_pass_end is None and self.rows["no_grad"] >= self.global_batch:
                self.first_pass_end = time.time()


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # the line being written
            continue
        if "loss" in row:
            rows.append(row)
    return rows


def _figures(watch: _Watch, run_dir: Path, device: str) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"global_batch": watch.global_batch}
    if device == "cuda" and torch.cuda.is_initialized():
        out["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / GiB, 3)
        out["gpu_reserved_peak_gib"] = round(torch.cuda.max_memory_reserved() / GiB, 3)
        out["gpu_peak_kind"] = "torch.cuda.max_memory_allocated"
    else:
        out["process_peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
    with watch.lock:
        batches, rows, first_pass_end = list(watch.batches), dict(watch.rows), watch.first_pass_end
    steps = []
    for row, (asked, got) in zip(_metrics(run_dir), batches, strict=False):
        compute = row["time"] - got
        steps.append(
            {
                "step": row["step"],
                "data_wait_s": round(got - asked, 3),
                "compute_s": round(compute, 3),
                "pairs_per_s_compute": round(watch.global_batch / compute, 2) if compute > 0 else None,
                "pairs_per_s_loop": row.get("pairs_per_s"),
            }
        )
    out["steps"] = steps
    out["steps_done"] = len(steps)
    rates = [s["pairs_per_s_compute"] for s in steps if s["pairs_per_s_compute"]]
    out["pairs_per_s_compute"] = max(rates) if rates else None
    out["rows_embedded"] = rows
    if not steps and batches:
        # No step has ended: estimate one from the rows embedded so far (the first pass without a graph, then
        # the pass with one), marked as an estimate.
        now, got = time.time(), batches[0][1]
        if first_pass_end is not None and rows["grad"]:
            rate = rows["grad"] / (now - first_pass_end)
            estimate = (first_pass_end - got) + watch.global_batch / rate
            out["pairs_per_s_estimate"] = round(watch.global_batch / estimate, 2)
        elif first_pass_end is None and rows["grad"] and not rows["no_grad"]:  # a plain step
            out["pairs_per_s_estimate"] = round(rows["grad"] / (now - got), 2)
    return out


def train_run(argv: list[str], report: Path) -> int:
    """``RECIPE --section.key VALUE …``: ``openalign.train.train`` with its batches, steps, embedded rows and peak
    GPU memory reported to ``report`` every two seconds and at the end."""
    import torch

    from openalign.model.dual_encoder import DualEncoder
    from openalign.train import throughput
    from openalign.train.config import compile_enabled, load_train_config, parse_overrides, resolve_precision
    from openalign.train.data import build_train_stream
    from openalign.train.loop import train

    cfg = load_train_config(argv[0], parse_overrides(argv[1:]))
    run_dir = Path(cfg.train.run_dir)
    watch = _Watch(cfg.per_rank_batch(1))
    forward = DualEncoder.forward

    def counted(self: DualEncoder, pixels: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = forward(self, pixels, *args, **kwargs)
        watch.embedded(pixels.shape[0], torch.is_grad_enabled())
        return out

    DualEncoder.forward = counted  # type: ignore[method-assign,assignment]  # counts rows; the loop is untouched
    model = cfg.model.resolve()
    image, text = throughput.family(model)
    bf16 = resolve_precision(cfg.train.precision, cfg.train.device, model.image.family) == "bf16"
    static: dict[str, Any] = {
        "config": argv[0],
        "measurement": {
            "config": argv[0],
            "image": image,
            "text": text,
            "batch": watch.global_batch,
            "chunk": cfg.train.chunk_size,
            "image_size": cfg.data.image_size or model.image_size,
            "text_length": cfg.data.max_text_length,
            "precision": "bf16" if bf16 else "fp32",
            "compiled": compile_enabled(cfg, cfg.train.device),
            "grad_checkpointing": cfg.train.grad_checkpointing,
        },
    }
    if cfg.train.device == "cuda":
        static["gpu"] = torch.cuda.get_device_name(0)
    done = threading.Event()

    def report_now(final: bool = False) -> None:
        _write(report, {**static, **_figures(watch, run_dir, cfg.train.device), "finished": final})

    def reporter() -> None:
        while not done.wait(2.0):
            report_now()

    thread = threading.Thread(target=reporter, daemon=True)
    thread.start()
    start = time.time()
    try:
        train(cfg, stream_factory=lambda *a, **k: watch.stream(build_train_stream(*a, **k)))
    except BaseException as err:  # out of memory, say: what was measured up to it is kept, and the error named
        static["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        raise
    finally:
        done.set()
        thread.join()
        static["seconds"] = round(time.time() - start, 1)
        report_now(final="error" not in static)
    return 0


# ---------------------------------------------------------------------------------------------- plans


def plan_run(argv: list[str], report: Path) -> int:
    """``DEVICE (NAME RECIPE OVERRIDES-JSON)…``: each run's plan on DEVICE, written as each is done."""
    from openalign.train import plan as P

    device = P.device_spec(argv[0])
    plans: dict[str, Any] = {"device": device.name}
    for name, recipe, overrides in zip(argv[1::3], argv[2::3], argv[3::3], strict=True):
        start = time.perf_counter()
        cfg = P.load_plan_config(recipe, json.loads(overrides))
        p = P.plan(cfg, device)
        plans[name] = {
            "peak_gib": round(p.peak / GiB, 3),
            "fits": p.fits,
            "capacity_gib": round(p.capacity / GiB, 2),
            "inputs_gib": round(p.inputs / GiB, 3),
            "flops_per_step": p.flops,
            "pairs_per_s": p.pairs_per_second,
            "step_s": p.step_seconds,
            "seconds": round(time.perf_counter() - start, 1),
        }
        _write(report, plans)
    return 0


# ---------------------------------------------------------------------------------------------- benches


def bench(command: str, settings: dict[str, Any], report: Path) -> int:
    """``bench-train`` / ``bench-model`` / ``bench-towers`` with these settings, figures to ``report``."""
    import importlib.util

    from openalign.bench.model import BenchSettings, run_model_bench
    from openalign.bench.towers import TowersBenchSettings, run_towers_bench
    from openalign.bench.train import run_train_bench
    from openalign.bench.train_setup import TrainBenchSettings

    if command == "bench-model":
        run_model_bench(BenchSettings(**settings, json_path=str(report)))
        return 0
    if command == "bench-towers":
        run_towers_bench(TowersBenchSettings(**settings, json_path=str(report)))
        return 0
    s = TrainBenchSettings(**settings, json_path=str(report))
    if importlib.util.find_spec("webdataset") is not None:
        run_train_bench(s)
        return 0
    _train_bench_without_webdataset(s, report)
    return 0


def _train_bench_without_webdataset(s: Any, report: Path) -> None:
    """``bench train``'s training figures and our input pipeline's, with bench train's own functions, where
    webdataset (the pipeline's baseline) is not installed."""
    from openalign.bench import train as bt
    from openalign.bench.model import matmul_peak

    print("webdataset is not installed: the input pipeline is measured without its baseline", flush=True)
    with tempfile.TemporaryDirectory(prefix="openalign-bench-train-") as tmp:
        shards, tok = bt.prepare_data(s, Path(tmp))
        training = {
            w: bt.in_own_process(bt.measure_training, w, s, shards, str(tok)) for w in ("openalign", "transformers")
        }
        one = bt.in_own_process(bt.measure_pipeline, "openalign", s, shards, str(tok), 0)
        ours = {"in_process": one["samples_per_s"], "workers": 0.0, "cpu_ms": one["cpu_ms"]}
        if s.workers:
            many = bt.in_own_process(bt.measure_pipeline, "openalign", s, shards, str(tok), s.workers)
            ours["workers"] = many["samples_per_s"]
    peak = matmul_peak(s.device, s.bf16)
    nominal = training["transformers"]["flops_per_step"]
    for res in training.values():
        res["mfu"] = nominal / res["step_s"] / peak if nominal else None
    _write(
        report,
        {
            "settings": dataclasses.asdict(s),
            "matmul_peak_flops": peak,
            "training": training,
            "pipeline_samples_per_s": {"openalign": ours},
            "speedup": training["openalign"]["pairs_per_s"] / training["transformers"]["pairs_per_s"],
            "note": "webdataset is not installed: no input-pipeline baseline",
        },
    )
