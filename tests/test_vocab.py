"""WordPiece vocabulary: streaming readers, round trips, parity with transformers, multilingual text."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers

import openalign
from openalign.config import ConfigError
from openalign.text.vocab import VocabConfig, build_vocab, iter_captions

WORDS = {
    lang: text.split()
    for lang, text in {
        "en": "a red dog runs on green grass near the old wooden house under blue sky",
        "de": "der hund läuft über die große grüne wiese straße mädchen schön größe",
        "fr": "le garçon élève regarde une fenêtre très près du château où noël été",
        "cs": "příliš žluťoučký kůň úpěl ďábelské ódy řeka čeština město dívka",
        "ru": "кошка спит на столе рядом с большой красной книгой зимой",
        "ar": "القطة نائمة على الطاولة بجانب الكتاب الأحمر الكبير",
    }.items()
}
CHINESE = "猫在桌子上睡觉一只红色的狗跑过绿色草地旁边古老木房子蓝天下"


def _caption(rng: random.Random, lang: str, capitalise: bool = False) -> str:
    if lang == "zh":
        return "".join(rng.choice(CHINESE) for _ in range(rng.randint(4, 10)))
    words = [rng.choice(WORDS[lang]) for _ in range(rng.randint(3, 9))]
    if capitalise:
        words = [w.capitalize() if rng.random() < 0.4 else w for w in words]
    return " ".join(words)


def _corpus(n: int, seed: int = 0, capitalise: bool = False) -> list[str]:
    rng = random.Random(seed)
    langs = [*WORDS, "zh"]
    return [_caption(rng, langs[i % len(langs)], capitalise) for i in range(n)]


def _hf_ids(path, texts: list[str]) -> torch.Tensor:
    hf = transformers.BertTokenizerFast.from_pretrained(path)
    out = hf(texts, padding="max_length", truncation=True, max_length=64, return_tensors="pt")
    return out["input_ids"], out["attention_mask"]


# --------------------------------------------------------------------------------------------------
# Reading captions


def test_every_format_streams_the_same_captions_and_counts_bad_ones(tmp_path) -> None:
    good = ["a red dog", "Ein großer Hund", "猫在桌子上", "a, b; c"]
    pq.write_table(
        pa.table({"key": ["1", "2", "3", "4", "5", "6"], "caption": [*good, None, "  "]}), tmp_path / "a.parquet"
    )
    (tmp_path / "parts").mkdir()
    pq.write_table(pa.table({"caption": good[:2]}), tmp_path / "parts" / "p0.parquet")
    pq.write_table(pa.table({"caption": good[2:]}), tmp_path / "parts" / "p1.parquet")
    csv = "key,caption\n" + "".join(f'{i},"{t}"\n' for i, t in enumerate(good))
    (tmp_path / "a.csv").write_bytes(csv.encode() + b'9,"bad \xff\xfe bytes"\n10,\n')
    (tmp_path / "a.tsv").write_text("caption\tkey\n" + "".join(f"{t}\t{i}\n" for i, t in enumerate(good)))
    lines = [json.dumps({"caption": t}, ensure_ascii=False) for t in good]
    (tmp_path / "a.jsonl").write_bytes(("\n".join(lines) + '\n{"caption": null}\n{broken\n{"other": 1}\n').encode())
    (tmp_path / "a.json").write_text(json.dumps([{"caption": t} for t in good], ensure_ascii=False))
    (tmp_path / "a.txt").write_bytes("\n".join(good).encode() + b"\n\nbad \xff line\n")
    from PIL import Image

    from openalign.data.shards import write_shards

    image = Image.new("RGB", (8, 8), "red")
    write_shards(
        [{"key": f"{i:03d}", "jpg": image, "txt": t, "json": {}} for i, t in enumerate(good)],
        tmp_path / "shards",
        samples_per_shard=3,
    )
    expected_skips = {
        "a.parquet": {"null": 1, "empty": 1},
        "parts": {},
        "a.csv": {"not_utf8": 1, "empty": 1},
        "a.tsv": {},
        "a.jsonl": {"null": 1, "bad_json": 1, "no_column": 1},
        "a.json": {},
        "a.txt": {"empty": 1, "not_utf8": 1},
        "shards": {},
        "shards/{00000..00001}.tar": {},
    }
    for name, skips in expected_skips.items():
        skipped: Counter[str] = Counter()
        assert list(iter_captions(tmp_path / name, skipped=skipped)) == good, name
        assert dict(skipped) == skips, name


def test_missing_inputs_fail_clearly(tmp_path) -> None:
    pq.write_table(pa.table({"text": ["a"], "n": [1]}), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match=r"no column 'caption'.*text"):
        iter_captions(tmp_path / "a.parquet")
    with pytest.raises(ValueError, match="int64, not text"):
        iter_captions(tmp_path / "a.parquet", column="n")
    (tmp_path / "a.csv").write_text("url,alt\nx,y\n")
    with pytest.raises(ValueError, match="no column 'caption'"):
        iter_captions(tmp_path / "a.csv")
    with pytest.raises(FileNotFoundError):
        iter_captions(tmp_path / "nope.parquet")
    with pytest.raises(FileNotFoundError):
        iter_captions(tmp_path / "nope-{0..3}.tar")
    (tmp_path / "a.xlsx").write_text("x")
    with pytest.raises(ValueError, match="unsupported"):
        iter_captions(tmp_path / "a.xlsx")
    with pytest.raises(ConfigError, match="vocab_size"):
        build_vocab(tmp_path / "a.parquet", tmp_path / "v", VocabConfig(vocab_size=0, column="text"))
    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(ValueError, match="no usable captions"):
        build_vocab(tmp_path / "empty.txt", tmp_path / "v")


# --------------------------------------------------------------------------------------------------
# The vocabulary


def test_round_trip_and_identical_ids_in_transformers(tmp_path) -> None:
    corpus = _corpus(700, capitalise=True)
    pq.write_table(pa.table({"caption": corpus}), tmp_path / "c.parquet")
    tok, stats = build_vocab(tmp_path / "c.parquet", tmp_path / "v", VocabConfig(vocab_size=600))
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "v" / name).is_file()
    assert stats["captions"] == 700 and stats["vocab_size"] == tok.vocab_size <= 600
    english = [c for c in _corpus(200, seed=1) if c.isascii()]
    ours = openalign.load_tokenizer(tmp_path / "v")
    for text in english:
        assert ours.decode(ours(text)["input_ids"][0]) == text.lower()  # encode → decode
    long = " ".join(["house"] * 100)  # truncated to 64 with the closing [SEP] kept, in both libraries
    texts = [*_corpus(50, seed=2, capitalise=True), long, "unseen zebra", ""]
    batch = ours(texts)
    hf_ids, hf_mask = _hf_ids(tmp_path / "v", texts)
    assert batch["input_ids"].shape == (53, 64)
    assert torch.equal(batch["input_ids"], hf_ids) and torch.equal(batch["attention_mask"], hf_mask)
    assert batch["input_ids"][50, 63].item() == tok.backend.token_to_id("[SEP]")
    assert json.loads((tmp_path / "v" / "tokenizer_config.json").read_text())["model_max_length"] == 64


_LEARN = """
import hashlib, json, sys
from openalign.text.vocab import VocabConfig, build_vocab
tok, _ = build_vocab(sys.argv[1], sys.argv[2], VocabConfig(vocab_size=300, min_frequency=1))
print(hashlib.sha256(open(sys.argv[2] + "/tokenizer.json", "rb").read()).hexdigest())
"""


def test_the_same_corpus_gives_the_same_vocabulary_in_every_process(tmp_path) -> None:
    # HF's trainer numbers ## pieces in hash-map order, which is seeded per process; on this corpus of
    # many equally frequent made-up words its plain vocabulary differs between nearly every two processes.
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyzäöü"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(400)]
    corpus = [" ".join(words[(i * 7 + j) % 400] for j in range(5)) for i in range(400)]
    (tmp_path / "c.txt").write_text("\n".join(corpus) + "\n", encoding="utf-8")
    digests = {
        subprocess.run(
            [sys.executable, "-c", _LEARN, str(tmp_path / "c.txt"), str(tmp_path / f"v{i}")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for i in range(4)
    }
    assert len(digests) == 1
    tok = openalign.load_tokenizer(tmp_path / "v0")
    pieces = [t for t in tok.backend.get_vocab() if t.startswith("##")]
    assert pieces and all(tok.backend.token_to_id(t) is not None for t in pieces)
    # The ## pieces are ordinary pieces, not special tokens: decoding keeps them.
    text = " ".join(words[:20])
    assert tok.decode(tok(text)["input_ids"][0]) == tok.backend.normalizer.normalize_str(text)


def test_multilingual_corpus_encodes_with_few_unknowns(tmp_path) -> None:
    (tmp_path / "c.txt").write_text("\n".join(_corpus(1400)) + "\n", encoding="utf-8")
    tok, _ = build_vocab(tmp_path / "c.txt", tmp_path / "v", VocabConfig(vocab_size=1500))
    unk = tok.backend.token_to_id("[UNK]")
    held_out = _corpus(350, seed=9)  # the same languages, new combinations
    ids = tok(held_out)["input_ids"]
    real = ids[(ids != tok.pad_id)]
    assert (real == unk).float().mean().item() < 0.01
    by_lang = {lang: tok(_caption(random.Random(3), lang))["input_ids"][0] for lang in [*WORDS, "zh"]}
    for lang, row in by_lang.items():
        assert unk not in row.tolist(), lang
    # Chinese characters are split one per token, as BERT does, so no [UNK] for unseen combinations.
    assert tok.decode(tok("猫桌子")["input_ids"][0]) == "猫 桌 子"
    # Lowercasing BERT-style strips accents.
    assert tok.decode(tok("Příliš ŽLUŤOUČKÝ")["input_ids"][0]) == "prilis zlutoucky"
    hf_ids, _ = _hf_ids(tmp_path / "v", held_out[:40])
    assert torch.equal(tok(held_out[:40])["input_ids"], hf_ids)


def test_no_lowercase_keeps_case_and_accents(tmp_path, capsys) -> None:
    from openalign.cli import main

    corpus = _corpus(1400, capitalise=True)
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"alt": c}) for c in corpus) + "\n")
    out = tmp_path / "v"
    argv = ["vocab", str(tmp_path / "c.jsonl"), str(out), "--column", "alt", "--vocab-size", "2000", "--no-lowercase"]
    assert main([*argv, "--quiet"]) == 0
    assert "1,400 captions" in capsys.readouterr().out
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["do_lower_case"] is False
    tok = openalign.load_tokenizer(out)
    for text in ["Příliš žluťoučký Kůň", "Der Hund läuft über die Straße", "Le Garçon élève", "Кошка спит"]:
        assert tok.decode(tok(text)["input_ids"][0]) == tok.backend.normalizer.normalize_str(text)
    texts = [c for c in _corpus(60, seed=5, capitalise=True)]
    hf_ids, _ = _hf_ids(out, texts)  # transformers must not lowercase either
    assert torch.equal(tok(texts)["input_ids"], hf_ids)
    vocab = (out / "vocab.txt").read_text(encoding="utf-8").split("\n")
    assert "Kůň" in vocab or "##ůň" in vocab or any("ů" in v for v in vocab)
    stats = json.loads((out / "vocab_stats.json").read_text())
    assert stats["config"]["lowercase"] is False and stats["captions"] == 1400


def test_cli_vocab_errors(tmp_path, capsys) -> None:
    from openalign.cli import main

    assert main(["vocab", str(tmp_path / "missing.parquet"), str(tmp_path / "v")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("openalign vocab: error:") and "missing.parquet" in err and "\n" not in err
    (tmp_path / "c.txt").write_text("a b c\n")
    assert main(["vocab", str(tmp_path / "c.txt"), str(tmp_path / "v"), "--min-frequency", "0"]) == 2
    assert "min_frequency" in capsys.readouterr().err
