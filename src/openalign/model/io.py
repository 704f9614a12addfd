"""Saving and loading models: openalign directories and transformers AlignModel directories.

An openalign checkpoint is a directory with ``config.json`` (a format marker, the architecture and the model's
config) and ``model.safetensors``; a tokenizer saved beside a dual encoder travels with it. Every openalign
model saves and loads through the same two helpers here, whatever its architecture:

- ``dual_encoder``: the ALIGN image–text model (``load_model``); checkpoints without an ``architecture`` key
  are dual encoders;
- ``copy_detector``: the image embedding model that finds near-duplicates of test images
  (``load_copy_detector``), with the statistics of its training run under ``train``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file

from openalign.config import ConfigError, ModelConfig, from_dict, model_config, to_dict
from openalign.model.copy_detector import CopyDetector, CopyDetectorConfig
from openalign.model.dual_encoder import DualEncoder

FORMAT = "openalign"
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
Architecture = Literal["dual_encoder", "copy_detector"]
ARCHITECTURES: tuple[Architecture, ...] = ("dual_encoder", "copy_detector")
# The layout copy detectors were first saved in: {"format": LEGACY_DETECTOR_FORMAT, "detector": {...}}.
LEGACY_DETECTOR_FORMAT = "openalign-copy-detector"


def save_model(model: DualEncoder | CopyDetector, path: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` to directory ``path`` (created if missing)."""
    kind: Architecture = "copy_detector" if isinstance(model, CopyDetector) else "dual_encoder"
    meta: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "architecture": kind,
        "model": to_dict(model.config),
    }
    if isinstance(model, CopyDetector):
        meta["train"] = {k: v for k, v in model.train_stats.items() if k != "losses"}
    return write_checkpoint(path, model.state_dict(), meta)


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


def read_safetensors(file: str | Path, map_location: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file; a truncated or corrupt one is a one-line ConfigError naming it."""
    try:
        return load_file(str(file), device=str(map_location))
    except OSError:
        raise
    except Exception as err:  # safetensors' SafetensorError (a cut-off file, a bad header) and its kin
        text = " ".join(str(err).split()).split(". ")[0].rstrip(".") or type(err).__name__
        raise ConfigError(f"{file}: truncated or corrupt safetensors file ({text[:160]})") from None


def read_weights(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    weights = Path(path) / WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"{path}: no {WEIGHTS}")
    return read_safetensors(weights, map_location)


def check_fits(where: str | Path, expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> None:
    """A one-line ConfigError when ``given`` cannot load into a model whose state is ``expected``: the first
    mismatching tensor (name, checkpoint shape vs model shape) and how many tensors do not fit."""
    problems = mismatches(expected, given)
    if problems:
        more = f"; {len(problems)} tensors do not fit" if len(problems) > 1 else ""
        raise ConfigError(f"{where} does not fit the model its config describes: {problems[0]}{more}")


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", *, expect: Architecture | None = None
) -> DualEncoder | CopyDetector:
    """Any openalign model directory (or a transformers AlignModel directory), in eval mode; with ``expect``, a
    checkpoint of another architecture is a one-line ConfigError before any weight is read."""
    meta = read_config(path)
    if meta.get("model_type") == "align":
        kind: Architecture = "dual_encoder"
        config: dict[str, Any] = {}
    else:
        kind, config = architecture(meta, path)
    if expect is not None and kind != expect:
        names = {"dual_encoder": "an ALIGN dual encoder", "copy_detector": "a copy detector"}
        raise ConfigError(f"{path} holds {names[kind]}, not {names[expect]}")
    if meta.get("model_type") == "align":
        from openalign.model.hf import load_hf_align

        return load_hf_align(path, map_location=map_location)
    model: DualEncoder | CopyDetector
    if kind == "copy_detector":
        model = CopyDetector(from_dict(CopyDetectorConfig, config, "copy_detector"))
        model.train_stats = dict(meta.get("train") or {})
    else:
        cfg: ModelConfig = model_config(config)
        model = DualEncoder(cfg)
    state = read_weights(path, map_location)
    check_fits(Path(path) / WEIGHTS, model.state_dict(), state)
    model.load_state_dict(state, strict=True)
    return model.eval()


def mismatches(expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> list[str]:
    """Everything that keeps ``given`` from loading into a model whose state is ``expected`` (names in order)."""
    found = []
    for name, tensor in expected.items():
        if name not in given:
            if name.endswith("num_batches_tracked"):
                continue  # not saved by every transformers version; unused in eval
            found.append(f"{name} is missing")
        elif tuple(given[name].shape) != tuple(tensor.shape):
            found.append(f"{name} has shape {list(given[name].shape)}, the model expects {list(tensor.shape)}")
    found += [f"{name} is not a parameter of the model" for name in given if name not in expected]
    return found


def first_mismatch(expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> str | None:
    """What first keeps ``given`` from loading into a model whose state is ``expected`` (names in order), or None."""
    found = mismatches(expected, given)
    return found[0] if found else None


def load_model(path: str | Path, map_location: str | torch.device = "cpu") -> DualEncoder:
    """Load an openalign checkpoint directory or a transformers AlignModel directory, in eval mode."""
    model = load_checkpoint(path, map_location, expect="dual_encoder")
    assert isinstance(model, DualEncoder)
    return model


def load_copy_detector(path: str | Path, map_location: str | torch.device = "cpu") -> CopyDetector:
    """A copy detector directory (``openalign copy-detector train``), in eval mode."""
    model = load_checkpoint(path, map_location, expect="copy_detector")
    assert isinstance(model, CopyDetector)
    return model
