"""``filter_corpus``: stage the input, run an engine, check the funnel adds up, write the report."""

from __future__ import annotations

import functools
import glob
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from openalign.config import to_dict
from openalign.data.filters.images import ImageTagger, make_annotator
from openalign.data.filters.inputs import StagedInput, output_format, stage_input
from openalign.data.filters.person import PersonHook, resolve_person_hook
from openalign.data.filters.plan import FilterPlan, build_plan
from openalign.data.filters.rules import STEP_DESCRIPTIONS, TRANSFORM_DESCRIPTIONS, FilterRules, load_rules
from openalign.outputs import atomic_write_text, check_writable, refuse_input_as_output


@dataclass
class EngineConfig:
    """Where and how the rules run. DuckDB is embedded; Spark runs locally or on a cluster."""

    engine: Literal["duckdb", "spark"] = "duckdb"  # duckdb: embedded, this machine; spark: a Spark master
    threads: int | None = None  # DuckDB threads (default: all cores)
    memory_limit: str | None = None  # DuckDB memory before spilling, e.g. "8GB" (default: 80% of RAM)
    temp_directory: str | None = None  # work files and DuckDB spill (default: the system temp dir)
    spark_master: str = "local[*]"  # Spark master URL
    spark_conf: dict[str, str] = field(default_factory=dict)  # extra spark.* settings


@dataclass
class FilterConfig:
    """Everything ``openalign filter`` runs with: the rules, the engine, and how input and output are handled."""

    rules: FilterRules = field(default_factory=FilterRules)
    engine: EngineConfig = field(default_factory=EngineConfig)
    input_format: Literal["parquet", "csv", "tsv", "jsonl", "webdataset"] | None = None  # default: from INPUT
    report: str | None = None  # also write the funnel and statistics to this JSON file
    # CSV/TSV records that may fail to parse (each counted as malformed_row, its line in the report) before
    # the run stops with an error naming the line; JSON lines that do not parse are always skipped and counted
    max_malformed_rows: int = 0
    person_names: str | None = None  # names -> <PERSON> after filtering: nlp, demo or module:function
    # spaCy pipeline (installed name such as en_core_web_sm, or a saved pipeline's path) for the POS rule
    # and person_names nlp
    nlp: str | None = None
    nlp_batch_size: int = 256  # alt-texts per nlp.pipe batch
    # ALIGN checkpoint (openalign or transformers AlignModel) that tags images zero-shot for the
    # image-text tag-overlap rule; off unless given
    tagger: str | None = None
    tag_vocab: str | None = None  # the tagger's tags, one per line (needed with tagger)
    tag_top_k: int = 5  # tags kept per image, best first
    overwrite: bool = False  # replace OUTPUT if it exists (never an input: that is refused)


@dataclass
class FunnelReport:
    """Rows in, rows removed by each step in order, rows out; ``rows_in == rows_out + Σ removed``."""

    rows_in: int
    steps: list[tuple[str, int]]  # (step, rows removed), in funnel order
    rows_out: int
    skipped: dict[str, str] = field(default_factory=dict)  # rule -> why it did not run
    stats: dict[str, int] = field(default_factory=dict)  # corpus statistics the rules used
    transformed: dict[str, int] = field(default_factory=dict)  # transformation -> output rows it changed
    input_errors: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)  # input, output, engine, rules, seconds

    def __post_init__(self) -> None:
        removed = sum(n for _, n in self.steps)
        if self.rows_in != self.rows_out + removed:
            raise RuntimeError(
                f"filter funnel does not add up: {self.rows_in} rows in != {self.rows_out} out + {removed} removed"
            )

    @property
    def removed(self) -> dict[str, int]:
        return dict(self.steps)

    def to_dict(self) -> dict[str, Any]:
        remaining, steps = self.rows_in, []
        for name, n in self.steps:
            remaining -= n
            steps.append({"step": name, "removed": n, "remaining": remaining, "description": STEP_DESCRIPTIONS[name]})
        return {
            "rows_in": self.rows_in,
            "steps": steps,
            "rows_out": self.rows_out,
            "skipped": self.skipped,
            "stats": self.stats,
            "transformed": self.transformed,
            "input_errors": self.input_errors[:1000],
            "input_error_count": len(self.input_errors),
            **self.meta,
        }

    def table(self) -> str:
        """The funnel as a fixed-width text table."""
        width = max(len(n) for n, _ in [*self.steps, ("rows out", 0)]) + 2
        lines = [f"{'step':<{width}}{'removed':>12}{'remaining':>12}{'%in':>8}  description"]
        lines.append(f"{'rows in':<{width}}{'':>12}{self.rows_in:>12,}{100.0:>7.1f}%")
        remaining = self.rows_in
        for name, n in self.steps:
            remaining -= n
            share = 100.0 * remaining / self.rows_in if self.rows_in else 0.0
            lines.append(f"{name:<{width}}{n:>12,}{remaining:>12,}{share:>7.1f}%  {STEP_DESCRIPTIONS[name]}")
        share = 100.0 * self.rows_out / self.rows_in if self.rows_in else 0.0
        lines.append(f"{'rows out':<{width}}{'':>12}{self.rows_out:>12,}{share:>7.1f}%")
        if self.meta.get("size_columns"):
            lines.append(f"sizes from {' x '.join(self.meta['size_columns'])}")
        for name, n in self.transformed.items():
            lines.append(f"transformed {name}: {n:,} of {self.rows_out:,} rows ({TRANSFORM_DESCRIPTIONS[name]})")
        for rule, why in self.skipped.items():
            lines.append(f"skipped {rule}: {why}")
        if self.input_errors:
            lines.append(f"{len(self.input_errors)} input error(s), first: {self.input_errors[0]}")
        return "\n".join(lines)


def prepare(
    input: str | Path,
    rules: FilterRules,
    work: Path,
    input_format: str | None = None,
    max_malformed_rows: int = 0,
    person: PersonHook | str | None = None,
    nlp: str | None = None,
    nlp_batch_size: int = 256,
    image_tagger: ImageTagger | None = None,
) -> tuple[StagedInput, FilterPlan]:
    """What an engine is given: ``input`` staged under ``work`` (with the image rules' hidden columns) and
    the plan of ``rules`` on it. ``person``: a resolved hook (:func:`resolve_person_hook`)."""
    annotator = None
    if rules.image_formats is not None or rules.min_tag_overlap is not None:
        annotator = functools.partial(make_annotator, rules.columns, rules=rules, tagger=image_tagger)
    staged = stage_input(
        str(input), input_format, rules.columns, work / "staged", max_malformed_rows, annotator=annotator
    )
    return staged, build_plan(staged, rules, nlp, person, nlp_batch_size)


def filter_corpus(
    input: str | Path,
    output: str | Path,
    rules: str | Path | dict[str, Any] | FilterRules = "align",
    *,
    engine: EngineConfig | str = "duckdb",
    input_format: str | None = None,
    max_malformed_rows: int = 0,
    report_path: str | Path | None = None,
    person_hook: PersonHook | str | None = None,
    nlp: str | None = None,
    nlp_batch_size: int = 256,
    image_tagger: ImageTagger | None = None,
    spark: Any = None,
    overwrite: bool = False,
    progress: bool = False,
) -> FunnelReport:
    """Apply ``rules`` to the alt-text corpus at ``input`` and write the surviving rows to ``output``.

    ``input``: a Parquet, CSV/TSV or JSON Lines file, a directory or glob of them, or WebDataset shards
    (``shards/{00000..00099}.tar``). ``output``: Parquet, CSV, TSV or JSON Lines by extension, with every
    input column kept (DuckDB: one file, in input order; Spark: a directory of part files). ``rules``: a
    preset name, YAML path, mapping or FilterRules. ``max_malformed_rows``: CSV/TSV records that may fail to
    parse before the run stops with an error naming the line (nothing is written then). ``person_hook``: a
    ``str -> str`` callable, ``"nlp"``, ``"demo"`` or ``"module:function"`` (default: the rules'
    ``person_substitution``). ``nlp``: a spaCy pipeline name or path, for the POS rule and ``"nlp"`` person
    substitution. ``image_tagger``: encoded images -> tags, for the tag-overlap rule (see
    ``openalign.pipeline.tagging``).
    ``spark``: an existing SparkSession to use. Returns the funnel; also written as JSON to ``report_path``
    when given.
    """
    start = time.perf_counter()
    rules = load_rules(rules)
    cfg = EngineConfig(engine=engine) if isinstance(engine, str) else engine  # type: ignore[arg-type]
    if cfg.engine not in ("duckdb", "spark"):
        raise ValueError(f"unknown engine '{cfg.engine}'; valid: duckdb, spark")
    if max_malformed_rows < 0:
        raise ValueError(f"--max-malformed-rows must be ≥ 0, got {max_malformed_rows}")
    hook = resolve_person_hook(person_hook if person_hook is not None else rules.person_substitution)
    if nlp is not None and (rules.required_pos is not None or hook == "nlp"):
        from openalign.data.filters.nlp import check_backend

        # A missing pipeline, or one without the tagger or entity recognizer asked for, is an error now, not
        # deep in an engine (nor a funnel that silently removes every row).
        check_backend(nlp, pos=rules.required_pos is not None, persons=hook == "nlp")
    out = Path(output)
    out_fmt = output_format(out)
    refuse_input_as_output(out, [input, *glob.glob(str(input))])
    if out.exists() and not overwrite:
        raise ValueError(f"output {out} exists; pass overwrite=True (--overwrite) to replace it")
    if not out.parent.exists():
        raise FileNotFoundError(f"output directory not found: {out.parent}")
    # Checked before the run, so that a long filter never ends on an output it cannot write.
    # A folder OUTPUT (Spark's part files) is replaced whole: then it is its folder that must be writable.
    check_writable(out.parent if out.is_dir() else out, directory=out.is_dir())
    if report_path is not None:
        check_writable(report_path, what="report")

    def say(msg: str) -> None:
        if progress:
            print(f"[filter {time.perf_counter() - start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    work = Path(tempfile.mkdtemp(prefix="openalign-filter-", dir=cfg.temp_directory))
    try:
        say(f"reading {input}")
        staged, plan = prepare(
            input, rules, work, input_format, max_malformed_rows, hook, nlp, nlp_batch_size, image_tagger
        )
        say(f"running {len(plan.steps)} steps on {cfg.engine} ({', '.join(plan.steps)})")
        if cfg.engine == "duckdb":
            from openalign.data.filters.duckdb_engine import DuckDBSettings, run_duckdb

            # Spill files go under the run's work directory, itself under temp_directory when set.
            settings = DuckDBSettings(threads=cfg.threads, memory_limit=cfg.memory_limit)
            result = run_duckdb(staged, plan, out, out_fmt, work, settings, log=say if progress else None)
        else:
            from openalign.data.filters.spark_engine import SparkSettings, run_spark, spark_session

            session = spark or spark_session(SparkSettings(cfg.spark_master, dict(cfg.spark_conf)))
            result = run_spark(staged, plan, out, out_fmt, session)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    unknown = set(result.removed) - set(plan.steps)
    if unknown:
        raise RuntimeError(f"engine reported unexpected reasons {sorted(unknown)}")
    # Only text formats can hold a line that does not parse; Parquet has no such line to report.
    parsed = [("malformed_row", staged.malformed)] if staged.format != "parquet" else []
    steps = parsed + [(s, result.removed.get(s, 0)) for s in plan.steps]
    seconds = time.perf_counter() - start
    report = FunnelReport(
        rows_in=result.source_rows + staged.malformed,
        steps=steps,
        rows_out=result.rows_written,
        skipped=plan.skipped,
        stats=result.stats,
        transformed=result.transformed,
        input_errors=staged.input_errors,
        meta={
            "input": str(input),
            "input_format": staged.format,
            "text_column": staged.text_column,
            "size_columns": [plan.width, plan.height] if plan.width and plan.height else None,
            "status_column": plan.status,
            "output": str(out),
            "engine": cfg.engine,
            "rules": to_dict(rules),
            "person_substitution": (hook if isinstance(hook, str) else getattr(hook, "__name__", None))
            if hook and "person_substitution" not in plan.skipped
            else None,
            "nlp": nlp,
            "seconds": round(seconds, 3),
        },
    )
    rate = report.rows_in / max(seconds, 1e-9)
    say(f"done: {report.rows_out:,} of {report.rows_in:,} rows kept ({rate:,.0f} rows/s)")
    if report_path is not None:
        atomic_write_text(report_path, json.dumps(report.to_dict(), indent=2))
    return report
