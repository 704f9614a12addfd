"""Interop with transformers' AlignModel: small random models saved and loaded both ways, no download."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import openalign
from conftest import tiny_overrides
from openalign.config import ConfigError, merge
from openalign.model.efficientnet import round_filters

transformers = pytest.importorskip("transformers")


def _randomise_batch_norm(model: torch.nn.Module) -> None:
    """Fresh batch norms are the identity in eval mode; random statistics make the comparison bite."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                n = m.num_features
                m.running_mean.copy_(torch.randn(n, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(n, generator=gen) + 0.5)
                m.weight.copy_(1 + torch.randn(n, generator=gen) * 0.1)
                m.bias.copy_(torch.randn(n, generator=gen) * 0.1)


def _hf_model(depthwise_padding: tuple[int, ...] = ()) -> transformers.AlignModel:
    torch.manual_seed(0)
    vision = transformers.AlignVisionConfig(
        width_coefficient=0.5, depth_coefficient=0.5, image_size=64, depthwise_padding=list(depthwise_padding)
    )
    text = transformers.AlignTextConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=40,
    )
    config = transformers.AlignConfig(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        projection_dim=round_filters(320, 0.5),
        temperature_init_value=0.7,
    )
    model = transformers.AlignModel(config).eval()
    _randomise_batch_norm(model)
    return model


def _exportable(**overrides: object) -> openalign.DualEncoder:
    """A tiny model transformers can express: no image projection, no residual on a stage's first block."""
    torch.manual_seed(0)
    base = tiny_overrides(image={"width_coefficient": 0.5}, text={"pooling": "cls"}, embed_dim=round_filters(320, 0.5))
    return openalign.create_model("nano", **merge(base, overrides))


def _inputs(size: int, vocab: int = 99) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    pixels = torch.randn(3, 3, size, size, generator=gen)
    ids = torch.randint(1, vocab, (3, 10), generator=gen)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 6:] = 0
    ids[1, 6:] = 0
    return pixels, ids, mask


def _hf_embeddings(hf: transformers.AlignModel, pixels, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = hf(pixel_values=pixels, input_ids=ids, attention_mask=mask)
    return out.image_embeds, out.text_embeds


def _our_embeddings(model: openalign.DualEncoder, pixels, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return model.encode_image(pixels), model.encode_text(ids, mask)


@pytest.mark.parametrize("size", [64, 65, 77])
def test_transformers_checkpoint_loads_with_equal_embeddings(tmp_path, size: int) -> None:
    # depthwise_padding exercises transformers' per-block symmetric padding switch as well.
    hf = _hf_model(depthwise_padding=(1,))
    hf.save_pretrained(tmp_path)
    ours = openalign.load_model(tmp_path)
    assert not ours.training
    assert ours.config.image.padding == "hf" and ours.config.image_size == 289
    inputs = _inputs(size)
    for a, b in zip(_hf_embeddings(hf, *inputs), _our_embeddings(ours, *inputs), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    assert ours.temperature.item() == pytest.approx(hf.temperature.item())


def test_preprocessor_config_sets_size_and_pixel_range(tmp_path) -> None:
    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    # the public kakaobrain/align-base processor: 346 resize, 289 crop, pixels / 127.5 - 1
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "EfficientNetImageProcessor",
                "crop_size": {"height": 289, "width": 289},
                "size": {"height": 346, "width": 346},
                "rescale_factor": 1 / 127.5,
                "rescale_offset": True,
                "do_normalize": False,
            }
        )
    )
    cfg = openalign.load_model(tmp_path).config
    assert cfg.image_size == 289
    x = torch.rand(3)  # pixels in [0, 1]
    mean, std = torch.tensor(cfg.pixel_mean), torch.tensor(cfg.pixel_std)
    torch.testing.assert_close((x - mean) / std, x * 255 / 127.5 - 1)


@pytest.mark.parametrize("source", ["native", "roundtrip"])
def test_exported_model_loads_in_transformers_with_equal_embeddings(tmp_path, source: str) -> None:
    torch.manual_seed(0)
    if source == "native":
        # an openalign model (TF SAME padding) exported at an even size, where transformers is exact
        model = _exportable(image_size=64, temperature_param="log", temperature_init=0.3).eval()
        _randomise_batch_norm(model)
        size = 64
    else:
        # a transformers model imported and exported again is exact at odd sizes too
        _hf_model(depthwise_padding=(1,)).save_pretrained(tmp_path / "src")
        model = openalign.load_model(tmp_path / "src")
        size = 65
    from openalign.model.hf import export_hf_align

    export_hf_align(model, tmp_path / "out")
    hf = transformers.AlignModel.from_pretrained(tmp_path / "out").eval()
    inputs = _inputs(size, vocab=model.config.text.vocab_size)
    for a, b in zip(_hf_embeddings(hf, *inputs), _our_embeddings(model, *inputs), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    assert hf.temperature.item() == pytest.approx(model.temperature.item(), rel=1e-6)


def test_mean_pooled_text_features_are_the_masked_mean_of_transformers_last_layer(tmp_path) -> None:
    _hf_model().save_pretrained(tmp_path)
    ours = openalign.load_model(tmp_path)
    ours.config.text.pooling = "mean"
    hf = transformers.AlignModel.from_pretrained(tmp_path).eval()
    _, ids, mask = _inputs(64)
    with torch.no_grad():
        hidden = hf.text_model(input_ids=ids, attention_mask=mask).last_hidden_state
        features = ours.text(ids, mask)
    for row in range(len(ids)):
        kept = hidden[row, mask[row].bool()]
        torch.testing.assert_close(features[row], kept.mean(dim=0), rtol=0, atol=1e-5)
    assert not torch.allclose(features[0], hidden[0, 0], atol=1e-3)


def test_export_refuses_mean_pooled_text(tmp_path) -> None:
    from openalign.model.hf import export_hf_align

    with pytest.raises(ConfigError, match=r"text\.pooling must be cls"):
        export_hf_align(_exportable(image_size=64, text={"pooling": "mean"}), tmp_path)


def test_export_refuses_an_image_projection(tmp_path, tiny_model: openalign.DualEncoder) -> None:
    from openalign.model.hf import export_hf_align

    assert tiny_model.image_proj is not None
    with pytest.raises(ConfigError, match="no image projection"):
        export_hf_align(tiny_model, tmp_path)


def test_export_refuses_symmetric_padding(tmp_path) -> None:
    from openalign.model.hf import export_hf_align

    with pytest.raises(ConfigError, match=r"image\.padding symmetric cannot be exported"):
        export_hf_align(_exportable(image_size=64, image={"padding": "symmetric"}), tmp_path)


def test_export_refuses_a_residual_transformers_cannot_express(tmp_path) -> None:
    from openalign.model.hf import export_hf_align

    # at width 0.25 the first stage maps 8 channels to 8 at stride 1: TF adds a residual, transformers not
    overrides = tiny_overrides(text={"pooling": "cls"}, embed_dim=round_filters(320, 0.25))
    model = openalign.create_model("nano", **overrides)
    with pytest.raises(ConfigError, match="block 0 starts a stage"):
        export_hf_align(model, tmp_path)


def test_export_warns_where_transformers_cannot_be_exact(tmp_path) -> None:
    from openalign.model.hf import depthwise_padding_for, export_hf_align

    model = _exportable(image_size=289)
    with pytest.warns(UserWarning, match="pads the stem"):
        export_hf_align(model, tmp_path)
    # 289 → 145 → 73 → 37 → 19 → 10: every stride-2 block sees an odd input, so all pad symmetrically
    symmetric, stem_exact = depthwise_padding_for(model.config)
    assert not stem_exact
    assert len(symmetric) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        even = _exportable(image_size=64)
        export_hf_align(even, tmp_path / "even")
        assert depthwise_padding_for(even.config) == ([], True)


def test_tokenizer_exports_for_transformers(tmp_path) -> None:
    from openalign.model.hf import export_hf_align
    from openalign.text import train_wordpiece

    tok = train_wordpiece(["a red circle on green grass", "two blue squares by a circle"] * 10, vocab_size=90)
    tok.save(tmp_path / "tok")
    model = _exportable(image_size=64, text={"vocab_size": tok.vocab_size})
    export_hf_align(model, tmp_path / "out", tokenizer_dir=tmp_path / "tok")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    text = ["two red circles on grass"]
    ours = tok(text, max_length=12)
    theirs = hf_tok(text, padding="max_length", max_length=12, return_tensors="pt")
    assert torch.equal(ours["input_ids"], theirs["input_ids"])
    assert torch.equal(ours["attention_mask"], theirs["attention_mask"])
    assert openalign.load_tokenizer(tmp_path / "out").vocab_size == tok.vocab_size


def test_convert_cli_both_ways(tmp_path) -> None:
    from openalign.cli import main

    _hf_model().save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    ours = openalign.load_model(tmp_path / "ours")
    assert main(["convert", "--to-hf", str(tmp_path / "ours"), str(tmp_path / "back")]) == 0
    back = transformers.AlignModel.from_pretrained(tmp_path / "back").eval()
    inputs = _inputs(64)
    for a, b in zip(_hf_embeddings(back, *inputs), _our_embeddings(ours, *inputs), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_export_refuses_a_convnet_image_tower(tmp_path) -> None:
    from openalign.model.hf import export_hf_align

    with pytest.raises(ConfigError, match=r"AlignVision is an EfficientNet"):
        export_hf_align(_exportable(image_size=64, image={"family": "convnet"}), tmp_path)
