"""CLIP_benchmark's own metric code on openalign models (through ``openalign.integrations.clip_benchmark``),
against ``openalign eval`` on the same files, and ``--format clip_benchmark`` results.

The ``clip-benchmark`` package is installed without its dependencies; its ``metrics`` modules need only
torch, tqdm and scikit-learn (``balanced_accuracy_score``), which openalign's test extras already have.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from conftest import save_tiny_checkpoint
from openalign.cli import main
from openalign.integrations.clip_benchmark import load_openalign

zeroshot_retrieval = pytest.importorskip("clip_benchmark.metrics.zeroshot_retrieval")
zeroshot_classification = pytest.importorskip("clip_benchmark.metrics.zeroshot_classification")

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 200, 40),
    "blue": (30, 40, 220),
    "yellow": (230, 220, 30),
    "purple": (140, 40, 170),
    "white": (235, 235, 235),
}
TEMPLATES = ["a photo of a {}.", "a drawing of the {}.", "itap of my {}"]
SIZES = ["small", "big", "tiny", "large", "round", "flat"]


def _image(colour: str, seed: int, noise: int = 40) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = np.array(COLOURS[colour], dtype=np.int16)
    pixels = np.clip(base + rng.integers(-noise, noise + 1, (28, 28, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Tiny models on shared cores: intra-op threads only wait on each other."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    words = [f"a {s} {c} square on a {d} table" for c in COLOURS for d in COLOURS for s in SIZES]
    words += [t.format("thing") for t in TEMPLATES]
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), words * 5, vocab_size=250, min_frequency=1)


def _karpathy(root: Path, colours: list[str], *, same_image: bool = False) -> list[tuple[Path, list[str]]]:
    """A Karpathy-style JSON over images written here; returns (image path, captions) per test image."""
    (root / "imgs").mkdir(parents=True)
    entries, pairs = [], []
    tables = [(s, t) for s in SIZES for t in COLOURS]  # every caption different in words the vocabulary knows
    for i, colour in enumerate(colours):
        name = f"{i}.png"
        (_image("red", 0) if same_image else _image(colour, i)).save(root / "imgs" / name)
        captions = [
            f"a {tables[3 * i + k][0]} {colour} square on a {tables[3 * i + k][1]} table" for k in range(1 + i % 3)
        ]
        sentences = [{"raw": c, "sentid": 10 * i + k} for k, c in enumerate(captions)]
        entries.append({"split": "test", "filepath": "imgs", "filename": name, "imgid": i, "sentences": sentences})
        pairs.append((root / "imgs" / name, captions))
    (root / "dataset_flickr30k.json").write_text(json.dumps({"dataset": "flickr30k", "images": entries}))
    return pairs


class _Pairs(Dataset):
    """What CLIP_benchmark's retrieval datasets yield: a transformed image and the list of its captions."""

    def __init__(self, pairs: list[tuple[Path, list[str]]], transform):
        self.pairs, self.transform = pairs, transform

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int):
        path, captions = self.pairs[i]
        return self.transform(Image.open(path).convert("RGB")), captions


def _collate(batch):
    # CLIP_benchmark's retrieval collate: stacked images, captions kept as a list of lists.
    return torch.stack([b[0] for b in batch]), [b[1] for b in batch]


class _Labelled(Dataset):
    def __init__(self, items: list[tuple[Path, int]], classes: list[str], transform):
        self.items, self.classes, self.transform = items, classes, transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        path, label = self.items[i]
        return self.transform(Image.open(path).convert("RGB")), label


def _class_folders(root: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    """Three images per colour in ``<colour>_square`` folders; the folder names and (path, label) pairs."""
    classes = sorted(f"{c}_square" for c in COLOURS)
    items = []
    for label, folder in enumerate(classes):
        (root / folder).mkdir(parents=True)
        for k in range(3):
            path = root / folder / f"{k}.png"
            _image(folder.split("_")[0], 100 * label + k).save(path)
            items.append((path, label))
    return classes, items


def _clip_benchmark_zeroshot(model, loader, tokenizer, names: list[str], templates: list[str]) -> dict:
    """``zeroshot_classification.evaluate``; where its ``accuracy`` fails on NumPy ≥ 2.4 (it calls float() on
    a one-element array), the same steps from its own module: its prompt classifier, its logits, its argmax
    and scikit-learn's balanced accuracy, as ``evaluate`` does after ``accuracy``."""
    try:
        metrics: dict = zeroshot_classification.evaluate(
            model, loader, tokenizer, names, templates, device="cpu", amp=False
        )
        return metrics
    except TypeError as err:
        if "0-dimensional" not in str(err):
            raise
    from sklearn.metrics import balanced_accuracy_score

    classifier = zeroshot_classification.zero_shot_classifier(model, tokenizer, names, templates, "cpu", amp=False)
    logits, target = zeroshot_classification.run_classification(model, classifier, loader, "cpu", amp=False)
    pred = logits.argmax(axis=1)
    top5 = logits.topk(5, 1).indices.eq(target[:, None]).any(1)
    return {
        "acc1": float((pred == target).float().mean()),
        "acc5": float(top5.float().mean()),
        "mean_per_class_recall": balanced_accuracy_score(target, pred),
    }


def _eval(checkpoint: Path, task: str, out: Path, *args: str) -> dict:
    argv = ["eval", task, "--model", str(checkpoint), "--out", str(out), "--format", "clip_benchmark", *args]
    assert main([*argv, "--batch-size", "3"]) == 0
    files = list(out.glob("*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def _openalign_eval(checkpoint: Path, task: str, out: Path, *args: str) -> dict:
    argv = ["eval", task, "--model", str(checkpoint), "--out", str(out), *args, "--batch-size", "3"]
    assert main(argv) == 0
    return json.loads(next(out.glob(f"{task}-*.json")).read_text())


def test_clip_benchmark_retrieval_equals_openalign_eval(checkpoint: Path, tmp_path: Path) -> None:
    pairs = _karpathy(tmp_path / "data", [*COLOURS, *COLOURS])
    model, transform, tokenizer = load_openalign(str(checkpoint))
    loader = DataLoader(_Pairs(pairs, transform), batch_size=5, collate_fn=_collate)
    # amp=False: on CPU its autocast would embed in bfloat16, where openalign embeds in float32.
    theirs = zeroshot_retrieval.evaluate(model, loader, tokenizer, recall_k_list=[1, 5, 10], device="cpu", amp=False)

    spec = ["--dataset", f"karpathy:{tmp_path / 'data' / 'dataset_flickr30k.json'}", "--images", str(tmp_path / "data")]
    ours = _eval(checkpoint, "retrieval", tmp_path / "cb", *spec)
    native = _openalign_eval(checkpoint, "retrieval", tmp_path / "native", *spec)

    assert ours["task"] == "zeroshot_retrieval" and ours["dataset"] == "flickr30k"
    assert set(ours) == {"dataset", "model", "pretrained", "task", "metrics", "language"}
    assert ours["pretrained"] == str(checkpoint) and ours["language"] == "en"
    assert set(ours["metrics"]) == set(theirs)
    for k in (1, 5, 10):
        # No ties here, so the two rules agree.
        assert ours["metrics"][f"image_retrieval_recall@{k}"] == pytest.approx(native["metrics"][f"t2i_r{k}"] / 100)
        assert ours["metrics"][f"text_retrieval_recall@{k}"] == pytest.approx(native["metrics"][f"i2t_r{k}"] / 100)
    for key, value in theirs.items():
        assert ours["metrics"][key] == pytest.approx(value, abs=1e-6), key
    # Not a trivial agreement: a random tiny model gets some but not all of these.
    assert 0 < theirs["image_retrieval_recall@1"] < 1
    print("retrieval CLIP_benchmark", theirs, "openalign", ours["metrics"])


def test_clip_benchmark_zeroshot_equals_openalign_eval(checkpoint: Path, tmp_path: Path) -> None:
    root = tmp_path / "cls"
    classes, items = _class_folders(root)
    (tmp_path / "templates.txt").write_text("\n".join(TEMPLATES) + "\n")
    names = [c.replace("_", " ") for c in classes]

    model, transform, tokenizer = load_openalign(str(checkpoint))
    loader = DataLoader(_Labelled(items, names, transform), batch_size=4)
    # Its templates name the class "{c}", openalign's "{}".
    templates = [t.replace("{}", "{c}") for t in TEMPLATES]
    theirs = _clip_benchmark_zeroshot(model, loader, tokenizer, names, templates)

    spec = ["--dataset", str(root), "--templates", str(tmp_path / "templates.txt")]
    ours = _eval(checkpoint, "zeroshot", tmp_path / "cb", *spec)
    native = _openalign_eval(checkpoint, "zeroshot", tmp_path / "native", *spec)

    assert ours["task"] == "zeroshot_classification" and ours["dataset"] == "cls"
    assert set(ours["metrics"]) == {"acc1", "acc5", "mean_per_class_recall"}
    assert ours["metrics"]["acc1"] == native["metrics"]["top1"] / 100
    assert ours["metrics"]["mean_per_class_recall"] == native["metrics"]["mean_per_class_recall"] / 100
    for key, value in theirs.items():
        assert ours["metrics"][key] == pytest.approx(value, abs=1e-6), key
    assert 0 < theirs["acc1"] < 1
    print("zeroshot CLIP_benchmark", theirs, "openalign", ours["metrics"])


def test_ties_follow_each_formats_own_rule(checkpoint: Path, tmp_path: Path) -> None:
    """With every image the same, all images tie for every caption. CLIP_benchmark's ``topk`` hands the tie to
    one image, whose captions then score, and its format writes that rule, run by CLIP_benchmark's own
    ``recall_at_k`` on the embeddings `openalign eval` made; openalign's own recalls count a tie against the
    query, so a model that cannot tell the images apart gets no text→image recall there."""
    import openalign
    from openalign.embed import embed_images, embed_texts
    from openalign.eval.datasets import load_retrieval

    _karpathy(tmp_path / "data", ["red", "green", "blue", "yellow"], same_image=True)
    karpathy = tmp_path / "data" / "dataset_flickr30k.json"
    spec = ["--dataset", f"karpathy:{karpathy}", "--images", str(tmp_path / "data")]
    ours = _eval(checkpoint, "retrieval", tmp_path / "cb", *spec)
    native = _openalign_eval(checkpoint, "retrieval", tmp_path / "native", *spec)

    dataset = load_retrieval(f"karpathy:{karpathy}", str(tmp_path / "data"), "test")
    model, tokenizer = openalign.load_model(checkpoint), openalign.load_tokenizer(checkpoint)
    with torch.no_grad():  # as `_eval` embeds: images in batches of 3, captions in one
        images = embed_images(model, dataset.images, batch_size=3, progress=False)
        texts = embed_texts(model, tokenizer, dataset.captions, batch_size=256, progress=False)
    scores = texts @ images.T
    positive = torch.zeros_like(scores, dtype=torch.bool)
    positive[torch.arange(len(scores)), torch.tensor(dataset.text_image_ids)] = True
    for key, (s, p) in {"image": (scores, positive), "text": (scores.T, positive.T)}.items():
        theirs = float((zeroshot_retrieval.recall_at_k(s, p, 1) > 0).float().mean())
        assert ours["metrics"][f"{key}_retrieval_recall@1"] == pytest.approx(theirs, abs=1e-6), key
    assert ours["metrics"]["image_retrieval_recall@1"] > 0.0 and native["metrics"]["t2i_r1"] == 0.0


def test_topk_recalls_are_clip_benchmarks_on_sets_with_twin_images() -> None:
    """``topk_recall_at_k`` against CLIP_benchmark's own ``recall_at_k`` and ``batchify``: 60 images of which
    20 are one image repeated, 1–3 captions each, so that many queries meet exact ties."""
    from openalign.eval.retrieval import recall_at_k, topk_recall_at_k

    gen = torch.Generator().manual_seed(0)
    images = torch.nn.functional.normalize(torch.randn(60, 16, generator=gen), dim=1)
    images[40:] = images[40]
    ids = torch.tensor([i for i in range(60) for _ in range(1 + i % 3)])
    texts = torch.nn.functional.normalize(images[ids] + 0.9 * torch.randn(len(ids), 16, generator=gen), dim=1)
    scores = texts @ images.T
    positive = torch.zeros_like(scores, dtype=torch.bool)
    positive[torch.arange(len(ids)), ids] = True
    ks = (1, 5, 10)
    got = topk_recall_at_k(images, texts, ids, ks, block_size=7)
    for k in ks:
        t2i = zeroshot_retrieval.batchify(zeroshot_retrieval.recall_at_k, scores, positive, 16, "cpu", k=k)
        i2t = zeroshot_retrieval.batchify(zeroshot_retrieval.recall_at_k, scores.T, positive.T, 16, "cpu", k=k)
        # Theirs is a float32 mean; one query more or less moves it by at least 100/60 points.
        assert got[f"topk_t2i_r{k}"] == pytest.approx(100 * float((t2i > 0).float().mean()), abs=1e-4)
        assert got[f"topk_i2t_r{k}"] == pytest.approx(100 * float((i2t > 0).float().mean()), abs=1e-4)
    pessimistic = recall_at_k(images, texts, ids, ks)
    assert pessimistic["t2i_r1"] < got["topk_t2i_r1"]  # the twins' ties are what the two rules differ on


def test_loader_embeddings_equal_openalign_embed(checkpoint: Path) -> None:
    import openalign
    from openalign.embed import embed_images, embed_texts

    model, transform, tokenizer = load_openalign("unused-name", pretrained=str(checkpoint))
    texts = ["a red square", "a blue square on a green table number 3"]
    tokens = tokenizer(texts)
    assert tokens.dtype == torch.long and tokens.shape == (2, 16)
    net, tok = openalign.load_model(checkpoint), openalign.load_tokenizer(checkpoint, max_length=16)
    with torch.no_grad():
        torch.testing.assert_close(model.encode_text(tokens), embed_texts(net, tok, texts), rtol=0, atol=1e-6)
        pixels = torch.stack([transform(_image("red", 1)), transform(_image("blue", 2))])
        torch.testing.assert_close(model.encode_image(pixels), embed_images(net, [_image("red", 1), _image("blue", 2)]))


def test_format_clip_benchmark_refuses_tasks_it_has_no_name_for(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["eval", "knn", "--model", str(checkpoint), "--train", str(tmp_path), "--val", str(tmp_path)]
    assert main([*argv, "--format", "clip_benchmark"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CLIP_benchmark counterpart" in err[0]


def test_zeroshot_acc5_is_nan_below_five_classes_as_clip_benchmark_writes_it() -> None:
    from openalign.eval.report import clip_benchmark_result

    result = {
        "task": "zeroshot",
        "dataset": "tiny",
        "model": "runs/x/final",
        "metrics": {"top1": 50.0, "top5": 100.0, "mean_per_class_recall": 37.5, "num_classes": 3},
        "options": {},
    }
    converted = clip_benchmark_result(result, architecture="nano")
    assert converted["model"] == "nano" and converted["pretrained"] == "runs/x/final"
    assert converted["metrics"]["acc1"] == 0.5 and converted["metrics"]["mean_per_class_recall"] == 0.375
    assert math.isnan(converted["metrics"]["acc5"])


def test_a_suite_writes_clip_benchmark_results_for_every_entry(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    _karpathy(tmp_path / "flickr", list(COLOURS))
    _class_folders(tmp_path / "cls")
    (tmp_path / "templates.txt").write_text("\n".join(TEMPLATES) + "\n")
    karpathy = f"karpathy:{tmp_path / 'flickr' / 'dataset_flickr30k.json'}"
    entries = [
        {"task": "retrieval", "dataset": karpathy, "images": str(tmp_path / "flickr")},
        {"task": "zeroshot", "dataset": str(tmp_path / "cls"), "templates": str(tmp_path / "templates.txt")},
    ]
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump({"model": str(checkpoint), "batch_size": 3, "tasks": entries}))
    out = tmp_path / "out"
    assert main(["eval", "suite", str(suite), "--out", str(out), "--format", "clip_benchmark"]) == 0
    written = {json.loads(p.read_text())["task"]: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(written) == ["zeroshot_classification", "zeroshot_retrieval"] and not (out / "results.md").exists()
    # Each entry as a single run writes the same file.
    single = _eval(checkpoint, "zeroshot", tmp_path / "single", "--dataset", str(tmp_path / "cls"),
                   "--templates", str(tmp_path / "templates.txt"))  # fmt: skip
    assert written["zeroshot_classification"] == single

    suite.write_text(
        yaml.safe_dump({"model": str(checkpoint), "tasks": [*entries, {"task": "knn", "train": "x", "val": "y"}]})
    )
    capsys.readouterr()
    assert main(["eval", "suite", str(suite), "--format", "clip_benchmark"]) == 2
    assert "'knn' has no CLIP_benchmark counterpart" in capsys.readouterr().err


def test_linear_probe_writes_clip_benchmark_lp_metrics(checkpoint: Path, tmp_path: Path) -> None:
    _class_folders(tmp_path / "train")
    _class_folders(tmp_path / "val")
    spec = ["--train", str(tmp_path / "train"), "--val", str(tmp_path / "val"), "--method", "lbfgs"]
    ours = _eval(checkpoint, "linear-probe", tmp_path / "cb", *spec)
    native = _openalign_eval(checkpoint, "linear-probe", tmp_path / "native", *spec)
    assert ours["task"] == "linear_probe" and ours["dataset"] == native["dataset"]
    assert set(ours) == {"dataset", "model", "pretrained", "task", "metrics", "language"}
    metrics = ours["metrics"]
    assert metrics["lp_acc1"] == native["metrics"]["top1"] / 100
    assert metrics["lp_acc5"] == native["metrics"]["top5"] / 100
    assert metrics["lp_mean_per_class_recall"] == native["metrics"]["mean_per_class_recall"] / 100
    assert all(0 <= metrics[k] <= 1 for k in ("lp_acc1", "lp_acc5", "lp_mean_per_class_recall"))
    assert metrics["fewshot_k"] == -1 and metrics["normalized"] is True and metrics["epochs"] is None  # lbfgs


def test_loader_reads_a_transformers_align_directory(tmp_path: Path) -> None:
    """A transformers AlignModel directory (config, weights, vocab.txt) through the loader: its embeddings
    are transformers' own for the same pixels and token ids."""
    transformers = pytest.importorskip("transformers")
    from openalign.model.efficientnet import round_filters
    from openalign.text import train_wordpiece

    tokenizer = train_wordpiece([f"a {c} square" for c in COLOURS] * 10, vocab_size=60, min_frequency=1)
    torch.manual_seed(0)
    vision = transformers.AlignVisionConfig(width_coefficient=0.25, depth_coefficient=0.34, image_size=32)
    text = transformers.AlignTextConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=40,
    )  # fmt: skip
    # transformers' AlignModel has no image projection: the text projects to the image features' width.
    width = round_filters(320, 0.25)
    config = transformers.AlignConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=width)
    hf = transformers.AlignModel(config).eval()
    # Fresh batch norms shrink a random EfficientNet's features to ~1e-28; random statistics keep them in range.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in hf.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                m.weight.copy_(1 + torch.randn(m.num_features, generator=gen) * 0.1)
    hf.save_pretrained(tmp_path)
    tokenizer.save(tmp_path)

    model, transform, tok = load_openalign(str(tmp_path))
    ids = tok(["a red square", "a blue square on a green table"])
    pixels = torch.stack([transform(_image("red", 1)), transform(_image("blue", 2))])
    with torch.no_grad():
        out = hf(pixel_values=pixels, input_ids=ids, attention_mask=(ids != 0).long())
        torch.testing.assert_close(model.encode_image(pixels), out.image_embeds, rtol=0, atol=1e-4)
        torch.testing.assert_close(model.encode_text(ids), out.text_embeds, rtol=0, atol=1e-4)
