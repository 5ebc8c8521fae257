"""MELL vs Best-Fit, Worst-Fit and Llumnix-style load balancing on the Azure trace and Poisson workloads.

Prints one table per workload and a summary (instances peak / time-average, memory utilization,
migrations per second, migrated bytes, MELL's % fewer instances than each baseline); writes
bench/results/mell.json and bench/results/mell.png (instances in use over time, all policies).

    .venv/bin/python bench/mell.py [--trace PATH] [--num-requests N] [--rates 2 5 10]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.placement import POLICY_NAMES  # noqa: E402
from services.simulator.engine import InstanceProfile, SimulationConfig, build_events, simulate  # noqa: E402
from services.simulator.report import format_table, plot_timelines, savings, workload_json  # noqa: E402
from services.simulator.trace import load_trace, poisson_workload  # noqa: E402

DEFAULT_TRACE = REPO / ".." / "shared" / "traces" / "azure_llm_2023_conv.csv"


def _run_all(workload, config: SimulationConfig) -> dict:
    events = build_events(workload, config.profile)
    return {name: simulate(name, events, config) for name in POLICY_NAMES}


def _summary_row(title: str, results: dict) -> dict:
    saved = savings(results)
    return {
        "workload": title,
        **{f"{name}_mean_instances": results[name].mean_instances for name in POLICY_NAMES},
        **{f"mell_fewer_than_{name}_pct": saved[name] for name in ("bf", "wf", "lb")},
        "mell_migrations_per_s": results["mell"].migrations_per_s,
        "lb_migrations_per_s": results["lb"].migrations_per_s,
        "bf_migrations_per_s": results["bf"].migrations_per_s,
    }


def _print_summary(rows: list[dict]) -> None:
    print("\nSummary: time-average instances in use, MELL's savings, migrations per second")
    print(f"{'workload':<34} {'mell':>6} {'bf':>6} {'wf':>6} {'lb':>6}   {'vs bf':>6} {'vs wf':>6} {'vs lb':>6}"
          f"   {'mell mig/s':>10} {'lb mig/s':>9}")
    for row in rows:
        print(f"{row['workload']:<34} {row['mell_mean_instances']:6.2f} {row['bf_mean_instances']:6.2f} "
              f"{row['wf_mean_instances']:6.2f} {row['lb_mean_instances']:6.2f}   "
              f"{row['mell_fewer_than_bf_pct']:5.1f}% {row['mell_fewer_than_wf_pct']:5.1f}% "
              f"{row['mell_fewer_than_lb_pct']:5.1f}%   {row['mell_migrations_per_s']:10.3f} "
              f"{row['lb_migrations_per_s']:9.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--rates", type=float, nargs=3, default=[2.0, 5.0, 10.0], help="Poisson arrivals/s")
    parser.add_argument("--num-requests", type=int, default=6000, help="per Poisson workload")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    started = time.perf_counter()
    profile = InstanceProfile()  # Llama-2-7B fp16: 16,384 KV tokens per instance, 0.5 MiB a token
    config = SimulationConfig(profile=profile)
    workloads = [
        ("azure conv trace", load_trace(args.trace)),
        ("azure conv trace, 4x denser", load_trace(args.trace, time_scale=0.25)),
        *[(f"poisson {rate:g}/s", poisson_workload(rate, args.num_requests, 1024, 256, seed=args.seed))
          for rate in args.rates],
    ]
    panels, report, rows = [], [], []
    for title, workload in workloads:
        results = _run_all(workload, config)
        heading = f"{title}: {len(workload)} requests, {workload.arrival_s[-1]:.0f} s of arrivals"
        print(format_table(heading, results), end="\n\n")
        panels.append((heading, results))
        report.append(workload_json(heading, results))
        rows.append(_summary_row(title, results))
    # Batching: the same trace with operations grouped into steps (departs, updates, allocates; one
    # consolidation per step; migrations coalesced per request).
    unbatched = panels[0][1]["mell"]
    batching = {"unbatched": {"migrations": unbatched.migrations, "mean_instances": unbatched.mean_instances}}
    for window in (0.1, 0.5):
        batched = simulate("mell", build_events(workloads[0][1], profile),
                           SimulationConfig(profile=profile, batch_interval_s=window))
        batching[f"{window * 1000:g} ms"] = {"migrations": batched.migrations,
                                             "mean_instances": batched.mean_instances}
        print(f"mell on the azure trace, {window * 1000:g} ms batches: {batched.migrations} migrations "
              f"({batched.mean_instances:.2f} instances) vs {unbatched.migrations} unbatched "
              f"({unbatched.mean_instances:.2f})")
    # Adaptive migration choice: with slow links between instances, part of the moves re-prefill.
    choice = {}
    for link_gbytes in (25.0, 1.0):
        slow = InstanceProfile(link_bytes_per_s=link_gbytes * 1e9)
        result = simulate("mell", build_events(workloads[0][1], slow), SimulationConfig(profile=slow))
        choice[link_gbytes] = {"migrations": result.migrations, "kv_bytes": result.migrated_bytes,
                               "reprefill_tokens": result.reprefill_tokens,
                               "deferred": result.deferred_migrations, "oversized": result.oversized_migrations}
        print(f"mell on the azure trace, {link_gbytes:g} GB/s links: {result.migrated_bytes / 1e9:.0f} GB as KV, "
              f"{result.reprefill_tokens} tokens re-prefilled, {result.deferred_migrations} waited an interval, "
              f"{result.oversized_migrations} larger than one interval's budgets")
    _print_summary(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "profile": {field: getattr(profile, field) for field in profile.__slots__},
        "scheduler": {field: getattr(config.scheduler_config(), field)
                      for field in config.scheduler_config().__slots__},
        "workloads": report, "summary": rows,
        "batching": batching,
        "migration_choice_by_link_gbytes_per_s": choice,
        "wall_s": time.perf_counter() - started,
    }
    (args.out / "mell.json").write_text(json.dumps(payload, indent=2))
    plot_timelines(panels, str(args.out / "mell.png"))
    print(f"\nwrote {args.out / 'mell.json'} and {args.out / 'mell.png'} in {payload['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
