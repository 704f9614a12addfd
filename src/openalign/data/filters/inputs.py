"""Reading the formats alt-text corpora come in, and writing the survivors back out.

Parquet is read by the engines directly (the path that scales to corpora bigger than memory, and the
one to use on a cluster). CSV/TSV, JSON Lines, WebDataset shards and Parquet files whose alt-text column
is binary, or whose string columns hold a value that is not UTF-8, are first *staged* into Parquet here,
streaming, so that both engines see exactly the same table and so that undecodable input becomes a counted
funnel line instead of a crash:

* CSV/TSV is read strictly (:mod:`openalign.data.tables`): a record that does not parse (a stray quote,
  the wrong number of fields) stops the run with an error naming its line, unless ``max_malformed_rows``
  allows it, and then it is counted as ``malformed_row`` with its line in the input errors; either way
  every record of the file is read or counted, never swallowed by its neighbour;
* a JSON line that does not parse, is not an object, or whose alt-text is not a string, is skipped and
  counted as ``malformed_row`` (``bad_json``, ``not_an_object``, ``caption_not_text`` in the input errors,
  with its line);
* an alt-text column that is not text (a Parquet int or list column, a JSON key that never holds a
  string) and a size or unsafe-score column that is not a number are errors naming the column and its
  type, before anything is read;
* an alt-text that is not valid UTF-8 becomes null with ``non_utf8_text`` in a hidden column; invalid
  bytes in any other column are replaced by U+FFFD, since only the alt-text is judged;
* CSV values are kept as text (CSV has no types; sizes and scores are parsed per row by the engines, so
  one "n/a" width removes its row and not the job); JSON columns get one type each: integer, float,
  boolean or string, and a column whose values mix types keeps them as JSON text.
"""

from __future__ import annotations

import functools
import glob
import itertools
import json
import operator
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from openalign.data.filters.images import HIDDEN_PREFIX, TAG_WORDS_COLUMN, ImageAnnotator, annotate_table
from openalign.data.filters.rules import TEXT_COLUMN_CANDIDATES, ColumnNames
from openalign.data.sources import bounded_lines, line_reader, read_annotation
from openalign.data.tables import (
    MalformedRow,
    clean_text,
    has_surrogates,
    read_csv,
    read_csv_arrow,
    text_type_error,
    undecodable,
)

TEXT_ERROR_COLUMN = "__oa_text_error"
ROW_ID_COLUMN = "__oa_rid"
INPUT_FORMATS = ("parquet", "csv", "tsv", "jsonl", "webdataset")
_EXTENSIONS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
    ".tsv": "tsv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".tar": "webdataset",
    ".tgz": "webdataset",
}
OUTPUT_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl"}
OUTPUT_FORMATS |= {".ndjson": "jsonl", ".json": "jsonl"}
_BATCH_ROWS = 65_536


@dataclass
class StagedInput:
    """What the engines read: Parquet files plus what was learnt while getting there."""

    paths: list[Path]
    columns: list[str]  # the input's own columns, in order; the output keeps exactly these
    text_column: str
    format: str
    malformed: int = 0  # rows that never reached a table (unparseable lines)
    has_text_error_column: bool = False
    input_errors: list[str] = field(default_factory=list)  # unreadable shards or members
    hidden: list[str] = field(default_factory=list)  # columns staging added for the image rules (images.py)


def _format_of(path: str) -> str | None:
    lower = path.lower()
    if lower.endswith(".tar.gz"):
        return "webdataset"
    return _EXTENSIONS.get(os.path.splitext(lower)[1])


def detect_format(spec: str) -> str:
    """The input format from the file extension (for a directory, from the files inside)."""
    if "{" in spec and "}" in spec:
        return "webdataset"
    if os.path.isdir(spec):
        found = {_format_of(p.name) for p in Path(spec).iterdir() if p.is_file()} - {None}
        if len(found) != 1:
            kinds = ", ".join(sorted(f for f in found if f)) or "none"
            raise ValueError(f"cannot tell the input format of directory {spec} (formats found: {kinds})")
        return found.pop()  # type: ignore[return-value]
    fmt = _format_of(spec)
    if fmt is None:
        raise ValueError(f"cannot tell the input format of {spec} from its extension; pass --input-format")
    return fmt


def input_files(spec: str, fmt: str) -> list[str]:
    """Every file ``spec`` names: a file, a directory, a glob, or (WebDataset) a brace range."""
    if fmt == "webdataset":
        from openalign.data.sources import expand_urls

        if os.path.isdir(spec):
            return sorted(str(p) for p in Path(spec).iterdir() if _format_of(p.name) == "webdataset")
        files = expand_urls(spec)
    elif os.path.isdir(spec):
        files = sorted(str(p) for p in Path(spec).iterdir() if p.is_file() and _format_of(p.name) == fmt)
    elif any(ch in spec for ch in "*?["):
        files = sorted(glob.glob(spec))
    else:
        files = [spec]
    if not files:
        raise FileNotFoundError(f"no {fmt} input files match {spec}")
    for f in files:
        if "://" not in f and not os.path.isfile(f):
            raise FileNotFoundError(f"input file not found: {f}")
    return files


def resolve_text_column(columns: list[str], configured: str | None) -> str:
    """The alt-text column: the configured one, else the first of caption, alt, alt_text, text, TEXT."""
    if configured is not None:
        if configured not in columns:
            raise ValueError(f"input has no text column '{configured}'; columns: {', '.join(columns)}")
        return configured
    for name in TEXT_COLUMN_CANDIDATES:
        if name in columns:
            return name
    raise ValueError(
        f"input has no alt-text column (looked for {', '.join(TEXT_COLUMN_CANDIDATES)}); "
        f"columns: {', '.join(columns)}; name it with --text-column"
    )


def stage_input(
    spec: str,
    fmt: str | None,
    columns: ColumnNames,
    work_dir: Path,
    max_malformed_rows: int = 0,
    annotator: Callable[..., ImageAnnotator] | None = None,
    max_image_bytes: int | None = None,
) -> StagedInput:
    """Make ``spec`` readable by the engines; see the module docstring for what is counted where.
    ``max_malformed_rows``: CSV/TSV records that may fail to parse before the run stops (JSON lines that do
    not parse are always skipped and counted). ``annotator``: given the input's columns, what the image rules
    need (formats, tags); its hidden columns are added to the staged table (see :mod:`.images`)."""
    fmt = fmt or detect_format(spec)
    if fmt not in INPUT_FORMATS:
        raise ValueError(f"unknown input format '{fmt}'; valid: {', '.join(INPUT_FORMATS)}")
    files = input_files(spec, fmt)
    work_dir.mkdir(parents=True, exist_ok=True)
    from openalign.data.sources import DEFAULT_MAX_FILE_BYTES

    max_bytes = max_image_bytes or DEFAULT_MAX_FILE_BYTES
    if fmt == "webdataset":
        return _stage_webdataset(files, columns, work_dir, annotator, max_bytes)
    if fmt == "parquet":
        staged = _stage_parquet(files, columns, work_dir)
    elif fmt in ("csv", "tsv"):
        staged = _stage_csv(files, fmt, columns, work_dir, max_malformed_rows)
    else:
        staged = _stage_json(files, columns, work_dir, fmt)
    images = annotator(staged.columns) if annotator is not None else None
    if images is None or not images.columns:
        return staged
    # Relative image paths start at the table's folder (or the folder given as INPUT).
    root = Path(spec) if os.path.isdir(spec) else Path(spec).parent
    names = staged.columns + [TEXT_ERROR_COLUMN] * staged.has_text_error_column
    out = annotate_table(staged.paths, names, images, root, work_dir / "images.parquet", max_bytes, staged.input_errors)
    staged.paths, staged.hidden = [out], images.columns
    return staged


# --------------------------------------------------------------------------------------------------
# Parquet


def _stage_parquet(files: list[str], columns: ColumnNames, work_dir: Path) -> StagedInput:
    names: list[str] = []
    binary_text = False
    schemas = []
    for f in files:
        try:
            schema = pq.read_schema(f)
        except (OSError, pa.ArrowInvalid) as err:
            raise ValueError(f"{f} is not a readable Parquet file: {err}") from err
        schemas.append(schema)
        names += [n for n in schema.names if n not in names]
    text = resolve_text_column(names, columns.text)
    numeric = [columns.width, columns.height, columns.original_width, columns.original_height, columns.unsafe]
    for f, schema in zip(files, schemas, strict=True):
        if text in schema.names:
            kind = schema.field(text).type
            if (why := text_type_error(text, kind)) is not None:
                raise ValueError(f"{f}: {why}; name the alt-text column with --text-column")
            binary_text = binary_text or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
        for name in numeric:
            if name is not None and name in schema.names and not _scalar(schema.field(name).type):
                raise ValueError(f"{f}: column '{name}' holds {schema.field(name).type}, not a number")
    # The engines refuse a whole file for one string value that is not UTF-8 (Parquet writers seldom check):
    # one pass over the string columns finds those that need the staging binary alt-texts get.
    dirty = _invalid_utf8_columns(files, schemas)
    if not binary_text and not dirty:
        return StagedInput([Path(f) for f in files], names, text, "parquet")
    # Binary alt-texts are decoded here, and any invalid UTF-8 cleaned, so that it is a counted reason (the
    # alt-text) or a replaced byte (any other column) and not an engine error.
    out = work_dir / "staged.parquet"
    writer: pq.ParquetWriter | None = None
    try:
        for f in files:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=_BATCH_ROWS):
                table = pa.Table.from_batches([batch])
                for name in names:
                    if name not in table.column_names:
                        table = table.append_column(name, pa.nulls(len(table)))
                table = table.select(names)
                for name in dirty - {text}:
                    i = table.column_names.index(name)
                    table = table.set_column(i, name, _replace_invalid(table.column(i)))
                table = _decode_text_column(table, text)
                if writer is None:
                    writer = pq.ParquetWriter(out, table.schema)
                writer.write_table(table.cast(writer.schema))
    finally:
        if writer is not None:
            writer.close()
    return StagedInput([out], names, text, "parquet", has_text_error_column=True)


def _scalar(kind: pa.DataType) -> bool:
    """Whether the engines can read a number from a column of this type (per row, as they do from text)."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    tests = (pa.types.is_integer, pa.types.is_floating, pa.types.is_decimal, pa.types.is_string, pa.types.is_null)
    return any(test(kind) for test in (*tests, pa.types.is_large_string))


def _is_text(kind: pa.DataType) -> bool:
    return bool(pa.types.is_string(kind) or pa.types.is_large_string(kind))


def _valid_utf8(arr: pa.Array | pa.ChunkedArray) -> bool:
    """Whether every value of a string array is valid UTF-8 (Arrow's full validation checks it)."""
    try:
        arr.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


def _invalid_utf8_columns(files: list[str], schemas: list[pa.Schema]) -> set[str]:
    """The string columns of any of the files that hold a value that is not valid UTF-8."""
    dirty: set[str] = set()
    for f, schema in zip(files, schemas, strict=True):
        names = [n for n in schema.names if _is_text(schema.field(n).type) and n not in dirty]
        if not names:
            continue
        try:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=_BATCH_ROWS, columns=names):
                dirty.update(n for n in names if not _valid_utf8(batch.column(n)))
        except (OSError, pa.ArrowException):
            continue  # a damaged file: the engine that reads it next names it in its one-line error
    return dirty


def _as_binary(arr: pa.Array) -> pa.Array:
    """A string array's bytes, unchecked (a string array may hold invalid UTF-8 that a reader did not check)."""
    if pa.types.is_string(arr.type):
        return arr.view(pa.binary())
    if pa.types.is_large_string(arr.type):
        return arr.view(pa.large_binary())
    return arr


def _replace_invalid(arr: pa.ChunkedArray | pa.Array) -> pa.Array:
    """A string column with every byte that is not UTF-8 replaced by U+FFFD."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if _valid_utf8(arr):
        return arr
    values = [None if v is None else v.decode("utf-8", "replace") for v in _as_binary(arr).to_pylist()]
    return pa.array(values, arr.type)


def _decode_binary(arr: pa.ChunkedArray | pa.Array) -> tuple[pa.Array, list[bool] | None]:
    """Binary (or string that may hold invalid UTF-8) to UTF-8 strings; invalid values become null, flagged
    in the list returned with them."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if _is_text(arr.type):
        if _valid_utf8(arr):
            return arr, None
        arr = _as_binary(arr)
    try:
        return pc.cast(arr, pa.string()), None
    except pa.ArrowInvalid:
        pass
    values: list[str | None] = []
    bad: list[bool] = []
    for v in arr.to_pylist():
        if v is None:
            values.append(None)
            bad.append(False)
            continue
        try:
            values.append(v.decode("utf-8"))
            bad.append(False)
        except UnicodeDecodeError:
            values.append(None)
            bad.append(True)
    return pa.array(values, pa.string()), bad


def _decode_text_column(table: pa.Table, text: str) -> pa.Table:
    decoded, bad = _decode_binary(table.column(text))
    errors = pa.array(["non_utf8_text" if b else None for b in bad] if bad else [None] * len(table), pa.string())
    table = table.set_column(table.column_names.index(text), text, decoded)
    return table.append_column(TEXT_ERROR_COLUMN, errors)


# --------------------------------------------------------------------------------------------------
# CSV / TSV


def _stage_csv(files: list[str], fmt: str, columns: ColumnNames, work_dir: Path, max_malformed: int) -> StagedInput:
    delimiter = "\t" if fmt == "tsv" else ","
    header: list[str] | None = None
    errors: list[str] = []
    out = work_dir / "staged.parquet"
    writer: pq.ParquetWriter | None = None
    text = ""

    def write(rows: list[list[str]]) -> None:
        nonlocal writer
        assert header is not None
        arrays, errors = [], pa.nulls(len(rows), pa.string())
        for i, name in enumerate(header):
            # One column at a time with a C-level getter: zip(*rows) over a batch of rows is several times slower.
            values: list[str] = list(map(operator.itemgetter(i), rows))
            column: Sequence[str | None] = values
            bad = undecodable(values)
            if bad is not None and name == text:
                # An undecodable alt-text costs its row; elsewhere only the bad bytes are replaced.
                column = [None if b else v for v, b in zip(values, bad, strict=True)]
                errors = pa.array(["non_utf8_text" if b else None for b in bad], pa.string())
            elif bad is not None:
                column = [clean_text(v) for v in values]
            arrays.append(pa.array(column, pa.string()))
        arrays.append(errors)
        table = pa.Table.from_arrays(arrays, names=[*header, TEXT_ERROR_COLUMN])
        if writer is None:
            writer = pq.ParquetWriter(out, table.schema)
        writer.write_table(table)

    def write_arrow(batch: pa.RecordBatch) -> None:
        # Valid UTF-8 throughout (read_csv_arrow checked every line): no value needs cleaning.
        nonlocal writer
        assert header is not None
        arrays = [*batch.columns, pa.nulls(batch.num_rows, pa.string())]
        table = pa.Table.from_arrays(arrays, names=[*header, TEXT_ERROR_COLUMN])
        if writer is None:
            writer = pq.ParquetWriter(out, table.schema)
        writer.write_table(table)

    try:
        for f in files:
            allowed = max_malformed - len(errors)
            on_malformed = functools.partial(_malformed, errors, f)
            fast = read_csv_arrow(f, delimiter=delimiter, batch_rows=_BATCH_ROWS)
            if fast is not None:
                names, batches = fast
                if header is None:
                    header = names
                    text = resolve_text_column(header, columns.text)
                elif names != header:
                    raise ValueError(f"{f}: header {names} differs from the first file's {header}")
                for batch in batches:
                    write_arrow(batch)
                continue
            try:
                names, records = read_csv(f, delimiter=delimiter, max_malformed=allowed, on_malformed=on_malformed)
                if header is None:
                    header = names
                    text = resolve_text_column(header, columns.text)
                elif names != header:
                    raise ValueError(f"{f}: header {names} differs from the first file's {header}")
                for rows in _chunks(records, _BATCH_ROWS):
                    write(rows)
            except MalformedRow as err:
                raise ValueError(f"{err}; --max-malformed-rows N skips and counts up to N such rows") from None
    finally:
        if writer is not None:
            writer.close()
    assert header is not None
    if writer is None:  # header only: an empty table with the right columns
        pq.write_table(pa.table({n: pa.array([], pa.string()) for n in [*header, TEXT_ERROR_COLUMN]}), out)
    return StagedInput([out], header, text, fmt, malformed=len(errors), has_text_error_column=True, input_errors=errors)


def _malformed(errors: list[str], path: str, line: int, why: str) -> None:
    errors.append(f"malformed_row: {path}: line {line}: {why}")


def _chunks(records: Iterator[list[str]], size: int) -> Iterator[list[list[str]]]:
    while chunk := list(itertools.islice(records, size)):
        yield chunk


# --------------------------------------------------------------------------------------------------
# JSON Lines (and JSON arrays of objects)


def _iter_json_records(path: str) -> Iterator[tuple[str, Any]]:
    """(where, record) for each record of a JSON Lines file (or a JSON array), ``where`` being ``line N``
    (``item N`` in an array); an unparseable line yields ``_MALFORMED``."""
    with line_reader(path) as fh:
        head = fh.read(4096).lstrip()
        fh.seek(0)
        if head.startswith(b"["):
            # Read whole, within the annotation limit: an array cannot be read in parts.
            data = read_annotation(path)
            try:
                records = json.loads(data.decode("utf-8", "surrogateescape"))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: not a valid JSON array: {err}") from err
            for i, rec in enumerate(records, 1):
                yield f"item {i}", rec
            return
        for number, raw in enumerate(bounded_lines(fh), 1):
            if raw is None:  # a line over the limit, stepped over, never held whole
                yield f"line {number}", _MALFORMED
                continue
            line = raw.strip()
            if not line:
                continue
            try:
                # surrogateescape keeps invalid bytes visible (as lone surrogates) for the text check
                yield f"line {number}", json.loads(line.decode("utf-8", "surrogateescape"))
            except ValueError:
                yield f"line {number}", _MALFORMED


_MALFORMED = object()
_INT64 = (-(2**63), 2**63 - 1)


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int" if _INT64[0] <= v <= _INT64[1] else "bigint"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    return "object" if isinstance(v, dict) else "list" if isinstance(v, list) else type(v).__name__


def _column_type(kinds: set[str]) -> pa.DataType:
    kinds = kinds - {"null"}
    if kinds == {"int"}:
        return pa.int64()
    if kinds and kinds <= {"int", "float"}:
        return pa.float64()
    if kinds == {"bool"}:
        return pa.bool_()
    return pa.string()


def _as_text(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, str):
        return clean_text(v)
    return json.dumps(v, ensure_ascii=False, sort_keys=True)


def _stage_json(
    files: list[str], columns: ColumnNames, work_dir: Path, fmt: str, origins: list[str] | None = None
) -> StagedInput:
    """``origins``: what to call each line of a single file in the errors, when it stands for something else
    (a WebDataset sample)."""
    # Pass 1: the column names (in order of first appearance) and the kinds of value each one holds,
    # so that every batch of pass 2 is written with the same schema.
    kinds: dict[str, set[str]] = {}
    for f in files:
        for _, rec in _iter_json_records(f):
            if isinstance(rec, dict):
                for k, v in rec.items():
                    kinds.setdefault(k, set()).add(_kind(v))
    names = list(kinds)
    if not names:
        raise ValueError(f"no JSON objects found in {', '.join(files)}")
    text = resolve_text_column(names, columns.text)
    text_kinds = kinds[text] - {"null"}
    if text_kinds and "str" not in text_kinds:
        # No value is text: the column is something else, named by the user or picked by name.
        where = "the shards' json" if origins is not None else ", ".join(files)
        held = " and ".join(sorted(text_kinds))
        hint = "name the alt-text column with --text-column"
        raise ValueError(f"{where}: column '{text}' holds {held} values, not text; {hint}")
    types = {n: pa.string() if n == text else _column_type(kinds[n]) for n in names}
    schema = pa.schema([(n, types[n]) for n in names] + [(TEXT_ERROR_COLUMN, pa.string())])
    work_dir.mkdir(parents=True, exist_ok=True)
    out = work_dir / "staged.parquet"
    errors: list[str] = []
    with pq.ParquetWriter(out, schema) as writer:
        batch: dict[str, list[Any]] = {n: [] for n in schema.names}

        def flush() -> None:
            if batch[TEXT_ERROR_COLUMN]:
                writer.write_table(pa.table({n: pa.array(batch[n], schema.field(n).type) for n in schema.names}))
                for values in batch.values():
                    values.clear()

        for f in files:
            for where, rec in _iter_json_records(f):
                source = origins[int(where.split()[1]) - 1] if origins is not None else f"{f}: {where}"
                if rec is _MALFORMED:
                    errors.append(f"bad_json: {source}")
                    continue
                if not isinstance(rec, dict):
                    errors.append(f"not_an_object: {source}: a JSON {_kind(rec)}")
                    continue
                caption = rec.get(text)
                if caption is not None and not isinstance(caption, str):
                    # A line of JSON is a row of its own: a caption of another type costs that row only.
                    errors.append(f"caption_not_text: {source}: '{text}' holds {_kind(caption)}")
                    continue
                for n in names:
                    v = rec.get(n)
                    if n == text:
                        bad = v is not None and has_surrogates(v)
                        batch[n].append(None if bad else v)
                        batch[TEXT_ERROR_COLUMN].append("non_utf8_text" if bad else None)
                    elif types[n] == pa.string():
                        batch[n].append(_as_text(v))
                    else:
                        batch[n].append(v)
                if len(batch[TEXT_ERROR_COLUMN]) >= _BATCH_ROWS:
                    flush()
        flush()
    visible = [n for n in names if not n.startswith(HIDDEN_PREFIX)]
    hidden = [n for n in names if n.startswith(HIDDEN_PREFIX)]
    return StagedInput(
        [out], visible, text, fmt, malformed=len(errors), has_text_error_column=True, input_errors=errors, hidden=hidden
    )


# --------------------------------------------------------------------------------------------------
# WebDataset


def _stage_webdataset(
    files: list[str],
    columns: ColumnNames,
    work_dir: Path,
    annotator: Callable[..., ImageAnnotator] | None,
    max_bytes: int,
) -> StagedInput:
    """Per-sample ``.json`` metadata (img2dataset writes url, caption, width, height, sha256, ...), with the
    ``.txt`` member as the alt-text when the json has none and the sample key as ``key`` when it has none.
    The image rules read the image member itself: its format is sniffed from its bytes."""
    from openalign.data.sources import CAPTION_MEMBER, METADATA_MEMBER, image_member, read_samples

    errors: list[str] = []
    text_name = columns.text or "caption"
    rows_path = work_dir / "samples.jsonl"
    malformed = 0
    origins: list[str] = []  # the sample behind each line of rows_path
    # A shard's samples carry their image, so the format always comes from the bytes here.
    images = annotator([columns.tags], images_present=True) if annotator is not None else None
    if images is not None:
        images.format_column = None
    pending: list[tuple[dict, bytes | None]] = []
    saw_tags = False

    def flush(out: Any) -> None:
        nonlocal saw_tags
        if images is not None and images.columns and pending:
            tags = [meta.get(columns.tags) for meta, _ in pending]
            saw_tags = saw_tags or any(t is not None for t in tags)
            hidden = images([data for _, data in pending], None, tags)
            for i, (meta, _) in enumerate(pending):
                meta.update({name: values[i] for name, values in hidden.items()})
        for meta, _ in pending:
            # ensure_ascii writes lone surrogates as \udcXX escapes, which parse back unchanged
            out.write(json.dumps(meta, ensure_ascii=True) + "\n")
        pending.clear()

    with open(rows_path, "w", encoding="utf-8") as out:
        for url in files:
            on_error = lambda reason, detail: errors.append(f"{reason}: {detail}")  # noqa: E731
            for sample in read_samples(url, on_error=on_error, max_member_bytes=max_bytes):
                meta: Any = {}
                if METADATA_MEMBER in sample:
                    try:
                        meta = json.loads(sample[METADATA_MEMBER].decode("utf-8", "surrogateescape"))
                    except ValueError:
                        meta = None
                if not isinstance(meta, dict):
                    malformed += 1
                    errors.append(f"bad_json: {sample.get('__url__', url)}:{sample.get('__key__')}")
                    continue
                if CAPTION_MEMBER in sample and not any(c in meta for c in (text_name, *TEXT_COLUMN_CANDIDATES)):
                    meta[text_name] = sample[CAPTION_MEMBER].decode("utf-8", "surrogateescape")
                meta.setdefault(columns.key, sample["__key__"])
                member = image_member(sample)
                pending.append((meta, sample[member] if member is not None else None))
                origins.append(f"{sample.get('__url__', url)}:{sample['__key__']}")
                if len(pending) >= 256:
                    flush(out)
        flush(out)
    if rows_path.stat().st_size == 0:
        raise ValueError(f"no readable samples in {len(files)} WebDataset shard(s): {'; '.join(errors[:3])}")
    staged = _stage_json([str(rows_path)], columns, work_dir / "json", "webdataset", origins=origins)
    staged.malformed += malformed
    if images is not None and images.tagger is None and not saw_tags:
        # No sample had tags and nothing tags them: the rule has nothing to read (the plan skips it).
        staged.hidden = [c for c in staged.hidden if c != TAG_WORDS_COLUMN]
    staged.input_errors = errors + staged.input_errors
    return staged


# --------------------------------------------------------------------------------------------------
# Output


def output_format(path: str | Path) -> str:
    """parquet, csv, tsv or jsonl, from the output file's extension."""
    ext = os.path.splitext(str(path).lower())[1]
    if ext not in OUTPUT_FORMATS:
        raise ValueError(f"cannot tell the output format of {path}; use .parquet, .csv, .tsv or .jsonl")
    return OUTPUT_FORMATS[ext]
