"""CC12M's rules beyond the word rules: the NLP interface and its spaCy backend, no noun or no determiner,
JPEG only, image-tag overlap and <PERSON> substitution, each at its boundaries, on DuckDB and Spark alike."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image

from openalign.cli import main
from openalign.data.filters import filter_corpus, load_rules
from openalign.data.filters.images import tag_words
from openalign.data.filters.nlp import NLPError, SpacyBackend, TextAnnotator, load_backend
from openalign.data.sources import sniff_image_format
from test_filters import OFF, kept_ids, row, run, write_rows

spacy = pytest.importorskip("spacy")

# Tags the test pipeline knows: every other word has no POS tag at all (a blank pipeline tags nothing).
POS = {"a": "DET", "the": "DET", "an": "DET", "dog": "NOUN", "car": "NOUN", "cat": "NOUN", "red": "ADJ"}
POS |= {"on": "ADP", "walks": "VERB", "runs": "VERB", "paris": "PROPN", "sleeps": "VERB", "sofa": "NOUN"}
PEOPLE = ["Barack Obama", "Taylor Swift"]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A spaCy pipeline with known tags and known people, saved to disk and loaded back by path."""
    nlp = spacy.blank("en")
    ruler = nlp.add_pipe("attribute_ruler")
    for word, tag in POS.items():
        ruler.add([[{"LOWER": word}]], {"POS": tag})
    ents = nlp.add_pipe("entity_ruler")
    ents.add_patterns([{"label": "PERSON", "pattern": name} for name in PEOPLE])
    ents.add_patterns([{"label": "GPE", "pattern": "Paris"}])
    path = tmp_path_factory.mktemp("nlp") / "pipeline"
    nlp.to_disk(path)
    return str(path)


NO_WORD_RULES = {**OFF, "min_word_count": None, "max_repeated_fraction": None}


def cc12m(**overrides: object):
    """CC12M's rule set with every rule but the ones a test is about switched off."""
    base = {**NO_WORD_RULES, "image_formats": None, "min_tag_overlap": None, "required_pos": None}
    return load_rules("cc12m", **{**base, "person_substitution": None, **overrides})


# --------------------------------------------------------------------------------------------------
# The NLP interface


def test_spacy_backend_gives_tokens_pos_and_person_spans_from_a_saved_pipeline(pipeline):
    backend = SpacyBackend(pipeline, batch_size=2)
    got = backend.analyze(["Barack Obama walks a dog", "a red car", "the cat sleeps on the sofa"])
    assert got[0].tokens == ("Barack", "Obama", "walks", "a", "dog")
    assert got[0].pos[2:] == ("VERB", "DET", "NOUN") and got[0].persons == ((0, 12),)
    assert got[1].pos == ("DET", "ADJ", "NOUN") and got[1].persons == ()
    assert got[2].pos == ("DET", "NOUN", "VERB", "ADP", "DET", "NOUN")
    assert load_backend(pipeline) is load_backend(pipeline)  # one load per process


def test_a_pipeline_that_is_not_installed_says_how_to_install_one(tmp_path):
    with pytest.raises(NLPError, match=r"python -m spacy download en_core_web_sm") as err:
        SpacyBackend("en_core_web_not_installed")
    assert "\n" not in str(err.value)
    with pytest.raises(NLPError, match="cannot load spaCy pipeline"):
        SpacyBackend(str(tmp_path / "nowhere"))


def test_the_annotator_checks_pos_groups_and_substitutes_people(pipeline):
    ann = TextAnnotator(pipeline, ("NOUN|PROPN", "DET"), "nlp")
    ok, text = ann(["Barack Obama walks a dog", "dog runs", "a red", "the Paris", "Taylor Swift and Barack Obama"])
    assert ok == [True, False, False, True, False]
    assert text[0] == "<PERSON> walks a dog" and text[4] == "<PERSON> and <PERSON>" and text[1] == "dog runs"


# --------------------------------------------------------------------------------------------------
# No noun or no determiner


def test_no_noun_or_no_determiner_is_discarded_and_prepositions_are_not_required(tmp_path, pipeline):
    rows = [
        row(0, "a dog"),  # exactly one determiner and one noun, no preposition: kept
        row(1, "dog runs"),  # no determiner
        row(2, "a red"),  # no noun
        row(3, "the cat sleeps on the sofa"),  # with a preposition: kept too
        row(4, "the Paris"),  # a proper noun is a noun
        row(5, "red walks"),  # neither
    ]
    rules = cc12m(required_pos=["NOUN|PROPN", "DET"])
    report, kept = run(tmp_path, rows, rules, nlp=pipeline)
    assert kept == [0, 3, 4] and report.removed["missing_pos"] == 3
    # Requiring a preposition too (CC3M's rule) drops the ones without
    report, kept = run(tmp_path, rows, cc12m(required_pos=["NOUN|PROPN", "DET", "ADP"]), "cc3m", nlp=pipeline)
    assert kept == [3]
    # Without an NLP pipeline the rule is skipped, and the report says how to get one
    report, kept = run(tmp_path, rows, rules, "none")
    assert kept == [0, 1, 2, 3, 4, 5] and "spacy download" in report.skipped["missing_pos"]


def test_only_rows_the_other_rules_keep_are_analysed(tmp_path, pipeline):
    rows = [row(0, "dog runs", w=10), row(1, "dog runs"), row(2, "a dog")]
    rules = cc12m(required_pos=["NOUN|PROPN", "DET"], min_shorter_side=100)
    report, kept = run(tmp_path, rows, rules, nlp=pipeline)
    assert kept == [2] and report.removed["small_image"] == 1 and report.removed["missing_pos"] == 1


# --------------------------------------------------------------------------------------------------
# <PERSON>


def test_person_names_from_the_nlp_pipeline_are_a_counted_transformation(tmp_path, pipeline):
    rows = [row(0, "Barack Obama walks a dog"), row(1, "Taylor Swift on a red car"), row(2, "a dog on the sofa")]
    rows.append(row(3, "Barack Obama walks a dog"))
    report, kept = run(tmp_path, rows, cc12m(person_substitution="nlp"), nlp=pipeline)
    assert kept == [0, 1, 2, 3] and report.rows_out == 4 and sum(report.removed.values()) == 0
    assert report.transformed == {"person_substitution": 3}
    assert "transformed person_substitution: 3 of 4 rows" in report.table()
    out = pq.read_table(tmp_path / "out.parquet").column("caption").to_pylist()
    assert out == ["<PERSON> walks a dog", "<PERSON> on a red car", "a dog on the sofa", "<PERSON> walks a dog"]
    # the demo list is still there offline, and counted the same way; it misses these names
    report, _ = run(tmp_path, rows, cc12m(person_substitution="demo"), "demo")
    assert report.transformed == {"person_substitution": 0}


# --------------------------------------------------------------------------------------------------
# JPEG only


def encode(fmt: str, size: int = 8) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (200, 30, 30)).save(buf, format=fmt)
    return buf.getvalue()


def test_formats_are_sniffed_from_the_bytes():
    assert sniff_image_format(encode("JPEG")) == "jpeg" and sniff_image_format(encode("PNG")) == "png"
    assert sniff_image_format(encode("WEBP")) == "webp" and sniff_image_format(encode("GIF")) == "gif"
    assert sniff_image_format(b"\xff\xd8") is None and sniff_image_format(b"") is None


def test_jpeg_only_reads_the_file_header_never_the_name(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    (images / "png_named.jpg").write_bytes(encode("PNG"))
    (images / "jpeg_named.png").write_bytes(encode("JPEG"))
    (images / "plain.jpeg").write_bytes(encode("JPEG"))
    paths = ["images/png_named.jpg", "images/jpeg_named.png", "images/plain.jpeg", "images/missing.jpg"]
    rows = [row(i, "a dog", image_path=p) for i, p in enumerate(paths)]
    src = write_rows(tmp_path / "t.parquet", rows)
    report = filter_corpus(src, tmp_path / "t_out.parquet", cc12m(image_formats=["jpeg"]))
    assert kept_ids(tmp_path / "t_out.parquet") == [1, 2] and report.removed["image_format"] == 2
    assert any(e.startswith("missing_file") for e in report.input_errors)
    # bytes in the table itself
    rows = [row(0, "a dog", jpg=encode("JPEG")), row(1, "a dog", jpg=encode("PNG")), row(2, "a dog", jpg=None)]
    report, kept = run(tmp_path, rows, cc12m(image_formats=["jpg"]), "bytes")
    assert kept == [0] and report.removed["image_format"] == 2


def test_jpeg_only_from_a_format_column_and_skipped_without_images(tmp_path):
    rows = [row(i, "a dog", format=f) for i, f in enumerate(["image/jpeg", "JPG", "png", None, "jpeg"])]
    report, kept = run(tmp_path, rows, cc12m(image_formats=["jpeg"]))
    assert kept == [0, 1, 4] and report.removed["image_format"] == 2
    report, kept = run(tmp_path, [row(0), row(1)], cc12m(image_formats=["jpeg"]), "none")
    assert kept == [0, 1] and "image_format" in report.skipped


def write_shard(path: Path, samples: list[tuple[str, bytes, dict]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for key, image, meta in samples:
            for name, data in ((f"{key}.jpg", image), (f"{key}.json", json.dumps(meta).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def test_jpeg_only_in_shards_sniffs_the_image_member(tmp_path):
    meta = {"caption": "a dog", "width": 640, "height": 480}
    shard = write_shard(
        tmp_path / "00000.tar", [("000", encode("JPEG"), meta), ("001", encode("PNG"), meta), ("002", b"x", meta)]
    )
    report = filter_corpus(shard, tmp_path / "s.parquet", cc12m(image_formats=["jpeg"]), input_format="webdataset")
    table = pq.read_table(tmp_path / "s.parquet")
    assert table.column("key").to_pylist() == ["000"] and report.removed["image_format"] == 2
    assert not any(c.startswith("__oa_") for c in table.column_names)


def test_the_header_read_keeps_the_size_cap(tmp_path):
    from openalign.data.sources import BadInput, read_file_head

    path = tmp_path / "big.jpg"
    path.write_bytes(encode("JPEG") + b"\0" * 4096)
    assert read_file_head(path, 3) == b"\xff\xd8\xff"
    with pytest.raises(BadInput, match="limit") as err:
        read_file_head(path, 3, max_bytes=1024)
    assert err.value.reason == "too_large_file"


# --------------------------------------------------------------------------------------------------
# Image-text tag overlap


def test_tag_words_read_lists_json_and_separated_strings():
    assert tag_words(["Dog", "sports car", "dog"]) == "dog sports car"
    assert tag_words('["cat", "sofa"]') == "cat sofa" and tag_words("cat; sofa|grass") == "cat sofa grass"
    assert tag_words(None) is None and tag_words([]) == ""


def test_tag_overlap_at_the_minimum_is_kept_and_one_below_dropped(tmp_path):
    rows = [
        row(0, "A dog on the grass", tags=["dog", "grass", "ball"]),  # 2 tag words in the text: kept
        row(1, "A dog on the sofa", tags=["dog", "grass", "ball"]),  # 1: dropped
        row(2, "Dog, dog and a ball!", tags=["dog", "ball"]),  # 2 distinct words (dog counts once): kept
        row(3, "a dog on the grass", tags=[]),  # no tags: no overlap
        row(4, "a dog on the grass", tags=None),
    ]
    report, kept = run(tmp_path, rows, cc12m(min_tag_overlap=2))
    assert kept == [0, 2] and report.removed["tag_overlap"] == 3
    assert run(tmp_path, rows, cc12m(min_tag_overlap=1), "one")[1] == [0, 1, 2]
    report, kept = run(tmp_path, [row(0), row(1)], cc12m(min_tag_overlap=1), "none")
    assert kept == [0, 1] and "--tagger" in report.skipped["tag_overlap"]


def test_a_tagger_hook_tags_the_images_of_the_table(tmp_path):
    seen: list[int] = []

    def tagger(images):  # red images are "apple", everything else "sky"
        seen.append(len(images))
        return [None if b is None else (["apple"] if b == RED else ["sky"]) for b in images]

    RED = encode("JPEG")
    rows = [row(0, "an apple", jpg=RED), row(1, "an apple", jpg=encode("PNG", 9)), row(2, "blue sky", jpg=None)]
    report, kept = run(tmp_path, rows, cc12m(min_tag_overlap=1), image_tagger=tagger)
    assert kept == [0] and report.removed["tag_overlap"] == 2 and seen == [3]


def test_shards_are_tagged_from_their_image_member_or_read_from_their_json(tmp_path):
    red, other = encode("JPEG"), encode("JPEG", 9)
    meta = {"caption": "an apple on a plate", "width": 640, "height": 480}
    shard = write_shard(tmp_path / "00000.tar", [("000", red, meta), ("001", other, meta)])

    def tagger(images):
        return [["apple"] if b == red else ["sky"] for b in images]

    rules = cc12m(min_tag_overlap=1)
    report = filter_corpus(shard, tmp_path / "t.parquet", rules, input_format="webdataset", image_tagger=tagger)
    assert pq.read_table(tmp_path / "t.parquet").column("key").to_pylist() == ["000"]
    assert report.removed["tag_overlap"] == 1
    tagged = write_shard(
        tmp_path / "00001.tar", [("000", red, {**meta, "tags": ["plate"]}), ("001", red, {**meta, "tags": ["sky"]})]
    )
    report = filter_corpus(tagged, tmp_path / "j.parquet", rules, input_format="webdataset")
    assert pq.read_table(tmp_path / "j.parquet").column("key").to_pylist() == ["000"]
    # shards with no tags and no tagger: the rule has nothing to read
    report = filter_corpus(shard, tmp_path / "n.parquet", rules, input_format="webdataset")
    assert "tag_overlap" in report.skipped and report.rows_out == 2


def test_the_tagger_of_a_real_checkpoint_drives_the_rule_end_to_end(tmp_path, capsys):
    from conftest import save_tiny_checkpoint
    from openalign.pipeline.tagging import ZeroShotTagger

    tags = ["apple", "banana", "cherry", "grape", "lemon"]
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", [f"a photo of a {t}" for t in tags] * 20, vocab_size=120)
    vocab = tmp_path / "tags.txt"
    vocab.write_text("# fruit\n" + "\n".join(tags) + "\n")
    colours = [(250, 10, 10), (10, 250, 10), (10, 10, 250), (240, 240, 20)]
    images = []
    for c in colours:
        buf = io.BytesIO()
        Image.new("RGB", (40, 40), c).save(buf, format="JPEG")
        images.append(buf.getvalue())
    top = ZeroShotTagger(ckpt, tags, top_k=1)(images)
    assert all(t is not None and len(t) == 1 for t in top)
    # Each caption names one fruit: its image's own top tag for even rows, a fruit it is not tagged with
    # for odd rows. Only the even rows have an overlap.
    captions = []
    for i, t in enumerate(top):
        assert t is not None
        other = next(x for x in tags if x != t[0])
        captions.append(f"a photo of a {t[0] if i % 2 == 0 else other}")
    rows = [row(i, c, jpg=b) for i, (c, b) in enumerate(zip(captions, images, strict=True))]
    src = write_rows(tmp_path / "in.parquet", rows)
    out = tmp_path / "out.parquet"
    args = [
        "filter", str(src), str(out), "--rules", "cc12m", "--quiet", "--set", "min_word_count=null",
        "--rules.min_shorter_side", "10", "--tagger", str(ckpt), "--tag-vocab", str(vocab), "--tag-top-k", "1",
    ]  # fmt: skip
    assert main(args) == 0
    assert kept_ids(out) == [0, 2]
    assert "tag_overlap" in capsys.readouterr().out
    assert main([*args[:3], "--tagger", str(ckpt), "--overwrite"]) == 2
    assert "--tag-vocab" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# The CLI and both engines


def test_cli_nlp_flag_and_its_one_line_error(tmp_path, capsys, pipeline):
    src = write_rows(tmp_path / "in.parquet", [row(0, "Barack Obama walks a dog"), row(1, "dog runs")])
    out = tmp_path / "out.parquet"
    base = ["filter", str(src), str(out), "--rules", "cc12m", "--quiet", "--set", "min_word_count=null"]
    assert main([*base, "--nlp", pipeline, "--rules.min_shorter_side", "10"]) == 0
    assert pq.read_table(out).column("caption").to_pylist() == ["<PERSON> walks a dog"]
    assert "transformed person_substitution: 1 of 1 rows" in capsys.readouterr().out
    assert main([*base, "--nlp", "en_core_web_not_installed", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "python -m spacy download en_core_web_sm" in err


def test_a_pipeline_without_the_tagger_or_ner_a_rule_needs_is_refused_up_front(tmp_path, capsys, pipeline):
    """A blank or NER-only pipeline tags no part of speech, so missing_pos would remove every row; a
    tagger-only one finds no person. Each is one line naming the pipeline and the rule, nothing written."""
    blank, ner_only, tags_only = tmp_path / "blank", tmp_path / "ner_only", tmp_path / "tags_only"
    spacy.blank("en").to_disk(blank)
    nlp = spacy.blank("en")
    nlp.add_pipe("entity_ruler").add_patterns([{"label": "PERSON", "pattern": name} for name in PEOPLE])
    nlp.to_disk(ner_only)
    nlp = spacy.blank("en")
    ruler = nlp.add_pipe("attribute_ruler")
    for word, tag in POS.items():
        ruler.add([[{"LOWER": word}]], {"POS": tag})
    nlp.to_disk(tags_only)
    src = write_rows(tmp_path / "in.parquet", [row(0, "Barack Obama walks a dog"), row(1, "a red car")])
    out = tmp_path / "out.parquet"
    base = ["filter", str(src), str(out), "--rules", "cc12m", "--quiet", "--set", "min_word_count=null"]
    for spec, rule in [(blank, "the missing_pos"), (ner_only, "the missing_pos"), (tags_only, "person_names nlp")]:
        assert main([*base, "--rules.min_shorter_side", "10", "--nlp", str(spec), "--person-names", "nlp"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"'{spec}'" in err and f"so {rule}" in err, err
        assert not out.exists()
    # Each runs where it is asked only for what it has.
    sized = [*base, "--rules.min_shorter_side", "10", "--overwrite"]
    assert main([*sized, "--set", "required_pos=null", "--nlp", str(ner_only), "--person-names", "nlp"]) == 0
    assert pq.read_table(out).column("caption").to_pylist() == ["<PERSON> walks a dog", "a red car"]
    assert main([*sized, "--set", "person_substitution=null", "--nlp", str(tags_only)]) == 0
    assert pq.read_table(out).column("caption").to_pylist() == ["Barack Obama walks a dog", "a red car"]
    capsys.readouterr()
    with pytest.raises(NLPError, match="tags no parts of speech"):
        filter_corpus(src, tmp_path / "api.parquet", cc12m(required_pos=["NOUN|PROPN", "DET"]), nlp=str(blank))


def test_a_tagger_without_coarse_tags_is_named_as_such(tmp_path, capsys) -> None:
    """A trained tagger with no attribute_ruler sets only fine-grained tags: the refusal says that, not that
    the pipeline has no tagger."""
    from spacy.training import Example

    nlp = spacy.blank("en")
    tagger = nlp.add_pipe("tagger")
    for label in ("NN", "DT", "VBZ"):
        tagger.add_label(label)
    nlp.initialize()
    example = Example.from_dict(nlp.make_doc("a dog runs"), {"tags": ["DT", "NN", "VBZ"]})
    nlp.update([example])
    nlp.to_disk(tmp_path / "fine_tags")
    src = write_rows(tmp_path / "in.parquet", [row(0, "a dog runs on the beach")])
    argv = ["filter", str(src), str(tmp_path / "out.parquet"), "--rules", "cc12m", "--quiet"]
    assert main([*argv, "--set", "person_substitution=null", "--nlp", str(tmp_path / "fine_tags")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "components (tagger) set no coarse tag" in err, err
    assert "no tagger" not in err


@pytest.mark.slow
def test_spark_and_duckdb_agree_on_every_cc12m_rule(tmp_path, pipeline, spark):

    captions = ["Barack Obama walks a dog", "dog runs", "a red car", "the cat sleeps on the sofa", "a cat", "猫"]
    formats = ["jpeg", "JPG", "png"]
    tag_sets = [["dog"], ["car", "red"], ["cat", "sofa"], [], None]
    rows = [
        row(i, captions[i % 6] + ("" if i % 4 else " on the sofa"), format=formats[i % 3], tags=tag_sets[i % 5])
        for i in range(60)
    ]
    rules = cc12m(
        image_formats=["jpeg"], min_tag_overlap=1, required_pos=["NOUN|PROPN", "DET"], person_substitution="nlp"
    )
    src = write_rows(tmp_path / "in.parquet", rows)
    duck = filter_corpus(src, tmp_path / "duck.parquet", rules, nlp=pipeline)
    sprk = filter_corpus(src, tmp_path / "spark.parquet", rules, nlp=pipeline, engine="spark", spark=spark)
    assert duck.steps == sprk.steps and duck.transformed == sprk.transformed and duck.rows_out == sprk.rows_out
    assert {k: v for k, v in duck.removed.items() if v}.keys() >= {"image_format", "tag_overlap", "missing_pos"}
    assert duck.transformed["person_substitution"] > 0
    d = pq.read_table(tmp_path / "duck.parquet").to_pylist()
    s = pq.read_table(tmp_path / "spark.parquet").to_pylist()
    assert sorted((r["id"], r["caption"]) for r in d) == sorted((r["id"], r["caption"]) for r in s)


def test_the_tagger_reads_a_transformers_align_directory_too(tmp_path):
    import torch

    import openalign
    from conftest import tiny_overrides
    from openalign.model.efficientnet import round_filters
    from openalign.model.hf import export_hf_align
    from openalign.pipeline.tagging import ZeroShotTagger
    from openalign.text import train_wordpiece

    tags = ["apple", "banana", "cherry", "grape", "lemon"]
    tokenizer = train_wordpiece([f"a photo of a {t}" for t in tags] * 20, vocab_size=120)
    torch.manual_seed(0)
    # transformers' AlignModel has no image projection and pools the [CLS] token: a model it can express
    text = {"vocab_size": tokenizer.vocab_size, "pooling": "cls"}
    model = openalign.create_model(
        "nano", **tiny_overrides(image={"width_coefficient": 0.5}, text=text, embed_dim=round_filters(320, 0.5))
    )
    openalign.save_model(model, tmp_path / "ours")
    tokenizer.save(tmp_path / "ours")
    export_hf_align(model, tmp_path / "hf", tokenizer_dir=tmp_path / "ours")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "align"
    images = [encode("JPEG", 40), encode("PNG", 40), None]
    ours, theirs = ZeroShotTagger(tmp_path / "ours", tags, 2), ZeroShotTagger(tmp_path / "hf", tags, 2)
    a, b = ours.scores(images)[0], theirs.scores(images)[0]
    assert torch.allclose(a, b, atol=1e-5)
    assert ours(images) == theirs(images) and ours(images)[2] is None and len(ours(images)[0] or []) == 2
