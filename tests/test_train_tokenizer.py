"""A vocabulary learnt at the start of a run is learnt once: rank 0's goes to every rank, and a resumed run
keeps the one saved with its checkpoint. (The WordPiece trainer breaks ties between equally frequent merges
in hash-map order, so learning it again can give a different vocabulary.)"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from conftest import tiny_overrides  # noqa: E402
from dist_utils import run_gloo  # noqa: E402
from openalign.model import DualEncoder  # noqa: E402
from openalign.text import train_wordpiece  # noqa: E402
from openalign.train import checkpoint as ckpt  # noqa: E402
from openalign.train import loop  # noqa: E402
from openalign.train.config import load_train_config  # noqa: E402


def learner(word: str) -> Any:
    """A stand-in for learning from the synthetic world whose vocabulary holds ``word``, so the tests can
    tell whose vocabulary a run ended up with."""

    def learn(cfg: Any, captions: int = 10_000) -> Any:
        tokenizer = train_wordpiece([f"{word} a red circle"] * 20, vocab_size=200)
        tokenizer.max_length = cfg.data.max_text_length
        return tokenizer

    return learn


def synthetic_config(run_dir: Path | str) -> Any:
    return load_train_config(
        {
            "model": {"preset": "nano", **tiny_overrides()},
            "data": {"source": "synthetic", "batch_size": 4},
            "train": {"run_dir": str(run_dir), "device": "cpu"},
        }
    )


def vocabulary(tokenizer: Any) -> list[str]:
    return sorted(tokenizer.backend.get_vocab())


def _rank_vocabulary(rank: int, world_size: int, run_dir: str) -> list[str]:
    loop._synthetic_tokenizer = learner(f"rank{rank}word")  # each rank would learn its own
    return vocabulary(loop._load_tokenizer(synthetic_config(run_dir), None, rank == 0))


def test_every_rank_gets_rank_zeros_vocabulary(tmp_path: Path) -> None:
    (tmp_path / "gloo").mkdir()
    vocabs = run_gloo(_rank_vocabulary, 2, tmp_path / "gloo", str(tmp_path / "run"))
    assert vocabs[0] == vocabs[1]
    assert "rank0word" in vocabs[1] and "rank1word" not in vocabs[1]


def test_a_resumed_run_keeps_the_vocabulary_of_its_checkpoint(tmp_path: Path, monkeypatch: Any) -> None:
    cfg = synthetic_config(tmp_path / "run")
    monkeypatch.setattr(loop, "_synthetic_tokenizer", learner("firstword"))
    first = loop._load_tokenizer(cfg, None, True)  # nothing to resume yet: learnt
    assert "firstword" in vocabulary(first)
    model_config = cfg.model.resolve()
    torch.manual_seed(0)
    checkpoint = ckpt.write_checkpoint(
        cfg.train.run_dir,
        2,
        model_config=model_config,
        model_state=DualEncoder(model_config).state_dict(),
        trainer_state={"step": 2},
        tokenizer=first,
        keep=2,
    )
    monkeypatch.setattr(loop, "_synthetic_tokenizer", learner("secondword"))
    assert vocabulary(loop._load_tokenizer(cfg, checkpoint, True)) == vocabulary(first)
    # A fresh start learns anew.
    assert "secondword" in vocabulary(loop._load_tokenizer(cfg, None, True))
