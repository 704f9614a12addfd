"""``openalign bench gpu``: the GPU path checked in one command, on a GPU one may hold for only minutes.

Parts, each in its own process group with its own time limit (a part that fails or runs out of time is
recorded with the end of its output, and the next part starts):

- ``tests``: ``pytest -m cuda tests/test_cuda.py`` (bf16, gradient caching, exact resume, the memory plan,
  DDP and FSDP2 over NCCL); skipped with a note where the tests are not installed (a wheel);
- ``bench``: ``bench train --recipe`` (data, forward, loss, backward, optimizer), ours against transformers'
  AlignModel, eager, the real training loop beside that bare step, and the input pipeline against webdataset's;
  each of the three steps profiled too (``OUT/profile/``: per-op tables, kernels per step, host synchronisations);
- ``compiled``: ``bench model --compile --together``, ours against transformers, both compiled (at once, then
  timed one at a time);
- ``towers``: ``bench towers``, each tower alone (forward + backward) against its peer: the text tower against
  transformers' ``BertModel``, the image tower against timm's EfficientNets;
- ``compiled_loop``: ``bench train --recipe --compile``: the bare step compiled, then the real training loop in its
  process on the graphs it compiled (as ``openalign train`` runs on CUDA): the loop's step against the bare step's
  and the share of it spent waiting for data, fed by the input pipeline from JPEG shards, then each step profiled;
- ``paper`` (``--paper``; off by default, as ``l2``): ``pretrain_align_b7`` at the paper's batch (16,384 pairs,
  chunks of 64) on synthetic data, while a sampler records the peak memory of the whole process tree (the
  training process and its data workers) and the run reports its peak GPU memory;
- ``loop``: the same recipe at batch 64 without chunks, the loop's step beside ``bench train``'s;
- ``l2``: ``pretrain_align`` (L2 + BERT-Large) at batch 512 in chunks of 128;
- ``plan``: ``openalign.train.plan`` of each training run (fake tensors on the CPU), at low CPU priority in the
  background, for the plan-against-measured table.

Host memory is the sum over the process tree of each process's PSS (proportional set size, from
``/proc/PID/smaps_rollup``): a page shared by k processes counts 1/k in each, so pages workers share with
the parent by fork, and batches handed over in shared memory, count once. The sum of RSS, which counts
them in every process, and the growth of the machine's used memory are reported beside it.

Training runs report through a small wrapper around ``openalign.train.train`` (``python -m
openalign.bench.gpu train-run``): peak GPU memory every two seconds (a run stopped at its limit still has
one), when each batch arrived and each step ended (pairs/s with and without the wait for data), and the rows
the model has embedded so far, from which the rate of a step still running is estimated.

The whole check stays within ``budget_s``: each part's limit is its share of the budget. Results go to
``OUT/gpu_check.json`` and ``OUT/gpu_check.md`` (printed too); ``update_table`` writes the training runs'
measured pairs/s into the throughput table plans read (``openalign.train.throughput``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openalign.bench import gpu_memory
from openalign.bench.gpu_report import markdown
from openalign.config import ImageTowerConfig
from openalign.process import skip_exit_collection

__all__ = ["GpuCheckSettings", "run_gpu_check"]

SRC = Path(__file__).resolve().parents[2]  # the directory holding the openalign package
TESTS = SRC.parent / "tests" / "test_cuda.py"  # present in a checkout, not in an installed wheel
PARTS = ("tests", "bench", "compiled", "towers", "compiled_loop", "paper", "loop", "l2", "plan")
# Each part's share of the budget in seconds, sized for a fresh GPU with empty compile caches
# (docs/decisions/gpu-check-budget.md); --budget-s scales the shares, and "paper" and "l2" run only when named.
WEIGHTS = {
    "tests": 90.0,
    "bench": 180.0,  # three contenders timed and profiled, then the input pipeline
    # Ours and transformers' whole AlignModel compile together, from empty caches.
    "compiled": 360.0,
    "towers": 60.0,
    # The loop compiles its graphs; the bare step before it in its process adds its steps, profile and workers'
    # start, not a compilation.
    "compiled_loop": 240.0,
    "loop": 40.0,
    "paper": 150.0,
    "l2": 55.0,
}
# The recipes' ghost batch norm groups (pretrain_align*.yaml), which bench times as the loop part and `openalign
# train` run them.
RECIPE_GHOST_GROUP = ImageTowerConfig().virtual_batch_size
RESERVE_S = 15.0  # probing the device, writing the results
GPU_KEYS = {"H200": "h200-141gb", "H100": "h100-80gb", "A100-SXM4-80GB": "a100-80gb", "A100-SXM4-40GB": "a100-40gb"}


@dataclass
class GpuCheckSettings:
    """What ``openalign bench gpu`` checks."""

    device: str = "cuda"  # cuda, or cpu (with --tiny: the check itself, proven without a GPU)
    tiny: bool = False  # toy sizes for every part (nano, small batches, 64 px, 1-3 steps)
    out: str = "gpu-check"  # directory for gpu_check.json, gpu_check.md and each part's log
    # Wall-clock limit of the whole check; each part's limit is its share. None: the chosen parts' shares in full.
    budget_s: float | None = None
    update_table: bool = False  # write the training runs' pairs/s into the shipped throughput table
    tests: bool = True  # pytest -m cuda tests/test_cuda.py
    bench: bool = True  # bench train, ours against transformers, eager (b7-base, bf16, batch 64)
    compiled: bool = True  # bench model --compile, ours against transformers (b7-base, bf16, batch 64)
    towers: bool = True  # bench towers: text tower against BertModel, image tower against timm (b7-base, batch 64)
    # The compiled training loop's step and data wait (bench train --recipe --compile, JPEG shards, b7-base, batch 64).
    compiled_loop: bool = True
    paper: bool = False  # pretrain_align_b7 at 16384 pairs in chunks of 64, with host and GPU memory
    loop: bool = True  # pretrain_align_b7 at batch 64: the loop's step beside bench train's
    l2: bool = False  # pretrain_align (L2 + BERT-Large) at batch 512 in chunks of 128
    plan: bool = True  # plans of the training runs (fake tensors, background, low priority)
    paper_steps: int = 2  # steps of the paper's batch
    workers: int = 14  # data workers of the training runs and bench train (16-core hosts)
    limits: dict[str, float] = field(default_factory=dict)  # seconds for named parts instead of their share
    break_part: str | None = None  # testing: give this part an unknown option, to see a failure recorded

    def budget(self) -> float:
        """``budget_s``, or where unset the shares of the parts asked for, and the reserve."""
        if self.budget_s is not None:
            return self.budget_s
        return RESERVE_S + sum(w for name, w in WEIGHTS.items() if getattr(self, name))

    def validate(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"--device must be cuda or cpu, got {self.device!r}")
        if self.budget_s is not None and self.budget_s <= RESERVE_S + 5:
            raise ValueError(f"--budget-s must exceed {RESERVE_S + 5:g} seconds")
        unknown = sorted(set(self.limits) - set(PARTS))
        if unknown or (self.break_part is not None and self.break_part not in PARTS):
            raise ValueError(f"unknown part {[*unknown, self.break_part][0]!r}; parts: {', '.join(PARTS)}")
        if self.paper_steps < 1 or self.workers < 0:
            raise ValueError("--paper-steps must be at least 1 and --workers not negative")


@dataclass
class Part:
    """One subprocess of the check."""

    name: str
    title: str
    argv: list[str]
    report: Path | None = None  # JSON the part writes, read back whatever its end
    background: bool = False
    sample_memory: bool = False
    skip: str = ""  # why it does not run, when it does not
    note: str = ""


# ---------------------------------------------------------------------------------------------- parts


def _train_overrides(
    s: GpuCheckSettings, run: str, run_dir: Path, tokenizer: Path | None = None
) -> tuple[str, dict[str, Any]]:
    """(recipe, overrides) of a training run of the check; ``tokenizer``: a vocabulary learnt once for all runs."""
    common: dict[str, Any] = {
        "data.source": "synthetic",
        "train.run_dir": str(run_dir),
        "train.device": s.device,
        "train.checkpoint_every": 0,
        "train.checkpoint_minutes": 0,
        # Eager steps, as the shipped throughput rows: compiling would spend minutes of a part's time limit.
        "train.compile": False,
        "eval.every": 0,
        "log.every": 1,
        "log.tensorboard": False,
        "log.progress": False,
    }
    if tokenizer is not None:
        common["data.tokenizer"] = str(tokenizer)
    if s.tiny:
        # nano at 32 px, one thread: every mechanism of the real run (chunks, ghost batch norm, workers) at toy cost.
        common.update(
            {
                "model.preset": "nano",
                "data.image_size": 32,
                "data.resize": 36,
                "data.synthetic.image_size": 36,
                "train.threads": 1,
            }
        )
    sizes = {
        "paper": (
            "pretrain_align_b7",
            (32, 16, min(s.paper_steps, 2), 1) if s.tiny else (16384, 64, s.paper_steps, s.workers),
        ),
        "loop": ("pretrain_align_b7", (32, None, 1, 0) if s.tiny else (64, None, 8, s.workers)),
        "l2": ("pretrain_align", (32, 16, 1, 0) if s.tiny else (512, 128, 2, s.workers)),
    }
    recipe, (batch, chunk, steps, workers) = sizes[run]
    common.update({"train.batch_size": batch, "train.chunk_size": chunk, "train.steps": steps, "data.workers": workers})
    return recipe, common


def _bench_settings(s: GpuCheckSettings, which: str) -> dict[str, Any]:
    cuda = s.device == "cuda"
    profile = str(Path(s.out).resolve() / "profile")  # per-op tables and host synchronisations of each step
    if which == "bench":
        if s.tiny:
            return {"preset": "nano", "image_size": 32, "batch_size": 16, "steps": 1, "warmup": 1, "rounds": 1,
                    "workers": 0, "device": s.device, "bf16": cuda, "shard_samples": 32,
                    "pipeline_samples": 32, "recipe": True, "profile": profile}  # fmt: skip
        return {"preset": "b7-base", "batch_size": 64, "steps": 5, "warmup": 2, "rounds": 1, "workers": s.workers,
                "device": s.device, "bf16": cuda, "shard_samples": 512, "pipeline_samples": 512,
                "recipe": True, "profile": profile, "virtual_batch_size": RECIPE_GHOST_GROUP}  # fmt: skip
    if which == "compiled_loop":
        # The bare step, then the loop in its process on the graphs it compiled (one compilation), fed from JPEG
        # shards by the check's workers, on the model `compiled` times (batch norm per device, not the recipes'
        # groups): the same graphs, which that part leaves in the compile caches, so that the loop mostly reads them
        # from there rather than compiling from scratch.
        loop = {"recipe": True, "baseline": False, "bf16": cuda, "device": s.device, "rounds": 1,
                "profile": profile}  # fmt: skip
        if s.tiny:
            return {**loop, "preset": "nano", "image_size": 32, "batch_size": 16, "steps": 1, "warmup": 1,
                    "workers": 1, "shard_samples": 32, "pipeline_samples": 32, "compile": cuda}  # fmt: skip
        return {**loop, "preset": "b7-base", "batch_size": 64, "steps": 8, "warmup": 3, "workers": s.workers,
                "shard_samples": 512, "pipeline_samples": 256, "compile": True}  # fmt: skip
    if which == "towers":
        # With cudnn.benchmark timed too: never set by training, unmeasured on EfficientNet's depthwise convolutions.
        if s.tiny:
            return {"preset": "nano", "image_size": 32, "batch_size": 8, "steps": 1, "warmup": 1, "rounds": 1,
                    "device": s.device, "bf16": cuda, "cudnn_benchmark": True}  # fmt: skip
        return {"preset": "b7-base", "batch_size": 64, "steps": 3, "warmup": 1, "rounds": 2, "device": s.device,
                "bf16": cuda, "cudnn_benchmark": True}  # fmt: skip
    if s.tiny:
        # Compiling on a CPU takes minutes (a C++ toolchain per kernel); the CPU proof runs the part eager.
        return {"preset": "nano", "image_size": 32, "batch_size": 8, "steps": 1, "warmup": 1, "rounds": 1,
                "device": s.device, "bf16": cuda, "compile": cuda, "profile": profile, "together": True}  # fmt: skip
    # The two contenders compile together (minutes each from empty caches), then each is timed alone.
    return {"preset": "b7-base", "batch_size": 64, "steps": 5, "warmup": 3, "rounds": 1, "device": s.device,
            "bf16": cuda, "compile": True, "profile": profile, "together": True}  # fmt: skip


def _self(command: str, report: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "openalign.bench.gpu", command, "--report", str(report), *args]


def _flags(overrides: dict[str, Any]) -> list[str]:
    return [a for k, v in overrides.items() for a in (f"--{k}", "null" if v is None else json.dumps(v))]


def build_parts(
    s: GpuCheckSettings, out: Path, work: Path, plan_device: str, tokenizer: Path | None = None
) -> list[Part]:
    reports = out / "reports"
    parts: list[Part] = []
    if s.tests:
        skip = "" if TESTS.is_file() else f"no tests at {TESTS} (an installed package): run from a checkout"
        # One -q (the project's addopts give one already; two would drop the counts line the table reads).
        argv = [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "cuda",
            str(TESTS),
            "-o",
            "addopts=-q",
            "-rs",
            "-p",
            "no:cacheprovider",
        ]
        parts.append(Part("tests", "pytest -m cuda tests/test_cuda.py", argv, skip=skip))
    plans: list[str] = []
    for run in ("paper", "loop", "l2"):
        if not getattr(s, run):
            continue
        recipe, overrides = _train_overrides(s, run, work / run, tokenizer)
        title = f"{recipe} batch {overrides['train.batch_size']}, chunk {overrides['train.chunk_size']}"
        report = reports / f"{run}.json"
        parts.append(
            Part(run, title, _self("train-run", report, recipe, *_flags(overrides)), report, sample_memory=True)
        )
        plans += [run, recipe, json.dumps(overrides)]
    benches = (
        ("bench", "bench train --recipe (eager)"),
        ("compiled", "bench model --compile"),
        ("towers", "bench towers"),
        ("compiled_loop", "bench train --recipe --compile (the bare step, then the loop on its graphs)"),
    )
    for name, title in benches:
        if getattr(s, name):
            settings = json.dumps(_bench_settings(s, name))
            command = {"compiled": "bench-model", "towers": "bench-towers"}.get(name, "bench-train")
            part = Part(name, title, _self(command, reports / f"{name}.json", settings), reports / f"{name}.json")
            # bench train goes after the paper's batch, compiling last: it is the part most likely to need more
            # than its share, and the last part is the one a late start shortens.
            parts.insert(2 if name == "bench" and s.paper and s.tests else len(parts), part)
    if s.plan and plans:
        argv = _self("plan-run", reports / "plan.json", plan_device, *plans)
        if shutil.which("nice"):
            argv = ["nice", "-n", "15", *argv]  # the CPU is the other parts' first; a plan only has to end in time
        parts.append(Part("plan", f"plans on {plan_device}", argv, reports / "plan.json", background=True))
    for p in parts:
        if s.break_part == p.name:
            p.argv = [*p.argv, "--no-such-option"]
    return parts


# ---------------------------------------------------------------------------------------------- running


def _env() -> dict[str, str]:
    # The parts import this checkout's openalign whether or not it is installed (PYTHONPATH=src).
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End the part's whole process group (data workers, compile workers, ranks): TERM, then KILL."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_part(part: Part, limit: float, log: Path) -> dict[str, Any]:
    """Run one part to its end or its limit; its status, time, output tail and figures."""
    result: dict[str, Any] = {"name": part.name, "title": part.title, "limit_s": round(limit, 1)}
    if part.note:
        result["note"] = part.note
    if part.skip:
        return {**result, "status": "skipped", "note": part.skip}
    if limit < 5:
        return {**result, "status": "skipped", "note": "no time left in the budget"}
    log.parent.mkdir(parents=True, exist_ok=True)
    if part.report is not None:
        part.report.parent.mkdir(parents=True, exist_ok=True)
        part.report.unlink(missing_ok=True)
    start = time.monotonic()
    with open(log, "wb") as sink:
        proc = subprocess.Popen(part.argv, stdout=sink, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
        sampler = gpu_memory.TreeSampler(proc.pid) if part.sample_memory else None
        try:
            proc.wait(timeout=limit)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc)
        finally:
            if sampler is not None:
                sampler.stop()
    result["seconds"] = round(time.monotonic() - start, 1)
    result["returncode"] = proc.returncode
    result["status"] = "timed out" if timed_out else ("ok" if proc.returncode == 0 else "failed")
    if result["status"] != "ok":
        result["tail"] = log.read_bytes()[-3000:].decode(errors="replace")
    if sampler is not None:
        result["host_memory"] = sampler.summary()
    if part.report is not None and part.report.is_file():
        try:
            result["figures"] = json.loads(part.report.read_text())
        except json.JSONDecodeError as err:  # a part killed while writing: the tail says why
            result["report_error"] = str(err)
    if part.name == "tests":
        result["figures"] = _pytest_counts(log.read_text(errors="replace"))
    return result


def _pytest_counts(text: str) -> dict[str, Any]:
    import re

    lines = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", lines[-1])} if lines else {}
    return {"summary": lines[-1].strip("= ") if lines else "", **counts}


def _limits(s: GpuCheckSettings, parts: list[Part]) -> dict[str, float]:
    """Each foreground part's share of the budget, scaled so that their sum fits it; ``limits`` pins a part."""
    fixed = {p.name: s.limits[p.name] for p in parts if p.name in s.limits and not p.background}
    free = [p.name for p in parts if not p.background and p.name not in fixed and not p.skip]
    room = max(0.0, s.budget() - RESERVE_S - sum(fixed.values()))
    total = sum(WEIGHTS[n] for n in free) or 1.0
    return {**{n: room * WEIGHTS[n] / total for n in free}, **fixed}


def _probe(device: str) -> dict[str, Any]:
    """The device and software, asked in a child so that this process never holds a CUDA context."""
    code = (
        "import json, os, platform, torch\n"
        "cuda = torch.cuda.is_available()\n"
        "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'python': platform.python_version(),"
        " 'gpu': torch.cuda.get_device_name(0) if cuda else None, 'gpus': torch.cuda.device_count() if cuda else 0,"
        " 'cpus': os.cpu_count()}))\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env())
        info: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as err:
        info = {"error": f"probe failed: {err}"}
    with contextlib.suppress(ValueError, OSError):  # sysconf names are not on every platform
        info["host_memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    info["commit"] = _commit()
    info["device"] = device
    return info


def _vocabulary(where: Path) -> Path:
    """A WordPiece vocabulary of the synthetic world's captions, as a run without ``data.tokenizer`` learns at its
    start: learnt here once instead of once per training run."""
    from openalign.data.synthetic import SyntheticWorld
    from openalign.text import train_wordpiece

    world = SyntheticWorld(0, 64)
    tokenizer = train_wordpiece((r.caption for r in world.iter_rows(10_000, 0.25)), vocab_size=8192)
    tokenizer.save(where)
    return where


def device_key(gpu: str | None) -> str | None:
    """The plan's DEVICES key of a GPU as torch names it ("NVIDIA H200" → "h200-141gb"), or None."""
    if not gpu:
        return None
    return next((key for name, key in GPU_KEYS.items() if name in gpu), None)


def _commit() -> str:
    """The code measured: ``OPENALIGN_COMMIT`` when set (a copy of the tree whose git history is not its own),
    else git's short commit, marked ``-dirty`` when the tree differs from it, else "unknown"."""
    if os.environ.get("OPENALIGN_COMMIT"):
        return os.environ["OPENALIGN_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=SRC, capture_output=True, text=True,
            timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def run_gpu_check(s: GpuCheckSettings) -> dict[str, Any]:
    """Run every part, write ``gpu_check.json`` and ``gpu_check.md`` into ``s.out``, print the markdown."""
    s.validate()
    budget = s.budget()
    deadline = time.monotonic() + budget
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    env = _probe(s.device)
    if s.device == "cuda" and not env.get("gpu"):
        print(f"warning: no CUDA device ({env.get('error', 'torch sees none')}); the GPU parts will fail", flush=True)
    key = device_key(env.get("gpu")) if s.device == "cuda" else "cpu"
    plan_device = key or "h100-80gb"
    with tempfile.TemporaryDirectory(prefix="openalign-gpu-check-") as tmp:
        tokenizer = _vocabulary(Path(tmp) / "vocab") if s.paper or s.loop or s.l2 else None
        parts = build_parts(s, out, Path(tmp), plan_device, tokenizer)
        limits = _limits(s, parts)
        results: dict[str, dict[str, Any]] = {}
        background = []
        for p in (p for p in parts if p.background):
            limit = s.limits.get(p.name, budget - RESERVE_S / 2)

            def go(p: Part = p, limit: float = limit) -> None:
                results[p.name] = run_part(
                    p, min(limit, deadline - time.monotonic() - 5), out / "logs" / f"{p.name}.log"
                )

            thread = threading.Thread(target=go, daemon=True)
            thread.start()
            background.append(thread)
        for p in (p for p in parts if not p.background):
            limit = min(limits.get(p.name, 0.0), deadline - time.monotonic() - RESERVE_S / 2)
            print(f"[{p.name}] {p.title}: limit {max(limit, 0):.0f} s", flush=True)
            results[p.name] = r = run_part(p, limit, out / "logs" / f"{p.name}.log")
            print(f"[{p.name}] {r['status']}{' in ' + str(r['seconds']) + ' s' if 'seconds' in r else ''}", flush=True)
        for thread in background:
            thread.join(max(0.0, deadline - time.monotonic()))
    summary: dict[str, Any] = {
        "settings": {**dataclasses.asdict(s), "budget_s": budget},
        "environment": {**env, "plan_device": plan_device, "device_key": key},
        "date": datetime.date.today().isoformat(),
        "parts": {
            p.name: results.get(p.name, {"status": "timed out", "note": "still running at the deadline"}) for p in parts
        },
    }
    summary["ok"] = all(r["status"] in ("ok", "skipped") for r in summary["parts"].values())
    if s.update_table:
        summary["table_update"] = update_table(summary)
    text = markdown(summary)
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "gpu_check.md").write_text(text)
    print(text, flush=True)
    return summary


def update_table(summary: dict[str, Any], path: str | Path | None = None) -> str:
    """Write the training runs' measured pairs/s into the throughput table; one line saying what was done."""
    env = summary["environment"]
    if summary["settings"]["tiny"] or summary["settings"]["device"] != "cuda":
        return "not written: toy sizes or a CPU measure the check, not the GPU"
    if env.get("device_key") is None:
        return f"not written: {env.get('gpu')!r} is not a device plans know (h200-141gb, h100-80gb, a100-*)"
    from openalign.train.throughput import Measurement, record

    rows = []
    for run in ("paper", "loop", "l2"):
        figures = summary["parts"].get(run, {}).get("figures") or {}
        row, rate = figures.get("measurement"), figures.get("pairs_per_s_compute")
        if row is None or not rate:
            continue
        peak = figures.get("gpu_peak_gib")
        rows.append(
            Measurement(
                **row,
                device=env["device_key"],
                gpu=env["gpu"],
                pairs_per_s=round(rate, 1),
                date=summary["date"],
                commit=env["commit"],
                note=f"openalign bench gpu ({run}): the best of {figures.get('steps_done')} steps, data wait excluded",
                peak_gib=round(peak, 2) if peak else None,
            )
        )
    if not rows:
        return "not written: no training run finished a step"
    where = record(rows, path)
    return f"wrote {len(rows)} row(s) to {where}"


# ---------------------------------------------------------------------------------------------- children


def main(argv: list[str] | None = None) -> int:
    """The parts this module runs in children: ``train-run``, ``plan-run`` and the ``bench-*`` commands."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m openalign.bench.gpu")
    parser.add_argument("command", choices=["train-run", "plan-run", "bench-train", "bench-model", "bench-towers"])
    parser.add_argument("--report", required=True, type=Path)
    args, rest = parser.parse_known_args(argv)
    from openalign.bench import gpu_children as children

    if args.command == "train-run":
        return children.train_run(rest, args.report)
    if any(a.startswith("--") for a in rest):
        parser.error(f"unrecognized arguments: {' '.join(a for a in rest if a.startswith('--'))}")
    if args.command == "plan-run":
        return children.plan_run(rest, args.report)
    return children.bench(args.command, json.loads(rest[0]), args.report)


if __name__ == "__main__":
    code = main()
    skip_exit_collection()  # the part's report is written
    sys.exit(code)
