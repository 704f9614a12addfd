"""The plain convolutional image tower (image.family convnet)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import openalign
from conftest import tiny_overrides
from openalign.config import ConfigError, model_config
from openalign.model.convnet import ConvNet
from openalign.model.dual_encoder import DualEncoder
from openalign.train.towers import autocast_image

CONV = {"family": "convnet", "conv_channels": [8, 8, 16, 40], "conv_strides": [2, 1, 2, 2], "bn_momentum": 0.9}


def _reference(net: ConvNet) -> nn.Sequential:
    """The same layers written with torch's own modules, weights copied: what the tower must compute."""
    layers: list[nn.Module] = []
    for layer in net.layers:
        conv = nn.Conv2d(layer.conv.in_channels, layer.conv.out_channels, 3, layer.conv.stride, 1, bias=False)
        bn = nn.BatchNorm2d(layer.conv.out_channels, eps=1e-3, momentum=0.1)
        conv.load_state_dict(layer.conv.state_dict())
        bn.load_state_dict(layer.bn.state_dict())
        layers += [conv, bn, nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())


@pytest.mark.parametrize("channels_last", [True, False])
def test_convnet_computes_conv_bn_relu_layers_and_a_global_average_pool(channels_last: bool) -> None:
    torch.manual_seed(0)
    cfg = model_config("nano", **tiny_overrides(image={**CONV, "channels_last": channels_last})).image
    net = ConvNet(cfg)
    for layer in net.layers:  # non-trivial batch-norm parameters and statistics
        for t in (layer.bn.weight, layer.bn.bias, layer.bn.running_mean):
            t.data.uniform_(-0.5, 0.5)
    ref = _reference(net)
    x = torch.randn(6, 3, 20, 20)
    assert net.num_features == 40
    for mode in (True, False):  # batch statistics (and the running update) in training, running ones in eval
        net.train(mode), ref.train(mode)
        torch.testing.assert_close(net(x), ref(x), rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(net.layers, ref[1:-2:3], strict=True):
        torch.testing.assert_close(ours.bn.running_var, theirs.running_var)


def test_convnet_init_is_he_fan_out_and_identity_batch_norm() -> None:
    torch.manual_seed(0)
    layers = {"conv_channels": [64, 256], "conv_strides": [1, 1]}
    net = ConvNet(model_config("nano", **tiny_overrides(image={**CONV, **layers})).image)
    w = net.layers[1].conv.weight
    assert w.std().item() == pytest.approx((2.0 / (9 * 256)) ** 0.5, rel=0.05)
    assert torch.equal(net.layers[0].bn.weight, torch.ones(64)) and torch.equal(net.layers[0].bn.bias, torch.zeros(64))


def test_dual_encoder_with_a_convnet_tower_trains_saves_and_loads(tmp_path) -> None:
    torch.manual_seed(0)
    model = DualEncoder(model_config("nano", **tiny_overrides(image=CONV)))
    assert isinstance(model.image, ConvNet) and model.image_proj is not None
    pixels, ids = torch.randn(4, 3, 32, 32), torch.randint(5, 101, (4, 7))
    image, text = model(pixels, ids, torch.ones_like(ids))
    (image.sum() + text.sum()).backward()
    assert all(p.grad is not None for p in model.image.parameters())
    model.eval()
    openalign.save_model(model, tmp_path / "ckpt")
    loaded = openalign.load_model(tmp_path / "ckpt")
    assert loaded.config.image.family == "convnet" and isinstance(loaded.image, ConvNet)
    with torch.no_grad():
        torch.testing.assert_close(loaded.encode_image(pixels), model.encode_image(pixels))


def test_virtual_batch_norm_reaches_the_convnet_layers() -> None:
    cfg = model_config("nano", **tiny_overrides(image={**CONV, "batch_norm": "virtual", "virtual_batch_size": 2}))
    net = ConvNet(cfg.image).train()
    x = torch.randn(4, 3, 16, 16)
    halves = torch.cat([net(x[:2]), net(x[2:])])
    torch.testing.assert_close(net(x), halves, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("image", "message"),
    [
        ({"conv_channels": [8, 8], "conv_strides": [2]}, "must name the same layers"),
        ({"conv_channels": [], "conv_strides": []}, "must name the same layers"),
        ({"conv_channels": [8, 0], "conv_strides": [2, 1]}, "must be positive"),
        ({"conv_channels": [8, 8], "conv_strides": [2, 3]}, "conv_strides 1 or 2"),
    ],
)
def test_bad_convnet_layers_are_refused(image: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        model_config("nano", **tiny_overrides(image={**CONV, **image}))


def test_image_autocast_runs_the_image_tower_alone_in_bf16_while_training() -> None:
    torch.manual_seed(0)
    model = DualEncoder(model_config("nano", **tiny_overrides(image=CONV))).train()
    pixels, ids = torch.randn(8, 3, 32, 32), torch.randint(5, 101, (8, 7))
    mask = torch.ones_like(ids)
    dtypes: dict[str, set[torch.dtype]] = {"conv": set(), "text": set()}
    for m in model.image.modules():
        if isinstance(m, nn.Conv2d):
            m.register_forward_hook(lambda _m, _i, out: dtypes["conv"].add(out.dtype))
    for m in model.text.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda _m, _i, out: dtypes["text"].add(out.dtype))

    def step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        model.zero_grad()
        image, text = model(pixels, ids, mask)
        (image @ text.T).logsumexp(1).sum().backward()
        grads = [p.grad.flatten() for p in model.image.parameters() if p.grad is not None]
        return image.detach(), text.detach(), torch.cat(grads)

    ref_image, ref_text, ref_grad = step()
    assert dtypes == {"conv": {torch.float32}, "text": {torch.float32}}
    autocast_image(model, torch.bfloat16)
    dtypes["conv"].clear()
    image, text, grad = step()
    assert dtypes == {"conv": {torch.bfloat16}, "text": {torch.float32}}
    # The embeddings leave the tower as fp32 and the master weights' gradients stay fp32, near the fp32 ones
    # (bf16 keeps ~3 significant digits; a tiny net's gradients cancel, so only their direction is compared);
    # the text tower computed exactly what it did before.
    assert image.dtype == torch.float32 and grad.dtype == torch.float32
    torch.testing.assert_close(text, ref_text, rtol=0, atol=0)
    torch.testing.assert_close(image, ref_image, rtol=0, atol=3e-2)
    assert torch.nn.functional.cosine_similarity(grad, ref_grad, dim=0) > 0.95
    assert not torch.equal(image, ref_image)
    # Evaluation and serving keep the weights' precision.
    model.eval()
    dtypes["conv"].clear()
    with torch.no_grad():
        model.encode_image(pixels)
    assert dtypes["conv"] == {torch.float32}
