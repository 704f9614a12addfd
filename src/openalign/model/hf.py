"""Import and export of transformers ``AlignModel`` directories (the public kakaobrain/align-base layout).

Nothing here needs transformers installed: the directory format (config.json + safetensors or a
PyTorch .bin) is read and written directly, and the parameter names are translated by the tables
below. transformers' port differs from TF EfficientNet in two places that matter for exact numbers:
its stride-2 paddings are fixed rather than computed from the input size (reproduced here with
``padding="hf"``), and it has no projection after the image pool (so only models whose image
feature width equals the embedding size can be exported).
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from safetensors.torch import save_file
from torch import nn

from openalign.config import ConfigError, ModelConfig, model_config
from openalign.data.sources import read_annotation_json
from openalign.model.efficientnet import round_filters, round_repeats, same_padding
from openalign.model.weights import check_fits, read_safetensors

M = TypeVar("M", bound=nn.Module)


class Exportable(Protocol):
    """What export reads of a dual encoder: its config, its temperature and its weights."""

    config: ModelConfig

    @property
    def temperature(self) -> torch.Tensor: ...

    def state_dict(self) -> dict[str, Any]: ...


# (transformers name, openalign name); "{i}" is a block or layer index.
_VISION_NAMES = [
    ("vision_model.embeddings.convolution.weight", "image.stem.conv.weight"),
    ("vision_model.embeddings.batchnorm.", "image.stem.bn."),
    ("vision_model.encoder.blocks.{i}.expansion.expand_conv.weight", "image.blocks.{i}.expand.conv.weight"),
    ("vision_model.encoder.blocks.{i}.expansion.expand_bn.", "image.blocks.{i}.expand.bn."),
    (
        "vision_model.encoder.blocks.{i}.depthwise_conv.depthwise_conv.weight",
        "image.blocks.{i}.depthwise.conv.weight",
    ),
    ("vision_model.encoder.blocks.{i}.depthwise_conv.depthwise_norm.", "image.blocks.{i}.depthwise.bn."),
    ("vision_model.encoder.blocks.{i}.squeeze_excite.reduce.", "image.blocks.{i}.se.reduce."),
    ("vision_model.encoder.blocks.{i}.squeeze_excite.expand.", "image.blocks.{i}.se.expand."),
    (
        "vision_model.encoder.blocks.{i}.projection.project_conv.weight",
        "image.blocks.{i}.project.conv.weight",
    ),
    ("vision_model.encoder.blocks.{i}.projection.project_bn.", "image.blocks.{i}.project.bn."),
]
_TEXT_NAMES = [
    ("text_model.embeddings.word_embeddings.weight", "text.embeddings.word.weight"),
    ("text_model.embeddings.position_embeddings.weight", "text.embeddings.position.weight"),
    ("text_model.embeddings.token_type_embeddings.weight", "text.embeddings.token_type.weight"),
    ("text_model.embeddings.LayerNorm.", "text.embeddings.norm."),
    ("text_model.encoder.layer.{i}.attention.output.dense.", "text.layers.{i}.attn_out."),
    ("text_model.encoder.layer.{i}.attention.output.LayerNorm.", "text.layers.{i}.attn_norm."),
    ("text_model.encoder.layer.{i}.intermediate.dense.", "text.layers.{i}.ffn_in."),
    ("text_model.encoder.layer.{i}.output.dense.", "text.layers.{i}.ffn_out."),
    ("text_model.encoder.layer.{i}.output.LayerNorm.", "text.layers.{i}.ffn_norm."),
    ("text_projection.", "text_proj."),
]
_QKV = re.compile(r"text_model\.encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.(weight|bias)$")
_PREFIX_RULES = [
    (re.compile(re.escape(hf).replace(r"\{i\}", r"(\d+)")), ours) for hf, ours in _VISION_NAMES + _TEXT_NAMES
]
_REVERSE_RULES = [
    (re.compile(re.escape(ours).replace(r"\{i\}", r"(\d+)")), hf) for hf, ours in _VISION_NAMES + _TEXT_NAMES
]


def _rename(name: str, rules: list[tuple[re.Pattern[str], str]]) -> str | None:
    for pattern, target in rules:
        m = pattern.match(name)
        if m is None:
            continue
        rest = name[m.end() :]
        if target.endswith(".") or rest == "":
            out = target.replace("{i}", m.group(1)) if m.groups() else target
            return out + rest
    return None


# -------------------------------------------------------------------------------------------- import


def hf_config_to_model_config(hf: dict[str, Any], preprocessor: dict[str, Any] | None = None) -> ModelConfig:
    """Translate an AlignConfig (as its config.json mapping) into an openalign ModelConfig."""
    v = hf.get("vision_config") or {}
    t = hf.get("text_config") or {}
    if v.get("hidden_act", "swish") not in ("swish", "silu"):
        raise ConfigError(f"vision hidden_act {v.get('hidden_act')!r} is not supported (only swish)")
    if t.get("hidden_act", "gelu") != "gelu":
        raise ConfigError(f"text hidden_act {t.get('hidden_act')!r} is not supported (only gelu)")
    if v.get("pooling_type", "mean") != "mean":
        raise ConfigError("only mean-pooled AlignVision models are supported")
    image = {
        "width_coefficient": v.get("width_coefficient", 2.0),
        "depth_coefficient": v.get("depth_coefficient", 3.1),
        "depth_divisor": v.get("depth_divisor", 8),
        "kernel_sizes": v.get("kernel_sizes", [3, 3, 5, 3, 5, 5, 3]),
        "num_repeats": v.get("num_block_repeats", [1, 2, 2, 3, 3, 4, 1]),
        "in_channels": v.get("in_channels", [32, 16, 24, 40, 80, 112, 192]),
        "out_channels": v.get("out_channels", [16, 24, 40, 80, 112, 192, 320]),
        "expand_ratios": v.get("expand_ratios", [1, 6, 6, 6, 6, 6, 6]),
        "strides": v.get("strides", [1, 2, 2, 2, 1, 2, 1]),
        "se_ratio": v.get("squeeze_expansion_ratio", 0.25),
        "bn_eps": v.get("batch_norm_eps", 1e-3),
        "bn_momentum": v.get("batch_norm_momentum", 0.99),
        "drop_connect_rate": v.get("drop_connect_rate", 0.2),
        "resolution": v.get("image_size", 600),
        "padding": "hf",
        "hf_depthwise_padding": list(v.get("depthwise_padding", [])),
    }
    text = {
        "num_layers": t.get("num_hidden_layers", 12),
        "hidden_size": t.get("hidden_size", 768),
        "num_heads": t.get("num_attention_heads", 12),
        "intermediate_size": t.get("intermediate_size", 3072),
        "vocab_size": t.get("vocab_size", 30522),
        "max_position_embeddings": t.get("max_position_embeddings", 512),
        "max_length": min(64, t.get("max_position_embeddings", 512)),
        "type_vocab_size": t.get("type_vocab_size", 2),
        "hidden_dropout": t.get("hidden_dropout_prob", 0.1),
        "attention_dropout": t.get("attention_probs_dropout_prob", 0.1),
        "layer_norm_eps": t.get("layer_norm_eps", 1e-12),
        "pad_token_id": t.get("pad_token_id", 0) or 0,
    }
    width = round_filters(image["out_channels"][-1], image["width_coefficient"], image["depth_divisor"])
    if hf.get("projection_dim", 640) != width:
        raise ConfigError(
            f"projection_dim {hf.get('projection_dim')} differs from the image feature width {width}; "
            "transformers' AlignModel would not run such a checkpoint either"
        )
    cfg: dict[str, Any] = {
        "name": hf.get("_name_or_path", "") or "hf-align",
        "image": image,
        "text": text,
        "embed_dim": width,
        "temperature_init": float(hf.get("temperature_init_value", 1.0)),
        "image_size": 289,
    }
    if preprocessor:
        cfg.update(_preprocessing_from_hf(preprocessor))
    return model_config(cfg)


def _preprocessing_from_hf(pre: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    crop = pre.get("crop_size") or pre.get("size")
    if isinstance(crop, dict) and "height" in crop:
        out["image_size"] = int(crop["height"])
    elif isinstance(crop, int):
        out["image_size"] = crop
    # Our models take pixels in [0, 1] normalised by mean/std; express the processor's maps that way.
    scale = float(pre.get("rescale_factor", 1 / 255)) * 255.0
    if pre.get("do_normalize", False):
        mean = [float(m) for m in pre.get("image_mean", [0.5] * 3)]
        std = [float(s) for s in pre.get("image_std", [0.5] * 3)]
        offset = 1.0 if pre.get("rescale_offset", False) else 0.0
        # x' = ((x·s - offset) - mean) / std  with x in [0, 1]
        out["pixel_mean"] = [(offset + m) / scale for m in mean]
        out["pixel_std"] = [sd / scale for sd in std]
    elif pre.get("rescale_offset", False):
        # x' = x·s - 1 = (x - 1/s) / (1/s)
        out["pixel_mean"] = [1.0 / scale] * 3
        out["pixel_std"] = [1.0 / scale] * 3
    else:
        out["pixel_mean"] = [0.0] * 3
        out["pixel_std"] = [1.0 / scale] * 3
    return out


def hf_state_to_ours(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        name = name.removeprefix("align.")
        if name.startswith("text_model.pooler.") or name.endswith("position_ids") or name.endswith("token_type_ids"):
            continue  # ALIGN never uses BERT's pooler; the id buffers are derived
        if name == "temperature":
            t = tensor.float()
            out["temperature_param"] = t.log() if cfg.temperature_param == "log" else t
            continue
        m = _QKV.match(name)
        if m:
            qkv.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = tensor
            continue
        ours = _rename(name, _PREFIX_RULES)
        if ours is None:
            raise ConfigError(f"unexpected parameter {name!r} in the transformers checkpoint")
        out[ours] = tensor
    for (layer, kind), parts in qkv.items():
        out[f"text.layers.{layer}.qkv.{kind}"] = torch.cat([parts["query"], parts["key"], parts["value"]])
    return out


def _read_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    st = path / "model.safetensors"
    if st.is_file():
        return read_safetensors(st)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_annotation_json(index)["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(read_safetensors(path / shard))
        return state
    binary = path / "pytorch_model.bin"
    if binary.is_file():
        loaded: dict[str, torch.Tensor] = torch.load(binary, map_location="cpu", weights_only=True)
        return loaded
    raise FileNotFoundError(f"{path}: no model.safetensors or pytorch_model.bin")


def hf_model_config(path: str | Path, hf: dict[str, Any] | None = None) -> ModelConfig:
    """The ModelConfig of a transformers AlignModel directory: its ``config.json`` (or ``hf``, already read)
    with the pixel scaling of its ``preprocessor_config.json``, when there is one."""
    p = Path(path)
    if hf is None:
        hf = read_annotation_json(p / "config.json")
    pre_path = p / "preprocessor_config.json"
    pre = read_annotation_json(pre_path) if pre_path.is_file() else None
    return hf_config_to_model_config(hf, pre)


def load_hf_align(
    path: str | Path, model_class: Callable[[ModelConfig], M], map_location: str | torch.device = "cpu"
) -> M:
    """``model_class`` (a dual encoder) built from a transformers AlignModel directory's config, with its weights,
    in eval mode."""
    p = Path(path)
    cfg = hf_model_config(p)
    model = model_class(cfg)
    state = hf_state_to_ours(_read_hf_weights(p), cfg)
    check_fits(p, model.state_dict(), state)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Batch-norm step counters are not saved by every transformers version; they are unused in eval.
    missing = [k for k in missing if not k.endswith("num_batches_tracked")]
    if missing or unexpected:
        raise ConfigError(
            f"{path}: checkpoint does not fit its config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return model.to(map_location).eval()


# -------------------------------------------------------------------------------------------- export


def depthwise_padding_for(cfg: ModelConfig) -> tuple[list[int], bool]:
    """Which blocks transformers must pad symmetrically to reproduce TF SAME at ``cfg.image_size``,
    and whether the stem can be reproduced at all (transformers always pads it right/bottom by 1)."""
    im = cfg.image
    size = cfg.image_size
    stem_exact = same_padding(size, 3, 2) == (0, 1)
    size = -(-size // 2)
    symmetric, idx = [], 0
    for repeats, stride in zip(im.num_repeats, im.strides, strict=True):
        for j in range(round_repeats(repeats, im.depth_coefficient)):
            if j == 0 and stride == 2:
                if size % 2 == 1:
                    symmetric.append(idx)
                size = -(-size // 2)
            idx += 1
    return symmetric, stem_exact


def model_blocks(cfg: ModelConfig) -> list[bool]:
    """For each block: whether it starts a stage at stride 1 with equal input and output widths."""
    im = cfg.image
    flags = []
    for repeats, cin, cout, stride in zip(im.num_repeats, im.in_channels, im.out_channels, im.strides, strict=True):
        same = round_filters(cin, im.width_coefficient, im.depth_divisor) == round_filters(
            cout, im.width_coefficient, im.depth_divisor
        )
        n = round_repeats(repeats, im.depth_coefficient)
        flags += [stride == 1 and same] + [False] * (n - 1)
    return flags


def model_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    im, tx = cfg.image, cfg.text
    if im.family != "efficientnet":
        raise ConfigError(
            f"transformers' AlignVision is an EfficientNet; an image.family {im.family} model cannot be exported"
        )
    width = round_filters(im.out_channels[-1], im.width_coefficient, im.depth_divisor)
    if width != cfg.embed_dim:
        raise ConfigError(
            f"transformers' AlignModel has no image projection, so only models whose image features "
            f"({width}-d) equal embed_dim ({cfg.embed_dim}) can be exported (e.g. b7-*, or set embed_dim={width})"
        )
    if im.stem_channels != 32:
        raise ConfigError("transformers' AlignVision fixes the stem at 32 channels before scaling")
    if tx.pooling != "cls":
        raise ConfigError(
            "transformers' AlignModel takes the [CLS] vector as the text feature; text.pooling must be cls"
        )
    if im.padding == "symmetric":
        raise ConfigError(
            "transformers' AlignVision pads its stem convolution on the right and bottom only, "
            "so a model with image.padding symmetric cannot be exported"
        )
    first_residual = [i for i, b in enumerate(model_blocks(cfg)) if b]
    if first_residual and im.padding != "hf":
        raise ConfigError(
            f"block {first_residual[0]} starts a stage with equal input and output widths, so it has a residual "
            "connection that transformers' AlignVision cannot express"
        )
    if im.padding == "hf":
        dw_padding, stem_exact = list(im.hf_depthwise_padding), True
    else:
        dw_padding, stem_exact = depthwise_padding_for(cfg)
        if not stem_exact:
            warnings.warn(
                f"at {cfg.image_size} px transformers pads the stem convolution differently from TF SAME; "
                "the exported model's image embeddings will differ slightly from this model's "
                "(even image sizes are exact)",
                stacklevel=3,
            )
    vision = {
        "model_type": "align_vision_model",
        "num_channels": 3,
        "image_size": cfg.image_size,
        "width_coefficient": im.width_coefficient,
        "depth_coefficient": im.depth_coefficient,
        "depth_divisor": im.depth_divisor,
        "kernel_sizes": list(im.kernel_sizes),
        "in_channels": list(im.in_channels),
        "out_channels": list(im.out_channels),
        "depthwise_padding": dw_padding,
        "strides": list(im.strides),
        "num_block_repeats": list(im.num_repeats),
        "expand_ratios": list(im.expand_ratios),
        "squeeze_expansion_ratio": im.se_ratio,
        "hidden_act": "swish",
        "hidden_dim": max(2560, cfg.image_size),  # only the pooling window; must cover the feature map
        "pooling_type": "mean",
        "batch_norm_eps": im.bn_eps,
        "batch_norm_momentum": im.bn_momentum,
        "drop_connect_rate": im.drop_connect_rate,
    }
    text = {
        "model_type": "align_text_model",
        "vocab_size": tx.vocab_size,
        "hidden_size": tx.hidden_size,
        "num_hidden_layers": tx.num_layers,
        "num_attention_heads": tx.num_heads,
        "intermediate_size": tx.ffn_size,
        "hidden_act": "gelu",
        "hidden_dropout_prob": tx.hidden_dropout,
        "attention_probs_dropout_prob": tx.attention_dropout,
        "max_position_embeddings": tx.max_position_embeddings,
        "type_vocab_size": tx.type_vocab_size,
        "layer_norm_eps": tx.layer_norm_eps,
        "pad_token_id": tx.pad_token_id,
    }
    return {
        "architectures": ["AlignModel"],
        "model_type": "align",
        "projection_dim": cfg.embed_dim,
        "temperature_init_value": cfg.temperature_init,
        "text_config": text,
        "vision_config": vision,
    }


def _preprocessor_for(cfg: ModelConfig) -> dict[str, Any]:
    """An EfficientNetImageProcessor config that reproduces our pixel normalisation."""
    mean, std = list(cfg.pixel_mean), list(cfg.pixel_std)
    out: dict[str, Any] = {
        "image_processor_type": "EfficientNetImageProcessor",
        "do_resize": True,
        "size": {"height": round(cfg.image_size * 346 / 289), "width": round(cfg.image_size * 346 / 289)},
        "do_center_crop": True,
        "crop_size": {"height": cfg.image_size, "width": cfg.image_size},
        "do_rescale": True,
        "include_top": False,
        "resample": 3,
    }
    if mean == [0.5] * 3 and std == [0.5] * 3:
        out.update(rescale_factor=1 / 127.5, rescale_offset=True, do_normalize=False)
    else:
        out.update(rescale_factor=1 / 255, rescale_offset=False, do_normalize=True, image_mean=mean, image_std=std)
    return out


def export_hf_align(model: Exportable, path: str | Path, tokenizer_dir: str | Path | None = None) -> Path:
    """Write ``model`` as a transformers AlignModel directory (config, safetensors, preprocessor)."""
    cfg = model.config
    hf_config = model_config_to_hf(cfg)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name == "temperature_param":
            state["temperature"] = model.temperature.detach().clone()
            continue
        m = re.match(r"text\.layers\.(\d+)\.qkv\.(weight|bias)$", name)
        if m:
            for part, chunk in zip(("query", "key", "value"), tensor.chunk(3), strict=True):
                state[f"text_model.encoder.layer.{m.group(1)}.attention.self.{part}.{m.group(2)}"] = chunk
            continue
        hf_name = _rename(name, _REVERSE_RULES)
        if hf_name is None:
            raise ConfigError(f"parameter {name!r} has no transformers counterpart")
        state[hf_name] = tensor
    # transformers builds BERT's pooler; ALIGN never uses it, so it is written as zeros, not left random.
    h = cfg.text.hidden_size
    state["text_model.pooler.dense.weight"] = torch.zeros(h, h)
    state["text_model.pooler.dense.bias"] = torch.zeros(h)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in state.items()},
        str(out / "model.safetensors"),
        {"format": "pt"},
    )
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(_preprocessor_for(cfg), indent=2) + "\n")
    if tokenizer_dir is not None:
        from openalign.data.sources import TOKENIZER_CONFIG
        from openalign.text import load_tokenizer

        tok = load_tokenizer(tokenizer_dir)
        tok.save(out)
        # Keep the vocabulary's own casing (a cased multilingual vocabulary must stay cased in transformers).
        tok_cfg_path = out / TOKENIZER_CONFIG
        tok_cfg = json.loads(tok_cfg_path.read_text())
        tok_cfg.update(tokenizer_class="BertTokenizer", model_max_length=cfg.text.max_length)
        tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return out
