"""An openalign checkpoint directory: ``config.json`` (a format marker, the architecture and the model's config)
beside ``model.safetensors``, written and read whatever the model; and a dual encoder loaded from one, or from a
transformers AlignModel directory, as the class it is given. ``DualEncoder.save_pretrained`` and
``from_pretrained`` go through here, as ``model/io.py`` does for every architecture.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from safetensors.torch import save_file
from torch import nn

from openalign.config import ConfigError, ModelConfig, model_config, to_dict
from openalign.model.weights import check_fits, read_safetensors

FORMAT = "openalign"
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
Architecture = Literal["dual_encoder", "copy_detector"]
ARCHITECTURES: tuple[Architecture, ...] = ("dual_encoder", "copy_detector")
# The layout copy detectors were first saved in: {"format": LEGACY_DETECTOR_FORMAT, "detector": {...}}.
LEGACY_DETECTOR_FORMAT = "openalign-copy-detector"


M = TypeVar("M", bound=nn.Module)


def save_checkpoint(
    path: str | Path,
    kind: Architecture,
    config: Any,
    state: dict[str, torch.Tensor],
    train: dict[str, Any] | None = None,
) -> Path:
    """A model of architecture ``kind`` (its config dataclass and state dict) as a checkpoint directory ``path``;
    ``train``: the statistics of its training run, where kept (a copy detector's)."""
    meta: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "architecture": kind,
        "model": to_dict(config),
    }
    if train is not None:
        meta["train"] = train
    return write_checkpoint(path, state, meta)


def write_checkpoint(path: str | Path, state: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """The weights (written to a temporary file, then renamed) and ``config.json`` in directory ``path``."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    tmp = out / f"{WEIGHTS}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS)
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def read_config(path: str | Path) -> dict[str, Any]:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{path}: no config.json (expected an openalign or transformers AlignModel dir)")
    from openalign.data.sources import read_annotation_json

    config = read_annotation_json(cfg_path)
    if not isinstance(config, dict):
        raise ValueError(f"{cfg_path}: a model config is a JSON object")
    return config


def architecture(meta: dict[str, Any], path: str | Path) -> tuple[Architecture, dict[str, Any]]:
    """(architecture, model config mapping) of an openalign checkpoint's ``config.json``."""
    if meta.get("format") == LEGACY_DETECTOR_FORMAT:
        return "copy_detector", dict(meta.get("detector") or {})
    if meta.get("format") != FORMAT:
        raise ConfigError(
            f"{path}/config.json is neither an openalign checkpoint nor a transformers AlignModel "
            f"(format={meta.get('format')!r}, model_type={meta.get('model_type')!r})"
        )
    if meta.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
        raise ConfigError(f"{path}/config.json: unsupported format_version {meta.get('format_version')!r}")
    kind = meta.get("architecture", "dual_encoder")
    if kind not in ARCHITECTURES:
        raise ConfigError(f"{path}/config.json: unknown architecture {kind!r} (known: {', '.join(ARCHITECTURES)})")
    return kind, dict(meta.get("model") or {})


def checkpoint_kind(
    meta: dict[str, Any], path: str | Path, expect: Architecture | None = None
) -> tuple[Architecture, dict[str, Any]]:
    """(architecture, model config mapping) of the checkpoint directory ``path`` whose ``config.json`` is
    ``meta``; a transformers AlignModel directory holds a dual encoder (its mapping empty: its config is
    transformers'). With ``expect``, another architecture is a one-line ConfigError."""
    if meta.get("model_type") == "align":
        kind: Architecture = "dual_encoder"
        config: dict[str, Any] = {}
    else:
        kind, config = architecture(meta, path)
    if expect is not None and kind != expect:
        names = {"dual_encoder": "an ALIGN dual encoder", "copy_detector": "a copy detector"}
        raise ConfigError(f"{path} holds {names[kind]}, not {names[expect]}")
    return kind, config


def read_weights(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    weights = Path(path) / WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"{path}: no {WEIGHTS}")
    return read_safetensors(weights, map_location)


def load_weights(model: M, path: str | Path, map_location: str | torch.device = "cpu") -> M:
    """``model`` with the weights of the checkpoint directory ``path``, which must fit it exactly, in eval mode."""
    state = read_weights(path, map_location)
    check_fits(Path(path) / WEIGHTS, model.state_dict(), state)
    model.load_state_dict(state, strict=True)
    return model.eval()


def load_dual_encoder(
    path: str | Path,
    model_class: Callable[[ModelConfig], M],
    map_location: str | torch.device = "cpu",
    meta: dict[str, Any] | None = None,
) -> M:
    """The dual encoder of an openalign checkpoint directory or a transformers AlignModel directory, built by
    ``model_class`` from its config and holding its weights, in eval mode; ``meta``: its ``config.json``, when
    already read. A directory of another architecture is a one-line ConfigError before any weight is read."""
    meta = read_config(path) if meta is None else meta
    _, config = checkpoint_kind(meta, path, expect="dual_encoder")
    if meta.get("model_type") == "align":
        from openalign.model.hf import load_hf_align

        return load_hf_align(path, model_class, map_location)
    cfg: ModelConfig = model_config(config)
    return load_weights(model_class(cfg), path, map_location)
