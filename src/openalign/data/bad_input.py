"""``BadInput``: an input item a stage cannot use, named by a reason slug for counting, and its detail.

``data/sources.py`` reports skipped items with it and ``data/transforms.py`` raises its ``BadImage`` kind, so it
lies below both.
"""

from __future__ import annotations


class BadInput(ValueError):
    """An input item that cannot be used; ``reason`` is a short slug for counting skipped items."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
