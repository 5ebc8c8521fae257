"""Simulation results as a text table, JSON, and a plot of instances in use over time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.simulator.engine import SimulationResult

_COLUMNS = (  # (header, width, format spec)
    ("policy", 6, "<"), ("peak", 5, ">"), ("mean", 7, ">.2f"), ("bound", 6, ">.2f"), ("util", 6, ">.1%"),
    ("mig/s", 7, ">.3f"), ("items", 7, ">"), ("migrated GB", 12, ">.1f"), ("reprefill tok", 13, ">"),
    ("max items/op", 12, ">"),
)


def savings(results: Mapping[str, SimulationResult], policy: str = "mell") -> dict[str, float]:
    """Percent fewer instances (time-average) `policy` needs than each other policy."""
    if policy not in results:
        return {}
    mine = results[policy].mean_instances
    return {name: 100.0 * (1.0 - mine / other.mean_instances)
            for name, other in results.items() if name != policy and other.mean_instances > 0}


def format_table(title: str, results: Mapping[str, SimulationResult]) -> str:
    """One workload's results, a row per policy, then MELL's savings against the others."""
    header = "  ".join(f"{name:{'<' if spec == '<' else '>'}{width}}" for name, width, spec in _COLUMNS)
    lines = [title, header]
    for result in results.values():
        values = (result.policy, result.peak_instances, result.mean_instances, result.mean_instances_lower_bound,
                  result.memory_utilization, result.migrations_per_s, result.migration_items,
                  result.migrated_bytes / 1e9, result.reprefill_tokens, result.max_items_per_operation)
        lines.append("  ".join(format(value, f"{spec[0]}{width}{spec[1:]}")
                               for (_, width, spec), value in zip(_COLUMNS, values)))
    saved = savings(results)
    if saved:
        lines.append("mell needs " + ", ".join(f"{pct:.1f}% fewer instances than {name}"
                                               for name, pct in saved.items()))
    return "\n".join(lines)


def result_json(result: SimulationResult) -> dict:
    """The JSON object of one policy's result (the timeline left out)."""
    return {
        "policy": result.policy, "duration_s": result.duration_s, "num_admitted": result.num_admitted,
        "num_rejected": result.num_rejected, "num_allocated": result.num_allocated,
        "num_departed": result.num_departed, "num_unplaced": result.num_unplaced,
        "final_instances": result.final_instances, "peak_instances": result.peak_instances,
        "mean_instances": result.mean_instances, "mean_instances_lower_bound": result.mean_instances_lower_bound,
        "memory_utilization": result.memory_utilization, "migrations": result.migrations,
        "migrations_per_s": result.migrations_per_s, "migration_items": result.migration_items,
        "migrations_by_reason": result.migrations_by_reason,
        "max_items_per_operation": result.max_items_per_operation, "migrated_bytes": result.migrated_bytes,
        "reprefill_tokens": result.reprefill_tokens, "deferred_migrations": result.deferred_migrations,
        "oversized_migrations": result.oversized_migrations, "num_waited": result.num_waited,
        "mean_wait_s": result.mean_wait_s, "wall_s": result.wall_s,
    }


def workload_json(title: str, results: Mapping[str, SimulationResult]) -> dict:
    """One workload: every policy's result and MELL's percent savings."""
    return {"workload": title, "policies": {name: result_json(r) for name, r in results.items()},
            "mell_fewer_instances_pct": savings(results)}


def plot_timelines(panels: Sequence[tuple[str, Mapping[str, SimulationResult]]], path: str) -> None:
    """Instances in use over time, one panel per workload, every policy in each (PNG via Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(panels), 1, figsize=(11, 3.2 * len(panels)), squeeze=False)
    for axis, (title, results) in zip(axes[:, 0], panels):
        for name, result in results.items():
            if not result.timeline:
                continue
            times = [t - result.timeline[0][0] for t, _ in result.timeline]
            counts = [count for _, count in result.timeline]
            axis.step(times, counts, where="post", linewidth=0.9,
                      label=f"{name} (mean {result.mean_instances:.2f})")
        axis.set_title(title)
        axis.set_xlabel("time (s)")
        axis.set_ylabel("instances in use")
        axis.legend(loc="upper right", fontsize=8)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
