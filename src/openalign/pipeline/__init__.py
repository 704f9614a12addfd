"""Orchestration across stages: runs that combine data, models and training into one job.

- ``demo``: the whole pipeline on the synthetic world (``openalign demo``);
- ``experiments``: the paper's ablations in miniature (``openalign experiments``).

Modules here may import every package below ``openalign.cli``; nothing below imports them. Nothing is imported
at package import, so ``import openalign.pipeline`` stays free of torch.
"""
