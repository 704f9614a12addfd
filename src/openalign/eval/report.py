"""Results files and the Markdown table that puts our numbers beside the paper's.

A result is written as ``<task>-<dataset>.json`` holding CLIP_benchmark's fields (dataset, model, task,
metrics) plus the options it ran with; ``results.md`` is regenerated from every result file in the
directory, so separate runs into one directory add up to one report. ``clip_benchmark_result`` turns a
result into CLIP_benchmark's own JSON (its task and metric names, fractions instead of percentages), which
``clip_benchmark build`` reads beside its own results.

Paper numbers are shown only where the protocol is the same one the paper used: the same dataset, the
same split size (Flickr30K 1K test images, MSCOCO and CxC 5K, Multi30K 1K, all 999 SimLex-999 pairs, the
full ImageNet validation sets) and the same use of the model (zero-shot, except CxC, where the paper
scores its MSCOCO fine-tuned model). A different size means a different benchmark, so the paper's
column is left out with the reason. The second paper column is the baseline the paper compares to:
CLIP, or the one a reference names (GloVe for SimLex-999).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openalign.outputs import atomic_write_text


@dataclass(frozen=True)
class PaperReference:
    """Numbers from the ALIGN paper (and the baseline it compares to, CLIP unless named) for one task on one
    dataset, keyed by the metric names the task writes."""

    task: str
    dataset: str
    source: str  # the paper table the numbers come from
    align: Mapping[str, float]
    clip: Mapping[str, float] = field(default_factory=dict)  # the baseline's numbers; no column when empty
    # metric -> value our result must have for the comparison to be fair (e.g. the number of test images)
    requires: Mapping[str, float] = field(default_factory=dict)
    baseline_name: str = "CLIP"  # the header of the ``clip`` column
    table: str = ""  # for the transfer results (Tables 4-6): the row label in results.md's transfer summary


@dataclass(frozen=True)
class Failure:
    """A task a suite ran that raised: reported as failed, with its reason, never as "not run"."""

    entry: str  # the suite entry, as the suite names it ("tasks[4] finetune")
    task: str
    dataset: str  # the dataset it was given ("pets"), "" when the entry does not tell
    reason: str  # one line


def _cell(text: str) -> str:
    """``text`` as one Markdown table cell: one line, no column separators."""
    return " ".join(text.split()).replace("|", "\\|")


_RETRIEVAL_KEYS = ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10")
_CXC_KEYS = tuple(f"{d}_r{k}" for d in ("i2t", "t2i", "t2t", "i2i") for k in (1, 5, 10))
_SIMLEX_KEYS = ("all", "adjs", "nouns", "verbs", "conc_q1", "conc_q2", "conc_q3", "conc_q4", "hard")

PAPER: list[PaperReference] = [
    PaperReference(
        "retrieval",
        "flickr30k",
        "Table 1, zero-shot Flickr30K (1K test)",
        dict(zip(_RETRIEVAL_KEYS, (88.6, 98.7, 99.7, 75.7, 93.8, 96.8), strict=True)),
        dict(zip(_RETRIEVAL_KEYS, (88.0, 98.7, 99.4, 68.7, 90.6, 95.2), strict=True)),
        {"num_images": 1000, "num_captions": 5000},
    ),
    PaperReference(
        "retrieval",
        "mscoco",
        "Table 1, zero-shot MSCOCO (5K test)",
        dict(zip(_RETRIEVAL_KEYS, (58.6, 83.0, 89.7, 45.6, 69.8, 78.6), strict=True)),
        dict(zip(_RETRIEVAL_KEYS, (58.4, 81.5, 88.1, 37.8, 62.4, 72.2), strict=True)),
        {"num_images": 5000},
    ),
    PaperReference(
        "zeroshot", "imagenet", "zero-shot classification, §5", {"top1": 76.4}, {"top1": 76.2}, {"num_images": 50000}
    ),
    PaperReference(
        "zeroshot", "imagenet-r", "zero-shot classification, §5", {"top1": 92.2}, {"top1": 88.9}, {"num_images": 30000}
    ),
    PaperReference(
        "zeroshot", "imagenet-a", "zero-shot classification, §5", {"top1": 75.8}, {"top1": 77.2}, {"num_images": 7500}
    ),
    PaperReference(
        "zeroshot", "imagenet-v2", "zero-shot classification, §5", {"top1": 70.1}, {"top1": 70.1}, {"num_images": 10000}
    ),
    PaperReference(
        "cxc",
        "cxc-test",
        "Tables 2 and 3, CxC on the MSCOCO 5K test split, ALIGN fine-tuned on MSCOCO",
        dict(zip(_CXC_KEYS, (78.1, 94.3, 97.4, 61.8, 84.9, 91.1, 45.4, 66.8, 75.2, 49.4, 81.4, 89.1), strict=True))
        # Spearman's ρ × 100 (bootstrap means) and the mean of the three
        | {"sts_mean": 72.9, "sis_mean": 77.2, "sits_mean": 67.6, "mean_avg": 72.6},
        # every test image is an image→text query, so this counts the split's images
        requires={"i2t_queries": 5000},
    ),
    PaperReference(
        "simlex",
        "simlex-999",
        "supplement Table 1, SimLex-999 Spearman ρ × 100, with GloVe as reported there",
        dict(zip(_SIMLEX_KEYS, (39.8, 49.8, 45.9, 16.6, 23.9, 41.7, 47.6, 57.8, 31.7), strict=True)),
        dict(zip(_SIMLEX_KEYS, (40.8, 62.2, 42.8, 19.6, 43.3, 41.6, 42.3, 40.2, 27.2), strict=True)),
        {"n_all": 999},
        baseline_name="GloVe",
    ),
    PaperReference(
        "linear-probe",
        "imagenet",
        "Table 4, ImageNet Acc@1 with frozen features (EfficientNet-L2), with CLIP (ViT-L/14) as reported there",
        {"top1": 85.5},
        {"top1": 85.4},
        {"n": 50000},
        table="Table 4: ImageNet, frozen features",
    ),
    PaperReference(
        "finetune",
        "imagenet",
        "Table 4, ImageNet fine-tuned Acc@1 / Acc@5 (EfficientNet-L2), with NoisyStudent (EfficientNet-L2) "
        "as reported there",
        {"top1": 88.64, "top5": 98.67},
        {"top1": 88.4, "top5": 98.7},
        {"n": 50000},
        baseline_name="NoisyStudent",
        table="Table 4: ImageNet, fine-tuned",
    ),
    PaperReference(
        "vtab",
        "vtab-1k",
        "Table 5, VTAB-1k mean accuracy over the 19 tasks and per group (it gives no per-task numbers), "
        "with BiT-L as reported there",
        {"all_mean": 79.99, "natural_mean": 83.38, "specialized_mean": 87.56, "structured_mean": 73.25},
        {"all_mean": 78.72},
        baseline_name="BiT-L",
        table="Table 5: VTAB-1k",
    ),
    *(
        PaperReference(
            "finetune",
            dataset,
            f"Table 6, {title} fine-tuned top-1 (mean of three runs), with SAM-baseline as reported there",
            {"top1": align},
            {"top1": sam},
            {"n": test_images},  # the released test split
            baseline_name="SAM-baseline",
            table=f"Table 6: {title}",
        )
        for dataset, title, align, sam, test_images in (
            ("flowers102", "Oxford Flowers", 99.65, 99.60, 6149),
            ("pets", "Oxford Pets", 96.19, 96.92, 3669),
            ("cars", "Stanford Cars", 96.13, 95.07, 8041),
            ("food101", "Food101", 95.88, 96.03, 25250),
        )
    ),
    PaperReference(
        "multilingual",
        "multi30k-test-2016-flickr",
        "Multi30K zero-shot mean recall of ALIGN_mling (1K test images)",
        {"en_mean_recall": 90.2, "de_mean_recall": 84.1, "fr_mean_recall": 84.9, "cs_mean_recall": 63.2},
        requires={"num_images": 1000},
    ),
]

_ALIASES = {"coco": "mscoco", "coco5k": "mscoco", "mscoco5k": "mscoco", "flickr": "flickr30k", "f30k": "flickr30k"}


def canonical_dataset(name: str) -> str:
    """Lower-case, dashes for separators, common aliases folded ("COCO" -> "mscoco", "ImageNet_R" -> "imagenet-r")."""
    key = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return _ALIASES.get(key.replace("-", ""), key)


def paper_reference(task: str, dataset: str) -> PaperReference | None:
    ds = canonical_dataset(dataset)
    return next((p for p in PAPER if p.task == task and p.dataset == ds), None)


# openalign task -> CLIP_benchmark task, for the tasks that measure the same thing
CLIP_BENCHMARK_TASKS = {"retrieval": "zeroshot_retrieval", "zeroshot": "zeroshot_classification",
                        "linear-probe": "linear_probe"}  # fmt: skip


def _fraction(value: Any) -> float:
    return float(value) / 100.0


def clip_benchmark_metrics(task: str, metrics: Mapping[str, Any], options: Mapping[str, Any]) -> dict[str, Any]:
    """``metrics`` of openalign ``task`` under CLIP_benchmark's names, as fractions.

    Its image retrieval is text→image (a caption finds its image), its text retrieval image→text. It
    reports ``acc5`` as NaN for fewer than five classes, where top-5 is trivially right; so does this.
    """
    if task == "retrieval":
        # Its recalls hand ties out as torch.topk orders them, so its names carry the topk_ recalls, not ours.
        ks = sorted(int(m.group(1)) for key in metrics if (m := re.fullmatch(r"topk_t2i_r(\d+)", key)))
        if not ks:
            raise ValueError(
                "this retrieval result has no topk_t2i_r* recalls (CLIP_benchmark's tie rule); "
                "rerun `openalign eval retrieval` to write it in CLIP_benchmark's format"
            )
        out: dict[str, Any] = {}
        for k in ks:
            out[f"image_retrieval_recall@{k}"] = _fraction(metrics[f"topk_t2i_r{k}"])
            out[f"text_retrieval_recall@{k}"] = _fraction(metrics[f"topk_i2t_r{k}"])
        return out
    if task == "zeroshot":
        few = int(metrics.get("num_classes", 5)) < 5
        return {
            "acc1": _fraction(metrics["top1"]),
            "acc5": float("nan") if few else _fraction(metrics["top5"]),
            "mean_per_class_recall": _fraction(metrics["mean_per_class_recall"]),
        }
    if task == "linear-probe":
        return {
            "lp_acc1": _fraction(metrics["top1"]),
            "lp_acc5": _fraction(metrics["top5"]),
            "lp_mean_per_class_recall": _fraction(metrics["mean_per_class_recall"]),
            "epochs": options.get("epochs") if options.get("method", "sgd") == "sgd" else None,  # lbfgs: to convergence
            "fewshot_k": -1,  # the whole training set
            "normalized": True,  # the probe trains on L2-normalised embeddings
        }
    raise ValueError(
        f"eval task {task!r} has no CLIP_benchmark counterpart; --format clip_benchmark covers "
        + ", ".join(CLIP_BENCHMARK_TASKS)
    )


def clip_benchmark_result(result: Mapping[str, Any], architecture: str = "", language: str = "en") -> dict[str, Any]:
    """One result (``EvalResult.to_dict()``) as the JSON ``clip_benchmark eval`` writes: dataset, model (the
    architecture), pretrained (the checkpoint), task, metrics and language."""
    task = str(result["task"])
    metrics = clip_benchmark_metrics(task, result["metrics"], result.get("options") or {})
    return {
        "dataset": result["dataset"],
        "model": architecture or "openalign",
        "pretrained": result["model"],
        "task": CLIP_BENCHMARK_TASKS[task],
        "metrics": metrics,
        "language": language,
    }


def clip_benchmark_filename(result: Mapping[str, Any]) -> str:
    """CLIP_benchmark's default ``{dataset}_{pretrained}_{model}_{language}_{task}.json``, the checkpoint
    by its directory name."""
    pretrained = Path(str(result["pretrained"])).name or "model"
    name = f"{result['dataset']}_{pretrained}_{result['model']}_{result['language']}_{result['task']}"
    return re.sub(r"[^A-Za-z0-9.@_-]+", "_", name).strip("_") + ".json"


def write_clip_benchmark(result: Mapping[str, Any], out_dir: str | Path) -> Path:
    """Write a ``clip_benchmark_result`` into ``out_dir`` under CLIP_benchmark's file name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # json.dumps writes NaN as CLIP_benchmark does (its own reader, json.load, takes it back).
    return atomic_write_text(out / clip_benchmark_filename(result), json.dumps(dict(result), indent=2) + "\n")


def result_filename(result: Mapping[str, Any]) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{result['task']}-{result['dataset']}").strip("_")
    return f"{slug}.json"


def write_result(result: Mapping[str, Any], out_dir: str | Path) -> Path:
    """Write one result JSON into ``out_dir`` (atomically, so an interrupted run never leaves half a file)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(out / result_filename(result), json.dumps(dict(result), indent=2, default=str) + "\n")


def read_results(out_dir: str | Path) -> list[dict[str, Any]]:
    """Every result JSON in ``out_dir`` (files that are not results are ignored), sorted by task and dataset."""
    results = []
    for path in sorted(Path(out_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        # CLIP_benchmark-format files share the keys but not the metric names or units.
        if (
            isinstance(data, dict)
            and {"task", "dataset", "metrics"} <= set(data)
            and data["task"] not in CLIP_BENCHMARK_TASKS.values()
        ):
            results.append(data)
    return sorted(results, key=lambda r: (r["task"], r["dataset"]))


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        text = json.dumps(value) if not isinstance(value, str) else value
        return text if len(text) <= 60 else text[:57] + "..."
    if isinstance(value, int):
        return str(value)
    return f"{value:.2f}"


def _paper(value: float) -> str:
    """A paper number with the decimals the paper printed (one, or two where it gave two: 79.99, 88.64)."""
    return f"{value:.1f}" if round(value, 1) == value else f"{value:.2f}"


def transfer_summary(results: Iterable[Mapping[str, Any]], failed: Iterable[Failure] = ()) -> list[str]:
    """The paper's transfer tables (4-6), every row of them, with our number beside each where we have one
    and whether it is comparable (the paper's test split; for VTAB-1k, every task of a group); a row whose
    task ``failed`` says so, with the reason."""
    found = {(r["task"], canonical_dataset(r["dataset"])): r for r in results}
    failures = {(f.task, canonical_dataset(f.dataset)): f for f in failed if f.dataset}
    refs = [p for p in PAPER if p.table]
    if not any((p.task, p.dataset) in found or (p.task, p.dataset) in failures for p in refs):
        return []
    lines = [
        "## Transfer: the paper's Tables 4-6 beside ours",
        "",
        "| paper table | metric | ours | ALIGN (paper) | comparable |",
        "|---|---|---:|---:|---|",
    ]
    for ref in refs:
        result = found.get((ref.task, ref.dataset))
        metrics = result["metrics"] if result is not None else {}
        mismatch = [f"{k} {metrics.get(k)} (paper {v:g})" for k, v in ref.requires.items() if metrics.get(k) != v]
        for key, paper in ref.align.items():
            ours = metrics.get(key)
            failure = failures.get((ref.task, ref.dataset))
            if result is None and failure is not None:
                note, shown = f"failed: {_cell(failure.reason)}", ""
            elif result is None:
                note, shown = "not run", ""
            elif ours is None:
                note, shown = "not measured (a task of the group did not run)", ""
            else:
                note = "no: " + ", ".join(mismatch) if mismatch else "yes"
                if metrics.get("runs"):
                    note += f"; mean of {metrics['runs']} runs"
                shown = _fmt(ours)
            lines.append(f"| {ref.table} | {key} | {shown} | {_paper(paper)} | {note} |")
    lines += ["", "Paper numbers: ALIGN paper, Table 4 (ImageNet), Table 5 (VTAB-1k) and Table 6 (fine-grained).", ""]
    return lines


def markdown(results: Iterable[Mapping[str, Any]], failed: Iterable[Failure] = ()) -> str:
    """One table per result: metric, ours, and the paper's ALIGN and baseline numbers where comparable;
    with transfer results, first a summary of the paper's Tables 4-6 beside ours; every ``failed`` task
    listed with its reason."""
    results, failed = list(results), list(failed)
    parts = ["# Evaluation results", "", *transfer_summary(results, failed)]
    if failed:
        parts += ["## Failed", "", *(f"- {f.entry}: {' '.join(f.reason.split())}" for f in failed), ""]
    for r in results:
        metrics = r["metrics"]
        model = f" — model `{r['model']}`" if r.get("model") else ""
        parts += [f"## {r['task']} — {r['dataset']}{model}", ""]
        ref = paper_reference(r["task"], r["dataset"])
        mismatch = []
        if ref is not None:
            mismatch = [f"{k} {metrics.get(k)} (paper {v:g})" for k, v in ref.requires.items() if metrics.get(k) != v]
        shown = ref if not mismatch else None  # the paper's numbers, when the settings match its benchmark
        header, columns = ["metric", "ours"], []
        if shown is not None:
            header.append("ALIGN (paper)")
            columns.append(shown.align)
            if shown.clip:
                header.append(f"{shown.baseline_name} (paper)")
                columns.append(shown.clip)
        parts += ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
        for key, value in metrics.items():
            cells = [key, _fmt(value)] + ["" if (v := col.get(key)) is None else _paper(v) for col in columns]
            parts.append("| " + " | ".join(cells) + " |")
        parts.append("")
        if shown is not None:
            parts += [f"Paper numbers: ALIGN paper, {shown.source}.", ""]
        elif ref is not None:
            parts += [f"Paper numbers not shown: {', '.join(mismatch)} differ from the paper's benchmark.", ""]
    return "\n".join(parts).rstrip() + "\n"


def write_report(out_dir: str | Path, failed: Iterable[Failure] = ()) -> Path:
    """Regenerate ``results.md`` from every result JSON in ``out_dir`` (and the tasks of this run that ``failed``)."""
    return atomic_write_text(Path(out_dir) / "results.md", markdown(read_results(out_dir), failed))
