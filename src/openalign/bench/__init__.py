"""Benchmarks behind `openalign bench`: each prints our figure beside a baseline from the same run."""
