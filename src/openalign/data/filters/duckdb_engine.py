"""The filter rules on DuckDB: embedded, multi-threaded, and spilling to disk for corpora bigger than memory.

The run is a handful of SQL statements over temporary tables: one row of derived columns per input row
(validity, sizes, image identity, normalised alt-text), corpus statistics grouped by image and by
distinct alt-text, n-gram counts over the distinct alt-texts weighted by how many rows carry them (web
alt-text repeats a lot, so this does the expensive tokenisation once per distinct text), and finally one
``reason`` per row: the first rule that rejects it, or NULL for a survivor.
"""

from __future__ import annotations

import os
import resource
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openalign.data.filters.inputs import ROW_ID_COLUMN, TEXT_ERROR_COLUMN, StagedInput
from openalign.data.filters.person import PersonHook
from openalign.data.filters.plan import EngineResult, FilterPlan
from openalign.data.filters.rules import PUNCTUATION, frequent_threshold

# RE2 syntax. Normalising with two regex passes instead of split/strip/join on lists is ~4x faster and
# gives the same string as " ".join(rules.tokenize(text)) (tested): a separator is a whitespace run with
# the punctuation touching it (and punctuation-only words between), then punctuation at the text's ends.
_PUNCT_CLASS = "[" + "".join("\\" + c for c in PUNCTUATION) + "]"
_WS_CLASS = r"[\t\n\x0B\f\r ]"
SEPARATOR_PATTERN = f"{_PUNCT_CLASS}*(?:{_WS_CLASS}+{_PUNCT_CLASS}*)+"
EDGE_PATTERN = f"^{_PUNCT_CLASS}+|{_PUNCT_CLASS}+$"
_WHITESPACE_SQL = "(' ' || chr(9) || chr(10) || chr(11) || chr(12) || chr(13))"


@dataclass
class DuckDBSettings:
    threads: int | None = None  # default: all cores
    memory_limit: str | None = None  # e.g. "8GB"; past it DuckDB spills to temp_directory
    temp_directory: str | None = None  # default: the run's work directory


def quote(name: str) -> str:
    """A DuckDB identifier."""
    return '"' + name.replace('"', '""') + '"'


def literal(value: str) -> str:
    """A DuckDB string literal (standard SQL: only the quote is special)."""
    return "'" + value.replace("'", "''") + "'"


def norm_sql(text_sql: str) -> str:
    """The normalised alt-text (its words joined by single spaces, see rules.tokenize) as a DuckDB expression."""
    spaced = f"regexp_replace(lower({text_sql}), {literal(SEPARATOR_PATTERN)}, ' ', 'g')"
    return f"trim(regexp_replace({spaced}, {literal(EDGE_PATTERN)}, '', 'g'), ' ')"


def _identity_sql(plan: FilterPlan) -> str:
    parts = [f"{literal(prefix)} || nullif(CAST({quote(col)} AS VARCHAR), '')" for prefix, col in plan.identity]
    parts.append(f"'row:' || CAST({ROW_ID_COLUMN} AS VARCHAR)")
    return f"coalesce({', '.join(parts)})"


def _invalid_sql(plan: FilterPlan) -> str:
    """The first validity problem of a row (columns of the inner select in ``_run``), or NULL."""
    cases = []
    if plan.has_text_error_column:
        cases.append("WHEN text_error IS NOT NULL THEN text_error")
    cases.append("WHEN txt IS NULL THEN 'missing_text'")
    cases.append(f"WHEN trim(txt, {_WHITESPACE_SQL}) = '' THEN 'empty_text'")
    if plan.width is not None:
        ok = "isfinite(w) AND w > 0 AND isfinite(h) AND h > 0"
        cases.append(f"WHEN NOT coalesce({ok}, false) THEN 'bad_size'")
    if plan.unsafe is not None:
        cases.append("WHEN u_given AND coalesce(isnan(u), true) THEN 'bad_unsafe_score'")
    return "CASE " + " ".join(cases) + " END"


def _reason_sql(plan: FilterPlan) -> str:
    r = plan.rules
    cases = []
    if plan.unsafe is not None:
        cases.append(f"WHEN r.u > {float(r.max_unsafe)!r} THEN 'unsafe'")  # type: ignore[arg-type]
    if r.min_shorter_side is not None:
        cases.append(f"WHEN least(r.w, r.h) <= {int(r.min_shorter_side)} THEN 'small_image'")
    if r.max_aspect_ratio is not None:
        op = ">" if r.aspect_ratio_inclusive else ">="
        ratio = "greatest(r.w, r.h) / least(r.w, r.h)"
        cases.append(f"WHEN {ratio} {op} {float(r.max_aspect_ratio)!r} THEN 'aspect_ratio'")
    if r.max_texts_per_image is not None:
        cases.append(f"WHEN i.n_texts > {int(r.max_texts_per_image)} THEN 'image_text_count'")
    if r.max_images_per_text is not None:
        cases.append(f"WHEN t.n_images > {int(r.max_images_per_text)} THEN 'shared_text'")
    if r.vocab_top_k is not None:
        cases.append("WHEN t.rare_ngram THEN 'rare_ngram'")
    if r.min_word_count is not None:
        cases.append("WHEN t.rare_word THEN 'rare_word'")
    if r.min_words is not None:
        cases.append(f"WHEN t.n_words < {int(r.min_words)} THEN 'too_few_words'")
    if r.max_words is not None:
        cases.append(f"WHEN t.n_words > {int(r.max_words)} THEN 'too_many_words'")
    if r.max_repeated_fraction is not None:
        cases.append(f"WHEN t.repeated > {float(r.max_repeated_fraction)!r} THEN 'repeated_words'")
    if not cases:
        return "NULL"
    return "CASE " + " ".join(cases) + " END"


def _rare_texts(
    ex: Callable[[str], Any], table: str, occurrences: str, counts: str, threshold: int, n_rare: int, n_all: int
) -> None:
    """Create ``table`` (tid) of the texts with an n-gram counted fewer than ``threshold`` times.

    The hash join builds on the smaller side: the rare n-grams (semi join) or the frequent ones (anti join).
    """
    if n_rare <= n_all - n_rare:
        join = f"SEMI JOIN (SELECT g FROM ({counts}) WHERE cnt < {threshold}) x ON o.g = x.g"
    else:
        join = f"ANTI JOIN (SELECT g FROM ({counts}) WHERE cnt >= {threshold}) x ON o.g = x.g"
    ex(f"CREATE TEMP TABLE {table} AS SELECT DISTINCT o.tid FROM ({occurrences}) o {join}")


def _copy_options(fmt: str) -> str:
    return {
        "parquet": "FORMAT parquet, COMPRESSION zstd",
        "csv": "FORMAT csv, HEADER true",
        "tsv": "FORMAT csv, HEADER true, DELIMITER '\t'",
        "jsonl": "FORMAT json",
    }[fmt]


def run_duckdb(
    staged: StagedInput,
    plan: FilterPlan,
    output: Path,
    out_format: str,
    work_dir: Path,
    settings: DuckDBSettings | None = None,
    person_hook: PersonHook | None = None,
    log: Callable[[str], None] | None = None,
) -> EngineResult:
    """Filter ``staged`` by ``plan`` and write the survivors, in input order, to ``output``."""
    import duckdb

    settings = settings or DuckDBSettings()
    con = duckdb.connect()
    try:
        return _run(con, staged, plan, output, out_format, work_dir, settings, person_hook, log)
    finally:
        con.close()


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _run(
    con: Any,
    staged: StagedInput,
    plan: FilterPlan,
    output: Path,
    out_format: str,
    work_dir: Path,
    settings: DuckDBSettings,
    person_hook: PersonHook | None,
    log: Callable[[str], None] | None,
) -> EngineResult:
    r = plan.rules

    def ex(sql: str) -> Any:
        start, cpu = time.perf_counter(), _cpu_seconds()
        result = con.execute(sql)
        head = sql.split(None, 4)
        if log is not None and head[0] in ("CREATE", "COPY"):
            what = "write output" if head[0] == "COPY" else f"table {head[3]}"
            log(f"duckdb: {what} {time.perf_counter() - start:.1f}s (cpu {_cpu_seconds() - cpu:.1f}s)")
        return result

    ex("SET enable_progress_bar = false")
    spill = Path(settings.temp_directory) if settings.temp_directory else work_dir / "duckdb_spill"
    spill.mkdir(parents=True, exist_ok=True)
    ex(f"SET temp_directory = {literal(str(spill))}")
    if settings.threads:
        ex(f"SET threads = {int(settings.threads)}")
    if settings.memory_limit:
        ex(f"SET memory_limit = {literal(settings.memory_limit)}")
    files = ", ".join(literal(str(p)) for p in staged.paths)
    ex(
        f"CREATE TEMP TABLE src AS SELECT *, (row_number() OVER ()) - 1 AS {ROW_ID_COLUMN} "
        f"FROM read_parquet([{files}], union_by_name = true)"
    )
    source_rows = ex("SELECT count(*) FROM src").fetchone()[0]

    inner = [f"{ROW_ID_COLUMN} AS rid", f"{_identity_sql(plan)} AS ident"]
    inner.append(f"CAST({quote(plan.text)} AS VARCHAR) AS txt")
    if plan.has_text_error_column:
        inner.append(f"{TEXT_ERROR_COLUMN} AS text_error")
    if plan.width is not None:
        inner += [f"try_cast({quote(plan.width)} AS DOUBLE) AS w", f"try_cast({quote(plan.height)} AS DOUBLE) AS h"]
    if plan.unsafe is not None:
        inner += [f"try_cast({quote(plan.unsafe)} AS DOUBLE) AS u", f"{quote(plan.unsafe)} IS NOT NULL AS u_given"]
    outer = ["rid", "ident", f"{norm_sql('txt')} AS norm", f"{_invalid_sql(plan)} AS invalid"]
    outer += [c for c, on in (("w", plan.width), ("h", plan.width), ("u", plan.unsafe)) if on is not None]
    ex(f"CREATE TEMP TABLE rows AS SELECT {', '.join(outer)} FROM (SELECT {', '.join(inner)} FROM src)")

    stats: dict[str, int] = {}
    # The raw corpus: every well-formed row, before any rule.
    ex("CREATE TEMP TABLE img AS SELECT ident, count(*) AS n_texts FROM rows WHERE invalid IS NULL GROUP BY ident")
    stats["distinct_images"] = ex("SELECT count(*) FROM img").fetchone()[0]
    n_images = "count(DISTINCT ident)" if r.max_images_per_text is not None else "0"
    ex(
        f"CREATE TEMP TABLE txt AS SELECT row_number() OVER () AS tid, norm, n_rows, n_images FROM ("
        f"SELECT norm, count(*) AS n_rows, {n_images} AS n_images FROM rows WHERE invalid IS NULL GROUP BY norm)"
    )
    stats["distinct_texts"] = ex("SELECT count(*) FROM txt").fetchone()[0]

    # Words come from splitting the normalised text on its single spaces; no tokeniser runs twice.
    words = "SELECT tid, n_rows, unnest(string_split(norm, ' ')) AS g FROM txt WHERE norm <> ''"
    pairs = "list_transform(range(1, len(w)), lambda i: w[i] || ' ' || w[i + 1])"
    bigrams = (
        f"SELECT tid, n_rows, unnest({pairs}) AS g FROM (SELECT tid, n_rows, string_split(norm, ' ') AS w FROM txt)"
    )
    flag_joins, flag_cols = [], []
    if r.vocab_top_k is not None or r.min_word_count is not None:
        ex(f"CREATE TEMP TABLE uni AS SELECT g, sum(n_rows) AS cnt FROM ({words}) GROUP BY g")
        stats["distinct_words"] = ex("SELECT count(*) FROM uni").fetchone()[0]
    if r.vocab_top_k is not None:
        grams, gram_tables = words, ["uni"]
        if r.rare_ngram_order == 2:
            ex(f"CREATE TEMP TABLE bi AS SELECT g, sum(n_rows) AS cnt FROM ({bigrams}) GROUP BY g")
            grams, gram_tables = f"{words} UNION ALL {bigrams}", ["uni", "bi"]
        union = " UNION ALL ".join(f"SELECT g, cnt FROM {t}" for t in gram_tables)
        hist = dict(ex(f"SELECT cnt, count(*) FROM ({union}) GROUP BY cnt").fetchall())
        threshold = frequent_threshold(hist, r.vocab_top_k)
        stats["distinct_ngrams"] = sum(hist.values())
        stats["frequent_min_count"] = threshold
        stats["rare_ngrams"] = sum(n for c, n in hist.items() if c < threshold)
        if stats["rare_ngrams"]:
            _rare_texts(ex, "rare_ngram_tid", grams, union, threshold, stats["rare_ngrams"], stats["distinct_ngrams"])
            flag_joins.append("LEFT JOIN rare_ngram_tid rn ON rn.tid = t.tid")
            flag_cols.append("rn.tid IS NOT NULL AS rare_ngram")
    if r.min_word_count is not None:
        limit = int(r.min_word_count)
        stats["rare_words"] = ex(f"SELECT count(*) FROM uni WHERE cnt < {limit}").fetchone()[0]
        if stats["rare_words"]:
            _rare_texts(
                ex,
                "rare_word_tid",
                words,
                "SELECT g, cnt FROM uni",
                limit,
                stats["rare_words"],
                stats["distinct_words"],
            )
            flag_joins.append("LEFT JOIN rare_word_tid rw ON rw.tid = t.tid")
            flag_cols.append("rw.tid IS NOT NULL AS rare_word")
    for name in ("rare_ngram", "rare_word"):
        if not any(c.endswith(f" AS {name}") for c in flag_cols):
            flag_cols.append(f"false AS {name}")
    n_words = "CASE WHEN t.norm = '' THEN 0 ELSE length(t.norm) - length(replace(t.norm, ' ', '')) + 1 END"
    repeated = "0.0"
    if r.max_repeated_fraction is not None:
        distinct = "len(list_distinct(string_split(t.norm, ' ')))"
        repeated = f"CASE WHEN t.norm = '' THEN 0.0 ELSE ({n_words} - {distinct}) / ({n_words}) END"
    ex(
        f"CREATE TEMP TABLE txtflags AS SELECT t.norm, t.n_images, {n_words} AS n_words, {repeated} AS repeated, "
        f"{', '.join(flag_cols)} FROM txt t {' '.join(flag_joins)}"
    )
    ex(
        f"CREATE TEMP TABLE decisions AS SELECT r.rid, coalesce(r.invalid, {_reason_sql(plan)}) AS reason "
        f"FROM rows r LEFT JOIN img i ON r.ident = i.ident LEFT JOIN txtflags t ON r.norm = t.norm"
    )
    removed_sql = "SELECT reason, count(*) FROM decisions WHERE reason IS NOT NULL GROUP BY reason"
    removed = dict(ex(removed_sql).fetchall())

    columns = []
    for name in staged.columns:
        if name == plan.text and person_hook is not None:
            columns.append(f"oa_person(CAST({quote(name)} AS VARCHAR)) AS {quote(name)}")
        else:
            columns.append(quote(name))
    if person_hook is not None:
        con.create_function("oa_person", person_hook, ["VARCHAR"], "VARCHAR")
    partial = output.with_name(output.name + ".partial")
    written = ex(
        f"COPY (SELECT {', '.join(columns)} FROM src WHERE {ROW_ID_COLUMN} IN "
        f"(SELECT rid FROM decisions WHERE reason IS NULL) ORDER BY {ROW_ID_COLUMN}) "
        f"TO {literal(str(partial))} ({_copy_options(out_format)})"
    ).fetchone()[0]
    if output.is_dir():
        shutil.rmtree(output)
    os.replace(partial, output)
    return EngineResult(source_rows=source_rows, removed=removed, rows_written=written, stats=stats)
