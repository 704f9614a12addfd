"""``openalign bench embed``: ``openalign embed`` by N torchrun processes beside one process, in one run.

Synthetic shards and an untrained preset (with a WordPiece vocabulary learnt from the captions) are written
to a work folder; then the very same command embeds them once as one plain process and once under
``torch.distributed.run --nproc_per_node N``. Each wall time is the whole job as a user sees it, process
start and model loading included, so the ratio is what adding processes buys end to end. On CPUs the cores
are shared out: the one process gets them all, each of the N one N-th. The outputs of both runs are
compared, as the test suite does bit for bit at equal thread counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from openalign.config import ConfigError


@dataclass
class EmbedBenchSettings:
    """What ``openalign bench embed`` measures."""

    processes: int = 2  # torchrun processes beside the one plain process
    shards: int = 8  # synthetic WebDataset shards (the parts the processes share)
    per_shard: int = 64  # samples per shard
    image_size: int = 64  # synthetic images' side (the model's own size applies when embedding)
    preset: str = "nano"  # untrained model preset
    batch_size: int = 32  # images per forward pass
    device: str = "auto"  # auto: cuda:LOCAL_RANK when CUDA is available, else cpu
    timeout_s: int = 1800  # a run taking longer is an error
    work_dir: str | None = None  # where shards, model and outputs go (default a temporary folder)
    json_path: str | None = None  # also write the results to this JSON file

    def validate(self) -> None:
        if min(self.processes, self.shards, self.per_shard, self.batch_size, self.image_size) < 1:
            raise ConfigError("processes, shards, per_shard, batch_size and image_size must be at least 1")


def _prepare(work: Path, s: EmbedBenchSettings) -> tuple[str, Path]:
    import torch

    import openalign
    from openalign.data.shards import write_shards
    from openalign.data.synthetic import SyntheticWorld
    from openalign.text import train_wordpiece

    world = SyntheticWorld(seed=0, image_size=s.image_size)
    rows = [world.row(i, noise=0.0) for i in range(s.shards * s.per_shard)]
    samples = [{"key": f"{r.index:08d}", "jpg": world.render(r.scene), "txt": r.caption, "json": {}} for r in rows]
    write_shards(samples, work / "shards", samples_per_shard=s.per_shard)
    tokenizer = train_wordpiece([r.caption for r in rows], vocab_size=400)
    torch.manual_seed(0)
    model = openalign.create_model(s.preset, text={"vocab_size": tokenizer.vocab_size})
    openalign.save_model(model, work / "model")
    tokenizer.save(work / "model")
    return str(work / "shards" / f"{{00000..{s.shards - 1:05d}}}.tar"), work / "model"


def _run(argv: list[str], threads: int, timeout: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    src = str(Path(__file__).resolve().parents[2])  # the package as this process sees it, installed or not
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])} … failed: {(done.stderr or done.stdout).strip()[-500:]}")
    return wall


def _max_difference(a: Path, b: Path) -> float:
    worst = 0.0
    for kind in ("img_emb", "text_emb"):
        for file in sorted((a / kind).glob("*.npy")):
            x, y = np.load(file).astype(np.float64), np.load(b / kind / file.name).astype(np.float64)
            worst = max(worst, float(np.abs(x - y).max(initial=0.0)))
    return worst


def run_embed_bench(s: EmbedBenchSettings) -> dict[str, Any]:
    """Time both runs and print samples/s of each and the ratio N processes / one process."""
    s.validate()
    with tempfile.TemporaryDirectory(prefix="openalign-bench-embed-") as tmp:
        work = Path(s.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        shards, model = _prepare(work, s)
        common = ["embed", shards, "--model", str(model), "--batch-size", str(s.batch_size)]
        common += ["--device", s.device, "--quiet"]
        cores = os.cpu_count() or 1
        one = _run([sys.executable, "-m", "openalign", *common[:2], str(work / "one"), *common[2:]], cores, s.timeout_s)
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={s.processes}"]
        argv = [*launcher, "-m", "openalign", *common[:2], str(work / "many"), *common[2:]]
        many = _run(argv, max(1, cores // s.processes), s.timeout_s)
        info = json.loads((work / "many" / "embed.json").read_text())
        samples = int(info["totals"]["rows"])
        difference = _max_difference(work / "one", work / "many")
    result = {
        "samples": samples,
        "shards": s.shards,
        "processes": s.processes,
        "one_process_s": one,
        "n_processes_s": many,
        "one_process_samples_per_s": samples / one,
        "n_processes_samples_per_s": samples / many,
        "ratio": one / many,
        "max_abs_difference": difference,
    }
    print(f"embed {samples} samples ({s.shards} shards, {s.preset}, batch {s.batch_size}, device {s.device}):")
    print(f"  {s.processes} processes (torchrun): {samples / many:9.1f} samples/s  ({many:.1f} s)")
    print(f"  1 process:             {samples / one:9.1f} samples/s  ({one:.1f} s)")
    print(f"  ratio {s.processes} processes / 1 process: {one / many:.2f}x; outputs differ by at most {difference:.1e}")
    if s.json_path:
        Path(s.json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result
