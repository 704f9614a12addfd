"""Evaluation as in the ALIGN paper: image-text retrieval, zero-shot classification with prompt
ensembles, KNN, and the reports that put our numbers beside the paper's.

Each evaluator is a task in :mod:`openalign.eval.tasks` (``openalign eval TASK``); the metrics are plain
functions on embeddings (e.g. :func:`openalign.eval.retrieval.recall_at_k`) usable without a model.
"""
