"""Crisscrossed Captions (CxC; Parekh et al., EACL 2021): MS-COCO's Karpathy val/test splits with human
similarity ratings for caption pairs (STS), image pairs (SIS) and caption-image pairs (SITS).

Files (github.com/google-research-datasets/Crisscrossed-Captions, ``data/``), one per task and split:

- ``sts_{val,test}.csv``:  ``caption1,caption2,agg_score,sampling_method``
- ``sis_{val,test}.csv``:  ``image1,image2,agg_score,sampling_method``
- ``sits_{val,test}.csv``: ``caption,image,agg_score,sampling_method``

Captions are written ``COCO_val2014:sentid:<Karpathy sentid>`` and images by their COCO file name
(``COCO_val2014_000000032001.jpg``), the ``filename`` field of Karpathy's ``dataset_coco.json``;
``agg_score`` is the mean rating on a 0-5 scale.

Retrieval with extended positives (the paper's Table 2). A pair is a CxC positive when its agg_score is
at least ``threshold`` (3.0: "3 = the two are roughly equivalent" on the rating scale):

- I2T / T2I: the original COCO pairs (an image and its 5 captions) plus every SITS pair ≥ 3; candidates
  are all 25k captions / 5k images of the split.
- T2T: the STS pairs ≥ 3 (in either direction); co-captions are NOT positives by themselves (they were
  rated too, as ``c2c_cocaption``, and count only when rated ≥ 3). The query caption is removed from its
  own candidates.
- I2I: the SIS pairs ≥ 3 (either direction), the query image removed from its candidates; SITS and STS
  ratings are not propagated to image pairs.
- A query with no positive cannot be scored and is left out of that task's denominator; the number of
  evaluated queries is reported with every task (``<task>_queries``).

Two choices the CSV files alone do not settle are made explicitly here and are configurable or easy to
change: the threshold (``threshold``; the CxC paper counts ratings of 3 and above as positive), and, for
I2I, that positives come only from SIS (SITS and STS ratings are not propagated to image pairs) and that
images without an SIS positive are not queries but stay in the index. The latter is the open question of
issue #1 in the CxC repository; T2T is handled the same way.

Correlation (the paper's Table 3): Spearman's ρ × 100 between the model's cosine similarity and
agg_score over each file's pairs, as a bootstrap: ``n_bootstrap`` resamples of the pairs with replacement
(fixed seed), reported as mean and standard deviation.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from openalign.data.sources import (
    DEFAULT_MAX_ANNOTATION_BYTES,
    DEFAULT_MAX_FILE_BYTES,
    check_annotation,
    read_annotation_json,
)
from openalign.eval.retrieval import recall_at_k_sets
from openalign.eval.simlex import spearman

if TYPE_CHECKING:
    from openalign.model.dual_encoder import DualEncoder
    from openalign.text.tokenizer import TextTokenizer

TASK_COLUMNS = {
    "sts": ("caption1", "caption2", "agg_score", "sampling_method"),
    "sis": ("image1", "image2", "agg_score", "sampling_method"),
    "sits": ("caption", "image", "agg_score", "sampling_method"),
}


# --------------------------------------------------------------------------------------------------
# Data


@dataclass
class CxCData:
    """One Karpathy split (val or test) of MS-COCO with its CxC ratings, all as indices into the split."""

    split: str
    image_files: list[str]  # Karpathy "filename" (the CxC image id)
    image_paths: list[str]  # "filepath/filename" relative to the COCO image root
    captions: list[str]
    caption_sentids: list[int]
    caption_image: list[int]  # index of each caption's image
    sts: list[tuple[int, int, float]] = field(default_factory=list)  # (caption, caption, agg_score)
    sis: list[tuple[int, int, float]] = field(default_factory=list)  # (image, image, agg_score)
    sits: list[tuple[int, int, float]] = field(default_factory=list)  # (caption, image, agg_score)
    skipped: dict[str, int] = field(default_factory=dict)  # rows whose ids are not in the split (strict=False)


def read_karpathy_split(
    path: str | Path, split: str, *, max_annotation_bytes: int = DEFAULT_MAX_ANNOTATION_BYTES
) -> tuple[list[str], list[str], list[str], list[int], list[int]]:
    """(image files, image paths, captions, sentids, caption->image) of one split of a Karpathy JSON."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no such Karpathy split file (dataset_coco.json)")
    data = read_annotation_json(p, max_bytes=max_annotation_bytes)
    try:
        images = data["images"]
    except (KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a Karpathy split JSON with an 'images' list ({err})") from None
    files: list[str] = []
    paths: list[str] = []
    captions: list[str] = []
    sentids: list[int] = []
    owner: list[int] = []
    for entry in images:
        if entry.get("split") != split:
            continue
        try:
            filename = entry["filename"]
            sentences = entry["sentences"]
        except KeyError as err:
            raise ValueError(f"{path}: an image entry lacks the {err} field") from None
        index = len(files)
        files.append(filename)
        paths.append(str(Path(entry.get("filepath", "")) / filename))
        for s in sentences:
            if "sentid" not in s or "raw" not in s:
                raise ValueError(f"{path}: a sentence of {filename} lacks 'sentid' or 'raw'")
            captions.append(s["raw"].strip())
            sentids.append(int(s["sentid"]))
            owner.append(index)
    if not files:
        raise ValueError(f"{path}: the '{split}' split is empty")
    return files, paths, captions, sentids, owner


def parse_sentid(value: str, where: str) -> int:
    """``COCO_val2014:sentid:190268`` -> 190268."""
    _, sep, tail = value.rpartition(":sentid:")
    if not sep or not tail.strip().isdigit():
        raise ValueError(f"{where}: caption id {value!r} is not of the form COCO_val2014:sentid:<number>")
    return int(tail)


def read_cxc_csv(
    path: str | Path, task: str, *, max_annotation_bytes: int = DEFAULT_MAX_ANNOTATION_BYTES
) -> list[tuple[str, str, float, str]]:
    """Rows (id1, id2, agg_score, sampling_method) of a CxC CSV, the header checked against ``task``."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no such CxC file")
    check_annotation(p, max_bytes=max_annotation_bytes)  # its rows are kept in memory
    expected = TASK_COLUMNS[task]
    rows = []
    with p.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header[:4]) != expected:
            raise ValueError(f"{path}: expected the CxC header {','.join(expected)}, got {header}")
        for lineno, row in enumerate(reader, 2):
            if not row:
                continue
            if len(row) < 4:
                raise ValueError(f"{path}:{lineno}: expected 4 columns, got {len(row)}")
            try:
                score = float(row[2])
            except ValueError:
                raise ValueError(f"{path}:{lineno}: agg_score {row[2]!r} is not a number") from None
            rows.append((row[0].strip(), row[1].strip(), score, row[3].strip()))
    return rows


def load_cxc(
    cxc_dir: str | Path,
    karpathy_json: str | Path,
    split: str = "test",
    *,
    strict: bool = True,
    tasks: Sequence[str] = ("sts", "sis", "sits"),
    max_annotation_bytes: int = DEFAULT_MAX_ANNOTATION_BYTES,
) -> CxCData:
    """Load a Karpathy split and its CxC ratings (``<task>_<split>.csv`` under ``cxc_dir``).

    Every caption id and image name must belong to the split; with ``strict=False`` rows that do not are
    skipped and counted in ``skipped[task]`` instead of raising.
    """
    if split not in ("val", "test"):
        raise ValueError(f"CxC covers the Karpathy 'val' and 'test' splits, got {split!r}")
    files, paths, captions, sentids, owner = read_karpathy_split(
        karpathy_json, split, max_annotation_bytes=max_annotation_bytes
    )
    data = CxCData(split, files, paths, captions, sentids, owner)
    caption_index = {s: i for i, s in enumerate(sentids)}
    image_index = {f: i for i, f in enumerate(files)}

    def caption(value: str, where: str) -> int | None:
        sid = parse_sentid(value, where)
        if sid not in caption_index:
            if strict:
                raise ValueError(f"{where}: caption sentid {sid} is not in the Karpathy '{split}' split")
            return None
        return caption_index[sid]

    def image(value: str, where: str) -> int | None:
        if value not in image_index:
            if strict:
                raise ValueError(f"{where}: image {value!r} is not in the Karpathy '{split}' split")
            return None
        return image_index[value]

    kinds = {"sts": (caption, caption), "sis": (image, image), "sits": (caption, image)}
    for task in tasks:
        if task not in kinds:
            raise ValueError(f"unknown CxC task {task!r}; valid: sts, sis, sits")
        path = Path(cxc_dir) / f"{task}_{split}.csv"
        first, second = kinds[task]
        out: list[tuple[int, int, float]] = []
        skipped = 0
        for lineno, (a, b, score, _method) in enumerate(
            read_cxc_csv(path, task, max_annotation_bytes=max_annotation_bytes), 2
        ):
            where = f"{path}:{lineno}"
            i, j = first(a, where), second(b, where)
            if i is None or j is None:
                skipped += 1
                continue
            out.append((i, j, score))
        setattr(data, task, out)
        data.skipped[task] = skipped
    return data


# --------------------------------------------------------------------------------------------------
# Positives and metrics


def extended_positives(data: CxCData, threshold: float = 3.0) -> dict[str, list[set[int]]]:
    """Per-query positive sets for i2t, t2i, t2t and i2i (see the module docstring for the rule)."""
    n_img, n_cap = len(data.image_files), len(data.captions)
    i2t: list[set[int]] = [set() for _ in range(n_img)]
    t2i: list[set[int]] = [set() for _ in range(n_cap)]
    for c, i in enumerate(data.caption_image):
        i2t[i].add(c)
        t2i[c].add(i)
    for c, i, score in data.sits:
        if score >= threshold:
            i2t[i].add(c)
            t2i[c].add(i)
    t2t: list[set[int]] = [set() for _ in range(n_cap)]
    for a, b, score in data.sts:
        if score >= threshold and a != b:
            t2t[a].add(b)
            t2t[b].add(a)
    i2i: list[set[int]] = [set() for _ in range(n_img)]
    for a, b, score in data.sis:
        if score >= threshold and a != b:
            i2i[a].add(b)
            i2i[b].add(a)
    return {"i2t": i2t, "t2i": t2i, "t2t": t2t, "i2i": i2i}


def bootstrap_spearman(
    model_scores: Sequence[float] | np.ndarray,
    human_scores: Sequence[float] | np.ndarray,
    *,
    n_bootstrap: int = 1000,
    seed: int = 0,
) -> tuple[float, float]:
    """Mean and standard deviation of Spearman's ρ × 100 over ``n_bootstrap`` resamples with replacement.

    Resamples in which either side is constant have no ρ and are left out; if all are, both are NaN.
    """
    a, b = np.asarray(model_scores, dtype=np.float64), np.asarray(human_scores, dtype=np.float64)
    if len(a) != len(b):
        raise ValueError(f"{len(a)} model scores for {len(b)} human scores")
    if len(a) < 2:
        raise ValueError(f"a correlation needs at least 2 rated pairs, got {len(a)}")
    if n_bootstrap < 1:
        raise ValueError(f"n_bootstrap must be at least 1, got {n_bootstrap}")
    rng = np.random.default_rng(seed)
    rhos = np.empty(n_bootstrap)
    for t in range(n_bootstrap):
        idx = rng.integers(0, len(a), len(a))
        rhos[t] = spearman(a[idx], b[idx])
    rhos = rhos[np.isfinite(rhos)]  # a resample whose scores are all equal has no defined ρ
    if len(rhos) == 0:
        # A model that gives every pair the same score has no ranking to correlate: NaN, not an error,
        # so one degenerate task does not lose the others' results.
        return float("nan"), float("nan")
    return 100.0 * float(rhos.mean()), 100.0 * float(rhos.std(ddof=1) if len(rhos) > 1 else 0.0)


def evaluate_cxc(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    data: CxCData,
    *,
    threshold: float = 3.0,
    ks: Sequence[int] = (1, 5, 10),
    n_bootstrap: int = 1000,
    seed: int = 0,
) -> dict[str, Any]:
    """All CxC metrics from L2-normalised embeddings in the split's order (images, then captions)."""
    image_emb, text_emb = torch.as_tensor(image_emb).float(), torch.as_tensor(text_emb).float()
    if image_emb.shape[0] != len(data.image_files):
        raise ValueError(f"{image_emb.shape[0]} image embeddings for {len(data.image_files)} images")
    if text_emb.shape[0] != len(data.captions):
        raise ValueError(f"{text_emb.shape[0]} caption embeddings for {len(data.captions)} captions")
    pos = extended_positives(data, threshold)
    out: dict[str, Any] = {}
    runs = {
        "i2t": (image_emb, text_emb, None),
        "t2i": (text_emb, image_emb, None),
        "t2t": (text_emb, text_emb, list(range(len(data.captions)))),
        "i2i": (image_emb, image_emb, list(range(len(data.image_files)))),
    }
    for task, (queries, candidates, exclude) in runs.items():
        if not any(pos[task]):
            out[f"{task}_queries"] = 0
            continue
        r = recall_at_k_sets(queries, candidates, pos[task], ks, exclude=exclude)
        for k in ks:
            out[f"{task}_r{k}"] = r[f"r{k}"]
        out[f"{task}_queries"] = r["queries"]

    def cos(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
        return torch.nn.functional.cosine_similarity(a, b, dim=1).double().numpy()

    pairs = {
        "sts": (text_emb, text_emb, data.sts),
        "sis": (image_emb, image_emb, data.sis),
        "sits": (text_emb, image_emb, data.sits),
    }
    means = []
    for task, (a, b, rated) in pairs.items():
        if len(rated) < 2:
            continue
        i = torch.tensor([r[0] for r in rated])
        j = torch.tensor([r[1] for r in rated])
        mean, std = bootstrap_spearman(cos(a[i], b[j]), [r[2] for r in rated], n_bootstrap=n_bootstrap, seed=seed)
        out[f"{task}_mean"], out[f"{task}_std"], out[f"{task}_pairs"] = mean, std, len(rated)
        means.append(mean)
    if len(means) == 3 and all(np.isfinite(means)):
        out["mean_avg"] = float(np.mean(means))
    return out


def run_cxc(
    model: DualEncoder,
    tokenizer: TextTokenizer,
    cxc_dir: str | Path,
    karpathy_json: str | Path,
    image_root: str | Path,
    *,
    split: str = "test",
    threshold: float = 3.0,
    n_bootstrap: int = 1000,
    seed: int = 0,
    batch_size: int = 64,
    device: str | torch.device = "cpu",
    progress: bool = False,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_annotation_bytes: int = DEFAULT_MAX_ANNOTATION_BYTES,
) -> dict[str, Any]:
    """Embed the split's images (under ``image_root``/filepath/filename; a file over ``max_file_bytes`` is an
    error) and captions, then score CxC."""
    from openalign.embed import embed_images, embed_texts
    from openalign.eval.sets import ImageSource

    data = load_cxc(cxc_dir, karpathy_json, split, max_annotation_bytes=max_annotation_bytes)
    root = Path(image_root)
    files = [root / p for p in data.image_paths]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{missing[0]}: image not found ({len(missing)} of {len(files)} missing)")
    image_emb = embed_images(
        model,
        ImageSource.from_files(files, max_bytes=max_file_bytes),
        batch_size=batch_size,
        device=device,
        progress=progress,
    )
    text_emb = embed_texts(model, tokenizer, data.captions, device=device, progress=progress)
    return evaluate_cxc(image_emb, text_emb, data, threshold=threshold, n_bootstrap=n_bootstrap, seed=seed)


# --------------------------------------------------------------------------------------------------
# The `cxc` eval task


def _run(model: DualEncoder, tokenizer: TextTokenizer, options: dict[str, Any]) -> dict[str, Any]:
    from openalign.eval.tasks import max_annotation_bytes, max_file_bytes

    metrics = run_cxc(
        model,
        tokenizer,
        options["cxc"],
        options["karpathy"],
        options["images"],
        split=options["split"],
        threshold=options["threshold"],
        n_bootstrap=options["bootstrap"],
        seed=options["seed"],
        batch_size=options["batch_size"],
        device=options["device"],
        progress=True,
        max_file_bytes=max_file_bytes(options),
        max_annotation_bytes=max_annotation_bytes(options),
    )
    return {"dataset": f"cxc-{options['split']}", **metrics}


def _register() -> None:
    from openalign.eval.tasks import Option, Task, register

    register(
        Task(
            "cxc",
            _run,
            "Crisscrossed Captions: I2T/T2I/T2T/I2I R@1/5/10 with extended positives, STS/SIS/SITS ρ",
            options=(
                Option("cxc", required=True, metavar="DIR", help="directory with sts_/sis_/sits_{val,test}.csv"),
                Option("karpathy", required=True, metavar="JSON", help="Karpathy dataset_coco.json"),
                Option("images", required=True, metavar="DIR", help="COCO image root (holds val2014/)"),
                Option("split", default="test", choices=("val", "test"), help="Karpathy split (default test)"),
                Option("threshold", float, 3.0, help="agg_score at or above which a rated pair is a positive"),
                Option("bootstrap", int, 1000, help="bootstrap resamples for Spearman's ρ (default 1000)"),
                Option("seed", int, 0, help="bootstrap seed (default 0)"),
            ),
            examples=(
                "openalign eval cxc --model runs/b7-base/final --cxc Crisscrossed-Captions/data "
                "--karpathy dataset_coco.json --images coco/ --out results/",
            ),
            description="Retrieval on MSCOCO's Karpathy test split where CxC pairs rated >= 3 count as extra "
            "positives, and Spearman's ρ × 100 (bootstrap mean ± std) between cosine similarity and the human "
            "STS, SIS and SITS ratings.",
        )
    )


_register()
