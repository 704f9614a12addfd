from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import openalign
from conftest import tiny_overrides
from openalign.config import ConfigError, model_config
from openalign.model.captions import length_buckets, trim_padding
from openalign.model.efficientnet import Conv2dSame, EfficientNet, MBConv, same_padding
from openalign.model.layers import BatchNorm2d


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# Published parameter counts (timm's efficientnet_b0 / tf_efficientnet_b7 / tf_efficientnet_l2 and
# bert-base-uncased) minus the parts ALIGN does not build: the 1×1 head conv + its BN + the 1000-way
# classifier, and BERT's pooler. An error in channel rounding, depth rounding or SE width changes them.
@pytest.mark.parametrize(
    ("preset", "image_params", "features"),
    [
        ("b0-tiny", 5_288_548 - (320 * 1280 + 2 * 1280) - (1280 * 1000 + 1000), 320),
        ("b7-tiny", 66_347_960 - (640 * 2560 + 2 * 2560) - (2560 * 1000 + 1000), 640),
        ("l2-tiny", 480_309_308 - (1376 * 5504 + 2 * 5504) - (5504 * 1000 + 1000), 1376),
    ],
)
def test_efficientnet_matches_published_sizes(preset: str, image_params: int, features: int) -> None:
    with torch.device("meta"):
        model = openalign.create_model(preset)
    assert _params(model.image) == image_params
    assert model.image.num_features == features
    assert model.embed_dim == (1376 if preset.startswith("l2") else 640)
    assert (model.image_proj is None) == (features == model.embed_dim)


def test_bert_base_matches_published_size() -> None:
    with torch.device("meta"):
        model = openalign.create_model("b0-base", **{"text.vocab_size": 30522})
    assert _params(model.text) == 109_482_240 - (768 * 768 + 768)


@pytest.mark.parametrize("size", [7, 8, 15, 16, 289, 290])
@pytest.mark.parametrize("kernel", [3, 5])
def test_conv_same_padding_is_tf_same(size: int, kernel: int) -> None:
    torch.manual_seed(0)
    conv = Conv2dSame(2, 3, kernel, stride=2)
    x = torch.randn(1, 2, size, size)
    # TF SAME, written out: output ceil(n/s); total pad split with the extra pixel after.
    out_size = math.ceil(size / 2)
    total = max((out_size - 1) * 2 + kernel - size, 0)
    before, after = total // 2, total - total // 2
    ref = F.conv2d(F.pad(x, (before, after, before, after)), conv.weight, stride=2)
    y = conv(x)
    assert y.shape[-1] == out_size
    torch.testing.assert_close(y, ref)
    assert same_padding(size, kernel, 2) == (before, after)


class _Ops(TorchDispatchMode):
    """Records the name of every aten op that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("padding", ["symmetric", "same"])
def test_symmetric_padding_pads_by_half_the_kernel_without_a_padded_copy(padding: str) -> None:
    torch.manual_seed(0)
    cfg = dataclasses.replace(model_config("nano", **tiny_overrides()).image, padding=padding)
    net = EfficientNet(cfg).eval()
    torch_padding: list[bool] = []  # per convolution: does it give what torch's padding=kernel//2 gives?

    def check(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        assert isinstance(module, Conv2dSame)
        k, s = module.kernel_size[0], module.stride[0]
        ref = F.conv2d(inputs[0], module.weight, None, s, k // 2, 1, module.groups)
        torch_padding.append(ref.shape == output.shape and torch.allclose(ref, output, atol=1e-5))

    for module in net.modules():
        if isinstance(module, Conv2dSame):
            module.register_forward_hook(check)
    with torch.no_grad(), _Ops() as ops:
        net(torch.randn(2, 3, 32, 32))
    strided = sum(m.stride[0] == 2 for m in net.modules() if isinstance(m, Conv2dSame))
    assert len(torch_padding) == sum(isinstance(m, Conv2dSame) for m in net.modules()) and strided >= 3
    if padding == "symmetric":
        assert all(torch_padding)
        assert "aten.constant_pad_nd.default" not in ops.names
    else:  # TF SAME at even sizes pads a stride-2 convolution after the image only: a padded copy, other outputs
        assert sum(not ok for ok in torch_padding) == strided
        assert "aten.constant_pad_nd.default" in ops.names


def test_batchnorm_uses_tf_momentum() -> None:
    # The paper's TF decay 0.99 is the tower default (nano opts out of it for short runs).
    model = EfficientNet(dataclasses.replace(model_config("nano", **tiny_overrides()).image, bn_momentum=0.99))
    bn = model.stem.bn
    assert bn.eps == 1e-3 and bn.momentum == pytest.approx(0.01)
    x = torch.randn(4, 3, 32, 32)
    model.train()
    conv_out = model.stem.conv(x)
    model.stem(x)
    # running = 0.99 · running + 0.01 · batch (TF's decay 0.99), not the other way round
    torch.testing.assert_close(bn.running_mean, 0.01 * conv_out.mean((0, 2, 3)), rtol=1e-5, atol=1e-6)


def test_stochastic_depth_drops_whole_samples() -> None:
    cfg = model_config("nano", **tiny_overrides()).image
    torch.manual_seed(0)
    block = MBConv(16, 16, 3, 1, 6, 0.5, cfg, None).train()
    x = torch.randn(64, 16, 8, 8)
    block.drop_rate = 0.0
    branch = block(x) - x
    block.drop_rate = 0.5
    dropped = block(x) - x
    kept = dropped.flatten(1).abs().sum(1) > 0
    assert 10 < int(kept.sum()) < 54  # about half, and per sample: never a partial mask
    torch.testing.assert_close(dropped[kept], branch[kept] / 0.5, rtol=1e-4, atol=1e-5)
    assert torch.all(dropped[~kept] == 0)
    block.eval()
    assert torch.equal(block(x), block(x))


def test_drop_rate_rises_linearly_over_blocks() -> None:
    model = EfficientNet(model_config("b0-tiny").image)
    rates = [b.drop_rate for b in model.blocks]
    assert len(rates) == 16
    assert rates == pytest.approx([0.2 * i / 16 for i in range(16)])


def test_virtual_batch_norm_normalises_each_group_separately() -> None:
    torch.manual_seed(0)
    bn = BatchNorm2d(5, eps=1e-3, momentum=0.01, virtual_batch_size=4).train()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    x = torch.randn(10, 5, 3, 3) * 3 + 1
    y = bn(x)
    groups = x.split(4)  # 4 + 4 + 2
    for g, yg in zip(groups, y.split(4), strict=True):
        mean = g.mean((0, 2, 3), keepdim=True)
        var = g.var((0, 2, 3), unbiased=False, keepdim=True)
        ref = (g - mean) / torch.sqrt(var + 1e-3) * bn.weight[:, None, None] + bn.bias[:, None, None]
        torch.testing.assert_close(yg, ref, rtol=1e-5, atol=1e-5)
    group_mean = torch.stack([g.mean((0, 2, 3)) for g in groups]).mean(0)
    group_var = torch.stack([g.var((0, 2, 3)) for g in groups]).mean(0)
    torch.testing.assert_close(bn.running_mean, 0.01 * group_mean)
    torch.testing.assert_close(bn.running_var, 0.99 + 0.01 * group_var)
    bn.eval()
    torch.testing.assert_close(bn(x), F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, eps=1e-3))


def test_virtual_batch_norm_of_whole_groups_returns_its_own_tensor() -> None:
    # FSDP2 warns when a block returns a view (an in-place op on it would drop its backward hook); a batch of
    # whole groups must come back as a tensor of its own, with each group normalised by its own statistics.
    torch.manual_seed(0)
    bn = BatchNorm2d(5, eps=1e-3, momentum=0.01, virtual_batch_size=4).train()
    x = torch.randn(8, 5, 3, 3) * 3 + 1
    y = bn(x)
    assert y._base is None
    for g, yg in zip(x.split(4), y.split(4), strict=True):
        torch.testing.assert_close(yg, F.batch_norm(g, None, None, bn.weight, bn.bias, True, 0.0, 1e-3))


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_virtual_batch_norm_gradients_match_a_loop_over_groups(layout: torch.memory_format) -> None:
    # The groups become channels of one batch norm (one copy each way): output, input and affine gradients must be
    # those of a batch norm per group, and the output and input gradient keep the input's layout.
    torch.manual_seed(0)
    bn = BatchNorm2d(6, eps=1e-3, momentum=0.1, virtual_batch_size=4).train()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    x = (torch.randn(12, 6, 5, 7) * 2 + 1).contiguous(memory_format=layout).requires_grad_()
    upstream = torch.randn(12, 6, 5, 7).contiguous(memory_format=layout)
    y = bn(x)
    y.backward(upstream)
    got = (y.detach(), x.grad, bn.weight.grad, bn.bias.grad)
    xr = x.detach().clone().requires_grad_()
    weight, bias = (t.detach().clone().requires_grad_() for t in (bn.weight, bn.bias))
    ref = torch.cat([F.batch_norm(g, None, None, weight, bias, True, 0.0, 1e-3) for g in xr.split(4)])
    ref.backward(upstream)
    for a, b in zip(got, (ref.detach(), xr.grad, weight.grad, bias.grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert y.is_contiguous(memory_format=layout) and x.grad is not None
    assert x.grad.is_contiguous(memory_format=layout)


@pytest.mark.parametrize("virtual", [None, 4])
def test_batch_norm_with_bf16_parameters_keeps_fp32_statistics(virtual: int | None) -> None:
    # FSDP2's bf16 policy hands the layer bf16 copies of weight and bias but leaves the running buffers
    # fp32: the layer must normalise a bf16 input with fp32 statistics, as it does under autocast.
    torch.manual_seed(0)
    ref = BatchNorm2d(5, eps=1e-3, momentum=0.1, virtual_batch_size=virtual).train()
    with torch.no_grad():
        ref.weight.copy_((torch.rand(5) + 0.5).bfloat16().float())
        ref.bias.copy_(torch.rand(5).bfloat16().float())
    cast = BatchNorm2d(5, eps=1e-3, momentum=0.1, virtual_batch_size=virtual).train()
    cast.weight = torch.nn.Parameter(ref.weight.detach().bfloat16())
    cast.bias = torch.nn.Parameter(ref.bias.detach().bfloat16())
    x = (torch.randn(8, 5, 3, 3) * 2 + 1).bfloat16()
    y = cast(x)
    y.float().square().sum().backward()
    assert y.dtype == torch.bfloat16 and cast.weight.grad is not None and cast.weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref(x))
    assert cast.running_mean.dtype == cast.running_var.dtype == torch.float32
    torch.testing.assert_close(cast.running_mean, ref.running_mean)
    torch.testing.assert_close(cast.running_var, ref.running_var)
    cast.eval()
    ref.eval()
    torch.testing.assert_close(cast(x), ref(x))


def test_virtual_batch_norm_from_config() -> None:
    model = openalign.create_model("nano", **tiny_overrides(image={"batch_norm": "virtual", "virtual_batch_size": 2}))
    assert model.image.stem.bn.virtual_batch_size == 2
    model.train()
    a = model.encode_image(torch.randn(4, 3, 32, 32))
    assert torch.isfinite(a).all()


def _step(model: openalign.DualEncoder, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(6, 3, 32, 32, generator=gen)
    ids = torch.randint(1, 101, (6, 12), generator=gen)
    torch.manual_seed(seed)
    img, txt = model(pixels, ids)
    loss = (img @ txt.T / model.temperature).logsumexp(1).sum()
    model.zero_grad()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_matches_plain_and_counts_bn_once() -> None:
    torch.manual_seed(0)
    overrides = tiny_overrides(text={"vocab_size": 101, "num_layers": 2, "hidden_size": 32, "num_heads": 4})
    plain = openalign.create_model("nano", **overrides).train()
    ckpt = openalign.create_model("nano", **overrides).train()
    ckpt.load_state_dict(plain.state_dict())
    ckpt.set_grad_checkpointing(True)
    loss_a, grads_a = _step(plain, seed=3)
    loss_b, grads_b = _step(ckpt, seed=3)
    torch.testing.assert_close(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6, msg=name)
    for (name, a), b in zip(plain.state_dict().items(), ckpt.state_dict().values(), strict=True):
        if "running" in name or "num_batches" in name:
            torch.testing.assert_close(a, b, msg=name)


def test_embeddings_are_unit_norm_and_temperature_positive(tiny_model: openalign.DualEncoder) -> None:
    tiny_model.eval()
    img = tiny_model.encode_image(torch.randn(3, 3, 32, 32))
    txt = tiny_model.encode_text(torch.randint(1, 101, (3, 9)), torch.ones(3, 9, dtype=torch.long))
    assert img.shape == txt.shape == (3, 24)
    torch.testing.assert_close(img.norm(dim=-1), torch.ones(3))
    torch.testing.assert_close(txt.norm(dim=-1), torch.ones(3))
    assert tiny_model.temperature.ndim == 0 and tiny_model.temperature.item() == pytest.approx(1.0)
    assert tiny_model.embed_dim == 24


def test_temperature_options() -> None:
    fixed = openalign.create_model("nano", **tiny_overrides(learn_temperature=False, temperature_init=1 / 64))
    assert not fixed.temperature_param.requires_grad
    assert fixed.temperature.item() == pytest.approx(1 / 64)
    logt = openalign.create_model("nano", **tiny_overrides(temperature_param="log", temperature_init=0.5))
    assert logt.temperature_param.item() == pytest.approx(math.log(0.5))
    assert logt.temperature.item() == pytest.approx(0.5)
    assert logt.no_weight_decay() == {"temperature_param"}


def test_trimmed_padding_changes_nothing(tiny_model: openalign.DualEncoder) -> None:
    tiny_model.eval()
    ids = torch.randint(1, 101, (4, 16))
    mask = torch.ones(4, 16, dtype=torch.long)
    for row, length in enumerate([3, 7, 5, 2]):
        mask[row, length:] = 0
        ids[row, length:] = 0
    short_ids, _ = trim_padding(ids, mask)
    assert short_ids.shape == (4, 7)
    with torch.no_grad():
        full = tiny_model.text_proj(tiny_model.text(ids, mask))  # the untrimmed computation
        trimmed = tiny_model.encode_text(ids, mask, normalize=False)
    torch.testing.assert_close(full, trimmed, rtol=1e-5, atol=1e-6)
    # a row's embedding does not depend on how much padding follows it
    alone = tiny_model.encode_text(ids[1:2, :7], mask[1:2, :7], normalize=False)
    torch.testing.assert_close(alone[0], trimmed[1], rtol=1e-5, atol=1e-6)
    left = torch.flip(mask, [1])
    assert trim_padding(ids, left)[0].shape == (4, 16)


def test_length_buckets_encode_short_rows_apart_and_change_no_embedding(tiny_model: openalign.DualEncoder) -> None:
    tiny_model.eval()
    lengths = [2, 16, 3, 4, 16, 2, 5, 3]
    mask = (torch.arange(16) < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(1, 101, (8, 16)) * mask
    groups = length_buckets(mask)
    assert groups is not None
    # the split that pads least: the six short rows (longest 5) apart from the two of 16
    assert sorted(groups[0].tolist()) == [0, 2, 3, 5, 6, 7] and sorted(groups[1].tolist()) == [1, 4]
    with torch.no_grad():
        one_by_one = torch.cat(
            [tiny_model.encode_text(ids[i : i + 1, :n], normalize=False) for i, n in enumerate(lengths)]
        )
        bucketed = tiny_model.encode_text(ids, mask, normalize=False)
    torch.testing.assert_close(bucketed, one_by_one, rtol=1e-5, atol=1e-6)
    # and the gradients through the regrouping are those of the padded batch
    weights = torch.randn(8, bucketed.shape[1])
    grads = []
    for encode in (
        lambda: tiny_model.text_proj(tiny_model.text(ids, mask)),
        lambda: tiny_model.encode_text(ids, mask, normalize=False),
    ):
        tiny_model.zero_grad()
        (encode() * weights).sum().backward()
        grads.append([p.grad.clone() for p in tiny_model.text.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    for padded, regrouped in zip(*grads, strict=True):
        torch.testing.assert_close(regrouped, padded, rtol=1e-4, atol=1e-6)
    # nothing to gain: equal lengths, a saving under the threshold, left padding
    assert length_buckets(torch.ones(8, 16, dtype=torch.long)) is None
    assert length_buckets((torch.arange(16) < torch.tensor([12, 16, 14, 13])[:, None]).long()) is None
    assert length_buckets(torch.flip(mask, [1])) is None


class _HostReads(TorchDispatchMode):
    """Counts the reads of tensor values by the host (``int()``, ``bool()``, ``.item()``): each is a sync on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_text_tower_on_an_accelerator_reads_the_mask_once_and_matches_the_cpu_path(
    tiny_model: openalign.DualEncoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU every read of a value waits for all queued work (``torch.cuda.set_sync_debug_mode`` reports each).
    Without a GPU here, the accelerator path is taken by declaring the mask unreadable for free: one ``.tolist()``
    in ``check_tokens`` (validation and the batch's width), no other read, no second pass, and the embeddings and
    gradients of the CPU path (buckets, trimming, an all-ones mask dropped) within fp32 tolerance."""
    import openalign.model.bert as bert
    import openalign.model.captions as captions
    import openalign.model.dual_encoder as dual_encoder

    tiny_model.eval()
    lengths = [2, 9, 3, 4, 9, 2, 5, 3]
    mask = (torch.arange(16) < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(1, 101, (8, 16)) * mask
    weights = torch.randn(8, tiny_model.embed_dim)

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        tiny_model.zero_grad()
        with _HostReads() as counter:
            out = tiny_model.encode_text(ids, mask, normalize=False)
            (out * weights).sum().backward()
        run.reads = counter.reads  # type: ignore[attr-defined]
        return out.detach(), [p.grad.clone() for p in tiny_model.text.parameters() if p.grad is not None]

    cpu_out, cpu_grads = run()
    assert run.reads > 0  # type: ignore[attr-defined]  # the CPU path reads lengths freely (and the counter sees it)
    tolists: list[torch.Tensor] = []
    real_tolist = torch.Tensor.tolist

    def counted_tolist(t: torch.Tensor) -> object:
        tolists.append(t)
        return real_tolist(t)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    for module in (dual_encoder, bert, captions):
        monkeypatch.setattr(module, "host_readable", lambda t: False)
    passes = []
    monkeypatch.setattr(tiny_model.text, "forward", _recording(tiny_model.text.forward, passes))
    acc_out, acc_grads = run()
    assert run.reads == 0  # type: ignore[attr-defined]
    assert len(tolists) == 1 and tolists[0].numel() == 4
    assert passes == [((8, 9), None)]  # cut to the longest caption, no groups
    torch.testing.assert_close(acc_out, cpu_out, rtol=1e-5, atol=1e-6)
    assert len(acc_grads) == len(cpu_grads) > 0
    for acc, cpu in zip(acc_grads, cpu_grads, strict=True):
        torch.testing.assert_close(acc, cpu, rtol=1e-4, atol=1e-6)


def _recording(forward, calls: list[tuple[tuple[int, ...], object]]):  # type: ignore[no-untyped-def]
    def wrapped(input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append((tuple(input_ids.shape), args[1] if len(args) > 1 else None))
        return forward(input_ids, *args)

    return wrapped


def test_additive_mask_is_what_attention_makes_of_a_boolean_one() -> None:
    from openalign.model.bert import additive_mask

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 2, 12, 8, generator=gen, requires_grad=True) for _ in range(3))
    mask = (torch.arange(12) < torch.tensor([12, 3, 7, 1])[:, None]).long()
    boolean = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.bool()[:, None, None, :])
    additive = F.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask(mask, q.dtype))
    assert torch.equal(boolean, additive)
    grads = torch.autograd.grad(boolean.sum(), (q, k, v)), torch.autograd.grad(additive.sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert additive_mask(mask, torch.bfloat16).dtype == torch.bfloat16
    assert additive_mask(mask, q.dtype).is_contiguous()  # as the CPU's attention kernels take it


def test_channels_last_gives_the_same_embeddings() -> None:
    torch.manual_seed(0)
    a = openalign.create_model("nano", **tiny_overrides(image={"channels_last": False})).eval()
    b = openalign.create_model("nano", **tiny_overrides()).eval()
    assert b.config.image.channels_last and b.image.stem.conv.weight.is_contiguous(memory_format=torch.channels_last)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, 33, 33)
    torch.testing.assert_close(a.encode_image(x), b.encode_image(x), rtol=1e-5, atol=1e-6)


def test_sync_batch_norm_option() -> None:
    model = openalign.create_model("nano", **tiny_overrides(image={"batch_norm": "sync"}))
    assert isinstance(model.image.stem.bn, torch.nn.SyncBatchNorm)


def test_save_and_load_round_trip(tmp_path, tiny_model: openalign.DualEncoder) -> None:
    tiny_model.eval()
    with torch.no_grad():
        tiny_model.temperature_param.fill_(0.3)
    openalign.save_model(tiny_model, tmp_path / "ckpt")
    loaded = openalign.load_model(tmp_path / "ckpt")
    assert loaded.config == tiny_model.config
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(loaded.encode_image(x), tiny_model.encode_image(x))
    assert loaded.temperature.item() == pytest.approx(0.3)


def test_load_model_rejects_unknown_directories(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        openalign.load_model(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ConfigError, match="neither an openalign checkpoint nor a transformers AlignModel"):
        openalign.load_model(tmp_path)


def test_load_model_names_a_damaged_or_mismatched_weights_file(tmp_path, tiny_model: openalign.DualEncoder) -> None:
    import json

    ckpt = openalign.save_model(tiny_model, tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(ConfigError, match=rf"^{weights}: truncated or corrupt safetensors file"):
        openalign.load_model(ckpt)
    weights.write_bytes(good)
    meta = json.loads((ckpt / "config.json").read_text())
    meta["model"]["text"]["hidden_size"] = 48
    (ckpt / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError) as caught:
        openalign.load_model(ckpt)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{weights} does not fit the model its config describes: ")
    assert "text.embeddings.word.weight has shape [101, 32], the model expects [101, 48]" in message
    assert message.endswith("tensors do not fit")


@pytest.mark.parametrize(
    ("pixels", "message"),
    [
        (torch.randn(2, 32, 32), r"shape \[B, 3, H, W\]"),
        (torch.randn(2, 1, 32, 32), r"shape \[B, 3, H, W\]"),
        (torch.randint(0, 255, (2, 3, 32, 32), dtype=torch.uint8), "floating point"),
        (torch.randn(0, 3, 32, 32), "empty batch"),
    ],
)
def test_bad_pixels_fail_before_compute(tiny_model: openalign.DualEncoder, pixels: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_model.encode_image(pixels)


@pytest.mark.parametrize(
    ("ids", "mask", "message"),
    [
        (torch.tensor([[1, 2, 101]]), None, r"token id 101 is outside the model's vocabulary \[0, 101\)"),
        (torch.tensor([[1, -1]]), None, "token id -1"),
        (torch.tensor([[1.0, 2.0]]), None, "integer token ids"),
        (torch.tensor([1, 2]), None, r"shape \[B, L\]"),
        (torch.ones(1, 65, dtype=torch.long), None, "positions"),
        (torch.tensor([[1, 2]]), torch.tensor([[1, 1, 0]]), "attention_mask shape"),
        (torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), r"\[CLS\]"),
    ],
)
def test_bad_tokens_fail_before_compute(
    tiny_model: openalign.DualEncoder, ids: torch.Tensor, mask: torch.Tensor | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_model.encode_text(ids, mask)


def test_tokenizer_round_trip(tmp_path) -> None:
    from openalign.text import load_tokenizer, train_wordpiece

    captions = ["a red circle on green grass", "two blue squares beside a red circle"] * 20
    tok = train_wordpiece(captions, vocab_size=120)
    batch = tok(["a red circle", "blue squares on grass"], max_length=8)
    assert batch["input_ids"].shape == (2, 8)
    assert batch["input_ids"][0, 0].item() == tok.backend.token_to_id("[CLS]")
    assert batch["attention_mask"].sum(1).tolist() == [5, 6]
    long = tok(["red " * 40], max_length=8)["input_ids"][0]
    assert long[-1].item() == tok.backend.token_to_id("[SEP]")  # truncation keeps the closing [SEP]
    tok.save(tmp_path)
    for source in (tmp_path, tmp_path / "tokenizer.json", tmp_path / "vocab.txt"):
        again = load_tokenizer(source)
        assert torch.equal(again(["a red circle"], max_length=8)["input_ids"], batch["input_ids"][:1])
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nope")
