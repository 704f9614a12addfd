"""Saving and loading models: openalign directories and transformers AlignModel directories.

An openalign checkpoint is a directory with ``config.json`` (a format marker, the architecture and the model's
config) and ``model.safetensors`` (the format, and reading and writing it, in ``model/checkpoint_dir.py``); a
tokenizer saved beside a dual encoder travels with it. Every openalign model saves and loads through the same two
helpers here, whatever its architecture:

- ``dual_encoder``: the ALIGN image–text model (``load_model``); checkpoints without an ``architecture`` key
  are dual encoders;
- ``copy_detector``: the image embedding model that finds near-duplicates of test images
  (``load_copy_detector``), with the statistics of its training run under ``train``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from openalign.config import from_dict
from openalign.model.checkpoint_dir import (
    ARCHITECTURES,
    FORMAT,
    FORMAT_VERSION,
    LEGACY_DETECTOR_FORMAT,
    WEIGHTS,
    Architecture,
    architecture,
    checkpoint_kind,
    load_dual_encoder,
    load_weights,
    read_config,
    read_weights,
    save_checkpoint,
    write_checkpoint,
)
from openalign.model.copy_detector import CopyDetector, CopyDetectorConfig
from openalign.model.dual_encoder import DualEncoder
from openalign.model.weights import check_fits, first_mismatch, mismatches, read_safetensors

# The format's names and helpers (``checkpoint_dir``, ``weights``) are this module's public names too.
__all__ = [
    "ARCHITECTURES",
    "FORMAT",
    "FORMAT_VERSION",
    "LEGACY_DETECTOR_FORMAT",
    "WEIGHTS",
    "Architecture",
    "architecture",
    "check_fits",
    "checkpoint_kind",
    "first_mismatch",
    "load_checkpoint",
    "load_copy_detector",
    "load_model",
    "mismatches",
    "read_config",
    "read_safetensors",
    "read_weights",
    "save_model",
    "write_checkpoint",
]


def save_model(model: DualEncoder | CopyDetector, path: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` to directory ``path`` (created if missing)."""
    if isinstance(model, CopyDetector):
        train = {k: v for k, v in model.train_stats.items() if k != "losses"}
        return save_checkpoint(path, "copy_detector", model.config, model.state_dict(), train)
    return save_checkpoint(path, "dual_encoder", model.config, model.state_dict())


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", *, expect: Architecture | None = None
) -> DualEncoder | CopyDetector:
    """Any openalign model directory (or a transformers AlignModel directory), in eval mode; with ``expect``, a
    checkpoint of another architecture is a one-line ConfigError before any weight is read."""
    meta = read_config(path)
    kind, config = checkpoint_kind(meta, path, expect)
    if kind == "dual_encoder":
        return load_dual_encoder(path, DualEncoder, map_location, meta)
    detector = CopyDetector(from_dict(CopyDetectorConfig, config, "copy_detector"))
    detector.train_stats = dict(meta.get("train") or {})
    return load_weights(detector, path, map_location)


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
