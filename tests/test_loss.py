from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dist_utils import run_gloo
from openalign.bench.loss import allocator_peak
from openalign.loss import (
    _columns,
    _num_negatives,
    _sample_columns,
    contrastive_loss,
    global_loss_value,
    sigmoid_loss,
    uniform_loss,
)


def reference_loss(x: Tensor, y: Tensor, t: Tensor | float, eps: float, columns=None) -> Tensor:
    """Eq. 1-3 of the paper with label smoothing, written out row by row.

    ``columns`` optionally gives, per direction, the column indices each row uses (positive included);
    the positive of row i is always column i.
    """
    n = x.shape[0]
    total = 0.0
    for direction, (rows, cols) in enumerate(((x, y), (y, x))):
        for i in range(n):
            used = range(n) if columns is None else [int(j) for j in columns[direction][i]]
            logits = [torch.dot(rows[i], cols[j]) / t for j in used]
            top = max(float(v.detach()) for v in logits)
            lse = top + torch.log(sum(torch.exp(v - top) for v in logits))
            log_p = {j: v - lse for j, v in zip(used, logits, strict=True)}
            total = total - (1 - eps) * log_p[i] - eps / len(log_p) * sum(log_p.values())
    return total / n


def unit_rows(n: int, d: int, seed: int, dtype: torch.dtype = torch.float64) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g, dtype=dtype), dim=-1)


@pytest.mark.parametrize("eps", [0.1, 0.0])
@pytest.mark.parametrize("n, d, seed", [(1, 3, 0), (4, 8, 1), (7, 5, 2)])
def test_matches_explicit_formula_and_gradients(n: int, d: int, seed: int, eps: float) -> None:
    x = unit_rows(n, d, seed).requires_grad_()
    y = unit_rows(n, d, seed + 100).requires_grad_()
    t = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)

    loss = contrastive_loss(x, y, t, label_smoothing=eps)
    expected = reference_loss(x, y, t, eps)
    assert loss.dim() == 0
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)

    grads = torch.autograd.grad(loss, (x, y, t))
    expected_grads = torch.autograd.grad(expected, (x, y, t))
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # A single pair has nothing to contrast: the loss is 0 whatever the temperature.
    assert (grads[2].abs() > 0) == (n > 1)

    as_float = contrastive_loss(x.detach(), y.detach(), 0.2, label_smoothing=eps)
    torch.testing.assert_close(as_float, expected.detach(), rtol=1e-12, atol=1e-12)


def test_float32_matches_float64() -> None:
    x, y = unit_rows(6, 4, 3), unit_rows(6, 4, 4)
    loss32 = contrastive_loss(x.float(), y.float(), torch.tensor(0.07))
    torch.testing.assert_close(loss32.double(), contrastive_loss(x, y, 0.07), rtol=1e-5, atol=1e-5)


def test_directions_are_summed_not_averaged() -> None:
    # Identical embeddings make every logit equal, so each direction is exactly log N whatever the
    # smoothing; the sum of the two directions is 2 log N (an average would give log N).
    n = 6
    same = F.normalize(torch.ones(n, 4, dtype=torch.float64), dim=-1)
    for eps in (0.0, 0.1):
        torch.testing.assert_close(contrastive_loss(same, same, 0.1, eps), torch.tensor(2 * math.log(n)).double())


def test_perfect_alignment_reaches_label_smoothing_floor() -> None:
    # Orthonormal, perfectly paired embeddings. Without smoothing the loss vanishes as temperature -> 0.
    # With smoothing eps a confident softmax is penalised: the floor is 2 H(q), the entropy of the target
    # q = (1 - eps + eps/N on the positive, eps/N elsewhere) per direction, reached exactly at the
    # temperature t* where the softmax equals q (exp(1/t*) = q_pos / q_neg), and higher on either side.
    n, eps = 5, 0.1
    emb = torch.eye(n, 8, dtype=torch.float64)
    assert contrastive_loss(emb, emb, 1e-3, label_smoothing=0.0) < 1e-12

    q_pos, q_neg = 1 - eps + eps / n, eps / n
    floor = -2 * (q_pos * math.log(q_pos) + (n - 1) * q_neg * math.log(q_neg))
    t_star = 1 / math.log(q_pos / q_neg)
    at_floor = contrastive_loss(emb, emb, t_star, label_smoothing=eps)
    torch.testing.assert_close(at_floor, torch.tensor(floor, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    for t in (1e-3, t_star / 2, t_star * 2, 1.0):
        assert contrastive_loss(emb, emb, t, label_smoothing=eps) > floor + 1e-3


@pytest.mark.parametrize("eps", [0.1, 0.0])
@pytest.mark.parametrize("n, fraction", [(6, 1.0), (9, 0.5), (9, 0.25)])
def test_uniform_loss_is_the_loss_of_embeddings_that_tell_nothing_apart(n: int, fraction: float, eps: float) -> None:
    # One embedding for every image and text: every logit of a row is equal, each direction scores ln(K)
    # for K candidates per row whatever the smoothing, and the sum is what uniform_loss says.
    same = F.normalize(torch.ones(n, 4, dtype=torch.float64), dim=-1)
    generator = torch.Generator().manual_seed(0)
    loss = contrastive_loss(same, same, 0.05, label_smoothing=eps, negatives_fraction=fraction, generator=generator)
    candidates = 1 + round(fraction * (n - 1) + 1e-9)
    assert uniform_loss(n, fraction) == pytest.approx(2 * math.log(candidates), abs=1e-12)
    torch.testing.assert_close(loss, torch.tensor(uniform_loss(n, fraction), dtype=torch.float64))


def test_full_negatives_fraction_is_exact_and_draws_nothing() -> None:
    x, y = unit_rows(5, 4, 5), unit_rows(5, 4, 6)
    generator = torch.Generator().manual_seed(0)
    generator_state, global_state = generator.get_state(), torch.get_rng_state()
    full = contrastive_loss(x, y, 0.1)
    assert torch.equal(contrastive_loss(x, y, 0.1, negatives_fraction=1.0, generator=generator), full)
    # 0.9 * (5 - 1) = 3.6 rounds to 4 = every other column, so nothing is sampled either.
    assert torch.equal(contrastive_loss(x, y, 0.1, negatives_fraction=0.9, generator=generator), full)
    assert torch.equal(generator.get_state(), generator_state)
    assert torch.equal(torch.get_rng_state(), global_state)


@pytest.mark.parametrize(
    "columns, fraction, expected",
    [(9, 0.5, 4), (10, 0.5, 5), (2, 0.5, 1), (9, 0.25, 2), (9, 1.0, 8), (1, 0.5, 0)],
)
def test_number_of_sampled_negatives(columns: int, fraction: float, expected: int) -> None:
    assert _num_negatives(columns, fraction) == expected


def test_sampled_columns_keep_positive_first_and_are_distinct() -> None:
    n_rows, n_cols, k = 40, 9, 4
    positives = torch.arange(3, 3 + n_rows) % n_cols
    columns = _sample_columns(positives, n_cols, k, torch.Generator().manual_seed(0))
    assert columns.shape == (n_rows, k + 1)
    assert torch.equal(columns[:, 0], positives)
    for row, positive in zip(columns.tolist(), positives.tolist(), strict=True):
        assert len(set(row)) == k + 1
        assert positive not in row[1:]
    # Independent per row: not every row draws the same negatives.
    assert len({tuple(sorted(row[1:])) for row in columns.tolist()}) > 1


def test_half_negatives_matches_formula_on_drawn_columns() -> None:
    n, eps = 9, 0.1
    x, y = unit_rows(n, 4, 7), unit_rows(n, 4, 8)
    loss = contrastive_loss(x, y, 0.1, eps, negatives_fraction=0.5, generator=torch.Generator().manual_seed(1))
    again = contrastive_loss(x, y, 0.1, eps, negatives_fraction=0.5, generator=torch.Generator().manual_seed(1))
    other = contrastive_loss(x, y, 0.1, eps, negatives_fraction=0.5, generator=torch.Generator().manual_seed(2))
    assert torch.equal(loss, again)
    assert not torch.equal(loss, other)
    assert not torch.allclose(loss, contrastive_loss(x, y, 0.1, eps))

    # Replay the draws (image->text first, then text->image) and recompute on exactly those columns.
    generator = torch.Generator().manual_seed(1)
    positives = torch.arange(n)
    drawn = [_sample_columns(positives, n, 4, generator) for _ in range(2)]
    assert all(c.shape == (n, 5) for c in drawn)
    torch.testing.assert_close(loss, reference_loss(x, y, 0.1, eps, columns=drawn), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("eps", [0.1, 0.0])
@pytest.mark.parametrize("n, block", [(1, 1), (7, 1), (7, 3), (7, 7), (7, 100), (12, 5)])
def test_blockwise_matches_explicit_formula_and_gradients(n: int, block: int, eps: float) -> None:
    x = unit_rows(n, 5, n).requires_grad_()
    y = unit_rows(n, 5, n + 100).requires_grad_()
    t = torch.tensor(0.15, dtype=torch.float64, requires_grad=True)
    loss = contrastive_loss(x, y, t, label_smoothing=eps, block_rows=block)
    expected = reference_loss(x, y, t, eps)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(torch.autograd.grad(loss, (x, y, t)), torch.autograd.grad(expected, (x, y, t)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    as_float = contrastive_loss(x.detach(), y.detach(), 0.15, label_smoothing=eps, block_rows=block)
    torch.testing.assert_close(as_float, expected.detach(), rtol=1e-12, atol=1e-12)


def test_blockwise_sampled_negatives_match_the_formula_on_the_same_draws() -> None:
    n, eps = 11, 0.1
    x, y = unit_rows(n, 4, 7).requires_grad_(), unit_rows(n, 4, 8).requires_grad_()
    loss = contrastive_loss(x, y, 0.1, eps, negatives_fraction=0.5, generator=torch.Generator().manual_seed(1),
                            block_rows=4)  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    drawn = [_sample_columns(torch.arange(n), n, 5, generator) for _ in range(2)]
    expected = reference_loss(x, y, 0.1, eps, columns=drawn)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(torch.autograd.grad(loss, (x, y)), torch.autograd.grad(expected, (x, y)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_blockwise_float32_matches_the_dense_loss_at_a_large_batch() -> None:
    x, y = unit_rows(512, 32, 1).float().requires_grad_(), unit_rows(512, 32, 2).float().requires_grad_()
    t = torch.tensor(0.05, requires_grad=True)
    dense = contrastive_loss(x, y, t)
    lean = contrastive_loss(x, y, t, block_rows=100)
    torch.testing.assert_close(lean, dense, rtol=1e-5, atol=1e-5)
    for got, want in zip(torch.autograd.grad(lean, (x, y, t)), torch.autograd.grad(dense, (x, y, t)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_blockwise_peak_memory_follows_the_block_not_the_batch() -> None:
    """At N = 2048 a float32 N x N matrix is 16 MiB and the dense loss holds several at once; the blockwise
    loss holds a few 64 x N blocks and the N x D inputs' gradients."""
    n, d, block = 2048, 64, 64
    x, y = unit_rows(n, d, 3).float(), unit_rows(n, d, 4).float()
    t = torch.tensor(0.05)

    def step(block_rows: int | None) -> None:
        a, b, temp = x.clone().requires_grad_(), y.clone().requires_grad_(), t.clone().requires_grad_()
        contrastive_loss(a, b, temp, block_rows=block_rows).backward()

    cpu = torch.device("cpu")
    dense, lean = allocator_peak(lambda: step(None), cpu), allocator_peak(lambda: step(block), cpu)
    square = n * n * 4
    assert dense > 3 * square, dense / square
    assert lean < 8 * block * n * 4 + 8 * n * d * 4, (lean, dense)


def reference_sigmoid_loss(x: Tensor, y: Tensor, t: Tensor | float, b: Tensor | float) -> Tensor:
    """SigLIP's loss written out pair by pair: -1/N sum_ij log sigmoid(z_ij (x_i . y_j / t + b))."""
    n = x.shape[0]
    total = 0.0
    for i in range(n):
        for j in range(n):
            z = 1.0 if i == j else -1.0
            total = total - torch.log(torch.sigmoid(z * (torch.dot(x[i], y[j]) / t + b)))
    return total / n


@pytest.mark.parametrize("n, block", [(1, None), (6, None), (6, 1), (7, 3), (9, 4), (5, 100)])
def test_sigmoid_loss_matches_the_pairwise_formula_and_gradients(n: int, block: int | None) -> None:
    x = unit_rows(n, 5, n).requires_grad_()
    y = unit_rows(n, 5, n + 50).requires_grad_()
    t = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(-10.0, dtype=torch.float64, requires_grad=True)  # SigLIP's initial bias
    loss = sigmoid_loss(x, y, t, b, block_rows=block)
    expected = reference_sigmoid_loss(x, y, t, b)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(torch.autograd.grad(loss, (x, y, t, b)), torch.autograd.grad(expected, (x, y, t, b)),
                         strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    floats = sigmoid_loss(x.detach(), y.detach(), 0.1, -10.0, block_rows=block)
    torch.testing.assert_close(floats, expected.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "image, text, kwargs, message",
    [
        (torch.zeros(4), torch.zeros(4), {}, "2-D"),
        (torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), {}, "2-D"),
        (torch.zeros(4, 3), torch.zeros(4, 5), {}, "widths differ"),
        (torch.zeros(4, 3), torch.zeros(5, 3), {}, "batch sizes differ"),
        (torch.zeros(4, 3), torch.zeros(4, 3, dtype=torch.float64), {}, "dtype"),
        (torch.zeros(4, 3, dtype=torch.long), torch.zeros(4, 3, dtype=torch.long), {}, "dtype"),
        (torch.zeros(4, 3), torch.zeros(4, 3), {"negatives_fraction": 0.0}, "negatives_fraction"),
        (torch.zeros(4, 3), torch.zeros(4, 3), {"negatives_fraction": 1.5}, "negatives_fraction"),
        (torch.zeros(4, 3), torch.zeros(4, 3), {"label_smoothing": 1.0}, "label_smoothing"),
        (torch.zeros(4, 3), torch.zeros(4, 3), {"label_smoothing": -0.1}, "label_smoothing"),
        (torch.zeros(4, 3), torch.zeros(4, 3), {"temperature": 0.0}, "temperature"),
        (torch.zeros(4, 3), torch.zeros(4, 3), {"temperature": -1.0}, "temperature"),
        (torch.zeros(4, 3), torch.zeros(4, 3), {"temperature": float("nan")}, "temperature"),
        (torch.zeros(4, 3), torch.zeros(4, 3), {"temperature": torch.ones(1)}, "0-dim"),
        (torch.zeros(0, 3), torch.zeros(0, 3), {}, "empty"),
        (torch.zeros(4, 3), torch.zeros(4, 3), {"block_rows": 0}, "block_rows"),
    ],
)
def test_bad_input_raises(image: Tensor, text: Tensor, kwargs: dict, message: str) -> None:
    kwargs = {"temperature": 0.1, **kwargs}
    with pytest.raises(ValueError, match=message):
        contrastive_loss(image, text, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# Multi-process: real gloo ranks, gradients averaged over ranks as DDP does, compared with one process.

# Per-rank batch sizes; the unequal layouts include a rank holding one pair and, with 4 ranks, none.
SHARDS = {
    2: {"equal": [3, 3], "unequal": [2, 5]},
    4: {"equal": [3, 3, 3, 3], "unequal": [3, 1, 0, 4]},
}
CASES = [("equal", 0.1), ("equal", 0.0), ("unequal", 0.1)]


class TinyDualEncoder(nn.Module):
    """Two towers and a head shared by both, so shared parameters collect gradients from both modalities."""

    def __init__(self) -> None:
        super().__init__()
        self.image_tower = nn.Linear(5, 4)
        self.text_tower = nn.Linear(6, 4)
        self.head = nn.Linear(4, 4)
        self.temperature = nn.Parameter(torch.tensor(0.3))

    def forward(self, images: Tensor, texts: Tensor) -> tuple[Tensor, Tensor]:
        return (
            F.normalize(self.head(self.image_tower(images)), dim=-1),
            F.normalize(self.head(self.text_tower(texts)), dim=-1),
        )


def make_model_and_batch(n: int) -> tuple[TinyDualEncoder, Tensor, Tensor]:
    torch.manual_seed(0)
    model = TinyDualEncoder().double()
    g = torch.Generator().manual_seed(1)
    return (
        model,
        torch.randn(n, 5, generator=g, dtype=torch.float64),
        torch.randn(n, 6, generator=g, dtype=torch.float64),
    )


def grads_after_loss(model: nn.Module, loss: Tensor) -> dict[str, Tensor]:
    model.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _dist_worker(rank: int, world: int) -> dict:
    out: dict = {}
    for layout, eps in CASES:
        sizes = SHARDS[world][layout]
        start = sum(sizes[:rank])
        model, images, texts = make_model_and_batch(sum(sizes))
        image_emb, text_emb = model(images[start : start + sizes[rank]], texts[start : start + sizes[rank]])
        loss = contrastive_loss(image_emb, text_emb, model.temperature, label_smoothing=eps)
        grads = grads_after_loss(model, loss)
        for grad in grads.values():
            dist.all_reduce(grad)
            grad /= world
        image_emb, text_emb = model(images[start : start + sizes[rank]], texts[start : start + sizes[rank]])
        blockwise = contrastive_loss(image_emb, text_emb, model.temperature, label_smoothing=eps, block_rows=2)
        block_grads = grads_after_loss(model, blockwise)
        for grad in block_grads.values():
            dist.all_reduce(grad)
            grad /= world
        image_emb, text_emb = model(images[start : start + sizes[rank]], texts[start : start + sizes[rank]])
        all_images, all_texts, positives, _ = _columns(image_emb, text_emb, True)
        logits_i2t, logits_t2i = image_emb @ all_texts.T, text_emb @ all_images.T
        out[layout, eps] = {
            "grads": grads,
            "block_grads": block_grads,
            "block_logged": global_loss_value(blockwise),
            "logged": global_loss_value(loss),
            "logits_shapes": (tuple(logits_i2t.shape), tuple(logits_t2i.shape)),
            "positives": positives.tolist(),
            "local_only": contrastive_loss(image_emb, text_emb, model.temperature, eps, gather=False).detach()
            if sizes[rank]
            else None,
        }

    for layout in ("equal", "unequal"):
        sizes = SHARDS[world][layout]
        start = sum(sizes[:rank])
        model, images, texts = make_model_and_batch(sum(sizes))
        bias = nn.Parameter(torch.tensor(-2.0, dtype=torch.float64))
        for block in (None, 2):
            image_emb, text_emb = model(images[start : start + sizes[rank]], texts[start : start + sizes[rank]])
            bias.grad = None
            loss = sigmoid_loss(image_emb, text_emb, model.temperature, bias, block_rows=block)
            sig_grads = {**grads_after_loss(model, loss), "bias": bias.grad.clone()}
            for grad in sig_grads.values():
                dist.all_reduce(grad)
                grad /= world
            out["sigmoid", layout, block] = {"grads": sig_grads, "logged": global_loss_value(loss)}

    # Sampled negatives across ranks: a rank-specific seed, and backward must still complete everywhere.
    model, images, texts = make_model_and_batch(3 * world)
    image_emb, text_emb = model(images[3 * rank : 3 * rank + 3], texts[3 * rank : 3 * rank + 3])
    generator = torch.Generator().manual_seed(rank)
    loss = contrastive_loss(image_emb, text_emb, model.temperature, negatives_fraction=0.5, generator=generator)
    out["sampled_grads"] = grads_after_loss(model, loss)
    image_emb, text_emb = model(images[3 * rank : 3 * rank + 3], texts[3 * rank : 3 * rank + 3])
    generator = torch.Generator().manual_seed(rank)
    loss = contrastive_loss(
        image_emb, text_emb, model.temperature, negatives_fraction=0.5, generator=generator, block_rows=2
    )
    out["sampled_block_grads"] = grads_after_loss(model, loss)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def dist_results(request, tmp_path_factory) -> tuple[int, list[dict]]:
    world = request.param
    return world, run_gloo(_dist_worker, world, tmp_path_factory.mktemp(f"gloo{world}"))


@pytest.mark.slow
@pytest.mark.parametrize("layout, eps", CASES)
def test_distributed_gradients_match_single_process(dist_results, layout: str, eps: float) -> None:
    world, results = dist_results
    model, images, texts = make_model_and_batch(sum(SHARDS[world][layout]))
    expected = grads_after_loss(model, contrastive_loss(*model(images, texts), model.temperature, eps))
    for result in results:
        for name, grad in result[layout, eps]["grads"].items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("layout, eps", CASES)
def test_distributed_blockwise_loss_matches_the_single_process_loss(dist_results, layout: str, eps: float) -> None:
    world, results = dist_results
    model, images, texts = make_model_and_batch(sum(SHARDS[world][layout]))
    expected = contrastive_loss(*model(images, texts), model.temperature, eps)
    expected_grads = grads_after_loss(model, expected)
    for result in results:
        torch.testing.assert_close(result[layout, eps]["block_logged"], expected.detach(), rtol=1e-12, atol=1e-12)
        for name, grad in result[layout, eps]["block_grads"].items():
            torch.testing.assert_close(grad, expected_grads[name], rtol=1e-10, atol=1e-12, msg=name)
    for result in results:  # the same per-rank draws give the same sampled loss, a block at a time
        for name, grad in result["sampled_block_grads"].items():
            torch.testing.assert_close(grad, result["sampled_grads"][name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["equal", "unequal"])
@pytest.mark.parametrize("block", [None, 2])
def test_distributed_sigmoid_loss_matches_the_single_process_loss(dist_results, layout: str, block) -> None:
    world, results = dist_results
    model, images, texts = make_model_and_batch(sum(SHARDS[world][layout]))
    bias = nn.Parameter(torch.tensor(-2.0, dtype=torch.float64))
    expected = sigmoid_loss(*model(images, texts), model.temperature, bias)
    expected_grads = {**grads_after_loss(model, expected), "bias": bias.grad.clone()}
    for result in results:
        got = result["sigmoid", layout, block]
        torch.testing.assert_close(got["logged"], expected.detach(), rtol=1e-12, atol=1e-12)
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, expected_grads[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("layout, eps", CASES)
def test_distributed_global_loss_value_matches_single_process(dist_results, layout: str, eps: float) -> None:
    world, results = dist_results
    model, images, texts = make_model_and_batch(sum(SHARDS[world][layout]))
    with torch.no_grad():
        expected = contrastive_loss(*model(images, texts), model.temperature, eps)
    for result in results:
        torch.testing.assert_close(result[layout, eps]["logged"], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_distributed_local_logits_are_local_rows_by_global_columns(dist_results) -> None:
    world, results = dist_results
    for layout in SHARDS[world]:
        sizes = SHARDS[world][layout]
        for rank, result in enumerate(results):
            n, start = sizes[rank], sum(sizes[:rank])
            assert result[layout, 0.1]["logits_shapes"] == ((n, sum(sizes)), (n, sum(sizes)))
            assert result[layout, 0.1]["positives"] == list(range(start, start + n))


@pytest.mark.slow
def test_distributed_without_gather_is_the_local_loss(dist_results) -> None:
    world, results = dist_results
    sizes = SHARDS[world]["equal"]
    model, images, texts = make_model_and_batch(sum(sizes))
    with torch.no_grad():
        image_emb, text_emb = model(images, texts)
    for rank, result in enumerate(results):
        rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
        expected = contrastive_loss(image_emb[rows], text_emb[rows], model.temperature.detach(), 0.1)
        torch.testing.assert_close(result["equal", 0.1]["local_only"], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_distributed_sampled_negatives_backward(dist_results) -> None:
    _, results = dist_results
    for result in results:
        assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in result["sampled_grads"].values())


def test_bench_loss_prints_both_and_agrees(tmp_path, capsys) -> None:
    import json

    from openalign.cli import main

    out = tmp_path / "loss.json"
    argv = ["bench", "loss", "--batches", "8", "96", "--dim", "16", "--block-rows", "32", "--rounds", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "dense ms" in printed and "blockwise ms" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [8, 96]
    assert rows[0]["apart"] == 0  # within one block: the dense path
    assert 0 < rows[1]["apart"] < 1e-4 and rows[1]["blockwise_peak_mib"] < rows[1]["dense_peak_mib"]
    assert main([*argv, "--loss", "sigmoid", "--json", str(out)]) == 0
    assert "sigmoid loss" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["apart"] == 0 and 0 < rows[1]["apart"] < 1e-4
