"""``torch.compile(fullgraph=True)`` of both towers on the CPU: one graph each, the same outputs as eager."""

from __future__ import annotations

import copy

import pytest
import torch

from openalign.config import ModelConfig, model_config
from openalign.model.dual_encoder import DualEncoder
from openalign.train.config import load_train_config
from openalign.train.towers import compile_towers


def _compiled(tower: torch.nn.Module) -> torch.nn.Module:
    # fullgraph=True turns any graph break into an error, so a tower that compiles is one graph.
    return torch.compile(tower, fullgraph=True)  # type: ignore[return-value]


@pytest.mark.slow
def test_nano_towers_compile_without_graph_breaks_and_match_eager(request: pytest.FixtureRequest) -> None:
    # Inductor's C++ code generation takes about two CPU-minutes on a cold cache: too long for every run, so
    # only a run that selects slow tests compiles (python -m pytest -m slow tests/test_compile.py).
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("compiles both towers with inductor; run with -m slow")
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = load_train_config("nano_cpu", {}).model.resolve()
    model = DualEncoder(cfg)
    side = cfg.image_size
    pixels = torch.randn(4, 3, side, side)
    ids = torch.randint(1, cfg.text.vocab_size, (4, 12))
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[1, 7:] = 0  # padding inside the compiled attention

    image, text = _compiled(model.image), _compiled(model.text)
    # Training mode: batch statistics, and a backward through the compiled graphs (as the loop runs them).
    model.train()
    model.text.eval()  # dropout off, so eager and compiled draw nothing random
    expected_image = model.image(pixels)
    expected_grads = torch.autograd.grad(expected_image.square().sum(), list(model.image.parameters()))
    got_image = image(pixels)
    got_grads = torch.autograd.grad(got_image.square().sum(), list(model.image.parameters()))
    torch.testing.assert_close(got_image, expected_image, atol=1e-5, rtol=1e-4)
    # Fused kernels sum in another order: gradients agree to 1e-3 of the largest (a lost or doubled term is
    # off by its whole size; biases ahead of a batch norm have a true gradient of zero, and rounding noise).
    scale = max(float(g.abs().max()) for g in expected_grads)
    for got, expected in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-3 * scale, rtol=1e-3)
    expected_text = model.text(ids, mask)
    torch.testing.assert_close(text(ids, mask), expected_text, atol=1e-5, rtol=1e-4)
    # Evaluation mode: running statistics (a recompile, still one graph).
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(image(pixels), model.image(pixels), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(text(ids, mask), model.text(ids, mask), atol=1e-5, rtol=1e-4)
    counts = torch._dynamo.utils.counters
    assert not counts["graph_break"], dict(counts["graph_break"])


@pytest.mark.slow
def test_compiled_text_tower_takes_every_caption_width_in_one_graph(request: pytest.FixtureRequest) -> None:
    # Inductor's graph with a symbolic width: one compilation for captions cut to 12, 7, 4 and 2 columns, each
    # width's embeddings and gradients those of eager code (python -m pytest -m slow tests/test_compile.py).
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("compiles the text tower with inductor; run with -m slow")
    counts = torch._dynamo.utils.counters
    cfg = load_train_config("nano_cpu", {}).model.resolve()
    model, compiled = _eager_and_compiled(cfg)
    for width in (12, 7, 4, 2):
        ids = torch.randint(1, cfg.text.vocab_size, (4, width))
        mask = torch.ones(4, width, dtype=torch.long)
        mask[1, width // 2 :] = 0
        _assert_text_tower_matches(model, compiled, ids, mask)
    assert not counts["graph_break"], dict(counts["graph_break"])
    assert counts["stats"]["unique_graphs"] == 1  # the text tower with a graph, compiled once for every width


def test_compiled_text_tower_compiles_where_inductor_narrows_the_widths_it_takes() -> None:
    # Inductor's CPU code sums a float reduction of more than 4,096 elements in chunks and guards on which side of
    # that line batch × width falls: at 128 captions the backward's sums over rows cross it at a width of 32. A range
    # of widths promised to Dynamo beforehand turned that guard into an error at the first compile (bench model
    # --compile and openalign train --train.compile true died on a CPU). Widths now compile once per side of the
    # line, each with eager's embeddings and gradients. A one-layer tower keeps inductor's C++ builds to seconds.
    counts = torch._dynamo.utils.counters
    cfg = load_train_config("nano_cpu", {}).model.resolve()
    cfg = model_config(cfg, text={"num_layers": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64})
    model, compiled = _eager_and_compiled(cfg)
    graphs = []
    for width in (40, 36, 12, 20):  # above the line twice, then below it twice
        ids = torch.randint(1, cfg.text.vocab_size, (128, width))
        mask = torch.ones(128, width, dtype=torch.long)
        mask[1, width // 2 :] = 0
        _assert_text_tower_matches(model, compiled, ids, mask)
        graphs.append(counts["stats"]["unique_graphs"])
    assert not counts["graph_break"], dict(counts["graph_break"])
    assert graphs == [1, 1, 2, 2], graphs  # one graph per side of the line, each compiled once


def _eager_and_compiled(cfg: ModelConfig) -> tuple[DualEncoder, DualEncoder]:
    """A model in training mode with its text tower's dropout off (eager and compiled code then draw nothing random),
    and a copy with its towers compiled as training compiles them; Dynamo's caches and counters start empty."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = DualEncoder(cfg)
    model.train()
    model.text.eval()
    compiled = copy.deepcopy(model)
    compile_towers(compiled)
    return model, compiled


def _assert_text_tower_matches(
    model: DualEncoder, compiled: DualEncoder, ids: torch.Tensor, mask: torch.Tensor
) -> None:
    """The compiled text tower's embeddings and gradients are eager code's for these captions."""
    results = []
    for m in (model, compiled):
        m.zero_grad()
        out = m.text_features(ids, mask)
        out.square().sum().backward()
        results.append((out, [p.grad for p in m.text.parameters()]))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    scale = max(float(g.abs().max()) for g in want_grads)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-3 * scale, rtol=1e-3)
