"""Model towers, the dual encoder, the copy detector, and checkpoint I/O (openalign and transformers formats)."""

from __future__ import annotations

from typing import Any

from openalign.config import ModelConfig, model_config
from openalign.model.copy_detector import CopyDetector, CopyDetectorConfig
from openalign.model.dual_encoder import DualEncoder


def create_model(preset_or_config: str | dict[str, Any] | ModelConfig, **overrides: Any) -> DualEncoder:
    """A randomly initialised dual encoder from a preset name (see ``list_presets``) or a config."""
    return DualEncoder(model_config(preset_or_config, **overrides))


__all__ = ["CopyDetector", "CopyDetectorConfig", "DualEncoder", "create_model"]
