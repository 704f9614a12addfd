"""A model's weights as files hold them: safetensors files read, and a state dict checked against the model it
is to load into, so that a damaged file or a checkpoint of another shape is one line naming it."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from openalign.config import ConfigError


def read_safetensors(file: str | Path, map_location: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file; a truncated or corrupt one is a one-line ConfigError naming it."""
    try:
        return load_file(str(file), device=str(map_location))
    except OSError:
        raise
    except Exception as err:  # safetensors' SafetensorError (a cut-off file, a bad header) and its kin
        text = " ".join(str(err).split()).split(". ")[0].rstrip(".") or type(err).__name__
        raise ConfigError(f"{file}: truncated or corrupt safetensors file ({text[:160]})") from None


def check_fits(where: str | Path, expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> None:
    """A one-line ConfigError when ``given`` cannot load into a model whose state is ``expected``: the first
    mismatching tensor (name, checkpoint shape vs model shape) and how many tensors do not fit."""
    problems = mismatches(expected, given)
    if problems:
        more = f"; {len(problems)} tensors do not fit" if len(problems) > 1 else ""
        raise ConfigError(f"{where} does not fit the model its config describes: {problems[0]}{more}")


def mismatches(expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> list[str]:
    """Everything that keeps ``given`` from loading into a model whose state is ``expected`` (names in order)."""
    found = []
    for name, tensor in expected.items():
        if name not in given:
            if name.endswith("num_batches_tracked"):
                continue  # not saved by every transformers version; unused in eval
            found.append(f"{name} is missing")
        elif tuple(given[name].shape) != tuple(tensor.shape):
            found.append(f"{name} has shape {list(given[name].shape)}, the model expects {list(tensor.shape)}")
    found += [f"{name} is not a parameter of the model" for name in given if name not in expected]
    return found


def first_mismatch(expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> str | None:
    """What first keeps ``given`` from loading into a model whose state is ``expected`` (names in order), or None."""
    found = mismatches(expected, given)
    return found[0] if found else None
