"""Layers per pipeline stage split by the workers' measured speed, against the even split, on one stack in one run.

    .venv/bin/python bench/balance.py [--model smollm2-135m] [--topology tp1pp4] [--slow RANK:FACTOR] [--quick]

The calibration's pipeline waves time each worker's layers and the last stage's head (final norm, lm_head,
sampling) on its own, without the waits for the previous stage; the profile turns that into the split that
minimises the slowest stage (services/topology/balance.py). This bench measures decode TPOT through the router at
several batch sizes with the even split and with that split, alternating A-B-A-B on the same stack so that drift of
a busy machine falls on both. `--slow 1:3` makes worker 1 three times slower (a fault rule: a slower device).
Prints a table, writes bench/results/balance.json and balance.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from switch import BenchConfig, machine_info, start_stack, stop_stack  # noqa: E402


async def _tpot(reconfigurer, batch: int, prompt: int, output: int, vocab: int, rng: random.Random) -> float:
    from services.controller.autopilot.calibrate import measure_load

    decode, _ = await measure_load(reconfigurer.router, reconfigurer.metadata, "-", batch, prompt, output, vocab, rng)
    return decode.tpot_s


async def run(args: argparse.Namespace) -> dict:
    from services.controller.autopilot.calibrate import CalibrationPlan, calibrate, prompt_vocabulary
    from services.controller.autopilot.profile import balanced_split

    config = BenchConfig(model=args.model, chain=(args.topology, args.topology), num_workers=args.num_workers,
                         num_requests=1, prompt_len=args.prompt, max_tokens=2, steps_between=0,
                         kv_cache_mb=args.kv_cache_mb, block_size=16, restart_all=False, memcpy_mb=0, seed=0,
                         out=args.out)
    faults = ""
    if args.slow:
        rank, factor = args.slow.split(":")
        faults = f"forward:rank={int(rank)}:slow={float(factor)}"
    stack, _, _ = await start_stack(config, args.topology, faults=faults)
    try:
        reconfigurer = stack.reconfigurer
        vocab, rng = prompt_vocabulary(reconfigurer), random.Random(0)
        print("calibrating the pipeline ...", file=sys.stderr, flush=True)
        profile = await calibrate(reconfigurer, CalibrationPlan(layouts=(args.topology,), batch_sizes=(1, 8),
                                                                prompt_tokens=(args.prompt,), output_tokens=16),
                                  args.model, "bench")
        # The model's proposal, measured here whatever the calibration decided (it keeps a split only if faster).
        balanced = balanced_split(profile.worker_speeds, profile.num_layers, args.topology)
        speeds = {w.rank: (w.layer_s, w.head_ratio) for w in profile.worker_speeds}
        splits = {"even": None, "balanced": balanced}
        tpots: dict[str, dict[int, list[float]]] = {name: {b: [] for b in args.batches} for name in splits}
        if balanced is not None:
            for _ in range(args.rounds):
                for name, partition in splits.items():
                    op = await reconfigurer.reconfigure(args.topology, layer_partition=partition or ())
                    assert op.state.name == "SUCCEEDED", op.error
                    for batch in args.batches:
                        tpots[name][batch].append(await _tpot(reconfigurer, batch, args.prompt, args.output,
                                                              vocab, rng))
        return {"config": vars(args) | {"out": str(args.out)}, "machine": machine_info(),
                "worker_layer_ms": {r: s * 1e3 for r, (s, _) in speeds.items()},
                "head_layers": max((h for _, h in speeds.values()), default=0.0),
                "even": [len(r) for r in _even(profile.num_layers, args.topology)],
                "balanced": list(balanced) if balanced else None,
                "adopted_by_calibration": list(profile.layer_partition(args.topology) or []),
                "tpot_ms": {name: {b: [t * 1e3 for t in v] for b, v in per.items()} for name, per in tpots.items()}}
    finally:
        await stop_stack(stack)


def _even(num_layers: int, topology: str):
    from services.topology import Topology
    from services.topology.placement import layer_partition

    return layer_partition(num_layers, Topology.parse(topology).pp)


def format_table(result: dict) -> str:
    lines = ["per layer and step: " + ", ".join(f"rank {r} {ms:.2f} ms" for r, ms in result["worker_layer_ms"].items())
             + f"; last stage's head = {result['head_layers']:.1f} layers",
             f"even split {result['even']}  ->  by speed {result['balanced']} (the calibration adopted: "
             f"{result['adopted_by_calibration'] or 'none'})"]
    if result["balanced"] is None:
        lines.append("the even split is already within 5% of the best: nothing to compare")
        return "\n".join(lines)
    lines.append(f"{'batch':>5}  {'even TPOT ms':>12}  {'by speed ms':>11}  {'speed-up':>8}")
    for batch in result["config"]["batches"]:
        even = statistics.median(result["tpot_ms"]["even"][batch])
        fast = statistics.median(result["tpot_ms"]["balanced"][batch])
        lines.append(f"{batch:5d}  {even:12.1f}  {fast:11.1f}  {even / fast:7.2f}x")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if result["balanced"] is None:
        return
    batches = result["config"]["batches"]
    figure, axis = plt.subplots(figsize=(6, 4))
    for name in ("even", "balanced"):
        label = f"{name} {result[name]}"
        axis.plot(batches, [statistics.median(result["tpot_ms"][name][b]) for b in batches], marker="o", label=label)
    axis.set_xlabel("requests decoding together")
    axis.set_ylabel("TPOT (ms, median of rounds)")
    axis.set_title(f"{result['config']['model']} {result['config']['topology']}: layers by measured speed")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    from services.logs import configure_logging

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--topology", default="tp1pp4")
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--kv-cache-mb", type=int, default=64)
    parser.add_argument("--slow", default="", metavar="RANK:FACTOR", help="make one worker FACTOR times slower")
    parser.add_argument("--batches", type=lambda t: [int(v) for v in t.split(",")], default=[1, 4, 16])
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="A-B alternations")
    parser.add_argument("--out", type=Path, default=Path("bench/results/balance.json"))
    parser.add_argument("--quick", action="store_true", help="batches 1,4, one round, 12 tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.rounds, args.output = [1, 4], 1, 12
    configure_logging("bench", "WARNING")
    started = time.perf_counter()
    result = asyncio.run(run(args))
    result["seconds"] = time.perf_counter() - started
    print(format_table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} ({result['seconds']:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
