"""Optimisers, parameter grouping and learning-rate schedules for ALIGN training and fine-tuning.

Pre-training recipe (Jia et al. 2021, Sec. 5): LAMB with peak lr 1e-3, weight decay 1e-5, linear warmup
over 10k steps then linear decay to zero at 1.2M steps. Weight decay and the layer-wise trust ratio apply to
weight matrices and kernels only; biases, normalisation parameters and the learned temperature take a plain
Adam step.

Fine-tuning recipes use SGD with momentum 0.9 and a step (x0.2 every 30 epochs) or cosine schedule, often
with a smaller learning rate on the backbone, expressed here through ``lr_scales``.

Exclusion rule (``param_groups``): a parameter skips weight decay and the trust ratio when any module that
owns it is a normalisation layer (see ``NORM_TYPES``), when its attribute name on an owning module is
``bias``, or when a module declares it through a ``no_weight_decay()`` method returning names relative to
that module (the dual encoder declares its temperature this way; a custom normalisation layer can declare
``{"weight"}``). Other 0-d and 1-d parameters are NOT excluded by shape: the paper's rule is by role, the
rules above already cover every such parameter in EfficientNet and BERT, and a shape heuristic would
silently change the recipe for anything new.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast, overload

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

__all__ = [
    "NORM_TYPES",
    "SCHEDULES",
    "GroupLRScheduler",
    "Lamb",
    "OptimConfig",
    "build_optimizer",
    "build_schedule",
    "build_scheduler",
    "constant",
    "param_groups",
    "step_decay",
    "warmup_cosine",
    "warmup_linear_decay",
]

# _NormBase covers BatchNorm{1,2,3}d, SyncBatchNorm, InstanceNorm* and their lazy variants.
NORM_TYPES: tuple[type[nn.Module], ...] = (
    _NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)

OPTIMIZERS = ("adamw", "lamb", "sgd")


# ----------------------------------------------------------------------------------------------------------
# LAMB
# ----------------------------------------------------------------------------------------------------------


def _check_hparams(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float, max_trust: float | None
) -> None:
    # Written so NaN fails too (every comparison with it is False); an infinite lr or decay turns the first
    # step's weights into NaN while its loss still looks fine.
    if not 0.0 <= lr < math.inf:
        raise ValueError(f"lr must be finite and >= 0, got {lr}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two values in [0, 1), got {betas}")
    if not 0.0 <= eps < math.inf:
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    if not 0.0 <= weight_decay < math.inf:
        raise ValueError(f"weight_decay must be finite and >= 0, got {weight_decay}")
    if max_trust is not None and not 0.0 < max_trust < math.inf:
        raise ValueError(f"max_trust_ratio must be finite and > 0, or None, got {max_trust}")


# torch.optim.Optimizer wraps these methods in torch._disable_dynamo, which imports torch._dynamo at their first
# call: about as long as importing torch itself, paid by every eager training process (each spawned run, each
# rank) that never compiles anything. Lamb's own step leaves it unimported; torch's AdamW and
# SGD import it in theirs.
def _base_method(name: str) -> Callable[..., Any]:
    wrapped = getattr(torch.optim.Optimizer, name)
    if "torch._dynamo" in sys.modules:
        return cast(Callable[..., Any], wrapped)
    # Without torch._dynamo loaded nothing is being compiled, so the wrapper's only effect would be the import.
    return cast(Callable[..., Any], getattr(wrapped, "__wrapped__", wrapped))


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020, Algorithm 2) with per-group control of the trust ratio.

    Per parameter ``w`` with gradient ``g`` at step ``t``::

        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        r = m_hat / (sqrt(v_hat) + eps)          # m_hat, v_hat bias-corrected unless bias_correction=False
        u = r + weight_decay * w
        w = w - lr * trust * u,   trust = ||w|| / ||u||  (1 when either norm is 0; clamped to max_trust_ratio)

    Groups with ``trust_ratio=False`` use ``trust = 1``: an AdamW step with the decay inside the update, or
    plain Adam when their weight decay is 0 (how ``param_groups`` configures biases, norms and the
    temperature). The default weight decay is 0 so that a bare ``Lamb(model.parameters())`` never decays
    biases or norms; pass groups from ``param_groups`` to get the paper's split.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        *,
        trust_ratio: bool = True,
        max_trust_ratio: float | None = None,
        bias_correction: bool = True,
    ) -> None:
        _check_hparams(lr, betas, eps, weight_decay, max_trust_ratio)
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "trust_ratio": trust_ratio,
            "max_trust_ratio": max_trust_ratio,
            "bias_correction": bias_correction,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _base_method("add_param_group")(self, param_group)
        # Groups may override any default, so validate what they ended up with, not just the constructor args.
        g = self.param_groups[-1]
        _check_hparams(g["lr"], g["betas"], g["eps"], g["weight_decay"], g["max_trust_ratio"])

    # Optimizer's own methods, without importing torch._dynamo where nothing compiles (``_base_method``).
    def zero_grad(self, set_to_none: bool = True) -> None:
        _base_method("zero_grad")(self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return cast(dict[str, Any], _base_method("state_dict")(self))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _base_method("load_state_dict")(self, state_dict)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # State dicts written before a key existed load with the default behaviour.
        for group in self.param_groups:
            group.setdefault("trust_ratio", True)
            group.setdefault("max_trust_ratio", None)
            group.setdefault("bias_correction", True)

    # The overloads of torch's Optimizer.step: a closure's loss comes back, no closure gives None.
    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # _foreach kernels need one device and dtype per call.
            buckets: dict[tuple[torch.device, torch.dtype], tuple[list, list, list, list, list[int]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients; use a dense embedding")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                params, grads, exp_avgs, exp_avg_sqs, steps = buckets.setdefault(
                    (p.device, p.dtype), ([], [], [], [], [])
                )
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            for params, grads, exp_avgs, exp_avg_sqs, steps in buckets.values():
                self._update(group, params, grads, exp_avgs, exp_avg_sqs, steps)
        return loss

    @staticmethod
    def _update(
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        steps: list[int],
    ) -> None:
        beta1, beta2 = group["betas"]
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)

        # r = m_hat / (sqrt(v_hat) + eps) = m / (c1 * sqrt(v) / sqrt(c2) + c1 * eps) with c = 1 - beta^t: both
        # corrections fold into the denominator (eps stays outside them, as in Adam) and save a full pass.
        eps = group["eps"]
        denom = torch._foreach_sqrt(exp_avg_sqs)
        if group["bias_correction"]:
            c1 = [1.0 - beta1**t for t in steps]
            torch._foreach_mul_(denom, [c / math.sqrt(1.0 - beta2**t) for c, t in zip(c1, steps, strict=True)])
            torch._foreach_add_(denom, [c * eps for c in c1])
        else:
            torch._foreach_add_(denom, eps)
        updates = torch._foreach_div(exp_avgs, denom)
        if group["weight_decay"] != 0.0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])

        if not group["trust_ratio"]:
            torch._foreach_add_(params, updates, alpha=-group["lr"])
            return
        w_norm = torch.stack(torch._foreach_norm(params))
        u_norm = torch.stack(torch._foreach_norm(updates))
        # Kept on-device with torch.where: no host sync per step.
        trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
        if group["max_trust_ratio"] is not None:
            trust.clamp_(max=group["max_trust_ratio"])
        # The 0-d trust factors broadcast, so scaling and applying the update is one pass.
        torch._foreach_addcmul_(params, updates, trust.unbind(0), value=-group["lr"])


# ----------------------------------------------------------------------------------------------------------
# Parameter groups
# ----------------------------------------------------------------------------------------------------------


def _resolve_scale(names: list[str], lr_scales: dict[str, float], used: set[str]) -> float:
    """Scale for a parameter known under ``names`` (aliases of a tied tensor); exact name beats prefix."""
    found: set[float] = set()
    for name in names:
        if name in lr_scales:
            used.add(name)
            found.add(lr_scales[name])
            continue
        prefixes = [k for k in lr_scales if k.endswith(".") and name.startswith(k)]
        if prefixes:
            key = max(prefixes, key=len)
            used.add(key)
            found.add(lr_scales[key])
    if len(found) > 1:
        raise ValueError(f"lr_scales give conflicting scales {sorted(found)} to shared parameter {names}")
    return found.pop() if found else 1.0


def param_groups(
    model: nn.Module, weight_decay: float, *, lr_scales: dict[str, float] | None = None
) -> list[dict[str, Any]]:
    """Split trainable parameters into decayed (trust ratio on) and excluded (no decay, no trust) groups.

    See the module docstring for the exclusion rule. ``lr_scales`` maps an exact parameter name, or a module
    prefix ending in ".", to a learning-rate multiplier; the exact name wins, then the longest prefix. Every
    group carries ``names``, ``weight_decay``, ``trust_ratio`` and ``lr_scale``; decayed groups come first and
    empty groups are omitted. Names in ``no_weight_decay()`` or keys of ``lr_scales`` that match no parameter
    raise ValueError, so a typo cannot silently fall back to the default treatment.
    """
    if not 0.0 <= weight_decay < math.inf:
        raise ValueError(f"weight_decay must be finite and >= 0, got {weight_decay}")
    lr_scales = dict(lr_scales or {})
    for key, scale in lr_scales.items():
        if not 0.0 <= scale < math.inf:
            raise ValueError(f"lr_scales[{key!r}] must be finite and >= 0, got {scale}")

    # Tied weights appear under several names and owners; any owner's rule excludes the tensor.
    aliases: dict[int, list[str]] = {}
    excluded: set[int] = set()
    tensors: dict[int, nn.Parameter] = {}
    declared: set[str] = set()
    for mod_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        no_wd = getattr(module, "no_weight_decay", None)
        if callable(no_wd):
            declared.update(prefix + n for n in no_wd())
        for attr, p in module.named_parameters(recurse=False):
            aliases.setdefault(id(p), []).append(prefix + attr)
            tensors[id(p)] = p
            if isinstance(module, NORM_TYPES) or attr == "bias":
                excluded.add(id(p))

    all_names = {n for names in aliases.values() for n in names}
    unknown = sorted(declared - all_names)
    if unknown:
        raise ValueError(f"no_weight_decay() names unknown parameters: {', '.join(unknown)}")
    excluded.update(pid for pid, names in aliases.items() if declared.intersection(names))

    used: set[str] = set()
    groups: dict[tuple[bool, float], dict[str, Any]] = {}
    for pid, names in aliases.items():
        scale = _resolve_scale(names, lr_scales, used)
        p = tensors[pid]
        if not p.requires_grad:
            continue
        is_excluded = pid in excluded
        group = groups.setdefault(
            (is_excluded, scale),
            {
                "params": [],
                "names": [],
                "weight_decay": 0.0 if is_excluded else weight_decay,
                "trust_ratio": not is_excluded,
                "lr_scale": scale,
            },
        )
        group["params"].append(p)
        group["names"].append(names[0])
    unmatched = sorted(set(lr_scales) - used)
    if unmatched:
        raise ValueError(f"lr_scales keys match no parameter: {', '.join(unmatched)}")
    # Stable sort keeps first-appearance order within the decayed and excluded halves.
    return [groups[k] for k in sorted(groups, key=lambda k: k[0])]


# ----------------------------------------------------------------------------------------------------------
# Schedules: multipliers of the peak lr, usable directly as LambdaLR lambdas.
# ----------------------------------------------------------------------------------------------------------


def _check_horizon(warmup_steps: int, total_steps: int) -> None:
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")


def warmup_linear_decay(step: int, warmup_steps: int, total_steps: int) -> float:
    """0 at step 0, 1 at ``warmup_steps``, linear to 0 at ``total_steps`` and 0 after.

    With ``warmup_steps >= total_steps`` training ends mid-warmup: the ramp is kept and the value drops to 0
    at ``total_steps``, so the horizon always wins and the peak is never overshot.
    """
    _check_horizon(warmup_steps, total_steps)
    step = max(step, 0)
    if step >= total_steps:
        return 0.0
    if step < warmup_steps:
        return step / warmup_steps
    return (total_steps - step) / (total_steps - warmup_steps)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, final: float = 0.0) -> float:
    """Linear warmup to 1, then half-cosine from 1 to ``final`` at ``total_steps``; ``final`` after."""
    _check_horizon(warmup_steps, total_steps)
    if not 0.0 <= final <= 1.0:
        raise ValueError(f"final must be in [0, 1], got {final}")
    step = max(step, 0)
    if step >= total_steps:
        return final
    if step < warmup_steps:
        return step / warmup_steps
    progress = (step - warmup_steps) / (total_steps - warmup_steps)
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


def step_decay(step: int, every: int, gamma: float) -> float:
    """``gamma ** (step // every)``; the fine-tuning recipe is every=30 epochs' worth of steps, gamma=0.2."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    if not 0.0 < gamma < math.inf:
        raise ValueError(f"gamma must be finite and > 0, got {gamma}")
    return gamma ** (max(step, 0) // every)


def constant(step: int, warmup_steps: int = 0) -> float:
    """1 after an optional linear warmup."""
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    return 1.0 if step >= warmup_steps else max(step, 0) / warmup_steps


SCHEDULES: dict[str, Callable[..., float]] = {
    "constant": constant,
    "step_decay": step_decay,
    "warmup_cosine": warmup_cosine,
    "warmup_linear_decay": warmup_linear_decay,
}


def build_schedule(name: str, **kw: Any) -> Callable[[int], float]:
    """Bind a named schedule's arguments into ``step -> multiplier``, checking them now, not mid-run."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; valid: {', '.join(sorted(SCHEDULES))}")
    fn = SCHEDULES[name]
    try:
        inspect.signature(fn).bind(0, **kw)
    except TypeError as e:
        accepted = ", ".join(list(inspect.signature(fn).parameters)[1:])
        raise ValueError(f"schedule {name!r}: {e}; accepts: {accepted}") from None
    schedule = partial(fn, **kw)
    schedule(0)
    return schedule


class GroupLRScheduler:
    """Sets ``group["lr"] = peak_lr * group.get("lr_scale", 1.0) * multiplier(step)`` on every group.

    Unlike LambdaLR it reads ``lr_scale`` on each step, so the scale stays right even if something else
    rewrote a group's lr. Call ``step()`` after ``optimizer.step()``; the lr for step 0 is set on
    construction. Only the step position is checkpointed: peak and multiplier come from the config on resume.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        peak_lr: float,
        multiplier: Callable[[int], float],
        *,
        last_step: int = 0,
    ) -> None:
        if not 0.0 <= peak_lr < math.inf:
            raise ValueError(f"peak_lr must be finite and >= 0, got {peak_lr}")
        self.optimizer = optimizer
        self.peak_lr = peak_lr
        self.multiplier = multiplier
        self.last_step = last_step
        self._apply()

    def _apply(self) -> None:
        m = self.multiplier(self.last_step)
        for group in self.optimizer.param_groups:
            group["lr"] = self.peak_lr * group.get("lr_scale", 1.0) * m

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_step = int(state_dict["last_step"])
        self._apply()


# ----------------------------------------------------------------------------------------------------------
# Config and builders
# ----------------------------------------------------------------------------------------------------------


@dataclass
class OptimConfig:
    name: str = "lamb"  # "lamb" | "adamw" | "sgd"; paper pre-training: LAMB, fine-tuning: SGD
    lr: float = 1e-3  # peak lr; paper pre-training 1e-3, fine-tuning SGD e.g. 0.1
    weight_decay: float = 1e-5  # paper 1e-5; never applied to biases, norms or no_weight_decay() params
    betas: tuple[float, float] = (0.9, 0.999)  # lamb/adamw; paper 0.9, 0.999
    eps: float = 1e-6  # lamb/adamw; paper 1e-6
    momentum: float = 0.9  # sgd only; paper fine-tuning 0.9
    nesterov: bool = False  # sgd only
    max_trust_ratio: float | None = None  # lamb only; clamp on ||w||/||u||, None = unclamped as in the paper
    bias_correction: bool = True  # lamb only; Adam-style m_hat, v_hat
    schedule: str = "warmup_linear_decay"  # see SCHEDULES; paper pre-training: warmup then linear decay
    warmup_steps: int = 10_000  # linear warmup for every schedule but step_decay; paper 10k
    total_steps: int = 1_200_000  # lr reaches 0 (or final_lr_ratio) here; paper 1.2M steps
    decay_every: int | None = None  # step_decay: steps between decays, e.g. 30 epochs' worth; required there
    decay_gamma: float = 0.2  # step_decay factor; paper fine-tuning x0.2
    final_lr_ratio: float = 0.0  # warmup_cosine: final lr as a fraction of the peak
    lr_scales: dict[str, float] = field(default_factory=dict)  # exact name or "prefix." -> lr multiplier

    def __post_init__(self) -> None:
        # YAML/JSON deliver lists; the optimiser state dict expects a tuple.
        self.betas = cast("tuple[float, float]", tuple(self.betas))
        self.validate()

    def validate(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}; valid: {', '.join(OPTIMIZERS)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; valid: {', '.join(sorted(SCHEDULES))}")
        # An optimizer object may hold lr 0 (its groups' lr is the scheduler's to set); a run's peak may not:
        # it would train nothing while looking like it ran.
        if not 0.0 < self.lr < math.inf:
            raise ValueError(f"lr must be finite and > 0, got {self.lr}")
        _check_hparams(self.lr, self.betas, self.eps, self.weight_decay, self.max_trust_ratio)
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.nesterov and self.momentum == 0.0:
            raise ValueError("nesterov requires momentum > 0")
        if self.schedule == "step_decay" and self.decay_every is None:
            raise ValueError("decay_every must be set to a step count when schedule='step_decay'")
        for key, scale in self.lr_scales.items():
            if not 0.0 <= scale < math.inf:
                raise ValueError(f"lr_scales[{key!r}] must be finite and >= 0, got {scale}")
        build_schedule(self.schedule, **_schedule_kwargs(self))


def _schedule_kwargs(cfg: OptimConfig) -> dict[str, Any]:
    if cfg.schedule == "warmup_linear_decay":
        return {"warmup_steps": cfg.warmup_steps, "total_steps": cfg.total_steps}
    if cfg.schedule == "warmup_cosine":
        return {"warmup_steps": cfg.warmup_steps, "total_steps": cfg.total_steps, "final": cfg.final_lr_ratio}
    if cfg.schedule == "step_decay":
        return {"every": cfg.decay_every, "gamma": cfg.decay_gamma}
    return {"warmup_steps": cfg.warmup_steps}


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """Optimizer over ``param_groups(model, ...)``; each group starts at ``cfg.lr * lr_scale``."""
    cfg.validate()
    groups = param_groups(model, cfg.weight_decay, lr_scales=cfg.lr_scales)
    for group in groups:
        group["lr"] = cfg.lr * group["lr_scale"]
    if cfg.name == "lamb":
        return Lamb(
            groups,
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            max_trust_ratio=cfg.max_trust_ratio,
            bias_correction=cfg.bias_correction,
        )
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(
        groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay
    )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> GroupLRScheduler:
    """Scheduler driving every group at ``cfg.lr * lr_scale * schedule(step)``."""
    cfg.validate()
    return GroupLRScheduler(optimizer, cfg.lr, build_schedule(cfg.schedule, **_schedule_kwargs(cfg)))
