"""Whether a compiled contender trains the model its eager self trains: one step's gradients, compiled against eager.

A compiled step that is fast but computes other gradients is not the same training, and its speed is no figure to
compare with. ``bench model --compile`` therefore takes, on the same weights and batch, one compiled step's
gradients and one eager step's (``torch.compiler.set_stance("force_eager")``: the same functions, uncompiled) and
compares them by parameter group (the first part of a parameter's name: a tower, a projection, the temperature).
Dropout draws other masks in the two steps, so the verdict reads each group's gradient norm, compiled over eager,
which dropout moves by a few percent and a lost or rescaled term moves by its whole size (transformers'
``AlignModel`` pools its image features with ``AvgPool2d(hidden_dim, ceil_mode=True)``, whose backward inductor
divides by the whole kernel, ``hidden_dim``², not by the part of it inside the map: its compiled image tower gets
gradients 65,000 times too small on B7 at 289 px; the benches race it with that pooling as a mean,
``openalign.bench.peer``).
The relative difference of the two gradients is reported beside it: near rounding without dropout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# A group's compiled gradient norm within this factor of its eager one agrees (dropout moves it a few percent).
NORM_FACTOR = 1.5


def gradients(model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Copies of the parameters' gradients by group (the name's first part), by parameter name."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            groups.setdefault(name.split(".")[0], {})[name] = p.grad.detach().to(torch.float32, copy=True)
    return groups


def compare(eager: dict[str, dict[str, torch.Tensor]], compiled: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Per group: the compiled gradient's norm over the eager one's, and ``|compiled - eager| / |eager|``; the
    groups whose norm ratio lies outside ``NORM_FACTOR``, or that have a gradient in the compiled step only; and
    ``agree``. A parameter (or a whole group) without a gradient in one step counts as a zero gradient there: a
    compiled graph hands a parameter its output does not use zeros where eager leaves none (transformers' text
    pooler, when the whole model is compiled), which trains the same model. Groups with no gradient in either
    step are left out."""
    groups: dict[str, dict[str, float]] = {}
    apart = []
    for group in sorted(set(eager) | set(compiled)):
        e, c = eager.get(group, {}), compiled.get(group, {})
        if any(e[name].shape != c[name].shape for name in e.keys() & c.keys()):
            apart.append(group)
            continue
        names = sorted(e.keys() | c.keys())
        e_grads = [e[n] if n in e else torch.zeros_like(c[n]) for n in names]
        c_grads = [c[n] if n in c else torch.zeros_like(e[n]) for n in names]
        e_norm, c_norm = _norm(e_grads), _norm(c_grads)
        if e_norm == 0.0:
            if c_norm > 0.0:
                apart.append(group)
            continue
        diff = _norm([a - b for a, b in zip(c_grads, e_grads, strict=True)])
        ratio = c_norm / e_norm
        groups[group] = {"norm_ratio": ratio, "rel_error": diff / e_norm}
        if not 1 / NORM_FACTOR <= ratio <= NORM_FACTOR:
            apart.append(group)
    return {"groups": groups, "apart": apart, "agree": not apart}


def _norm(tensors: list[torch.Tensor]) -> float:
    """The L2 norm of the tensors taken as one vector (as the loop's gradient norm, ``get_total_norm``)."""
    return float(torch.nn.utils.get_total_norm(tensors))


def check(step: Callable[[], None], model: torch.nn.Module) -> dict[str, Any]:
    """``step()`` (forward and backward, leaving the gradients in place) run compiled, then eager on the same
    weights; both steps' gradients compared (``compare``). The caller's step must not update the weights."""
    model.zero_grad(set_to_none=True)
    step()
    compiled = gradients(model)
    model.zero_grad(set_to_none=True)
    with torch.compiler.set_stance("force_eager"):
        step()
    eager = gradients(model)
    model.zero_grad(set_to_none=True)
    return compare(eager, compiled)


def describe(which: str, result: dict[str, Any]) -> str:
    """One line: each group's norm ratio and difference, and the verdict."""
    groups = result["groups"].items()
    parts = [f"{name} {g['norm_ratio']:.3g}x norm, {100 * g['rel_error']:.2g} % apart" for name, g in groups]
    verdict = "agree" if result["agree"] else f"DO NOT AGREE ({', '.join(result['apart'])})"
    return f"{which:>12} compiled gradients against eager, one step: {'; '.join(parts)}: {verdict}"


def report(results: dict[str, dict[str, Any]], contenders: list[str]) -> tuple[list[str], str]:
    """A bench's verdicts: ``describe``'s line for each contender checked, and the note its ratio line carries
    (empty when every checked contender agrees): a compiled contender whose gradients are not its eager ones
    trains another model."""
    checked = [w for w in contenders if results.get(w, {}).get("gradients") is not None]
    lines = [describe(w, results[w]["gradients"]) for w in checked]
    wrong = [w for w in checked if not results[w]["gradients"]["agree"]]
    return lines, f" ({' and '.join(wrong)} compiled: gradients unlike its eager ones)" if wrong else ""
