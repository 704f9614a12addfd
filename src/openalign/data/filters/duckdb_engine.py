"""The filter rules on DuckDB: embedded, multi-threaded, and spilling to disk for corpora bigger than memory.

The run is a handful of SQL statements over temporary tables: one row of derived columns per input row
(validity, sizes, image identity, normalised alt-text), corpus statistics grouped by image and by
distinct alt-text, n-gram counts over the distinct alt-texts weighted by how many rows carry them (web
alt-text repeats a lot, so this does the expensive tokenisation once per distinct text), and finally one
``reason`` per row: the first rule that rejects it, or NULL for a survivor.

Most of the time goes into hashing strings, so the plan hashes as few as it can. Alt-texts that are already
normal skip the rewriting regex. Each word is paired with its successor and the pairs are counted in one
pass, giving the bigram counts and the word counts together, without building a string per bigram. A
rare n-gram found in a single distinct text names that text directly, so only the other texts are read
again to find the rest. Distinct images are only counted for alt-texts on more rows than the limit, and
the per-row joins build on the few images and alt-texts that some rule rejects.
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
from openalign.data.filters.plan import EngineResult, FilterPlan
from openalign.data.filters.rules import PUNCTUATION, frequent_threshold, pair_pattern, segment_patterns

# RE2 syntax. The words of rules.tokenize are separated by maximal runs of punctuation and whitespace that
# contain whitespace, and the text's ends by the runs touching them. One pass turns every such run into a
# single space and a second, cheap one drops the spaces left at the ends. The first pattern skips runs that
# already are a single space: those are most separators, and a match costs far more than scanning past one.
_PUNCT = "".join("\\" + c for c in PUNCTUATION)
_WS = r"\t\n\x0B\f\r "
_RUN = f"[{_PUNCT}{_WS}]"
SEPARATOR_PATTERN = f"^{_RUN}+|{_RUN}+$|{_RUN}+[{_WS}]{_RUN}*|[{_WS}]{_RUN}+|[\\t\\n\\x0B\\f\\r]"
NOT_WHITESPACE_PATTERN = f"[^{_WS}]"


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


def segment_sql(text_sql: str) -> str:
    """rules.segment as a DuckDB expression: scripts written without spaces set apart character by character."""
    touched, unit, seps = (literal(p) for p in segment_patterns("re2"))
    spaced = f"regexp_replace(regexp_replace({text_sql}, {seps}, ' ', 'g'), {unit}, ' \\0 ', 'g')"
    return f"CASE WHEN regexp_matches({text_sql}, {touched}) THEN {spaced} ELSE {text_sql} END"


def paired_sql(norm: str) -> str:
    """rules.paired_words over a normalised alt-text, as a DuckDB expression giving their join by spaces."""
    touched = literal(segment_patterns("re2")[0])
    paired = f"regexp_replace({norm}, {literal(pair_pattern('re2'))}, '\\1\\2', 'g')"
    return f"CASE WHEN regexp_matches({norm}, {touched}) THEN {paired} ELSE {norm} END"


def norm_sql(text_sql: str) -> str:
    """The normalised alt-text (its words joined by single spaces, see rules.tokenize) as a DuckDB expression."""
    low, sep = segment_sql(f"lower({text_sql})"), literal(SEPARATOR_PATTERN)
    spaced = f"regexp_replace({low}, {sep}, ' ', 'g')"
    # Most alt-texts are already normal once lowercased, and RE2 finds out faster than it rewrites.
    return f"CASE WHEN regexp_matches({low}, {sep}) THEN regexp_replace({spaced}, '^ | $', '', 'g') ELSE {low} END"


def _identity_sql(plan: FilterPlan) -> str:
    parts = [f"{literal(prefix)} || nullif(CAST({quote(col)} AS VARCHAR), '')" for prefix, col in plan.identity]
    parts.append(f"'row:' || CAST({ROW_ID_COLUMN} AS VARCHAR)")
    return f"coalesce({', '.join(parts)})"


def _invalid_sql(plan: FilterPlan) -> str:
    """The first validity problem of a row (columns of the inner select in ``_run``), or NULL."""
    cases = []
    if plan.status is not None:
        cases.append("WHEN status IS DISTINCT FROM 'success' THEN 'download_failed'")
    if plan.has_text_error_column:
        cases.append("WHEN text_error IS NOT NULL THEN text_error")
    cases.append("WHEN txt IS NULL THEN 'missing_text'")
    # trim() with a character set decodes every character and is several times slower than RE2.
    cases.append(f"WHEN NOT regexp_matches(txt, {literal(NOT_WHITESPACE_PATTERN)}) THEN 'empty_text'")
    if plan.width is not None:
        ok = "isfinite(w) AND w > 0 AND isfinite(h) AND h > 0"
        cases.append(f"WHEN NOT coalesce({ok}, false) THEN 'bad_size'")
    if plan.unsafe is not None:
        cases.append("WHEN u_given AND coalesce(isnan(u), true) THEN 'bad_unsafe_score'")
    return "CASE " + " ".join(cases) + " END"


def _row_reason_sql(plan: FilterPlan) -> str | None:
    """The first rule decided by the row itself or its image (``r``: rows, ``i``: the images over the limit)."""
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
    if plan.image_format is not None:
        formats = ", ".join(literal(f) for f in r.image_formats or [])
        cases.append(f"WHEN r.fmt IS NULL OR r.fmt NOT IN ({formats}) THEN 'image_format'")
    if r.max_texts_per_image is not None:
        cases.append("WHEN i.ident IS NOT NULL THEN 'image_text_count'")
    return "CASE " + " ".join(cases) + " END" if cases else None


def _text_reason_sql(plan: FilterPlan) -> str | None:
    """The first rule decided by the alt-text alone (``t``: texts with n_words, n_paired and repeated; ``s``: shared
    texts; ``rn``, ``rw``: texts with a rare n-gram, a rare word)."""
    r = plan.rules
    cases = []
    if r.max_images_per_text is not None:
        cases.append("WHEN s.norm IS NOT NULL THEN 'shared_text'")
    if r.vocab_top_k is not None:
        cases.append("WHEN rn.tid IS NOT NULL THEN 'rare_ngram'")
    if r.min_word_count is not None:
        cases.append("WHEN rw.tid IS NOT NULL THEN 'rare_word'")
    if r.min_words is not None:
        cases.append(f"WHEN t.n_words < {int(r.min_words)} THEN 'too_few_words'")
    if r.max_words is not None:
        cases.append(f"WHEN t.n_paired > {int(r.max_words)} THEN 'too_many_words'")
    if r.max_repeated_fraction is not None:
        cases.append(f"WHEN t.repeated > {float(r.max_repeated_fraction)!r} THEN 'repeated_words'")
    return "CASE " + " ".join(cases) + " END" if cases else None


def _tag_overlap_sql(plan: FilterPlan) -> str:
    """Words of the image's tags that are words of the alt-text (``r``: rows with norm and tw)."""
    both = "len(list_intersect(string_split(r.norm, ' '), string_split(r.tw, ' ')))"
    overlap = f"CASE WHEN r.norm = '' OR coalesce(r.tw, '') = '' THEN 0 ELSE {both} END"
    return f"CASE WHEN {overlap} < {int(plan.rules.min_tag_overlap or 0)} THEN 'tag_overlap' END"


def _word_stream_sql(texts_sql: str, successors: bool) -> str:
    """One row per word of the texts in ``texts_sql`` (tid, norm, n_rows): ``a`` the word and, with
    ``successors``, ``b`` the word after it ('' for the last; a word is never empty). Words come from
    splitting the normalised text on its single spaces, so no tokeniser runs twice, and a bigram stays two
    short strings instead of a new concatenated one, which is cheaper to build and to hash."""
    lists = f"SELECT tid, n_rows, string_split(norm, ' ') AS w FROM {texts_sql} WHERE norm <> ''"
    if not successors:
        return f"SELECT tid, n_rows, unnest(w) AS a FROM ({lists})"
    pairs = f"SELECT tid, n_rows, unnest(w) AS a, unnest(w[2:len(w)]) AS b FROM ({lists})"
    return f"SELECT tid, n_rows, a, coalesce(b, '') AS b FROM ({pairs})"


def _find_rare_texts(ex: Callable[[str], Any], table: str, texts_sql: str, keys: list[str], grams_sql: str) -> None:
    """Create ``table`` (tid): the texts of ``texts_sql`` with a rare n-gram.

    ``grams_sql`` has a row per distinct value of ``keys`` in the word stream of the texts (a word, or a word
    with its successor): ``rare`` when an n-gram it stands for is rare, ``occ`` its occurrences in the
    distinct texts and ``t1`` the first of those texts. When ``occ`` is 1, ``t1`` is its only text, and
    that covers much of a corpus's long tail, so many rare texts are found without reading a text again.
    Only the other texts are scanned, for the rare values that occur more than once; that scan's hash join
    builds on the smaller side: those values (a hit is rare) or the ones that are not rare (a miss is).
    """
    ex(f"CREATE TEMP TABLE {table}_grams AS {grams_sql}")
    ex(f"CREATE TEMP TABLE {table} AS SELECT DISTINCT t1 AS tid FROM {table}_grams WHERE rare AND occ = 1")
    n_repeated_rare, n_common = ex(
        f"SELECT count(*) FILTER (WHERE rare AND occ > 1), count(*) FILTER (WHERE NOT rare) FROM {table}_grams"
    ).fetchone()
    if not n_repeated_rare:
        return
    if n_repeated_rare <= n_common:
        where, hit = "rare AND occ > 1", "x.a IS NOT NULL"
    else:
        where, hit = "NOT rare", "x.a IS NULL"
    # Materialised, so that the join knows its exact size and builds on it.
    ex(f"CREATE TEMP TABLE {table}_build AS SELECT {', '.join(keys)} FROM {table}_grams WHERE {where}")
    on = " AND ".join(f"x.{k} = o.{k}" for k in keys)
    others = f"(SELECT t.* FROM {texts_sql} t ANTI JOIN {table} r ON t.tid = r.tid)"
    ex(
        f"INSERT INTO {table} SELECT DISTINCT o.tid FROM ({_word_stream_sql(others, len(keys) == 2)}) o "
        f"LEFT JOIN {table}_build x ON {on} WHERE {hit}"
    )


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
    log: Callable[[str], None] | None = None,
) -> EngineResult:
    """Filter ``staged`` by ``plan`` and write the survivors, in input order, to ``output``."""
    import duckdb

    settings = settings or DuckDBSettings()
    con = duckdb.connect()
    try:
        return _run(con, staged, plan, output, out_format, work_dir, settings, log)
    except duckdb.Error as err:  # DuckDB's message names no file: a damaged Parquet page reads "don't know what type"
        inputs = ", ".join(str(p) for p in staged.paths[:3]) + (", ..." if len(staged.paths) > 3 else "")
        raise ValueError(f"cannot filter {inputs}: {' '.join(str(err).split()) or type(err).__name__}") from None
    finally:
        con.close()
        partial = output.with_name(output.name + ".partial")  # left by a COPY that failed half-way
        if partial.is_dir():
            shutil.rmtree(partial, ignore_errors=True)
        else:
            partial.unlink(missing_ok=True)


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
    log: Callable[[str], None] | None,
) -> EngineResult:
    r = plan.rules

    def ex(sql: str) -> Any:
        start, cpu = time.perf_counter(), _cpu_seconds()
        result = con.execute(sql)
        head = sql.split(None, 4)
        if log is not None and head[0] in ("CREATE", "INSERT", "COPY"):
            what = {"CREATE": f"table {head[3]}", "INSERT": f"insert into {head[2]}"}.get(head[0], "write output")
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
    # The row ids above follow the input order; from here on only the output keeps an order, by ORDER BY.
    ex("SET preserve_insertion_order = false")
    source_rows = ex("SELECT count(*) FROM src").fetchone()[0]

    inner = [f"{ROW_ID_COLUMN} AS rid", f"{_identity_sql(plan)} AS ident"]
    inner.append(f"CAST({quote(plan.text)} AS VARCHAR) AS txt")
    if plan.has_text_error_column:
        inner.append(f"{TEXT_ERROR_COLUMN} AS text_error")
    if plan.status is not None:
        inner.append(f"CAST({quote(plan.status)} AS VARCHAR) AS status")
    if plan.width is not None and plan.height is not None:
        inner += [f"try_cast({quote(plan.width)} AS DOUBLE) AS w", f"try_cast({quote(plan.height)} AS DOUBLE) AS h"]
    if plan.unsafe is not None:
        inner += [f"try_cast({quote(plan.unsafe)} AS DOUBLE) AS u", f"{quote(plan.unsafe)} IS NOT NULL AS u_given"]
    if plan.image_format is not None:
        inner.append(f"{quote(plan.image_format)} AS fmt")
    if plan.tag_words is not None:
        inner.append(f"{quote(plan.tag_words)} AS tw")
    outer = ["rid", "ident", f"{norm_sql('txt')} AS norm", f"{_invalid_sql(plan)} AS invalid"]
    derived: list[tuple[str, object]] = [("w", plan.width), ("h", plan.width), ("u", plan.unsafe)]
    derived += [("fmt", plan.image_format), ("tw", plan.tag_words), ("txt", plan.annotator)]
    outer += [c for c, on in derived if on is not None]
    ex(f"CREATE TEMP TABLE rows AS SELECT {', '.join(outer)} FROM (SELECT {', '.join(inner)} FROM src)")

    stats: dict[str, int] = {}
    # The raw corpus: every well-formed row, before any rule.
    ex("CREATE TEMP TABLE img AS SELECT ident, count(*) AS n_texts FROM rows WHERE invalid IS NULL GROUP BY ident")
    stats["distinct_images"] = ex("SELECT count(*) FROM img").fetchone()[0]
    # A text's id is its row in this table.
    ex("CREATE TEMP TABLE txt AS SELECT norm, count(*) AS n_rows FROM rows WHERE invalid IS NULL GROUP BY norm")
    stats["distinct_texts"] = ex("SELECT count(*) FROM txt").fetchone()[0]
    flag_joins = []
    if r.max_images_per_text is not None:
        # Only a text on more rows than the limit can be on more distinct images than it.
        limit = int(r.max_images_per_text)
        ex(
            f"CREATE TEMP TABLE shared AS SELECT r.norm FROM rows r "
            f"SEMI JOIN (SELECT norm FROM txt WHERE n_rows > {limit}) c ON r.norm = c.norm "
            f"WHERE r.invalid IS NULL GROUP BY r.norm HAVING count(DISTINCT r.ident) > {limit}"
        )
        flag_joins.append("LEFT JOIN shared s ON s.norm = t.norm")

    texts = "(SELECT rowid AS tid, norm, n_rows FROM txt)"
    bigrams = r.vocab_top_k is not None and r.rare_ngram_order == 2
    uni_hist: dict[int, int] = {}
    if r.vocab_top_k is not None or r.min_word_count is not None:
        # Per n-gram: its count, its occurrences in the distinct texts (occ) and the first such text (t1).
        stats_sql = "sum(n_rows) AS cnt, count(*) AS occ, min(tid) AS t1"
        if bigrams:
            # Each word with its successor: the bigrams, and (b = '') each text's last word, so that the
            # word counts follow without a second pass over the texts.
            successions = _word_stream_sql(texts, True)
            ex(f"CREATE TEMP TABLE pairs AS SELECT a, b, {stats_sql} FROM ({successions}) GROUP BY a, b")
            word_counts = "SELECT a, sum(cnt) AS cnt, sum(occ) AS occ, min(t1) AS t1 FROM pairs GROUP BY a"
        else:
            word_counts = f"SELECT a, {stats_sql} FROM ({_word_stream_sql(texts, False)}) GROUP BY a"
        ex(f"CREATE TEMP TABLE uni AS {word_counts}")
        uni_hist = dict(ex("SELECT cnt, count(*) FROM uni GROUP BY cnt").fetchall())
        stats["distinct_words"] = sum(uni_hist.values())
    if r.vocab_top_k is not None:
        hist = dict(uni_hist)
        if bigrams:
            for cnt, n in ex("SELECT cnt, count(*) FROM pairs WHERE b <> '' GROUP BY cnt").fetchall():
                hist[cnt] = hist.get(cnt, 0) + n
        threshold = frequent_threshold(hist, r.vocab_top_k)
        stats["distinct_ngrams"] = sum(hist.values())
        stats["frequent_min_count"] = threshold
        stats["rare_ngrams"] = sum(n for c, n in hist.items() if c < threshold)
        if bigrams:
            # A word-successor pair is rare when its bigram is or its first word is (the last word of a text
            # is the first of a pair with b = '', so every word is checked).
            rare = f"(p.b <> '' AND p.cnt < {threshold}) OR u.cnt < {threshold}"
            grams = f"SELECT p.a, p.b, p.occ, p.t1, {rare} AS rare FROM pairs p JOIN uni u ON p.a = u.a"
            _find_rare_texts(ex, "rare_ngram_tid", texts, ["a", "b"], grams)
        else:
            grams = f"SELECT a, occ, t1, cnt < {threshold} AS rare FROM uni"
            _find_rare_texts(ex, "rare_ngram_tid", texts, ["a"], grams)
        flag_joins.append("LEFT JOIN rare_ngram_tid rn ON rn.tid = t.tid")
    if r.min_word_count is not None:
        limit = int(r.min_word_count)
        stats["rare_words"] = sum(n for c, n in uni_hist.items() if c < limit)
        grams = f"SELECT a, occ, t1, cnt < {limit} AS rare FROM uni"
        _find_rare_texts(ex, "rare_word_tid", texts, ["a"], grams)
        flag_joins.append("LEFT JOIN rare_word_tid rw ON rw.tid = t.tid")

    def count(words: str) -> str:
        return f"CASE WHEN {words} = '' THEN 0 ELSE strlen({words}) - strlen(replace({words}, ' ', '')) + 1 END"

    # too_many_words and repeated_words count paired words (rules.paired_words), too_few_words every word.
    text_cols = ["tid", "norm", f"{count('norm')} AS n_words"]
    if r.max_words is not None or r.max_repeated_fraction is not None:
        texts = f"(SELECT tid, norm, n_rows, {paired_sql('norm')} AS paired FROM {texts})"
        text_cols.append(f"{count('paired')} AS n_paired")
    if r.max_repeated_fraction is not None:
        distinct = "len(list_distinct(string_split(paired, ' ')))"
        n = count("paired")
        text_cols.append(f"CASE WHEN paired = '' THEN 0.0 ELSE ({n} - {distinct}) / ({n}) END AS repeated")
    text_reason = _text_reason_sql(plan)
    row_reason = _row_reason_sql(plan)
    # The per-row joins build only on the images and texts that some rule rejects.
    joins, reasons = [], ["r.invalid"]
    if row_reason is not None:
        reasons.append(row_reason)
    if r.max_texts_per_image is not None:
        busy = f"SELECT ident FROM img WHERE n_texts > {int(r.max_texts_per_image)}"
        joins.append(f"LEFT JOIN ({busy}) i ON r.ident = i.ident")
    if text_reason is not None:
        ex(
            f"CREATE TEMP TABLE txtreason AS SELECT norm, reason FROM (SELECT t.norm, {text_reason} AS reason "
            f"FROM (SELECT {', '.join(text_cols)} FROM {texts}) t {' '.join(flag_joins)}) WHERE reason IS NOT NULL"
        )
        joins.append("LEFT JOIN txtreason x ON r.norm = x.norm")
        reasons.append("x.reason")
    if plan.tag_words is not None:
        reasons.append(_tag_overlap_sql(plan))
    ex(
        f"CREATE TEMP TABLE decisions AS SELECT r.rid, coalesce({', '.join(reasons)}) AS reason "
        f"FROM rows r {' '.join(joins)}"
    )
    transformed: dict[str, int] = {}
    survivors = f"src SEMI JOIN (SELECT rid FROM decisions WHERE reason IS NULL) k ON src.{ROW_ID_COLUMN} = k.rid"
    columns = [f"src.{quote(name)}" for name in staged.columns]
    if plan.annotator is not None:
        _annotate_texts(con, ex, plan, work_dir)
        if r.required_pos is not None and plan.annotator.required_pos is not None:
            ex(
                "UPDATE decisions SET reason = 'missing_pos' FROM rows r, nlp n "
                "WHERE decisions.reason IS NULL AND decisions.rid = r.rid AND r.txt = n.txt AND NOT n.pos_ok"
            )
        if plan.annotator.person is not None:
            ex(
                "CREATE TEMP TABLE kept AS SELECT d.rid, n.person_txt, n.person_txt IS DISTINCT FROM r.txt AS changed "
                "FROM decisions d JOIN rows r ON d.rid = r.rid LEFT JOIN nlp n ON r.txt = n.txt WHERE d.reason IS NULL"
            )
            transformed["person_substitution"] = ex("SELECT count(*) FROM kept WHERE changed").fetchone()[0]
            survivors = f"src JOIN kept k ON src.{ROW_ID_COLUMN} = k.rid"
            columns[staged.columns.index(plan.text)] = f"k.person_txt AS {quote(plan.text)}"
    removed_sql = "SELECT reason, count(*) FROM decisions WHERE reason IS NOT NULL GROUP BY reason"
    removed = dict(ex(removed_sql).fetchall())

    partial = output.with_name(output.name + ".partial")
    written = ex(
        f"COPY (SELECT {', '.join(columns)} FROM {survivors} ORDER BY src.{ROW_ID_COLUMN}) "
        f"TO {literal(str(partial))} ({_copy_options(out_format)})"
    ).fetchone()[0]
    if output.is_dir():
        shutil.rmtree(output)
    os.replace(partial, output)
    return EngineResult(
        source_rows=source_rows, removed=removed, rows_written=written, stats=stats, transformed=transformed
    )


def _annotate_texts(con: Any, ex: Callable[[str], Any], plan: FilterPlan, work_dir: Path) -> None:
    """Create ``nlp`` (txt, pos_ok, person_txt): the text pass over the distinct alt-texts of the kept rows,
    in batches, so an NLP pipeline sees many texts per call (spaCy's ``nlp.pipe``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    assert plan.annotator is not None
    path = work_dir / "nlp.parquet"
    schema = pa.schema([("txt", pa.string()), ("pos_ok", pa.bool_()), ("person_txt", pa.string())])
    texts = con.sql(
        "SELECT DISTINCT r.txt FROM rows r SEMI JOIN (SELECT rid FROM decisions WHERE reason IS NULL) d "
        "ON r.rid = d.rid"
    ).to_arrow_reader(_TEXT_BATCH)
    with pq.ParquetWriter(path, schema) as writer:
        for batch in texts:
            values = batch.column(0).to_pylist()
            ok, changed = plan.annotator(values)
            writer.write_table(pa.table([values, ok, changed], schema=schema))
    ex(f"CREATE TEMP TABLE nlp AS SELECT * FROM read_parquet({literal(str(path))})")


_TEXT_BATCH = 4096
