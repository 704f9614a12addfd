"""Saving and loading dual encoders: openalign directories and transformers AlignModel directories.

An openalign checkpoint is a directory with ``config.json`` (the ModelConfig plus a format marker)
and ``model.safetensors``; a tokenizer saved beside it travels with the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from openalign.config import ConfigError, ModelConfig, model_config, to_dict
from openalign.model.dual_encoder import DualEncoder

FORMAT = "openalign"
FORMAT_VERSION = 1


def save_model(model: DualEncoder, path: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` to directory ``path`` (created if missing)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": to_dict(model.config)}
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def read_config(path: str | Path) -> dict[str, Any]:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{path}: no config.json (expected an openalign or transformers AlignModel dir)")
    config: dict[str, Any] = json.loads(cfg_path.read_text())
    return config


def load_model(path: str | Path, map_location: str | torch.device = "cpu") -> DualEncoder:
    """Load an openalign checkpoint directory or a transformers AlignModel directory, in eval mode."""
    meta = read_config(path)
    if meta.get("model_type") == "align":
        from openalign.model.hf import load_hf_align

        return load_hf_align(path, map_location=map_location)
    if meta.get("format") != FORMAT:
        raise ConfigError(
            f"{path}/config.json is neither an openalign checkpoint nor a transformers AlignModel "
            f"(model_type={meta.get('model_type')!r})"
        )
    cfg: ModelConfig = model_config(meta["model"])
    model = DualEncoder(cfg)
    state = load_file(str(Path(path) / "model.safetensors"), device=str(map_location))
    model.load_state_dict(state, strict=True)
    return model.eval()
