"""``openalign plan``: fake-tensor plans of a training step checked against the same step run for real."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from openalign.cli import main
from openalign.train import plan as P

SRC = str(Path(__file__).resolve().parents[1] / "src")


def run_limited(
    code: str, gib: float, timeout: float = 900, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter whose address space is capped, so a plan that allocated real
    memory fails the test instead of the machine."""
    limit = int(gib * 2**30)

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=cap,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        input=stdin,
    )


# The capped cases below run one after another in one interpreter (as `openalign plan --validate` plans and
# steps in one process): each pays for importing torch and for PyTorch's first fake step (its dispatch and
# sharding caches) once, not once a case. Each case's output, its spawned ranks' included, goes to files of
# its own through file descriptors 1 and 2; an exception ends that case only.
CASES: dict[str, str] = {}
SHARED: dict[str, str] = {}  # a test's case -> the entry of CASES that runs it with others' cases

RUN_CASES = """
import gc, json, os, sys, tempfile, traceback
results = {}
for key, code in json.load(sys.stdin).items():
    gc.collect()  # a case's garbage is not freed inside the next case's measured step
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush(); sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
        try:
            exec(compile(code, key, "exec"), {})
            status = 0
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)
        os.close(saved[0]); os.close(saved[1])
        out.seek(0); err.seek(0)
        results[key] = [status, out.read().decode(errors="replace"), err.read().decode(errors="replace")]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def capped(request: pytest.FixtureRequest) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every selected test's case run in one interpreter capped at 6 GiB: its exit status, stdout and stderr."""
    keys = [
        SHARED.get(item.callspec.params["case"], item.callspec.params["case"])
        for item in request.session.items
        if item.module is request.module and "case" in getattr(getattr(item, "callspec", None), "params", {})
    ]
    run = run_limited(RUN_CASES, gib=6, timeout=1800, stdin=json.dumps({k: CASES[k] for k in keys}))
    try:
        results = json.loads(run.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):  # the interpreter itself died: every case fails with its tail
        results = {k: [run.returncode or 1, run.stdout, run.stderr] for k in keys}
    return {k: subprocess.CompletedProcess(k, *v) for k, v in results.items()}


VALIDATE = """
import json
from openalign.train import plan as P
cases = tuple(c for c in P.VALIDATION_CASES if c[0] in LABELS)
print(json.dumps([[c.label, c.predicted_peak, c.measured_peak, c.predicted_flops, c.measured_flops]
                  for c in P.validate(cases)]))
"""
VALIDATED = (
    "nano b32",
    "nano b32 chunk 8 ckpt",
    "nano b64 bf16",
    "nano ghost-bn b32 chunk 16",
    "b0-mini 32px b8 chunk 4",
    "nano fsdp×2 b32 chunk 8",
    "nano fsdp×2 b64 ckpt",
    "nano fsdp×2 b128 chunk 8",
)
# The multi-rank cases run as `validate` runs them: one after another on one pair of gloo ranks.
RANKED = tuple(label for label, _, world in P.VALIDATION_CASES if world > 1 and label in VALIDATED)
CASES.update(
    {f"validate {label}": VALIDATE.replace("LABELS", repr((label,))) for label in VALIDATED if label not in RANKED}
)
CASES["validate ranked"] = VALIDATE.replace("LABELS", repr(RANKED))
for label in RANKED:
    SHARED[f"validate {label}"] = "validate ranked"


@pytest.mark.parametrize("case", [f"validate {label}" for label in VALIDATED])
def test_planned_peak_and_flops_match_a_real_cpu_step(
    case: str, capped: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    # The measured peak comes from the CPU allocator's own events (the profiler), the prediction from a
    # fake step; FLOPs must agree exactly, memory within the tolerance.
    out = capped[SHARED.get(case, case)]
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r[0]: r[1:] for r in json.loads(out.stdout.strip().splitlines()[-1])}
    label = case.removeprefix("validate ")
    predicted, measured, flops, real_flops = rows[label]
    assert measured > 0
    assert abs(predicted - measured) / measured <= P.TOLERANCE, (label, predicted, measured)
    assert flops == real_flops > 0, label


@pytest.mark.slow
def test_the_papers_b7_batch_is_planned_without_allocating_it() -> None:
    # 16,384 pairs at 289 px through B7 + BERT-Base would need terabytes; under a 3 GiB address space the plan
    # must still finish, and say it does not fit one H100 without gradient caching.
    code = (
        "from openalign.train import plan as P\n"
        "cfg = P.load_plan_config('pretrain_align_b7', {})\n"
        "p = P.plan(cfg, P.device_spec('h100-80gb'))\n"
        "print(p.peak, p.params, p.optimizer, p.flops, p.fits, p.precision, p.per_rank)\n"
    )
    out = run_limited(code, gib=3)
    assert out.returncode == 0, out.stderr[-2000:]
    peak, params, optimizer, flops, fits, precision, per_rank = out.stdout.split()[-7:]
    assert per_rank == "16384" and precision == "bf16" and fits == "False"
    assert int(peak) > 1000 * 2**30  # activations of 16k images dwarf an 80 GB card
    assert int(optimizer) == 2 * int(params)  # LAMB keeps two moments per parameter
    assert int(flops) > 1e15


EXTENDED_PLAN = """
from openalign.train import plan as P
world, overrides = WORLD, OVERRIDES
cfg = P.load_plan_config('nano_cpu', {'train.chunk_size': 4, **overrides})
cpu = P.device_spec('cpu')
with P.session(cfg, cpu, world) as steps:
    a = P.plan(cfg, cpu, world, steps=steps)
    full = steps.measure(cfg, cfg.per_rank_batch(world))
print(a.extrapolated, a.peak, full.peak, a.flops, full.flops)
"""
EXTENDED = {
    "extended single": (1, {"train.batch_size": 32, "train.precision": "fp32"}),
    # FSDP2, checkpointed, with a large embedding table: the middle chunks (adding to gradients held
    # unsharded) peak higher than the first, so a line through two and three chunks overshoots.
    "extended fsdp×2": (
        2,
        {
            "train.batch_size": 80,
            "train.precision": "bf16",
            "train.strategy": "fsdp",
            "train.grad_checkpointing": True,
            "model.text.vocab_size": 60000,
        },
    ),
}
CASES.update(
    {
        key: EXTENDED_PLAN.replace("WORLD", repr(world)).replace("OVERRIDES", repr(overrides))
        for key, (world, overrides) in EXTENDED.items()
    }
)


@pytest.mark.parametrize("case", list(EXTENDED))
def test_chunked_plan_extends_measured_chunk_counts_to_the_batch(
    case: str, capped: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    # Memory outside the loss grows by the same bytes per row once every kind of chunk is in the step, so the
    # plan of 8 or 10 chunks extended from 3 and 4 must equal the plan of the whole per-rank batch run in full
    # (up to the loss, measured at full size in both).
    out = capped[case]
    assert out.returncode == 0, out.stderr[-2000:]
    extrapolated, peak, full_peak, flops, full_flops = out.stdout.split()[-5:]
    assert extrapolated == "True"
    assert flops == full_flops
    assert abs(int(peak) - int(full_peak)) / int(full_peak) < 0.002, (peak, full_peak)


CASES["checkpointed chunks"] = """
import json
from openalign.train import plan as P
base = {"train.chunk_size": 4, "train.grad_checkpointing": True}
cases = tuple((f"b{rows}", {**base, "train.batch_size": rows}, 1) for rows in (8, 24))
print(json.dumps([[c.label, c.predicted_peak, c.measured_peak] for c in P.validate(cases)]))
"""


@pytest.mark.parametrize("case", ["checkpointed chunks"])
def test_checkpointed_chunks_hold_one_chunk_of_activations_planned_and_real(
    case: str, capped: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    # With checkpointing, a block recomputed in backward must be freed once its chunk's backward is done: at
    # 6 chunks of 4 the real peak is that of 2 chunks of 4 plus a few inputs, and the plan follows it at
    # both. (Blocks kept alive to the end of the step raised it by half.)
    out = capped[case]
    assert out.returncode == 0, out.stderr[-2000:]
    (_, two_planned, two_real), (_, six_planned, six_real) = json.loads(out.stdout.strip().splitlines()[-1])
    for predicted, measured in ((two_planned, two_real), (six_planned, six_real)):
        assert abs(predicted - measured) / measured <= P.TOLERANCE, (predicted, measured)
    assert six_real < 1.1 * two_real and six_planned < 1.1 * two_planned


SHRINKING = """
from openalign.train import plan as P
cfg = P.load_plan_config('nano_cpu', {'train.batch_size': 64 * WORLD, 'train.precision': 'fp32',
                                      'train.grad_checkpointing': True, 'train.strategy': STRATEGY})
dev = P.device_spec('cpu')
with P.session(cfg, dev, WORLD) as s:
    print(*(P.plan(P._with_chunk(cfg, c), dev, WORLD, steps=s).activations for c in (32, 16, 4)))
"""
for strategy, world in (("ddp", 1), ("fsdp", 4)):
    CASES[f"shrinking {strategy}×{world}"] = SHRINKING.replace("WORLD", str(world)).replace("STRATEGY", repr(strategy))


@pytest.mark.parametrize("case", ["shrinking ddp×1", "shrinking fsdp×4"])
def test_planned_activations_shrink_with_the_chunk(
    case: str, capped: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    # 64 rows per rank, checkpointed: chunks of 4 hold a quarter of the activations chunks of 16 hold, so
    # what a plan calls activations must fall with the chunk, not stay at (chunks x one chunk's worth).
    out = capped[case]
    assert out.returncode == 0, out.stderr[-2000:]
    c32, c16, c4 = map(int, out.stdout.split()[-3:])
    assert c4 < c16 < c32
    assert c16 < 0.7 * c32


FSDP_BF16 = """
import json
from openalign.train import plan as P
from openalign.train.config import load_train_config
base = {"train.batch_size": 16, "train.chunk_size": 4, "train.strategy": "fsdp", "train.precision": "bf16"}
ghost = {"train.grad_checkpointing": True, "model.image.batch_norm": "virtual", "model.image.virtual_batch_size": 4}
steps = [(load_train_config("nano_cpu", base), True), (load_train_config("nano_cpu", {**base, **ghost}), True)]
print(json.dumps(P.measured_ranks(steps, 2)))
"""
CASES["fsdp bf16"] = FSDP_BF16


@pytest.mark.parametrize("case", ["fsdp bf16"])
def test_fsdp_bf16_step_runs_on_two_gloo_ranks_without_view_warnings(
    case: str, capped: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    # FSDP2 casts parameters to bf16 but not batch norm's running statistics: the real step on two gloo
    # processes must run (per-device batch norm, then ghost batch norm checkpointed; both gradient-cached), and no
    # block may hand FSDP2 a view as its output.
    out = capped[case]
    assert out.returncode == 0, out.stderr[-2000:]
    assert "returned a view tensor" not in out.stderr
    steps = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(steps) == 2
    for (peak0, flops0), (peak1, flops1) in steps:
        assert peak0 > 0 and flops0 == flops1 > 0 and peak1 > 0


CASES["largest chunk"] = """
from openalign.train import plan as P
cfg = P.load_plan_config('nano_cpu', {'train.batch_size': 16, 'train.precision': 'fp32'})
whole = P.plan(cfg, P.device_spec('cpu'))
c4 = P.plan(P._with_chunk(cfg, 4), P.device_spec('cpu'))
budget = (c4.peak + whole.peak) / 2 / 2**30
dev = P.Device('small', budget, None, None, cuda=False)
chunk, p = P.largest_chunk(cfg, dev)
print(chunk, p.fits, P.plan(P._with_chunk(cfg, 8), dev).fits, whole.fits, P.plan(cfg, dev).fits)
"""


@pytest.mark.slow
@pytest.mark.parametrize("case", ["largest chunk"])
def test_largest_chunk_is_the_boundary_of_fitting(
    case: str, capped: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    out = capped[case]
    assert out.returncode == 0, out.stderr[-2000:]
    chunk, fits, eight_fits, _, whole_fits = out.stdout.split()[-5:]
    assert whole_fits == "False" and fits == "True"
    # 4 fits by construction; the answer is the largest size that does.
    assert chunk == ("8" if eight_fits == "True" else "4")


CASES["data parallel"] = """
from openalign.train import plan as P
cfg = P.load_plan_config('nano_cpu', {'train.batch_size': 32, 'train.chunk_size': 8, 'train.precision': 'fp32'})
one = P.plan(P._with_batch(cfg, 8), P.device_spec('cpu'))
four = P.plan(cfg, P.device_spec('cpu'), 4)
print(one.per_rank, four.per_rank, one.loss, four.loss, four.ddp_buckets, four.grads, one.ddp_buckets)
"""


@pytest.mark.parametrize("case", ["data parallel"])
def test_data_parallel_plan_gathers_the_global_batch(
    case: str, capped: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    # Four ranks of 8 rows: the loss scores 8 rows against 32 columns, and DDP keeps a gradient bucket copy.
    out = capped[case]
    assert out.returncode == 0, out.stderr[-2000:]
    one_rows, four_rows, one_loss, four_loss, buckets, grads, one_buckets = map(int, out.stdout.split()[-7:])
    assert one_rows == four_rows == 8
    assert four_loss > one_loss
    assert buckets == grads > 0 and one_buckets == 0


CASES["fsdp shards"] = """
from openalign.train import plan as P
cfg = P.load_plan_config('nano_cpu', {'train.batch_size': 32, 'train.chunk_size': 4, 'train.precision': 'fp32'})
ddp = P.plan(P._with_strategy(cfg, 'ddp'), P.device_spec('cpu'), 4)
fsdp = P.plan(P._with_strategy(cfg, 'fsdp'), P.device_spec('cpu'), 4)
print(*(getattr(p, k) for p in (ddp, fsdp) for k in ('params', 'grads', 'optimizer', 'gathered', 'ddp_buckets',
                                                      'flops', 'strategy')))
"""


@pytest.mark.parametrize("case", ["fsdp shards"])
def test_fsdp_plan_shards_the_state_and_gathers_units(
    case: str, capped: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    # The real fully_shard step under fake tensors: this rank holds a quarter of parameters, gradients and
    # optimizer state (each tensor's shard padded to divide by 4), no DDP bucket, and gathered units at its peak.
    out = capped[case]
    assert out.returncode == 0, out.stderr[-2000:]
    values = out.stdout.split()[-14:]
    ddp, fsdp = [
        dict(zip(("params", "grads", "optimizer", "gathered", "buckets", "flops"), map(int, v[:6]), strict=True))
        for v in (values[:7], values[7:])
    ]
    assert (values[6], values[13]) == ("ddp", "fsdp")
    for key in ("params", "grads", "optimizer"):
        assert ddp[key] / 4 <= fsdp[key] < ddp[key] / 4 * 1.05, key
    assert fsdp["gathered"] > 0 and fsdp["buckets"] == 0 and ddp["gathered"] == 0 and ddp["buckets"] > 0
    # Sharding moves no arithmetic: one rank computes the same forward and backward.
    assert abs(fsdp["flops"] - ddp["flops"]) / ddp["flops"] < 1e-3


def test_device_table_and_sizes() -> None:
    assert set(P.DEVICES) == {"h100-80gb", "h200-141gb", "a100-40gb", "a100-80gb", "l4-24gb"}
    h100, h200 = P.device_spec("h100-80gb"), P.device_spec("h200-141gb")
    assert h100.bf16_tflops == h200.bf16_tflops == 989.0 and h200.fp32_tflops == 494.5
    assert not hasattr(h100, "mfu")  # no assumed utilisation: time is measured, or an explicit --mfu
    assert P.capacity_bytes(h100) < 80 * 2**30 < P.capacity_bytes(h200) < 139.8 * 2**30
    assert P.device_spec("24").memory_gib == pytest.approx(24e9 / 2**30)
    assert P.device_spec("cpu").memory_gib > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--config", "nano_cpu", "--device", "tpu"], "unknown device 'tpu'"),
        (["plan", "--config", "nano_cpu", "--device", "-3"], "device memory must be positive"),
        (["plan", "--config", "finetune_flickr30k"], "--model.preset NAME"),
        (["plan", "--config", "nano_cpu", "--mfu", "1.5"], "--mfu must be in (0, 1]"),
        (["plan"], "--config is required"),
        (["plan", "--config", "nano_cpu", "--train.chunk_size", "7", "--train.batch_size", "32"], "does not divide"),
    ],
)
def test_plan_rejects_bad_input_in_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_plan_command_prints_the_breakdown(capsys: pytest.CaptureFixture) -> None:
    argv = ["plan", "--config", "nano_cpu", "--device", "cpu", "--train.batch_size", "8", "--no-search"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for label in ("parameters", "gradients", "optimizer state", "activations", "loss buffers", "peak", "FLOPs"):
        assert label in out
    assert "fits" in out


def test_batch_inputs_are_planned_as_uint8_pixels() -> None:
    # Pixels travel as uint8 and are normalised chunk by chunk: the per-rank batch the plan holds is one byte
    # a pixel, and the step's model input is the model's normalisation of those bytes.
    import torch

    cfg = P.load_plan_config("nano_cpu", {"train.batch_size": 8, "train.chunk_size": 4, "train.precision": "fp32"})
    side, length = P.input_shapes(cfg)
    # Planned first: a fake step must leave the normalisation real steps use untouched (--validate runs both).
    p = P.plan(cfg, P.device_spec("cpu"))
    assert p.inputs == 8 * 3 * side * side + 2 * 8 * length * 8  # uint8 pixels, int64 ids and mask
    batch = P.make_batch(cfg, 8)
    assert batch["pixel_values"].dtype == torch.uint8
    model = cfg.model.resolve()
    x = P.model_pixels(cfg, batch["pixel_values"])
    mean = torch.tensor(model.pixel_mean).view(1, 3, 1, 1)
    std = torch.tensor(model.pixel_std).view(1, 3, 1, 1)
    assert x.dtype == torch.float32 and torch.allclose(x, (batch["pixel_values"].float() / 255 - mean) / std, atol=1e-6)


def test_the_blockwise_loss_is_planned_at_its_blocks_not_the_batch_squared() -> None:
    from openalign.train.config import load_train_config

    rows, width = 4096, 64
    dense, _ = P.measure_loss(load_train_config("nano_cpu", {}), rows, width)
    lean, _ = P.measure_loss(load_train_config("nano_cpu", {"train.loss_block_rows": 256}), rows, width)
    square = rows * rows * 4
    assert dense > 3 * square and lean < 8 * 256 * rows * 4 + 8 * rows * width * 4, (dense, lean)
