"""Search over ALIGN embeddings: index building, multimodal queries, the HTTP API and its web page."""

from openalign.search.build import BuildConfig, build_config, build_index, open_index
from openalign.search.catalog import SearchIndex
from openalign.search.index import AnnConfig, VectorStore, ann_config, build_store, exact_search
from openalign.search.query import Hit, Query, Searcher, compose_query, remove_near_duplicates

__all__ = [
    "AnnConfig",
    "BuildConfig",
    "Hit",
    "Query",
    "SearchIndex",
    "Searcher",
    "VectorStore",
    "ann_config",
    "build_config",
    "build_index",
    "build_store",
    "compose_query",
    "exact_search",
    "open_index",
    "remove_near_duplicates",
]
