from __future__ import annotations

import hashlib
import io
import json
import math
import re
import string
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from openalign.data import synthetic as syn

N_ROWS = 6000


@pytest.fixture(scope="module")
def rows() -> list[syn.Row]:
    return list(syn.SyntheticWorld(seed=3).iter_rows(N_ROWS, noise=0.3))


def _words(text: str) -> list[str]:
    # The filter rules' tokenisation: lowercase, split on whitespace, strip punctuation at the edges.
    return [w for w in (p.strip(string.punctuation) for p in text.lower().split()) if w]


def _digest(image: Image.Image) -> str:
    return hashlib.sha256(image.tobytes()).hexdigest()


def _phrases(table: dict[str, tuple]) -> list[tuple[str, str]]:
    """(phrase, canonical) pairs, longest first, so "to the left of" wins over "left of"."""
    pairs = [(p if isinstance(p, str) else p[0], k) for k, ps in table.items() for p in ps]
    pairs += [(p[1], k) for k, ps in table.items() for p in ps if not isinstance(p, str)]
    return sorted(pairs, key=lambda pk: -len(pk[0]))


def _find(text: str, table: dict[str, tuple]) -> list[str]:
    """Canonical names of every phrase of ``table`` in ``text``, each occurrence consumed once."""
    found = []
    for phrase, canonical in _phrases(table):
        pattern = re.compile(rf"(?<![a-z]){re.escape(phrase)}(?![a-z])")
        while pattern.search(text):
            found.append(canonical)
            text = pattern.sub("#", text, count=1)
    return found


def test_deterministic_and_seed_dependent() -> None:
    a = [(_digest(img), cap) for img, cap in syn.iter_pairs(40, seed=1)]
    b = [(_digest(img), cap) for img, cap in syn.iter_pairs(40, seed=1)]
    c = [(_digest(img), cap) for img, cap in syn.iter_pairs(40, seed=2)]
    assert a == b
    assert sum(x == y for x, y in zip(a, c, strict=True)) == 0
    world = syn.SyntheticWorld(seed=1)
    assert world.row(17).caption == a[17][1]  # random access gives the streamed row
    assert _digest(world.render(world.row(17).scene)) == a[17][0]


def test_noise_kinds_at_expected_rates(rows: list[syn.Row]) -> None:
    noise = 0.3
    counts = Counter(r.noise for r in rows)
    image_counts = Counter(r.image_noise for r in rows)

    def close(observed: int, p: float) -> bool:
        sigma = math.sqrt(N_ROWS * p * (1 - p))
        return abs(observed - N_ROWS * p) < 4 * sigma + 1

    assert close(N_ROWS - counts["clean"], noise)
    for kind, weight in syn.NOISE_WEIGHTS.items():
        assert counts[kind] > 0 and close(counts[kind], noise * weight), (kind, counts[kind])
    for kind, weight in syn.IMAGE_NOISE_WEIGHTS.items():
        # hub rows keep their hub's clean metadata, so image noise is drawn on the other rows only
        p = noise * weight * (1 - noise * syn.NOISE_WEIGHTS["hub"])
        assert image_counts[kind] > 0 and close(image_counts[kind], p), (kind, image_counts[kind])


def test_each_noise_kind_is_what_its_filter_rule_removes(rows: list[syn.Row]) -> None:
    by_kind = defaultdict(list)
    for r in rows:
        by_kind[r.noise].append(r)
    images_per_text = defaultdict(set)
    texts_per_image = Counter(r.image_id for r in rows)
    word_counts = Counter(w for r in rows for w in _words(r.caption))
    for r in rows:
        images_per_text[" ".join(_words(r.caption))].add(r.image_id)
    # boilerplate: the head strings are shared by > 10 distinct images (the ALIGN rule's threshold)
    shared = {t for t, ims in images_per_text.items() if len(ims) > 10}
    boiler = [" ".join(_words(r.caption)) for r in by_kind["boilerplate"]]
    assert sum(t in shared for t in boiler) / len(boiler) > 0.6
    assert any(len(t.split()) >= 3 for t in shared)  # long boilerplate that only the shared rule catches
    assert all(len(_words(r.caption)) < 3 for r in by_kind["short"])
    assert all(len(_words(r.caption)) > 20 for r in by_kind["long"])
    assert all(min(word_counts[w] for w in _words(r.caption)) == 1 for r in by_kind["junk"])
    assert all(texts_per_image[r.image_id] > 10 for r in by_kind["hub"])
    assert max(texts_per_image.values()) >= 25
    names = set(syn.FIRST_NAMES)
    assert all(any(w in names for w in r.caption.split()) for r in by_kind["name"])
    # a mismatched caption describes some other scene: its colours or shapes disagree with the image
    wrong = 0
    for r in by_kind["mismatch"]:
        colours = set(_find(r.caption, syn.COLOUR_WORDS))
        shapes = set(_find(r.caption, syn.SHAPE_WORDS))
        wrong += colours != {o.colour for o in r.scene.objects} or shapes != {o.kind for o in r.scene.objects}
    assert wrong / len(by_kind["mismatch"]) > 0.9
    for r in rows:
        short, long = min(r.width, r.height), max(r.width, r.height)
        assert (short <= 200) == (r.image_noise == "small")
        assert (long / short >= 3) == (r.image_noise == "wide")
        assert (r.punsafe > 0.5) == (r.image_noise == "unsafe")


def test_clean_variant_has_no_noise() -> None:
    rows = list(syn.SyntheticWorld(seed=5).iter_rows(1500, noise=0.0))
    assert {r.noise for r in rows} == {"clean"} and {r.image_noise for r in rows} == {None}
    assert all(min(r.width, r.height) > 200 and max(r.width, r.height) / min(r.width, r.height) < 3 for r in rows)
    assert all(r.punsafe < 0.5 for r in rows)
    assert len({r.image_id for r in rows}) == 1500


def test_clean_captions_describe_their_scenes() -> None:
    rows = list(syn.SyntheticWorld(seed=7).iter_rows(1500, noise=0.0))
    layouts = Counter()
    for r in rows:
        scene, text = r.scene, r.caption
        layouts[scene.layout] += 1
        assert 3 <= len(_words(text)) <= 20, text
        assert _find(text, syn.BACKGROUND_WORDS) == [scene.background], text
        colours = _find(text, syn.COLOUR_WORDS)
        shapes = _find(text, syn.SHAPE_WORDS)
        if scene.layout == "single":
            (obj,) = scene.objects
            assert (colours, shapes) == ([obj.colour], [obj.kind]), text
            assert _find(text, syn.POSITION_WORDS) == [scene.position], text
            x, y = obj.x, obj.y
            assert {"left": x < 0.35, "right": x > 0.65, "top": y < 0.35, "bottom": y > 0.65}.get(scene.position, True)
        elif scene.layout == "count":
            obj = scene.objects[0]
            assert (colours, shapes) == ([obj.colour], [obj.kind]), text
            said = 3 if re.search(r"\bthree\b", text) else 2 if re.search(r"\b(two|a pair of)\b", text) else 0
            assert said == len(scene.objects), text
        else:
            a, b = scene.objects
            (relation,) = _find(text, syn.RELATION_WORDS)
            assert relation == scene.relation, text
            # the caption names the first object before the relation and the second after it
            rel_at = min(text.find(p) for p in syn.RELATION_WORDS[relation] if p in text)
            assert _find(text[:rel_at], syn.COLOUR_WORDS) == [a.colour]
            assert _find(text[rel_at:], syn.COLOUR_WORDS) == [b.colour]
            assert set(_find(text[:rel_at], syn.SHAPE_WORDS)) == {a.kind}
            assert set(_find(text[rel_at:], syn.SHAPE_WORDS)) == {b.kind}
            dx, dy = b.x - a.x, b.y - a.y
            assert {"left of": dx > 0.3, "right of": dx < -0.3, "above": dy > 0.3, "below": dy < -0.3}[relation]
    assert min(layouts.values()) > 200


def test_rendered_pixels_match_the_scene() -> None:
    world = syn.SyntheticWorld(seed=9, image_size=64)
    for i in range(300):
        scene = world.scene(i)
        pixels = np.asarray(world.render(scene))
        assert pixels.shape == (64, 64, 3)
        for obj in scene.objects:
            cx, cy, r = obj.x * 64, obj.y * 64, obj.radius * 64
            if obj.kind == "ring":
                band = [tuple(pixels[int(cy), min(63, int(cx + k))]) for k in range(int(r) + 1)]
                assert obj.rgb in band and band[0] != obj.rgb
            else:
                assert tuple(pixels[int(cy), int(cx)]) == obj.rgb, (i, obj)
    big = syn.SyntheticWorld(seed=9, image_size=160)
    assert big.render(big.scene(0)).size == (160, 160)


def test_held_out_sets_are_disjoint_from_training(rows: list[syn.Row]) -> None:
    images, captions, ids = syn.retrieval_set(300, 5, seed=3)
    assert len(images) == 300 and len(captions) == 1500 and ids == [i for i in range(300) for _ in range(5)]
    for i in range(300):
        assert len(set(captions[5 * i : 5 * i + 5])) == 5
    world = syn.SyntheticWorld(seed=3)
    train = {r.scene.fingerprint() for r in rows}
    test = {world.retrieval_item(i, 1)[0].fingerprint() for i in range(300)}
    test |= {world.class_scene(i)[0].fingerprint() for i in range(560)}
    assert len(test) == 860 and not train & test
    train_pixels = {_digest(world.render(r.scene)) for r in rows[:1000]}
    assert not train_pixels & {_digest(im) for im in images}


def test_retrieval_captions_are_accurate() -> None:
    world = syn.SyntheticWorld(seed=0)
    for i in range(50):
        scene, texts = world.retrieval_item(i, 5)
        for text in texts:
            assert set(_find(text, syn.COLOUR_WORDS)) == {o.colour for o in scene.objects}
            assert _find(text, syn.BACKGROUND_WORDS) == [scene.background]


def test_classification_set() -> None:
    images, labels, names = syn.classification_set(2, seed=0)
    assert len(names) == len(syn.COLOURS) * len(syn.SHAPES) and names == sorted(names)
    assert len(images) == 2 * len(names) and sorted(Counter(labels).values()) == [2] * len(names)
    world = syn.SyntheticWorld(seed=0)
    for i, label in enumerate(labels):
        scene, again = world.class_scene(i)
        assert again == label
        (obj,) = scene.objects
        assert names[label] == f"{obj.colour} {obj.kind}"
        assert obj.colour in syn.ALLOWED_COLOURS[scene.background]
    _, shape_labels, shape_names = syn.classification_set(3, classes="shape")
    assert shape_names == sorted(syn.SHAPES) and len(shape_labels) == 3 * len(syn.SHAPES)
    with pytest.raises(ValueError, match="classes"):
        syn.classification_set(1, classes="colour")  # type: ignore[arg-type]


def test_write_corpus(tmp_path: Path) -> None:
    path = syn.write_corpus(tmp_path / "a", 1200, seed=1, test_duplicates=10)
    table = pq.read_table(path).to_pylist()
    assert list(table[0]) == [
        "key",
        "url",
        "caption",
        "width",
        "height",
        "sha256",
        "punsafe",
        "image_path",
        "noise",
        "image_noise",
        "planted_duplicate_of",
    ]
    assert len(table) == 1200 and len({r["key"] for r in table}) == 1200
    for r in table[:200]:
        data = (tmp_path / "a" / r["image_path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == r["sha256"]
        assert Image.open(io.BytesIO(data)).size == (64, 64)
    hubs = defaultdict(set)
    for r in table:
        if r["noise"] == "hub":
            hubs[r["sha256"]].add((r["url"], r["image_path"], r["width"], r["height"]))
    assert hubs and all(len(v) == 1 for v in hubs.values())  # one image, one url, one set of metadata
    planted = [r for r in table if r["planted_duplicate_of"]]
    assert len(planted) == 10
    assert {p["planted_duplicate_of"].split("/")[0] for p in planted} == {"retrieval", "classification"}
    world = syn.SyntheticWorld(seed=0)
    for p in planted:
        split, _, number = p["planted_duplicate_of"].partition("/")
        scene = world.retrieval_item(int(number), 1)[0] if split == "retrieval" else world.class_scene(int(number))[0]
        original = np.asarray(world.render(scene), dtype=np.float32)
        copy = np.asarray(Image.open(tmp_path / "a" / p["image_path"]), dtype=np.float32)
        diff = np.abs(copy - original).mean()
        assert 0.5 < diff < 40, diff  # changed, yet the same picture
        assert p["noise"] == "clean" and p["caption"]
    # Two processes drawing the rows write the very same files: every image (hubs once) and the table.
    again = syn.write_corpus(tmp_path / "b", 1200, seed=1, test_duplicates=10, workers=2)
    assert pq.read_table(again).to_pylist() == table
    files = {p.relative_to(tmp_path / "a"): p.read_bytes() for p in (tmp_path / "a").rglob("*") if p.is_file()}
    assert {p.relative_to(tmp_path / "b"): p.read_bytes() for p in (tmp_path / "b").rglob("*") if p.is_file()} == files
    assert len(files) == 1 + len({r["image_path"] for r in table}) < 1 + len(table)
    clean = pq.read_table(syn.write_corpus(tmp_path / "c", 50, noise=0.0)).to_pylist()
    assert {r["noise"] for r in clean} == {"clean"} and not any(r["planted_duplicate_of"] for r in clean)
    with pytest.raises(ValueError, match="test_duplicates"):
        syn.write_corpus(tmp_path / "d", 10, test_duplicates=11)
    with pytest.raises(ValueError, match="workers"):
        syn.write_corpus(tmp_path / "d", 10, workers=0)


def test_corpus_workers_draw_a_bounded_number_of_rows_ahead() -> None:
    """The writer asks for a chunk only as it takes one: a slow disk cannot pile drawn rows up in memory."""
    asked: list[tuple[int, int]] = []

    class Done:
        def __init__(self, rows: list) -> None:
            self.rows = rows

        def get(self) -> list:
            return self.rows

    class Pool:  # runs each chunk at once, recording what was asked
        def apply_async(self, fn: object, args: tuple[int, int]) -> Done:
            asked.append(args)
            return Done([(i, b"") for i in range(*args)])

    rows = syn._rendered_in_pool(Pool(), 1000, workers=2, chunk=10)
    taken = [next(rows) for _ in range(25)]  # into the third chunk
    assert [i for i, _ in taken] == list(range(25))
    assert len(asked) == 3 + 4 * 2  # the chunks taken so far, and 4 per worker waiting behind them
    assert [i for i, _ in rows] == list(range(25, 1000)) and asked[-1] == (990, 1000)


def test_write_retrieval_set_karpathy_format(tmp_path: Path) -> None:
    path = syn.write_retrieval_set(tmp_path, 12, 5, seed=0)
    data = json.loads(path.read_text())
    assert data["dataset"] == "synthetic" and len(data["images"]) == 12
    _, captions, _ = syn.retrieval_set(12, 5, seed=0)
    sentids = []
    for i, entry in enumerate(data["images"]):
        assert entry["split"] == "test" and entry["imgid"] == i
        image = Image.open(tmp_path / entry["filepath"] / entry["filename"])
        assert image.size == (64, 64)
        assert [s["raw"] for s in entry["sentences"]] == captions[5 * i : 5 * i + 5]
        assert all(s["imgid"] == i and s["tokens"] == _words(s["raw"].replace(",", " ")) for s in entry["sentences"])
        assert entry["sentids"] == [s["sentid"] for s in entry["sentences"]]
        sentids += entry["sentids"]
    assert sentids == list(range(60))


def test_write_classification_set_imagenet_layout(tmp_path: Path) -> None:
    val = syn.write_classification_set(tmp_path, 1, seed=0, classes="shape")
    names = (tmp_path / "classnames.txt").read_text().splitlines()
    assert names == sorted(syn.SHAPES)
    folders = sorted(p.name for p in val.iterdir())
    assert folders == [n.replace(" ", "_") for n in names]
    assert all(len(list((val / f).glob("*.jpg"))) == 1 for f in folders)


def test_rendering_speed_sanity() -> None:
    world = syn.SyntheticWorld(seed=0)
    syn.texture_bank(64)
    start = time.perf_counter()
    for _ in world.iter_pairs(600):
        pass
    rate = 600 / (time.perf_counter() - start)
    assert rate > 500, f"{rate:.0f} pairs/s"  # ~5000/s on one core; loose for a shared CI machine


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="image_size"):
        syn.SyntheticWorld(image_size=8)
    with pytest.raises(ValueError, match="noise"):
        syn.SyntheticWorld().row(0, noise=1.5)
    with pytest.raises(ValueError, match="n_per_class"):
        syn.classification_set(0)
