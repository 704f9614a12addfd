"""The markdown of ``openalign bench gpu``: one table per area, from the check's JSON summary."""

from __future__ import annotations

from typing import Any

from openalign.bench.host import host_line
from openalign.bench.profile import profile_line

__all__ = ["markdown"]

RUNS = {"paper": "the paper's batch", "loop": "the loop beside bench train", "l2": "L2 + BERT-Large"}


def _num(x: Any, fmt: str = ".1f", unit: str = "") -> str:
    return "–" if x is None else f"{x:{fmt}}{unit}"


def _ratio(a: Any, b: Any) -> str:
    return f"{a / b:.2f}×" if a and b else "–"


def _figures(summary: dict[str, Any], name: str) -> dict[str, Any]:
    return summary["parts"].get(name, {}).get("figures") or {}


def _why(part: dict[str, Any]) -> str:
    if part.get("note"):
        return str(part["note"])
    tail = (part.get("tail") or "").strip().splitlines()
    return tail[-1][:160].replace("|", "/") if tail else ""


def _parts(summary: dict[str, Any]) -> list[str]:
    lines = ["| part | what | status | seconds | limit s | note |", "|---|---|---|---|---|---|"]
    for name, p in summary["parts"].items():
        figures = p.get("figures") or {}
        note = figures.get("summary", "") if name == "tests" else ""
        note = "; ".join(x for x in (note, _why(p) if p["status"] != "ok" else p.get("note", "")) if x)
        lines.append(
            f"| {name} | {p.get('title', '')} | {p['status']} | {_num(p.get('seconds'))} | "
            f"{_num(p.get('limit_s'), '.0f')} | {note} |"
        )
    return lines


def _steps(t: dict[str, Any]) -> str:
    """Pairs/s of the median step, its parts, and the spread of the timed steps where they are recorded."""
    parts = t.get("parts_s") or {}
    shown = ", ".join(f"{k} {v:.3f} s" for k, v in parts.items() if k != "loss")
    steps = t.get("steps_s") or []
    if len(steps) > 1:
        shown += f"{'; ' if shown else ''}{len(steps)} steps of {min(steps):.3f}–{max(steps):.3f} s"
    return f"{t['pairs_per_s']:.1f} ({shown})" if shown else f"{t['pairs_per_s']:.1f}"


def _versus(summary: dict[str, Any]) -> list[str]:
    lines = ["| what | openalign | transformers / peer | ratio |", "|---|---|---|---|"]
    bench, compiled = _figures(summary, "bench"), _figures(summary, "compiled")
    training = bench.get("training") or {}
    ours, theirs = training.get("openalign"), training.get("transformers")
    settings = bench.get("settings") or {}
    if ours:
        what = f"`bench train --preset {settings.get('preset')}` pairs/s, eager (data+fwd+loss+bwd+opt)"
        peer = _steps(theirs) if theirs else "–"
        lines.append(
            f"| {what} | {_steps(ours)} | {peer} | {_ratio(ours['pairs_per_s'], (theirs or {}).get('pairs_per_s'))} |"
        )
        lines += _profiled(ours, theirs)
    recipe = training.get("recipe")
    if recipe and ours:
        lines.append(
            f"| `bench train --recipe`: the training loop (guard, logging, LAMB schedule) on the same model, batch "
            f"and shards (peer: the bare step above) | {_steps(recipe)} | {ours['pairs_per_s']:.1f} | "
            f"{_ratio(recipe['pairs_per_s'], ours['pairs_per_s'])} |"
        )
        lines += _profiled(recipe, ours)
    results = compiled.get("results") or {}
    c_ours, c_theirs = results.get("openalign"), results.get("transformers")
    c_settings = compiled.get("settings") or {}
    if c_ours:
        # Compiled, the peer pools its image map as the mean it computes (openalign.bench.peer).
        how = (
            "compiled (transformers' image pooler as a mean)"
            if c_settings.get("compile")
            else "eager (not compiled on this device)"
        )
        what = f"`bench model --preset {c_settings.get('preset')}` pairs/s, {how}"
        lines.append(
            f"| {what} | {_steps(c_ours)} | {_steps(c_theirs) if c_theirs else '–'} | "
            f"{_ratio(c_ours.get('pairs_per_s'), (c_theirs or {}).get('pairs_per_s'))} |"
        )
        lines += _profiled(c_ours, c_theirs)
        if c_ours.get("gradients"):
            peer = _gradients(c_theirs["gradients"]) if c_theirs and c_theirs.get("gradients") else "–"
            lines.append(
                f"| the same, its gradients against its eager step's (one step, same weights and batch) | "
                f"{_gradients(c_ours['gradients'])} | {peer} | |"
            )
    if ours or c_ours:

        def mfu(r: Any) -> str:
            return _num(100 * r["mfu"], ".1f", " %") if r and r.get("mfu") is not None else "–"

        lines.append(
            f"| nominal MFU (3 × forward FLOPs / step time / measured matmul peak), eager / compiled | "
            f"{mfu(ours)} / {mfu(c_ours)} | {mfu(theirs)} / {mfu(c_theirs)} | |"
        )
    pipeline = bench.get("pipeline_samples_per_s") or {}
    if pipeline:
        workers = settings.get("workers", 0)
        key = "workers" if workers else "in_process"
        ours_p, theirs_p = (pipeline.get(w, {}).get(key) for w in ("openalign", "webdataset"))
        where = f"{workers} workers" if workers else "one process"
        per = f" ({ours_p / workers:.0f} per worker)" if workers and ours_p else ""
        lines.append(
            f"| input pipeline samples/s, {where} (peer: webdataset + PIL) | {_num(ours_p)}{per} | "
            f"{_num(theirs_p) if theirs_p is not None else 'webdataset not installed'} | {_ratio(ours_p, theirs_p)} |"
        )
    towers = _figures(summary, "towers")
    for tower in ("text", "image"):
        rows = towers.get(tower) or []
        for peer in rows[1:]:
            lines.append(
                f"| {tower} tower alone, fwd + bwd ms, batch {(towers.get('settings') or {}).get('batch_size')} "
                f"(peer: {peer['model']}; ratio: peer time / ours) | {rows[0]['median_ms']:.1f} | "
                f"{peer['median_ms']:.1f} | {_ratio(peer['median_ms'], rows[0]['median_ms'])} |"
            )
    loop = _figures(summary, "loop")
    if loop.get("pairs_per_s_compute") or ours:
        rate = loop.get("pairs_per_s_compute")
        lines.append(
            f"| `openalign train` at batch {loop.get('global_batch', '–')}, pairs/s on its best step without the "
            f"data wait (peer: its own `bench train`) | {_num(rate)} | {_num((ours or {}).get('pairs_per_s'))} | "
            f"{_ratio(rate, (ours or {}).get('pairs_per_s'))} |"
        )
    compiled_loop = _figures(summary, "compiled_loop")
    timed = (compiled_loop.get("training") or {}).get("recipe")
    if timed:
        compiling = (compiled_loop.get("settings") or {}).get("compile")
        how = "compiled, in the bare step's process on its graphs" if compiling else "eager (not compiled here)"
        bare = (compiled_loop.get("training") or {}).get("openalign")
        if bare:
            which = "compiled" if compiling else "eager"
            lines.append(
                f"| `bench train`'s bare step, {which}, from JPEG shards | {_steps(bare)}; first step "
                f"{_num(bare.get('first_step_s'), '.1f', ' s')} | – | |"
            )
            lines += _profiled(bare, None)
        share = compiled_loop.get("recipe_data_share")
        first = timed.get("first_step_s")
        lines.append(
            f"| `openalign train`'s loop, {how}, from JPEG shards "
            f"(`bench train --recipe --compile`; peer: the bare step; ratio: loop / bare step pairs/s) | "
            f"{_steps(timed)}; waiting for data {_num(None if share is None else 100 * share, '.1f', ' %')} of its "
            f"step; first step {_num(first, '.1f', ' s')} | {_num((bare or {}).get('pairs_per_s'))} | "
            f"{_ratio(timed['pairs_per_s'], (bare or {}).get('pairs_per_s'))} |"
        )
        lines += _profiled(timed, None)
    return lines if len(lines) > 2 else []


def _gradients(result: dict[str, Any]) -> str:
    """A compiled step's gradients against eager (``bench.gradients``): agreeing, or which groups and how far."""
    if result["agree"]:
        return "agree"
    groups = result["groups"]
    apart = [f"{g} {groups[g]['norm_ratio']:.2g}x norm" if g in groups else f"{g} one-sided" for g in result["apart"]]
    return f"**do not agree**: {', '.join(apart)}"


def _profiled(ours: dict[str, Any], peer: dict[str, Any] | None) -> list[str]:
    """The row above's steps on the host (``bench.host``: the stepping thread busy, or kept off its core by the GIL
    or other processes) and profiled (``bench.profile``: kernels filling little of its wall time wait on the
    host), where measured."""
    lines = []
    for key, what, line in (("host", "on the host", host_line), ("profile", "profiled", profile_line)):
        if ours.get(key):
            theirs = (peer or {}).get(key)
            lines.append(f"| the same, {what} | {line(ours[key])} | {line(theirs) if theirs else '–'} | |")
    return lines


def _runs(summary: dict[str, Any]) -> list[str]:
    plans = _figures(summary, "plan")
    lines = [
        "| run | batch / chunk | steps done | peak host memory, GiB: PSS of the tree (RSS sum; host used rise) "
        "| peak GPU memory (plan, error) | pairs/s without data wait (the loop's, with it) |",
        "|---|---|---|---|---|---|",
    ]
    for run, label in RUNS.items():
        part = summary["parts"].get(run)
        if part is None:
            continue
        f, host, plan = part.get("figures") or {}, part.get("host_memory") or {}, plans.get(run) or {}
        measurement = f.get("measurement") or {}
        gpu = f.get("gpu_peak_gib")
        measured = gpu if gpu is not None else f.get("process_peak_rss_gib")
        kind = "" if gpu is not None else " (peak RSS: no GPU)"
        # A CPU run's peak RSS holds the libraries too: no error against the plan, which counts tensors.
        err = f", {100 * (plan['peak_gib'] - gpu) / gpu:+.1f} %" if plan.get("peak_gib") and gpu else ""
        mem = f"{_num(measured, '.2f')}{kind} (plan {_num(plan.get('peak_gib'), '.2f')}{err})"
        host_text = (
            f"{_num(host.get('peak_pss_gib'), '.2f')} ({_num(host.get('peak_rss_sum_gib'), '.2f')}; "
            f"{_num(host.get('host_used_rise_gib'), '.2f')})"
            if host.get("peak_pss_gib") is not None
            else "–"
        )
        loop_rates = ", ".join(_num(s.get("pairs_per_s_loop")) for s in f.get("steps", []))
        rate = _num(f.get("pairs_per_s_compute"))
        if f.get("pairs_per_s_estimate") is not None:
            rate = f"~{f['pairs_per_s_estimate']:.1f} (estimated: no step ended within {part.get('limit_s')} s)"
        status = "" if part["status"] == "ok" else f" — {part['status']}"
        batch = f"{measurement.get('batch', '–')} / {measurement.get('chunk') or 'none'}"
        lines.append(
            f"| {summary['parts'][run].get('title', run)} ({label}){status} | {batch} | {f.get('steps_done', 0)} | "
            f"{host_text} | {mem} | {rate} ({loop_rates or '–'}) |"
        )
    return lines if len(lines) > 2 else []


def _plan_table(summary: dict[str, Any]) -> list[str]:
    plans = _figures(summary, "plan")
    if not plans:
        return []
    lines = [
        f"| run | planned peak GiB ({plans.get('device')}) | measured peak GiB | error | planned pairs/s | "
        "measured pairs/s | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in RUNS:
        plan, f = plans.get(run), _figures(summary, run)
        if plan is None:
            continue
        measured = f.get("gpu_peak_gib")
        rate = f.get("pairs_per_s_compute") or f.get("pairs_per_s_estimate")
        planned_rate = plan.get("pairs_per_s")
        lines.append(
            f"| {run} | {plan['peak_gib']:.2f} | {_num(measured, '.2f')} | "
            f"{_num(100 * (plan['peak_gib'] - measured) / measured if measured else None, '+.1f', ' %')} | "
            f"{_num(planned_rate) if planned_rate else 'not measured'} | {_num(rate)} | "
            f"{_num(100 * (planned_rate - rate) / rate if planned_rate and rate else None, '+.1f', ' %')} |"
        )
    return lines if len(lines) > 2 else []


def markdown(summary: dict[str, Any]) -> str:
    env = summary["environment"]
    s = summary["settings"]
    head = [
        "# GPU check",
        "",
        f"{env.get('gpu') or s['device']} ({env.get('gpus', 0)} GPU), {env.get('cpus')} CPUs, "
        f"{env.get('host_memory_gib')} GiB host memory; torch {env.get('torch')}, CUDA {env.get('cuda')}; "
        f"commit {env.get('commit')}, {summary['date']}; budget {s['budget_s']:g} s"
        f"{', toy sizes (--tiny)' if s['tiny'] else ''}.",
        "",
    ]
    out = [*head, "## Parts", "", *_parts(summary), ""]
    for title, table in (
        ("Training step against transformers", _versus(summary)),
        ("Training runs: host and GPU memory, throughput", _runs(summary)),
        ("Plan against measured", _plan_table(summary)),
    ):
        if table:
            out += [f"## {title}", "", *table, ""]
    out.append(
        "Host memory: the sum of PSS over the training process and its data workers (shared pages counted once), "
        "sampled every 0.5 s; GPU memory: `torch.cuda.max_memory_allocated` in the training process."
    )
    if "table_update" in summary:
        out += ["", f"Throughput table: {summary['table_update']}."]
    return "\n".join(out) + "\n"
