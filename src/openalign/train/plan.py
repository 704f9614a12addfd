"""Plan a training step without the hardware: memory per device, FLOPs and time, for any recipe and device.

The model, optimizer and one whole training step (forward, the paper's loss over the global batch,
backward, gradient norm, optimizer step) run under PyTorch's ``FakeTensorMode``: every tensor has a shape,
dtype and device but no storage, so the step of a 16k batch on EfficientNet-B7 allocates nothing. What is
measured, not derived from formulas:

- memory: ``LiveBytes``, a ``TorchDispatchMode`` that sees every tensor each op returns and holds a weak
  reference to its storage, so live bytes rise when a storage appears and fall when the step lets go of
  it; the peak is the most bytes alive at once. (PyTorch's ``MemTracker`` refuses a module called more
  than once per step, which gradient caching does by design.)
- FLOPs: PyTorch's FLOP formulas (``FlopCounterMode``'s, with ``train/flops.py``'s), applied by the same
  dispatch mode to the same ops ``FlopCounterMode`` counts, since a second mode stacked on it would add to
  the plan's time. The real steps ``validate`` runs are counted by ``FlopCounterMode`` itself.

With gradient caching the step repeats one chunk's work per chunk, so a plan of many chunks runs the step
at three and four chunks and extends both measurements along the line through them (exact for FLOPs, and
for memory outside the loss, whose batch-sized tensors grow by the same bytes per row); the loss over the
global batch is measured at full size on its own. Three chunks, not two, because chunks are of three
kinds: the first backward starts with no gradients, the middle ones add to the gradients of the chunks
before (under FSDP2 held unsharded, so more at their peak than the first's),
the last reduces them as it goes. Only from three chunks on is every kind in the step, and each chunk
more adds only its rows. ``validate`` runs the same steps for real on the CPU and
compares.

Assumptions a plan makes, and says: captions at the full ``data.max_text_length`` (the loop trims padding
the batch does not use), DDP's gradient buckets are one more copy of the gradients (its default without
``gradient_as_bucket_view``), and time is a measured step rate of the same model family on the same device
(``train/throughput.py``), pairs/s per device held at the planned batch and world size, communication not
counted; with no measurement for the device the plan has no time (``--mfu`` derives one from the FLOPs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from openalign.config import ConfigError
from openalign.data.transforms import normalize_pixels
from openalign.model.dual_encoder import DualEncoder
from openalign.model.efficientnet import direct_depthwise
from openalign.optim import build_optimizer
from openalign.process import skip_exit_collection
from openalign.train import flops as flop_formulas
from openalign.train.config import TrainConfig, resolve_precision, sharded
from openalign.train.grad_cache import cached_step, plain_step
from openalign.train.step import step_loss
from openalign.train.throughput import Measurement, differences, family, load_measurements, lookup, measured_devices

__all__ = [
    "DEVICES",
    "Device",
    "LiveBytes",
    "Plan",
    "StepMeasure",
    "device_spec",
    "largest_chunk",
    "measure",
    "plan",
    "time_rows",
]

GiB = 2**30


@dataclass(frozen=True)
class Device:
    """What a plan needs of a device: usable memory and peak dense matmul throughput (the latter only for a
    time derived from FLOPs at a stated utilisation, ``--mfu``; a plan's time otherwise comes from a
    measured step rate, ``train/throughput.py``)."""

    name: str
    memory_gib: float  # what the framework can allocate (nvidia-smi's total), not the marketing figure
    bf16_tflops: float | None  # dense peak with bf16 inputs
    fp32_tflops: float | None  # dense peak for fp32 matmuls (TF32 tensor cores where the card has them)
    cuda: bool = True


# Peak figures: NVIDIA's datasheets (H100 SXM5, A100 SXM4 40/80 GB, L4), dense, i.e. half the "with
# sparsity" figures; the H200 has the H100 SXM's compute. Memory: nvidia-smi's total (81559, 81920 MiB less
# ECC reserve, 40536, 23034 MiB; 139.8 GiB on an H200).
DEVICES: dict[str, Device] = {
    "h100-80gb": Device("h100-80gb", 79.6, 989.0, 494.5),
    "h200-141gb": Device("h200-141gb", 139.8, 989.0, 494.5),
    "a100-80gb": Device("a100-80gb", 79.2, 312.0, 156.0),
    "a100-40gb": Device("a100-40gb", 39.4, 312.0, 156.0),
    "l4-24gb": Device("l4-24gb", 22.5, 121.0, 60.0),
}

# A CUDA process holds its context and cuBLAS/cuDNN workspaces outside PyTorch's allocator, and the caching
# allocator loses some memory to fragmentation; a plan fits when its peak leaves both.
CUDA_RESERVE_GIB = 1.0
FRAGMENTATION = 0.10


def device_spec(name: str) -> Device:
    """A device of ``DEVICES``, ``cpu`` (this machine's RAM), or a memory size in GB (``MEM_GB``)."""
    if name in DEVICES:
        return DEVICES[name]
    if name == "cpu":
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
        return Device("cpu", ram, None, None, cuda=False)
    try:
        gb = float(name)
    except ValueError:
        raise ConfigError(
            f"unknown device {name!r}; one of {', '.join([*DEVICES, 'cpu'])} or a memory size in GB"
        ) from None
    if not gb > 0:
        raise ConfigError(f"device memory must be positive, got {name}")
    return Device(f"{gb:g}gb", gb * 1e9 / GiB, None, None)


def with_tflops(device: Device, tflops: float) -> Device:
    """``device`` with its peak throughput replaced (in both precisions: the one the step uses counts)."""
    return dataclasses.replace(device, bf16_tflops=tflops, fp32_tflops=tflops)


def load_plan_config(config: str, overrides: dict[str, Any]) -> TrainConfig:
    """A recipe as ``openalign train`` loads it, less what only a run needs: training shards are not read,
    and a fine-tuning recipe's ``model.init`` may be replaced by ``--model.preset``."""
    from openalign.train.config import load_train_config

    planned = {"data.shards": "planned", **overrides}
    try:
        return load_train_config(config, planned)
    except ConfigError as err:
        if not str(err).startswith("model.init is empty"):
            raise
        if "model.preset" not in overrides:
            raise ConfigError(
                f"{config} starts from a checkpoint: plan it with --model.init DIR or --model.preset NAME "
                "(e.g. l2-large, b7-base)"
            ) from None
        return load_train_config(config, {**planned, "model.init": None})


# ---------------------------------------------------------------------------------------------- tracking


_PRIM_DEVICE = torch.ops.prim.device.default
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd


@functools.cache
def _decomposes(func: Any) -> bool:
    """Whether ``func.decompose`` has a decomposition to run (``FlopCounterMode`` counts an op's parts when
    it has): asked once per op, not entering the mode again at every call to find out."""
    return func is not _PRIM_DEVICE and (
        _COMPOSITE in func.py_kernels or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _COMPOSITE)
    )


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive, and the most alive at once, over the ops run inside it.

    FSDP2 frees a gathered unit's parameters by resizing their storage to nothing and gathers them again
    into the same storage; ``resized`` follows both, and ``gathered`` counts what such storages hold.

    With ``count_flops``, ``flops`` sums the FLOPs of the ops run inside, as ``flop_counter()`` would: its
    formulas, and an op that decomposes counted by its parts."""

    def __init__(self, count_flops: bool = False) -> None:
        super().__init__()
        self.flops = 0
        # op packet -> formula(*args, out_val=out, **kwargs), the table FlopCounterMode looks ops up in
        self._formulas = flop_formulas.counter().flop_registry if count_flops else None
        self.live = 0
        self.peak = 0
        self.gathered = 0  # bytes alive in storages FSDP resizes (unsharded parameters)
        self.gathered_at_peak = 0
        self.phase_peaks: dict[str, int] = {}
        self.phase = "step"
        self._seen: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()
        self._resizable: weakref.WeakSet[Any] = weakref.WeakSet()

    def add(self, t: torch.Tensor) -> None:
        local = getattr(t, "_local_tensor", None)  # a DTensor: what this rank holds
        storage = (local if local is not None else t).untyped_storage()
        if storage in self._seen:
            return
        box = [storage.nbytes()]
        self._seen[storage] = box
        self.live += box[0]
        weakref.finalize(storage, self._free, box)
        self._update()

    def resized(self, t: torch.Tensor, before: int) -> None:
        """``t``'s storage was resized from ``before`` bytes to what it holds now."""
        storage = t.untyped_storage()
        if storage not in self._seen:  # first seen here: what it holds now is gathered
            self.add(t)
            self._resizable.add(storage)
            self.gathered += storage.nbytes()
            self._update()
            return
        box = self._seen[storage]
        delta = storage.nbytes() - box[0]
        box[0] = storage.nbytes()
        if storage not in self._resizable:
            self._resizable.add(storage)
            self.gathered += before
        self.gathered += delta
        self.live += delta
        self._update()

    def transient(self, extra: int) -> None:
        """``extra`` bytes more alive for a moment (a step measured before and not run again)."""
        self.live += extra
        self._update()
        self.live -= extra

    def _free(self, box: list[int]) -> None:
        self.live -= box[0]

    def _update(self) -> None:
        if self.live >= self.peak:
            self.peak = self.live
            self.gathered_at_peak = self.gathered
        self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        formulas = self._formulas
        if formulas is not None and _decomposes(func):
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        if formulas is not None:
            formula = formulas.get(func._overloadpacket)
            if formula is not None:
                self.flops += formula(*args, **kwargs, out_val=out)
        if isinstance(out, torch.Tensor):  # most ops: no tree to flatten
            self.add(out)
        else:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.add(t)
        return out


def flop_counter() -> FlopCounterMode:
    """PyTorch's ``FlopCounterMode`` counting the whole step only, with grouped convolutions' backward
    counted right (``train/flops.py``).

    Its per-module breakdown (``ModuleTracker``) puts a gradient hook on the output of every module call,
    and the calls that checkpointing makes during backward, to recompute a block, produce outputs no
    gradient ever reaches: their hooks keep those recomputed activations alive to the end of the step, so
    under the stock counter each gradient-cached chunk's recomputed blocks pile up (a step of 16 chunks
    held 16 chunks' activations). The total needs no module names."""

    class _Global:
        parents = frozenset({"Global"})

        def __enter__(self) -> None:
            return None

        def __exit__(self, *_: Any) -> None:
            return None

    counter = flop_formulas.counter()
    counter.mod_tracker = _Global()  # type: ignore[assignment]
    return counter


@contextlib.contextmanager
def following_fsdp_storage(tracker: LiveBytes) -> Iterator[None]:
    """Tell ``tracker`` when FSDP2 frees or re-allocates a storage in place (``UntypedStorage.resize_`` is
    not an op a dispatch mode sees)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage
    # _fsdp_param_group imported alloc_storage by name: both module globals are replaced.
    patched = [(_fsdp_param, "alloc_storage", alloc), (_fsdp_param_group, "alloc_storage", alloc)]
    patched.append((_fsdp_param, "free_storage", free))

    def following(fn: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
        def resize(tensor: torch.Tensor) -> None:
            before = tensor.untyped_storage().nbytes()
            fn(tensor)
            if tensor.untyped_storage().nbytes() != before:
                tracker.resized(tensor, before)

        return resize

    for module, name, fn in patched:
        setattr(module, name, following(fn))
    try:
        yield
    finally:
        for module, name, fn in patched:
            setattr(module, name, fn)


def _nbytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = getattr(t, "_local_tensor", None)
            st = (local if local is not None else t).untyped_storage()
            seen[id(st)] = st.nbytes()
    return sum(seen.values())


# ---------------------------------------------------------------------------------------------- the step


@dataclass
class StepSetup:
    """What one rank's step is made of, real or fake."""

    model: DualEncoder
    optimizer: torch.optim.Optimizer
    batch: dict[str, torch.Tensor]
    chunk_size: int | None
    bf16: bool
    loss_fn: Callable[..., torch.Tensor]
    grad_clip: float | None
    fsdp: bool = False  # sharded by FSDP2 over the process group, as the loop shards it
    pixels: Callable[[torch.Tensor], torch.Tensor] | None = None  # uint8 pixels → model input, per chunk


def input_shapes(cfg: TrainConfig) -> tuple[int, int]:
    """(image side, caption length) of the batches the training stream makes."""
    model = cfg.model.resolve()
    return cfg.data.image_size or model.image_size, cfg.data.max_text_length


def build_model(
    cfg: TrainConfig, bf16: bool, *, meta: DualEncoder | None = None, mesh: Any = None
) -> tuple[DualEncoder, torch.optim.Optimizer, bool]:
    """Model and optimizer (with its state, as after a first step) on the CPU, and whether FSDP2 shards them.
    Inside a ``FakeTensorMode``, ``meta`` (the model built on the meta device) is given fake storage, so
    even L2 + BERT-Large costs no memory. With ``train.strategy fsdp`` in a process group of several ranks
    the model is sharded by ``wrap_model``, as the loop shards it (``mesh``: its device mesh, made outside
    fake tensors)."""
    from openalign.train.distributed import DistInfo, is_distributed, wrap_model

    torch.manual_seed(cfg.train.seed)
    model = meta.to_empty(device="cpu") if meta is not None else DualEncoder(cfg.model.resolve())
    model.set_grad_checkpointing(cfg.train.grad_checkpointing)
    for tower in ("image", "text"):
        if getattr(cfg.model, f"lock_{tower}"):
            model.lock_tower(tower)  # a locked tower keeps no gradients or optimizer state
    model.train()
    fsdp = cfg.train.strategy == "fsdp" and is_distributed()
    if fsdp:
        import torch.distributed as dist

        info = DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size())
        wrap_model(model, info, "fsdp", bf16=bf16, mesh=mesh)
    optimizer = build_optimizer(model, cfg.optim)
    # The optimizer's state exists from the first step on; a step on zero gradients creates it.
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer, fsdp


def make_batch(cfg: TrainConfig, rows: int) -> dict[str, torch.Tensor]:
    """A batch of ``rows`` pairs at the sizes the training stream makes (captions at full length)."""
    side, length = input_shapes(cfg)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, cfg.model.resolve().text.vocab_size, (rows, length), generator=gen)
    return {
        # uint8, as the stream hands pixels to the device: the float copy exists one chunk at a time.
        "pixel_values": torch.randint(0, 256, (rows, 3, side, side), dtype=torch.uint8, generator=gen),
        "input_ids": ids,
        "attention_mask": torch.ones(rows, length, dtype=torch.long),
    }


def pixels_fn(cfg: TrainConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the step applies to each chunk's uint8 pixels: the model's normalisation, on their device."""
    model = cfg.model.resolve()
    return partial(normalize_pixels, mean=model.pixel_mean, std=model.pixel_std)


def model_pixels(cfg: TrainConfig, pixels: torch.Tensor) -> torch.Tensor:
    """``pixels`` of a ``make_batch`` batch as the model takes them (normalised floats)."""
    return pixels_fn(cfg)(pixels)


def _setup(
    cfg: TrainConfig, model: DualEncoder, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor], bf16: bool
) -> StepSetup:
    t = cfg.train
    loss_fn = step_loss(t)
    fsdp = hasattr(model, "set_requires_gradient_sync")  # an FSDPModule
    return StepSetup(model, optimizer, batch, t.chunk_size, bf16, loss_fn, t.grad_clip, fsdp, pixels_fn(cfg))


def build_step(
    cfg: TrainConfig, rows: int, bf16: bool, *, meta: DualEncoder | None = None, mesh: Any = None
) -> StepSetup:
    """``build_model`` and a batch of ``rows``: one rank's whole step."""
    model, optimizer, _ = build_model(cfg, bf16, meta=meta, mesh=mesh)
    return _setup(cfg, model, optimizer, make_batch(cfg, rows), bf16)


def run_step(s: StepSetup, loss_fn: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """One training step as the loop takes it: forward and backward (gradient-cached or not), gradient norm,
    optional clipping, optimizer step, gradients dropped."""
    from openalign.train.distributed import average_replicated_grads, fsdp_no_sync, grad_norm, replicated_params

    loss_fn = loss_fn or s.loss_fn
    # Under FSDP2 the mixed-precision policy casts the gathered parameters instead of autocast (as in the loop).
    bf16_autocast = s.bf16 and not s.fsdp
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16_autocast else contextlib.nullcontext()
    temperature = lambda: s.model.temperature  # noqa: E731
    with autocast:
        if s.chunk_size is None:
            loss = plain_step(s.model, s.batch, loss_fn, temperature, pixels=s.pixels)
        else:
            no_sync = partial(fsdp_no_sync, s.model) if s.fsdp else None
            loss = cached_step(s.model, s.batch, s.chunk_size, loss_fn, temperature, no_sync=no_sync, pixels=s.pixels)
    if s.fsdp:
        average_replicated_grads(replicated_params(s.model))
    params = [p for p in s.model.parameters() if p.grad is not None]
    norm = grad_norm(params)
    if s.grad_clip is not None:
        torch.nn.utils.clip_grads_with_norm_(params, s.grad_clip, norm)
    s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    return loss


@dataclass
class StepMeasure:
    """One fake step of ``rows`` rows on one rank."""

    rows: int
    peak: int  # most bytes alive at once
    outside_loss_peak: int  # the same, leaving out the loss over the gathered batch
    live_at_loss: int  # bytes alive when the loss over the gathered batch starts
    flops: int
    params: int
    buffers: int
    grads: int
    optimizer: int
    inputs: int
    gathered: int = 0  # FSDP2: unsharded parameters alive at the peak (units gathered at once)


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A process group of ``world_size`` ranks in which this process is rank 0 and collectives move no data
    (PyTorch's fake backend): the loss then gathers the global batch's shapes."""
    import torch.distributed as dist

    if world_size == 1:
        yield
        return
    if dist.is_initialized():
        raise ConfigError("planning with several ranks needs a process without a process group")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Real tensors may enter: generator states that checkpointing and gradient caching save and restore.
    return FakeTensorMode(allow_non_fake_inputs=True)


@dataclass
class _OptimizerStep:
    """What the optimizer step adds over the bytes alive when it starts, and its FLOPs: the same for every
    batch size, so measured once per model and reused."""

    extra: int
    flops: int


class StepSession:
    """One fake model, optimizer and state for all the steps a plan measures: building them (and, under
    FSDP2, each optimizer step over sharded tensors) costs far more than a step's forward and backward. The
    first step measured runs the optimizer; later ones stop before it and add what it added then. Steps
    are cached by (rows, chunk size, checkpointing). Enter it inside the process group the plan runs in."""

    def __init__(self, cfg: TrainConfig, bf16: bool, world_size: int = 1) -> None:
        with torch.device("meta"):
            meta = DualEncoder(cfg.model.resolve())
        self.cfg, self.bf16, self.world_size = cfg, bf16, world_size
        mesh = _fsdp_mesh(cfg)
        self.mode = _fake_mode()
        with self.mode:
            self.model, self.optimizer, _ = build_model(cfg, bf16, meta=meta, mesh=mesh)
        self.optimizer_step: _OptimizerStep | None = None
        self.cache: dict[tuple[int, int | None, bool], StepMeasure] = {}
        self.losses: dict[int, tuple[int, int]] = {}

    def loss(self, rows: int) -> tuple[int, int]:
        """``measure_loss`` for ``rows`` cached embeddings per rank."""
        if rows not in self.losses:
            self.losses[rows] = measure_loss(self.cfg, rows, self.cfg.model.resolve().embed_dim)
        return self.losses[rows]

    def measure(self, cfg: TrainConfig, rows: int) -> StepMeasure:
        """One fake step of ``cfg`` (this session's model and optimizer; its batch, chunk size and
        checkpointing) of ``rows`` per-rank rows."""
        if cfg.model != self.cfg.model or cfg.optim != self.cfg.optim or cfg.train.strategy != self.cfg.train.strategy:
            raise ValueError("a step session measures one model, optimizer and strategy")
        key = (rows, cfg.train.chunk_size, cfg.train.grad_checkpointing)
        if key not in self.cache:
            with self.mode:
                self.model.set_grad_checkpointing(cfg.train.grad_checkpointing)
                s = _setup(cfg, self.model, self.optimizer, make_batch(cfg, rows), self.bf16)
                self.cache[key] = self._measure(s, rows)
        return self.cache[key]

    def _measure(self, s: StepSetup, rows: int) -> StepMeasure:
        tracker = LiveBytes(count_flops=True)
        params = [p for p in s.model.parameters()]
        state = [v for st in s.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        for t in [*params, *s.model.buffers(), *s.batch.values(), *state]:
            tracker.add(t)
        live_at_loss = 0

        def loss_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
            nonlocal live_at_loss
            live_at_loss = tracker.live
            tracker.phase = "loss"
            return s.loss_fn(*args, **kwargs)

        def back_to_model(*_: Any) -> None:
            tracker.phase = "step"

        hook = s.model.register_forward_pre_hook(back_to_model)
        grads = 0
        optimizer_flops = 0
        original_step = s.optimizer.step

        def step_and_count(*args: Any, **kwargs: Any) -> Any:
            nonlocal grads, optimizer_flops
            tracker.phase = "step"
            grads = _nbytes(p.grad for p in params if p.grad is not None)
            start = tracker.live
            if self.optimizer_step is not None:
                tracker.transient(self.optimizer_step.extra)
                optimizer_flops = self.optimizer_step.flops
                return None
            before = tracker.flops
            tracker.phase = "optimizer"
            out = original_step(*args, **kwargs)
            self.optimizer_step = _OptimizerStep(0, tracker.flops - before)
            extra = tracker.phase_peaks.get("optimizer", start) - start
            self.optimizer_step.extra = extra
            tracker.phase_peaks["step"] = max(tracker.phase_peaks.get("step", 0), start + extra)
            tracker.phase = "step"
            return out

        s.optimizer.step = step_and_count  # type: ignore[method-assign]
        try:
            with tracker, following_fsdp_storage(tracker):
                run_step(s, loss_fn if s.chunk_size is not None else None)
        finally:
            hook.remove()
            del s.optimizer.step
        flops = tracker.flops + optimizer_flops  # the optimizer's when its step was skipped
        return StepMeasure(
            rows=rows,
            peak=tracker.peak,
            outside_loss_peak=tracker.phase_peaks.get("step", 0),
            live_at_loss=live_at_loss,
            flops=flops,
            params=_nbytes(params),
            buffers=_nbytes(s.model.buffers()),
            grads=grads,
            optimizer=_nbytes(state),
            inputs=_nbytes(s.batch.values()),
            gathered=tracker.gathered_at_peak,
        )


@contextlib.contextmanager
def session(cfg: TrainConfig, device: Device, world_size: int = 1) -> Iterator[StepSession]:
    """A fake process group of ``world_size`` ranks and one ``StepSession`` in it, for the plans of ``cfg``
    on ``device`` at any batch, chunk size and checkpointing."""
    if world_size < 1:
        raise ConfigError(f"world size must be positive, got {world_size}")
    with fake_world(world_size):
        yield StepSession(cfg, resolve_bf16(cfg, device), world_size)


def measure(cfg: TrainConfig, rows: int, bf16: bool) -> StepMeasure:
    """One fake training step of ``rows`` per-rank rows on a model built for it (process group already set
    up), optimizer step included."""
    return StepSession(cfg, bf16).measure(cfg, rows)


def _fsdp_mesh(cfg: TrainConfig) -> Any:
    """The device mesh FSDP2 shards over, made from the (fake) process group before tensors are faked: making
    it reads rank numbers out of a tensor, which a fake tensor does not hold."""
    from openalign.train.distributed import is_distributed

    if cfg.train.strategy != "fsdp" or not is_distributed():
        return None
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def measure_loss(cfg: TrainConfig, rows: int, width: int) -> tuple[int, int]:
    """(bytes the loss over the gathered batch adds at its peak, its FLOPs) for ``rows`` cached embeddings
    per rank: the loss and its gradient with respect to the embeddings and the temperature, as the cached
    step computes them."""
    t = cfg.train
    with _fake_mode():
        image = torch.empty(rows, width).requires_grad_()
        text = torch.empty(rows, width).requires_grad_()
        temp = torch.ones(()).requires_grad_()
        tracker = LiveBytes(count_flops=True)
        for x in (image, text, temp):
            tracker.add(x)
        start = tracker.live
        with tracker:
            loss = step_loss(t)(image, text, temp)
            grads = torch.autograd.grad(loss, [image, text, temp])
            del loss, grads
        return tracker.peak - start, tracker.flops


# ---------------------------------------------------------------------------------------------- the plan


@dataclass
class Plan:
    """The predicted memory, FLOPs and time of one training step on each of ``world_size`` devices."""

    device: str
    world_size: int
    global_batch: int
    per_rank: int
    chunk_size: int | None
    precision: str
    grad_checkpointing: bool
    strategy: str
    params: int  # bytes per device
    buffers: int
    grads: int
    optimizer: int
    inputs: int  # the per-rank batch
    loss: int  # gathered embeddings, logits and their gradients, at the loss's peak
    ddp_buckets: int
    gathered: int  # FSDP2: unsharded parameters of the units gathered at the peak
    activations: int  # the rest of the peak: saved activations and temporaries
    peak: int  # predicted peak per device
    capacity: int  # bytes a step may use on the device
    flops: int  # per device per step (recomputation included)
    tflops: float | None  # the device's peak in the step's precision
    mfu: float | None  # --mfu: the time is FLOPs over this fraction of the peak, not a measured rate
    step_seconds: float | None  # None: no measured rate for this device and model family (and no --mfu)
    pairs_per_second: float | None  # all devices together
    extrapolated: bool  # measured at three and four chunks and extended to the per-rank batch
    family: tuple[str, str] = ("custom", "custom")  # (image tower, text tower) presets the model matches
    measurement: Measurement | None = None  # the measured step rate the time is scaled from (or, with --mfu, beside)
    measured_devices: tuple[str, ...] = ()  # devices with a measurement of this model family
    differs: tuple[str, ...] = ()  # how the measured step differs from this one

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity


def capacity_bytes(device: Device) -> int:
    if not device.cuda:
        return int(device.memory_gib * GiB)
    return int((device.memory_gib - CUDA_RESERVE_GIB) * (1 - FRAGMENTATION) * GiB)


def resolve_bf16(cfg: TrainConfig, device: Device) -> bool:
    """Whether the plan's step runs under bf16 autocast. bf16-image (and what auto picks on an AMX CPU) is
    planned as fp32: its activations are no larger than fp32's, so the plan's memory is an upper bound."""
    kind = "cuda" if device.cuda else "cpu"
    # The GPUs the plan names compute in bf16 (plan an older one, a memory size, with --train.precision fp32);
    # the machine planning may hold another GPU, or none.
    family = cfg.model.resolve().image.family
    return resolve_precision(cfg.train.precision, kind, family, gpu_bf16=True) == "bf16"


def plan(
    cfg: TrainConfig,
    device: Device,
    world_size: int = 1,
    *,
    mfu: float | None = None,
    steps: StepSession | None = None,
    measurements: list[Measurement] | None = None,
) -> Plan:
    """Predict one step of ``cfg`` on ``world_size`` devices like ``device`` (one device, DDP or FSDP2: the
    strategy is ``train.strategy``; with FSDP2 parameters, gradients and optimizer state are this rank's
    shards, and the peak includes the units FSDP gathers and the buffers it reduce-scatters). ``steps``: a
    ``session`` of the same config, device and world size to measure in (one is opened when not given).

    Time: the closest measured step rate of the same model family on the same device (``measurements``,
    default the shipped table), per-device pairs/s held at any batch and world size, communication not
    counted; none when that device has no measurement. ``mfu``: time from the FLOPs at that fraction of
    the device's peak instead, an explicit override."""
    if steps is None:
        with session(cfg, device, world_size) as steps:
            return plan(cfg, device, world_size, mfu=mfu, steps=steps, measurements=measurements)
    if steps.world_size != world_size or steps.bf16 != resolve_bf16(cfg, device):
        raise ValueError("the step session was opened for another world size or precision")
    per_rank = cfg.per_rank_batch(world_size)
    chunk = cfg.train.chunk_size
    bf16 = steps.bf16
    if chunk is not None and per_rank > 4 * chunk:
        a = steps.measure(_with_batch(cfg, 3 * chunk * world_size), 3 * chunk)
        b = steps.measure(_with_batch(cfg, 4 * chunk * world_size), 4 * chunk)
        loss_a, loss_b = steps.loss(a.rows), steps.loss(b.rows)
        loss_n = steps.loss(per_rank)

        def line(x_a: float, x_b: float) -> int:
            return round(x_a + (x_b - x_a) * (per_rank - a.rows) / chunk)

        inputs = line(a.inputs, b.inputs)
        peak = max(line(a.outside_loss_peak, b.outside_loss_peak), line(a.live_at_loss, b.live_at_loss) + loss_n[0])
        flops = line(a.flops - loss_a[1], b.flops - loss_b[1]) + loss_n[1]
        base, extrapolated = a, True
    else:
        base = steps.measure(cfg, per_rank)
        inputs, peak, flops, extrapolated = base.inputs, base.peak, base.flops, False
        loss_n = steps.loss(per_rank) if chunk is not None else (0, 0)
    buckets = base.grads if world_size > 1 and cfg.train.strategy == "ddp" else 0
    peak += buckets
    persistent = base.params + base.buffers + base.optimizer + inputs + buckets
    activations = max(0, peak - persistent - base.grads - loss_n[0] - base.gathered)
    tflops = device.bf16_tflops if bf16 else device.fp32_tflops
    rows = load_measurements() if measurements is None else measurements
    measured = lookup(cfg, device.name, rows, world_size=world_size, bf16=bf16)
    seconds: float | None = None
    if mfu is not None:
        seconds = flops / (tflops * 1e12 * mfu) if tflops else None
    elif measured is not None:
        # The measured rate per device, held at this batch: each device computes its own rows.
        seconds = per_rank / measured.pairs_per_s
    return Plan(
        device=device.name,
        world_size=world_size,
        global_batch=per_rank * world_size,
        per_rank=per_rank,
        chunk_size=chunk,
        precision="bf16" if bf16 else "fp32",
        grad_checkpointing=cfg.train.grad_checkpointing,
        strategy=cfg.train.strategy if world_size > 1 else "single",
        params=base.params,
        buffers=base.buffers,
        grads=base.grads,
        optimizer=base.optimizer,
        inputs=inputs,
        loss=loss_n[0],
        ddp_buckets=buckets,
        gathered=base.gathered,
        activations=activations,
        peak=peak,
        capacity=capacity_bytes(device),
        flops=flops,
        tflops=tflops,
        mfu=mfu,
        step_seconds=seconds,
        pairs_per_second=per_rank * world_size / seconds if seconds else None,
        extrapolated=extrapolated,
        family=family(cfg.model.resolve()),
        measurement=measured,
        measured_devices=tuple(measured_devices(cfg, rows)),
        differs=tuple(differences(measured, cfg, per_rank, bf16, world_size)) if measured is not None else (),
    )


def _with_batch(cfg: TrainConfig, global_batch: int) -> TrainConfig:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=global_batch))


def _with_chunk(cfg: TrainConfig, chunk: int | None, checkpointing: bool | None = None) -> TrainConfig:
    train = dataclasses.replace(cfg.train, chunk_size=chunk)
    if checkpointing is not None:
        train = dataclasses.replace(train, grad_checkpointing=checkpointing)
    return dataclasses.replace(cfg, train=train)


def _with_strategy(cfg: TrainConfig, strategy: Literal["ddp", "fsdp"]) -> TrainConfig:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, strategy=strategy))


def chunk_candidates(cfg: TrainConfig, per_rank: int) -> list[int]:
    """Chunk sizes that divide the per-rank batch; with ghost batch norm, multiples of its group size, so
    gradient caching keeps the statistics groups of plain training."""
    image = cfg.model.resolve().image
    group = image.virtual_batch_size if image.batch_norm == "virtual" and image.virtual_batch_size else 1
    return [c for c in range(1, per_rank + 1) if per_rank % c == 0 and c % group == 0]


def largest_chunk(
    cfg: TrainConfig,
    device: Device,
    world_size: int = 1,
    *,
    mfu: float | None = None,
    steps: StepSession | None = None,
) -> tuple[int | None, Plan | None]:
    """The largest chunk size whose step fits (``None`` with a plan: the whole per-rank batch fits without
    caching); ``(None, None)`` when none fits. Memory grows with the chunk, so the answer lies between the
    largest size known to fit and the smallest known not to; each probe is the size a line through the
    peaks measured so far predicts to be the last that fits, kept strictly between the two, so a good
    prediction ends the search in two probes and a bad one is no worse than walking the sizes."""
    if steps is None:
        with session(cfg, device, world_size) as steps:
            return largest_chunk(cfg, device, world_size, mfu=mfu, steps=steps)
    per_rank = cfg.per_rank_batch(world_size)
    whole = plan(_with_chunk(cfg, None), device, world_size, mfu=mfu, steps=steps)
    if whole.fits:
        return None, whole
    sizes = [c for c in chunk_candidates(cfg, per_rank) if c < per_rank]
    # What does not grow with the chunk: state, the per-rank batch, gathered units (the loss's buffers do not
    # either, but a step without caching has none; the line is a guess, every answer is measured).
    fixed = whole.params + whole.buffers + whole.grads + whole.optimizer + whole.inputs + whole.ddp_buckets
    points = [(0, fixed + whole.gathered), (per_rank, whole.peak)]
    lo, hi, best = -1, len(sizes), None
    while hi - lo > 1:
        (c0, p0), (c1, p1) = sorted(points[-2:])
        slope = (p1 - p0) / (c1 - c0) if c1 != c0 else 0.0
        guess = lo + 1
        if slope > 0:
            limit = c0 + (whole.capacity - p0) / slope
            guess = max([i for i, c in enumerate(sizes) if c <= limit], default=lo + 1)
        mid = min(max(guess, lo + 1), hi - 1)
        p = plan(_with_chunk(cfg, sizes[mid]), device, world_size, mfu=mfu, steps=steps)
        points.append((sizes[mid], p.peak))
        if p.fits:
            best, lo = (sizes[mid], p), mid
        else:
            hi = mid
    return best if best is not None else (None, None)


def suggestion(
    cfg: TrainConfig, device: Device, world_size: int, *, mfu: float | None = None, steps: StepSession | None = None
) -> str:
    """What makes a step fit that does not: gradient checkpointing, or sharding when the state alone is too big."""
    if steps is None:
        with session(cfg, device, world_size) as steps:
            return suggestion(cfg, device, world_size, mfu=mfu, steps=steps)
    if not cfg.train.grad_checkpointing:
        ckpt = _with_chunk(cfg, cfg.train.chunk_size, True)
        chunk, p = largest_chunk(ckpt, device, world_size, mfu=mfu, steps=steps)
        if p is not None:
            size = "no chunking" if chunk is None else f"--train.chunk_size {chunk}"
            return f"fits with --train.grad_checkpointing true and {size} (peak {p.peak / GiB:.1f} GiB)"
    smallest = min(chunk_candidates(cfg, cfg.per_rank_batch(world_size)))
    p = plan(_with_chunk(cfg, smallest, True), device, world_size, mfu=mfu, steps=steps)
    state = p.params + p.buffers + p.grads + p.optimizer + p.ddp_buckets
    if state > p.capacity and sharded(cfg, world_size):
        return (
            f"parameters, gradients and optimizer state alone take {state / GiB:.1f} GiB of "
            f"{p.capacity / GiB:.1f} per device: shard them over more devices"
        )
    if state > p.capacity:
        return (
            f"parameters, gradients and optimizer state alone take {state / GiB:.1f} GiB of "
            f"{p.capacity / GiB:.1f}: shard them with --train.strategy fsdp over several devices"
        )
    return f"nothing fits: even chunks of {smallest} with checkpointing peak at {p.peak / GiB:.1f} GiB"


def fmt_gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def fmt_flops(n: int) -> str:
    return f"{n / 1e12:.1f} TFLOP" if n >= 1e12 else f"{n / 1e9:.2f} GFLOP"


def describe(p: Plan) -> list[tuple[str, str]]:
    """The plan as (label, value) rows."""
    rows = [
        ("device", f"{p.device} × {p.world_size} ({p.strategy})"),
        ("batch", f"{p.global_batch} global, {p.per_rank} per device, chunk {p.chunk_size or 'none'}"),
        ("precision", f"{p.precision}, gradient checkpointing {'on' if p.grad_checkpointing else 'off'}"),
        ("parameters", fmt_gib(p.params)),
        ("buffers", fmt_gib(p.buffers)),
        ("gradients", fmt_gib(p.grads)),
        ("optimizer state", fmt_gib(p.optimizer)),
        ("batch inputs", fmt_gib(p.inputs)),
        ("loss buffers", f"{fmt_gib(p.loss)} (gathered embeddings, logits and their gradients)"),
    ]
    if p.ddp_buckets:
        rows.append(("DDP buckets", fmt_gib(p.ddp_buckets)))
    if p.gathered:
        rows.append(("gathered units", f"{fmt_gib(p.gathered)} (FSDP2's unsharded parameters, at the peak)"))
    rows += [
        ("activations", f"{fmt_gib(p.activations)} (and temporaries, at the peak)"),
        ("peak", f"{fmt_gib(p.peak)} of {fmt_gib(p.capacity)} usable: {'fits' if p.fits else 'does NOT fit'}"),
        (
            "FLOPs/step",
            f"{fmt_flops(p.flops)} per device" + (" (extended from 3 and 4 chunks)" if p.extrapolated else ""),
        ),
    ]
    return rows + time_rows(p)


def time_rows(p: Plan) -> list[tuple[str, str]]:
    """Where the plan's time comes from: a measured step rate, the ``--mfu`` override, or neither."""
    m = p.measurement
    if p.mfu is not None:
        if p.step_seconds is None:
            return [("step time", f"--mfu needs the device's peak TFLOP/s (--tflops); {p.device} has none")]
        rows = [
            ("step time", f"{p.step_seconds:.2f} s from the FLOPs at --mfu {p.mfu:g} of {p.tflops:g} TFLOP/s"),
            ("throughput", f"{p.pairs_per_second:,.0f} pairs/s (an --mfu override, not a measurement)"),
        ]
        if m is not None:
            rows.append(("measured", m.describe()))
        return rows
    if m is None or p.step_seconds is None:
        elsewhere = ", ".join(p.measured_devices) or "no device"
        return [
            (
                "step time",
                f"not measured on {p.device} (this model family, {p.family[0]} + {p.family[1]}, is measured on: "
                f"{elsewhere}); --mfu F derives a time from the FLOPs",
            )
        ]
    scale = f" × {p.world_size} devices" if p.world_size > 1 else ""
    return [
        ("step time", f"{p.step_seconds:.2f} s"),
        ("throughput", f"{p.pairs_per_second:,.0f} pairs/s = {m.pairs_per_s:g} measured per device{scale}"),
        ("measured", m.describe()),
        (
            "assumes",
            "pairs/s per device as measured at this batch and world size; communication not counted"
            + (f"; measured at {', '.join(p.differs)}" if p.differs else ""),
        ),
    ]


# ---------------------------------------------------------------------------------------------- validation

# Small steps the CPU runs for real: presets, batches and chunk sizes, checkpointing and precision varied.
# (label, overrides of nano_cpu with the EfficientNet image tower the plans are for, processes: several run FSDP2
# over gloo, and each rank's peak is compared)
VALIDATION_CASES: tuple[tuple[str, dict[str, Any], int], ...] = (
    ("nano b32", {"train.batch_size": 32}, 1),
    ("nano b32 chunk 8", {"train.batch_size": 32, "train.chunk_size": 8}, 1),
    ("nano b32 chunk 8 ckpt", {"train.batch_size": 32, "train.chunk_size": 8, "train.grad_checkpointing": True}, 1),
    ("nano b16 ckpt", {"train.batch_size": 16, "train.grad_checkpointing": True}, 1),
    # bf16 at 64 rows: CPU bf16 kernels hold scratch no tensor owns (oneDNN's), a large share of a smaller step's
    # peak; a plan counts tensors, and keeps a reserve for such workspaces on GPUs.
    ("nano b64 bf16", {"train.batch_size": 64, "train.precision": "bf16"}, 1),
    (
        "nano ghost-bn b32 chunk 16",
        {
            "train.batch_size": 32,
            "train.chunk_size": 16,
            "model.image.batch_norm": "virtual",
            "model.image.virtual_batch_size": 8,
        },
        1,
    ),
    (
        "b0-mini 32px b8 chunk 4",
        {
            "model.preset": "b0-mini",
            "model.image_size": 32,
            "train.batch_size": 8,
            "train.chunk_size": 4,
            "data.max_text_length": 16,
        },
        1,
    ),
    (
        "nano fsdp×2 b32 chunk 8",
        {"train.batch_size": 32, "train.chunk_size": 8, "train.strategy": "fsdp"},
        2,
    ),
    # Sharded and checkpointed, the step's own tensors are small, and its peak falls in the last block's
    # depthwise-convolution backward, where oneDNN holds scratch of a fixed size whatever the batch: at 8 rows a
    # rank that is a large share of its peak, so these cases take 32 and 64 rows a rank. The second is extended
    # from three and four chunks.
    ("nano fsdp×2 b64 ckpt", {"train.batch_size": 64, "train.grad_checkpointing": True, "train.strategy": "fsdp"}, 2),
    ("nano fsdp×2 b128 chunk 8", {"train.batch_size": 128, "train.chunk_size": 8, "train.strategy": "fsdp"}, 2),
)


TOLERANCE = 0.20  # the largest relative error of a predicted peak that validation accepts


@dataclass
class Check:
    """A planned step against the same step run for real on the CPU."""

    label: str
    predicted_peak: int
    measured_peak: int
    predicted_flops: int
    measured_flops: int

    @property
    def error(self) -> float:
        return (self.predicted_peak - self.measured_peak) / self.measured_peak


def measured_step(cfg: TrainConfig, rows: int, bf16: bool) -> tuple[int, int]:
    """(peak bytes allocated, FLOPs) of one real step of ``rows`` rows on the CPU.

    The peak comes from the CPU allocator itself, not from tensors: PyTorch's profiler with
    ``profile_memory`` records every allocation and free the allocator makes (kernels' scratch buffers
    included), and the running sum of those events is the bytes the process holds. Recording starts before
    the model exists, so the sum is absolute; the peak is taken from the step's start on, as the plan's is
    (building the model and the optimizer state is not part of a step). ``tracemalloc`` would see Python's
    allocator, not torch's, and a dispatch-mode counter would count the way the plan does. FLOPs come from
    the counter the plan uses, on real tensors. Depthwise convs run as convs (``direct_depthwise``), as in
    the plan, not as the matmul the CPU otherwise takes for tiny maps.
    """
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        s = build_step(cfg, rows, bf16)
        counter = flop_counter()
        with counter, record_function("openalign.step"), direct_depthwise():
            run_step(s)
        del s
    assert prof.profiler is not None
    raw = prof.profiler.kineto_results.events()
    start = min(e.start_ns() for e in raw if e.name() == "openalign.step")
    events = sorted((e.start_ns(), e.nbytes()) for e in raw if e.name() == "[memory]")
    live = peak = 0
    for at, delta in events:
        live += delta
        if at >= start:
            peak = max(peak, live)
    return peak, int(counter.get_total_flops())


def validate(cases: tuple[tuple[str, dict[str, Any], int], ...] = VALIDATION_CASES) -> list[Check]:
    """Plan each case on the CPU, run it for real, compare peaks and FLOPs (with several processes: the
    largest rank's peak, and rank 0's FLOPs, against the plan of rank 0). The cases of one world size run on
    one set of gloo ranks, one after another."""
    from openalign.train.config import load_train_config

    cpu = device_spec("cpu")
    configs = [
        load_train_config("nano_cpu", {"train.precision": "fp32", "model.image.family": "efficientnet", **overrides})
        for _, overrides, _ in cases
    ]
    plans = [plan(cfg, cpu, world) for cfg, (_, _, world) in zip(configs, cases, strict=True)]
    measured: dict[int, tuple[int, int]] = {}
    for world in sorted({world for *_, world in cases}):
        ours = [i for i, (*_, w) in enumerate(cases) if w == world]
        steps = [(configs[i], plans[i].precision == "bf16") for i in ours]
        if world == 1:
            for i, (cfg, bf16) in zip(ours, steps, strict=True):
                measured[i] = measured_step(cfg, cfg.per_rank_batch(1), bf16)
        else:
            for i, ranks in zip(ours, measured_ranks(steps, world), strict=True):
                measured[i] = (max(r[0] for r in ranks), ranks[0][1])
    out = []
    for i, ((label, _, _), p) in enumerate(zip(cases, plans, strict=True)):
        peak, flops = measured[i]
        out.append(Check(label, p.peak, peak, p.flops, flops))
    return out


def measured_ranks(steps: list[tuple[TrainConfig, bool]], world_size: int) -> list[list[tuple[int, int]]]:
    """(peak bytes, FLOPs) of one real step of each (config, bf16) on each of ``world_size`` CPU processes
    joined over gloo: ``[step][rank]``. The ranks are spawned and joined once and run the steps in turn, each
    measured from its own start (``measured_step``), as one process runs single-rank steps."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="openalign-plan-") as tmp:
        mp.start_processes(
            _measured_rank,
            args=(world_size, steps, tmp),
            nprocs=world_size,
            start_method="spawn",
        )
        by_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world_size)]
    return [[by_rank[r][i] for r in range(world_size)] for i in range(len(steps))]


def _measured_rank(rank: int, world_size: int, steps: list[tuple[TrainConfig, bool]], tmp: str) -> None:
    from openalign.train.distributed import cleanup, open_group

    # One thread per rank: the ranks share the cores, and kernels' scratch should not depend on their count.
    torch.set_num_threads(1)
    store = f"file://{os.path.join(tmp, 'store')}"
    open_group("gloo", init_method=store, rank=rank, world_size=world_size)
    results = []
    try:
        for cfg, bf16 in steps:
            gc.collect()  # the last step's garbage is not freed inside this one's measured step
            results.append(measured_step(cfg, cfg.per_rank_batch(world_size), bf16))
    finally:
        cleanup()
    torch.save(results, os.path.join(tmp, f"rank{rank}.pt"))
    skip_exit_collection()
