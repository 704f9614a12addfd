"""openalign: ALIGN image–text dual encoders (Jia et al., ICML 2021) from noisy alt-text to search."""

from openalign.config import ModelConfig, list_presets, model_config
from openalign.model import DualEncoder, create_model
from openalign.model.io import load_model, save_model
from openalign.text import load_tokenizer

__version__ = "0.1.0"

__all__ = [
    "DualEncoder",
    "ModelConfig",
    "__version__",
    "create_model",
    "list_presets",
    "load_model",
    "load_tokenizer",
    "model_config",
    "save_model",
]
