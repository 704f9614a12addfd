"""data/tables.py: strict CSV/TSV, where a stray quote costs one line and is named, never the rows after it."""

from __future__ import annotations

import csv
import gzip
import random
from pathlib import Path

import pytest

from openalign.data.tables import MalformedRow, clean_text, has_surrogates, infer_values, read_csv, read_csv_arrow

HEADER = "key,url,caption,width,height"


def crawl_lines(n: int, captions: dict[int, str] | None = None) -> list[str]:
    """A header and ``n`` rows written by hand (so that bad quoting stays bad); row i is on line i + 2."""
    captions = captions or {}
    rows = [f"{i:05d},http://x/{i}.jpg,{captions.get(i, f'a red car number {i}')},640,480" for i in range(n)]
    return [HEADER, *rows]


def write(path: Path, lines: list[str], end: str = "\n") -> Path:
    path.write_bytes((end.join(lines) + end).encode("utf-8"))
    return path


def read_all(path: Path, max_malformed: int = 0) -> tuple[list[str], list[list[str]], list[tuple[int, str]]]:
    malformed: list[tuple[int, str]] = []
    note = lambda n, why: malformed.append((n, why))  # noqa: E731
    header, records = read_csv(path, max_malformed=max_malformed, on_malformed=note)
    return header, list(records), malformed


def keys(records: list[list[str]]) -> list[str]:
    return [r[0] for r in records]


def test_an_unclosed_quote_is_named_by_its_line_not_read_as_one_long_row(tmp_path: Path) -> None:
    src = write(tmp_path / "a.csv", crawl_lines(300, {4: '"a stray quote opens here'}))
    with pytest.raises(MalformedRow, match=r"a\.csv: line 6: a quoted value opened on this line is never closed"):
        read_all(src)
    # Allowed, it costs its own line only: the 299 rows after and before it are all read.
    header, records, malformed = read_all(src, max_malformed=1)
    assert header == HEADER.split(",")
    assert keys(records) == [f"{i:05d}" for i in range(300) if i != 4]
    assert [n for n, _ in malformed] == [6]


def test_text_after_a_closing_quote_names_the_record_and_the_line_it_reached(tmp_path: Path) -> None:
    # The stray quote at row 5 runs on to the next quote, the opening one of row 8's quoted caption.
    src = write(tmp_path / "a.csv", crawl_lines(20, {4: '"a stray quote', 7: '"a quoted, caption"'}))
    with pytest.raises(MalformedRow, match=r"line 6: text after a closing quote on line 9 where ','"):
        read_all(src)
    _, records, malformed = read_all(src, max_malformed=1)
    assert len(records) == 19 and malformed[0][0] == 6
    assert records[6] == ["00007", "http://x/7.jpg", "a quoted, caption", "640", "480"]


def test_two_bad_quotes_that_close_each_other_do_not_hide_the_rows_between(tmp_path: Path) -> None:
    # Row 5 opens a quote; row 200's unquoted inch mark, just before a comma, closes it. The record between
    # is well formed, but every one of its lines is a whole row.
    src = write(tmp_path / "a.csv", crawl_lines(300, {4: '"a stray quote', 199: 'a vinyl record 12"'}))
    with pytest.raises(MalformedRow, match=r"line 6: a quoted value runs from this line to line 201, and each of"):
        read_all(src)
    _, records, malformed = read_all(src, max_malformed=1)
    assert keys(records) == [f"{i:05d}" for i in range(300) if i != 4]
    assert records[198][2] == 'a vinyl record 12"' and [n for n, _ in malformed] == [6]


def test_wrong_field_counts_are_malformed_and_the_allowance_is_a_ceiling(tmp_path: Path) -> None:
    lines = crawl_lines(10)
    lines[3] = "00002,http://x/2.jpg,too,many,fields,here"
    lines[8] = "00007,http://x/7.jpg,640"
    src = write(tmp_path / "a.csv", lines)
    with pytest.raises(MalformedRow, match=r"line 4: 6 fields where the header has 5$"):
        read_all(src)
    with pytest.raises(MalformedRow, match=r"line 9: 3 fields where the header has 5 \(malformed row 2; 1 allowed\)"):
        read_all(src, max_malformed=1)
    _, records, malformed = read_all(src, max_malformed=2)
    assert keys(records) == [f"{i:05d}" for i in range(10) if i not in (2, 7)]
    assert malformed == [(4, "6 fields where the header has 5"), (9, "3 fields where the header has 5")]


def test_quoted_delimiters_newlines_and_quotes_read_every_row(tmp_path: Path) -> None:
    captions = [
        "a red car, parked outside",
        "two lines:\nthe second, with a comma",
        "three\nlines\nhere",
        'she said "hello", then left',
        'a 5" screen',
        'ends in a quote 12"',
        "",
        "tab\tinside",
    ]
    rows = [[f"{i:05d}", f"http://x/{i}.jpg", captions[i % len(captions)], "640", "480"] for i in range(300)]
    for delimiter, name in ((",", "a.csv"), ("\t", "a.tsv")):
        path = tmp_path / name
        with open(path, "w", newline="") as f:
            writer = csv.writer(f, delimiter=delimiter, lineterminator="\r\n")
            writer.writerow(HEADER.split(","))
            writer.writerows(rows)
        header, records, malformed = read_all(path)
        assert header == HEADER.split(",") and records == rows and malformed == [], name
    # What writers leave unquoted is read as written: an inch mark inside a value, and blank lines.
    lines = crawl_lines(3, {1: 'a 5" screen on a desk'})
    src = write(tmp_path / "loose.csv", [lines[0], lines[1], "", lines[2], lines[3], ""])
    _, records, _ = read_all(src)
    assert keys(records) == ["00000", "00001", "00002"] and records[1][2] == 'a 5" screen on a desk'


def test_header_bom_gzip_and_bad_headers(tmp_path: Path) -> None:
    src = tmp_path / "a.csv.gz"
    src.write_bytes(gzip.compress(("\ufeff" + "\n".join(crawl_lines(3, {1: '"a stray'})) + "\n").encode()))
    header, records, malformed = read_all(src, max_malformed=1)
    assert header[0] == "key" and keys(records) == ["00000", "00002"] and [n for n, _ in malformed] == [3]
    for text, message in (
        ("", "no header"),
        ("key,,caption\n1,2,3\n", "naming every column"),
        ("key,key\n1,2\n", "duplicate column names"),
        ('key,"cap\n1,2\n', "line 1: a quoted value opened on this line is never closed"),
    ):
        with pytest.raises(ValueError, match=message):
            read_csv(write(tmp_path / "h.csv", [text], end=""))


def test_undecodable_bytes_survive_to_be_judged(tmp_path: Path) -> None:
    src = tmp_path / "a.csv"
    src.write_bytes(b"key,caption\n1,caf\xe9 latte\n2,caf\xc3\xa9 latte\n")
    _, records, _ = read_all(src)
    assert [has_surrogates(r[1]) for r in records] == [True, False]
    assert clean_text(records[0][1]) == "caf\ufffd latte" and clean_text(records[1][1]) == "café latte"


def test_infer_values_types_a_column_only_when_every_value_agrees() -> None:
    assert infer_values(["1", "", "-3"]) == [1, None, -3]
    assert infer_values(["1", "2.5", ""]) == [1.0, 2.5, None]
    assert infer_values(["1", "n/a"]) == ["1", "n/a"]
    assert infer_values(["1_000"]) == ["1_000"]
    assert infer_values(["", ""]) == [None, None]


# --------------------------------------------------------------------------------------------------
# The pyarrow fast path: taken only where it reads what the strict reader reads


def _fast(path: Path) -> tuple[list[str], list[list[str]]] | None:
    fast = read_csv_arrow(path, batch_rows=7)
    if fast is None:
        return None
    header, batches = fast
    rows = [list(r.values()) for b in batches for r in b.to_pylist()]
    return header, rows


@pytest.mark.parametrize("seed", range(6))
def test_the_fast_path_reads_what_the_strict_reader_reads_or_stands_aside(tmp_path: Path, seed: int) -> None:
    """Random files of rows from a pool of tricky values, some written correctly, some with a stray quote, a
    field too many, a line break in a quoted value, bytes that are not UTF-8 or CRLF line ends. Whenever
    read_csv_arrow takes a file its rows are the strict reader's; a file with anything malformed (which the
    strict reader names or skips) or a record over two lines is left to the strict reader."""
    rng = random.Random(seed)
    good = ["plain", 'a 5" screen', '"quoted, comma"', '"a ""quote"" inside"', '""', "", " spaced ", "é ü 日本"]
    bad = ['"unclosed', '"closed" then text', "one,too many", '"line\nbreak"', "bad \xff byte"]
    taken = 0
    for trial in range(40):
        end = rng.choice(["\n", "\r\n"])
        lines = ["key,caption,n"]
        broken = False
        for i in range(rng.randint(0, 30)):
            value = rng.choice(bad if rng.random() < 0.05 else good)
            broken = broken or value in bad
            lines.append(f"{i},{value},{i * 3}")
            if rng.random() < 0.05:
                lines.append("")
        path = tmp_path / f"{trial}.csv"
        path.write_bytes(end.join(lines).encode("utf-8", "surrogateescape").replace("\xff".encode(), b"\xff") + b"\n")
        fast = _fast(path)
        if broken:
            assert fast is None, lines
            continue
        header, records, malformed = read_all(path)
        assert malformed == []
        assert fast == (header, records), lines
        taken += 1
    assert taken > 10


def test_the_fast_path_is_what_filter_takes_for_a_clean_file_and_gzip(tmp_path: Path) -> None:
    src = write(tmp_path / "a.csv", crawl_lines(50, {3: '"a, quoted, caption"', 7: 'a 5" screen'}))
    fast = _fast(src)
    assert fast is not None and fast == read_all(src)[:2]
    with gzip.open(tmp_path / "a.csv.gz", "wb") as f:
        f.write(src.read_bytes())
    assert _fast(tmp_path / "a.csv.gz") == fast
    # A BOM, blank lines before the header, a line longer than a block: left to the strict reader, or read whole.
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf" + src.read_bytes())
    assert _fast(tmp_path / "bom.csv") is None
    (tmp_path / "blank.csv").write_bytes(b"\n" + src.read_bytes())
    assert _fast(tmp_path / "blank.csv") is None
    long = write(tmp_path / "long.csv", crawl_lines(3, {1: "x" * (9 * 2**20)}))
    fast_long = _fast(long)
    assert fast_long is not None and fast_long[1][1][2] == "x" * (9 * 2**20)


def test_a_line_without_an_end_is_an_error_naming_it_not_all_memory(tmp_path: Path, monkeypatch) -> None:
    import openalign.data.tables as tables

    monkeypatch.setattr(tables, "MAX_LINE_CHARS", 1000)
    src = write(tmp_path / "a.csv", crawl_lines(3, {1: "y" * 5000}))
    assert read_csv_arrow(src) is None
    with pytest.raises(ValueError, match=r"line 3 is longer than 1000 characters"):
        read_all(src)
