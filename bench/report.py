"""What the side-by-side benches share for their output (pipeline, async_steps, after_switch): their defaults, the
report (a markdown table printed, JSON with the run's config and machine, a plot next to it) and a paired-bar plot.
Stdlib only at import time."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from switch import machine_info


def apply_defaults(args: argparse.Namespace, defaults: dict) -> None:
    """Each setting the command line left unset (None) takes its default."""
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def write_report(args: argparse.Namespace, title: str, table: str, rows: list[dict],
                 plot: Callable[[list[dict], Path, str], None], **extra) -> None:
    """Print `table` under `title`, write args.out (config, machine, `extra`, rows) and its plot (.png)."""
    print(f"\n# {title}\n\n{table}\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(config={k: str(v) for k, v in vars(args).items()}, machine=machine_info(),
                                        **extra, rows=rows), indent=1) + "\n")
    plot(rows, args.out.with_suffix(".png"), title)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


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
