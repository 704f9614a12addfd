"""What ``openalign bench train`` sets up: its settings, the model they select, and our input stream.

The bare step (``bench/train.py``) and the real loop (``bench/recipe.py``) both train this model on this stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from openalign.bench.model import BenchSettings, bench_config

if TYPE_CHECKING:
    from openalign.config import ModelConfig
    from openalign.text.tokenizer import TextTokenizer
    from openalign.train.data import TrainStream


@dataclass
class TrainBenchSettings:
    """What ``openalign bench train`` measures."""

    preset: str = "nano"  # model preset
    image_size: int | None = None  # square crop size (default: the preset's)
    # Ghost batch norm: groups of this many samples in our image tower, bare step and loop alike (the recipes' 16).
    virtual_batch_size: int | None = None
    batch_size: int = 256  # pairs per step (the nano_cpu recipe's batch)
    steps: int = 5  # timed steps per round
    warmup: int = 2  # untimed steps per round
    rounds: int = 2  # alternating rounds; the best round counts
    workers: int = 2  # DataLoader workers feeding each contender
    device: str = "cpu"  # cpu or cuda
    bf16: bool = False  # bf16 autocast (GPU)
    # torch.compile: our towers as training compiles them (train.compile), the loop too; transformers' whole model.
    compile: bool = False
    decode: Literal["cpu", "cuda"] = "cpu"  # where our stream decodes JPEGs (data.decode; cuda needs torchvision)
    # data.pin_memory of our stream: batches assembled ahead, page-locked on CUDA (None: as `openalign train` sets it)
    pin_memory: bool | None = None
    shard_samples: int = 512  # synthetic pairs written once and cycled through
    # Longer side of the shards' JPEGs, 4:3 (img2dataset writes 256 border-resized, 384–1024 keep-ratio);
    # None: square at 1.25× the pre-crop size.
    source_side: int | None = None
    pipeline_samples: int = 1024  # samples timed for the input-pipeline figure
    baseline: bool = True  # also run the transformers loop and webdataset (--no-baseline: only ours)
    training: bool = True  # time the training steps (--no-training: only the input pipeline)
    # Also time the real loop (`openalign train`: guard, schedule, logging) on the same model, batch and shards;
    # compiled, in the bare step's process after it, on the graphs the bare step compiled.
    recipe: bool = False
    bare: bool = True  # time the bare step (--no-bare with --recipe: only the loop)
    grad_clip: float | None = None  # --recipe: the loop clips the gradient norm to this (None: no clipping, the paper)
    json_path: str | None = None  # also write the results to this JSON file
    # Also write each contender's per-op profile and host synchronisations of a step here (openalign.bench.profile).
    profile: str | None = None

    def validate(self) -> None:
        for name in ("batch_size", "steps", "rounds", "shard_samples", "pipeline_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.source_side is not None and self.source_side < 16:
            raise ValueError(f"--source-side must be at least 16 pixels, got {self.source_side}")
        if self.warmup < 0 or self.workers < 0:
            raise ValueError("--warmup and --workers must not be negative")
        if self.decode == "cuda" and self.device != "cuda":
            raise ValueError("--decode cuda decodes on the GPU: it needs --device cuda")
        if self.virtual_batch_size is not None and self.virtual_batch_size < 1:
            raise ValueError(f"--virtual-batch-size must be at least 1, got {self.virtual_batch_size}")
        if not self.bare and not self.recipe:
            raise ValueError("--no-bare times only the loop: it needs --recipe")
        if self.grad_clip is not None and not 0 < self.grad_clip < float("inf"):
            raise ValueError(f"--grad-clip must be positive and finite, got {self.grad_clip}")


def _model_settings(s: TrainBenchSettings) -> BenchSettings:
    return BenchSettings(preset=s.preset, image_size=s.image_size, batch_size=s.batch_size, device=s.device)


def model_cfg(s: TrainBenchSettings) -> ModelConfig:
    """Our model's config: ``bench model``'s for the preset, with ghost batch norm when asked for."""
    from openalign.config import model_config

    cfg: ModelConfig = bench_config(_model_settings(s))
    if s.virtual_batch_size is None:
        return cfg
    return model_config(cfg, image={"batch_norm": "virtual", "virtual_batch_size": s.virtual_batch_size})


def shard_stream(
    s: TrainBenchSettings, shards: str, tokenizer: TextTokenizer, cfg: ModelConfig, workers: int
) -> TrainStream:
    """Our training stream over ``shards``, as `openalign train` builds it for the model and device."""
    from openalign.train.data import DataConfig, build_train_stream, pin_batches

    data = DataConfig(
        shards=shards,
        batch_size=s.batch_size,
        workers=workers,
        max_text_length=cfg.text.max_length,
        decode=s.decode,
        pin_memory=s.pin_memory,
    )
    data.pin_memory = pin_batches(data, s.device, cfg)  # unset: as `openalign train` sets it for the device
    return build_train_stream(data, tokenizer, seed=0, model_config=cfg)
