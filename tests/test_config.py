from __future__ import annotations

import pytest

import openalign
from openalign.config import ConfigError, ModelConfig, from_dict, load_yaml, model_config, to_dict


def test_presets_cover_the_paper_grid() -> None:
    names = openalign.list_presets()
    for image in ["b0", "b1", "b2", "b3", "b4", "b5", "b6", "b7", "l2"]:
        for text in ["tiny", "mini", "small", "medium", "base", "large"]:
            assert f"{image}-{text}" in names
    assert "nano" in names


@pytest.mark.parametrize(
    ("name", "width", "depth", "resolution", "dropout"),
    [
        ("b0", 1.0, 1.0, 224, 0.2),
        ("b1", 1.0, 1.1, 240, 0.2),
        ("b2", 1.1, 1.2, 260, 0.3),
        ("b3", 1.2, 1.4, 300, 0.3),
        ("b4", 1.4, 1.8, 380, 0.4),
        ("b5", 1.6, 2.2, 456, 0.4),
        ("b6", 1.8, 2.6, 528, 0.5),
        ("b7", 2.0, 3.1, 600, 0.5),
        ("l2", 4.3, 5.3, 800, 0.5),
    ],
)
def test_compound_scaling_coefficients(name: str, width: float, depth: float, resolution: int, dropout: float) -> None:
    cfg = model_config(f"{name}-base")
    assert (cfg.image.width_coefficient, cfg.image.depth_coefficient) == (width, depth)
    assert (cfg.image.resolution, cfg.image.dropout) == (resolution, dropout)
    assert cfg.embed_dim == (1376 if name == "l2" else 640)
    assert cfg.image_size == 289


@pytest.mark.parametrize(
    ("name", "layers", "hidden", "heads"),
    [
        ("tiny", 2, 128, 2),
        ("mini", 4, 256, 4),
        ("small", 4, 512, 8),
        ("medium", 8, 512, 8),
        ("base", 12, 768, 12),
        ("large", 24, 1024, 16),
    ],
)
def test_bert_sizes(name: str, layers: int, hidden: int, heads: int) -> None:
    t = model_config(f"b0-{name}").text
    assert (t.num_layers, t.hidden_size, t.num_heads, t.ffn_size) == (layers, hidden, heads, 4 * hidden)
    assert (t.vocab_size, t.max_length) == (100_000, 64)


def test_overrides_nested_and_dotted() -> None:
    cfg = model_config("b3-mini", embed_dim=320, image={"batch_norm": "virtual"}, **{"text.vocab_size": 5000})
    assert cfg.embed_dim == 320 and cfg.image.batch_norm == "virtual" and cfg.text.vocab_size == 5000
    assert cfg.image.width_coefficient == 1.2  # untouched siblings survive a nested override


def test_round_trip_through_dict() -> None:
    cfg = model_config("b5-base", temperature_param="log")
    assert from_dict(ModelConfig, to_dict(cfg)) == cfg


def test_unknown_preset_lists_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown preset 'b9-base'; valid presets: .*b7-base"):
        openalign.create_model("b9-base")


def test_unknown_key_names_it_and_the_valid_keys() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'image.batchnorm'; valid keys in image: .*batch_norm"):
        model_config("nano", image={"batchnorm": "sync"})
    with pytest.raises(ConfigError, match=r"unknown config key 'embed_size'"):
        model_config("nano", embed_size=3)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"image": {"batch_norm": "global"}}, "image.batch_norm: 'global' is not one of"),
        ({"embed_dim": "big"}, "embed_dim: expected an integer"),
        ({"text": {"num_heads": 3}}, "not divisible"),
        ({"text": {"max_length": 1000}}, "exceeds text.max_position_embeddings"),
        ({"temperature_init": 0.0}, "temperature_init must be positive"),
        ({"learn_temperature": "yes"}, "expected true or false"),
        ({"image": {"kernel_sizes": [3, 3]}}, "stages"),
    ],
)
def test_bad_values_are_one_line_errors(override: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        model_config("nano", **override)
    assert "\n" not in str(err.value)


def test_yaml_file(tmp_path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text("name: mine\nembed_dim: 96\nimage:\n  width_coefficient: 0.5\n")
    cfg = model_config(load_yaml(path))
    assert cfg.embed_dim == 96 and cfg.image.width_coefficient == 0.5


def test_exponent_floats_without_a_dot_read_as_numbers(tmp_path) -> None:
    from openalign.config import load_yaml, parse_yaml
    from openalign.train.config import parse_overrides

    assert parse_yaml("lr: 2e-3\nwd: 1E5\nname: e5\nsteps: 10\nx: 1.5e-3") == {
        "lr": 2e-3,
        "wd": 1e5,
        "name": "e5",
        "steps": 10,
        "x": 1.5e-3,
    }
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 3e-4\n")
    assert load_yaml(path) == {"optim": {"lr": 3e-4}}
    assert parse_overrides(["--optim.lr", "2e-3", "--data.tokenizer=vocab"]) == {
        "optim.lr": 2e-3,
        "data.tokenizer": "vocab",
    }
