"""Data stages of the pipeline: alt-text filters, test-image decontamination, WebDataset shards,
image transforms and the synthetic noisy alt-text world.

Submodules are imported on use (``from openalign.data.shards import read_samples``) so that loading
one stage never pays for another's dependencies (Spark, FAISS).
"""
