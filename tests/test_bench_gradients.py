"""A compiled contender's gradients against its eager ones (``openalign.bench.gradients``): a rescaled or lost
gradient is caught, rounding and dropout are not."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from openalign.bench import gradients
from openalign.bench.gpu_report import _gradients


class _Tiny(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 4))
        self.text = nn.Linear(6, 4)
        self.unused = nn.Linear(2, 2)  # out of the loss: no gradient eager, zeros from a graph returning its output


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, a backward scaled by 1e-6: what a backend dividing a pooling's gradient by its whole
    kernel does to everything upstream of it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 1e-6


def _step(model: _Tiny, forward: Any) -> Any:
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(32, 8, generator=g), torch.randn(32, 6, generator=g)

    def step() -> None:
        image, text = forward(x, t)
        (image * text).sum().square().backward()

    return step


def _compiled(model: _Tiny, backend: Any) -> Any:
    def forward(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return model.image(x), model.text(t)

    return torch.compile(forward, backend=backend, fullgraph=True)


def test_a_compiled_step_with_the_eager_gradients_agrees_even_with_dropout() -> None:
    torch.manual_seed(0)
    model = _Tiny(dropout=0.1)
    result = gradients.check(_step(model, _compiled(model, "aot_eager")), model)
    assert result["agree"], result
    assert set(result["groups"]) == {"image", "text"}
    # No dropout in the text group: its gradients are the same numbers (the dropout's other masks move the image
    # group's, and through the product the text group's, by a few percent at most).
    for g in result["groups"].values():
        assert abs(g["norm_ratio"] - 1) < 0.2
    assert all(p.grad is None for p in model.parameters())  # the check leaves no gradient behind


def test_a_compiled_step_whose_backward_rescales_a_tower_is_caught() -> None:
    torch.manual_seed(0)
    model = _Tiny()

    def wrong(gm: torch.fx.GraphModule, example: list[torch.Tensor]) -> Any:
        def run(*args: Any) -> Any:
            out = gm(*args)
            return (_ScaleGrad.apply(out[0]), *out[1:])  # the image output's gradient, scaled

        return run

    result = gradients.check(_step(model, _compiled(model, wrong)), model)
    assert not result["agree"]
    assert "image" in result["apart"]
    assert result["groups"]["image"]["norm_ratio"] < 1e-5
    assert result["groups"]["image"]["rel_error"] > 0.99
    assert _gradients(result).startswith("**do not agree**: image ")


def test_a_group_with_a_gradient_in_one_step_only_does_not_agree() -> None:
    a = {"w": torch.ones(3)}
    assert gradients.compare({"image": a, "text": a}, {"image": a})["apart"] == ["text"]
    assert gradients.compare({"image": a}, {"image": a, "text": a})["apart"] == ["text"]
    same = gradients.compare({"image": a}, {"image": {"w": torch.ones(3)}})
    assert same["agree"] and same["groups"]["image"] == {"norm_ratio": 1.0, "rel_error": 0.0}
    # Zero gradients in one step against a gradient in the other: compiled only, the eager norm is no yardstick.
    assert gradients.compare({"bias": {"b": torch.zeros(2)}}, {"bias": {"b": torch.ones(2)}})["apart"] == ["bias"]
    # No gradient in either step: nothing to compare.
    assert gradients.compare({"bias": {"b": torch.zeros(2)}}, {}) == {"groups": {}, "apart": [], "agree": True}


def test_a_parameter_given_zeros_where_eager_gives_none_agrees_and_a_real_gradient_does_not() -> None:
    e = {"text": {"w": torch.ones(3)}}
    zeros = {"text": {"w": torch.ones(3), "pooler": torch.zeros(4)}}
    assert gradients.compare(e, zeros)["agree"] and gradients.compare(zeros, e)["agree"]
    extra = {"text": {"w": torch.ones(3), "pooler": torch.full((4,), 2.0)}}
    assert gradients.compare(e, extra)["apart"] == ["text"] and gradients.compare(extra, e)["apart"] == ["text"]
    shapes = {"text": {"w": torch.ones(4)}}
    assert gradients.compare(e, shapes)["apart"] == ["text"]


def test_a_whole_model_compiled_with_an_output_the_loss_leaves_unused_agrees() -> None:
    # transformers' AlignModel compiled whole returns its text pooler's output, which the loss does not use: the
    # compiled step hands the pooler zero gradients where eager leaves none. The same training.
    torch.manual_seed(0)
    model = _Tiny()
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(32, 8, generator=g), torch.randn(32, 6, generator=g)

    def forward(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return model.image(x), model.text(t), model.unused(t[:, :2])

    compiled = torch.compile(forward, backend="aot_eager", fullgraph=True)

    def step() -> None:
        image, text, _ = compiled(x, t)
        (image * text).sum().square().backward()

    result = gradients.check(step, model)
    assert result["agree"], result
    assert set(result["groups"]) == {"image", "text"}


def test_the_line_names_each_group_and_the_verdict() -> None:
    result = gradients.compare({"image": {"w": torch.ones(2)}}, {"image": {"w": torch.full((2,), 1e-6)}})
    line = gradients.describe("transformers", result)
    assert line.startswith("transformers compiled gradients against eager, one step: image ")
    assert line.endswith("DO NOT AGREE (image)")


def test_the_gpu_checks_report_shows_each_contenders_gradients_under_the_compiled_row() -> None:
    from openalign.bench.gpu_report import _versus

    def contender(agree: bool) -> dict[str, Any]:
        ratio = 1.0 if agree else 6e-7
        groups = {"vision_model": {"norm_ratio": ratio, "rel_error": 1 - ratio}}
        return {
            "pairs_per_s": 2.0,
            "step_s": 0.5,
            "gradients": {"groups": groups, "apart": [] if agree else ["vision_model"], "agree": agree},
        }

    results = {"openalign": contender(True), "transformers": contender(False)}
    summary = {
        "parts": {"compiled": {"figures": {"results": results, "settings": {"compile": True, "preset": "b7-base"}}}}
    }
    rows = [row for row in _versus(summary) if "its gradients against its eager step's" in row]
    assert rows == [
        "| the same, its gradients against its eager step's (one step, same weights and batch) | agree | "
        "**do not agree**: vision_model 6e-07x norm | |"
    ]
