"""``openalign bench train``: a training step end to end, against a plain transformers loop on the same data.

Both contenders read the same synthetic WebDataset shards through the same input stream (so "data" is
the same work for both), with the same per-step batch:

- openalign: our dual encoder, the normalised-softmax loss, LAMB (the paper's optimiser);
- transformers: ``AlignModel`` built from the same config (``openalign.bench.peer``, as ``bench model``), its own
  ``align_loss`` and ``torch.optim.AdamW`` — the loop one would write with the public port.

Each runs in a fresh process (its peak memory is its own), in alternating rounds, keeping its best round.
Compiled, ``--recipe``'s loop runs in the bare step's process after it, on the graphs the bare step compiled:
one compilation (minutes on a GPU) serves both, and their ratio comes from one run.
A step is timed in five parts: waiting for the batch, forward, loss, backward, optimizer. MFU divides the
nominal FLOPs of a step (3 × the forward FLOPs PyTorch counts on transformers' model, as ``bench model``)
by the whole step time and by a matmul peak measured in the same run.

The input pipeline alone is measured too: decoded, resized, cropped, flipped and tokenised samples per
second in one process and per DataLoader worker, against webdataset's own pipeline (``decode("pil")``
with the same transform and tokenizer) on the same shards.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from openalign.bench.gradients import check as check_gradients
from openalign.bench.gradients import report as report_gradients
from openalign.bench.host import HostClock
from openalign.bench.model import forward_flops, matmul_peak, peak_memory_mb
from openalign.bench.peer import require_baseline
from openalign.bench.profile import keep_best, print_profiles
from openalign.bench.train_setup import TrainBenchSettings, model_cfg, shard_stream
from openalign.data.transforms import model_resize
from openalign.process import run_spawned
from openalign.train.grad_cache import chunk_batch
from openalign.train.towers import Towers

if TYPE_CHECKING:
    from openalign.config import ModelConfig
    from openalign.text.tokenizer import TextTokenizer

PARTS = ("data", "forward", "loss", "backward", "optimizer")


def prepare_data(s: TrainBenchSettings, root: Path) -> tuple[str, Path]:
    """Synthetic shards, their JPEGs at ``source_side`` (or 1.25× the pre-crop size, so the resize is real work),
    and a tokenizer for them."""
    from openalign.data.shards import write_shards
    from openalign.data.synthetic import SyntheticWorld
    from openalign.text import train_wordpiece

    cfg = model_cfg(s)
    side = s.source_side or max(16, round(1.25 * model_resize(cfg.image_size)))
    size = (side, side * 3 // 4) if s.source_side else (side, side)
    world = SyntheticWorld(0, side)
    rows = list(world.iter_rows(s.shard_samples, noise=0.25))

    def image(row: Any) -> Any:
        picture = world.render(row.scene)
        return picture if picture.size == size else picture.resize(size)

    samples = ({"key": f"{r.index:08d}", "jpg": image(r), "txt": r.caption} for r in rows)
    per_shard = max(1, -(-s.shard_samples // max(4, s.workers * 2)))  # enough shards for every worker
    paths = write_shards(samples, root / "shards", samples_per_shard=per_shard, jpeg_quality=90)
    vocab = min(cfg.text.vocab_size, 8192)
    tokenizer = train_wordpiece((r.caption for r in rows), vocab_size=vocab, min_frequency=1)
    tokenizer.save(root / "tokenizer")
    return ",".join(str(p) for p in paths), root / "tokenizer"


def _build(
    which: str, cfg: Any, device: torch.device, compiled: bool = False
) -> tuple[torch.nn.Module, Any, Any, torch.optim.Optimizer, Towers | None]:
    """(module, forward(batch) -> output, loss(output) -> scalar, optimizer, our towers as training runs them) for
    one contender; ``compiled``: our towers as training compiles them, transformers' model whole."""
    if which == "openalign":
        from openalign.loss import contrastive_loss
        from openalign.model import DualEncoder
        from openalign.optim import OptimConfig, build_optimizer

        model = DualEncoder(cfg).to(device).train()
        towers = Towers(model, device=device, compiled=compiled)
        optimizer = build_optimizer(model, OptimConfig(name="lamb", lr=1e-3, weight_decay=1e-5))

        def forward(b: dict[str, Any]) -> Any:
            return model(b["pixel_values"], b["input_ids"], b["attention_mask"], b.get("text_groups"))

        def loss(out: Any) -> torch.Tensor:
            return contrastive_loss(out[0].float(), out[1].float(), model.temperature)

        return model, forward, loss, optimizer, towers
    from transformers.models.align.modeling_align import align_loss

    from openalign.bench.peer import align_model

    model = align_model(cfg, compiled).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-5)
    call = torch.compile(model) if compiled else model

    def hf_forward(b: dict[str, torch.Tensor]) -> Any:
        return call(pixel_values=b["pixel_values"], input_ids=b["input_ids"], attention_mask=b["attention_mask"])

    def hf_loss(out: Any) -> torch.Tensor:
        return align_loss(out.logits_per_text.float())

    return model, hf_forward, hf_loss, optimizer, None


def measure_training(
    which: str, s: TrainBenchSettings, shards: str, tokenizer_dir: str, profile: str | None = None
) -> dict[str, Any]:
    """One contender's step times by part, pairs/s and peak memory, measured in the calling process; with
    ``profile`` (a directory), then two more steps profiled, without the timing's synchronisations."""
    from openalign.text import load_tokenizer

    torch.manual_seed(0)
    device = torch.device(s.device)
    cfg = model_cfg(s)
    tokenizer = load_tokenizer(tokenizer_dir, max_length=cfg.text.max_length)
    module, forward, loss_fn, optimizer, towers = _build(which, cfg, device, s.compile)
    train_stream = shard_stream(s, shards, tokenizer, cfg, s.workers)
    pixels, stream = train_stream.pixels, iter(train_stream)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def next_batch() -> dict[str, Any]:
        batch = next(stream)
        # Ours takes its captions as training's step hands them over: checked, cut and grouped on the host.
        captions = towers.captions(batch) if towers is not None else None
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        if captions is not None:
            (batch,) = chunk_batch(batch, s.batch_size, [captions[0].width])
        batch["pixel_values"] = pixels(batch["pixel_values"])
        return {**batch, "text_groups": captions[0].groups} if captions is not None else batch

    def one_step(batch: dict[str, Any], mark: Any) -> torch.Tensor:
        """A training step on ``batch``, calling ``mark()`` after each of its parts but the data."""
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=s.bf16):
            out = forward(batch)
            mark()
            step_loss: torch.Tensor = loss_fn(out)
            mark()
        step_loss.backward()
        mark()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mark()
        return step_loss

    stamps: list[float] = []

    def stamp() -> None:
        sync()
        stamps.append(time.perf_counter())

    flops, first_step = 0, 0.0
    times: dict[str, list[float]] = {part: [] for part in PARTS}
    clock = HostClock()

    def check_compiled() -> dict[str, Any]:
        """One step's gradients, compiled against eager, on a batch of its own and the weights the warm-up left."""
        checked = next_batch()

        def forward_backward() -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=s.bf16):
                step_loss = loss_fn(forward(checked))
            step_loss.backward()

        return check_gradients(forward_backward, module)

    gradients = None
    for step in range(s.warmup + s.steps):
        if step == s.warmup:
            if s.compile:
                gradients = check_compiled()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            clock.start()
        stamps[:] = [time.perf_counter()]
        batch = next_batch()
        stamp()
        loss = one_step(batch, stamp)
        if step == 0:  # compiled: the towers' compilation, where their graphs are not compiled already
            first_step = stamps[-1] - stamps[0]
        if step >= s.warmup:
            for part, (start, end) in zip(PARTS, itertools.pairwise(stamps), strict=True):
                times[part].append(end - start)
    host = clock.stop(s.steps)
    if which == "transformers":  # counted after the timed steps, outside the host's figures
        flops = forward_flops(forward, batch, device=device, bf16=s.bf16) * 3
    profiled = None
    if profile:
        from openalign.bench.profile import profile_steps

        # Without the timing's synchronisations, which would keep the host from running ahead of the device.
        def whole_step() -> None:
            one_step(next_batch(), lambda: None)

        title = f"bench train: {which}'s bare step"
        profiled = profile_steps(whole_step, device, 2, Path(profile) / f"{which}.txt", title)
    totals = [sum(parts) for parts in zip(*(times[p] for p in PARTS), strict=True)]
    median = sorted(range(len(totals)), key=totals.__getitem__)[len(totals) // 2]
    step_s = totals[median]
    return {
        "model": which,
        "step_s": step_s,
        "parts_s": {part: times[part][median] for part in PARTS},
        "steps_s": totals,  # every timed step, in order
        "first_step_s": first_step,
        "pairs_per_s": s.batch_size / step_s,
        "peak_mem_mb": peak_memory_mb(device),
        "peak_mem_kind": "max allocated" if device.type == "cuda" else "peak RSS of the training process",
        "flops_per_step": flops,
        "final_loss": float(loss.detach()),
        "profile": profiled,
        "host": host,
        "gradients": gradients,
    }


def measure_recipe(
    which: str, s: TrainBenchSettings, shards: str, tokenizer_dir: str, profile: str | None = None
) -> dict[str, Any]:
    """The real training loop's step on the bare step's model, batch and shards (``openalign.bench.recipe``)."""
    from openalign.bench.recipe import measure_loop

    return measure_loop(s, shards, tokenizer_dir, profile)


def measure_bare_then_loop(
    which: str, s: TrainBenchSettings, shards: str, tokenizer_dir: str, profile: str | None = None
) -> dict[str, dict[str, Any]]:
    """Our bare step, then the real loop, measured in the calling process: compiled, the loop's model (a second one
    of the same config) passes the guards of the graphs the bare step compiled, so nothing compiles again."""
    from openalign.bench.recipe import measure_loop

    bare = measure_training(which, s, shards, tokenizer_dir, profile)
    # The bare step's stream is let go of on return; its workers end here, before the loop's start.
    gc.collect()
    loop = measure_loop(s, shards, tokenizer_dir, profile)
    if s.device == "cpu":
        loop["peak_mem_kind"] = "peak RSS of the process (its bare step's too)"
    return {which: bare, "recipe": loop}


def measure_pipeline(
    which: str, s: TrainBenchSettings, shards: str, tokenizer_dir: str, workers: int
) -> dict[str, float]:
    """Decoded + augmented + tokenised samples per second through ``workers`` processes (0: in-process, on one
    thread as in a worker), and the CPU time per sample of this process: with ``workers`` 0 that is the
    pipeline's whole cost, a figure that other work on the machine hardly moves (samples per second there fall
    with every process competing)."""
    from openalign.text import load_tokenizer

    cfg = model_cfg(s)
    if workers == 0:
        # One thread, as in a DataLoader worker: idle intra-op threads spinning between small kernels would
        # otherwise count as CPU time of the pipeline.
        torch.set_num_threads(1)
    tokenizer = load_tokenizer(tokenizer_dir, max_length=cfg.text.max_length)
    batches = max(2, -(-s.pipeline_samples // s.batch_size))
    if which == "openalign":
        loader: Any = iter(shard_stream(s, shards, tokenizer, cfg, workers))
    else:
        loader = iter(_webdataset_loader(s, shards, tokenizer, cfg, workers))
    # Worker start-up, and the batches workers prefetched meanwhile, are not steady-state throughput.
    for _ in range(1 + 2 * workers):
        next(loader)
    start, cpu = time.perf_counter(), time.process_time()
    n = 0
    for _ in range(batches):
        n += len(next(loader)["input_ids"])
    if which == "openalign" and s.decode == "cuda":
        torch.cuda.synchronize()  # the last batch's decode, queued on the GPU
    return {"samples_per_s": n / (time.perf_counter() - start), "cpu_ms": 1000 * (time.process_time() - cpu) / n}


def _webdataset_loader(
    s: TrainBenchSettings, shards: str, tokenizer: TextTokenizer, cfg: ModelConfig, workers: int
) -> Any:
    import webdataset as wds
    from PIL import Image

    from openalign.data.transforms import random_crop, to_tensor

    resize = model_resize(cfg.image_size)

    def transform(image: Image.Image) -> torch.Tensor:
        # The usual PIL recipe: resize the whole image, then crop and flip (ours resamples only the crop).
        box, flipped = random_crop(cfg.image_size, resize)
        image = image.resize((resize, resize), Image.Resampling.BICUBIC, reducing_gap=3.0).crop(box)
        if flipped:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return to_tensor(image, cfg.pixel_mean, cfg.pixel_std)

    def collate(samples: list[tuple[Any, str]]) -> dict[str, torch.Tensor]:
        tokens = tokenizer([caption for _, caption in samples], max_length=cfg.text.max_length)
        return {"pixel_values": torch.stack([x for x, _ in samples]), **tokens}

    dataset = (
        wds.WebDataset(shards.split(","), shardshuffle=False, empty_check=False)
        .repeat()
        .shuffle(1000)
        .decode("pil")
        .to_tuple("jpg", "txt")
        .map_tuple(transform, lambda t: t)
        .batched(s.batch_size, collation_fn=collate)
    )
    if workers == 0:
        return iter(dataset)
    return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers)


# ---------------------------------------------------------------------------------------------- processes


def in_own_process(fn: Callable[..., Any], *args: Any) -> Any:
    """A contender measured in a spawned interpreter whose DataLoader workers fork from it, as a training
    process's do."""
    return run_spawned(fn, *args, fork_workers=True)


def run_train_bench(s: TrainBenchSettings) -> dict[str, Any]:
    """Run both benchmarks, print the tables and the ratios, and return every figure."""
    s.validate()
    cfg = model_cfg(s)
    contenders = (["openalign", "transformers"] if s.baseline else ["openalign"]) if s.training and s.bare else []
    if "transformers" in contenders:
        require_baseline("transformers", "transformers' AlignModel in a training loop")
    if s.training and s.recipe:
        contenders.insert(1 if contenders else 0, "recipe")
    with tempfile.TemporaryDirectory(prefix="openalign-bench-train-") as tmp:
        print(f"writing {s.shard_samples} synthetic pairs as shards …", flush=True)
        shards, tok = prepare_data(s, Path(tmp))
        best: dict[str, dict[str, Any]] = {}
        # Compiled, the bare step and the loop share a process and its compiled graphs.
        shared = s.compile and "openalign" in contenders and "recipe" in contenders
        runs = [w for w in contenders if not (shared and w == "recipe")]
        for r in range(s.rounds):
            for which in runs if r % 2 == 0 else runs[::-1]:
                measure = measure_recipe if which == "recipe" else measure_training
                together = shared and which == "openalign"
                # The first round also profiles, after its timed steps.
                res = in_own_process(
                    measure_bare_then_loop if together else measure, which, s, shards, str(tok),
                    s.profile if r == 0 else None,
                )  # fmt: skip
                for name, one in res.items() if together else [(which, res)]:
                    print(f"  round {r + 1} {name:>12}: {one['pairs_per_s']:.2f} pairs/s", flush=True)
                    keep_best(best, name, one)
        pipelines = ["openalign", "webdataset"] if s.baseline else ["openalign"]
        pipeline = {which: {"in_process": 0.0, "workers": 0.0, "cpu_ms": math.inf} for which in pipelines}
        for r in range(s.rounds):
            for which in pipelines if r % 2 == 0 else pipelines[::-1]:
                one = in_own_process(measure_pipeline, which, s, shards, str(tok), 0)
                pipeline[which]["in_process"] = max(pipeline[which]["in_process"], one["samples_per_s"])
                pipeline[which]["cpu_ms"] = min(pipeline[which]["cpu_ms"], one["cpu_ms"])
                if s.workers:
                    many = in_own_process(measure_pipeline, which, s, shards, str(tok), s.workers)
                    pipeline[which]["workers"] = max(pipeline[which]["workers"], many["samples_per_s"])
    peak = matmul_peak(s.device, s.bf16)
    nominal = best["transformers"]["flops_per_step"] if "transformers" in best else 0
    for res in best.values():
        res["mfu"] = nominal / res["step_s"] / peak if nominal else None

    print(
        f"\nbench train: {s.preset} at {cfg.image_size} px, batch {s.batch_size}, {s.workers} data workers"
        f"{' (JPEGs decoded on the GPU)' if s.decode == 'cuda' else ''}, "
        f"{s.device}{' bf16' if s.bf16 else ''}{' compiled' if s.compile else ''}, {torch.get_num_threads()} threads"
    )
    if nominal:
        per_pair = nominal / s.batch_size / 1e9
        print(f"nominal {per_pair:.2f} GFLOP per pair (fwd+bwd); matmul peak {peak / 1e9:.1f} GFLOP/s")
    header = " ".join(f"{p + ' s':>11}" for p in PARTS)
    if any(which != "recipe" for which in contenders):
        print(f"{'loop':>12} {'pairs/s':>8} {'step s':>7} {header} {'peak MB':>8} {'MFU':>6}")
    for which in contenders:
        if which == "recipe":
            continue
        res = best[which]
        parts = " ".join(f"{res['parts_s'][p]:11.3f}" for p in PARTS)
        mfu = f"{100 * res['mfu']:5.1f}%" if res["mfu"] is not None else "     -"
        print(f"{which:>12} {res['pairs_per_s']:8.2f} {res['step_s']:7.3f} {parts} {res['peak_mem_mb']:8.0f} {mfu}")
    summary: dict[str, Any] = {
        "settings": dataclasses.asdict(s),
        "image_size": cfg.image_size,
        "matmul_peak_flops": peak,
        "training": best,
        "pipeline_samples_per_s": pipeline,
    }
    verdicts, note = report_gradients(best, contenders)
    for line in verdicts:
        print(line)
    if "transformers" in best:
        ratio = best["openalign"]["pairs_per_s"] / best["transformers"]["pairs_per_s"]
        summary["speedup"] = ratio
        print(f"openalign / transformers pairs/s: {ratio:.2f}x{note}")
    if "recipe" in best and "openalign" not in best:
        loop = best["recipe"]
        summary["recipe_data_share"] = loop["parts_s"]["data"] / loop["step_s"]
        print(
            f"loop (recipe) {loop['pairs_per_s']:.2f} pairs/s; step {loop['step_s']:.3f} s of which data wait "
            f"{loop['parts_s']['data']:.3f} s ({100 * summary['recipe_data_share']:.1f} %)"
        )
    elif "recipe" in best:
        loop, bare = best["recipe"], best["openalign"]
        summary["recipe_data_share"] = loop["parts_s"]["data"] / loop["step_s"]
        summary["recipe_ratio"] = loop["pairs_per_s"] / bare["pairs_per_s"]
        print(
            f"loop (recipe) {loop['pairs_per_s']:.2f} pairs/s vs bare step {bare['pairs_per_s']:.2f} -> "
            f"{summary['recipe_ratio']:.2f}x; step {loop['step_s']:.3f} s of which data wait "
            f"{loop['parts_s']['data']:.3f} s (bare step {bare['step_s']:.3f} s, data {bare['parts_s']['data']:.3f} s)"
        )
    print_profiles(best, contenders)
    print("\ninput pipeline (decode + resize + crop + flip + tokenise), samples/s:")
    print(f"{'pipeline':>12} {'1 process':>10} {f'{s.workers} workers':>10} {'per worker':>11} {'CPU ms/sample':>14}")
    for which, fig in pipeline.items():
        per = fig["workers"] / s.workers if s.workers else 0.0
        print(f"{which:>12} {fig['in_process']:10.1f} {fig['workers']:10.1f} {per:11.1f} {fig['cpu_ms']:14.2f}")
    if "webdataset" in pipeline:
        ours, theirs = pipeline["openalign"], pipeline["webdataset"]
        ratio = ours["in_process"] / theirs["in_process"]
        summary["pipeline_speedup"] = ratio
        summary["pipeline_cpu_speedup"] = theirs["cpu_ms"] / ours["cpu_ms"]
        line = f"openalign / webdataset samples/s: {ratio:.2f}x in one process"
        if s.workers and theirs["workers"]:
            line += f", {ours['workers'] / theirs['workers']:.2f}x with {s.workers} workers"
        print(f"{line}; {summary['pipeline_cpu_speedup']:.2f}x by CPU time per sample")
    if s.json_path:
        with open(s.json_path, "w") as f:
            json.dump(summary, f, indent=2)
    return summary
