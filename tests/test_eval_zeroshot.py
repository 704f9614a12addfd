"""Zero-shot classification, prompt ensembling, KNN, the class-folder loaders and the shipped class lists."""

from __future__ import annotations

import io
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import openalign
from conftest import tiny_overrides
from openalign.embed import embed_texts
from openalign.eval.datasets import load_class_folders, load_classification
from openalign.eval.knn import knn_accuracy, knn_predict, nearest_neighbours
from openalign.eval.templates import (
    SINGLE_TEMPLATE,
    imagenet_classes,
    imagenet_templates,
    load_templates,
    subset_indices,
)
from openalign.eval.zeroshot import classification_metrics, zeroshot_classifier
from openalign.text import train_wordpiece


def test_hand_computed_metrics_with_tie_and_empty_class() -> None:
    scores = torch.tensor(
        [
            [0.9, 0.1, 0.0, 0.0],  # label 0: right
            [0.5, 0.5, 0.0, 0.0],  # label 1: tied with class 0 -> wrong at top-1, right at top-2
            [0.1, 0.2, 0.3, 0.0],  # label 0: third
            [0.0, 0.0, 0.1, 0.9],  # label 3: right
        ]
    )
    got = classification_metrics(scores, [0, 1, 0, 3], ["a", "b", "c", "d"], ks=(1, 2, 3))
    assert got["top1"] == 50.0 and got["top2"] == 75.0 and got["top3"] == 100.0
    # per class: a 1/2, b 0/1, d 1/1; c has no images and is left out of the mean
    assert got["mean_per_class_recall"] == pytest.approx(100 * (0.5 + 0 + 1) / 3)
    assert got["empty_classes"] == ["c"]
    with pytest.raises(ValueError, match="no labelled images"):
        classification_metrics(torch.zeros(0, 3), [])


@pytest.mark.parametrize("seed", range(4))
def test_metrics_match_plain_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, c = 60, 7
    scores = rng.integers(0, 4, (n, c)).astype(float)  # small integers: many ties
    labels = rng.integers(0, c - 1, n)  # the last class never occurs
    got = classification_metrics(torch.tensor(scores), labels, ks=(1, 3))
    ranks = [sum(1 for j in range(c) if j != y and s[j] >= s[y]) for s, y in zip(scores.tolist(), labels, strict=True)]
    assert got["top1"] == pytest.approx(100 * sum(r < 1 for r in ranks) / n)
    assert got["top3"] == pytest.approx(100 * sum(r < 3 for r in ranks) / n)
    per_class = [
        sum(r == 0 for r, y in zip(ranks, labels, strict=True) if y == k) / sum(labels == k)
        for k in range(c)
        if (labels == k).any()
    ]
    assert got["mean_per_class_recall"] == pytest.approx(100 * sum(per_class) / len(per_class))
    assert got["empty_classes"] == [k for k in range(c) if not (labels == k).any()]


def test_prompt_ensemble_is_renormalised_mean_of_normalised_prompts() -> None:
    tokenizer = train_wordpiece(["a photo of a cat dog", "a sketch of the bird"] * 10, vocab_size=80, min_frequency=1)
    torch.manual_seed(0)
    model = openalign.create_model("nano", **tiny_overrides(text={"vocab_size": tokenizer.vocab_size})).eval()
    templates = ["a photo of a {}.", "a sketch of the {}.", "{}"]
    classes = ["cat", "dog", "bird"]
    got = zeroshot_classifier(model, tokenizer, classes, templates, batch_size=2)
    prompts = [t.format(name) for name in classes for t in templates]
    rows = embed_texts(model, tokenizer, prompts, batch_size=len(prompts)).view(3, 3, -1)
    for c in range(len(classes)):
        mean = torch.stack([r / r.norm() for r in rows[c]]).mean(0)
        torch.testing.assert_close(got[c], mean / mean.norm(), atol=1e-5, rtol=1e-5)
    single = zeroshot_classifier(model, tokenizer, classes, [SINGLE_TEMPLATE])
    expected = embed_texts(model, tokenizer, [f"a photo of a {c}." for c in classes])
    torch.testing.assert_close(single, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="class list is empty"):
        zeroshot_classifier(model, tokenizer, [], templates)


def test_shipped_templates_and_imagenet_lists() -> None:
    templates = imagenet_templates()
    assert len(templates) == 80 == len(set(templates)) and all(t.count("{}") == 1 for t in templates)
    assert SINGLE_TEMPLATE in templates and load_templates("single") == [SINGLE_TEMPLATE]
    classes = imagenet_classes()
    wnids = [c.wnid for c in classes]
    assert len(classes) == 1000 and wnids == sorted(wnids) and len(set(wnids)) == 1000
    assert [c.index for c in classes] == list(range(1000))
    assert len({c.name.lower() for c in classes}) == 1000  # every prompt names a distinct class
    assert (classes[0].wnid, classes[0].name) == ("n01440764", "tench")
    assert (classes[999].wnid, classes[999].name) == ("n15075141", "toilet tissue")
    for subset in ("imagenet-r", "imagenet-a"):
        idx = subset_indices(subset)
        assert len(idx) == 200 == len(set(idx)) and list(idx) == sorted(idx)
    assert subset_indices("imagenet-r")[:3] == (1, 2, 4) and subset_indices("imagenet-a")[:3] == (6, 11, 13)


def test_templates_file(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("a {} here\n\nthe {}\n")
    assert load_templates(str(tmp_path / "t.txt")) == ["a {} here", "the {}"]
    (tmp_path / "bad.txt").write_text("no slot\n")
    with pytest.raises(ValueError, match="exactly one"):
        load_templates(str(tmp_path / "bad.txt"))


# --------------------------------------------------------------------------------------------------
# Class folders and WebDataset classification


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (1, 2, 3)).save(buf, "PNG")
    return buf.getvalue()


def _folders(root: Path, spec: dict[str, int]) -> Path:
    for folder, count in spec.items():
        (root / folder).mkdir(parents=True)
        for k in range(count):
            (root / folder / f"{k}.png").write_bytes(_png())
    return root


def test_name_folders(tmp_path: Path) -> None:
    root = _folders(tmp_path / "d", {"sea_lion": 2, "ant": 1, "zebra": 0})
    (root / "ant" / "notes.txt").write_text("x")
    (root / "ant" / ".DS_Store").write_text("x")
    data = load_class_folders(root)
    assert data.classnames == ["ant", "sea lion", "zebra"] and data.labels == [0, 1, 1]
    assert len(data.skipped_files) == 1 and data.skipped_files[0].endswith("notes.txt")
    assert len(list(data.images)) == 3
    (tmp_path / "names.txt").write_text("Ant\nSea lion\nZebra\n")
    assert load_classification(str(root), classnames=str(tmp_path / "names.txt")).classnames == [
        "Ant",
        "Sea lion",
        "Zebra",
    ]
    (tmp_path / "two.txt").write_text("a\nb\n")
    with pytest.raises(ValueError, match="2 class names for 3 classes"):
        load_class_folders(root, classnames=tmp_path / "two.txt")


def test_imagenet_subset_layouts(tmp_path: Path) -> None:
    r = imagenet_classes()
    r_idx = subset_indices("imagenet-r")
    root = _folders(tmp_path / "r", {r[r_idx[0]].wnid: 2, r[r_idx[5]].wnid: 1})
    data = load_class_folders(root, layout="imagenet-r")
    assert data.name == "imagenet-r" and len(data.classnames) == 200 and data.labels == [0, 0, 5]
    assert data.classnames[0] == r[r_idx[0]].name
    auto = load_class_folders(root)  # WordNet-id folders: only the classes present, named from ImageNet
    assert auto.classnames == [r[r_idx[0]].name, r[r_idx[5]].name] and auto.name == "r"
    with pytest.raises(ValueError, match="n01440764: folder is not a class of imagenet-r"):
        load_class_folders(_folders(tmp_path / "x", {"n01440764": 1}), layout="imagenet-r")

    v2 = _folders(tmp_path / "v2", {"0": 1, "10": 2, "2": 1})
    data = load_class_folders(v2, layout="imagenet-v2")
    assert data.name == "imagenet-v2" and len(data.classnames) == 1000
    assert Counter(data.labels) == {0: 1, 2: 1, 10: 2}  # folder "10" is class 10, not the 2nd sorted folder
    with pytest.raises(ValueError, match="class folders are numbers"):
        load_class_folders(v2)
    (tmp_path / "names.txt").write_text("\n".join(f"c{i}" for i in range(11)))
    data = load_class_folders(v2, classnames=tmp_path / "names.txt")
    assert data.classnames[10] == "c10" and Counter(data.labels)[10] == 2


def test_empty_inputs_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no class folders"):
        load_class_folders(tmp_path / "empty")
    with pytest.raises(ValueError, match="no images in any of the 2 classes"):
        load_class_folders(_folders(tmp_path / "none", {"a": 0, "b": 0}))
    with pytest.raises(FileNotFoundError, match="no such class-folder directory"):
        load_class_folders(tmp_path / "missing")
    (tmp_path / "blank.txt").write_text("\n")
    with pytest.raises(ValueError, match="class names file is empty"):
        load_class_folders(_folders(tmp_path / "one", {"a": 1}), classnames=tmp_path / "blank.txt")


def test_webdataset_classification(tmp_path: Path) -> None:
    with tarfile.open(tmp_path / "0.tar", "w") as tf:
        for key, label in (("s0", b"1"), ("s1", b"0"), ("s2", b" 2\n")):
            for ext, data in (("png", _png()), ("cls", label)):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    (tmp_path / "classnames.txt").write_text("cat\ndog\nbird\n")
    data = load_classification(f"wds:{tmp_path / '0.tar'}")
    assert data.classnames == ["cat", "dog", "bird"] and data.labels == [1, 0, 2] and len(list(data.images)) == 3
    (tmp_path / "two.txt").write_text("cat\ndog\n")
    with pytest.raises(ValueError, match=r"0\.tar:s2: label 2 is outside the 2 classes"):
        load_classification(str(tmp_path / "0.tar"), classnames=str(tmp_path / "two.txt"))


# --------------------------------------------------------------------------------------------------
# KNN


def reference_knn(train: np.ndarray, labels: list[int], queries: np.ndarray, k: int) -> list[int]:
    preds = []
    for q in queries:
        sims = [float(np.dot(q, t)) for t in train]
        order = sorted(range(len(train)), key=lambda i: (-sims[i], i))[:k]
        votes = Counter(labels[i] for i in order)
        top = max(votes.values())
        preds.append(next(labels[i] for i in order if votes[labels[i]] == top))
    return preds


def test_knn_hand_case_ties_go_to_the_earlier_neighbour() -> None:
    train = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    labels = [3, 1, 2, 2]
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.8, 0.6]])
    # query 0: rows 0 and 1 tie at 1.0 -> row 0 (label 3) is nearest
    assert nearest_neighbours(train, q, 1)[:, 0].tolist() == [0, 2, 3]
    assert knn_accuracy(train, labels, q, [3, 2, 2], k=1) == 100.0
    assert knn_accuracy(train, labels, q, [1, 2, 2], k=1) == pytest.approx(200 / 3)
    # k=3 for query 0: rows 0, 1 (1.0, 1.0) then row 3 (0.6): votes 3:1, 1:1, 2:1 -> the nearest, label 3
    assert knn_predict(torch.tensor(labels)[nearest_neighbours(train, q, 3)], 4).tolist()[0] == 3


@pytest.mark.parametrize("k", [1, 2, 5])
def test_knn_matches_reference(k: int) -> None:
    rng = np.random.default_rng(k)
    train = rng.integers(-1, 2, (50, 3)).astype(np.float64)  # many exact ties
    labels = rng.integers(0, 4, 50).tolist()
    queries = rng.integers(-1, 2, (30, 3)).astype(np.float64)
    expected = reference_knn(train, labels, queries, k)
    nn_idx = nearest_neighbours(torch.tensor(train), torch.tensor(queries), k, block_size=7)
    assert knn_predict(torch.tensor(labels)[nn_idx], 4).tolist() == expected
    query_labels = rng.integers(0, 4, 30).tolist()
    want = 100 * sum(p == y for p, y in zip(expected, query_labels, strict=True)) / 30
    assert knn_accuracy(train, labels, queries, query_labels, k) == pytest.approx(want)
    with pytest.raises(ValueError, match="k must be between 1 and the 50"):
        nearest_neighbours(torch.tensor(train), torch.tensor(queries), 51)


def test_knn_on_normalised_embeddings_equals_cosine() -> None:
    g = torch.Generator().manual_seed(0)
    train = F.normalize(torch.randn(20, 8, generator=g), dim=1)
    labels = torch.arange(20) % 3
    queries = train[[2, 5, 7]] + 0.01 * torch.randn(3, 8, generator=g)
    assert knn_accuracy(train, labels, F.normalize(queries, dim=1), labels[[2, 5, 7]]) == 100.0
