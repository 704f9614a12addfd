"""transformers' ``AlignModel`` as the benches race it: built from our config and, where compiled, with its image
pooling written as the mean it computes, so that the compiled peer trains the model its eager self trains.

AlignVision pools its last feature map with ``AvgPool2d(hidden_dim, ceil_mode=True)``: one window of
``hidden_dim``² (2,560² on B7) over a map a few pixels a side, which eager averages over the pixels it covers, i.e.
the map's mean. Inductor's backward of that pooling divides by the whole window (pytorch/pytorch#198119), so
compiled as shipped the model's image tower gets gradients ``hidden_dim² / (h·w)`` times too small (65,000× on B7
at 289 px): another training, whose step time is no figure to race. Compiled, the peer's pooler is therefore the
same mean written as ``x.mean((2, 3))``, whose backward every backend gets right; eager, it runs as it ships.
``bench model --compile`` checks the result (``openalign.bench.gradients``).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import nn

from openalign.config import ConfigError
from openalign.model.hf import model_config_to_hf

HF_INSTALL = 'pip install -e ".[hf]"'


def require_baseline(package: str, baseline: str, instead: str = "--no-baseline to measure only ours") -> None:
    """Refuse, in one line naming the install, a bench whose ``baseline`` needs ``package`` when it is absent:
    the contender would otherwise fail in its own process after ours had run."""
    if importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"the baseline ({baseline}) needs {package}, which is not installed: {HF_INSTALL} (or {instead})"
        )


class MapMean(nn.Module):
    """``AvgPool2d(k, ceil_mode=True)`` where the map is no larger than its window: the mean over the map (eager's
    divisor is the number of pixels the window covers); a larger map goes to the pooling itself."""

    def __init__(self, pool: nn.AvgPool2d) -> None:
        super().__init__()
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.pool.kernel_size
        kh, kw = (k, k) if isinstance(k, int) else k
        if x.shape[-2] <= kh and x.shape[-1] <= kw:
            return x.mean((-2, -1), keepdim=True)
        pooled: torch.Tensor = self.pool(x)
        return pooled


def pools_by_mean(pool: nn.Module) -> bool:
    """Whether ``pool`` is AlignVision's mean pooling as it builds it: one window from the map's corner, over
    every pixel it covers (ceil mode, no padding, padding counted), i.e. the map's mean where the map fits it."""
    return (
        isinstance(pool, nn.AvgPool2d)
        and pool.ceil_mode
        and pool.padding in (0, (0, 0))
        and pool.stride == pool.kernel_size
        and pool.divisor_override is None
    )


def align_model(cfg: Any, compiled: bool = False) -> Any:
    """transformers' ``AlignModel`` of our model config (``model_config_to_hf``), freshly initialised; ``compiled``:
    its image pooler as ``MapMean`` (see the module's docstring)."""
    import transformers

    hf = model_config_to_hf(cfg)
    config = transformers.AlignConfig(
        text_config=hf["text_config"], vision_config=hf["vision_config"], projection_dim=hf["projection_dim"]
    )
    model = transformers.AlignModel(config)
    vision = model.vision_model
    if compiled and pools_by_mean(vision.pooler):
        vision.pooler = MapMean(vision.pooler)  # type: ignore[assignment]  # transformers types it AvgPool2d
    return model
