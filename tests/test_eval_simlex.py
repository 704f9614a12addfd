"""SimLex-999: both file formats, the nine subsets, Spearman against scipy, the pre-projection [CLS] vector."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from gensim.test.utils import datapath
from scipy.stats import rankdata, spearmanr

import openalign
from openalign.eval import simlex
from openalign.text import train_wordpiece

GENSIM_FILE = datapath("simlex999.txt")


def fixed_embed(words: list[str]) -> torch.Tensor:
    """A deterministic embedding per word (seeded by the word's CRC), independent of the batch."""
    return torch.stack(
        [torch.randn(16, generator=torch.Generator().manual_seed(zlib.crc32(w.encode()))) for w in words]
    )


def reference_rho(pairs: list[simlex.SimLexPair], mask: np.ndarray | None = None) -> float:
    vec = {w: fixed_embed([w])[0].double().numpy() for p in pairs for w in (p.word1, p.word2)}
    cos = np.array(
        [vec[p.word1] @ vec[p.word2] / np.linalg.norm(vec[p.word1]) / np.linalg.norm(vec[p.word2]) for p in pairs]
    )
    human = np.array([p.score for p in pairs])
    if mask is not None:
        cos, human = cos[mask], human[mask]
    return 100 * spearmanr(cos, human).statistic


def test_gensim_file_all_subset_matches_scipy() -> None:
    pairs = simlex.load_simlex(GENSIM_FILE)
    assert len(pairs) == 999
    assert pairs[0] == simlex.SimLexPair("old", "new", 1.58)
    out = simlex.evaluate_simlex(pairs, fixed_embed)
    # gensim's 3-column file has no POS/concreteness/association columns: only "all".
    assert set(out) == {"all", "n_all"} and out["n_all"] == 999
    assert out["all"] == pytest.approx(reference_rho(pairs), abs=1e-4)  # float rounding may swap a near-tie


def write_official(path: Path, pairs: list[simlex.SimLexPair]) -> list[simlex.SimLexPair]:
    """The official 10-column release built from gensim's pairs, with made-up POS/concQ/SimAssoc333."""
    rng = np.random.default_rng(0)
    rows = ["\t".join(simlex.OFFICIAL_COLUMNS)]
    out = []
    for p in pairs:
        pos = "ANV"[int(rng.integers(0, 3))]
        q = int(rng.integers(1, 5))
        hard = int(rng.random() < 1 / 3)
        rows.append(f"{p.word1}\t{p.word2}\t{pos}\t{p.score:.2f}\t4.1\t3.9\t{q}\t0.35\t{hard}\t0.9")
        out.append(simlex.SimLexPair(p.word1, p.word2, float(f"{p.score:.2f}"), pos, q, bool(hard)))
    path.write_text("\n".join(rows) + "\n")
    return out


def test_official_format_nine_subsets(tmp_path: Path) -> None:
    expected = write_official(tmp_path / "SimLex-999.txt", simlex.load_simlex(GENSIM_FILE))
    pairs = simlex.load_simlex(tmp_path / "SimLex-999.txt")
    assert pairs == expected
    out = simlex.evaluate_simlex(pairs, fixed_embed)
    assert [k for k in out if not k.startswith("n_")] == list(simlex.SUBSETS)
    masks = {
        "all": np.ones(len(pairs), bool),
        "adjs": np.array([p.pos == "A" for p in pairs]),
        "nouns": np.array([p.pos == "N" for p in pairs]),
        "verbs": np.array([p.pos == "V" for p in pairs]),
        **{f"conc_q{q}": np.array([p.conc_quartile == q for p in pairs]) for q in (1, 2, 3, 4)},
        "hard": np.array([bool(p.hard) for p in pairs]),
    }
    for name, mask in masks.items():
        assert out[f"n_{name}"] == int(mask.sum())
        assert out[name] == pytest.approx(reference_rho(pairs, mask), abs=1e-4), name
    assert out["n_adjs"] + out["n_nouns"] + out["n_verbs"] == 999


def test_rankdata_and_spearman_match_scipy() -> None:
    rng = np.random.default_rng(1)
    a = rng.integers(0, 6, 200).astype(float)  # many ties
    b = a + rng.normal(0, 2, 200)
    np.testing.assert_allclose(simlex.rankdata(a), rankdata(a))
    assert simlex.spearman(a, b) == pytest.approx(spearmanr(a, b).statistic, abs=1e-12)
    assert simlex.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert np.isnan(simlex.spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError, match="at least 2"):
        simlex.spearman([1.0], [2.0])


def test_word_embedding_is_cls_before_projection(tiny_model: openalign.DualEncoder) -> None:
    words = ["old", "new", "smart", "intelligent", "hard", "difficult"]
    tok = train_wordpiece(words * 5 + ["difficulties ahead"], vocab_size=101, min_frequency=1)
    emb = simlex.word_embeddings(tiny_model, tok, words, batch_size=4)
    assert emb.shape == (6, tiny_model.config.text.hidden_size)  # 32, not the 24-d projected space
    tiny_model.eval()
    for w, e in zip(words, emb, strict=True):
        pieces = tok.backend.encode(w)
        assert pieces.tokens[0] == "[CLS]" and pieces.tokens[-1] == "[SEP]"
        with torch.no_grad():
            ref = tiny_model.text(torch.tensor([pieces.ids]), None)[0]  # unpadded, one word at a time
        assert torch.allclose(e, ref, atol=1e-5)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"missing\.txt"):
        simlex.load_simlex(tmp_path / "missing.txt")
    f = tmp_path / "two.txt"
    f.write_text("# comment\nold\tnew\n")
    with pytest.raises(ValueError, match=r"two.txt:2: expected 'word1<TAB>word2<TAB>score'"):
        simlex.load_simlex(f)
    f.write_text("old\tnew\tvery\n")
    with pytest.raises(ValueError, match="not a number: 'very'"):
        simlex.load_simlex(f)
    f.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no SimLex-999 pairs"):
        simlex.load_simlex(f)
    f.write_text("word1\tword2\tPOS\tSimLex999\n")
    with pytest.raises(ValueError, match=r"lacks column\(s\) conc\(w1\)"):
        simlex.load_simlex(f)
    f.write_text("\t".join(simlex.OFFICIAL_COLUMNS) + "\nold\tnew\tX\t1.58\t1\t1\t1\t0\t0\t1\n")
    with pytest.raises(ValueError, match="POS must be A, N or V"):
        simlex.load_simlex(f)
    pairs = [simlex.SimLexPair("a", "b", 1.0), simlex.SimLexPair("a", "c", 2.0)]
    with pytest.raises(ValueError, match="zero embedding"):
        simlex.evaluate_simlex(pairs, lambda words: torch.zeros(len(words), 3))
    with pytest.raises(ValueError, match="expected \\[W, D\\]"):
        simlex.evaluate_simlex(pairs, lambda words: torch.ones(1, 3))


def test_cli_simlex(tmp_path: Path) -> None:
    import json

    from conftest import tiny_overrides
    from openalign.cli import main

    tok = train_wordpiece(["old new smart intelligent hard difficult happy cheerful"] * 20, vocab_size=101)
    torch.manual_seed(0)
    model = openalign.create_model("nano", **tiny_overrides(text={"vocab_size": tok.vocab_size}))
    openalign.save_model(model, tmp_path / "ckpt")
    tok.save(tmp_path / "ckpt")
    assert main(["eval", "simlex", "--model", str(tmp_path / "ckpt"), "--out", str(tmp_path / "res")]) == 0
    [result] = [json.loads(p.read_text()) for p in (tmp_path / "res").glob("simlex-*.json")]
    assert result["metrics"]["n_all"] == 999
    assert main(["eval", "simlex", "--model", str(tmp_path / "ckpt"), "--file", str(tmp_path / "none.txt")]) == 2
