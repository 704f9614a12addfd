"""Measured training throughput: the step rates a plan's time comes from.

A plan predicts memory and FLOPs from a fake step, but not time: how fast a step runs depends on kernels,
memory bandwidth and launch overheads no FLOP count sees (EfficientNet's depthwise convolutions and batch
norms run at a few percent of a GPU's matmul peak). So time comes from rates measured on real devices,
kept in ``throughput.json`` next to this module (shipped with the package), one row per model family,
device and step shape. ``openalign bench gpu`` adds rows through ``record``; ``lookup`` finds the row a
plan scales from, and a plan without one says so instead of guessing.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from openalign.config import ConfigError, ModelConfig, list_presets, model_config
from openalign.train.config import TrainConfig, compile_enabled

__all__ = ["TABLE", "Measurement", "family", "load_measurements", "lookup", "record"]

TABLE = Path(__file__).with_name("throughput.json")  # the shipped table


@dataclass(frozen=True)
class Measurement:
    """One measured training step rate on one device."""

    config: str  # recipe name, or "custom"
    image: str  # image tower preset ("b7", "l2"), or "custom"
    text: str  # text tower ("bert-base", "bert-large"), or "custom"
    device: str  # a DEVICES key of train/plan.py ("h200-141gb")
    gpu: str  # the device's name as torch reports it ("NVIDIA H200")
    batch: int  # global batch of the measured run (one device)
    chunk: int | None  # gradient-caching chunk size; None = no caching
    image_size: int
    text_length: int  # caption length the batches were padded to
    precision: str  # "bf16" or "fp32"
    compiled: bool  # torch.compile'd towers
    pairs_per_s: float  # training pairs per second on one device
    date: str  # YYYY-MM-DD of the measurement
    commit: str  # the openalign commit measured
    note: str = ""  # how it was measured, its spread
    grad_checkpointing: bool = False
    peak_gib: float | None = None  # peak memory allocated by PyTorch on the device, when recorded

    def key(self) -> tuple[Any, ...]:
        """What makes two rows the same measurement (a newer one replaces an older one)."""
        return (
            self.image,
            self.text,
            self.device,
            self.config,
            self.image_size,
            self.text_length,
            self.precision,
            self.grad_checkpointing,
            self.compiled,
            self.batch,
            -1 if self.chunk is None else self.chunk,
        )

    def describe(self) -> str:
        """The row in words: what ran, where and when."""
        chunk = f"chunks of {self.chunk}" if self.chunk else "no chunks"
        how = "compiled" if self.compiled else "eager"
        ckpt = ", checkpointed" if self.grad_checkpointing else ""
        return (
            f"{self.pairs_per_s:g} pairs/s on one {self.gpu} ({self.config}, batch {self.batch}, {chunk}, "
            f"{self.image_size} px, {self.precision}, {how}{ckpt}; {self.date}, commit {self.commit})"
        )


def load_measurements(path: str | Path | None = None) -> list[Measurement]:
    """The rows of a throughput table (``None``: the one shipped with the package)."""
    file = Path(path) if path is not None else TABLE
    if not file.exists():
        if path is None:
            return []
        raise ConfigError(f"{file}: no such throughput table")
    data = json.loads(file.read_text())
    rows = data.get("measurements") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ConfigError(f"{file}: expected an object with a 'measurements' list")
    names = {f.name for f in dataclasses.fields(Measurement)}
    out = []
    for i, row in enumerate(rows):
        unknown = sorted(set(row) - names) if isinstance(row, dict) else []
        if not isinstance(row, dict) or unknown:
            raise ConfigError(f"{file}: measurement {i} has unknown keys {unknown} or is not an object")
        try:
            out.append(Measurement(**row))
        except TypeError as err:
            raise ConfigError(f"{file}: measurement {i}: {err}") from None
    return out


ABOUT = (
    "Measured training step rates (pairs/s on one device) that `openalign plan` scales its time from. "
    "Written by openalign.train.throughput.record (openalign bench gpu); keep it sorted, one row per key."
)


def record(rows: list[Measurement], path: str | Path | None = None) -> Path:
    """Add ``rows`` to a throughput table (``None``: the shipped one), replacing rows with the same key;
    the file stays sorted by key, so the same rows always write the same bytes."""
    file = Path(path) if path is not None else TABLE
    kept = {m.key(): m for m in (load_measurements(file) if file.exists() else [])}
    for m in rows:
        kept[m.key()] = m
    ordered = [dataclasses.asdict(kept[k]) for k in sorted(kept)]
    text = json.dumps({"about": ABOUT, "measurements": ordered}, indent=2, ensure_ascii=False) + "\n"
    tmp = file.with_name(file.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(file)  # never a half-written table
    return file


# ---------------------------------------------------------------------------------------------- matching

# The fields each image tower family builds from: a field the family does not read (an EfficientNet's widths in a
# convnet config, a convnet's layers in an EfficientNet one) does not make another family.
_IMAGE_ARCH = {
    "convnet": ("conv_channels", "conv_strides"),
    "efficientnet": (
        "width_coefficient",
        "depth_coefficient",
        "depth_divisor",
        "stem_channels",
        "kernel_sizes",
        "num_repeats",
        "in_channels",
        "out_channels",
        "expand_ratios",
        "strides",
        "se_ratio",
    ),
}


def _image_arch(model: ModelConfig) -> tuple[Any, ...]:
    image = model.image
    return (image.family, *(getattr(image, name) for name in _IMAGE_ARCH[image.family]))


def _text_arch(model: ModelConfig) -> tuple[int, ...]:
    t = model.text
    return (t.num_layers, t.hidden_size, t.num_heads, t.ffn_size)


@cache
def _tower_presets() -> tuple[dict[tuple[Any, ...], str], dict[tuple[int, ...], str]]:
    images: dict[tuple[Any, ...], str] = {}
    texts: dict[tuple[int, ...], str] = {}
    for name in list_presets():
        image, _, text = name.partition("-")
        if not text:  # a whole model off the grid (nano)
            continue
        cfg = model_config(name)
        images.setdefault(_image_arch(cfg), image)
        texts.setdefault(_text_arch(cfg), f"bert-{text}")
    return images, texts


def family(model: ModelConfig) -> tuple[str, str]:
    """(image tower preset, text tower) whose architecture ``model`` has, by shape, not by name (a checkpoint
    of B7 + BERT-Base is that family too); "custom" for a tower off the presets' grid. Batch norm, dropout,
    vocabulary size and embedding width do not make another family."""
    images, texts = _tower_presets()
    return images.get(_image_arch(model), "custom"), texts.get(_text_arch(model), "custom")


def _distance(
    m: Measurement, cfg: TrainConfig, per_device: int, bf16: bool, image_size: int, world_size: int
) -> tuple[Any, ...]:
    """How far ``m`` is from the planned step, most important first: the input size, then caching or not
    (a cached step runs every forward twice), precision, checkpointing, the chunk, the batch, compilation;
    the newest row wins a tie."""
    chunk = cfg.train.chunk_size
    return (
        m.image_size != image_size,
        m.text_length != cfg.data.max_text_length,
        (m.chunk is None) != (chunk is None),
        m.precision != ("bf16" if bf16 else "fp32"),
        m.grad_checkpointing != cfg.train.grad_checkpointing,
        0.0 if chunk is None or m.chunk is None else abs(math.log(m.chunk / chunk)),
        abs(math.log(m.batch / per_device)),
        m.compiled != compile_enabled(cfg, "cuda", world_size, gpu_compiles=True),
        -_ordinal(m.date),
    )


def _ordinal(date: str) -> int:
    try:
        return datetime.date.fromisoformat(date).toordinal()
    except ValueError:
        return 0


def lookup(
    cfg: TrainConfig,
    device: str,
    measurements: list[Measurement] | None = None,
    *,
    world_size: int = 1,
    bf16: bool = True,
) -> Measurement | None:
    """The measured row closest to a step of ``cfg`` on ``device`` (per-device batch at ``world_size``), of
    the same model family and device; ``None`` when that family was never measured there."""
    rows = load_measurements() if measurements is None else measurements
    image, text = family(cfg.model.resolve())
    same = [m for m in rows if (m.image, m.text, m.device) == (image, text, device)]
    if not same or "custom" in (image, text):
        return None
    per_device = cfg.per_rank_batch(world_size)
    size = cfg.data.image_size or cfg.model.resolve().image_size
    return min(same, key=lambda m: _distance(m, cfg, per_device, bf16, size, world_size))


def measured_devices(cfg: TrainConfig, measurements: list[Measurement] | None = None) -> list[str]:
    """The devices with a measurement of ``cfg``'s model family."""
    rows = load_measurements() if measurements is None else measurements
    image, text = family(cfg.model.resolve())
    return sorted({m.device for m in rows if (m.image, m.text) == (image, text)})


def differences(m: Measurement, cfg: TrainConfig, per_device: int, bf16: bool, world_size: int = 1) -> list[str]:
    """How the measured step differs from the planned one, in words (empty: the same step)."""
    out = []
    size = cfg.data.image_size or cfg.model.resolve().image_size
    if m.image_size != size:
        out.append(f"{m.image_size} px, not {size}")
    if m.text_length != cfg.data.max_text_length:
        out.append(f"{m.text_length} tokens, not {cfg.data.max_text_length}")
    if m.batch != per_device:
        out.append(f"batch {m.batch}, not {per_device}")
    if m.chunk != cfg.train.chunk_size:
        have = f"chunks of {m.chunk}" if m.chunk else "no chunks"
        want = f"chunks of {cfg.train.chunk_size}" if cfg.train.chunk_size else "none"
        out.append(f"{have}, not {want}")
    if m.precision != ("bf16" if bf16 else "fp32"):
        out.append(f"{m.precision}, not {'bf16' if bf16 else 'fp32'}")
    if m.grad_checkpointing != cfg.train.grad_checkpointing:
        out.append("checkpointed" if m.grad_checkpointing else "not checkpointed")
    if m.compiled != compile_enabled(cfg, "cuda", world_size, gpu_compiles=True):
        out.append("compiled" if m.compiled else "eager")
    return out
