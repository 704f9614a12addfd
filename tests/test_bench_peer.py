"""transformers' AlignModel as the benches race it (``openalign.bench.peer``): compiled, its image pooling is the
mean its own pooler computes, forward and backward, and inductor's backward of it is eager's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from openalign.bench.model import BenchSettings, bench_config
from openalign.bench.peer import MapMean, align_model, pools_by_mean

pytest.importorskip("transformers")


def _forward_and_backward(pool: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_()
    out = pool(x)
    # A weight per output element: a plain sum's gradient would not tell one divisor's places from another's.
    (out * torch.linspace(-1, 2, out.numel()).view_as(out)).sum().backward()
    assert x.grad is not None
    return out.detach(), x.grad


def test_the_peer_pools_its_image_map_as_shipped_eager_and_by_its_mean_compiled() -> None:
    cfg = bench_config(BenchSettings(preset="nano", image_size=64))
    shipped = align_model(cfg).vision_model.pooler
    assert pools_by_mean(shipped)  # transformers' pooler as it builds it: the case MapMean stands for
    assert isinstance(shipped, nn.AvgPool2d)
    mended = align_model(cfg, compiled=True).vision_model.pooler
    assert isinstance(mended, MapMean) and mended.pool.kernel_size == shipped.kernel_size
    # Maps of B7's 10 x 10 at 289 px, nano's 2 x 2, a single pixel and an uneven one, as large as the window.
    k = shipped.kernel_size
    assert isinstance(k, int)
    g = torch.Generator().manual_seed(0)
    for h, w in ((10, 10), (2, 2), (1, 1), (7, 9), (k, 3)):
        x = torch.randn(3, 5, h, w, generator=g)
        out, grad = _forward_and_backward(mended, x)
        ref_out, ref_grad = _forward_and_backward(shipped, x)
        assert out.shape == ref_out.shape == (3, 5, 1, 1)
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(grad, ref_grad)


def test_a_map_larger_than_the_window_is_pooled_by_the_window() -> None:
    pool = nn.AvgPool2d(4, ceil_mode=True)
    x = torch.randn(2, 3, 6, 9)
    torch.testing.assert_close(MapMean(pool)(x), pool(x))
    assert MapMean(pool)(x).shape == (2, 3, 2, 3)


def test_pooling_other_than_one_window_per_map_is_left_as_it_is() -> None:
    assert not pools_by_mean(nn.AvgPool2d(8))  # no ceil mode: a map smaller than the window gives no output
    assert not pools_by_mean(nn.AvgPool2d(8, ceil_mode=True, padding=2))
    assert not pools_by_mean(nn.AvgPool2d(8, stride=2, ceil_mode=True))
    assert not pools_by_mean(nn.AvgPool2d(8, ceil_mode=True, divisor_override=3))
    assert not pools_by_mean(nn.MaxPool2d(8, ceil_mode=True))


def test_inductors_backward_of_the_mended_pooling_is_eagers_of_the_shipped_one() -> None:
    # The peer's compiled step is only a figure to race if it trains what eager trains; the pooler is where
    # inductor's code for the shipped module went wrong (pytorch/pytorch#198119), so its gradient is compared
    # here with inductor's own code, on the window size AlignVision builds for nano.
    cfg = bench_config(BenchSettings(preset="nano", image_size=64))
    shipped = align_model(cfg).vision_model.pooler
    compiled = torch.compile(MapMean(shipped), backend="inductor", fullgraph=True)
    x = torch.randn(4, 16, 2, 2)
    out, grad = _forward_and_backward(compiled, x)
    ref_out, ref_grad = _forward_and_backward(shipped, x)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(grad, ref_grad)


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "model", "--preset", "nano", "--image-size", "32", "--batch-size", "2", "--steps", "1"],
        ["bench", "train", "--preset", "nano", "--image-size", "32", "--batch-size", "2", "--steps", "1"],
        ["bench", "towers", "--preset", "nano", "--towers", "text"],
    ],
)
def test_a_missing_baseline_package_is_one_line_naming_its_install(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without transformers (a `[serve]`-only install), the benches racing it stop before measuring anything."""
    import importlib.util

    from openalign.cli import main

    real = importlib.util.find_spec
    absent = lambda name, *a: None if name == "transformers" else real(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", absent)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'pip install -e ".[hf]"' in err and "transformers" in err, err
