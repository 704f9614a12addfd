"""Gradient caching equals plain training of the whole batch: loss, every parameter gradient, BN statistics."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import openalign
from conftest import tiny_overrides
from dist_utils import run_gloo
from openalign.loss import contrastive_loss
from openalign.train import grad_cache
from openalign.train.grad_cache import cached_step, chunk_batch, plain_step
from openalign.train.towers import Towers, caption_widths

BATCH = 64


def make_batch(n: int = BATCH, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 101, (n, 12), generator=g)
    lengths = torch.randint(3, 13, (n,), generator=g)
    mask = (torch.arange(12)[None] < lengths[:, None]).long()
    return {"pixel_values": torch.randn(n, 3, 32, 32, generator=g), "input_ids": ids * mask, "attention_mask": mask}


def make_model(**extra: object) -> openalign.DualEncoder:
    torch.manual_seed(0)
    model = openalign.create_model("nano", **tiny_overrides(temperature_init=0.3, **extra))
    # Running statistics away from their (0, 1) defaults, so an update applied with the wrong weight shows.
    for m in model.modules():
        if isinstance(m, _BatchNorm):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    return model.train()


# Other processes share these cores; intra-op threads would only contend.
pytestmark = pytest.mark.usefixtures("one_thread")


def loss_fn(image: torch.Tensor, text: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return contrastive_loss(image, text, t, label_smoothing=0.1)


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def bn_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers() if "running" in n or "num_batches" in n}


def chunked_reference(model: nn.Module, batch: dict, chunk: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain autograd through the whole batch, the towers called chunk by chunk: the exact function that
    caching must reproduce. Also returns the running statistics expected from the BN inputs it saw: one
    update with the mean over chunks of each chunk's mean and unbiased variance."""
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [
        m.register_forward_hook(lambda mod, inp, out, name=name: seen.setdefault(name, []).append(inp[0].detach()))
        for name, m in model.named_modules()
        if isinstance(m, _BatchNorm)
    ]
    before = bn_buffers(model)
    images, texts = [], []
    for part in chunk_batch(batch, chunk):
        image, text = model(part["pixel_values"], part["input_ids"], part["attention_mask"])
        images.append(image)
        texts.append(text)
    loss = loss_fn(torch.cat(images), torch.cat(texts), model.temperature)
    loss.backward()
    for h in hooks:
        h.remove()
    expected = {}
    for name, inputs in seen.items():
        m = model.get_submodule(name)
        means = torch.stack([x.mean((0, 2, 3)) for x in inputs]).mean(0)
        variances = torch.stack([x.var((0, 2, 3), correction=1) for x in inputs]).mean(0)
        expected[f"{name}.running_mean"] = before[f"{name}.running_mean"].lerp(means, m.momentum)
        expected[f"{name}.running_var"] = before[f"{name}.running_var"].lerp(variances, m.momentum)
        expected[f"{name}.num_batches_tracked"] = before[f"{name}.num_batches_tracked"] + 1
    return loss.detach(), expected


def assert_grads_close(got: dict, want: dict, atol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("chunk", [16, 32])
def test_cached_equals_plain_with_dropout_and_stochastic_depth(chunk: int) -> None:
    model = make_model(text={"hidden_dropout": 0.2, "attention_dropout": 0.2}, image={"drop_connect_rate": 0.5})
    ref = copy.deepcopy(model)
    batch = make_batch()

    torch.manual_seed(123)
    want_loss, want_bn = chunked_reference(ref, batch, chunk)
    want_rng = torch.get_rng_state()
    torch.manual_seed(123)
    loss = cached_step(model, batch, chunk, loss_fn, lambda: model.temperature)

    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-6)
    assert_grads_close(grads(model), grads(ref))
    assert model.temperature_param.grad is not None and model.temperature_param.grad.abs() > 0
    got_bn = bn_buffers(model)
    for name, value in want_bn.items():
        torch.testing.assert_close(got_bn[name], value, atol=1e-6, rtol=1e-5)
    # The step consumes the random stream exactly as the plain forward does.
    assert torch.equal(torch.get_rng_state(), want_rng)


def test_cached_step_with_the_blockwise_loss_equals_it_with_the_dense_one() -> None:
    """``train.loss_block_rows``: the loss a block of rows at a time inside gradient caching gives the step
    the dense loss gives."""
    from openalign.train.config import LoopConfig
    from openalign.train.step import step_loss

    model, ref = make_model(), make_model()
    batch = make_batch()
    torch.manual_seed(123)
    want = cached_step(ref, batch, 16, step_loss(LoopConfig()), lambda: ref.temperature)
    torch.manual_seed(123)
    got = cached_step(model, batch, 16, step_loss(LoopConfig(loss_block_rows=10)), lambda: model.temperature)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    assert_grads_close(grads(model), grads(ref))


def test_without_rng_replay_the_gradients_would_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above is sensitive: with dropout on, skipping the replay changes the gradients."""
    model = make_model(text={"hidden_dropout": 0.2, "attention_dropout": 0.2}, image={"drop_connect_rate": 0.5})
    ref = copy.deepcopy(model)
    batch = make_batch()
    torch.manual_seed(5)
    chunked_reference(ref, batch, 16)
    monkeypatch.setattr(grad_cache.RngState, "restore", lambda self, device: None)
    torch.manual_seed(5)
    cached_step(model, batch, 16, loss_fn, lambda: model.temperature)
    diff = max((grads(model)[n] - g).abs().max().item() for n, g in grads(ref).items())
    assert diff > 1e-3


@pytest.mark.parametrize("chunk", [16, 32])
def test_virtual_batch_norm_makes_cached_identical_to_whole_batch_training(chunk: int) -> None:
    """Ghost BN groups of 16 normalise the same samples together whether the batch is chunked or not, so
    caching reproduces one plain forward/backward of all 64 samples, running statistics included."""
    no_dropout = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
    model = make_model(
        text=no_dropout, image={"drop_connect_rate": 0.0, "batch_norm": "virtual", "virtual_batch_size": 16}
    )
    ref = copy.deepcopy(model)
    batch = make_batch()

    want_loss = plain_step(ref, batch, loss_fn, lambda: ref.temperature)
    loss = cached_step(model, batch, chunk, loss_fn, lambda: model.temperature)

    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-6)
    assert_grads_close(grads(model), grads(ref))
    want_bn, got_bn = bn_buffers(ref), bn_buffers(model)
    for name in want_bn:
        torch.testing.assert_close(got_bn[name], want_bn[name], atol=1e-6, rtol=1e-5)
    assert any(not torch.equal(v, make_model().state_dict()[k]) for k, v in got_bn.items() if "running_mean" in k)


def test_per_device_batch_norm_differs_from_whole_batch_as_documented() -> None:
    """With per-device BN a chunk's statistics are not the batch's: caching is chunk-sized BN, not batch-64 BN."""
    no_dropout = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
    model = make_model(text=no_dropout, image={"drop_connect_rate": 0.0})
    ref = copy.deepcopy(model)
    batch = make_batch()
    plain_step(ref, batch, loss_fn, lambda: ref.temperature)
    cached_step(model, batch, 16, loss_fn, lambda: model.temperature)
    name = "image.stem.conv.weight"
    assert not torch.allclose(grads(model)[name], grads(ref)[name], atol=1e-5)


def test_gradients_accumulate_into_existing_grad() -> None:
    model = make_model(text={"hidden_dropout": 0.0, "attention_dropout": 0.0}, image={"drop_connect_rate": 0.0})
    batch = make_batch(32)
    cached_step(model, batch, 16, loss_fn, lambda: model.temperature)
    once = grads(model)
    cached_step(model, batch, 16, loss_fn, lambda: model.temperature)
    for name, g in grads(model).items():
        torch.testing.assert_close(g, 2 * once[name], atol=1e-6, rtol=1e-5)


def test_chunk_batch_rejects_bad_size() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_batch(make_batch(4), 0)


# --------------------------------------------------------------------------------------- two ranks (DDP)


def _ddp_cached(rank: int, world: int, state: dict, batch: dict) -> dict[str, torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model(**_VIRTUAL)
    model.load_state_dict(state)
    ddp = DDP(model)
    n = BATCH // world
    local = {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()}
    cached_step(ddp, local, 16, loss_fn, lambda: model.temperature, no_sync=ddp.no_sync, inner=model)
    return grads(model)


_VIRTUAL = {
    "text": {"hidden_dropout": 0.0, "attention_dropout": 0.0},
    "image": {"drop_connect_rate": 0.0, "batch_norm": "virtual", "virtual_batch_size": 16},
}


@pytest.mark.slow
def test_ddp_cached_equals_single_process_whole_batch(tmp_path) -> None:
    model = make_model(**_VIRTUAL)
    batch = make_batch()
    plain_step(model, batch, loss_fn, lambda: model.temperature)
    want = grads(model)
    fresh = make_model(**_VIRTUAL).state_dict()
    results = run_gloo(_ddp_cached, 2, tmp_path, fresh, batch)
    for got in results:
        # The all-reduce sums the ranks' halves in another order than one process does.
        assert_grads_close(got, want, atol=5e-5)


def test_caption_widths_measure_each_chunk_on_the_host() -> None:
    lengths = [3, 5, 2, 7, 4, 4, 1, 2]
    mask = (torch.arange(10)[None] < torch.tensor(lengths)[:, None]).long()
    batch = {"pixel_values": torch.randn(8, 3, 4, 4), "input_ids": torch.arange(80).view(8, 10) * mask}
    batch["attention_mask"] = mask
    widths = caption_widths(batch, 4)
    assert widths == [7, 4]  # each chunk's longest caption
    assert caption_widths(batch) == [7]  # no chunks: the batch's
    # At least two columns (a compiled text tower takes every width from two up), never more than there are.
    ones = {"input_ids": torch.ones(4, 6, dtype=torch.long), "attention_mask": torch.zeros(4, 6, dtype=torch.long)}
    ones["attention_mask"][:, 0] = 1
    assert caption_widths(ones, 2) == [2, 2]
    assert caption_widths({k: v[:, :1] for k, v in ones.items()}) == [1]
    assert caption_widths({"input_ids": batch["input_ids"]}) is None

    chunks = chunk_batch(batch, 4, widths)  # views of the whole batch, each chunk's captions at its width
    assert [c["input_ids"].shape for c in chunks] == [(4, 7), (4, 4)]
    assert [c["attention_mask"].shape for c in chunks] == [(4, 7), (4, 4)]
    assert torch.equal(chunks[1]["input_ids"], batch["input_ids"][4:, :4])
    assert all(c["input_ids"].data_ptr() == batch["input_ids"][4 * i].data_ptr() for i, c in enumerate(chunks))
    assert all(c["pixel_values"].shape == (4, 3, 4, 4) for c in chunks)
    with pytest.raises(ValueError):
        chunk_batch(batch, 4, [7])  # a width for every chunk


@pytest.mark.parametrize("buckets", [False, True])
def test_captions_cut_to_each_chunk_train_as_the_padded_batch(buckets: bool) -> None:
    """Chunks whose captions reach the text tower as training hands them over (``Towers.captions``: cut to their
    own widths, and with ``buckets`` short rows encoded apart) train as the padded batch trained whole: the same
    loss and gradients, since the cut columns are padding."""
    no_dropout = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
    model = make_model(
        text=no_dropout, image={"drop_connect_rate": 0.0, "batch_norm": "virtual", "virtual_batch_size": 16}
    )
    ref = copy.deepcopy(model)
    batch = make_batch()
    towers = Towers(model, device=torch.device("cpu"))
    towers.buckets = buckets
    captions = towers.captions(batch, 16)
    assert captions is not None
    widths = [c.width for c in captions]
    assert widths == caption_widths(batch, 16, floor=1) and len(set(widths)) > 1 and max(widths) <= 12
    assert any(c.groups is not None for c in captions) == buckets
    seen: list[int] = []
    model.text.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[1]))

    want_loss = plain_step(ref, batch, loss_fn, lambda: ref.temperature)
    loss = cached_step(model, batch, 16, loss_fn, lambda: model.temperature, captions=captions)
    assert seen == widths + widths  # the no-graph pass, then the graph pass, each chunk at its width
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-6)
    assert_grads_close(grads(model), grads(ref))

    model.zero_grad()
    seen.clear()
    whole = towers.captions(batch)
    assert whole is not None
    plain_step(model, batch, loss_fn, lambda: model.temperature, captions=whole)
    assert seen == [whole[0].width] == [max(widths)]
    assert_grads_close(grads(model), grads(ref))
