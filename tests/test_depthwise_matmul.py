"""The depthwise conv that tiny maps take on the CPU: the same numbers as ``F.conv2d``, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from openalign.config import model_config
from openalign.model.efficientnet import Conv2dSame, EfficientNet, depthwise_as_matmul, direct_depthwise


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _reference(x: torch.Tensor, w: torch.Tensor, stride: int, pad: tuple[int, int, int, int]) -> torch.Tensor:
    return F.conv2d(F.pad(x, pad), w, None, stride, 0, 1, w.shape[0])


@pytest.mark.parametrize(
    ("channels", "size", "kernel", "stride", "pad"),
    [
        (7, (3, 3), 5, 1, (2, 2, 2, 2)),
        (5, (3, 3), 3, 1, (1, 1, 1, 1)),
        (4, (4, 5), 5, 2, (1, 2, 2, 2)),  # SAME at stride 2: the extra pixel after
        (3, (2, 2), 3, 2, (0, 1, 0, 1)),
        (6, (5, 3), 5, 1, (2, 2, 2, 2)),
        (2, (1, 1), 3, 1, (1, 1, 1, 1)),
    ],
)
@pytest.mark.parametrize("channels_last", [False, True])
def test_depthwise_as_matmul_matches_conv2d_forward_and_backward(
    channels: int, size: tuple[int, int], kernel: int, stride: int, pad: tuple[int, int, int, int], channels_last: bool
) -> None:
    g = torch.Generator().manual_seed(channels * 31 + kernel)
    x0 = torch.randn(6, channels, *size, generator=g, dtype=torch.float64)
    if channels_last:
        x0 = x0.contiguous(memory_format=torch.channels_last)
    w0 = torch.randn(channels, 1, kernel, kernel, generator=g, dtype=torch.float64)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y, yr = depthwise_as_matmul(x, w, stride, pad), _reference(xr, wr, stride, pad)
    assert y.shape == yr.shape
    assert y.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    torch.testing.assert_close(y, yr, rtol=1e-12, atol=1e-12)
    upstream = torch.randn(yr.shape, generator=g, dtype=torch.float64)
    (y * upstream).sum().backward()
    (yr * upstream).sum().backward()
    assert x.grad is not None and w.grad is not None
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-12, atol=1e-12)


def test_gradients_keep_the_inputs_dtype_under_bf16_autocast() -> None:
    x = torch.randn(4, 8, 3, 3, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(8, 1, 5, 5, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = depthwise_as_matmul(x, w, 1, (2, 2, 2, 2))
    y.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
    assert w.grad is not None and w.grad.dtype == torch.float32
    expected = _reference(x.detach().float(), w.detach(), 1, (2, 2, 2, 2))
    torch.testing.assert_close(y.float(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("groups", "size", "device", "matmul"),
    [
        (16, 3, "cpu", True),  # depthwise, the map no larger than the 5x5 window
        (16, 5, "cpu", True),
        (16, 6, "cpu", False),  # a map larger than the window: the direct conv is faster
        (1, 3, "cpu", False),  # not depthwise
        (16, 3, "meta", False),  # shapes only: plans count the conv the model would run on a GPU
    ],
)
def test_only_depthwise_convs_over_tiny_cpu_maps_take_the_matmul(
    groups: int, size: int, device: str, matmul: bool
) -> None:
    conv = Conv2dSame(16, 16, 5, 1, groups=groups).to(device)
    x = torch.randn(2, 16, size, size, device=device)
    with _Ops() as ops:
        conv(x)
    assert ("bmm" in ops.names) is matmul
    assert ("convolution" in ops.names) is not matmul


def test_tower_with_tiny_last_maps_gives_the_conv_towers_outputs_and_gradients(monkeypatch) -> None:
    cfg = model_config("nano", image={"strides": [1, 2, 2, 2, 1, 1, 1]}, image_size=48).image
    torch.manual_seed(0)
    tower = EfficientNet(cfg).double()
    x = torch.randn(8, 3, 48, 48, dtype=torch.float64)
    with _Ops() as ops:
        fast = tower(x)
    assert "bmm" in ops.names  # the 3x3 maps of the last stages
    fast.pow(2).sum().backward()
    fast_grads = [p.grad.clone() for p in tower.parameters() if p.grad is not None]
    tower.zero_grad()
    monkeypatch.setattr(Conv2dSame, "_dense_depthwise", lambda self, x: False)
    slow = tower(x)
    slow.pow(2).sum().backward()
    slow_grads = [p.grad for p in tower.parameters() if p.grad is not None]
    torch.testing.assert_close(fast, slow, rtol=1e-9, atol=1e-10)
    assert len(fast_grads) == len(slow_grads) > 0
    for a, b in zip(fast_grads, slow_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)


def test_direct_depthwise_runs_the_conv_inside_the_block_only() -> None:
    conv = Conv2dSame(16, 16, 5, 1, groups=16)
    x = torch.randn(2, 16, 3, 3)
    with _Ops() as inside, direct_depthwise():
        conv(x)
    with _Ops() as after:
        conv(x)
    assert "convolution" in inside.names and "bmm" not in inside.names
    assert "bmm" in after.names
