"""The filter rules on PySpark, for corpora that live on a cluster (``local[*]`` on one machine).

The same plan as the DuckDB engine, step for step, in DataFrame expressions: per-row derived columns,
statistics grouped by image and by distinct normalised alt-text, n-gram counts weighted by rows, one
``reason`` per row. Regular expressions are Java's; the whitespace set and punctuation set are the same
characters as :mod:`openalign.data.filters.rules`. Spark writes OUTPUT as a directory of part files in
the format of its extension (that is how Spark writes; pandas, pyarrow, DuckDB and Spark all read it).
Row order is not kept (ordering a cluster-sized table costs a full sort); the row set is.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openalign.data.filters.inputs import ROW_ID_COLUMN, TEXT_ERROR_COLUMN, StagedInput
from openalign.data.filters.plan import EngineResult, FilterPlan
from openalign.data.filters.rules import PUNCTUATION, frequent_threshold, pair_pattern, segment_patterns

# Java regex, same construction as the DuckDB engine's (see there): whitespace runs with the punctuation
# touching them become one space, then punctuation at the ends goes. \A and \z (not ^ and $) so that a
# trailing Unicode line terminator is not taken for the end of the text.
_PUNCT_CLASS = "[" + "".join("\\" + c for c in PUNCTUATION) + "]"
_WS_CLASS = r"[\t\n\x0B\f\r ]"
SEPARATOR_PATTERN = f"{_PUNCT_CLASS}*(?:{_WS_CLASS}+{_PUNCT_CLASS}*)+"
EDGE_PATTERN = rf"\A{_PUNCT_CLASS}+|{_PUNCT_CLASS}+\z"
_WS_EDGES = rf"\A{_WS_CLASS}+|{_WS_CLASS}+\z"


@dataclass
class SparkSettings:
    master: str = "local[*]"  # any Spark master URL: local[N], spark://host:7077, yarn, k8s://...
    conf: dict[str, str] = field(default_factory=dict)  # extra spark.* settings for a new session


def spark_session(settings: SparkSettings | None = None) -> Any:
    """A SparkSession for filtering (or the active one, which keeps its own settings)."""
    try:
        from pyspark.sql import SparkSession
    except ImportError as err:
        raise ImportError("the spark engine needs pyspark: pip install 'openalign[spark]'") from err
    settings = settings or SparkSettings()
    if settings.master.startswith("local"):
        # Python work on executors (the NLP pass) needs this package's dependencies: on one machine, run the
        # workers with the driver's interpreter rather than whatever `python3` is first on the PATH.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.master(settings.master).appName("openalign-filter")
    conf = {
        "spark.sql.shuffle.partitions": "8",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        **settings.conf,
    }
    for key, value in conf.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def _col(name: str) -> Any:
    from pyspark.sql import functions as F

    return F.col("`" + name.replace("`", "``") + "`")


def norm_column(text: Any) -> Any:
    """The normalised alt-text (its words joined by single spaces, see rules.tokenize) as a Spark column."""
    from pyspark.sql import functions as F

    low = F.lower(text)
    touched, unit, seps = segment_patterns("java")
    segmented = F.regexp_replace(F.regexp_replace(low, seps, " "), unit, " $0 ")
    low = F.when(low.rlike(touched), segmented).otherwise(low)
    spaced = F.regexp_replace(low, SEPARATOR_PATTERN, " ")
    return F.regexp_replace(F.regexp_replace(spaced, EDGE_PATTERN, ""), r"\A +| +\z", "")


def _bigrams(toks: Any) -> Any:
    from pyspark.sql import functions as F

    n = F.greatest(F.size(toks) - 1, F.lit(0))
    return F.zip_with(F.slice(toks, 1, n), F.slice(toks, 2, n), lambda a, b: F.concat(a, F.lit(" "), b))


def _try_double(name: str) -> Any:
    from pyspark.sql import functions as F

    return F.expr("try_cast(`" + name.replace("`", "``") + "` AS DOUBLE)")


def run_spark(
    staged: StagedInput,
    plan: FilterPlan,
    output: Path,
    out_format: str,
    spark: Any,
) -> EngineResult:
    """Filter ``staged`` by ``plan`` with ``spark`` and write the survivors to directory ``output``."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    r = plan.rules
    paths = [str(p) for p in staged.paths]
    src = spark.read.option("mergeSchema", "true").parquet(*paths)
    src = src.withColumn(ROW_ID_COLUMN, F.monotonically_increasing_id()).persist(StorageLevel.MEMORY_AND_DISK)
    source_rows = src.count()

    ident_parts = [F.concat(F.lit(prefix), F.nullif(_col(c).cast("string"), F.lit(""))) for prefix, c in plan.identity]
    ident = F.coalesce(*ident_parts, F.concat(F.lit("row:"), F.col(ROW_ID_COLUMN).cast("string")))
    txt = _col(plan.text).cast("string")
    rows = src.select(
        F.col(ROW_ID_COLUMN).alias("rid"),
        ident.alias("ident"),
        txt.alias("txt"),
        (F.col(TEXT_ERROR_COLUMN) if plan.has_text_error_column else F.lit(None).cast("string")).alias("text_error"),
        (_col(plan.status).cast("string") if plan.status else F.lit("success")).alias("status"),
        (_try_double(plan.width) if plan.width else F.lit(None).cast("double")).alias("w"),
        (_try_double(plan.height) if plan.height else F.lit(None).cast("double")).alias("h"),
        (_try_double(plan.unsafe) if plan.unsafe else F.lit(None).cast("double")).alias("u"),
        (_col(plan.unsafe).isNotNull() if plan.unsafe else F.lit(False)).alias("u_given"),
        (_col(plan.image_format) if plan.image_format else F.lit(None).cast("string")).alias("fmt"),
        (_col(plan.tag_words) if plan.tag_words else F.lit(None).cast("string")).alias("tw"),
    )
    invalid = F.when(~F.coalesce(F.col("status") == "success", F.lit(False)), "download_failed")
    invalid = invalid.when(F.col("text_error").isNotNull(), F.col("text_error"))
    invalid = invalid.when(F.col("txt").isNull(), "missing_text")
    invalid = invalid.when(F.regexp_replace("txt", _WS_EDGES, "") == "", "empty_text")
    if plan.width is not None:
        w, h = F.col("w"), F.col("h")
        finite = ~F.isnan(w) & ~F.isnan(h) & (w < float("inf")) & (h < float("inf"))
        ok = F.coalesce(finite & (w > 0) & (h > 0), F.lit(False))
        invalid = invalid.when(~ok, "bad_size")
    if plan.unsafe is not None:
        # Spark's isnan(NULL) is false, not NULL: a score that is not a number casts to NULL, tested apart.
        invalid = invalid.when(F.col("u_given") & (F.col("u").isNull() | F.isnan("u")), "bad_unsafe_score")
    norm = norm_column(F.col("txt"))
    # The raw alt-text is kept only for the text pass (the NLP pipeline reads case and punctuation).
    raw = F.col("txt") if plan.annotator is not None else F.lit(None).cast("string").alias("txt")
    rows = rows.select("rid", "ident", "w", "h", "u", "fmt", "tw", raw, norm.alias("norm"), invalid.alias("invalid"))
    rows = rows.persist(StorageLevel.MEMORY_AND_DISK)
    good = rows.where(F.col("invalid").isNull())

    stats: dict[str, int] = {}
    img = good.groupBy("ident").agg(F.count(F.lit(1)).alias("n_texts"))
    stats["distinct_images"] = img.count()
    n_images = F.countDistinct("ident") if r.max_images_per_text is not None else F.lit(0)
    txt_df = good.groupBy("norm").agg(F.count(F.lit(1)).alias("n_rows"), n_images.alias("n_images"))
    toks = F.when(F.col("norm") == "", F.array().cast("array<string>")).otherwise(F.split("norm", " "))
    txt_df = txt_df.withColumn("toks", toks).persist(StorageLevel.MEMORY_AND_DISK)
    stats["distinct_texts"] = txt_df.count()

    flags = txt_df.select("norm", "n_images", F.size("toks").alias("n_words"), "toks")
    if r.vocab_top_k is not None or r.min_word_count is not None:
        uni = txt_df.select("n_rows", F.explode("toks").alias("g")).groupBy("g").agg(F.sum("n_rows").alias("cnt"))
        uni = uni.persist(StorageLevel.MEMORY_AND_DISK)
        stats["distinct_words"] = uni.count()
    if r.vocab_top_k is not None:
        grams = uni
        if r.rare_ngram_order == 2:
            bi = txt_df.select("n_rows", F.explode(_bigrams(F.col("toks"))).alias("g"))
            grams = uni.unionByName(bi.groupBy("g").agg(F.sum("n_rows").alias("cnt")))
        grams = grams.persist(StorageLevel.MEMORY_AND_DISK)
        hist = {row["cnt"]: row["n"] for row in grams.groupBy("cnt").agg(F.count(F.lit(1)).alias("n")).collect()}
        threshold = frequent_threshold(hist, r.vocab_top_k)
        stats["distinct_ngrams"] = sum(hist.values())
        stats["frequent_min_count"] = threshold
        stats["rare_ngrams"] = sum(n for c, n in hist.items() if c < threshold)
        text_grams = F.concat("toks", _bigrams(F.col("toks"))) if r.rare_ngram_order == 2 else F.col("toks")
        rare = grams.where(F.col("cnt") < threshold).select("g")
        hit = txt_df.select("norm", F.explode(text_grams).alias("g")).join(rare, "g", "left_semi")
        flags = flags.join(hit.select("norm").distinct().withColumn("rare_ngram", F.lit(True)), "norm", "left")
    if r.min_word_count is not None:
        stats["rare_words"] = uni.where(F.col("cnt") < r.min_word_count).count()
        rare_w = uni.where(F.col("cnt") < r.min_word_count).select("g")
        hit_w = txt_df.select("norm", F.explode("toks").alias("g")).join(rare_w, "g", "left_semi")
        flags = flags.join(hit_w.select("norm").distinct().withColumn("rare_word", F.lit(True)), "norm", "left")
    n_words = F.col("n_words")
    # too_many_words and repeated_words count paired words (rules.paired_words), too_few_words every word.
    norm_col = F.col("norm")
    paired = F.when(
        norm_col.rlike(segment_patterns("java")[0]), F.regexp_replace(norm_col, pair_pattern("java"), "$1$2")
    ).otherwise(norm_col)
    paired_toks = F.when(norm_col == "", F.array().cast("array<string>")).otherwise(F.split(paired, " "))
    flags = flags.withColumn("ptoks", paired_toks).withColumn("n_paired", F.size("ptoks"))
    n_paired = F.col("n_paired")
    repeated = F.when(n_paired == 0, F.lit(0.0)).otherwise((n_paired - F.size(F.array_distinct("ptoks"))) / n_paired)
    flags = flags.withColumn("repeated", repeated).drop("toks", "ptoks")

    reason = None

    def add(cond: Any, name: str) -> None:
        nonlocal reason
        reason = F.when(cond, name) if reason is None else reason.when(cond, name)

    w, h = F.col("w"), F.col("h")
    if plan.unsafe is not None:
        add(F.col("u") > float(r.max_unsafe), "unsafe")  # type: ignore[arg-type]
    if r.min_shorter_side is not None:
        add(F.least(w, h) <= r.min_shorter_side, "small_image")
    if r.max_aspect_ratio is not None:
        ratio = F.greatest(w, h) / F.least(w, h)
        add(ratio > r.max_aspect_ratio if r.aspect_ratio_inclusive else ratio >= r.max_aspect_ratio, "aspect_ratio")
    if plan.image_format is not None:
        add(F.col("fmt").isNull() | ~F.col("fmt").isin(*(r.image_formats or [])), "image_format")
    if r.max_texts_per_image is not None:
        add(F.col("n_texts") > r.max_texts_per_image, "image_text_count")
    if r.max_images_per_text is not None:
        add(F.col("n_images") > r.max_images_per_text, "shared_text")
    if r.vocab_top_k is not None:
        add(F.coalesce(F.col("rare_ngram"), F.lit(False)), "rare_ngram")
    if r.min_word_count is not None:
        add(F.coalesce(F.col("rare_word"), F.lit(False)), "rare_word")
    if r.min_words is not None:
        add(n_words < r.min_words, "too_few_words")
    if r.max_words is not None:
        add(n_paired > r.max_words, "too_many_words")
    if r.max_repeated_fraction is not None:
        add(F.col("repeated") > r.max_repeated_fraction, "repeated_words")
    if plan.tag_words is not None:
        both = F.size(F.array_intersect(F.split("norm", " "), F.split("tw", " ")))
        empty = (F.col("norm") == "") | (F.coalesce(F.col("tw"), F.lit("")) == "")
        add(F.when(empty, F.lit(0)).otherwise(both) < int(r.min_tag_overlap or 0), "tag_overlap")
    content = reason if reason is not None else F.lit(None).cast("string")
    decisions = (
        rows.join(img, "ident", "left")
        .join(flags, "norm", "left")
        .select("rid", "txt", F.coalesce(F.col("invalid"), content).alias("reason"))
    )
    annotated = None
    if plan.annotator is not None:
        decisions = decisions.persist(StorageLevel.MEMORY_AND_DISK)
        annotated = _annotate_texts(decisions, plan).persist(StorageLevel.MEMORY_AND_DISK)
        decisions = decisions.join(annotated, "txt", "left")
        if plan.annotator.required_pos is not None:
            missing = F.col("reason").isNull() & ~F.coalesce(F.col("pos_ok"), F.lit(True))
            decisions = decisions.withColumn("reason", F.when(missing, F.lit("missing_pos")).otherwise(F.col("reason")))
    decisions = decisions.persist(StorageLevel.MEMORY_AND_DISK)
    by_reason = decisions.where(F.col("reason").isNotNull()).groupBy("reason").agg(F.count(F.lit(1)).alias("n"))
    removed = {row["reason"]: row["n"] for row in by_reason.collect()}
    transformed: dict[str, int] = {}
    person = plan.annotator is not None and plan.annotator.person is not None
    kept_cols = [F.col("rid").alias(ROW_ID_COLUMN)] + ([F.col("person_txt").alias("__oa_person")] if person else [])
    kept = decisions.where(F.col("reason").isNull()).select(*kept_cols, "txt")
    columns = [_col(c) for c in staged.columns]
    if person:
        changed = kept.where(~F.col("__oa_person").eqNullSafe(F.col("txt")))
        transformed["person_substitution"] = changed.count()
        out = src.join(kept.drop("txt"), ROW_ID_COLUMN, "inner")
        columns = [F.col("__oa_person").alias(c) if c == plan.text else _col(c) for c in staged.columns]
    else:
        out = src.join(kept.drop("txt"), ROW_ID_COLUMN, "left_semi")
    out = out.select(*columns)
    partial = output.with_name(output.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    writer = out.write.mode("overwrite")
    if out_format == "parquet":
        writer.parquet(str(partial))
    elif out_format in ("csv", "tsv"):
        writer.option("header", "true").option("sep", "\t" if out_format == "tsv" else ",").csv(str(partial))
    else:
        writer.json(str(partial))
    # Counted from what was written where the format allows reading it back exactly.
    written = spark.read.parquet(str(partial)).count() if out_format == "parquet" else kept.count()
    for frame in (decisions, txt_df, rows, src, annotated):
        if frame is not None:
            frame.unpersist()
    if output.exists():
        shutil.rmtree(output) if output.is_dir() else output.unlink()
    partial.rename(output)
    return EngineResult(
        source_rows=source_rows, removed=removed, rows_written=written, stats=stats, transformed=transformed
    )


def _annotate_texts(decisions: Any, plan: FilterPlan) -> Any:
    """(txt, pos_ok, person_txt) for the distinct alt-texts of the kept rows, by ``plan.annotator`` on the
    executors: each partition is fed to it in Arrow batches, and the annotator loads its NLP pipeline once
    per executor process (it ships a pipeline's name, never the pipeline)."""
    from pyspark.sql import functions as F

    annotator = plan.annotator
    assert annotator is not None

    def run(batches: Any) -> Any:
        import pandas as pd

        for frame in batches:
            texts = frame["txt"].tolist()
            ok, changed = annotator(texts)
            yield pd.DataFrame({"txt": texts, "pos_ok": ok, "person_txt": changed})

    texts = decisions.where(F.col("reason").isNull()).select("txt").distinct()
    return texts.mapInPandas(run, "txt string, pos_ok boolean, person_txt string")
