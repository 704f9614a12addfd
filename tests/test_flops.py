"""FLOP counting: grouped convolutions' backward, and a B7 training step against three forwards."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from openalign.train import flops as F
from openalign.train import plan as P


def _count(counter: FlopCounterMode, fn: object) -> int:
    with counter:
        fn()  # type: ignore[operator]
    return int(counter.get_total_flops())


def _conv_counts(
    conv: torch.nn.Module, x: torch.Tensor, counter: type[FlopCounterMode] | None = None
) -> tuple[int, int]:
    """(forward FLOPs, backward FLOPs) of ``conv`` on ``x`` under the project's counter (or ``counter``)."""
    make = (lambda: counter(display=False)) if counter is not None else F.counter
    forward = _count(make(), lambda: conv(x))
    out = conv(x)
    backward = _count(make(), lambda: out.sum().backward())
    return forward, backward


def test_depthwise_convolution_backward_counts_twice_its_forward() -> None:
    # EfficientNet's depthwise 5x5, stride 2: the input and the weight gradient each cost one forward.
    c, n, side, k = 48, 3, 17, 5
    conv = torch.nn.Conv2d(c, c, k, stride=2, padding=2, groups=c, bias=False)
    x = torch.randn(n, c, side, side, requires_grad=True)
    forward, backward = _conv_counts(conv, x)
    out_side = (side + 2 * 2 - k) // 2 + 1
    # Direct count: one multiply-add (2 FLOPs) per output element per weight of its group.
    assert forward == 2 * n * c * out_side**2 * k * k
    assert backward == 2 * forward
    # The stock formula counts the weight gradient as a dense convolution: groups times one forward.
    _, stock = _conv_counts(conv, x, FlopCounterMode)
    assert stock == forward + c * forward


@pytest.mark.parametrize("groups", [2, 4])
def test_grouped_and_transposed_convolution_backward_counts_twice_its_forward(groups: int) -> None:
    for conv in (
        torch.nn.Conv2d(8, 12, 3, padding=1, groups=groups),
        torch.nn.ConvTranspose2d(8, 12, 3, stride=2, groups=groups),
        torch.nn.Conv1d(8, 16, 5, groups=groups),
    ):
        shape = (2, 8, 9) if isinstance(conv, torch.nn.Conv1d) else (2, 8, 9, 9)
        forward, backward = _conv_counts(conv, torch.randn(*shape, requires_grad=True))
        assert forward > 0 and backward == 2 * forward, conv


def test_one_gradient_asked_for_counts_one_forward() -> None:
    # Input without grad (a stem's pixels): only the weight gradient; a frozen weight: only the input's.
    conv = torch.nn.Conv2d(16, 16, 3, groups=16, bias=False)
    forward, backward = _conv_counts(conv, torch.randn(2, 16, 8, 8))
    assert backward == forward
    conv.weight.requires_grad_(False)
    forward, backward = _conv_counts(conv, torch.randn(2, 16, 8, 8, requires_grad=True))
    assert backward == forward


@pytest.mark.parametrize(
    "conv",
    [
        torch.nn.Conv2d(6, 10, 3, stride=2, padding=1),
        torch.nn.Conv2d(6, 10, (3, 5), dilation=2),
        torch.nn.Conv1d(6, 10, 4, stride=3),
        torch.nn.Conv3d(4, 6, 3, padding=1),
        torch.nn.ConvTranspose2d(6, 10, 4, stride=2, padding=1),
        torch.nn.ConvTranspose1d(6, 10, 3, stride=2, output_padding=1),
    ],
    ids=["2d-strided", "2d-dilated", "1d", "3d", "transposed-2d", "transposed-1d"],
)
def test_dense_convolution_counts_as_pytorchs_stock_counter(conv: torch.nn.Module) -> None:
    dims = {torch.nn.Conv1d: 1, torch.nn.ConvTranspose1d: 1, torch.nn.Conv3d: 3}.get(type(conv), 2)
    x = torch.randn(3, conv.in_channels, *(11,) * dims, requires_grad=True)  # type: ignore[arg-type]
    assert _conv_counts(conv, x) == _conv_counts(conv, x, FlopCounterMode)


def test_the_plan_and_the_benchmark_count_with_the_corrected_formula() -> None:
    from openalign.bench.model import forward_flops

    conv = torch.nn.Conv2d(32, 32, 3, padding=1, groups=32, bias=False)
    x = torch.randn(2, 32, 8, 8, requires_grad=True)
    forward = _count(P.flop_counter(), lambda: conv(x))
    out = conv(x)
    assert _count(P.flop_counter(), lambda: out.sum().backward()) == 2 * forward
    assert forward_flops(conv, x, device=torch.device("cpu"), bf16=False) == forward


def test_b7_bert_base_step_counts_three_forwards() -> None:
    # B7 + BERT-Base at 289 px and 64 tokens, under fake tensors (no memory, seconds): a training step
    # (forward, backward, the loss, the optimizer) is about three forwards; the stock counter made it ~35.
    cfg = P.load_plan_config("pretrain_align_b7", {"train.batch_size": 16, "train.precision": "fp32"})
    assert P.input_shapes(cfg) == (289, 64)
    rows = 16  # one ghost batch-norm group
    with P.session(cfg, P.device_spec("cpu")) as steps:
        step = steps.measure(cfg, rows).flops
        with steps.mode:
            batch = P.make_batch(cfg, rows)
            pixels = P.model_pixels(cfg, batch["pixel_values"])
            forward = _count(F.counter(), lambda: steps.model(pixels, batch["input_ids"], batch["attention_mask"]))
    assert math.isclose(step, 3 * forward, rel_tol=0.02), (step / rows / 1e9, forward / rows / 1e9)
    assert 80e9 < step / rows < 95e9  # ≈ 3 × (19.2 + 10.2) GFLOP per pair


def _tracked_flops(fn: object) -> int:
    tracker = P.LiveBytes(count_flops=True)
    with tracker:
        fn()  # type: ignore[operator]
    return tracker.flops


def test_the_plans_tracker_counts_what_the_flop_counter_counts() -> None:
    # The plan counts FLOPs in its memory tracker, one dispatch mode instead of two; it must agree with
    # FlopCounterMode (the project's formulas) op for op: a training step of nano under fake tensors, and, under
    # inference mode, ops that reach the mode whole and are counted by their parts (linear, attention).
    cfg = P.load_plan_config("nano_cpu", {"train.batch_size": 8, "train.chunk_size": 4, "train.precision": "fp32"})
    with P.session(cfg, P.device_spec("cpu")) as steps, steps.mode:
        s = P._setup(cfg, steps.model, steps.optimizer, P.make_batch(cfg, 8), False)
        step = lambda: P.run_step(s)  # noqa: E731
        counted, tracked = _count(P.flop_counter(), step), _tracked_flops(step)
    assert tracked == counted > 0

    linear = torch.nn.Linear(24, 40)
    q, k, v = (torch.randn(2, 3, 7, 8) for _ in range(3))

    def inference() -> None:
        with torch.inference_mode():
            linear(torch.randn(5, 24))
            torch.nn.functional.scaled_dot_product_attention(q, k, v)

    counted, tracked = _count(P.flop_counter(), inference), _tracked_flops(inference)
    assert tracked == counted >= 2 * 5 * 24 * 40
