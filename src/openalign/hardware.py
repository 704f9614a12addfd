"""What this machine's processors can do: the CPU's from the flags the Linux kernel lists in ``/proc/cpuinfo``
(where the file cannot be read, no flag is known and every caller takes its portable path), a GPU's from its
compute capability.
"""

from __future__ import annotations

import functools
import re

import torch


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first processor's feature flags (``avx512_bf16``, ``amx_bf16``, …); empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def cpu_has_bfloat16_dot() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX); elsewhere it is emulated, slower."""
    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})


def cpu_has_amx() -> bool:
    """Whether this process can use AMX's bfloat16 tile multiply (Xeon Sapphire Rapids and later), where oneDNN
    runs bfloat16 convolutions and their backward several times faster than float32; with AVX512-BF16 alone they
    run slower than float32. The CPU must have it and the kernel must grant this process the tile registers
    (Linux does on request since 5.16; PyTorch asks as oneDNN would): where it refuses, oneDNN falls back to
    AVX512-BF16 kernels."""
    if "amx_bf16" not in cpu_flags():
        return False
    request = getattr(torch.cpu, "_init_amx", None)
    return bool(request()) if request is not None else True


def cuda_computes_bfloat16(device: torch.device | str | int | None = None) -> bool:
    """Whether a CUDA device computes in bfloat16 in hardware: NVIDIA GPUs of compute capability 8.0 (Ampere)
    and later, and AMD GPUs under ROCm. Older NVIDIA GPUs (V100, T4) hold bfloat16 values but emulate its
    matrix products in float32, slower than float32 itself, and cuDNN has no bfloat16 convolutions for them;
    ``torch.cuda.is_bf16_supported()`` answers True there by default, as a tensor can be made."""
    if torch.version.hip:
        return True
    return torch.cuda.get_device_capability(device) >= (8, 0)


def cuda_compile_blocker(device: torch.device | str | int | None = None) -> str | None:
    """Why ``torch.compile`` cannot generate kernels for a CUDA device, or None where it can. Inductor writes a
    GPU's kernels in Triton, which needs the ``triton`` package (PyTorch's Linux CUDA wheels bring it) and
    compute capability 7.0 (V100) or later: without either the first compiled call fails."""
    from torch.utils._triton import has_triton_package

    if not has_triton_package():
        return "compiling for a GPU needs the triton package, which is not installed"
    if torch.version.hip:
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if major < 7:
        return f"Triton compiles for GPUs of compute capability 7.0 and later, and this one's is {major}.{minor}"
    return None


def out_of_memory_figures(message: str) -> tuple[str | None, str | None, str | None]:
    """From the message of PyTorch's ``OutOfMemoryError``: the allocation that failed, the GPU's capacity and
    what was free of it ("2.50 GiB"), each None where the message does not say."""
    size = r"([\d.]+ [KMGT]?i?B)"
    asked = re.search(rf"Tried to allocate {size}", message)
    room = re.search(rf"total capacity of {size} of which {size} is free", message)
    return (asked.group(1) if asked else None, *((room.group(1), room.group(2)) if room else (None, None)))
