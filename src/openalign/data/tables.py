"""Strict CSV/TSV reading: every record is accounted for, and a bad one is named by its line.

A parser that is lenient about quotes lets one stray ``"`` open a quoted value that runs on to the next
quote, or to the end of the file; the rows in between become one malformed row, and dropping that row
drops them all without a word. Here RFC 4180's quoting is held strictly (a quoted value ends at a quote
followed by the delimiter or a line end, and closes before the file ends), and a record must have as
many fields as the header. One stray quote therefore always breaks a rule, unless a second bad quote
(``12"`` just before a delimiter or a line end, which writers often leave unquoted) happens to close the
value it opened. The record is then well formed, but it spans lines that each read, quotes taken as
plain characters, as a whole row of their own; with three lines or more (a whole row swallowed between
the two quotes) it is taken for a stray quote as well. Two such quotes on adjacent lines still join
those two rows into one, and a genuine value of three lines or more is refused when every one of its
lines holds exactly as many delimiters as a row does: both are rare, and the second is named.

A record that breaks a rule is *malformed*. It costs its first physical line only: reading starts again
on the line after it, so the rows after a stray quote are read as rows. A reader allows
``max_malformed`` of them, each reported with its line number, and stops at the next with a one-line
error naming its line.

Most files have no record spanning lines and no bad byte; ``read_csv_arrow`` checks that in one quick pass
over the raw lines (a line with a quote must read here, on its own, as one whole record) and then lets
pyarrow's CSV reader parse them, which on such lines gives exactly the values read here. Any other file is
read by the strict reader, record by record.

A line longer than ``MAX_LINE_CHARS`` is an error naming it (a file of one endless line, such as a sparse
or binary file named ``.csv``, would otherwise be read whole to find its end).

A quote inside an unquoted value (``a 5" screen``) is kept as a character, as every common writer does,
and blank lines are not records. Values come back as ``str``; bytes that are not UTF-8 survive as lone
surrogates (``surrogateescape``), so a caller can tell an undecodable value from a decoded one
(``has_surrogates``) and decide whether it costs the row or only the bad characters (``clean_text``).
"""

from __future__ import annotations

import csv
import gzip
import itertools
import operator
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

MalformedHandler = Callable[[int, str], None]  # (line number, why)


class MalformedRow(ValueError):
    """A malformed record past the reader's allowance; the message names the file and the line."""

    def __init__(self, message: str, line: int):
        super().__init__(message)
        self.line = line


# Python's csv stops a value at this many characters; a runaway quoted value meets it first.
_FIELD_LIMIT = csv.field_size_limit()
MAX_LINE_CHARS = 64 * 2**20
_INT = re.compile(r"^[+-]?\d+$")


def csv_delimiter(path: str | Path) -> str:
    """Tab for ``.tsv`` (and ``.tsv.gz``), comma otherwise."""
    name = Path(path).name.lower().removesuffix(".gz")
    return "\t" if name.endswith(".tsv") else ","


def _explain(message: str, first: int, last: int, delimiter: str) -> str:
    """What a csv.Error means for a record read from line ``first`` to line ``last``."""
    if "unexpected end of data" in message:
        return "a quoted value opened on this line is never closed (a stray '\"'?)"
    if "expected after" in message:
        where = "" if last == first else f" on line {last}"
        return f"text after a closing quote{where} where {delimiter!r} or a line end should be (a stray '\"'?)"
    if "field larger than field limit" in message:
        return f"a quoted value runs past {_FIELD_LIMIT} characters (a stray '\"'?)"
    return " ".join(message.split())


def _rows_in_disguise(lines: list[str], first: int, delimiter: str, width: int) -> str | None:
    """Why a well-formed record spanning three lines or more looks like rows joined by two stray quotes, or None."""
    if len(lines) < 3:
        return None
    for line in lines:
        if len(next(csv.reader([line], delimiter=delimiter, quoting=csv.QUOTE_NONE), [])) != width:
            return None
    return (
        f"a quoted value runs from this line to line {first + len(lines) - 1}, and each of those {len(lines)} "
        "lines reads as a whole row on its own (a stray '\"'?)"
    )


def _bounded_lines(fh: IO[str], path: Path) -> Iterator[str]:
    """The file's lines, each read with a limit, so that a line without an end is an error, not all memory."""
    number = 0
    while line := fh.readline(MAX_LINE_CHARS):
        number += 1
        if len(line) == MAX_LINE_CHARS and not line.endswith(("\n", "\r")):
            raise ValueError(f"{path}: line {number} is longer than {MAX_LINE_CHARS} characters (not a CSV file?)")
        yield line


def _open(path: Path) -> IO[str]:
    # Undecodable bytes become lone surrogates; newline="" leaves line ends to the csv reader.
    if path.suffix.lower() == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", errors="surrogateescape", newline="")
    return open(path, encoding="utf-8", errors="surrogateescape", newline="")


class _Reader:
    """csv's reader over a file's lines, with each record's lines at hand (a record's quoted values are
    bounded by the field limit, so they are few) and a way to read on from the line after a record's first.

    ``shadow`` trails the csv reader's copy of the lines, so the lines a record took are the ones the
    shadow has not given yet: a one-line record costs one step of a C iterator, not a Python call per line.
    """

    def __init__(self, lines: Iterator[str], delimiter: str, before: int):
        source, self._shadow = itertools.tee(lines)
        self._source = source
        self._csv = csv.reader(source, delimiter=delimiter, strict=True)
        self._delimiter = delimiter
        self._before = before  # lines of the file before the first one given here
        self._done = 0  # lines given here that belong to records already read

    def next(self) -> tuple[list[str], str | None, int, list[str] | None] | None:
        """(fields, why it is malformed or None, its first line, its lines when more than one), or None at
        the end. A record that breaks quoting comes back with no fields and the reason."""
        why = None
        try:
            fields = next(self._csv)
        except StopIteration:
            return None
        except csv.Error as err:
            fields, why = [], str(err)
        taken, first = self._csv.line_num - self._done, self._before + self._done + 1
        self._done = self._csv.line_num
        if taken == 1:
            next(self._shadow)
            lines = None
        else:
            lines = list(itertools.islice(self._shadow, taken))
        if why is not None:
            why = _explain(why, first, first + taken - 1, self._delimiter)
        return fields, why, first, lines

    def after_first_line(self, first: int, lines: list[str]) -> _Reader:
        """A reader that goes on from the line after ``first``, a record's first line."""
        return _Reader(itertools.chain(lines[1:], self._source), self._delimiter, first)


def _records(
    path: Path, delimiter: str, max_malformed: int, on_malformed: MalformedHandler | None
) -> Iterator[list[str]]:
    """The header, then every well-formed record (see the module docstring)."""
    with _open(path) as fh:
        reader = _Reader(_bounded_lines(fh, path), delimiter, 0)
        header: list[str] | None = None
        malformed = 0
        while (record := reader.next()) is not None:
            fields, why, first, lines = record
            if why is None and not fields:
                continue  # a blank line
            if header is None:
                if why is not None:
                    raise ValueError(f"{path}: line {first}: {why}")
                header = _check_header(path, fields)
                yield header
                continue
            if why is None and len(fields) != len(header):
                why = f"{len(fields)} fields where the header has {len(header)}"
            if why is None and lines is not None:
                why = _rows_in_disguise(lines, first, delimiter, len(header))
            if why is None:
                yield fields
                continue
            malformed += 1
            if malformed > max_malformed:
                allowed = f" (malformed row {malformed}; {max_malformed} allowed)" if max_malformed else ""
                raise MalformedRow(f"{path}: line {first}: {why}{allowed}", first)
            if on_malformed is not None:
                on_malformed(first, why)
            if lines is not None:  # the lines after its first are read again, as the rows they may be
                reader = reader.after_first_line(first, lines)
        if header is None:
            raise ValueError(f"{path}: no header; the first line must name every column")


def _check_header(path: Path, names: list[str]) -> list[str]:
    names = [names[0].lstrip("\ufeff"), *names[1:]]
    if any(n.strip() == "" for n in names):
        raise ValueError(f"{path}: the first line must be a header naming every column; got {names}")
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: duplicate column names in the header: {', '.join(names)}")
    return names


def read_csv(
    path: str | Path,
    *,
    delimiter: str | None = None,
    max_malformed: int = 0,
    on_malformed: MalformedHandler | None = None,
) -> tuple[list[str], Iterator[list[str]]]:
    """The header of a CSV/TSV file (optionally gzip-compressed) and an iterator over its records.

    Every record has as many fields as the header. Up to ``max_malformed`` malformed records are
    skipped, each passed to ``on_malformed(line, why)``; the next one raises ``MalformedRow`` (a
    ``ValueError``) naming its line. A missing or bad header raises here, before the first record.
    """
    if max_malformed < 0:
        raise ValueError(f"max_malformed must be ≥ 0, got {max_malformed}")
    p = Path(path)
    records = _records(p, delimiter or csv_delimiter(p), max_malformed, on_malformed)
    header = next(records)
    return header, records


def _one_line_records(path: Path, delimiter: str) -> tuple[list[str], int] | None:
    """The header and the longest line's length when every record of the file is one line of valid UTF-8
    that pyarrow's parser reads as ``read_csv`` does, else None.

    A line without a quote splits at each delimiter under either parser, so it needs the header's number of
    them; a line with one must read strictly, on its own, as one record of the header's width (so no quoted
    value spans lines and no quote is stray). Blank lines before the header, a byte-order mark or a lone
    ``\\r`` send the file to the strict reader. The file is looked at in blocks, and only lines holding a
    quote one at a time."""
    opener = gzip.open if path.suffix.lower() == ".gz" else open
    header: list[str] | None = None
    width = longest = 0
    sep, quote = delimiter.encode(), b'"'
    carry = b""
    with opener(path, "rb") as fh:
        while True:
            chunk = fh.read(8 * 2**20)
            data = carry + chunk
            if chunk:
                cut = data.rfind(b"\n") + 1
                data, carry = data[:cut], data[cut:]
                if len(carry) > MAX_LINE_CHARS:
                    return None
                if not data:
                    continue
            elif not data:
                break
            else:
                carry = b""
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                return None
            if data.count(b"\r") != data.count(b"\r\n"):
                return None
            lines = data.split(b"\n")
            if data.endswith(b"\n"):
                lines.pop()
            longest = max(longest, max(map(len, lines)) + 1)
            if longest > MAX_LINE_CHARS:
                return None
            if header is None:
                first = lines.pop(0).removesuffix(b"\r")
                if not first or first.startswith(b"\xef\xbb\xbf"):
                    return None
                try:
                    rows = list(csv.reader([first.decode("utf-8")], delimiter=delimiter, strict=True))
                except csv.Error:
                    return None
                if len(rows) != 1:
                    return None
                header = _check_header(path, rows[0])
                width = len(header)
            # Per line with C-level maps: which lines hold a quote, and how many delimiters the others hold.
            has_quote = list(map(bytes.__contains__, lines, itertools.repeat(quote))) if quote in data else None
            quoted = list(itertools.compress(lines, has_quote)) if has_quote else []
            plain = list(itertools.compress(lines, map(operator.not_, has_quote))) if quoted and has_quote else lines
            counts = set(map(bytes.count, plain, itertools.repeat(sep)))
            if counts - {width - 1} and any(
                line.count(sep) != width - 1 and line not in (b"", b"\r") for line in plain
            ):
                return None
            for line in quoted:
                try:
                    rows = list(
                        csv.reader([line.removesuffix(b"\r").decode("utf-8")], delimiter=delimiter, strict=True)
                    )
                except csv.Error:
                    return None
                if len(rows) != 1 or len(rows[0]) != width:
                    return None
            if not chunk:
                break
    return None if header is None else (header, longest)


def read_csv_arrow(path: str | Path, *, delimiter: str | None = None, batch_rows: int = 65_536) -> Any:
    """``(header, batches)`` of Arrow record batches of strings when every record of a CSV/TSV file is one
    well-formed line of UTF-8 (see the module docstring), read by pyarrow's streaming CSV reader; None for any
    other file, which ``read_csv`` reads strictly and names the line of each malformed record."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    p = Path(path)
    delim = delimiter or csv_delimiter(p)
    checked = _one_line_records(p, delim)
    if checked is None:
        return None
    header, longest = checked
    # pyarrow parses a block at a time, and a block must hold a whole line.
    block = max(8 * 2**20, 2 * longest + 2)
    reader = pacsv.open_csv(
        str(p),  # a path string: pyarrow then reads the file itself (a .gz decompressed), not through Python
        read_options=pacsv.ReadOptions(column_names=header, skip_rows=1, block_size=block, use_threads=True),
        parse_options=pacsv.ParseOptions(delimiter=delim, newlines_in_values=False, ignore_empty_lines=True),
        convert_options=pacsv.ConvertOptions(
            column_types=dict.fromkeys(header, pa.string()), strings_can_be_null=False, quoted_strings_can_be_null=False
        ),
    )

    def batches() -> Iterator[Any]:
        with reader:
            for batch in reader:
                for start in range(0, batch.num_rows, batch_rows):
                    yield batch.slice(start, batch_rows)

    return header, batches()


def has_surrogates(value: str) -> bool:
    """Whether a value read here held bytes that are not UTF-8."""
    if value.isascii():
        return False
    try:
        value.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def undecodable(values: Sequence[str]) -> list[bool] | None:
    """Which values held bytes that are not UTF-8, or None when none did (one check for the lot)."""
    joined = "".join(values)
    if not has_surrogates(joined):
        return None
    return [has_surrogates(v) for v in values]


def clean_text(value: str) -> str:
    """The value with every undecodable byte replaced by U+FFFD."""
    if not has_surrogates(value):
        return value
    return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def infer_values(values: list[str]) -> list[Any]:
    """A CSV column's values as ints when every non-empty one is an integer, else floats when every one is a
    number, else the strings themselves; an empty value of a numeric column is None."""
    present = [v for v in values if v != ""]
    if not present:
        return [None] * len(values)
    if all(_INT.match(v) for v in present) and all(-(2**63) <= int(v) < 2**63 for v in present):
        return [int(v) if v != "" else None for v in values]
    try:
        if not any("_" in v for v in present):
            return [float(v) if v != "" else None for v in values]
    except ValueError:
        pass
    return values


def text_type_error(column: str, kind: Any) -> str | None:
    """Why a column of Arrow type ``kind`` cannot be a text column, or None when it can (strings, bytes,
    dictionary-encoded strings, or an all-null column)."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    textual = (
        pa.types.is_string,
        pa.types.is_large_string,
        pa.types.is_binary,
        pa.types.is_large_binary,
        pa.types.is_null,
    )
    views = [getattr(pa.types, name) for name in ("is_string_view", "is_binary_view") if hasattr(pa.types, name)]
    if any(test(kind) for test in (*textual, *views)):
        return None
    return f"column '{column}' holds {kind}, not text"
