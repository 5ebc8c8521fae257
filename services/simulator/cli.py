"""`reconfig simulate`: run KV placement policies over a trace or Poisson workload and report."""

from __future__ import annotations

import argparse
import json
import sys

from services.placement.policy import POLICY_NAMES
from services.placement.types import KVSchedulerConfig
from services.simulator.engine import InstanceProfile, SimulationConfig, build_events, simulate
from services.simulator.report import format_table, plot_timelines, workload_json
from services.simulator.trace import Workload, load_trace, poisson_workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `reconfig simulate`."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="CSV", help="TIMESTAMP,ContextTokens,GeneratedTokens trace")
    source.add_argument("--poisson-rate", type=float, metavar="LAMBDA", help="Poisson arrivals per second")
    parser.add_argument("--num-requests", type=int, default=5000, help="Poisson: how many requests")
    parser.add_argument("--prompt-mean", type=float, default=1024.0, help="Poisson: mean prompt tokens")
    parser.add_argument("--output-mean", type=float, default=256.0, help="Poisson: mean output tokens")
    parser.add_argument("--length-distribution", choices=("lognormal", "exponential"), default="lognormal")
    parser.add_argument("--length-sigma", type=float, default=1.0, help="Poisson: lognormal sigma")
    parser.add_argument("--seed", type=int, default=0, help="Poisson: random seed")
    parser.add_argument("--time-scale", type=float, default=1.0, help="trace: multiply inter-arrival gaps")
    parser.add_argument("--max-requests", type=int, default=None, help="trace: read only the first N")
    parser.add_argument("--policy", choices=(*POLICY_NAMES, "all"), default="all")
    parser.add_argument("--kv-capacity", type=int, default=16384, metavar="TOKENS", help="KV tokens per instance")
    parser.add_argument("--kv-bytes-per-token", type=int, default=524288)
    parser.add_argument("--decode-tokens-per-s", type=float, default=25.0, help="per request, per instance")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=4000.0)
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    parser.add_argument("--link-gbytes-per-s", type=float, default=25.0, help="migration link bandwidth")
    parser.add_argument("--max-migrations-per-op", type=int, default=10)
    parser.add_argument("--max-instances", type=int, default=None, metavar="N",
                        help="at most N instances: a request no instance has room for waits, and runs later")
    parser.add_argument("--batch-ms", type=float, default=0.0, help="batch operations in windows of this many ms")
    parser.add_argument("--update-ms", type=float, default=0.0,
                        help="the policy sees the requests' growth once per this many ms, as a front router's policy "
                             "period (arrivals and departures at once; 0: every growth when it happens)")
    parser.add_argument("--move-ms", type=float, default=0.0,
                        help="a move takes this many ms from the policy's decision to its commit: one of a request "
                             "that ends sooner is not made, and none starts while one of the same request is under "
                             "way (0: moves are instant)")
    parser.add_argument("--max-concurrent-moves", type=int, default=0, metavar="N",
                        help="with --move-ms: at most N moves under way at once, as a front router's (0: any)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", metavar="PNG", help="write instances in use over time, all policies")


def _workload(args: argparse.Namespace) -> Workload:
    if args.trace:
        return load_trace(args.trace, time_scale=args.time_scale, max_requests=args.max_requests)
    return poisson_workload(args.poisson_rate, args.num_requests, args.prompt_mean, args.output_mean,
                            args.length_distribution, args.length_sigma, args.seed)


def run(args: argparse.Namespace) -> int:
    """Simulate the chosen policies; print a table (or JSON) and optionally write the plot."""
    try:
        profile = InstanceProfile(
            kv_capacity_tokens=args.kv_capacity, kv_bytes_per_token=args.kv_bytes_per_token,
            decode_tokens_per_s=args.decode_tokens_per_s, prefill_tokens_per_s=args.prefill_tokens_per_s,
            block_size=args.block_size, link_bytes_per_s=args.link_gbytes_per_s * 1e9)
        config = SimulationConfig(
            profile=profile, batch_interval_s=args.batch_ms / 1000.0, update_interval_s=args.update_ms / 1000.0,
            move_s=args.move_ms / 1000.0, max_concurrent_moves=args.max_concurrent_moves,
            scheduler=KVSchedulerConfig(capacity=args.kv_capacity, max_migrations_per_op=args.max_migrations_per_op,
                                        max_instances=args.max_instances))
        workload = _workload(args)
    except (OSError, ValueError) as error:
        print(f"simulate: {error}", file=sys.stderr)
        return 2
    events = build_events(workload, profile)
    policies = POLICY_NAMES if args.policy == "all" else (args.policy,)
    results = {name: simulate(name, events, config) for name in policies}
    title = f"{workload.source}: {len(workload)} requests, C={args.kv_capacity} tokens"
    if events.num_rejected:
        title += f" ({events.num_rejected} larger than C skipped)"
    if args.max_instances is not None:
        waits = ", ".join(f"{name} {r.num_waited} (mean {r.mean_wait_s:.2f} s)" for name, r in results.items())
        title += f"; at most {args.max_instances} instances, requests that waited for room: {waits}"
    if args.json:
        print(json.dumps(workload_json(title, results), indent=2))
    else:
        print(format_table(title, results))
    if args.plot:
        plot_timelines([(title, results)], args.plot)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m services.simulator`."""
    parser = argparse.ArgumentParser(prog="reconfig simulate", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
