"""openalign: ALIGN image–text dual encoders (Jia et al., ICML 2021) from noisy alt-text to search.

The names below load on first use (PEP 562), so ``import openalign`` and ``openalign --help`` do not pay
for torch until a model is actually needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "DualEncoder": "openalign.model",
    "ModelConfig": "openalign.config",
    "create_model": "openalign.model",
    "create_model_and_transforms": "openalign.model.pretrained",
    "get_tokenizer": "openalign.model.pretrained",
    "list_presets": "openalign.config",
    "load_model": "openalign.model.io",
    "load_tokenizer": "openalign.text",
    "model_config": "openalign.config",
    "save_model": "openalign.model.io",
}

__all__ = [
    "DualEncoder",
    "ModelConfig",
    "__version__",
    "create_model",
    "create_model_and_transforms",
    "get_tokenizer",
    "list_presets",
    "load_model",
    "load_tokenizer",
    "model_config",
    "save_model",
]

if TYPE_CHECKING:
    from openalign.config import ModelConfig, list_presets, model_config
    from openalign.model import DualEncoder, create_model
    from openalign.model.io import load_model, save_model
    from openalign.model.pretrained import create_model_and_transforms, get_tokenizer
    from openalign.text import load_tokenizer


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'openalign' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
