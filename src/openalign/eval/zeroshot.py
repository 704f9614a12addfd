"""Zero-shot classification (paper Table 3): class names through the text tower become the classifier.

Prompt ensembling, as in the paper: every class name is put into each template ("a photo of a {}.",
"a sketch of the {}.", ... the 80 ImageNet prompts), the L2-normalised embeddings are averaged and the
mean is normalised again; the paper reports +2.9 ImageNet top-1 from this over the single prompt
"a photo of a {}." (``ensemble=False``).

Metrics: top-1 and top-5 accuracy over all images, and mean per-class recall (the average over classes
of the fraction of that class's images ranked first). A class without images has no recall; it is left
out of the mean and listed under ``empty_classes``, never counted as 0 or 100. Ties count against the
image: a wrong class scoring the same as the right one ranks above it.

ImageNet-R and ImageNet-A use only their 200 classes: the classifier holds just those, which is the same
as restricting the 1000-way logits to them, since each class's weights do not depend on the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from openalign.eval.tasks import Option, Task, register

if TYPE_CHECKING:
    from openalign.eval.sets import ClassificationSet
    from openalign.model.dual_encoder import DualEncoder
    from openalign.text.tokenizer import TextTokenizer

DEFAULT_KS = (1, 5)


@torch.no_grad()
def zeroshot_classifier(
    model: DualEncoder,
    tokenizer: TextTokenizer,
    classnames: Sequence[str],
    templates: Sequence[str],
    *,
    batch_size: int = 256,
    device: str = "cpu",
    progress: bool = False,
) -> torch.Tensor:
    """Class embeddings [C, D]: per class, the renormalised mean of its normalised prompt embeddings."""
    from openalign.embed import embed_texts

    if not classnames:
        raise ValueError("the class list is empty")
    if not templates:
        raise ValueError("no prompt templates")
    texts = [t.format(c) for c in classnames for t in templates]
    emb = embed_texts(model, tokenizer, texts, batch_size=batch_size, device=device, progress=progress)
    emb = F.normalize(emb, dim=-1).view(len(classnames), len(templates), -1)
    return F.normalize(emb.mean(1), dim=-1)


def true_class_ranks(scores: torch.Tensor, labels: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """For every row, how many other classes score at least as high as the true one (0 = correct at top-1)."""
    scores = torch.as_tensor(scores)
    labels = torch.as_tensor(labels, dtype=torch.long)
    if scores.ndim != 2 or scores.shape[0] != labels.shape[0]:
        raise ValueError(f"scores {list(scores.shape)} do not match {labels.shape[0]} labels")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= scores.shape[1]):
        raise ValueError(f"labels must lie in [0, {scores.shape[1]})")
    own = scores.gather(1, labels[:, None])
    return (scores >= own).sum(1) - 1


def classification_metrics(
    scores: torch.Tensor,
    labels: Sequence[int] | torch.Tensor,
    classnames: Sequence[str] | None = None,
    ks: Sequence[int] = DEFAULT_KS,
) -> dict[str, Any]:
    """``top{k}`` accuracy (percent of all images), ``mean_per_class_recall`` over classes that have
    images, and ``empty_classes`` (names or indices of the classes without any)."""
    scores = torch.as_tensor(scores)
    labels = torch.as_tensor(labels, dtype=torch.long)
    if labels.numel() == 0:
        raise ValueError("no labelled images to score")
    num_classes = scores.shape[1]
    ranks = true_class_ranks(scores, labels)
    out: dict[str, Any] = {f"top{k}": 100.0 * float((ranks < k).double().mean()) for k in ks}
    counts = torch.bincount(labels, minlength=num_classes)
    hits = torch.bincount(labels, weights=(ranks == 0).double(), minlength=num_classes)
    present = counts > 0
    out["mean_per_class_recall"] = 100.0 * float((hits[present] / counts[present]).mean())
    empty = (~present).nonzero().flatten().tolist()
    out["empty_classes"] = [classnames[i] for i in empty] if classnames is not None else empty
    return out


def evaluate_zeroshot(
    model: DualEncoder,
    tokenizer: TextTokenizer,
    dataset: ClassificationSet,
    templates: Sequence[str],
    *,
    batch_size: int = 64,
    device: str = "cpu",
    progress: bool = True,
) -> dict[str, Any]:
    """Zero-shot metrics of a :class:`~openalign.eval.sets.ClassificationSet` with the given templates."""
    from openalign.embed import embed_images

    classifier = zeroshot_classifier(
        model,
        tokenizer,
        dataset.classnames,
        templates,
        batch_size=max(batch_size, 256),
        device=device,
        progress=progress,
    )
    images = embed_images(model, dataset.images, batch_size=batch_size, device=device, progress=progress)
    metrics = classification_metrics(images @ classifier.T, dataset.labels, dataset.classnames)
    metrics.update(
        num_images=len(dataset.labels),
        num_classes=len(dataset.classnames),
        num_templates=len(templates),
        skipped_files=len(dataset.skipped_files),
    )
    return metrics


def _run(model: DualEncoder, tokenizer: TextTokenizer, options: dict[str, Any]) -> dict[str, Any]:
    from openalign.eval.datasets import load_classification
    from openalign.eval.tasks import max_annotation_bytes, max_file_bytes
    from openalign.eval.templates import SINGLE_TEMPLATE, load_templates

    templates = load_templates(options["templates"]) if options["ensemble"] else [SINGLE_TEMPLATE]
    limits = {"max_file_bytes": max_file_bytes(options), "max_annotation_bytes": max_annotation_bytes(options)}
    dataset = load_classification(options["dataset"], options["layout"], options["classnames"], **limits)
    metrics = evaluate_zeroshot(
        model, tokenizer, dataset, templates, batch_size=options["batch_size"], device=options["device"]
    )
    return {"dataset": dataset.name, **metrics}


register(
    Task(
        "zeroshot",
        _run,
        "zero-shot classification with prompt ensembles (ImageNet, -R, -A, -V2, class folders, WebDataset)",
        options=(
            Option(
                "dataset",
                required=True,
                metavar="PATH",
                help="class-folder directory, wds:SHARDS with a cls member, or a released dataset NAME:DIR[:SPLIT]",
            ),
            Option(
                "layout",
                default="auto",
                choices=("auto", "names", "wnids", "indices", "imagenet", "imagenet-r", "imagenet-a", "imagenet-v2"),
                help="how folders map to classes (default auto: numbers, WordNet ids or names)",
            ),
            Option("classnames", metavar="FILE", help="class names, one per line in label order"),
            Option(
                "templates",
                default="imagenet",
                metavar="FILE",
                help="prompt templates: imagenet (the 80 prompts), single, or a file with one per line",
            ),
            Option("ensemble", bool, True, help="use the single prompt 'a photo of a {}.' instead of the ensemble"),
        ),
        examples=(
            "openalign eval zeroshot --model runs/b0/final --dataset imagenet/val --layout imagenet --out results/",
            "openalign eval zeroshot --model runs/b0/final --dataset imagenet-r --layout imagenet-r --no-ensemble",
            "openalign eval zeroshot --model runs/b0/final --dataset imagenetv2-matched-frequency --layout imagenet-v2",
            "openalign eval zeroshot --model runs/b0/final --dataset wds:cifar10/test/0.tar "
            "--classnames classnames.txt",
        ),
        description="Zero-shot top-1, top-5 and mean per-class recall. Class embeddings average the 80 "
        "ImageNet prompts (--no-ensemble: 'a photo of a {}.'); classes without images are left out of "
        "the per-class mean and listed.",
    )
)
