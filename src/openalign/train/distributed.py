"""Process groups and model wrapping: one process, torchrun DDP, or FSDP2 for models beyond one device.

``torchrun`` (single node or ``--nnodes N --node-rank i --rdzv-endpoint host:port``) sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous address; the process group is initialised from them,
with NCCL on GPUs and gloo on CPUs. Without them training runs in one process.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DistInfo",
    "all_gather_object",
    "average_replicated_grads",
    "broadcast_object",
    "cleanup",
    "fsdp_no_sync",
    "grad_norm",
    "init_distributed",
    "is_distributed",
    "open_group",
    "replicated_params",
    "unwrap",
    "wrap_model",
]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, world size, rank on its node, and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _pick_device(device: str, local_rank: int) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("train.device is 'cuda' but no CUDA device is available")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if device != "cpu":
        raise ValueError(f"train.device must be auto, cpu or cuda, got {device!r}")
    return torch.device("cpu")


def init_distributed(device: str = "auto", timeout_minutes: float = 30.0) -> DistInfo:
    """Join the process group torchrun describes in the environment, or run alone without one.

    Idempotent: a process group that already exists (tests, notebooks) is reused as it is.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        dev = _pick_device(device, local_rank)
    else:
        dev = _pick_device(device, local_rank)
        if world > 1:
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
            timeout = timedelta(minutes=timeout_minutes)
            if dev.type == "cuda":
                open_group("nccl", timeout=timeout, device_id=dev)
            else:
                open_group("gloo", timeout=timeout)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev)


def open_group(backend: str, **kwargs: Any) -> None:
    """``dist.init_process_group(backend, **kwargs)``, with ``torch._dynamo`` imported first.

    Importing ``torch._dynamo`` while a group exists (DDP's constructor does, when nothing did before) keeps
    that group alive for good: destroying it then does not join gloo's worker threads, which still run while
    the interpreter finalizes. One that drops a finished collective's tensors needs the GIL, a finalizing
    interpreter ends that thread instead, and the process aborts ("terminate called without an active
    exception") after its work is done."""
    importlib.import_module("torch._dynamo")
    dist.init_process_group(backend, **kwargs)


def cleanup() -> None:
    """Destroys the default process group, which must then be held by nothing else.

    A DDP reducer holds the group from C++ and keeps the GIL while it is destroyed. If it drops the group's last
    reference, the group's destructor joins gloo's worker threads with the GIL held, while one of them, dropping
    the tensors of the collective that just finished, waits for the GIL: the process hangs. The Python handle
    ``destroy_process_group`` drops releases the GIL before destroying the group, so callers let go of their
    wrappers first; collecting here frees any that only the cyclic collector would, while that handle lives."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def _shard_units(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of both towers: each becomes one FSDP unit, gathered just before it runs."""
    units: list[nn.Module] = []
    for tower in (getattr(model, "image", None), getattr(model, "text", None)):
        for name in ("blocks", "layers"):
            blocks = getattr(tower, name, None)
            if isinstance(blocks, nn.ModuleList):
                units.extend(blocks)
    return units


def wrap_model(
    model: nn.Module,
    info: DistInfo,
    strategy: Literal["ddp", "fsdp"] = "ddp",
    *,
    bf16: bool = False,
    mesh: Any = None,
) -> nn.Module:
    """Wrap ``model`` (already on ``info.device``) for data-parallel training; unchanged in one process.

    ``ddp``: every rank keeps the whole model and gradients are averaged. ``fsdp``: FSDP2
    (``fully_shard``) shards parameters, gradients and optimizer state per block, so a model that does
    not fit one device (EfficientNet-L2 + BERT-Large with a 16k batch) still trains; with ``bf16`` the
    gathered parameters are cast to bf16 for compute while gradients are reduced in fp32. ``mesh``: the
    FSDP device mesh, made from the process group when not given (a plan makes it before faking tensors).
    """
    if info.world_size == 1:
        return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [info.device.index] if info.device.type == "cuda" else None
        # Batch statistics stay per rank (per-device BN, as on TPU cores); DDP's buffer broadcast keeps
        # every rank's running statistics equal to rank 0's, which is what checkpoints save.
        return DistributedDataParallel(model, device_ids=ids)
    if strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        kwargs: dict[str, Any] = {"mp_policy": policy} if policy is not None else {}
        if mesh is not None:
            kwargs["mesh"] = mesh
        # FSDP2 shards only contiguous tensors: NHWC conv weights go back to NCHW (activations stay NHWC).
        for p in model.parameters():
            if not p.is_contiguous():
                p.data = p.data.contiguous()
        for unit in _shard_units(model):
            fully_shard(unit, **kwargs)
        # FSDP2 cannot shard 0-dim tensors (the temperature): they stay replicated, their gradients averaged
        # by average_replicated_grads after each backward.
        fully_shard(model, ignored_params=set(replicated_params(model)), **kwargs)
        return model
    raise ValueError(f"train.strategy must be ddp or fsdp, got {strategy!r}")


def replicated_params(model: nn.Module) -> list[nn.Parameter]:
    """Parameters FSDP2 leaves unsharded (0-dim ones), whose gradients must be averaged by hand."""
    return [p for p in model.parameters() if p.dim() == 0]


def average_replicated_grads(params: list[nn.Parameter]) -> None:
    """Mean over ranks of the gradients FSDP does not reduce (one collective for all of them)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or not is_distributed():
        return
    flat = torch.stack([g.reshape(()) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for g, value in zip(grads, flat.unbind(0), strict=True):
        g.copy_(value)


@contextlib.contextmanager
def fsdp_no_sync(model: nn.Module) -> Iterator[None]:
    """FSDP2's counterpart of DDP's ``no_sync``: gradients accumulate unsharded, reduce-scattered on leaving
    the next backward that runs outside it (the last chunk's)."""
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of the parameters' gradients, whole even where FSDP shards them."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads)
    full = getattr(norm, "full_tensor", None)  # FSDP: a replicated DTensor
    return full() if full is not None else norm


def unwrap(model: nn.Module) -> nn.Module:
    """The bare module inside a DDP wrapper (FSDP2 shards in place and needs no unwrapping)."""
    return getattr(model, "module", model)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` from rank ``src`` on every rank (the object itself when not distributed)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, by rank, on every rank."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
