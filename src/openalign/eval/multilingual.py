"""Multilingual image-text retrieval on Multi30K (Elliott et al. 2016), the paper's Table 9.

Multi30K's task-1 layout: an image list ``image_splits/<split>.txt`` (one Flickr30K file name per line)
and one caption file per language ``raw/<split>.<lang>`` (optionally gzipped), whose line i is the
caption of image i. The paper reports zero-shot "mean Recall": the mean of I2T and T2I R@1, R@5 and
R@10 (six numbers) per language, on ``test_2016_flickr`` (1000 images) for en, de, fr and cs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from openalign.data.sources import DEFAULT_MAX_ANNOTATION_BYTES, DEFAULT_MAX_FILE_BYTES, read_annotation_text

if TYPE_CHECKING:
    from openalign.model.dual_encoder import DualEncoder
    from openalign.text.tokenizer import TextTokenizer

LANGUAGES = ("en", "de", "fr", "cs")


@dataclass
class Multi30KData:
    split: str
    image_files: list[str]
    captions: dict[str, list[str]]  # language -> one caption per image, aligned with image_files


def _read_lines(path: Path, max_bytes: int) -> list[str]:
    # A .gz is decompressed within the same limit: a gzip bomb is an error, not all memory.
    lines = read_annotation_text(path, max_bytes=max_bytes).splitlines()
    while lines and not lines[-1].strip():
        lines.pop()  # a trailing newline is not an extra caption
    return [line.strip() for line in lines]


def _find(directory: Path, name: str) -> Path:
    for candidate in (directory / name, directory / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{directory / name}: no such caption file (nor {name}.gz)")


def load_multi30k(
    captions_dir: str | Path,
    image_list: str | Path,
    languages: Sequence[str] = LANGUAGES,
    split: str = "test_2016_flickr",
    *,
    max_annotation_bytes: int = DEFAULT_MAX_ANNOTATION_BYTES,
) -> Multi30KData:
    """Read the image list and ``<split>.<lang>`` caption files; every file must have one line per image."""
    if not languages:
        raise ValueError("no languages given")
    image_list = Path(image_list)
    if not image_list.is_file():
        raise FileNotFoundError(f"{image_list}: no such image list")
    images = _read_lines(image_list, max_annotation_bytes)
    if not images:
        raise ValueError(f"{image_list}: the image list is empty")
    for lineno, name in enumerate(images, 1):
        if not name:
            raise ValueError(f"{image_list}:{lineno}: empty image name")
    captions: dict[str, list[str]] = {}
    for lang in languages:
        path = _find(Path(captions_dir), f"{split}.{lang}")
        lines = _read_lines(path, max_annotation_bytes)
        if len(lines) != len(images):
            raise ValueError(f"{path}: {len(lines)} captions for the {len(images)} images of {image_list}")
        empty = [i + 1 for i, line in enumerate(lines) if not line]
        if empty:
            raise ValueError(f"{path}:{empty[0]}: empty caption ({len(empty)} empty lines)")
        captions[lang] = lines
    return Multi30KData(split, images, captions)


def mean_recall(metrics: Mapping[str, float], ks: Sequence[int] = (1, 5, 10)) -> float:
    """The paper's mR: the mean of i2t_r{k} and t2i_r{k} over ``ks``."""
    keys = [f"{d}_r{k}" for d in ("i2t", "t2i") for k in ks]
    missing = [k for k in keys if k not in metrics]
    if missing:
        raise ValueError(f"mean recall needs {', '.join(missing)}")
    return sum(float(metrics[k]) for k in keys) / len(keys)


def evaluate_multilingual(
    image_emb: torch.Tensor, text_embs: Mapping[str, torch.Tensor], ks: Sequence[int] = (1, 5, 10)
) -> dict[str, Any]:
    """Per language: I2T/T2I R@k and mean recall, as flat keys ``<lang>_i2t_r1`` ... ``<lang>_mean_recall``.

    Caption j of every language belongs to image j (one caption per image).
    """
    from openalign.eval.retrieval import recall_at_k

    if not text_embs:
        raise ValueError("no languages to evaluate")
    n = image_emb.shape[0]
    out: dict[str, Any] = {}
    for lang, emb in text_embs.items():
        if emb.shape[0] != n:
            raise ValueError(f"{lang}: {emb.shape[0]} caption embeddings for {n} images")
        metrics = recall_at_k(image_emb, emb, torch.arange(n), ks=tuple(ks))
        for key, value in metrics.items():
            out[f"{lang}_{key}"] = value
        out[f"{lang}_mean_recall"] = mean_recall(metrics, ks)
    out["num_images"] = n
    return out


def run_multilingual(
    model: DualEncoder,
    tokenizer: TextTokenizer,
    captions_dir: str | Path,
    image_list: str | Path,
    image_root: str | Path,
    *,
    languages: Sequence[str] = LANGUAGES,
    split: str = "test_2016_flickr",
    batch_size: int = 64,
    device: str | torch.device = "cpu",
    progress: bool = False,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_annotation_bytes: int = DEFAULT_MAX_ANNOTATION_BYTES,
) -> dict[str, Any]:
    """Embed the split's images once (a file over ``max_file_bytes`` is an error) and each language's
    captions, then score every language."""
    from openalign.embed import embed_images, embed_texts
    from openalign.eval.sets import ImageSource

    data = load_multi30k(captions_dir, image_list, languages, split, max_annotation_bytes=max_annotation_bytes)
    files = [Path(image_root) / name for name in data.image_files]
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
    text_embs = {
        lang: embed_texts(model, tokenizer, caps, device=device, progress=progress)
        for lang, caps in data.captions.items()
    }
    return evaluate_multilingual(image_emb, text_embs)


# --------------------------------------------------------------------------------------------------
# The `multilingual` eval task


def _run(model: DualEncoder, tokenizer: TextTokenizer, options: dict[str, Any]) -> dict[str, Any]:
    from openalign.eval.tasks import max_annotation_bytes, max_file_bytes

    metrics = run_multilingual(
        model,
        tokenizer,
        options["captions"],
        options["image_list"],
        options["images"],
        languages=options["languages"],
        split=options["split"],
        batch_size=options["batch_size"],
        device=options["device"],
        progress=True,
        max_file_bytes=max_file_bytes(options),
        max_annotation_bytes=max_annotation_bytes(options),
    )
    return {"dataset": f"multi30k-{options['split']}", **metrics}


def _register() -> None:
    from openalign.eval.tasks import Option, Task, register

    register(
        Task(
            "multilingual",
            _run,
            "Multi30K retrieval per language: R@1/5/10 and mean recall",
            options=(
                Option("captions", required=True, metavar="DIR", help="directory with <split>.<lang>[.gz] files"),
                Option("image_list", required=True, metavar="FILE", help="<split>.txt: one image name per line"),
                Option("images", required=True, metavar="DIR", help="Flickr30K image directory"),
                Option("languages", list, list(LANGUAGES), metavar="LANG", help="languages (default en de fr cs)"),
                Option("split", default="test_2016_flickr", help="file stem of the split (default test_2016_flickr)"),
            ),
            examples=(
                "openalign eval multilingual --model runs/mling/final --captions multi30k/data/task1/raw "
                "--image-list multi30k/data/task1/image_splits/test_2016_flickr.txt --images flickr30k-images",
            ),
            description="Zero-shot image-text retrieval with one caption per image in each language; the "
            "paper's mean recall is the mean of I2T and T2I R@1, R@5 and R@10.",
        )
    )


_register()
