"""Orchestration across stages: runs that combine data, models and training into one job.

- ``dedup``: the one near-duplicate removal path: embed train and test images (precomputed ``.npy``, a copy
  detector or an ALIGN image tower), find the pairs with ``openalign.data.dedup``, write the pairs and the
  deduplicated table;
- ``copy_detector``: training the copy detector that dedup embeds with;
- ``demo``: the whole pipeline on the synthetic world (``openalign demo``);
- ``experiments``: the paper's ablations in miniature (``openalign experiments``).

Modules here may import every package below ``openalign.cli``; nothing below imports them. Nothing is imported
at package import, so ``import openalign.pipeline`` stays free of torch.
"""
