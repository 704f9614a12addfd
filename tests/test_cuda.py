"""The training path on a GPU: bf16 against fp32, gradient caching, exact resume, the memory plan, DDP and FSDP2.

Marked ``cuda`` and skipped without a CUDA device, so CI (CPU only) pays nothing for them; ``openalign bench gpu``
runs them first. Each check is a function of the device, so the same code runs by hand on the CPU
(``python tests/test_cuda.py cpu``) to check the checks themselves.

TF32 is off wherever a result is compared with another: cuDNN convolutions use TF32 by default, whose 10-bit
mantissa would swamp the differences these tests bound.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import openalign  # noqa: E402
from openalign.data.transforms import normalize_pixels  # noqa: E402
from openalign.loss import contrastive_loss  # noqa: E402
from openalign.optim import OptimConfig, build_optimizer  # noqa: E402
from openalign.train import plan as P  # noqa: E402
from openalign.train.grad_cache import cached_step, plain_step  # noqa: E402
from test_train_grad_cache import (  # noqa: E402
    _VIRTUAL,
    assert_grads_close,
    bn_buffers,
    grads,
    loss_fn,
    make_batch,
    make_model,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda", 0)


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """fp32 matmuls and convolutions in fp32, not TF32, for the duration."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _on(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


# ------------------------------------------------------------------------------------------ (a) bf16 vs fp32

# bf16 keeps 8 bits of mantissa (relative rounding 2^-9 ≈ 0.2 %). At initialisation the loss's gradient is a
# small difference of nearly uniform softmax terms, so that rounding reaches the gradients at ~10 %: on the CPU
# (bf16 autocast, same model and batch) the loss agreed to 1e-5, all gradients together to 13.9 % (L2), each
# weight's gradient with a cosine of at least 0.93 (squeeze-excitation weights, the smallest gradients). A bf16
# step that is wrong (a gradient left in bf16 and underflowing, a tower outside autocast's casts, a scale lost)
# is off by far more, or not finite.
BF16_LOSS_RTOL = 0.01  # the loss within 1 %
BF16_GRAD_RTOL = 0.25  # ‖g_bf16 − g_fp32‖ / ‖g_fp32‖ over all gradients at once
BF16_MIN_COSINE = 0.85  # every weight tensor's gradient pointing the same way


def check_bf16_step(device: torch.device) -> dict[str, float]:
    """One forward and backward of b0-tiny (no dropout; the recipes' ghost batch norm in groups of 16) at fp32 and
    under bf16 autocast, from the same weights."""
    torch.manual_seed(0)
    model = openalign.create_model(
        "b0-tiny",
        image_size=128,
        image={"drop_connect_rate": 0.0, "batch_norm": "virtual", "virtual_batch_size": 16},
        text={"hidden_dropout": 0.0, "attention_dropout": 0.0},
    ).to(device)
    model.train()
    gen = torch.Generator().manual_seed(0)
    n, length = 32, 32
    lengths = torch.randint(6, length + 1, (n,), generator=gen)
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    batch = _on(
        {
            "pixel_values": torch.randn(n, 3, 128, 128, generator=gen),
            "input_ids": torch.randint(5, model.config.text.vocab_size, (n, length), generator=gen) * mask,
            "attention_mask": mask,
        },
        device,
    )

    def step(bf16: bool) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = plain_step(model, batch, loss_fn, lambda: model.temperature)
        return float(loss), {k: g.float() for k, g in grads(model).items()}

    with exact_fp32():
        loss32, g32 = step(False)
        loss16, g16 = step(True)
    assert torch.isfinite(torch.tensor(loss16)) and all(torch.isfinite(g).all() for g in g16.values())
    assert g16.keys() == g32.keys()
    flat32 = torch.cat([g.flatten() for g in g32.values()])
    flat16 = torch.cat([g16[k].flatten() for k in g32])
    grad_error = float((flat16 - flat32).norm() / flat32.norm())
    # Gradients that are ~0 in fp32 (biases a batch norm downstream cancels) have no direction to agree on.
    floor = 1e-4 * max(float(g.norm()) for g in g32.values())
    cosines = {
        k: float(torch.nn.functional.cosine_similarity(g16[k].flatten(), g.flatten(), dim=0))
        for k, g in g32.items()
        if g.dim() > 1 and float(g.norm()) > floor
    }
    worst = min(cosines, key=cosines.__getitem__)
    loss_error = abs(loss16 - loss32) / abs(loss32)
    assert loss_error <= BF16_LOSS_RTOL, (loss16, loss32)
    assert grad_error <= BF16_GRAD_RTOL, grad_error
    assert cosines[worst] >= BF16_MIN_COSINE, (worst, cosines[worst])
    return {"loss_error": loss_error, "grad_error": grad_error, "min_cosine": cosines[worst]}


def test_bf16_step_matches_fp32() -> None:
    check_bf16_step(CUDA)


# ------------------------------------------------------------------------------------------ (b) gradient caching


def check_cached_equals_plain(device: torch.device, chunk: int) -> None:
    """As tests/test_train_grad_cache.py on the CPU: with ghost batch norm in groups of 16, a cached step of
    chunks of ``chunk`` is one plain step of all 64 pairs: loss, every gradient, running statistics."""
    model = make_model(**_VIRTUAL).to(device)
    ref = copy.deepcopy(model)
    batch = _on(make_batch(), device)
    with exact_fp32():
        want = plain_step(ref, batch, loss_fn, lambda: ref.temperature)
        got = cached_step(model, batch, chunk, loss_fn, lambda: model.temperature)
    # Chunks and the whole batch can take different kernels (cuDNN picks by shape): sums in another order.
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert_grads_close(grads(model), grads(ref), atol=1e-4)
    want_bn, got_bn = bn_buffers(ref), bn_buffers(model)
    for name in want_bn:
        torch.testing.assert_close(got_bn[name], want_bn[name], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk", [16, 32])
def test_gradient_caching_equals_plain_training(chunk: int) -> None:
    check_cached_equals_plain(CUDA, chunk)


# ------------------------------------------------------------------------------------------ (c) exact resume


def _resume_config(run_dir: Path, device: str, steps: int) -> Any:
    """nano on the synthetic world, dropout and stochastic depth on (a resume must restore the random stream),
    bf16 on a GPU, workers 0 (the stream's order is the stream's business, tested on the CPU)."""
    from openalign.train.config import load_train_config

    return load_train_config(
        "nano_cpu",
        {
            "data.batch_size": 32,
            "data.workers": 0,
            "data.synthetic.image_size": 64,
            "optim.warmup_steps": 2,
            "optim.total_steps": 6,
            "train.run_dir": str(run_dir),
            "train.device": device,
            "train.steps": steps,
            "train.checkpoint_every": 2,
            "train.checkpoint_minutes": 0,
            "eval.every": 0,
            "log.every": 1,
            "log.tensorboard": False,
            "log.progress": False,
        },
    )


def resume_child(device: str, root: Path) -> dict[str, Any]:
    """A straight 4-step run, and a run stopped at step 2 then resumed to step 4, in one process with
    deterministic algorithms; returns which final tensors differ. ``CUBLAS_WORKSPACE_CONFIG`` must be set
    before CUDA starts, so this runs in a fresh interpreter (``main``)."""
    from safetensors.torch import load_file

    from openalign.data.synthetic import SyntheticWorld
    from openalign.text import train_wordpiece
    from openalign.train.checkpoint import load_trainer_state
    from openalign.train.loop import train

    torch.use_deterministic_algorithms(True)
    world = SyntheticWorld(0, 64)
    # One vocabulary for all three runs: two WordPiece learners may break ties differently.
    tokenizer = train_wordpiece((r.caption for r in world.iter_rows(2000, 0.25)), vocab_size=1000)
    tokenizer.max_length = 64
    straight = train(_resume_config(root / "straight", device, 4), tokenizer=tokenizer)
    train(_resume_config(root / "stopped", device, 2), tokenizer=tokenizer)
    resumed = train(_resume_config(root / "stopped", device, 4), resume="latest", tokenizer=tokenizer)
    assert straight.final_dir is not None and resumed.final_dir is not None
    a = load_file(str(straight.final_dir / "model.safetensors"))
    b = load_file(str(resumed.final_dir / "model.safetensors"))
    sa, _ = load_trainer_state(root / "straight" / "checkpoints" / "step_0000004")
    sb, _ = load_trainer_state(root / "stopped" / "checkpoints" / "step_0000004")
    states = zip(sa["optimizer"]["state"].values(), sb["optimizer"]["state"].values(), strict=True)
    optim = [i for i, (pa, pb) in enumerate(states) if not all(_same(pa[k], pb[k]) for k in pa)]
    moved = not torch.equal(
        a["text_proj.weight"],
        load_file(str(root / "stopped/checkpoints/step_0000002/model.safetensors"))["text_proj.weight"],
    )
    return {
        "steps": [straight.step, resumed.step],
        "keys_equal": a.keys() == b.keys(),
        "different": [k for k in a if k in b and not torch.equal(a[k], b[k])],
        "optimizer_different": optim,
        "stream_equal": sa["stream"] == sb["stream"],
        "moved": moved,
    }


def _same(a: Any, b: Any) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else bool(a == b)


def check_resume(device: str, tmp_path: Path) -> dict[str, Any]:
    env = {
        **os.environ,
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "resume", device, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["steps"] == [4, 4] and result["keys_equal"] and result["moved"]
    assert not result["different"], f"{len(result['different'])} tensors differ, e.g. {result['different'][:3]}"
    assert not result["optimizer_different"] and result["stream_equal"]
    return result


def test_resume_is_bitwise_equal_to_a_straight_run(tmp_path: Path) -> None:
    check_resume("cuda", tmp_path)


# ------------------------------------------------------------------------------------------ (d) memory plan

PLAN_TOLERANCE = 0.15  # the planned peak within ±15 % of torch.cuda.max_memory_allocated


def plan_case(device: torch.device) -> Any:
    """B3 + a 4-layer BERT at 289 px, 32 pairs, bf16 on a GPU (fp32 on the CPU): a few GiB of activations."""
    return P.load_plan_config(
        "pretrain_align_b7",
        {
            "model.preset": "b3-mini",
            "data.source": "synthetic",
            "train.batch_size": 32,
            "train.chunk_size": None,
            "train.precision": "bf16" if device.type == "cuda" else "fp32",
        },
    )


def real_peak(cfg: Any, device: torch.device) -> int:
    """Bytes allocated at the peak of one real step of ``cfg`` on a CUDA device: model, optimizer state (as after
    a first step, as a plan assumes), the batch and the step, with nothing else of this process counted."""
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.manual_seed(cfg.train.seed)
    model_cfg = cfg.model.resolve()
    model = openalign.DualEncoder(model_cfg).to(device).train()
    optimizer = build_optimizer(model, cfg.optim)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    batch = _on(P.make_batch(cfg, cfg.per_rank_batch(1)), device)
    pixels = partial(normalize_pixels, mean=model_cfg.pixel_mean, std=model_cfg.pixel_std)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss = partial(contrastive_loss, label_smoothing=cfg.train.label_smoothing)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cfg.train.precision == "bf16"):
        plain_step(model, batch, loss, lambda: model.temperature, pixels=pixels)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def check_plan(device: torch.device) -> dict[str, float]:
    cfg = plan_case(device)
    planned = P.plan(cfg, P.device_spec("h100-80gb" if device.type == "cuda" else "cpu")).peak
    measured = real_peak(cfg, device) if device.type == "cuda" else P.measured_step(cfg, 32, False)[0]
    error = (planned - measured) / measured
    assert measured > 2**30 or device.type == "cpu", f"the case should take GiB, took {measured / 2**30:.2f}"
    assert abs(error) <= PLAN_TOLERANCE, f"planned {planned / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB"
    return {"planned_gib": planned / 2**30, "measured_gib": measured / 2**30, "error": error}


def test_memory_plan_matches_max_memory_allocated() -> None:
    check_plan(CUDA)


# ------------------------------------------------------------------------------------------ (e) DDP and FSDP2

LAMB = OptimConfig(name="lamb", lr=1e-3, eps=1e-3, schedule="constant", warmup_steps=0, total_steps=20)


def check_wrapped_steps(device: torch.device, strategy: str, store: Path) -> None:
    """Two training steps as the loop takes them (gradient caching, the reduction on the last chunk only,
    FSDP2's unsharded temperature, the global gradient norm, LAMB, a gathered checkpoint state) through DDP or
    FSDP2 over a one-process group (NCCL on a GPU), against the same steps on the bare model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from openalign.train.distributed import (
        DistInfo,
        average_replicated_grads,
        fsdp_no_sync,
        grad_norm,
        replicated_params,
        unwrap,
        wrap_model,
    )

    cuda = device.type == "cuda"
    kwargs: dict[str, Any] = {"device_id": device} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1, **kwargs)
    try:
        model = make_model(**_VIRTUAL).to(device)
        ref = copy.deepcopy(model)
        # wrap_model leaves a one-process run as it is; told of two ranks it wraps over the real group of
        # one, as many ranks as NCCL allows on one GPU.
        wrapped = wrap_model(model, DistInfo(rank=0, world_size=2, device=device), strategy)  # type: ignore[arg-type]
        assert wrapped is not model or strategy == "fsdp"
        ref.text_buckets = model.text_buckets  # FSDP2 turns length buckets off
        optimizer, ref_optimizer = build_optimizer(model, LAMB), build_optimizer(ref, LAMB)
        fsdp = strategy == "fsdp"
        no_sync = partial(fsdp_no_sync, model) if fsdp else getattr(wrapped, "no_sync", None)
        with exact_fp32():
            for step in range(2):
                batch = _on(make_batch(seed=step), device)
                loss = cached_step(
                    wrapped, batch, 16, loss_fn, lambda: model.temperature, no_sync=no_sync, inner=unwrap(wrapped)
                )
                if fsdp:
                    average_replicated_grads(replicated_params(model))
                params = [p for p in model.parameters() if p.grad is not None]
                norm = grad_norm(params)
                assert torch.isfinite(loss) and torch.isfinite(norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                plain_step(ref, batch, loss_fn, lambda: ref.temperature)
                ref_optimizer.step()
                ref_optimizer.zero_grad(set_to_none=True)
        state, optim_state = get_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        want = ref.state_dict()
        assert state.keys() == want.keys() and optim_state["state"]
        for k in (k for k in want if "running" not in k and "num_batches" not in k):
            got = state[k].to(device)
            torch.testing.assert_close(got, want[k], atol=1e-4, rtol=1e-3, msg=lambda m, k=k: f"{k}: {m}")
        assert not torch.equal(
            want["temperature_param"].cpu(), make_model(**_VIRTUAL).state_dict()["temperature_param"]
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ddp_and_fsdp2_over_nccl_with_one_process(strategy: str, tmp_path: Path) -> None:
    check_wrapped_steps(CUDA, strategy, tmp_path / "store")


# ------------------------------------------------------------------------------------------ (f) GPU JPEG decoding

# data.decode: cuda against the CPU path (draft mode off), same shards and seed: the same crops and flips, pixels
# apart only by the decoders (nvJPEG's IDCT and chroma upsampling against libjpeg-turbo's) and by the resize's
# rounding (PIL's decode on the device's side: 0.1-0.2 levels of 255 on average, tests/test_device_decode.py).
# A crop one pixel off measures about 4.6 on average, a missed flip about 37.
DECODE_MEAN_TOLERANCE = 2.0  # mean |difference| in levels of 255
DECODE_P99_TOLERANCE = 16  # 99th percentile


def check_device_decode(device: torch.device, tmp: Path) -> dict[str, float]:
    """Photo-like JPEGs at img2dataset's sizes (4:2:0, quality 90; a few grey or progressive), crops of 289 from
    346, as the paper's."""
    from openalign.config import from_dict
    from openalign.data.device_decode import DeviceDecoder, pil_decode
    from openalign.data.synthetic import SyntheticWorld
    from openalign.text import train_wordpiece
    from openalign.train.data import DataConfig, build_train_stream
    from test_device_decode import caption, encoded, take, write_tar

    world = SyntheticWorld(0, 640)
    sizes = [(640, 480), (480, 640), (256, 256), (1024, 768), (300, 200)]

    def jpeg(i: int, scene: Any) -> bytes:
        image = world.render(scene).resize(sizes[i % 5])
        # Every seventh grey (decoded to RGB on both sides), every eleventh progressive.
        return encoded(image.convert("L") if i % 7 == 3 else image, "JPEG", quality=90, progressive=i % 11 == 5)

    samples = [
        {"__key__": f"{i:06d}", "jpg": jpeg(i, row.scene), "txt": caption(i).encode()}
        for i, row in enumerate(world.iter_rows(40, 0.0))
    ]
    write_tar(tmp / "a.tar", samples)
    tokenizer = train_wordpiece([caption(i) for i in range(300)], vocab_size=120, min_frequency=1)
    base = {"shards": str(tmp / "a.tar"), "batch_size": 20, "piece_size": 8, "image_size": 289, "resize": 346}
    base |= {"max_text_length": 8, "draft": False, "workers": 0, "shuffle_buffer": 0, "shuffle_shards": False}
    cpu = build_train_stream(from_dict(DataConfig, base), tokenizer, seed=3)
    gpu = build_train_stream(from_dict(DataConfig, {**base, "decode": "cuda"}), tokenizer, seed=3)
    if device.type != "cuda":  # by hand on the CPU: PIL's decode in place of nvJPEG
        gpu.decoder = DeviceDecoder(289, 346, device, decode=pil_decode)
    diffs = []
    for a, b in zip(take(cpu, 2), take(gpu, 2), strict=True):
        assert b["pixel_values"].device.type == device.type and b["pixel_values"].dtype == torch.uint8
        assert torch.equal(a["input_ids"], b["input_ids"])
        diffs.append((a["pixel_values"].float() - b["pixel_values"].float().cpu()).abs().flatten())
    diff = torch.cat(diffs)
    mean, p99 = float(diff.mean()), float(torch.quantile(diff[::7], 0.99))
    assert cpu.stats == gpu.stats == {}
    assert mean <= DECODE_MEAN_TOLERANCE and p99 <= DECODE_P99_TOLERANCE, (mean, p99, float(diff.max()))
    return {"mean": mean, "p99": p99, "max": float(diff.max())}


def test_gpu_jpeg_decoding_matches_the_cpu_path(tmp_path: Path) -> None:
    check_device_decode(CUDA, tmp_path)


# ------------------------------------------------------------------------------------------ (g) text attention


def check_text_attention(device: torch.device) -> dict[str, float]:
    """The text tower's masked attention in an eager step on ``device`` keeps off cuDNN's attention (whose host
    time per call bounded the eager step, ``openalign.model.bert.attention``) and gives the CPU's embeddings and
    gradients in fp32."""
    torch.manual_seed(0)
    model = openalign.create_model("b0-tiny", text={"hidden_dropout": 0.0, "attention_dropout": 0.0}).train()
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 24, (16,), generator=gen)
    mask = (torch.arange(24)[None] < lengths[:, None]).long()
    ids = torch.randint(5, model.config.text.vocab_size, (16, 24), generator=gen) * mask

    def run(m: torch.nn.Module, on: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        out = m.text_features(ids.to(on), mask.to(on))
        (grad,) = torch.autograd.grad(out.square().sum(), m.text.layers[0].qkv.weight)
        return out.detach().cpu(), grad.cpu()

    want = run(model, torch.device("cpu"))
    on_device = copy.deepcopy(model).to(device)
    with exact_fp32(), torch.profiler.profile() as prof:
        got = run(on_device, device)
    with (
        torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"),
        torch.profiler.profile() as p16,
    ):
        run(on_device, device)
    names = {e.name for e in [*prof.events(), *p16.events()]}
    if device.type == "cuda":  # rows 16 elements apart, as memory-efficient attention takes a mask uncopied
        from openalign.model.bert import additive_mask

        assert additive_mask(mask.to(device), torch.float32).stride(0) == 32
    assert not [n for n in names if "cudnn_attention" in n], sorted(n for n in names if "attention" in n)
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-3)
    return {"max_abs_diff": float((got[0] - want[0]).abs().max())}


def test_text_attention_keeps_off_cudnn_and_matches_the_cpu() -> None:
    check_text_attention(CUDA)


# ------------------------------------------------------------------------------------------ (h) pinned batches


def check_pinned_batches(device: torch.device, tmp: Path) -> dict[str, float]:
    """Batches for a run on ``device`` with ``data.pin_memory`` unset: on CUDA page-locked (assembled ahead in a
    thread), the unpinned stream's batches value for value, and copied to the device without blocking as the loop
    copies them; on a CPU neither pinned nor assembled ahead."""
    import dataclasses

    import numpy as np
    from PIL import Image

    from openalign.config import from_dict
    from openalign.text import train_wordpiece
    from openalign.train.data import DataConfig, build_train_stream, pin_batches
    from test_device_decode import caption, encoded, take, write_tar

    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)) for _ in range(48)]
    samples = [
        {"__key__": f"{i:06d}", "jpg": encoded(p, "JPEG"), "txt": caption(i).encode()} for i, p in enumerate(pictures)
    ]
    for k in range(0, 48, 12):
        write_tar(tmp / f"{k // 12:05d}.tar", samples[k : k + 12])
    tokenizer = train_wordpiece([caption(i) for i in range(300)], vocab_size=120, min_frequency=1)
    cfg = from_dict(DataConfig, {"shards": str(tmp / "{00000..00003}.tar"), "batch_size": 16, "piece_size": 6,
                                 "image_size": 32, "resize": 40, "max_text_length": 8, "workers": 2})  # fmt: skip
    auto = dataclasses.replace(cfg, pin_memory=pin_batches(cfg, device))
    assert auto.pin_memory is (device.type == "cuda")
    # The plain stream's workers first: forked before any assembly thread is running in this process.
    plain = take(build_train_stream(dataclasses.replace(cfg, pin_memory=False), tokenizer, seed=3), 4)
    pinned = take(build_train_stream(auto, tokenizer, seed=3), 4)
    for a, b in zip(pinned, plain, strict=True):
        assert all(t.is_pinned() is (device.type == "cuda") for t in a.values())
        moved = {k: v.to(device, non_blocking=True) for k, v in a.items()}
        for k, v in b.items():
            assert torch.equal(moved[k].cpu(), v), k
    if device.type != "cuda":
        return {}
    # Behind ~0.2 s of queued GPU work, the copy of a pinned batch returns at once; a pageable one may wait for it.
    waited = {}
    for name, batch in (("pinned", pinned[0]), ("pageable", plain[0])):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.cuda._sleep(400_000_000)
        batch["pixel_values"].to(device, non_blocking=True)
        waited[f"{name}_copy_ms"] = (time.perf_counter() - start) * 1e3
        torch.cuda.synchronize(device)
        waited[f"{name}_queued_ms"] = (time.perf_counter() - start) * 1e3
    assert waited["pinned_copy_ms"] < waited["pinned_queued_ms"] / 4, waited
    return waited


def test_batches_are_pinned_and_copied_without_blocking(tmp_path: Path) -> None:
    check_pinned_batches(CUDA, tmp_path)


# ------------------------------------------------------------------------------------------ by hand


def main(argv: list[str]) -> None:
    """``cpu`` (or ``cuda``): every check on that device, with timings; ``resume DEVICE DIR``: the child of
    the resume check."""
    if argv[0] == "resume":
        print(json.dumps(resume_child(argv[1], Path(argv[2]))))
        return
    import tempfile

    device = torch.device(argv[0])
    checks: dict[str, Any] = {
        "bf16": lambda tmp: check_bf16_step(device),
        "cached 16": lambda tmp: check_cached_equals_plain(device, 16),
        "cached 32": lambda tmp: check_cached_equals_plain(device, 32),
        "resume": lambda tmp: check_resume(device.type, tmp),
        "plan": lambda tmp: check_plan(device),
        "ddp": lambda tmp: check_wrapped_steps(device, "ddp", tmp / "store"),
        "fsdp": lambda tmp: check_wrapped_steps(device, "fsdp", tmp / "store"),
        "decode": lambda tmp: check_device_decode(device, tmp),
        "attention": lambda tmp: check_text_attention(device),
        "pinned": lambda tmp: check_pinned_batches(device, tmp),
    }
    for name, check in checks.items():
        if argv[1:] and name not in argv[1:]:
            continue
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            result = check(Path(tmp))
        print(f"{name}: ok in {time.perf_counter() - start:.1f} s {result or ''}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
