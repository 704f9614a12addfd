"""Training: the loop, distributed setup, gradient caching, checkpoints and resume, the input stream, logging.

from openalign.train import load_train_config, train
result = train(load_train_config("nano_cpu", {"train.run_dir": "runs/nano"}), resume="latest")
model = openalign.load_model(result.final_dir)
"""

from openalign.train.config import TrainConfig, list_recipes, load_train_config
from openalign.train.loop import NonFiniteError, OutOfMemoryError, TrainResult, train

__all__ = [
    "NonFiniteError",
    "OutOfMemoryError",
    "TrainConfig",
    "TrainResult",
    "list_recipes",
    "load_train_config",
    "train",
]
