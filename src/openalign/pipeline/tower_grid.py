"""Ablation (f) of ``openalign experiments``: the image and text tower sizes its 3 × 3 grid crosses, and the model
settings of one cell. ``pipeline/experiments.py`` trains the grid; ``pipeline/experiment_plots.py`` draws it."""

from __future__ import annotations

from typing import Any

# Towers scaled down and up from nano's in width and depth, each by about the same factor of its own training
# compute, so that the grid separates the two towers' effects.
IMAGE_TOWERS = {"S": (0.35, 0.35), "M": (0.5, 0.5), "L": (0.7, 0.7)}  # (width, depth) coefficients
TEXT_TOWERS = {"S": (1, 96, 2), "M": (2, 128, 2), "L": (3, 160, 2)}  # (layers, hidden size, heads)


def tower_overrides(image: str, text: str) -> dict[str, Any]:
    """Ablation (f)'s towers of sizes ``image`` and ``text`` (S, M or L)."""
    width, depth = IMAGE_TOWERS[image]
    layers, hidden, heads = TEXT_TOWERS[text]
    return {
        "model.image.width_coefficient": width,
        "model.image.depth_coefficient": depth,
        "model.text.num_layers": layers,
        "model.text.hidden_size": hidden,
        "model.text.num_heads": heads,
    }
