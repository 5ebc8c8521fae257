"""Plots the benches share."""

from __future__ import annotations

from pathlib import Path


def paired_bars(path: Path, title: str, labels: list[str], left: tuple[str, list[float]],
                right: tuple[str, list[float]], ylabel: str, log: bool = False) -> None:
    """Two bars per label (left and right: (legend, values)), side by side; written to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = range(len(labels))
    figure, axes = plt.subplots(figsize=(1.8 * len(labels) + 3, 4))
    for offset, (legend, values) in ((-0.2, left), (0.2, right)):
        axes.bar([x + offset for x in xs], values, 0.4, label=legend)
    axes.set_xticks(list(xs), labels)
    if log:
        axes.set_yscale("log")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
