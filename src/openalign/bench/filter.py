"""``openalign bench filter``: the ALIGN rules on DuckDB against a straightforward pandas implementation.

A synthetic alt-text corpus is written to Parquet first (not timed): Zipf-distributed words with a
little case and punctuation noise, frequent word-to-word successions (so bigrams have a realistic head
and a long tail for the rare-n-gram rule to cut), caption lengths mostly 3-20 words with short and long
tails, boilerplate captions shared by many images, a few images with thousands of alt-texts, image sizes
and aspect ratios around the thresholds, unsafe scores and a few null captions. The vocabulary size K
is set just above the generator's common n-grams (DEFAULT_TOP_K), so the rare rule has work at any size.

DuckDB filters the whole corpus; pandas filters its first ``baseline_rows`` rows and its time is scaled
linearly to the full size (kind to pandas: its groupbys and Python-level loops only get slower per row
with size). DuckDB also filters that subsample, and both must keep exactly the same rows.
"""

from __future__ import annotations

import itertools
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from openalign.data.filters.rules import FilterRules, frequent_threshold, load_rules, paired_words, tokenize

FOLLOW_PROBABILITY = 0.97
JUNK_RATE = 0.05
# The paper keeps 100M n-grams for 1.8B pairs; that ratio means nothing for a generator whose phrase
# structure is fixed (4000 words, 8 usual successors each: ~36k common n-grams) while only its tail grows
# with the row count. A fixed K just above that head cuts the tail (random word pairs, junk ids) at any size.
DEFAULT_TOP_K = 40_000
_BOILERPLATE = [
    "1920x1080",
    "alt img",
    "image",
    "click here to enlarge",
    "Photo",
    "thumbnail",
    "product image 1",
    "IMG_0001.JPG",
    "untitled",
    "logo",
    "banner",
    "loading...",
    "see more photos of this listing",
    "no image available",
    "default avatar image",
    "Read more",
]


def _vocabulary(size: int, rng: np.random.Generator) -> list[str]:
    """``size`` distinct lowercase pseudo-words of 2-10 letters."""
    letters = (rng.integers(0, 26, size=(size * 2, 10), dtype=np.uint8) + ord("a")).tobytes()
    lengths = rng.integers(2, 11, size=size * 2)
    words = dict.fromkeys(letters[i * 10 : i * 10 + n].decode() for i, n in enumerate(lengths))
    return list(words)[:size]


def _zipf(n: int, n_items: int, exponent: float, rng: np.random.Generator) -> np.ndarray:
    """Ranks 0..n_items-1 with P(rank r) roughly proportional to 1 / (r + 1) ** exponent (inverse CDF of the
    continuous power law, which is fast and close enough for a synthetic corpus)."""
    top = n_items ** (1.0 - exponent)
    ranks = ((top - 1.0) * rng.random(n) + 1.0) ** (1.0 / (1.0 - exponent))
    out: np.ndarray = np.minimum(ranks.astype(np.int64) - 1, n_items - 1)
    return out


def synthetic_corpus(
    path: str | Path, rows: int, *, seed: int = 0, vocab_size: int = 4_000, chunk_rows: int = 1_000_000
) -> Path:
    """Write ``rows`` synthetic img2dataset-style rows (url, caption, width, height, punsafe) to Parquet."""
    rng = np.random.default_rng(seed)
    words = _vocabulary(vocab_size, rng)
    # Each word in three spellings: plain, Capitalised, with trailing punctuation.
    spelled = pa.array(words + [w.capitalize() for w in words] + [w + "," for w in words])
    boilerplate = pa.array(_BOILERPLATE)
    max_len = 40
    path = Path(path)
    with pq.ParquetWriter(path, _schema()) as writer:
        for start in range(0, rows, chunk_rows):
            n = min(chunk_rows, rows - start)
            kind = rng.random(n)
            lengths = np.where(
                kind < 0.85,
                np.clip(rng.negative_binomial(8, 0.5, n) + 3, 3, 20),
                np.where(kind < 0.93, rng.integers(1, 3, n), rng.integers(21, max_len + 1, n)),
            )
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            tokens = np.empty(offsets[-1], dtype=np.int64)
            tokens[offsets[:-1]] = _zipf(n, vocab_size, 1.05, rng)
            by_length = np.argsort(lengths, kind="stable")
            sorted_lengths = lengths[by_length]
            for t in range(1, max_len):
                # Only captions longer than t have a word at position t.
                slots = offsets[by_length[np.searchsorted(sorted_lengths, t, side="right") :]] + t
                # Mostly a word is one of the previous word's usual successors (Zipf over 8 fixed choices, so
                # phrases repeat); otherwise it is a fresh draw, and that bigram is probably in the long tail.
                choice = _zipf(len(slots), 8, 1.5, rng)
                successor = (tokens[slots - 1] * 2654435761 + choice * 40503 + 7) % vocab_size
                fresh = _zipf(len(slots), vocab_size, 1.05, rng)
                tokens[slots] = np.where(rng.random(len(slots)) < FOLLOW_PROBABILITY, successor, fresh)
            draw = rng.random(len(tokens))
            tokens += ((draw >= 0.9).astype(np.int64) + (draw >= 0.97)) * vocab_size
            flat = pa.array(tokens)
            offsets = pa.array(offsets.astype(np.int32))
            captions = pc.binary_join(pa.ListArray.from_arrays(offsets, spelled.take(flat)), " ")
            # Junk tokens (file names, ids) in some alt-texts: the rare n-grams the vocabulary rule exists for.
            junk = rng.random(n) < JUNK_RATE
            junk_ids = pc.cast(pa.array(rng.integers(0, 10**9, n)), pa.string())
            with_junk = pc.binary_join_element_wise(captions, pc.binary_join_element_wise("dsc", junk_ids, ""), " ")
            captions = pc.if_else(pa.array(junk), with_junk, captions)
            shared = rng.random(n) < 0.02
            bp = boilerplate.take(pa.array(rng.integers(0, len(_BOILERPLATE), n)))
            captions = pc.if_else(pa.array(shared), bp, captions)
            captions = pc.if_else(pa.array(rng.random(n) < 0.001), pa.nulls(n, pa.string()), captions)
            image_ids = np.arange(start, start + n, dtype=np.int64) + 1_000
            popular = rng.random(n) < 0.01
            image_ids[popular] = _zipf(int(popular.sum()), 200, 1.1, rng)
            urls = pc.binary_join_element_wise(
                "https://img.example.com/", pc.cast(pa.array(image_ids), pa.string()), ".jpg", ""
            )
            short = np.clip(rng.lognormal(math.log(350), 0.5, n), 16, 4000).astype(np.int64)
            aspect = np.exp(np.abs(rng.normal(0, 0.55, n)))
            long = (short * aspect).astype(np.int64)
            landscape = rng.random(n) < 0.6
            width = np.where(landscape, long, short)
            height = np.where(landscape, short, long)
            punsafe = rng.beta(0.5, 8.0, n)
            table = pa.table(
                {"url": urls, "caption": captions, "width": width, "height": height, "punsafe": punsafe},
                schema=_schema(),
            )
            writer.write_table(table)
    return path


def _schema() -> pa.Schema:
    return pa.schema(
        [
            ("url", pa.string()),
            ("caption", pa.string()),
            ("width", pa.int64()),
            ("height", pa.int64()),
            ("punsafe", pa.float64()),
        ]
    )


def pandas_align_filter(path: str | Path, rules: FilterRules) -> Any:
    """The ALIGN rules written the way a pandas user would; returns the kept rows' input positions."""
    import pandas as pd

    df = pd.read_parquet(path)
    text = df["caption"]
    w = pd.to_numeric(df["width"], errors="coerce").astype(float)
    h = pd.to_numeric(df["height"], errors="coerce").astype(float)
    u = pd.to_numeric(df["punsafe"], errors="coerce")
    valid = text.notna()
    valid &= text.fillna("").str.strip(" \t\n\x0b\f\r") != ""
    valid &= np.isfinite(w) & (w > 0) & np.isfinite(h) & (h > 0)
    valid &= ~(df["punsafe"].notna() & u.isna())

    toks = text[valid].map(tokenize)
    norm = toks.str.join(" ")
    good = df[valid].assign(norm=norm, toks=toks)
    n_texts = good.groupby("url")["url"].transform("size")
    n_images = good.groupby("norm")["url"].transform("nunique")
    unigrams = good["toks"].explode().dropna()
    bigrams = good["toks"].map(lambda t: [f"{a} {b}" for a, b in itertools.pairwise(t)]).explode().dropna()
    counts = pd.concat([unigrams, bigrams]).value_counts()
    threshold = frequent_threshold(counts.value_counts().to_dict(), rules.vocab_top_k or 0)
    frequent = set(counts.index[counts >= threshold])
    rare = good["toks"].map(
        lambda t: any(x not in frequent for x in t) or any(f"{a} {b}" not in frequent for a, b in itertools.pairwise(t))
    )
    n_words = good["toks"].str.len()
    n_paired = good["toks"].map(lambda t: len(paired_words(t)))  # what too_many_words counts
    keep = (
        ~(u[valid.values] > rules.max_unsafe)
        & (np.minimum(good["width"], good["height"]) > rules.min_shorter_side)
        & (
            np.maximum(good["width"], good["height"]) / np.minimum(good["width"], good["height"])
            < rules.max_aspect_ratio
        )
        & (n_texts <= rules.max_texts_per_image)
        & (n_images <= rules.max_images_per_text)
        & ~rare
        & (n_words >= rules.min_words)
        & (n_paired <= rules.max_words)
    )
    return good.index[keep].to_numpy()


@dataclass
class FilterBenchSettings:
    """What ``openalign bench filter`` measures (the arguments of ``run_filter_bench``)."""

    rows: int = 10_000_000  # corpus rows
    baseline_rows: int = 1_000_000  # rows of the pandas subsample
    top_k: int | None = None  # vocabulary size K (default 40000)
    threads: int | None = None  # duckdb threads (default: all cores)
    seed: int = 0  # the synthetic corpus
    work_dir: str | None = None  # where the temporary corpus goes (default: system temp)
    json_path: str | None = None  # also write the results to this JSON file


def run_filter_bench(
    rows: int = 10_000_000,
    baseline_rows: int = 1_000_000,
    *,
    seed: int = 0,
    threads: int | None = None,
    top_k: int | None = None,
    work_dir: str | None = None,
) -> dict[str, Any]:
    """Generate, filter with DuckDB (all rows) and pandas (a subsample), compare; prints and returns the figures."""
    from openalign.data.filters import EngineConfig, filter_corpus

    if rows < 1 or baseline_rows < 1:
        raise ValueError(f"--rows and --baseline-rows must be positive, got {rows} and {baseline_rows}")
    baseline_rows = min(baseline_rows, rows)
    with tempfile.TemporaryDirectory(prefix="openalign-bench-filter-", dir=work_dir) as tmp:
        tmp_path = Path(tmp)
        t0 = time.perf_counter()
        full = synthetic_corpus(tmp_path / "corpus.parquet", rows, seed=seed)
        sub = tmp_path / "subsample.parquet"
        pq.write_table(pq.read_table(full).slice(0, baseline_rows), sub)
        print(f"generated {rows:,} synthetic alt-text rows in {time.perf_counter() - t0:.1f}s", flush=True)

        def rules_for(n: int) -> FilterRules:
            return load_rules("align", vocab_top_k=top_k or DEFAULT_TOP_K)

        engine = EngineConfig(engine="duckdb", threads=threads)
        t0 = time.perf_counter()
        report = filter_corpus(full, tmp_path / "kept.parquet", rules_for(rows), engine=engine)
        duck_s = time.perf_counter() - t0

        sub_report = filter_corpus(sub, tmp_path / "kept_sub.parquet", rules_for(baseline_rows), engine=engine)
        t0 = time.perf_counter()
        pandas_kept = pandas_align_filter(sub, rules_for(baseline_rows))
        pandas_s = time.perf_counter() - t0
        sub_table = pq.read_table(sub, columns=["url", "caption"])
        duck_sub = pq.read_table(tmp_path / "kept_sub.parquet", columns=["url", "caption"])
        pandas_set = sorted(
            (sub_table.column("url")[i].as_py(), sub_table.column("caption")[i].as_py()) for i in pandas_kept
        )
        duck_set = sorted(zip(duck_sub.column("url").to_pylist(), duck_sub.column("caption").to_pylist(), strict=True))
        same = pandas_set == duck_set

    duck_rate = rows / duck_s
    pandas_rate = baseline_rows / pandas_s
    pandas_full_s = pandas_s * rows / baseline_rows
    print(report.table())
    print(
        f"\nbench filter: ALIGN rules, {rows:,} rows, K={rules_for(rows).vocab_top_k:,} "
        f"(frequent n-grams need >= {report.stats.get('frequent_min_count', 0)} occurrences)"
    )
    print(f"{'engine':>8} {'rows':>12} {'seconds':>9} {'rows/s':>11}")
    print(f"{'duckdb':>8} {rows:>12,} {duck_s:>9.1f} {duck_rate:>11,.0f}")
    print(
        f"{'pandas':>8} {baseline_rows:>12,} {pandas_s:>9.1f} {pandas_rate:>11,.0f}   "
        f"(scaled to {rows:,} rows: {pandas_full_s:.1f}s)"
    )
    print(f"duckdb / pandas rows/s: {duck_rate / pandas_rate:.1f}x")
    print(
        f"subsample parity: pandas kept {len(pandas_set):,}, duckdb kept {sub_report.rows_out:,}: "
        f"{'identical rows' if same else 'DIFFERENT rows'}"
    )
    return {
        "rows": rows,
        "baseline_rows": baseline_rows,
        "duckdb_seconds": duck_s,
        "pandas_seconds": pandas_s,
        "duckdb_rows_per_s": duck_rate,
        "pandas_rows_per_s": pandas_rate,
        "speedup": duck_rate / pandas_rate,
        "parity": same,
        "funnel": report.to_dict(),
    }
