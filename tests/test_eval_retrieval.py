"""Retrieval recall: hand-computed cases, a plain-Python reference, and the dataset loaders' real formats."""

from __future__ import annotations

import csv
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from openalign.eval.datasets import (
    load_coco_captions,
    load_karpathy,
    load_retrieval,
    load_retrieval_csv,
    load_retrieval_wds,
)
from openalign.eval.retrieval import recall_at_k, recall_at_k_sets, retrieval_ranks


def reference_recall(sim: list[list[float]], ids: list[int], ks: tuple[int, ...]) -> dict[str, float]:
    """Ranks by counting, one query at a time; a tie with a wrong item counts against the query."""
    n, m = len(sim), len(sim[0])
    out = {}
    for k in ks:
        hits = 0
        for i in range(n):
            best = max(sim[i][j] for j in range(m) if ids[j] == i)
            wrong_above = sum(1 for j in range(m) if ids[j] != i and sim[i][j] >= best)
            hits += wrong_above < k
        out[f"i2t_r{k}"] = 100.0 * hits / n
    for k in ks:
        hits = 0
        for j in range(m):
            own = sim[ids[j]][j]
            wrong_above = sum(1 for i in range(n) if i != ids[j] and sim[i][j] >= own)
            hits += wrong_above < k
        out[f"t2i_r{k}"] = 100.0 * hits / m
    return out


def test_hand_computed_case_with_several_captions_and_ties() -> None:
    # Scores are dot products of these 2-d vectors:
    #            cap0  cap1  cap2  cap3  cap4      (cap0, cap1 -> image 0; cap2 -> image 1; cap3, cap4 -> image 2)
    # image 0:    0     1     2     0     0        best own caption (cap1, 1) is beaten by cap2: rank 1
    # image 1:    0     1     2     0     0        own caption cap2 scores highest: rank 0
    # image 2:    2     0     0     1     2        own cap4 (2) ties with wrong cap0 (2): rank 1 (pessimistic)
    images = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    texts = torch.tensor([[0.0, 2.0], [1.0, 0.0], [2.0, 0.0], [0.0, 1.0], [0.0, 2.0]])
    ids = [0, 0, 1, 2, 2]
    got = recall_at_k(images, texts, ids, ks=(1, 2))
    # i2t ranks [1, 0, 1] -> R@1 1/3, R@2 3/3.
    # t2i: cap0 own=image0 0, image2 scores 2 -> rank 1 (image1 ties at 0: counts against) -> rank 2
    #      cap1 own=1, image1 ties at 1 -> rank 1;  cap2 own image1 = 2, image0 ties -> rank 1
    #      cap3 own image2 = 1 -> rank 0;  cap4 own image2 = 2 -> rank 0
    assert got == pytest.approx({"i2t_r1": 100 / 3, "i2t_r2": 100.0, "t2i_r1": 40.0, "t2i_r2": 80.0})
    i2t, t2i = retrieval_ranks(images, texts, ids)
    assert i2t.tolist() == [1, 0, 1] and t2i.tolist() == [2, 1, 1, 0, 0]


def test_collapsed_embeddings_score_zero_not_chance() -> None:
    x = torch.ones(4, 3) / 3**0.5
    got = recall_at_k(x, x.repeat(2, 1), [0, 1, 2, 3, 0, 1, 2, 3], ks=(1, 4, 5))
    # Every image ties with every other: 6 wrong captions tie the best right one; 3 wrong images tie each caption.
    assert got == {"i2t_r1": 0.0, "i2t_r4": 0.0, "i2t_r5": 0.0, "t2i_r1": 0.0, "t2i_r4": 100.0, "t2i_r5": 100.0}


@pytest.mark.parametrize("seed", range(6))
def test_matches_reference_on_integer_scores_with_many_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 25))
    m = n + int(rng.integers(0, 40))
    ids = np.concatenate([np.arange(n), rng.integers(0, n, m - n)])
    rng.shuffle(ids)
    x = rng.integers(-2, 3, (n, 3)).astype(np.float64)
    y = rng.integers(-2, 3, (m, 3)).astype(np.float64)
    expected = reference_recall((x @ y.T).tolist(), ids.tolist(), (1, 2, 5, 10))
    assert recall_at_k(x, y, ids, (1, 2, 5, 10)) == pytest.approx(expected)
    # Blocks of a few image rows give the same answer as one block.
    i2t, t2i = retrieval_ranks(x, y, ids, block_size=3)
    i2t_full, t2i_full = retrieval_ranks(x, y, ids)
    assert torch.equal(i2t, i2t_full) and torch.equal(t2i, t2i_full)


def test_float32_unit_vectors_match_float64_reference() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(40, 16, generator=g), dim=1)
    ids = torch.arange(200) % 40
    y = torch.nn.functional.normalize(x[ids] + 0.9 * torch.randn(200, 16, generator=g), dim=1)
    x[7] = x[3]  # a duplicate image: an exact tie that float32 rounding must not turn into a win
    expected = reference_recall((x.double() @ y.double().T).tolist(), ids.tolist(), (1, 5, 10))
    got = recall_at_k(x, y, ids)
    assert got == pytest.approx(expected)
    _, t2i = retrieval_ranks(x, y, ids, block_size=7)
    assert bool((t2i[(ids == 3) | (ids == 7)] >= 1).all())


def reference_ranks(sim: list[list[float]], ids: list[int], tolerance: float = 0.0) -> tuple[list[int], list[int]]:
    """Pessimistic ranks by counting wrong items at or above the best right one (less ``tolerance``), one
    query at a time."""
    n, m = len(sim), len(sim[0])
    i2t = []
    for i in range(n):
        best = max(sim[i][j] for j in range(m) if ids[j] == i)
        i2t.append(sum(1 for j in range(m) if ids[j] != i and sim[i][j] >= best - tolerance))
    t2i = [sum(1 for i in range(n) if i != ids[j] and sim[i][j] >= sim[ids[j]][j] - tolerance) for j in range(m)]
    return i2t, t2i


@pytest.mark.parametrize("tile", [(None, None), (7, 13), (140, 37), (1, 1), (200, 1000)])
def test_ranks_do_not_depend_on_the_tile_shape(tile: tuple[int | None, int | None]) -> None:
    # 140 images span more than one 128-row comparison stripe; integer float32 scores are exact, with many
    # ties, and shuffled captions put own pairs in every tile.
    rng = np.random.default_rng(11)
    n, m = 140, 330
    ids = np.concatenate([np.arange(n), rng.integers(0, n, m - n)])
    rng.shuffle(ids)
    x = rng.integers(-2, 3, (n, 4)).astype(np.float32)
    y = rng.integers(-2, 3, (m, 4)).astype(np.float32)
    i2t_ref, t2i_ref = reference_ranks((x.astype(np.float64) @ y.T.astype(np.float64)).tolist(), ids.tolist())
    i2t, t2i = retrieval_ranks(x, y, ids, block_size=tile[0], block_columns=tile[1])
    assert i2t.tolist() == i2t_ref and t2i.tolist() == t2i_ref
    assert i2t.dtype == t2i.dtype == torch.long


def capped(ranks: list[int], max_rank: int) -> list[int]:
    return [min(r, max_rank) for r in ranks]


def clustered(seed: int, n: int = 150, m: int = 450, d: int = 48, spread: float = 2e-3):
    """Images in groups of five nearly identical vectors (closer than bfloat16 can tell apart) and captions
    near their image: bfloat16 scores alone tie or misorder most of the ranks that matter."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(n // 5, d, generator=g), dim=1)
    x = torch.nn.functional.normalize(centres.repeat_interleave(5, 0) + spread * torch.randn(n, d, generator=g), dim=1)
    ids = torch.cat([torch.arange(n), torch.randint(0, n, (m - n,), generator=g)])
    y = torch.nn.functional.normalize(x[ids] + spread * torch.randn(m, d, generator=g), dim=1)
    return x, y, ids


def near_zero(seed: int, n: int = 150, m: int = 450, d: int = 48):
    """Scores within 0.01 of zero, where rounding the product to bfloat16 costs almost nothing and the
    rounding of the inputs is the whole error; captions stand out from their image's neighbours by ~1e-3."""
    g = torch.Generator().manual_seed(seed)
    a = torch.nn.functional.normalize(torch.randn(d, generator=g), dim=0)
    b = torch.randn(d, generator=g)
    b = torch.nn.functional.normalize(b - (b @ a) * a, dim=0)
    x = torch.nn.functional.normalize(a + 1e-3 * torch.randn(n, d, generator=g), dim=1)
    ids = torch.cat([torch.arange(n), torch.randint(0, n, (m - n,), generator=g)])
    y = torch.nn.functional.normalize(b + 20 * (x[ids] - a) + 1e-3 * torch.randn(m, d, generator=g), dim=1)
    return x, y, ids


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("data", [clustered, near_zero])
@pytest.mark.parametrize("tile", [(None, None), (40, 70), (150, 16)])
def test_bfloat16_ranks_are_the_exact_ranks(seed: int, data: Any, tile: tuple[int | None, int | None]) -> None:
    x, y, ids = data(seed)
    sim = (x.double() @ y.double().T).tolist()
    # Scores within the default tie tolerance of the bar count as ties, as they do in float32.
    i2t_ref, t2i_ref = reference_ranks(sim, ids.tolist(), tolerance=1e-6)
    # The data must be a case that bfloat16 scores alone get wrong, or this test proves nothing.
    naive_i2t, naive_t2i = reference_ranks((x.bfloat16() @ y.bfloat16().T).double().tolist(), ids.tolist())
    assert capped(naive_t2i, 10) != capped(t2i_ref, 10) and capped(naive_i2t, 10) != capped(i2t_ref, 10)
    for max_rank in (1, 5, 10):
        i2t, t2i = retrieval_ranks(
            x, y, ids, max_rank=max_rank, precision="bfloat16", block_size=tile[0], block_columns=tile[1]
        )
        assert i2t.tolist() == capped(i2t_ref, max_rank)
        assert t2i.tolist() == capped(t2i_ref, max_rank)


@pytest.mark.parametrize("high, d", [(2, 4), (20, 8)])
def test_bfloat16_integer_scores_keep_ties_pessimistic(high: int, d: int) -> None:
    # Small integers are exact in bfloat16, so every tie is a true tie. With components up to 20 the inputs
    # are still exact but scores pass 256, where bfloat16 cannot tell neighbouring integers apart: the
    # rounding of the product is then the only error, and the ranks must allow for it.
    rng = np.random.default_rng(5)
    n, m = 60, 200
    ids = np.concatenate([np.arange(n), rng.integers(0, n, m - n)])
    x = rng.integers(-high, high + 1, (n, d)).astype(np.float32)
    y = rng.integers(-high, high + 1, (m, d)).astype(np.float32)
    i2t_ref, t2i_ref = reference_ranks((x.astype(np.float64) @ y.T.astype(np.float64)).tolist(), ids.tolist())
    i2t, t2i = retrieval_ranks(x, y, ids, max_rank=10, precision="bfloat16", block_size=16, block_columns=50)
    assert i2t.tolist() == capped(i2t_ref, 10) and t2i.tolist() == capped(t2i_ref, 10)


def test_recall_is_the_same_at_every_precision() -> None:
    g = torch.Generator().manual_seed(1)
    n, d = 300, 128
    x = torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)
    ids = torch.arange(5 * n) // 5
    y = torch.nn.functional.normalize(x[ids] + 4 / d**0.5 * torch.randn(5 * n, d, generator=g), dim=1)
    expected = reference_recall((x.double() @ y.double().T).tolist(), ids.tolist(), (1, 5, 10))
    assert 5 < expected["t2i_r1"] < 95  # neither trivial nor hopeless
    for precision in ("float32", "bfloat16", "auto"):
        assert recall_at_k(x, y, ids, precision=precision) == pytest.approx(expected)
    assert recall_at_k(x.double().numpy(), y.double().numpy(), ids, precision="bfloat16") == pytest.approx(expected)


def test_bfloat16_product_error_stays_within_the_bound_the_ranks_rely_on() -> None:
    # The bound assumes this CPU's bfloat16 matrix product sums in float32 and rounds once: checked here on
    # every pair of unit and non-unit vectors, against the bound written out plainly.
    g = torch.Generator().manual_seed(2)
    for d, scale in ((64, 1.0), (640, 1.0), (640, 7.5), (1024, 0.01)):
        x = scale * torch.nn.functional.normalize(torch.randn(200, d, generator=g), dim=1)
        y = torch.nn.functional.normalize(torch.randn(700, d, generator=g) + 0.3, dim=1)
        exact = x.double() @ y.double().T
        approx = (x.bfloat16() @ y.bfloat16().T).double()
        dx = (x.bfloat16().double() - x.double()).norm(dim=1)[:, None]
        dy = (y.bfloat16().double() - y.double()).norm(dim=1)[None, :]
        nx, ny = x.double().norm(dim=1)[:, None], y.double().norm(dim=1)[None, :]
        gamma = 2 * d * 2.0**-24 / (1 - 2 * d * 2.0**-24)
        input_error = nx * dy + dx * ny + dx * dy + gamma * (nx + dx) * (ny + dy)
        output_rounding = 2.0**-8 / (1 - 2.0**-8) * approx.abs()
        assert bool(((approx - exact).abs() <= input_error + output_rounding).all())


@pytest.mark.parametrize("sure", [True, False])
def test_bfloat16_thresholds_round_the_safe_way(sure: bool) -> None:
    from openalign.eval.retrieval import _BF16_ROUNDING, _score_reaching

    rng = np.random.default_rng(3)
    bar = np.concatenate([rng.normal(0, 0.3, 2000), [0.0, 1e-30, -1e-30, 1.0, -1.0]])
    t = _score_reaching(bar, sure=sure).astype(np.float64)
    r = _BF16_ROUNDING
    if sure:
        # Any score at or above the threshold is certainly at or above the bar, even at its lowest.
        assert bool((t - r * np.abs(t) >= bar).all())
    else:
        # Any score below the threshold cannot reach the bar, even at its highest.
        below = np.nextafter(t.astype(np.float32), np.float32(-np.inf)).astype(np.float64)
        assert bool((below + r * np.abs(below) < bar).all())


def test_max_rank_caps_float32_ranks_and_precision_is_checked() -> None:
    x, y, ids = clustered(0, n=30, m=60)
    i2t, t2i = retrieval_ranks(x, y, ids)
    i2t5, t2i5 = retrieval_ranks(x, y, ids, max_rank=5, precision="float32")
    assert i2t5.tolist() == capped(i2t.tolist(), 5) and t2i5.tolist() == capped(t2i.tolist(), 5)
    with pytest.raises(ValueError, match="needs max_rank"):
        retrieval_ranks(x, y, ids, precision="bfloat16")
    with pytest.raises(ValueError, match="precision must be"):
        retrieval_ranks(x, y, ids, max_rank=5, precision="float16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_rank must be a positive integer"):
        retrieval_ranks(x, y, ids, max_rank=0)


def test_bad_inputs_name_the_problem() -> None:
    x, y = torch.eye(3), torch.eye(3)
    with pytest.raises(ValueError, match="image 1 has no caption"):
        recall_at_k(x, y, [0, 2, 2])
    with pytest.raises(ValueError, match="contains 3, outside the 3 images"):
        recall_at_k(x, y, [0, 1, 3])
    with pytest.raises(ValueError, match="one entry per caption"):
        recall_at_k(x, y, [0, 1])
    with pytest.raises(ValueError, match="dims"):
        recall_at_k(x, torch.eye(3, 4), [0, 1, 2])
    with pytest.raises(ValueError, match="positive integers"):
        recall_at_k(x, y, [0, 1, 2], ks=(0,))
    with pytest.raises(ValueError, match="non-empty"):
        recall_at_k(torch.empty(0, 3), y, [0, 1, 2])
    with pytest.raises(ValueError, match="NaN"):
        recall_at_k(x * float("nan"), y, [0, 1, 2])


# --------------------------------------------------------------------------------------------------
# Recall with a set of positives per query (CxC's extended positives)


def slow_recall(q: torch.Tensor, c: torch.Tensor, positives, k: int, exclude=None) -> tuple[float, int]:
    """Plain reference: sort candidates by score, ties broken against the query (negatives first)."""
    hits, n = 0, 0
    for i in range(len(q)):
        pos = set(positives[i])
        if not pos:
            continue
        n += 1
        cands = [j for j in range(len(c)) if exclude is None or j != exclude[i]]
        scores = {j: float(q[i] @ c[j]) for j in cands}
        order = sorted(cands, key=lambda j: (-scores[j], j in pos))
        hits += any(j in pos for j in order[:k])
    return 100.0 * hits / n, n


def test_recall_at_k_sets_hand_computed() -> None:
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    c = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [0.6, 0.8]])
    # q0 best positive is c1 (rank 1 behind c0); q1's positive c2 is the top; q2 has none (skipped)
    r = recall_at_k_sets(q, c, [{1}, {2, 0}, set()], ks=(1, 2))
    assert (r["r1"], r["r2"], r["queries"], r["skipped"]) == (50.0, 100.0, 2, 1)
    # excluding c0 from q0's ranking puts c1 first
    assert recall_at_k_sets(q[:1], c, [{1}], ks=(1,), exclude=[0])["r1"] == 100.0
    # ties count against: a positive tied with a negative is not at rank 1
    assert recall_at_k_sets(q[:1], torch.tensor([[1.0, 0.0], [1.0, 0.0]]), [{1}], ks=(1, 2)) == {
        "r1": 0.0,
        "r2": 100.0,
        "queries": 1,
        "skipped": 0,
    }


def test_recall_at_k_sets_matches_slow_reference() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(37, 6, generator=g), dim=1)
    c = torch.nn.functional.normalize(torch.randn(53, 6, generator=g), dim=1)
    c[5] = c[4]  # an exact tie
    rng = np.random.default_rng(0)
    positives = [set(rng.choice(53, size=rng.integers(0, 4), replace=False).tolist()) for _ in range(37)]
    exclude = [int(rng.integers(0, 53)) for _ in range(37)]
    exclude = [e if e not in p else None for e, p in zip(exclude, positives, strict=True)]
    r = recall_at_k_sets(q, c, positives, ks=(1, 5, 10), exclude=exclude, block_size=8)
    for k in (1, 5, 10):
        ref, n = slow_recall(q, c, positives, k, exclude)
        assert r[f"r{k}"] == pytest.approx(ref)
        assert r["queries"] == n


def test_recall_at_k_sets_bad_input() -> None:
    q, c = torch.eye(2), torch.eye(3, 2)
    with pytest.raises(ValueError, match="outside"):
        recall_at_k_sets(q, c, [{3}, {0}])
    with pytest.raises(ValueError, match="no query has a positive"):
        recall_at_k_sets(q, c, [set(), set()])
    with pytest.raises(ValueError, match="2 queries"):
        recall_at_k_sets(q, c, [{0}])
    with pytest.raises(ValueError, match="both excluded and a positive"):
        recall_at_k_sets(q, c, [{0}, {1}], exclude=[0, None])


# --------------------------------------------------------------------------------------------------
# Loaders


def _png(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), colour).save(buf, "PNG")
    return buf.getvalue()


def _karpathy(root: Path) -> Path:
    (root / "val2014").mkdir(parents=True)
    images = []
    for i in range(3):
        (root / "val2014" / f"COCO_{i}.jpg").write_bytes(_png((80 * i, 0, 0)))
        images.append(
            {
                "split": "test" if i < 2 else "restval",
                "filepath": "val2014",
                "filename": f"COCO_{i}.jpg",
                "sentences": [
                    {"raw": f"picture {i} caption {k} ", "tokens": ["x"], "sentid": 5 * i + k} for k in range(i + 1)
                ],
            }
        )
    path = root / "dataset_coco.json"
    path.write_text(json.dumps({"dataset": "coco", "images": images}))
    return path


def test_karpathy_loader(tmp_path: Path) -> None:
    data = load_karpathy(_karpathy(tmp_path), tmp_path)
    assert data.name == "coco" and data.captions == [
        "picture 0 caption 0",
        "picture 1 caption 0",
        "picture 1 caption 1",
    ]
    assert data.text_image_ids == [0, 1, 1] and len(data.images) == 2
    pixels = [im.getpixel((0, 0)) for im in data.images]
    assert pixels == [(0, 0, 0), (80, 0, 0)]
    assert len(load_karpathy(tmp_path / "dataset_coco.json", tmp_path, split="restval").images) == 1
    # Images directly under the root are found too (people often flatten COCO's val2014 folder).
    flat = tmp_path / "flat"
    flat.mkdir()
    for p in (tmp_path / "val2014").iterdir():
        (flat / p.name).write_bytes(p.read_bytes())
    assert len(load_retrieval(f"karpathy:{tmp_path / 'dataset_coco.json'}", flat).images) == 2


def test_karpathy_errors(tmp_path: Path) -> None:
    path = _karpathy(tmp_path)
    (tmp_path / "val2014" / "COCO_1.jpg").unlink()
    with pytest.raises(FileNotFoundError, match=r"COCO_1\.jpg: image file not found"):
        load_karpathy(path, tmp_path)
    with pytest.raises(ValueError, match=r"no images in split 'val'; splits present: restval \(1\), test \(2\)"):
        load_karpathy(path, tmp_path, split="val")
    data = json.loads(path.read_text())
    data["images"][0]["sentences"] = []
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"COCO_0\.jpg has no sentences"):
        load_karpathy(path, tmp_path)
    with pytest.raises(FileNotFoundError, match="no such Karpathy split file"):
        load_karpathy(tmp_path / "nope.json", tmp_path)
    with pytest.raises(ValueError, match="karpathy caption file needs the image root"):
        load_retrieval(str(path))


def test_corrupt_image_is_named_when_read(tmp_path: Path) -> None:
    path = _karpathy(tmp_path)
    (tmp_path / "val2014" / "COCO_1.jpg").write_bytes(b"not an image")
    data = load_karpathy(path, tmp_path)
    with pytest.raises(ValueError, match=r"COCO_1.jpg: unreadable image \(corrupt"):
        list(data.images)


def _tar(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def test_webdataset_retrieval_set(tmp_path: Path) -> None:
    _tar(
        tmp_path / "0.tar",
        {"a.jpg": _png((1, 2, 3)), "a.txt": b"first\nsecond\n\n", "b.png": _png((9, 9, 9)), "b.txt": b"third"},
    )
    _tar(tmp_path / "1.tar", {"c.webp": _png((5, 5, 5)), "c.txt": b"fourth\nfifth", "c.json": b"{}"})
    data = load_retrieval(f"wds:{tmp_path}/{{0..1}}.tar")
    assert data.captions == ["first", "second", "third", "fourth", "fifth"]
    assert data.text_image_ids == [0, 0, 1, 2, 2]
    assert [im.getpixel((0, 0)) for im in data.images] == [(1, 2, 3), (9, 9, 9), (5, 5, 5)]
    _tar(tmp_path / "2.tar", {"d.jpg": _png((1, 1, 1))})
    with pytest.raises(ValueError, match=r"2\.tar:d: sample has no 'txt' captions"):
        load_retrieval_wds(str(tmp_path / "2.tar"))
    with pytest.raises(FileNotFoundError, match=r"9\.tar: no such shard"):
        load_retrieval_wds(str(tmp_path / "9.tar"))


def test_csv_retrieval_set_groups_by_image(tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    for name in ("x.png", "y.png"):
        (tmp_path / "img" / name).write_bytes(_png((7, 7, 7)))
    rows = [("img/x.png", "one"), ("img/y.png", "two"), ("img/x.png", "three")]
    with (tmp_path / "pairs.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["filepath", "Caption"])
        writer.writerows(rows)
    data = load_retrieval_csv(tmp_path / "pairs.csv")
    assert data.captions == ["one", "two", "three"] and data.text_image_ids == [0, 1, 0] and len(data.images) == 2
    with (tmp_path / "bad.csv").open("w") as f:
        f.write("image,caption\nimg/x.png,one\nimg/z.png,two\n")
    with pytest.raises(FileNotFoundError, match=r"z\.png: image file not found, listed in .*bad\.csv"):
        load_retrieval(str(tmp_path / "bad.csv"))
    with (tmp_path / "cols.csv").open("w") as f:
        f.write("picture,words\na,b\n")
    with pytest.raises(ValueError, match="no image column"):
        load_retrieval_csv(tmp_path / "cols.csv")


def test_coco_caption_file(tmp_path: Path) -> None:
    for name in ("a.jpg", "b.jpg"):
        (tmp_path / name).write_bytes(_png((3, 3, 3)))
    anns = [{"id": 1, "image_id": 20, "caption": "x"}, {"id": 2, "image_id": 10, "caption": "y"}]
    anns.append({"id": 3, "image_id": 20, "caption": "z "})
    images = [{"id": 10, "file_name": "a.jpg"}, {"id": 20, "file_name": "b.jpg"}]
    (tmp_path / "captions_val2014.json").write_text(json.dumps({"images": images, "annotations": anns}))
    data = load_retrieval(f"coco:{tmp_path / 'captions_val2014.json'}", tmp_path)
    assert data.captions == ["x", "y", "z"] and data.text_image_ids == [1, 0, 1]
    anns.append({"id": 4, "image_id": 30, "caption": "lost"})
    (tmp_path / "bad.json").write_text(json.dumps({"images": images, "annotations": anns}))
    with pytest.raises(ValueError, match="caption 4 refers to image_id 30, which is not in 'images'"):
        load_coco_captions(tmp_path / "bad.json", tmp_path)


def test_retrieval_bench_reports_both_timings(tmp_path: Path) -> None:
    from openalign.bench.retrieval import RetrievalBenchSettings, run_retrieval_bench

    out = tmp_path / "bench.json"
    result = run_retrieval_bench(RetrievalBenchSettings(images=60, dim=16, rounds=1, json_path=str(out)))
    assert json.loads(out.read_text()) == result
    assert result["matmul_s"] > 0 and result["ratio"] == pytest.approx(result["recall_at_k_s"] / result["matmul_s"])
    assert result["identical"] and 0 < result["metrics"]["t2i_r1"] < 100
    with pytest.raises(ValueError, match="must be positive"):
        run_retrieval_bench(RetrievalBenchSettings(images=0))


def plain_recalls(image_emb: torch.Tensor, text_emb: torch.Tensor, ids: list[int]) -> dict[str, float]:
    """Recall by sorting every query's scores (correct when no two scores tie)."""
    sims = image_emb @ text_emb.T
    out = {}
    for k in (1, 5, 10):
        i2t = [any(ids[j] == i for j in sims[i].argsort(descending=True)[:k].tolist()) for i in range(len(sims))]
        t2i = [ids[j] in sims[:, j].argsort(descending=True)[:k].tolist() for j in range(sims.shape[1])]
        out[f"i2t_r{k}"] = 100 * sum(i2t) / len(i2t)
        out[f"t2i_r{k}"] = 100 * sum(t2i) / len(t2i)
    return out


def test_evaluate_retrieval_matches_a_plain_computation_and_leaves_state_alone(tiny_model) -> None:
    from openalign.data.transforms import model_transform
    from openalign.eval.retrieval import RetrievalSet, evaluate_retrieval
    from openalign.text import train_wordpiece

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)) for _ in range(12)]
    words = ["red", "blue", "round", "square", "big", "small", "dog", "cat"]
    captions = [f"{words[i % 8]} {words[i // 8]} {words[(i * 5 + 1) % 8]}" for i in range(24)]  # all distinct
    ids = [i // 2 for i in range(24)]
    tokenizer = train_wordpiece(captions * 3, vocab_size=tiny_model.config.text.vocab_size, min_frequency=1)
    tiny_model.train()
    state = torch.get_rng_state()
    got = evaluate_retrieval(tiny_model, tokenizer, RetrievalSet(images, captions, ids), batch_size=5, progress=False)
    assert tiny_model.training and torch.equal(torch.get_rng_state(), state)

    tiny_model.eval()
    with torch.no_grad():
        transform = model_transform(tiny_model.config)
        image_emb = tiny_model.encode_image(torch.stack([transform(im) for im in images]))
        tokens = tokenizer(captions, max_length=16)
        text_emb = tiny_model.encode_text(tokens["input_ids"], tokens["attention_mask"])
    want = plain_recalls(image_emb, text_emb, ids)
    assert len(set(captions)) == 24 and 0 < want["t2i_r5"] < 100  # no ties, not a trivial answer
    topk = {f"topk_{key}" for key in want}  # CLIP_benchmark's tie rule, the same values where nothing ties
    assert got.keys() == {*want, *topk, "mean_recall", "num_images", "num_captions"}
    for key in want:
        assert got[f"topk_{key}"] == pytest.approx(want[key], abs=1e-6), key
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-6), key
    assert got["mean_recall"] == pytest.approx(sum(want.values()) / len(want), abs=1e-6)
    assert (got["num_images"], got["num_captions"]) == (12, 24)


def test_retrieval_set_checks_its_captions() -> None:
    from openalign.eval.retrieval import RetrievalSet

    images = [Image.new("RGB", (4, 4))] * 3
    with pytest.raises(ValueError, match="3 captions but 2 text_image_ids"):
        RetrievalSet(images, ["a", "b", "c"], [0, 1])
    with pytest.raises(ValueError, match="image 3, outside"):
        RetrievalSet(images, ["a", "b", "c"], [0, 1, 3])
    with pytest.raises(ValueError, match="image #2 has no caption"):
        RetrievalSet(images, ["a", "b"], [0, 1])
    with pytest.raises(ValueError, match="no images"):
        RetrievalSet([], [], [])
