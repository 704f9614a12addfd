"""The training configuration: one YAML file with sections model / data / optim / train / log / eval.

Loading is strict (``openalign.config.from_dict``): a misspelt key anywhere is an error naming it and the
valid keys. ``--section.key value`` command-line overrides go through the same check, their values parsed
as YAML scalars (``--train.grad_clip 1.0``, ``--model.image.batch_norm virtual``, ``--data.shards null``).
The recipes of the paper ship with the package: ``openalign train --config pretrain_align`` finds
``openalign/configs/pretrain_align.yaml`` (see ``list_recipes``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, cast

import yaml

from openalign.config import (
    ConfigError,
    ModelConfig,
    from_dict,
    load_yaml,
    merge,
    model_config,
    parse_yaml,
    to_dict,
)
from openalign.hardware import cpu_has_amx, cuda_compile_blocker, cuda_computes_bfloat16
from openalign.optim import OptimConfig
from openalign.train.data import DataConfig
from openalign.train.logging import LogConfig

__all__ = [
    "EvalConfig",
    "LoopConfig",
    "ModelSection",
    "TrainConfig",
    "check_compile",
    "compile_enabled",
    "list_recipes",
    "load_train_config",
    "parse_overrides",
    "sharded",
]


@dataclass
class ModelSection:
    """Which dual encoder to train. Every other key of the YAML section overrides a ModelConfig field
    (``image: {batch_norm: virtual}``, ``embed_dim: 320``) and is checked against ModelConfig."""

    preset: str = "nano"  # see openalign.list_presets(); ignored for the architecture when init is set
    init: str | None = None  # start from this checkpoint: an openalign model dir or a transformers AlignModel dir
    init_image: str | None = None  # the image tower (and its projection) from this openalign/transformers dir
    init_text: str | None = None  # the text tower (and its projection) from this openalign/transformers dir
    lock_image: bool = False  # LiT: image tower frozen (no gradients, no optimizer state, batch norm in eval mode)
    lock_text: bool = False  # text tower frozen the same way
    overrides: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields, nested

    def resolve(self, vocab_size: int | None = None) -> ModelConfig:
        """The ModelConfig to build; a known tokenizer size replaces a fresh model's vocab_size."""
        if self.init is not None:
            from openalign.model.checkpoint_dir import read_config

            meta = read_config(self.init)
            if meta.get("model_type") == "align":
                from openalign.model.dual_encoder import DualEncoder
                from openalign.model.hf import load_hf_align

                base: Any = load_hf_align(self.init, DualEncoder).config
            else:
                base = meta.get("model", {})
        else:
            base = self.preset
        extra = dict(self.overrides)
        text = extra.get("text")
        if not isinstance(text, dict):
            text = {}
        if vocab_size is not None and self.init is None and "vocab_size" not in text:
            extra = merge(extra, {"text.vocab_size": vocab_size})
        return model_config(base, **extra)


@dataclass
class LoopConfig:
    """How steps are taken: batch, precision, parallelism, guards and checkpoints."""

    run_dir: str = "runs/align"  # metrics, checkpoints/ and final/ go here
    batch_size: int | None = None  # global batch (all ranks); None = data.batch_size × world size. Paper 16384
    chunk_size: int | None = None  # per-rank rows per forward with gradient caching; None = no caching
    steps: int | None = None  # stop after this step; None = optim.total_steps (the schedule's horizon)
    label_smoothing: float = 0.1  # the paper's 0.1
    negatives_fraction: float = 1.0  # in-batch negatives used (the paper's ablation: 0.5, 0.25)
    # rows of the loss scored at a time, their logits recomputed in backward: its memory then grows with this,
    # not with the global batch squared (0: all rows at once)
    loss_block_rows: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # bf16: autocast over both towers; bf16-image: over the image tower only. auto: bf16 on a GPU that computes in
    # it (Ampere on); on a CPU with AMX, bf16-image when the image tower is the convolutional stack; else fp32
    # (resolve_precision says why).
    precision: Literal["auto", "fp32", "bf16", "bf16-image"] = "auto"
    strategy: Literal["ddp", "fsdp"] = "ddp"  # with several processes; fsdp (FSDP2) for models beyond one device
    # torch.compile each tower as one graph; None = on CUDA, eager on a CPU, under fsdp across ranks (its hooks)
    # and on a GPU Triton cannot compile for (compute capability below 7.0, or no triton package)
    compile: bool | None = None
    grad_checkpointing: bool = False  # recompute block activations in backward (memory for compute)
    grad_clip: float | None = None  # clip the global gradient norm to this; None = no clipping (paper)
    max_bad_steps: int = 10  # abort after this many consecutive non-finite steps (each one is skipped)
    checkpoint_every: int = 1000  # steps between checkpoints; 0 = only by time and at the end
    checkpoint_minutes: float = 30.0  # also checkpoint when this much time passed since the last; 0 = off
    keep_checkpoints: int = 3  # newest checkpoints kept; 0 = keep all
    seed: int = 0  # weights, dropout and (unless data.seed is set) data order
    threads: int | None = None  # torch CPU threads per process; None = PyTorch's default


@dataclass
class EvalConfig:
    """Zero-shot retrieval on a held-out set while training (R@1/5/10 both ways in the metrics)."""

    every: int = 0  # steps between evaluations; 0 = never
    source: Literal["synthetic", "karpathy"] = "synthetic"
    images: int = 200  # synthetic: held-out images (5 captions each); karpathy: at most this many images
    captions_per_image: int = 5
    karpathy: str = ""  # karpathy: dataset_*.json (Flickr30K / MSCOCO splits file)
    image_root: str = ""  # karpathy: directory the json's filepath/filename are relative to
    split: str = "test"
    batch_size: int = 128


@dataclass
class TrainConfig:
    """A whole training run."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: LoopConfig = field(default_factory=LoopConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self) -> None:
        t = self.train
        if t.batch_size is not None and t.batch_size < 1:
            raise ConfigError(f"train.batch_size must be positive, got {t.batch_size}")
        if t.chunk_size is not None and t.chunk_size < 1:
            raise ConfigError(f"train.chunk_size must be positive, got {t.chunk_size}")
        if t.steps is not None and t.steps < 1:
            raise ConfigError(f"train.steps must be positive, got {t.steps}")
        if not 0 <= t.label_smoothing < 1:
            raise ConfigError(f"train.label_smoothing must be in [0, 1), got {t.label_smoothing}")
        if not 0 < t.negatives_fraction <= 1:
            raise ConfigError(f"train.negatives_fraction must be in (0, 1], got {t.negatives_fraction}")
        if t.loss_block_rows < 0:
            raise ConfigError(f"train.loss_block_rows must be 0 (all at once) or more, got {t.loss_block_rows}")
        if t.grad_clip is not None and not 0 < t.grad_clip < math.inf:
            raise ConfigError(f"train.grad_clip must be positive and finite, or null, got {t.grad_clip}")
        if t.max_bad_steps < 1:
            raise ConfigError(f"train.max_bad_steps must be at least 1, got {t.max_bad_steps}")
        if not 0 <= t.checkpoint_minutes < math.inf:
            raise ConfigError(f"train.checkpoint_minutes must be finite and not negative, got {t.checkpoint_minutes}")
        if t.checkpoint_every < 0 or t.keep_checkpoints < 0:
            raise ConfigError("train.checkpoint_every and keep_checkpoints must not be negative")
        if t.threads is not None and t.threads < 1:
            raise ConfigError(f"train.threads must be positive, got {t.threads}")
        e = self.eval
        if e.every < 0 or e.images < 1 or e.captions_per_image < 1 or e.batch_size < 1:
            raise ConfigError("eval.every must be ≥ 0 and eval.images, captions_per_image, batch_size ≥ 1")
        if e.every and e.source == "karpathy" and not e.karpathy:
            raise ConfigError("eval.karpathy must name a dataset_*.json when eval.source is 'karpathy'")
        self.data.validate()
        if self.data.decode == "cuda" and t.device == "cpu":
            raise ConfigError(
                "data.decode: cuda decodes on the training GPU, but train.device is cpu (use data.decode: cpu)"
            )

    def per_rank_batch(self, world_size: int) -> int:
        """The rows each rank draws per step; checks that the global batch splits evenly."""
        t = self.train
        if t.batch_size is None:
            per_rank = self.data.batch_size
        else:
            if t.batch_size % world_size:
                raise ConfigError(f"train.batch_size {t.batch_size} does not split evenly over {world_size} ranks")
            per_rank = t.batch_size // world_size
        if t.chunk_size is not None and per_rank % t.chunk_size:
            raise ConfigError(
                f"train.chunk_size {t.chunk_size} does not divide the per-rank batch {per_rank} "
                f"(global {per_rank * world_size} over {world_size} ranks)"
            )
        return per_rank

    @property
    def total_steps(self) -> int:
        return self.train.steps if self.train.steps is not None else self.optim.total_steps

    def to_dict(self) -> dict[str, Any]:
        out = to_dict(self)
        model = out["model"]
        section = {k: v for k, v in model.items() if k != "overrides"}
        out["model"] = {**section, **model["overrides"]}
        return out


def compile_enabled(cfg: TrainConfig, device: Any, world_size: int = 1, *, gpu_compiles: bool | None = None) -> bool:
    """Whether a run of ``cfg`` on ``device`` (a ``torch.device`` or its name: "cuda", "cuda:1", "cpu") across
    ``world_size`` processes compiles its towers: ``train.compile`` when set, else on CUDA only, and there not when
    FSDP2 shards the model or the GPU cannot be compiled for (``gpu_compiles``; None asks the device, through
    ``gpu_compile_blocker``); ``check_compile`` says why. On a CPU compiling costs minutes of C++ builds and gains
    little, so eager is the default there."""
    if cfg.train.compile is not None:
        return cfg.train.compile
    if _device_kind(device) != "cuda" or sharded(cfg, world_size):
        return False
    return gpu_compile_blocker(device) is None if gpu_compiles is None else gpu_compiles


def check_compile(cfg: TrainConfig, world_size: int, device: Any = None) -> None:
    """Raise ``ConfigError`` for a compiled run the towers' one-graph compilation cannot be: FSDP2 across ranks,
    or a GPU without a compiler (``gpu_compile_blocker``). FSDP2's hooks gather each block's shards before the
    block runs and free them after; Dynamo does not trace them, so a tower holding sharded blocks is no one graph
    (``fullgraph``) and its first step would fail."""
    if not cfg.train.compile:
        return
    if sharded(cfg, world_size):
        raise ConfigError(
            "train.compile true does not combine with train.strategy fsdp across processes (FSDP2's hooks around "
            "each block break the towers' one graph): set train.compile false (or leave it unset), or use ddp"
        )
    reason = gpu_compile_blocker(device)
    if reason is not None:
        raise ConfigError(f"train.compile true: {reason}; set train.compile false (or leave it unset)")


def gpu_compile_blocker(device: Any) -> str | None:
    """``hardware.cuda_compile_blocker`` for ``device`` (a ``torch.device`` or its name); None for a CPU, or where
    no CUDA device can be asked (a config checked on a machine without one)."""
    cuda = _cuda_device(device)
    return None if cuda is None else cuda_compile_blocker(cuda)


def sharded(cfg: TrainConfig, world_size: int) -> bool:
    """Whether a run of ``cfg`` across ``world_size`` processes shards its model with FSDP2."""
    return world_size > 1 and cfg.train.strategy == "fsdp"


def _device_kind(device: Any) -> str:
    """The kind ("cuda", "cpu") of a ``torch.device`` or of its name ("cuda:1")."""
    return str(getattr(device, "type", None) or str(device).partition(":")[0])


def _cuda_device(device: Any) -> Any:
    """``device`` (a ``torch.device`` or its name) as the ``torch.device`` of a GPU this process can ask about; None
    for a CPU, or where CUDA is not available (a config checked on a machine without a GPU)."""
    import torch

    if _device_kind(device) != "cuda" or not torch.cuda.is_available():
        return None
    return torch.device(device) if isinstance(device, str) else device


Precision = Literal["fp32", "bf16", "bf16-image"]


def resolve_precision(precision: str, device: Any, image_family: str, *, gpu_bf16: bool | None = None) -> Precision:
    """What ``train.precision`` computes in on ``device`` (a ``torch.device`` or its name) for an image tower of
    ``image_family``: the setting itself, or what ``auto`` stands for there.

    On a GPU that computes in bfloat16 (``gpu_bf16``; None asks the device, where CUDA is available) auto is
    bf16; on an older one (V100, T4: ``hardware.cuda_computes_bfloat16``) fp32, as bf16 would be emulated,
    slower, and its convolutions have no cuDNN kernels. On a CPU with AMX it is bf16 for the convolutional image
    tower alone: that tower's convolutions are faster in bf16 there, while the text tower's small matrix products
    and the EfficientNet tower's depthwise convolutions are slower. Without AMX, bf16 convolutions (their backward
    above all) are slower than fp32 too, so everywhere else auto is fp32."""
    if precision != "auto":
        return cast(Precision, precision)
    kind = _device_kind(device)
    if kind == "cuda":
        native = gpu_computes_bfloat16(device) if gpu_bf16 is None else gpu_bf16
        return "bf16" if native else "fp32"
    if kind == "cpu" and image_family == "convnet" and cpu_has_amx():
        return "bf16-image"
    return "fp32"


def gpu_computes_bfloat16(device: Any) -> bool:
    """``hardware.cuda_computes_bfloat16`` for ``device`` (a ``torch.device`` or its name); True for a CPU, or where
    no CUDA device can be asked (a config checked on a machine without one)."""
    cuda = _cuda_device(device)
    return True if cuda is None else cuda_computes_bfloat16(cuda)


# --------------------------------------------------------------------------------------------------
# Loading


def list_recipes() -> list[str]:
    """Names of the configs that ship with the package (``openalign/configs/*.yaml``)."""
    return sorted(p.name[:-5] for p in resources.files("openalign.configs").iterdir() if p.name.endswith(".yaml"))


def _resolve_path(config: str | Path) -> Path | Any:
    path = Path(config)
    if path.is_file():
        return path
    if path.suffix in ("", ".yaml") and path.parent == Path("."):
        packaged = resources.files("openalign.configs").joinpath(path.stem + ".yaml")
        if packaged.is_file():
            return packaged
    raise FileNotFoundError(f"{config}: no such config file, nor a packaged recipe ({', '.join(list_recipes())})")


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["--train.grad_clip", "1.0", "--model.image.batch_norm=virtual"]`` -> dotted keys with YAML values."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(items):
        item = items[i]
        if not item.startswith("--") or len(item) < 3:
            raise ConfigError(f"expected --section.key VALUE, got {item!r}")
        key, eq, value = item[2:].partition("=")
        if not eq:
            if i + 1 >= len(items) or items[i + 1].startswith("--"):
                raise ConfigError(f"--{key} needs a value")
            value = items[i + 1]
            i += 1
        if "." not in key:
            raise ConfigError(f"--{key}: overrides name a section and a key, e.g. --train.grad_clip 1.0")
        try:
            out[key] = parse_yaml(value) if value != "" else ""
        except yaml.YAMLError as err:
            raise ConfigError(f"--{key}: cannot parse value {value!r}: {err}") from None
        i += 1
    return out


def _from_mapping(data: dict[str, Any]) -> TrainConfig:
    sections = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(data) - sections)
    if unknown:
        raise ConfigError(f"unknown config section '{unknown[0]}'; valid sections: {', '.join(sorted(sections))}")
    raw = dict(data)
    model_raw = dict(raw.pop("model", None) or {})
    own = {f.name for f in dataclasses.fields(ModelSection)} - {"overrides"}
    model = from_dict(ModelSection, {k: model_raw.pop(k) for k in own if k in model_raw}, "model")
    model.overrides = model_raw
    if model.init == "":
        raise ConfigError("model.init is empty: this recipe starts from a checkpoint, give it as --model.init DIR")
    for key in ("init_image", "init_text"):
        if getattr(model, key) == "":
            raise ConfigError(f"model.{key} is empty: give a checkpoint directory or leave it out")
    # Architecture keys are checked now, against ModelConfig, not when the model is built; so are their values
    # where the architecture is known without reading a checkpoint.
    from_dict(ModelConfig, merge({}, model_raw), "model")
    if model.init is None:
        model.resolve()
    try:
        cfg = from_dict(TrainConfig, {k: v or {} for k, v in raw.items()})
    except ValueError as err:  # OptimConfig validates itself with ValueError
        raise ConfigError(str(err) if isinstance(err, ConfigError) else f"optim: {err}") from None
    cfg.model = model
    cfg.validate()
    return cfg


def load_train_config(
    config: str | Path | dict[str, Any] | None = None, overrides: dict[str, Any] | None = None
) -> TrainConfig:
    """A TrainConfig from a YAML path, a packaged recipe name or a mapping, with dotted overrides on top."""
    if config is None:
        data: dict[str, Any] = {}
    elif isinstance(config, dict):
        data = config
    else:
        path = _resolve_path(config)
        data = load_yaml(path) if isinstance(path, Path) else parse_yaml(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{config}: the top level must be a mapping of sections")
    return _from_mapping(merge(data, overrides or {}))
