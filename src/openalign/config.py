"""Typed model configuration, presets and strict YAML/dict loading.

Every field is documented where it is declared. Loading is strict: an unknown key is an error that
names the key and lists the valid ones, so a typo in a YAML file never silently falls back to a default.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import re
import stat
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import yaml

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")
MAX_CONFIG_BYTES = 16 * 2**20  # the largest YAML settings file read


class ConfigError(ValueError):
    """A configuration problem, always reported as one line naming the offending key or value."""


# EfficientNet-B0 stages; every variant scales these with its width and depth coefficients.
_B0_KERNEL_SIZES = (3, 3, 5, 3, 5, 5, 3)
_B0_NUM_REPEATS = (1, 2, 2, 3, 3, 4, 1)
_B0_IN_CHANNELS = (32, 16, 24, 40, 80, 112, 192)
_B0_OUT_CHANNELS = (16, 24, 40, 80, 112, 192, 320)
_B0_EXPAND_RATIOS = (1, 6, 6, 6, 6, 6, 6)
_B0_STRIDES = (1, 2, 2, 2, 1, 2, 1)


@dataclass
class ImageTowerConfig:
    """The image tower: EfficientNet (Tan & Le 2019) as in ALIGN, or a plain convnet (family), average-pooled.

    ``family: convnet`` builds a plain stack of 3×3 convolutions instead (``openalign.model.convnet``: CPU-sized
    runs learn far more per second with it); of the fields below it reads ``conv_channels``, ``conv_strides`` and
    the batch-norm, layout and checkpointing ones."""

    family: Literal["efficientnet", "convnet"] = "efficientnet"
    # family convnet: output channels and stride of each 3×3 convolution + batch norm + ReLU layer
    conv_channels: tuple[int, ...] = (32, 32, 64, 64, 128, 128, 160)
    conv_strides: tuple[int, ...] = (2, 1, 2, 1, 2, 1, 2)
    width_coefficient: float = 1.0  # compound scaling of channels
    depth_coefficient: float = 1.0  # compound scaling of block repeats
    resolution: int = 224  # the variant's native ImageNet resolution (reference; ALIGN trains at 289)
    dropout: float = 0.2  # compound-scaled classifier-head dropout; only classification heads use it
    drop_connect_rate: float = 0.2  # stochastic depth, rising linearly from 0 over the blocks
    depth_divisor: int = 8  # channels are rounded to multiples of this
    stem_channels: int = 32  # before width scaling
    kernel_sizes: tuple[int, ...] = _B0_KERNEL_SIZES
    num_repeats: tuple[int, ...] = _B0_NUM_REPEATS  # before depth scaling
    in_channels: tuple[int, ...] = _B0_IN_CHANNELS  # before width scaling
    out_channels: tuple[int, ...] = _B0_OUT_CHANNELS  # before width scaling
    expand_ratios: tuple[int, ...] = _B0_EXPAND_RATIOS
    strides: tuple[int, ...] = _B0_STRIDES
    se_ratio: float = 0.25  # squeeze-excitation width as a fraction of the block's input channels
    batch_norm: Literal["device", "sync", "virtual"] = "device"  # statistics per device, synced, or ghost
    virtual_batch_size: int = 16  # samples per statistics group with batch_norm="virtual" (TPU per-core)
    bn_eps: float = 1e-3
    bn_momentum: float = 0.99  # TF convention (running = m·running + (1-m)·batch); torch gets 1 - m
    # "same": TF SAME at any input size; "hf": transformers' port (fixed paddings, and no residual on
    # a stage's first block even where its input and output widths agree); "symmetric": kernel // 2 on every
    # side, as torchvision and timm's non-TF EfficientNets pad (a stride-2 conv then needs no padded copy of
    # its input, so a step is faster). Checkpoints keep the padding they learnt with.
    padding: Literal["same", "hf", "symmetric"] = "same"
    hf_depthwise_padding: tuple[int, ...] = ()  # with padding="hf": blocks whose stride-2 pad is symmetric
    gradient_checkpointing: bool = False
    # NHWC convolutions: oneDNN on CPU runs EfficientNet's depthwise convolutions much faster in this layout, and it
    # is the layout GPU tensor cores want under bf16.
    channels_last: bool = True


@dataclass
class TextTowerConfig:
    """The text tower: BERT (Devlin et al. 2019); its last layer's [CLS] vector or token mean (pooling)."""

    family: Literal["bert"] = "bert"
    num_layers: int = 12
    hidden_size: int = 768
    num_heads: int = 12
    intermediate_size: int = 0  # 0 means 4 × hidden_size
    vocab_size: int = 100_000  # the paper's 100k wordpieces; replaced by the tokenizer's size when known
    max_length: int = 64  # the paper's maximum sequence length (tokenizer truncation)
    max_position_embeddings: int = 512  # BERT's table size; must be ≥ max_length
    type_vocab_size: int = 2
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    gradient_checkpointing: bool = False
    # cls: the paper's text feature, the last layer's [CLS] vector; mean: its average over the caption's tokens,
    # which differs between captions from the first step of a BERT trained from scratch.
    pooling: Literal["cls", "mean"] = "cls"

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size


@dataclass
class ModelConfig:
    """A dual encoder: image tower, text tower, projections to a shared space and a temperature."""

    name: str = ""
    image: ImageTowerConfig = field(default_factory=ImageTowerConfig)
    text: TextTowerConfig = field(default_factory=TextTowerConfig)
    embed_dim: int = 640  # the paper: 640 for B1–B7 (B1/B3/B5 projected up), 1376 for L2
    temperature_init: float = 1.0  # the paper starts the learned temperature at 1.0
    learn_temperature: bool = True  # False keeps it fixed (the paper's 1/32, 1/64, 1/128 ablation)
    temperature_param: Literal["direct", "log"] = "direct"  # learn σ itself (paper) or log σ
    image_size: int = 289  # the square input the model is trained and evaluated at
    pixel_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)  # with std 0.5 pixels in [0, 1] map to
    pixel_std: tuple[float, float, float] = (0.5, 0.5, 0.5)  # [-1, 1], as the public ALIGN checkpoint


# --------------------------------------------------------------------------------------------------
# Strict loading


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        return from_dict(tp, value, where)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        last: ConfigError | None = None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as err:
                last = err
        raise last or ConfigError(f"{where}: bad value {value!r}")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{where}: expected {len(args)} values, got {len(value)}")
        return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if origin is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        return [_coerce(v, args[0], f"{where}[{i}]") if args else v for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        # YAML reads .inf and .nan as numbers; no setting has a use for them, and a NaN passes every
        # range check (each comparison is False), so it would surface only as a diverged run.
        if not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if tp is Any:
        return value
    raise ConfigError(f"{where}: unsupported field type {_type_name(tp)}")


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against type annotation ``tp`` (converting ints to floats where a float is wanted);
    a mismatch is a ConfigError naming ``where``."""
    return _coerce(value, tp, where)


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass ``cls`` from a plain mapping, rejecting unknown keys and ill-typed values."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"unknown config key '{prefix}{unknown[0]}'; valid keys{' in ' + where if where else ''}: "
            + ", ".join(sorted(fields))
        )
    kwargs = {name: _coerce(value, hints[name], f"{where}.{name}" if where else name) for name, value in data.items()}
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON/YAML-friendly mapping (tuples become lists) that ``from_dict`` reads back unchanged."""

    def plain(v: Any) -> Any:
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    out: dict[str, Any] = plain(dataclasses.asdict(cfg))
    return out


def merge(base: dict[str, Any], overrides: dict[str, Any], *, dotted: bool = True) -> dict[str, Any]:
    """Deep-merge ``overrides`` into a copy of ``base``; dotted keys ("image.batch_norm") address nesting.

    Only the keys of ``overrides`` itself are paths: the keys inside a mapping it holds are names, so
    ``{"optim.lr_scales": {"text.": 5.0, "image_proj.weight": 2.0}}`` keeps both parameter keys whole.
    """
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for key, value in overrides.items():
        head, _, rest = key.partition(".") if dotted else (key, "", "")
        if rest:
            value = {rest: value}
        else:
            head = key  # no path after the dot: "text." names a module prefix, not a nesting
        if isinstance(value, dict) and isinstance(out.get(head), dict):
            out[head] = merge(out[head], value, dotted=bool(rest))
        else:
            out[head] = value
    return out


class _Loader(yaml.SafeLoader):
    """PyYAML follows YAML 1.1, where ``2e-3`` (no dot) is a string; YAML 1.2 and every other tool read it as
    a number, and learning rates are written that way."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str) -> Any:
    """``yaml.safe_load`` that also reads exponent floats without a dot (``2e-3``) as numbers."""
    return yaml.load(text, Loader=_Loader)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML file's top-level mapping; a file that does not parse is a ``ConfigError`` naming the place."""
    # A settings file is small; anything else named as one (a device, a huge file) is refused unread.
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_CONFIG_BYTES:
        what = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"{st.st_size} bytes"
        raise ConfigError(f"{path}: not a settings file ({what}; at most {MAX_CONFIG_BYTES // 2**20} MB)")
    with open(path) as f:
        text = f.read(MAX_CONFIG_BYTES + 1)
    try:
        data = parse_yaml(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{path}: not valid YAML{where}: {' '.join(str(problem).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data


# --------------------------------------------------------------------------------------------------
# Presets: data files under openalign/presets, named "<image>-<text>" plus "nano".


@functools.cache
def _parsed_preset(name: str) -> dict[str, Any]:
    # Parsed once a process: resolving every preset (as finding a model's family does) parsed it 60 times.
    text = resources.files("openalign.presets").joinpath(f"{name}.yaml").read_text()
    data: dict[str, Any] = parse_yaml(text)
    return data


def _preset_data(name: str) -> dict[str, Any]:
    # A copy: callers build configurations from its nested mappings and may change them.
    return copy.deepcopy(_parsed_preset(name))


def _towers() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    data = _preset_data("towers")
    return data["image"], data["text"], data["models"]


def list_presets() -> list[str]:
    """Every preset name: the paper's ``<efficientnet>-<bert>`` grid and the tiny ``nano``."""
    images, texts, models = _towers()
    return sorted(models) + [f"{i}-{t}" for i in images for t in texts]


def preset_dict(name: str) -> dict[str, Any]:
    images, texts, models = _towers()
    if name in models:
        return {"name": name, **models[name]}
    image, _, text = name.partition("-")
    if image not in images or text not in texts:
        raise ConfigError(f"unknown preset '{name}'; valid presets: {', '.join(list_presets())}")
    image_cfg = dict(images[image])
    embed_dim = image_cfg.pop("embed_dim", 640)
    return {"name": name, "image": image_cfg, "text": texts[text], "embed_dim": embed_dim}


def model_config(preset_or_config: str | dict[str, Any] | ModelConfig, **overrides: Any) -> ModelConfig:
    """Resolve a preset name, a mapping or a ModelConfig, then apply keyword overrides.

    Overrides may be top-level fields (``embed_dim=320``), nested mappings (``image={"batch_norm":
    "virtual"}``) or dotted names passed through a dict (``**{"text.vocab_size": 8000}``).
    """
    if isinstance(preset_or_config, ModelConfig):
        base = to_dict(preset_or_config)
    elif isinstance(preset_or_config, str):
        base = preset_dict(preset_or_config)
    elif isinstance(preset_or_config, dict):
        base = dict(preset_or_config)
    else:
        raise ConfigError(f"expected a preset name, mapping or ModelConfig, got {type(preset_or_config).__name__}")
    cfg = from_dict(ModelConfig, merge(base, overrides))
    validate(cfg)
    return cfg


def validate(cfg: ModelConfig) -> None:
    """Cross-field checks that the type system cannot express."""
    im, tx = cfg.image, cfg.text
    n = len(im.kernel_sizes)
    for name in ("num_repeats", "in_channels", "out_channels", "expand_ratios", "strides"):
        if len(getattr(im, name)) != n:
            raise ConfigError(f"image.{name} has {len(getattr(im, name))} stages, image.kernel_sizes has {n}")
    if any(k % 2 == 0 for k in im.kernel_sizes):
        raise ConfigError(f"image.kernel_sizes must be odd, got {list(im.kernel_sizes)}")
    if any(s not in (1, 2) for s in im.strides):
        raise ConfigError(f"image.strides must be 1 or 2, got {list(im.strides)}")
    if not im.conv_channels or len(im.conv_channels) != len(im.conv_strides):
        raise ConfigError(
            f"image.conv_channels ({len(im.conv_channels)} layers) and image.conv_strides "
            f"({len(im.conv_strides)}) must name the same layers, at least one"
        )
    if any(c < 1 for c in im.conv_channels) or any(s not in (1, 2) for s in im.conv_strides):
        raise ConfigError(
            f"image.conv_channels must be positive and image.conv_strides 1 or 2, got "
            f"{list(im.conv_channels)} and {list(im.conv_strides)}"
        )
    if not 0.0 <= im.drop_connect_rate < 1.0:
        raise ConfigError(f"image.drop_connect_rate must be in [0, 1), got {im.drop_connect_rate}")
    if not 0.0 < im.bn_momentum < 1.0:
        raise ConfigError(f"image.bn_momentum must be in (0, 1) (TF convention), got {im.bn_momentum}")
    if im.virtual_batch_size < 1:
        raise ConfigError(f"image.virtual_batch_size must be ≥ 1, got {im.virtual_batch_size}")
    if tx.hidden_size % tx.num_heads:
        raise ConfigError(f"text.hidden_size {tx.hidden_size} is not divisible by text.num_heads {tx.num_heads}")
    if tx.max_length > tx.max_position_embeddings:
        raise ConfigError(
            f"text.max_length {tx.max_length} exceeds text.max_position_embeddings {tx.max_position_embeddings}"
        )
    if not 0 <= tx.pad_token_id < tx.vocab_size:
        raise ConfigError(f"text.pad_token_id {tx.pad_token_id} is outside the vocabulary of {tx.vocab_size}")
    if cfg.embed_dim < 1:
        raise ConfigError(f"embed_dim must be positive, got {cfg.embed_dim}")
    if not (math.isfinite(cfg.temperature_init) and cfg.temperature_init > 0):
        raise ConfigError(f"temperature_init must be positive, got {cfg.temperature_init}")
    if cfg.image_size < 8:
        raise ConfigError(f"image_size must be at least 8 pixels, got {cfg.image_size}")
    if any(s <= 0 for s in cfg.pixel_std):
        raise ConfigError(f"pixel_std must be positive, got {list(cfg.pixel_std)}")
