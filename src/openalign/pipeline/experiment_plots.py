"""The figures of ``openalign experiments``: one PNG per ablation, drawn from the summary it writes.

b–e: each metric against the ablation's factor, mean over seeds with ± one sample std as error bars;
a: the same beside the learning curves (held-out t2i R@1 along training, mean ± std band over seeds);
f: the 3 × 3 tower grid as two heat maps, t2i R@1 and KNN top-1, each cell annotated with mean ± std.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openalign.pipeline.tower_grid import IMAGE_TOWERS, TEXT_TOWERS

__all__ = ["write_plots"]

SERIES = (("t2i_r1", "t2i R@1"), ("i2t_r1", "i2t R@1"), ("knn_top1", "KNN top-1"))
GRID_METRICS = (("t2i_r1", "t2i R@1 (%)"), ("knn_top1", "KNN top-1 (%)"))


def write_plots(summary: dict[str, Any], folder: Path) -> dict[str, Path]:
    """Draw every ablation of ``summary`` into ``folder/<key>.png``; returns the paths by ablation key."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for key, ablation in summary["ablations"].items():
        if key == "f":
            fig = _tower_grid(plt, ablation)
        elif key == "a":
            fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
            _factor_axes(left, ablation)
            _curves_axes(right, ablation)
        else:
            fig, ax = plt.subplots(figsize=(6, 4))
            _factor_axes(ax, ablation)
        fig.suptitle(f"({key}) {ablation['title']}", fontsize=10)
        fig.tight_layout()
        path = folder / f"{key}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths[key] = path
    return paths


def _mean_std(stat: dict[str, Any]) -> tuple[float, float]:
    if not stat["n"]:
        return float("nan"), 0.0
    return stat["mean"], stat["std"] or 0.0


def _factor_axes(ax: Any, ablation: dict[str, Any]) -> None:
    """Each metric against the variants, in table order (labelled by variant; numeric factors keep their order)."""
    rows = ablation["variants"]
    x = list(range(len(rows)))
    for offset, (metric, name) in zip((-0.1, 0.0, 0.1), SERIES, strict=True):
        means, stds = zip(*(_mean_std(r[metric]) for r in rows), strict=True)
        ax.errorbar([i + offset for i in x], means, yerr=stds, marker="o", capsize=3, label=name)
    ax.set_xticks(x)
    ax.set_xticklabels(
        [r["label"] + (" (ref.)" if r["expect"] == "reference" else "") for r in rows],
        rotation=20,
        ha="right",
        fontsize=8,
    )
    ax.set_ylabel("% (mean ± std over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _curves_axes(ax: Any, ablation: dict[str, Any]) -> None:
    for row in ablation["variants"]:
        curve = row.get("curve") or []
        if not curve:
            continue
        steps = [p["step"] for p in curve]
        means, stds = zip(*(_mean_std(p["t2i_r1"]) for p in curve), strict=True)
        (line,) = ax.plot(steps, means, marker=".", label=row["label"])
        ax.fill_between(
            steps,
            [m - s for m, s in zip(means, stds, strict=True)],
            [m + s for m, s in zip(means, stds, strict=True)],
            color=line.get_color(),
            alpha=0.2,
        )
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out t2i R@1 (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _tower_grid(plt: Any, ablation: dict[str, Any]) -> Any:
    cells = {}
    for row in ablation["variants"]:
        name = "towers-MM" if row["expect"] == "reference" else row["variant"]
        cells[name[-2], name[-1]] = row
    images, texts = list(IMAGE_TOWERS), list(TEXT_TOWERS)
    fig, axes = plt.subplots(1, len(GRID_METRICS), figsize=(10, 4))
    for ax, (metric, title) in zip(axes, GRID_METRICS, strict=True):
        grid = [[_mean_std(cells[i, t][metric])[0] for t in texts] for i in images]
        im = ax.imshow(grid, cmap="viridis", origin="lower")
        for a, i in enumerate(images):
            for b, t in enumerate(texts):
                mean, std = _mean_std(cells[i, t][metric])
                ax.text(b, a, f"{mean:.1f}\n± {std:.1f}", ha="center", va="center", color="white", fontsize=8)
        ax.set_xticks(range(len(texts)))
        ax.set_xticklabels([f"text {t}" for t in texts])
        ax.set_yticks(range(len(images)))
        ax.set_yticklabels([f"image {i}" for i in images])
        ax.set_title(title, fontsize=9)
        fig.colorbar(im, ax=ax, shrink=0.8)
    return fig
