"""``openalign bench model``: training throughput of our dual encoder against transformers' AlignModel.

Both models are built from the same config and fed the same batch; each is measured in a fresh
process (so peak memory is its own and neither warms the other's caches), in alternating rounds,
keeping each one's best round. Model FLOP utilisation divides the nominal FLOPs of a step (three
times the forward FLOPs counted by PyTorch on transformers' model, which does all the work a padded
batch asks for) by the step time and by a matmul peak measured in the same run.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch

from openalign.bench.gradients import check as check_gradients
from openalign.bench.gradients import report as report_gradients
from openalign.bench.host import HostClock
from openalign.bench.peer import align_model, require_baseline
from openalign.bench.profile import keep_best, print_profiles
from openalign.config import model_config
from openalign.loss import contrastive_loss
from openalign.model import DualEncoder
from openalign.model.efficientnet import round_filters
from openalign.process import run_spawned, run_spawned_in_turns
from openalign.train.grad_cache import chunk_batch
from openalign.train.towers import Towers

TEXT_LENGTH = 64


@dataclass
class BenchSettings:
    """What ``openalign bench model`` measures."""

    preset: str = "b0-tiny"  # model preset
    image_size: int | None = None  # square input size (default: the preset's)
    batch_size: int = 16  # image-text pairs per step
    steps: int = 5  # timed steps per round
    warmup: int = 2  # untimed steps per round
    rounds: int = 2  # alternating rounds; the best round counts
    device: str = "cpu"  # cpu or cuda
    bf16: bool = False  # bf16 autocast (GPU)
    # torch.compile: our towers as training compiles them, transformers' whole model (its pooler as a mean: bench.peer)
    compile: bool = False
    # torch.compile's mode for both contenders (reduce-overhead: each step replayed as CUDA graphs, on a GPU)
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"] = "default"
    # image layout: each model's default (ours NHWC, transformers NCHW), or the same for both
    memory_format: Literal["default", "channels_last", "contiguous"] = "default"
    # alt-text: captions of 6-32 tokens padded to 64; full: every row uses all 64
    text_lengths: Literal["alt-text", "full"] = "alt-text"
    baseline: bool = True  # also measure transformers' AlignModel (--no-baseline: only ours)
    # Build, compile and warm up the contenders at once, then time each alone: a round waits for the longest
    # compilation, not their sum (the device must hold both models and batches at once).
    together: bool = False
    json_path: str | None = None  # also write the results to this JSON file
    # Also profile two steps of each contender in the first round: DIR/model-<name>.txt (openalign.bench.profile)
    profile: str | None = None


def bench_config(settings: BenchSettings) -> Any:
    """The preset, with embed_dim set to the image feature width so that transformers can express it
    (its AlignModel has no image projection; the projection is a negligible part of a step), and the [CLS]
    vector as the text feature, the only one AlignModel takes (nano pools the mean)."""
    cfg = model_config(settings.preset)
    width = round_filters(cfg.image.out_channels[-1], cfg.image.width_coefficient, cfg.image.depth_divisor)
    overrides: dict[str, Any] = {"embed_dim": width, "text": {"pooling": "cls"}}
    if settings.memory_format != "default":
        overrides["image"] = {"channels_last": settings.memory_format == "channels_last"}
    if settings.image_size:
        overrides["image_size"] = settings.image_size
    return model_config(cfg, **overrides)


def make_batch(cfg: Any, settings: BenchSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    b, size = settings.batch_size, cfg.image_size
    pixels = torch.rand(b, 3, size, size, generator=gen) * 2 - 1
    ids = torch.randint(1000, cfg.text.vocab_size, (b, TEXT_LENGTH), generator=gen)
    if settings.text_lengths == "full":
        lengths = torch.full((b,), TEXT_LENGTH)
    else:
        # ALIGN keeps alt-texts of 3–20 words; as wordpieces plus [CLS]/[SEP] that is about 6–32 tokens.
        lengths = torch.randint(6, 33, (b,), generator=gen)
    mask = (torch.arange(TEXT_LENGTH)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    ids[:, 0] = 2
    return pixels, ids, mask


def _build(which: str, cfg: Any, compiled: bool) -> tuple[torch.nn.Module, Any]:
    if which == "openalign":
        ours = DualEncoder(cfg)
        return ours, partial(_ours, ours)
    hf = align_model(cfg, compiled)

    def forward(p: torch.Tensor, i: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = hf(pixel_values=p, input_ids=i, attention_mask=m)
        return out.image_embeds, out.text_embeds, hf.temperature

    return hf, forward


def _ours(
    model: DualEncoder,
    pixels: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    text_groups: list[tuple[torch.Tensor, int]] | None = None,
) -> tuple[torch.Tensor, ...]:
    return (*model(pixels, ids, mask, text_groups), model.temperature)


def _encoded(
    model: DualEncoder, pixels: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    return model.encode_image(pixels), model.encode_text(ids, mask), model.temperature


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated memory on a GPU, else this process's peak resident set size, in MiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def forward_flops(forward: Any, *inputs: Any, device: torch.device, bf16: bool) -> int:
    """FLOPs of one forward pass as PyTorch's counter sees them (no graph, autocast as in training)."""
    from openalign.train.flops import counter as flop_counter

    # The project's counter: the stock one counts a depthwise convolution's weight gradient as dense.
    counter = flop_counter()
    with counter, torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        forward(*inputs)
    return counter.get_total_flops()


def measure(
    which: str, settings: BenchSettings, profile: str | None = None, turn: Callable[[], None] | None = None
) -> dict[str, Any]:
    """One contender's figures, measured in the calling process; with ``profile`` (a directory), then two more
    steps profiled, without the timing's synchronisations. ``turn`` (``process.run_spawned_in_turns``) is called
    once warmed up, before the timed steps: it returns when this contender may run alone."""
    torch.manual_seed(0)
    device = torch.device(settings.device)
    cfg = bench_config(settings)
    model, forward = _build(which, cfg, settings.compile)
    model.to(device).train()
    # transformers' model has no layout option: its default is contiguous (NCHW).
    channels_last = cfg.image.channels_last if which == "openalign" else settings.memory_format == "channels_last"
    if channels_last:
        model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's stub omits it
    batch = make_batch(cfg, settings)
    host_mask = batch[2]
    pixels, ids, mask = (t.to(device) for t in batch)
    if channels_last and which != "openalign":
        # Ours takes pixels as training hands them over (NCHW) and lays them out itself, in its tower's first op.
        pixels = pixels.contiguous(memory_format=torch.channels_last)
    # Forward FLOPs × 3 (backward ≈ 2 × forward): PyTorch's counter overstates depthwise-conv
    # backward by the group count, so the backward pass is not counted directly. Counted before compiling: a
    # compiled model would compile a graph without gradients for it, minutes on a GPU.
    # Ours is counted on the captions it encodes (``encode_text`` cuts their padding), as its step reads them.
    counted = partial(_encoded, model) if isinstance(model, DualEncoder) else forward
    flops = 3 * forward_flops(counted, pixels, ids, mask, device=device, bf16=settings.bf16)
    if isinstance(model, DualEncoder):
        # As `openalign train` and `bench train` run ours: its towers prepared, its captions checked, cut to the
        # batch's longest and (eager on a CPU) split by length, all on the host.
        towers = Towers(model, device=device, compiled=settings.compile, mode=settings.compile_mode)
        captions = towers.captions({"input_ids": batch[1], "attention_mask": host_mask})
        if captions is not None:
            (cut,) = chunk_batch({"input_ids": ids, "attention_mask": mask}, len(ids), [captions[0].width])
            ids, mask, groups = cut["input_ids"], cut["attention_mask"], captions[0].groups
            forward = partial(_ours, model, text_groups=groups)
    elif settings.compile:
        forward = torch.compile(forward, mode=settings.compile_mode)
    graphs = settings.compile and settings.compile_mode == "reduce-overhead"

    def forward_backward() -> None:
        if graphs:  # a new step: the last one's graph outputs (its loss, its gradients' buffers) are done with
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=settings.bf16):
            image_emb, text_emb, temperature = forward(pixels, ids, mask)
            loss = contrastive_loss(image_emb.float(), text_emb.float(), temperature)
        loss.backward()

    def step() -> None:
        forward_backward()
        model.zero_grad(set_to_none=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    start, first_step = time.perf_counter(), None
    for i in range(settings.warmup):
        step()
        if i == 0:
            sync()
            first_step = time.perf_counter() - start  # compiling, where compiled
    # Compiled: one step's gradients against the eager ones (the steps update no weight), after the warm-up.
    gradients = check_gradients(forward_backward, model) if settings.compile else None
    sync()
    if turn is not None:
        turn()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    clock = HostClock()
    clock.start()
    for _ in range(settings.steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    host = clock.stop(settings.steps)
    peak = peak_memory_mb(device)
    profiled = None
    if profile:
        from openalign.bench.profile import profile_steps

        how = "compiled" if settings.compile else "eager"
        title = f"bench model: {which}, {how}"
        profiled = profile_steps(step, device, 2, Path(profile) / f"model-{which}-{how}.txt", title)
    return {
        "profile": profiled,
        "host": host,
        "model": which,
        "step_s": sorted(times)[len(times) // 2],
        "steps_s": times,  # every timed step, in order
        "first_step_s": first_step,
        "flops_per_step": flops,
        "peak_mem_mb": peak,
        "peak_mem_kind": "max allocated" if device.type == "cuda" else "peak RSS",
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "layout": "NHWC" if channels_last else "NCHW",
        "gradients": gradients,
    }


def matmul_peak(device: str, bf16: bool) -> float:
    """Achievable dense matmul FLOP/s on this device, the denominator of MFU."""
    dev = torch.device(device)
    n = 8192 if dev.type == "cuda" else 1536
    dtype = torch.bfloat16 if bf16 else torch.float32
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    best = float("inf")
    for _ in range(6):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def run_model_bench(settings: BenchSettings) -> dict[str, Any]:
    if settings.baseline:
        require_baseline("transformers", "transformers' AlignModel")
    cfg = bench_config(settings)
    contenders = ["openalign", "transformers"] if settings.baseline else ["openalign"]
    best: dict[str, dict[str, Any]] = {}
    for r in range(settings.rounds):
        order = contenders if r % 2 == 0 else contenders[::-1]
        # The first round also profiles, after its timed steps.
        calls = [(which, settings, settings.profile if r == 0 else None) for which in order]
        # Each result as it ends: a part stopped at its time limit has printed the contenders already timed.
        together = settings.together and len(calls) > 1
        results = run_spawned_in_turns(measure, calls) if together else (run_spawned(measure, *c) for c in calls)
        for which, res in zip(order, results, strict=True):
            first = f" (first step {res['first_step_s']:.1f} s)" if res["first_step_s"] is not None else ""
            print(f"  round {r + 1} {which:>12}: {settings.batch_size / res['step_s']:.2f} pairs/s{first}", flush=True)
            keep_best(best, which, res)
    peak = matmul_peak(settings.device, settings.bf16)
    nominal = best.get("transformers", best["openalign"])["flops_per_step"]
    for res in best.values():
        res["pairs_per_s"] = settings.batch_size / res["step_s"]
        res["mfu"] = nominal / res["step_s"] / peak
    lengths = "6-32 of 64" if settings.text_lengths == "alt-text" else "64 of 64"
    print(
        f"\nbench model: {settings.preset} at {cfg.image_size} px, batch {settings.batch_size}, caption tokens "
        f"{lengths}, {settings.device}{' bf16' if settings.bf16 else ''}"
        f"{'' if settings.memory_format == 'default' else ' ' + settings.memory_format}"
        f"{' compiled' if settings.compile else ''}"
        f"{' (' + settings.compile_mode + ')' if settings.compile and settings.compile_mode != 'default' else ''}, "
        f"{torch.get_num_threads()} threads"
    )
    per_pair = nominal / settings.batch_size / 1e9
    print(f"nominal {per_pair:.2f} GFLOP per pair (fwd+bwd); matmul peak {peak / 1e9:.1f} GFLOP/s")
    print(f"{'model':>12} {'layout':>6} {'pairs/s':>9} {'step s':>8} {'peak MB':>9} {'MFU':>7}")
    for which in contenders:
        res = best[which]
        pairs, step, mem, mfu = res["pairs_per_s"], res["step_s"], res["peak_mem_mb"], res["mfu"] * 100
        print(f"{which:>12} {res['layout']:>6} {pairs:9.2f} {step:8.3f} {mem:9.0f} {mfu:6.1f}%")
    verdicts, note = report_gradients(best, contenders)
    for line in verdicts:
        print(line)
    print_profiles(best, contenders)
    summary: dict[str, Any] = {
        "settings": dataclasses.asdict(settings),
        "image_size": cfg.image_size,
        "matmul_peak_flops": peak,
        "results": best,
    }
    if "transformers" in best:
        ratio = best["openalign"]["pairs_per_s"] / best["transformers"]["pairs_per_s"]
        summary["speedup"] = ratio
        print(f"openalign / transformers pairs/s: {ratio:.2f}x{note}")
    if settings.json_path:
        with open(settings.json_path, "w") as f:
            json.dump(summary, f, indent=2)
    return summary
