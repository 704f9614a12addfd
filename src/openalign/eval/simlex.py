"""SimLex-999 word similarity (Hill et al. 2015) with the text tower's word representations.

Supplement Sec. 2 of the paper: a word's wordpieces are fed to the text encoder as ``[CLS] pieces [SEP]``
and the [CLS] vector BEFORE the projection layer is the word's embedding; the score of a pair is the
cosine of its two embeddings, and the metric is Spearman's ρ (× 100) against the human ratings on the
nine subsets of Kiros et al. (2018): all, adjectives, nouns, verbs, concreteness quartiles 1-4, hard.

Two file formats are read:

- the official release ``SimLex-999.txt``: tab-separated with the header ``word1 word2 POS SimLex999
  conc(w1) conc(w2) concQ Assoc(USF) SimAssoc333 SD(SimLex)``; POS is A/N/V, concQ is the pair's
  concreteness quartile 1-4 and SimAssoc333 marks the 333 most associated ("hard") pairs;
- the 3-column variant shipped by gensim (``gensim.test.utils.datapath('simlex999.txt')``): ``#`` comment
  lines, then ``word1<TAB>word2<TAB>score``. It has no POS or concreteness columns, so only "all" is
  reported for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from openalign.model.dual_encoder import DualEncoder
    from openalign.text.tokenizer import TextTokenizer

OFFICIAL_COLUMNS = (
    "word1",
    "word2",
    "POS",
    "SimLex999",
    "conc(w1)",
    "conc(w2)",
    "concQ",
    "Assoc(USF)",
    "SimAssoc333",
    "SD(SimLex)",
)
POS_SUBSETS = {"A": "adjs", "N": "nouns", "V": "verbs"}
SUBSETS = ("all", "adjs", "nouns", "verbs", "conc_q1", "conc_q2", "conc_q3", "conc_q4", "hard")


@dataclass(frozen=True)
class SimLexPair:
    word1: str
    word2: str
    score: float  # human similarity rating, 0-10
    pos: str | None = None  # "A", "N" or "V" (official release only)
    conc_quartile: int | None = None  # 1 (most abstract) .. 4 (most concrete)
    hard: bool | None = None  # SimAssoc333 == 1


# --------------------------------------------------------------------------------------------------
# Spearman's ρ (numpy only: scipy is not a core dependency)


def rankdata(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties given their average rank (scipy's ``rankdata(method="average")``)."""
    x = np.asarray(x)
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    # Start index of each run of equal values; a run [i, j) gets the average of ranks i+1..j.
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    ends = np.r_[starts[1:], len(x)]
    avg = (starts + ends + 1) / 2.0
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.repeat(avg, ends - starts)
    return ranks


def spearman(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> float:
    """Spearman's rank correlation: Pearson's r of the average-tie ranks. NaN if either side is constant."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"spearman needs two 1-d arrays of equal length, got {a.shape} and {b.shape}")
    if len(a) < 2:
        raise ValueError(f"spearman needs at least 2 pairs, got {len(a)}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("spearman inputs contain NaN or infinite values")
    ra, rb = rankdata(a), rankdata(b)
    ra -= ra.mean()
    rb -= rb.mean()
    denom = np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / denom) if denom > 0 else float("nan")


# --------------------------------------------------------------------------------------------------
# Loading


def _parse_float(value: str, where: str, column: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{where}: column {column} is not a number: {value!r}") from None


def load_simlex(path: str | Path) -> list[SimLexPair]:
    """Read SimLex-999 in the official 10-column format or gensim's 3-column variant (detected)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no such SimLex-999 file")
    lines = p.read_text(encoding="utf-8").splitlines()
    pairs: list[SimLexPair] = []
    header: list[str] | None = None
    for lineno, line in enumerate(lines, 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.rstrip("\n\r").split("\t")
        where = f"{p}:{lineno}"
        if header is None and fields[0].strip().lower() == "word1":
            header = [f.strip() for f in fields]
            missing = [c for c in OFFICIAL_COLUMNS if c not in header]
            if missing:
                raise ValueError(f"{where}: SimLex-999 header lacks column(s) {', '.join(missing)}")
            continue
        if header is not None:
            if len(fields) != len(header):
                raise ValueError(f"{where}: expected {len(header)} tab-separated columns, got {len(fields)}")
            row = dict(zip(header, (f.strip() for f in fields), strict=True))
            pos = row["POS"]
            if pos not in POS_SUBSETS:
                raise ValueError(f"{where}: POS must be A, N or V, got {pos!r}")
            quartile = int(_parse_float(row["concQ"], where, "concQ"))
            if quartile not in (1, 2, 3, 4):
                raise ValueError(f"{where}: concQ must be 1-4, got {row['concQ']!r}")
            pairs.append(
                SimLexPair(
                    row["word1"],
                    row["word2"],
                    _parse_float(row["SimLex999"], where, "SimLex999"),
                    pos,
                    quartile,
                    _parse_float(row["SimAssoc333"], where, "SimAssoc333") == 1.0,
                )
            )
        else:
            if len(fields) != 3:
                raise ValueError(
                    f"{where}: expected 'word1<TAB>word2<TAB>score' (gensim format) or the official header, "
                    f"got {len(fields)} column(s)"
                )
            pairs.append(SimLexPair(fields[0].strip(), fields[1].strip(), _parse_float(fields[2], where, "score")))
    if not pairs:
        raise ValueError(f"{path}: no SimLex-999 pairs found")
    for pair in pairs:
        if not pair.word1 or not pair.word2:
            raise ValueError(f"{path}: a pair has an empty word: {pair}")
    return pairs


# --------------------------------------------------------------------------------------------------
# Scoring


def subset_masks(pairs: Sequence[SimLexPair]) -> dict[str, np.ndarray]:
    """Boolean masks of the nine subsets; subsets whose column the file lacks are left out."""
    n = len(pairs)
    masks = {"all": np.ones(n, dtype=bool)}
    if all(p.pos is not None for p in pairs):
        for code, name in POS_SUBSETS.items():
            masks[name] = np.array([p.pos == code for p in pairs])
    if all(p.conc_quartile is not None for p in pairs):
        for q in (1, 2, 3, 4):
            masks[f"conc_q{q}"] = np.array([p.conc_quartile == q for p in pairs])
    if all(p.hard is not None for p in pairs):
        masks["hard"] = np.array([bool(p.hard) for p in pairs])
    return masks


def evaluate_simlex(pairs: Sequence[SimLexPair], embed: Callable[[list[str]], torch.Tensor]) -> dict[str, Any]:
    """Spearman ρ × 100 between cosine similarities and human ratings, per subset.

    ``embed(words)`` returns one vector per word [W, D]; each distinct word is embedded once.
    Returns ``{subset: rho}`` plus ``n_<subset>`` pair counts.
    """
    if not pairs:
        raise ValueError("no SimLex-999 pairs to evaluate")
    words = sorted({w for p in pairs for w in (p.word1, p.word2)})
    vectors = torch.as_tensor(embed(words)).double()
    if vectors.ndim != 2 or vectors.shape[0] != len(words):
        raise ValueError(f"embed returned shape {list(vectors.shape)} for {len(words)} words; expected [W, D]")
    norms = vectors.norm(dim=1, keepdim=True)
    if bool((norms == 0).any()):
        raise ValueError(f"word {words[int((norms[:, 0] == 0).nonzero()[0])]!r} has a zero embedding")
    vectors = vectors / norms
    index = {w: i for i, w in enumerate(words)}
    a = vectors[[index[p.word1] for p in pairs]]
    b = vectors[[index[p.word2] for p in pairs]]
    cosine = (a * b).sum(1).numpy()
    human = np.array([p.score for p in pairs])
    out: dict[str, Any] = {}
    for name, mask in subset_masks(pairs).items():
        out[name] = 100.0 * spearman(cosine[mask], human[mask]) if mask.sum() >= 2 else float("nan")
        out[f"n_{name}"] = int(mask.sum())
    return out


@torch.no_grad()
def word_embeddings(
    model: DualEncoder,
    tokenizer: TextTokenizer,
    words: Sequence[str],
    *,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """The text tower's [CLS] vector before the projection for each word, as ``[CLS] pieces [SEP]``.

    Returns float32 [W, hidden] on CPU (not normalised; cosine similarity normalises).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    was_training = model.training
    model.eval()
    out = []
    try:
        for start in range(0, len(words), batch_size):
            batch = list(words[start : start + batch_size])
            tokens = tokenizer(batch, pad_to_max=False)
            ids, mask = tokens["input_ids"].to(device), tokens["attention_mask"].to(device)
            model.check_tokens(ids, mask)
            out.append(model.text(ids, mask).float().cpu())
    finally:
        model.train(was_training)
    if not out:
        raise ValueError("no words to embed")
    return torch.cat(out)


def run_simlex(
    model: DualEncoder,
    tokenizer: TextTokenizer,
    path: str | Path,
    *,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Load a SimLex-999 file and score ``model``'s word representations on every available subset."""
    pairs = load_simlex(path)
    return evaluate_simlex(
        pairs, lambda words: word_embeddings(model, tokenizer, words, batch_size=batch_size, device=device)
    )


# --------------------------------------------------------------------------------------------------
# The `simlex` eval task


def _default_file() -> str:
    try:
        from gensim.test.utils import datapath
    except ImportError:
        raise ValueError("no --file given and gensim (which ships a SimLex-999 copy) is not installed") from None
    return str(datapath("simlex999.txt"))


def _run(model: DualEncoder, tokenizer: TextTokenizer, options: dict[str, Any]) -> dict[str, Any]:
    path = options["file"] or _default_file()
    metrics = run_simlex(model, tokenizer, path, batch_size=max(options["batch_size"], 256), device=options["device"])
    return {"dataset": "simlex-999", **metrics}


def _register() -> None:
    from openalign.eval.tasks import Option, Task, register

    register(
        Task(
            "simlex",
            _run,
            "SimLex-999 word similarity (Spearman ρ × 100) from the text tower's [CLS] before projection",
            options=(
                Option(
                    "file",
                    metavar="FILE",
                    help="SimLex-999.txt (official 10 columns) or gensim's 3-column copy (default: gensim's)",
                ),
            ),
            examples=(
                "openalign eval simlex --model runs/b7-base/final --file SimLex-999/SimLex-999.txt --out results/",
                "openalign eval simlex --model runs/nano/final",
            ),
            description="Each word's wordpieces go through the text encoder as [CLS] pieces [SEP]; the cosine "
            "of two words' [CLS] vectors (before the projection) is correlated with the human ratings on all "
            "pairs, adjectives, nouns, verbs, concreteness quartiles 1-4 and the hard (SimAssoc333) pairs.",
        )
    )


_register()
