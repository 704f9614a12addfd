"""The contrastive loss dense and a block of rows at a time: time and peak memory of its forward and backward.

For each batch, ``contrastive_loss`` (or SigLIP's ``sigmoid_loss``) over N unit embeddings (one process, so N
is the global batch) runs dense and with ``block_rows``, in alternating rounds in one process. Printed per
batch: each one's median step, the ratio blockwise / dense, the peak bytes each adds (the CPU allocator's own
events on a CPU, the CUDA allocator's peak on a GPU) and how far their values and gradients lie apart.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from openalign.loss import contrastive_loss, sigmoid_loss


@dataclass
class LossBenchSettings:
    """What ``openalign bench loss`` measures."""

    batches: list[int] = field(default_factory=lambda: [64, 256, 1024, 4096])  # global batch sizes N
    loss: Literal["softmax", "sigmoid"] = "softmax"  # ALIGN's normalised softmax, or SigLIP's sigmoid loss
    dim: int = 640  # embedding width (ALIGN's)
    block_rows: int = 256  # rows the blockwise loss scores at a time
    label_smoothing: float = 0.1  # the paper's
    rounds: int = 5  # timed rounds of each, alternating; the median is printed
    device: str = "cpu"  # cpu or cuda
    seed: int = 0  # data seed
    json_path: str | None = None  # also write the results to this JSON file


def allocator_peak(step: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes the allocator holds above its level before ``step()``: on a CPU from the profiler's record of
    every allocation and free, on a GPU from the CUDA allocator's peak."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - before)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    assert prof.profiler is not None
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def _step(
    images: torch.Tensor, texts: torch.Tensor, temperature: torch.Tensor, settings: LossBenchSettings, block: int | None
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    x, y, t = (v.detach().requires_grad_() for v in (images, texts, temperature))
    if settings.loss == "sigmoid":
        b = torch.tensor(-10.0, device=x.device, requires_grad=True)  # SigLIP's initial bias
        loss = sigmoid_loss(x, y, t, b, block_rows=block)
        return loss.detach(), torch.autograd.grad(loss, (x, y, t, b))
    loss = contrastive_loss(x, y, t, label_smoothing=settings.label_smoothing, block_rows=block)
    return loss.detach(), torch.autograd.grad(loss, (x, y, t))


def _peak(
    images: torch.Tensor,
    texts: torch.Tensor,
    temperature: torch.Tensor,
    settings: LossBenchSettings,
    block: int | None,
    device: torch.device,
) -> int:
    return allocator_peak(lambda: _step(images, texts, temperature, settings, block), device)


def _apart(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def run_loss_bench(settings: LossBenchSettings) -> list[dict[str, Any]]:
    """Time and measure the dense and the blockwise loss at every batch; print a table and return its rows."""
    if min(settings.dim, settings.block_rows, settings.rounds, *settings.batches) < 1:
        raise ValueError("batches, dim, block_rows and rounds must be positive")
    device = torch.device(settings.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(settings.seed)
    rows: list[dict[str, Any]] = []
    print(
        f"{settings.loss} loss, forward + backward, D = {settings.dim}, blocks of {settings.block_rows} rows, {device}"
    )
    print(f"{'N':>6} {'dense ms':>10} {'blockwise ms':>13} {'ratio':>6} {'dense MiB':>10} {'blockwise MiB':>14} apart")
    for n in settings.batches:
        images = F.normalize(torch.randn(n, settings.dim, generator=gen), dim=1).to(device)
        texts = F.normalize(images.cpu() + torch.randn(n, settings.dim, generator=gen), dim=1).to(device)
        temperature = torch.tensor(0.05, device=device)
        contenders = {"dense": None, "blockwise": settings.block_rows}
        times: dict[str, list[float]] = {name: [] for name in contenders}
        results = {}
        for _ in range(settings.rounds + 1):  # the first round warms up
            for name, block in contenders.items():
                sync()
                start = time.perf_counter()
                results[name] = _step(images, texts, temperature, settings, block)
                sync()
                times[name].append(time.perf_counter() - start)
        peaks = {name: _peak(images, texts, temperature, settings, block, device) for name, block in contenders.items()}
        (dense_loss, dense_grads), (lean_loss, lean_grads) = results["dense"], results["blockwise"]
        gaps = [_apart(a, b) for a, b in zip(lean_grads, dense_grads, strict=True)]
        apart = max(_apart(lean_loss, dense_loss), *gaps)
        median = {name: statistics.median(t[1:]) for name, t in times.items()}
        row = {
            "batch": n,
            "dense_ms": median["dense"] * 1000,
            "blockwise_ms": median["blockwise"] * 1000,
            "ratio": median["blockwise"] / median["dense"],
            "dense_peak_mib": peaks["dense"] / 2**20,
            "blockwise_peak_mib": peaks["blockwise"] / 2**20,
            "apart": apart,
        }
        rows.append(row)
        print(
            f"{n:>6} {row['dense_ms']:>10.1f} {row['blockwise_ms']:>13.1f} {row['ratio']:>5.2f}x"
            f" {row['dense_peak_mib']:>10.1f} {row['blockwise_peak_mib']:>14.1f} {apart:.1e}"
        )
    if settings.json_path:
        with open(settings.json_path, "w") as f:
            json.dump({"settings": asdict(settings), "rows": rows}, f, indent=2)
    return rows
