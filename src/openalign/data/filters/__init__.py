"""Alt-text corpus filters: ALIGN's frequency-based rules and CC12M's relaxed ones, on DuckDB or Spark.

    from openalign.data.filters import filter_corpus
    report = filter_corpus("pairs.parquet", "kept.parquet", rules="align", report_path="funnel.json")
    print(report.table())

Each rule's exact semantics (what is counted over the raw corpus, tie-breaking) is the plain-Python
specification :mod:`openalign.data.filters.reference`; the tokenisation is :mod:`openalign.data.filters.rules`.
"""

from openalign.data.filters.person import PERSON_TOKEN, demo_person_names, resolve_person_hook
from openalign.data.filters.pipeline import EngineConfig, FunnelReport, filter_corpus
from openalign.data.filters.rules import (
    PRESETS,
    RULE_STEPS,
    VALIDITY_STEPS,
    ColumnNames,
    FilterRules,
    frequent_threshold,
    load_rules,
    ngrams,
    tokenize,
)

__all__ = [
    "PERSON_TOKEN",
    "PRESETS",
    "RULE_STEPS",
    "VALIDITY_STEPS",
    "ColumnNames",
    "EngineConfig",
    "FilterRules",
    "FunnelReport",
    "demo_person_names",
    "filter_corpus",
    "frequent_threshold",
    "load_rules",
    "ngrams",
    "resolve_person_hook",
    "tokenize",
]
