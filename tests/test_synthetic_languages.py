"""The synthetic world in several languages: same scenes, captions in each language's own words, the
English world unchanged, and its held-out set in Multi30K's layout, read by the real Multi30K loader."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from openalign.data import synthetic as syn
from openalign.data.synthetic_languages import lexicon
from openalign.eval.multilingual import load_multi30k

FOUR = ("en", "de", "fr", "cs")


def _tokens(caption: str) -> list[str]:
    return [w.strip(",") for w in caption.split()]


def _english_words() -> set[str]:
    tables = (syn.COLOUR_WORDS, syn.SIZE_WORDS, syn.POSITION_WORDS, syn.RELATION_WORDS, syn.BACKGROUND_WORDS)
    words = {w for table in tables for phrases in table.values() for p in phrases for w in p.split()}
    words |= {w for forms in syn.SHAPE_WORDS.values() for pair in forms for p in pair for w in p.split()}
    words |= {w for ps in syn.COUNT_WORDS.values() for p in ps for w in p.split()}
    return words | {w for p in syn.PREFIXES for w in p.split()}


def test_english_world_is_unchanged() -> None:
    """The default is the English world as it was: rows, scenes and retrieval captions hash to the digest the
    world gave before it had languages (so every corpus, shard and run made from it is byte-identical)."""
    world = syn.SyntheticWorld(4, 32)
    assert world.languages == ("en",)
    rows = [(r.caption, r.noise, r.image_noise, r.image_id, r.scene.fingerprint()) for r in world.iter_rows(400, 0.3)]
    retrieval = [world.retrieval_item(i, 5)[1] for i in range(50)]
    digest = hashlib.sha256(json.dumps([rows, retrieval], default=str).encode()).hexdigest()
    assert digest == "80d9233e9a624dec6061cf4e3455e7938078e32b6027c55d0379a7a7bfa8fce2"
    assert all(r.language == "en" for r in world.iter_rows(50))


def test_each_row_gets_one_language_from_the_seed_and_keeps_its_scene() -> None:
    english = syn.SyntheticWorld(6, 32)
    world = syn.SyntheticWorld(6, 32, FOUR)
    rows = list(world.iter_rows(800, noise=0.0))
    counts = Counter(r.language for r in rows)
    assert set(counts) == set(FOUR) and min(counts.values()) > 150, counts  # all four, roughly evenly
    # The scene of a row does not depend on its caption's language.
    assert [r.scene for r in rows[:100]] == [r.scene for r in english.iter_rows(100, noise=0.0)]
    again = [(r.language, r.caption) for r in syn.SyntheticWorld(6, 32, FOUR).iter_rows(200, noise=0.0)]
    assert again == [(r.language, r.caption) for r in rows[:200]]
    other_seed = [r.language for r in syn.SyntheticWorld(7, 32, FOUR).iter_rows(200, noise=0.0)]
    assert other_seed != [r.language for r in rows[:200]]
    assert {r.language for r in syn.SyntheticWorld(6, 32, ("cs",)).iter_rows(50)} == {"cs"}


def test_captions_are_in_their_language() -> None:
    """A caption uses only its language's words: no English word in a German one, no German in a Czech one."""
    english = _english_words()
    words = {lang: lexicon(lang) for lang in ("de", "fr", "cs")}
    seen: dict[str, set[str]] = {lang: set() for lang in FOUR}
    for row in syn.SyntheticWorld(2, 32, FOUR).iter_rows(1200, noise=0.0):
        tokens = _tokens(row.caption)
        seen[row.language] |= set(tokens)
        if row.language == "en":
            assert set(tokens) <= english, row.caption
            continue
        assert set(tokens) <= words[row.language], (row.language, row.caption)
        others = set().union(*(words[o] for o in words if o != row.language)) | english
        # Words shared with another language ("orange", "triangle", "in") are fine; a caption made of them is not.
        assert set(tokens) - others, (row.language, row.caption)
    # The lexicons carry what tokenisers trip over: Czech háčeks and čárky, French accents and elisions, German ß.
    assert {"červený", "dvě", "uprostřed"} & seen["cs"] and any("ř" in w for w in seen["cs"])
    assert any("é" in w or "à" in w for w in seen["fr"]) and any("'" in w for w in seen["fr"])
    assert any("ß" in w or "ü" in w for w in seen["de"])


def test_captions_name_the_scene() -> None:
    """The same retrieval scene in four languages: each caption names its colour(s) and shape(s) in its words."""
    world = syn.SyntheticWorld(0, 32)
    colour = {"de": {"red": "rot", "blue": "blau"}, "fr": {"red": "rouge", "blue": "bleu"},
              "cs": {"red": "červen", "blue": "modr"}}  # fmt: skip
    checked = 0
    for i in range(200):
        scene = world.retrieval_item(i, 1)[0]
        if scene.layout != "single" or scene.objects[0].colour not in ("red", "blue"):
            continue
        for lang in ("de", "fr", "cs"):
            [text] = world.retrieval_item(i, 1, lang)[1]
            assert colour[lang][scene.objects[0].colour] in text, (lang, text, scene)
        checked += 1
    assert checked > 10


def test_bad_languages() -> None:
    with pytest.raises(ValueError, match="'xx'"):
        syn.SyntheticWorld(0, 32, ("en", "xx"))
    with pytest.raises(ValueError, match="repeat"):
        syn.SyntheticWorld(0, 32, ("de", "de"))
    with pytest.raises(ValueError, match="no caption languages"):
        syn.SyntheticWorld(0, 32, ())


def test_tokenizer_keeps_accents_only_when_asked() -> None:
    """BERT-uncased normalisation (lowercase=True) strips accents; the multilingual vocabulary keeps them."""
    from openalign.text import train_wordpiece

    captions = [r.caption for r in syn.SyntheticWorld(1, 32, FOUR).iter_rows(400, noise=0.0)]
    uncased = train_wordpiece(captions, vocab_size=600, min_frequency=1)
    cased = train_wordpiece(captions, vocab_size=600, min_frequency=1, lowercase=False)
    assert uncased.backend.normalizer.normalize_str("dvě červené hvězdy") == "dve cervene hvezdy"
    assert cased.backend.normalizer.normalize_str("dvě červené hvězdy") == "dvě červené hvězdy"
    assert "ě" in "".join(cased.backend.get_vocab()) and "ě" not in "".join(uncased.backend.get_vocab())


def test_corpus_in_several_languages(tmp_path: Path) -> None:
    path = syn.write_corpus(tmp_path / "c", 120, seed=3, image_size=32, languages=FOUR, test_duplicates=2)
    table = pq.read_table(path).to_pylist()
    assert {row["language"] for row in table} == set(FOUR)
    world = syn.SyntheticWorld(3, 32, FOUR)
    assert [row["language"] for row in table] == [world.language(i) for i in range(120)]
    again = syn.write_corpus(tmp_path / "w", 120, seed=3, image_size=32, languages=FOUR, test_duplicates=2, workers=2)
    assert pq.read_table(again).to_pylist() == table  # worker processes draw in the same languages
    english = syn.write_corpus(tmp_path / "e", 20, seed=3, image_size=32)
    assert "language" not in pq.read_schema(english).names


def test_multi30k_layout_reads_through_the_multi30k_loader(tmp_path: Path) -> None:
    out = syn.write_multi30k_set(tmp_path / "m30k", 12, FOUR, seed=1, image_size=32)
    data = load_multi30k(out / "raw", out / "image_splits" / "test_2016_flickr.txt", FOUR)
    assert len(data.image_files) == 12 and set(data.captions) == set(FOUR)
    world = syn.SyntheticWorld(1, 32)
    renders = [np.asarray(world.render(world.retrieval_item(i, 1)[0]), np.float32) for i in range(12)]
    for i, name in enumerate(data.image_files):
        [text] = world.retrieval_item(i, 1)[1]
        image = np.asarray(Image.open(out / "images" / name).convert("RGB"), np.float32)
        # Image i is scene i (up to JPEG), closer to it than to any other scene.
        errors = [float(np.abs(image - r).mean()) for r in renders]
        assert image.shape == (32, 32, 3) and int(np.argmin(errors)) == i
        # Line i of every language describes image i: the world's own captions of scene i.
        assert data.captions["en"][i] == text == world.retrieval_item(i, 5)[1][0]
        for lang in ("de", "fr", "cs"):
            assert data.captions[lang][i] == world.retrieval_item(i, 1, lang)[1][0]
            assert set(_tokens(data.captions[lang][i])) <= lexicon(lang)
    # Distinct scenes mostly get distinct captions in every language (captions carry the scene).
    for lang in FOUR:
        assert len(set(data.captions[lang])) >= 10, data.captions[lang]
    with pytest.raises(ValueError, match="'xx'"):
        syn.write_multi30k_set(tmp_path / "bad", 2, ("xx",))
