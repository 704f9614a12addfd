"""Train the paper's WordPiece vocabulary on (filtered) alt-texts, streamed from the files people have.

Captions are read in batches from Parquet, CSV, JSON Lines, plain text (one caption per line) or
WebDataset shards (each sample's ``txt`` member), so a corpus of any size passes through in constant
memory; only the word counts of the trainer grow. Captions that cannot be used (null, empty, not
valid UTF-8, an unparsable JSON line, an unreadable shard) are skipped and counted by reason.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
from tqdm import tqdm

from openalign.config import ConfigError
from openalign.data.sources import (
    CAPTION_MEMBER,
    CAPTION_TEXT_SUFFIXES,
    SHARD_SUFFIXES,
    bounded_lines,
    expand_urls,
    iter_samples,
    line_reader,
    open_parquet,
    parquet_batches,
    read_annotation_json,
    table_format,
)
from openalign.data.tables import read_csv
from openalign.outputs import check_writable
from openalign.text.tokenizer import Tokenizer, train_wordpiece


@dataclass
class VocabConfig:
    """How the vocabulary is learnt; the defaults are the paper's (100k wordpieces, 64 tokens)."""

    vocab_size: int = 100_000  # wordpieces, special tokens included
    column: str = "caption"  # the alt-text column of a table (Parquet, CSV, JSON Lines)
    lowercase: bool = True  # BERT-uncased normalisation: lowercase and strip accents
    min_frequency: int = 2  # a merge must be seen at least this often
    max_length: int = 64  # tokens per caption, [CLS] and [SEP] included (saved with the vocabulary)
    batch_size: int = 1024  # captions handed to the trainer at once

    def validate(self) -> None:
        """Reject values the trainer cannot use, naming the field."""
        if self.vocab_size < 10:
            raise ConfigError(f"vocab.vocab_size must be at least 10, got {self.vocab_size}")
        if self.min_frequency < 1:
            raise ConfigError(f"vocab.min_frequency must be at least 1, got {self.min_frequency}")
        if self.max_length < 3:
            raise ConfigError(f"vocab.max_length must be at least 3 ([CLS] x [SEP]), got {self.max_length}")
        if self.batch_size < 1:
            raise ConfigError(f"vocab.batch_size must be at least 1, got {self.batch_size}")
        if not self.column:
            raise ConfigError("vocab.column must name a column")


def _decode(value: Any, skipped: Counter[str]) -> str | None:
    if value is None:
        skipped["null"] += 1
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            skipped["not_utf8"] += 1
            return None
    if not isinstance(value, str):
        skipped["not_text"] += 1
        return None
    if not value.strip():
        skipped["empty"] += 1
        return None
    return value


def _text_column(schema: pa.Schema, column: str, path: Path) -> pa.DataType:
    if column not in schema.names:
        raise ValueError(f"{path}: no column {column!r} (columns: {', '.join(schema.names)}); choose one with --column")
    kind = schema.field(column).type
    textual = (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary)
    if not (any(test(kind) for test in textual) or pa.types.is_null(kind)):
        raise ValueError(f"{path}: column {column!r} holds {kind}, not text")
    return kind


def _parquet(path: Path, column: str, batch_size: int, skipped: Counter[str]) -> Iterator[str]:
    files = sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
    for f in files:
        _text_column(open_parquet(f).schema_arrow, column, f)
        for batch in parquet_batches(f, batch_size, columns=[column]):
            for value in batch.column(0).to_pylist():
                if (text := _decode(value, skipped)) is not None:
                    yield text


def _csv(path: Path, column: str, skipped: Counter[str]) -> Iterator[str]:
    # Strict: a stray quote stops the run naming its line, instead of folding the rows after it into one.
    names, records = read_csv(path)
    index = names.index(column)
    for record in records:
        # Back to the bytes read: an invalid UTF-8 caption is skipped and counted like any other input's.
        if (text := _decode(record[index].encode("utf-8", "surrogateescape"), skipped)) is not None:
            yield text


def _csv_header(path: Path, column: str) -> None:
    names, _ = read_csv(path)
    if column not in names:
        raise ValueError(f"{path}: no column {column!r} (columns: {', '.join(names)}); choose one with --column")


def _json_rows(path: Path, skipped: Counter[str]) -> Iterator[bytes | Any]:
    with line_reader(path) as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if head.startswith(b"["):
            # A JSON array is not streamable; it is loaded whole, within the annotation limit (JSON Lines is
            # the format for big corpora).
            yield from read_annotation_json(path)
            return
        yield from _bounded_lines(f, skipped)


def _bounded_lines(f: BinaryIO, skipped: Counter[str]) -> Iterator[bytes]:
    """The file's lines (``bounded_lines``), a line over the limit counted (``too_long``)."""
    for line in bounded_lines(f):
        if line is None:
            skipped["too_long"] += 1
        else:
            yield line


def _jsonl(path: Path, column: str, skipped: Counter[str]) -> Iterator[str]:
    seen_column = False
    for line in _json_rows(path, skipped):
        if isinstance(line, bytes | bytearray):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError):
                skipped["bad_json"] += 1
                continue
        else:
            row = line
        if not isinstance(row, dict) or column not in row:
            skipped["no_column"] += 1
            continue
        seen_column = True
        if (text := _decode(row[column], skipped)) is not None:
            yield text
    if not seen_column and skipped["no_column"]:
        raise ValueError(f"{path}: no row has a {column!r} field; choose one with --column")


def _lines(path: Path, skipped: Counter[str]) -> Iterator[str]:
    with line_reader(path) as f:
        for line in _bounded_lines(f, skipped):
            if (text := _decode(line.rstrip(b"\r\n"), skipped)) is not None:
                yield text


def _shards(spec: str, skipped: Counter[str]) -> Iterator[str]:
    for sample in iter_samples(spec, on_error=lambda reason, detail: skipped.update([f"shard_{reason}"])):
        if CAPTION_MEMBER not in sample:
            skipped["no_txt"] += 1
            continue
        if (text := _decode(sample[CAPTION_MEMBER], skipped)) is not None:
            yield text


def iter_captions(
    source: str | Path, *, column: str = "caption", batch_size: int = 1024, skipped: Counter[str] | None = None
) -> Iterator[str]:
    """Stream the usable captions of ``source``: a Parquet file or folder, CSV, JSON Lines, plain text
    (one caption per line) or WebDataset shards (a ``.tar``, a folder of them, or a brace/glob pattern).

    Unusable captions are counted in ``skipped`` by reason. A missing file or caption column raises
    before anything is yielded.
    """
    skipped = skipped if skipped is not None else Counter()
    text = str(source)
    path = Path(text)
    suffix = path.suffix.lower()
    # A folder of shards also holds each shard's .parquet table; the shards are what it is.
    shard_folder = path.is_dir() and any(p.name.endswith(SHARD_SUFFIXES) for p in path.iterdir())
    if path.is_dir() and not shard_folder and any(path.rglob("*.parquet")):
        first = next(path.rglob("*.parquet"))
        _text_column(open_parquet(first).schema_arrow, column, first)
        return _parquet(path, column, batch_size, skipped)
    if path.is_file():
        fmt = table_format(path) if suffix != ".gz" else None  # compressed tables are not streamed here
        if fmt == "parquet":
            _text_column(open_parquet(path).schema_arrow, column, path)
            return _parquet(path, column, batch_size, skipped)
        if fmt == "csv":
            _csv_header(path, column)
            return _csv(path, column, skipped)
        if fmt == "jsonl":
            return _jsonl(path, column, skipped)
        if suffix in CAPTION_TEXT_SUFFIXES:
            return _lines(path, skipped)
    if path.is_dir() or any(mark in text for mark in (".tar", ".tgz", "{", "*", "::")) or text.startswith("pipe:"):
        urls = expand_urls(text)  # raises FileNotFoundError for a folder or pattern without shards
        if not any(Path(u).exists() or u.startswith("pipe:") for u in urls):
            raise FileNotFoundError(f"{source}: no such shard file")
        return _shards(text, skipped)
    if not path.exists():
        raise FileNotFoundError(f"{source}: no such file")
    raise ValueError(
        f"{source}: unsupported input {suffix or '(no suffix)'}; use .parquet, .csv, .jsonl, .txt or .tar shards"
    )


def _batched(captions: Iterator[str], size: int, bar: tqdm, counted: Counter[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    for caption in captions:
        batch.append(caption)
        if len(batch) == size:
            bar.update(len(batch))
            counted["captions"] += len(batch)
            yield batch
            batch = []
    if batch:
        bar.update(len(batch))
        counted["captions"] += len(batch)
        yield batch


def build_vocab(
    source: str | Path, out_dir: str | Path, config: VocabConfig | None = None, *, progress: bool = False
) -> tuple[Tokenizer, dict[str, Any]]:
    """Learn WordPiece on the captions of ``source`` and save it in ``out_dir`` (``tokenizer.json``,
    ``vocab.txt``, ``tokenizer_config.json``, ``special_tokens_map.json``, ``vocab_stats.json``).

    The result loads with ``openalign.load_tokenizer(out_dir)`` and with transformers'
    ``BertTokenizerFast.from_pretrained(out_dir)``, which give identical ids.
    """
    config = config or VocabConfig()
    config.validate()
    check_writable(out_dir, directory=True)
    skipped: Counter[str] = Counter()
    counted: Counter[str] = Counter()
    # A first pass collects the characters, so the trainer numbers its pieces in a stable order and the
    # second pass streams the captions straight into it: the same corpus always gives the same vocabulary.
    characters: set[str] = set()
    for caption in iter_captions(source, column=config.column, batch_size=config.batch_size, skipped=Counter()):
        characters.update(caption)
    captions = iter_captions(source, column=config.column, batch_size=config.batch_size, skipped=skipped)
    with tqdm(unit="caption", desc="vocab", disable=not progress, unit_scale=True) as bar:
        tokenizer = train_wordpiece(
            _batched(captions, config.batch_size, bar, counted),
            vocab_size=config.vocab_size,
            lowercase=config.lowercase,
            min_frequency=config.min_frequency,
            max_length=config.max_length,
            characters=characters,
        )
    used = counted["captions"]
    if used == 0:
        raise ValueError(f"{source}: no usable captions (skipped: {dict(skipped) or 'none'})")
    out = tokenizer.save(out_dir)
    stats = {
        "source": str(source),
        "captions": used,
        "skipped": dict(sorted(skipped.items())),
        "vocab_size": tokenizer.vocab_size,
        "config": asdict(config),
    }
    (out / "vocab_stats.json").write_text(json.dumps(stats, indent=2, ensure_ascii=False) + "\n")
    return tokenizer, stats
