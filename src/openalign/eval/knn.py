"""KNN classification on frozen image embeddings, the paper's ablation metric ("ImageNet KNN R@1").

The embeddings of a labelled train set are the index and the val images the queries; a query is right
when its nearest train image (cosine similarity) has the query's label. With ``k > 1`` the k nearest
vote; a tied vote goes to the tied label whose member ranks nearest. Neighbours with equal similarity
are ordered by their position in the train set, so results never depend on the order a sort happens
to return ties in (duplicate images are common in web-scale train sets).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from openalign.eval.tasks import Option, Task, register

if TYPE_CHECKING:
    from openalign.model.dual_encoder import DualEncoder
    from openalign.text.tokenizer import TextTokenizer

_BLOCK_ELEMENTS = 16 * 1024 * 1024


def nearest_neighbours(
    index: torch.Tensor, queries: torch.Tensor, k: int = 1, *, block_size: int | None = None
) -> torch.Tensor:
    """Indices [Q, k] of each query's k most similar index rows (dot product), nearest first; equal
    similarities are ordered by index position."""
    index, queries = torch.as_tensor(index), torch.as_tensor(queries)
    if index.ndim != 2 or queries.ndim != 2 or index.shape[1] != queries.shape[1]:
        raise ValueError(f"index {list(index.shape)} and queries {list(queries.shape)} must be [N, D] and [Q, D]")
    n = index.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"k must be between 1 and the {n} index rows, got {k}")
    dtype = torch.promote_types(index.dtype, queries.dtype)
    index, queries = index.to(dtype), queries.to(dtype)
    out = torch.empty(queries.shape[0], k, dtype=torch.long)
    block = block_size or max(1, _BLOCK_ELEMENTS // n)
    for start in range(0, queries.shape[0], block):
        scores = queries[start : start + block] @ index.T
        values, idx = scores.topk(k, dim=1)
        # topk's order among equal scores is unspecified; rows where the k-th score is shared by more
        # rows than were taken (or taken ones tie) are redone with a stable sort.
        kth = values[:, -1:]
        crowded = (scores >= kth).sum(1) > k
        tied_inside = (values[:, 1:] == values[:, :-1]).any(1) if k > 1 else torch.zeros_like(crowded)
        for r in (crowded | tied_inside).nonzero().flatten().tolist():
            order = torch.sort(-scores[r], stable=True).indices[:k]
            idx[r] = order
        out[start : start + block] = idx
    return out


def knn_predict(neighbour_labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Majority label of each row of neighbour labels [Q, k] (nearest first); ties go to the label seen first."""
    q, k = neighbour_labels.shape
    votes = torch.zeros(q, num_classes, dtype=torch.long)
    votes.scatter_add_(1, neighbour_labels, torch.ones_like(neighbour_labels))
    # Break vote ties by the rank of each label's nearest member: score = votes * (k+1) - first rank.
    first = torch.full((q, num_classes), k, dtype=torch.long)
    ranks = torch.arange(k).expand(q, k)
    first.scatter_reduce_(1, neighbour_labels, ranks, reduce="amin")
    return (votes * (k + 1) - first).argmax(1)


def knn_accuracy(
    train_emb: torch.Tensor,
    train_labels: Sequence[int] | torch.Tensor,
    query_emb: torch.Tensor,
    query_labels: Sequence[int] | torch.Tensor,
    k: int = 1,
) -> float:
    """Percent of queries whose k-NN vote (k=1: nearest neighbour) has the query's label."""
    train_labels = torch.as_tensor(np.asarray(train_labels), dtype=torch.long)
    query_labels = torch.as_tensor(np.asarray(query_labels), dtype=torch.long)
    if train_labels.shape[0] != len(train_emb) or query_labels.shape[0] != len(query_emb):
        raise ValueError("every embedding needs exactly one label")
    if query_labels.numel() == 0:
        raise ValueError("no queries")
    nn_idx = nearest_neighbours(torch.as_tensor(train_emb), torch.as_tensor(query_emb), k)
    num_classes = int(max(int(train_labels.max()), int(query_labels.max()))) + 1
    predicted = knn_predict(train_labels[nn_idx], num_classes)
    return 100.0 * float((predicted == query_labels).double().mean())


def _run(model: DualEncoder, tokenizer: TextTokenizer, options: dict[str, Any]) -> dict[str, Any]:
    from openalign.embed import embed_images
    from openalign.eval.datasets import load_classification
    from openalign.eval.tasks import max_annotation_bytes, max_file_bytes

    limits = {"max_file_bytes": max_file_bytes(options), "max_annotation_bytes": max_annotation_bytes(options)}
    train = load_classification(options["train"], options["layout"], options["classnames"], **limits)
    val = load_classification(options["val"], options["layout"], options["classnames"], **limits)
    # Classes are matched by folder / id, so a val set with fewer or more folders still lines up.
    ids = {cid: i for i, cid in enumerate(train.class_ids)}
    unseen = sorted({val.class_ids[y] for y in val.labels} - set(ids))
    extra = len(ids)
    val_labels = [ids.get(val.class_ids[y], extra) for y in val.labels]  # unseen classes: never predicted
    kw = {"batch_size": options["batch_size"], "device": options["device"], "progress": True}
    train_emb = embed_images(model, train.images, **kw)
    val_emb = embed_images(model, val.images, **kw)
    accuracy = knn_accuracy(train_emb, train.labels, val_emb, val_labels, options["k"])
    return {
        "dataset": val.name,
        "accuracy": accuracy,
        "k": options["k"],
        "num_train": len(train.labels),
        "num_val": len(val.labels),
        "val_classes_not_in_train": unseen,
    }


register(
    Task(
        "knn",
        _run,
        "KNN classification on image embeddings (the paper's ImageNet KNN R@1 ablation metric)",
        options=(
            Option(
                "train",
                required=True,
                metavar="PATH",
                help="labelled index set: class folders, wds:SHARDS or NAME:DIR[:SPLIT] (flowers102:DIR:train)",
            ),
            Option("val", required=True, metavar="PATH", help="query set in the same form"),
            Option("k", int, 1, help="neighbours that vote (default 1: R@1 by label)"),
            Option(
                "layout",
                default="auto",
                choices=("auto", "names", "wnids", "indices", "imagenet", "imagenet-r", "imagenet-a", "imagenet-v2"),
                help="how folders map to classes (see zeroshot)",
            ),
            Option("classnames", metavar="FILE", help="class names file for numeric folders or WebDataset"),
        ),
        examples=(
            "openalign eval knn --model runs/b0/final --train imagenet/train --val imagenet/val --out results/",
            "openalign eval knn --model runs/b0/final --train shapes/train --val shapes/val --k 20",
        ),
        description="Embed a labelled train set as the index and classify each val image by its nearest "
        "neighbour (or a k-NN vote); reports the percentage whose label is right.",
    )
)
