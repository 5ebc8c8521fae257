"""MoE serving: decode tok/s of tensor- vs expert-parallel layouts, and EPLB under a skewed router.

    python bench/moe.py [--model tiny-moe] [--batch-sizes 1,8,32,64] [--quick]

Part 1 starts a LocalCluster per layout (tpXpp1 and epXpp1, X = 2 and 4 workers) and runs the offline
`generate` loop (DP-aware in EP layouts) at each batch size. Part 2 copies the checkpoint, skews its routers
towards the experts that live only on rank 0, serves it as ep2pp1 with 2 redundant experts through an in-process
router engine, and rebalances the experts while requests decode.
Prints a markdown table, writes JSON (raw numbers, machine info) and a plot next to it.
Heavy imports stay inside functions: worker processes re-import this module as `__mp_main__`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULTS = dict(batch_sizes="1,8,32,64", widths="2,4", prompt_len=16, new_tokens=32, repeats=2, eplb_tokens=32)
QUICK = dict(batch_sizes="1,8", widths="2", prompt_len=8, new_tokens=8, repeats=1, eplb_tokens=16)
NUM_BYTE_TOKENS = 256  # prompts are random byte tokens of the presets' tokenizer
NUM_REDUNDANT = 2      # EPLB part: spare expert slots per layer
EPLB_EP = 2            # EPLB part: ep2pp1
EPLB_REQUESTS = 16


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What to measure."""

    model: str
    batch_sizes: tuple[int, ...]
    widths: tuple[int, ...]               # workers per layout: tp{X}pp1 vs ep{X}pp1
    prompt_len: int
    new_tokens: int
    repeats: int                          # timed runs per point; the fastest is kept
    eplb_tokens: int                      # greedy tokens per request in the EPLB rounds
    skip_eplb: bool
    seed: int
    out: Path

    def __post_init__(self) -> None:
        if self.new_tokens < 2 or self.prompt_len < 1 or self.repeats < 1:
            raise ValueError("need --new-tokens >= 2, --prompt-len >= 1, --repeats >= 1")


@dataclass(slots=True)
class Decode:
    """One layout at one batch size: decode seconds = a full generate minus a prefill-only generate."""

    topology: str
    num_workers: int
    batch_size: int
    prefill_seconds: float
    total_seconds: float
    num_decode_steps: int
    tokens: list[list[int]] = field(default_factory=list)
    matches_tp: bool | None = None        # EP rows: same greedy tokens as tp at the same width and batch

    @property
    def decode_seconds(self) -> float:
        return max(self.total_seconds - self.prefill_seconds, 1e-9)

    @property
    def tokens_per_second(self) -> float:
        return self.batch_size * self.num_decode_steps / self.decode_seconds


@dataclass(slots=True)
class Eplb:
    """The skewed ep2pp1 run: three rounds of the same requests, a rebalance during the second."""

    hot_experts: list[int]
    skew_shares: dict[int, float]         # per sparse layer: share of routing choices that go to hot experts
    balancedness_before: float
    balancedness_predicted: float
    balancedness_after: float
    epoch: int
    bytes_moved: int
    slots_changed: int
    prepare_seconds: float
    commit_seconds: float
    in_flight_at_rebalance: int           # requests of round 2 not finished when rebalance() returned
    round_seconds: list[float]            # wall time of rounds 1 (old map), 2 (rebalance inside), 3 (new map)
    num_tokens: int                       # generated tokens per round
    outputs_identical: bool


def make_prompts(config: BenchConfig, count: int, length: int, seed_offset: int = 0) -> list[list[int]]:
    """Random byte-token prompts (ids 3..255: no special tokens)."""
    import numpy as np

    rng = np.random.default_rng(config.seed + seed_offset)
    return rng.integers(3, NUM_BYTE_TOKENS, size=(count, length)).tolist()


async def _measure_layout(addresses: list[str], topology: str, num_workers: int, config: BenchConfig,
                          prompts: list[list[int]]) -> list[Decode]:
    from services.launch.generate import generate
    from services.router.driver import Driver

    results = []
    async with Driver(addresses) as driver:
        for batch_size in config.batch_sizes:
            batch = prompts[:batch_size]
            await generate(driver, batch, 2)  # warm-up
            best = None
            for _ in range(config.repeats):
                started = time.perf_counter()
                await generate(driver, batch, 1)
                prefill = time.perf_counter() - started
                started = time.perf_counter()
                generations = await generate(driver, batch, config.new_tokens)
                total = time.perf_counter() - started
                run = Decode(topology, num_workers, batch_size, prefill, total, config.new_tokens - 1,
                             [g.token_ids for g in generations])
                if best is None or run.decode_seconds < best.decode_seconds:
                    best = run
            results.append(best)
            _log(f"{topology} batch={batch_size}: {best.tokens_per_second:.1f} decode tok/s")
    return results


def measure_decode(config: BenchConfig) -> list[Decode]:
    """A LocalCluster per layout (only that layout's groups built), generate at every batch size."""
    from services.launch.cluster import ClusterConfig, LocalCluster

    prompts = make_prompts(config, max(config.batch_sizes), config.prompt_len)
    results = []
    for width in config.widths:
        for topology in (f"tp{width}pp1", f"ep{width}pp1"):
            cluster_config = ClusterConfig(model=config.model, num_workers=width, topology=topology,
                                           candidate_topologies=(topology,), env={"RECONFIG_LOG_LEVEL": "WARNING"})
            with LocalCluster(cluster_config) as cluster:
                results += asyncio.run(_measure_layout(cluster.worker_addresses, topology, width, config, prompts))
    reference = {(m.num_workers, m.batch_size): m for m in results if m.topology.startswith("tp")}
    for m in results:
        if m.topology.startswith("ep"):
            m.matches_tp = m.tokens == reference[m.num_workers, m.batch_size].tokens
    return results


def hot_experts(num_experts: int, num_physical: int, ep: int) -> list[int]:
    """The experts whose every copy sits on rank 0 in the map the workers start with."""
    from services.topology.eplb import initial_phy2log

    phy2log = initial_phy2log(num_experts, num_physical, ep)
    per_rank = len(phy2log) // ep
    return sorted(set(phy2log[:per_rank]) - set(phy2log[per_rank:]))


async def _eplb_rounds(cluster, config: BenchConfig, prompts: list[list[int]]) -> dict:
    from services.router.contracts import GenerationRequest
    from services.router.main import RouterConfig, build_engine

    async def tokens_of(engine, request) -> list[int]:
        return [t for delta in [d async for d in engine.generate(request)] for t in delta.token_ids]

    def start_round(engine, tag: str) -> list[asyncio.Future]:
        return [asyncio.ensure_future(tokens_of(engine, GenerationRequest(f"{tag}{i}", tuple(p), config.eplb_tokens)))
                for i, p in enumerate(prompts)]

    engine = await build_engine(RouterConfig(worker_addresses=tuple(cluster.worker_addresses),
                                             model_dir=str(cluster.model_dir), model_name="moe-bench"))
    try:
        started = time.perf_counter()
        first = await asyncio.gather(*start_round(engine, "a"))
        seconds = [time.perf_counter() - started]
        before = await engine.experts.status()
        _log(f"round 1 (skewed map) {seconds[0]:.2f}s, balancedness {before.balancedness:.3f}")

        started = time.perf_counter()
        tasks = start_round(engine, "b")
        while engine.stats().num_running < len(prompts):  # a bench, not a test: poll until all are decoding
            await asyncio.sleep(0.005)
        result = await engine.experts.rebalance()
        in_flight = sum(not t.done() for t in tasks)
        second = await asyncio.gather(*tasks)
        seconds.append(time.perf_counter() - started)
        _log(f"round 2 (rebalance inside) {seconds[1]:.2f}s, {in_flight} requests in flight after the commit")

        started = time.perf_counter()
        third = await asyncio.gather(*start_round(engine, "c"))
        seconds.append(time.perf_counter() - started)
        after = await engine.experts.status()
        _log(f"round 3 (new map) {seconds[2]:.2f}s, balancedness {after.balancedness:.3f}")
    finally:
        await engine.stop()
    return dict(balancedness_before=before.balancedness, balancedness_predicted=result.balancedness_after,
                balancedness_after=after.balancedness, epoch=int(result.epoch), bytes_moved=int(result.bytes_moved),
                slots_changed=int(result.slots_changed), prepare_seconds=result.prepare_seconds,
                commit_seconds=result.commit_seconds, in_flight_at_rebalance=in_flight, round_seconds=seconds,
                num_tokens=sum(len(t) for t in first), outputs_identical=first == second == third)


def measure_eplb(config: BenchConfig) -> Eplb:
    """Skew a copy of the checkpoint, serve it as ep2pp1 with redundant experts, rebalance under load."""
    import shutil
    import tempfile

    import transformers

    from services.launch.cluster import ClusterConfig, LocalCluster
    from services.model.presets import resolve_model
    from skew import skew_router  # bench/skew.py, beside this script
    from services.model.spec import ModelSpec

    transformers.utils.logging.disable_progress_bar()
    source = resolve_model(config.model)
    spec = ModelSpec.from_dir(source)
    hot = hot_experts(spec.num_experts, spec.num_experts + NUM_REDUNDANT, EPLB_EP)
    prompts = make_prompts(config, EPLB_REQUESTS, config.prompt_len, seed_offset=1)
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        model_dir = Path(tmp) / "skewed"
        shutil.copytree(source, model_dir)
        shares = skew_router(model_dir, hot, prompts)
        _log(f"skewed routers towards experts {hot} (rank 0 only): shares {[round(s, 2) for s in shares.values()]}")
        topology = f"ep{EPLB_EP}pp1"
        cluster_config = ClusterConfig(model=str(model_dir), num_workers=EPLB_EP, topology=topology,
                                       num_redundant_experts=NUM_REDUNDANT, candidate_topologies=(topology,),
                                       env={"RECONFIG_LOG_LEVEL": "WARNING"})
        with LocalCluster(cluster_config) as cluster:
            measured = asyncio.run(_eplb_rounds(cluster, config, prompts))
    return Eplb(hot_experts=hot, skew_shares={int(k): float(v) for k, v in shares.items()}, **measured)


def _log(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def format_table(config: BenchConfig, decodes: list[Decode], eplb: Eplb | None) -> str:
    """Markdown: tp vs ep decode tok/s per width and batch, then the EPLB run."""
    by = {(m.topology, m.batch_size): m for m in decodes}
    lines = ["| workers | batch | tp decode tok/s | ep decode tok/s | ep / tp | tp prefill ms | ep prefill ms "
             "| ep tokens = tp |", "|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for width in config.widths:
        for batch in config.batch_sizes:
            tp, ep = by[f"tp{width}pp1", batch], by[f"ep{width}pp1", batch]
            lines.append(f"| {width} | {batch} | {tp.tokens_per_second:.1f} | {ep.tokens_per_second:.1f} | "
                         f"{ep.tokens_per_second / tp.tokens_per_second:.2f}x | {1e3 * tp.prefill_seconds:.1f} | "
                         f"{1e3 * ep.prefill_seconds:.1f} | {'✓' if ep.matches_tp else '✗'} |")
    lines += ["", f"Notes: {config.model}, {len(os.sched_getaffinity(0))} CPUs, prompts of {config.prompt_len} "
              f"tokens, {config.new_tokens} greedy tokens, fastest of {config.repeats}. decode tok/s = batch x "
              f"{config.new_tokens - 1} / (generate(N tokens) - generate(1 token)) seconds, through the offline "
              "`generate` loop over a Driver (gRPC round trips included; EP spreads requests over the DP ranks). "
              "Workers use reconfig's default threads (usable cores // active workers). "
              "ep tokens = tp: greedy tokens equal (float sums in another order may flip a near-tie)."]
    if eplb is not None:
        rounds = eplb.round_seconds
        rate = [eplb.num_tokens / s for s in rounds]
        lines += ["", f"EPLB: ep{EPLB_EP}pp1, {NUM_REDUNDANT} redundant experts, routers skewed towards experts "
                  f"{eplb.hot_experts} (all their copies on rank 0; share of routing choices "
                  f"{min(eplb.skew_shares.values()):.2f}-{max(eplb.skew_shares.values()):.2f}), {EPLB_REQUESTS} "
                  f"requests x {eplb.num_tokens // EPLB_REQUESTS} greedy tokens per round.", "",
                  "| balancedness before | predicted after | measured after | bytes moved | slots changed "
                  "| prepare ms | commit ms | in flight at commit | outputs identical (3 rounds) |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
                  f"| {eplb.balancedness_before:.3f} | {eplb.balancedness_predicted:.3f} | "
                  f"{eplb.balancedness_after:.3f} | {eplb.bytes_moved} ({eplb.bytes_moved / 2**20:.2f} MiB) | "
                  f"{eplb.slots_changed} | {1e3 * eplb.prepare_seconds:.1f} | {1e3 * eplb.commit_seconds:.1f} | "
                  f"{eplb.in_flight_at_rebalance} / {EPLB_REQUESTS} | {'✓' if eplb.outputs_identical else '✗'} "
                  "|", "",
                  "| round | map | wall s | tok/s (prefill included) |", "|---|---|---:|---:|",
                  f"| 1 | skewed (initial) | {rounds[0]:.2f} | {rate[0]:.1f} |",
                  f"| 2 | rebalanced mid-round | {rounds[1]:.2f} | {rate[1]:.1f} |",
                  f"| 3 | rebalanced | {rounds[2]:.2f} | {rate[2]:.1f} |", "",
                  "balancedness = mean / max rank load over the sparse layers (1.0 = even), from the workers' load "
                  "windows; predicted = the planner's figure for the new map on the window before it."]
    return "\n".join(lines)


def plot(config: BenchConfig, decodes: list[Decode], eplb: Eplb | None, path: Path) -> None:
    """Left: decode tok/s by batch, one line per layout. Right: balancedness before / predicted / measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2 if eplb else 1, figsize=(11 if eplb else 6, 4.5), squeeze=False)
    left = axes[0][0]
    for topology in dict.fromkeys(m.topology for m in decodes):
        rows = sorted((m for m in decodes if m.topology == topology), key=lambda m: m.batch_size)
        left.plot([m.batch_size for m in rows], [m.tokens_per_second for m in rows], marker="o",
                  linestyle="--" if topology.startswith("ep") else "-", label=topology)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("batch")
    left.set_ylabel("decode tokens/s (log)")
    left.set_title(f"{config.model}: tp vs ep decode")
    left.legend(fontsize=8)
    left.grid(alpha=0.3, which="both")
    if eplb:
        right = axes[0][1]
        values = [eplb.balancedness_before, eplb.balancedness_predicted, eplb.balancedness_after]
        right.bar(["before", "predicted after", "measured after"], values, color=["C3", "C1", "C2"])
        for x, value in enumerate(values):
            right.annotate(f"{value:.2f}", (x, value), ha="center", va="bottom")
        right.set_ylim(0, 1.1)
        right.set_ylabel("balancedness (mean / max rank load)")
        right.set_title(f"EPLB under skew, ep{EPLB_EP}pp1 +{NUM_REDUNDANT} redundant "
                        f"({eplb.bytes_moved / 2**20:.2f} MiB moved)")
        right.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def machine_info() -> dict:
    import torch

    return {"cpu_count": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "processor": platform.processor(),
            "loadavg": os.getloadavg()}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in str(text).split(",") if part.strip())


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-moe", help="MoE preset or checkpoint dir")
    parser.add_argument("--batch-sizes", help=f"comma-separated (default {DEFAULTS['batch_sizes']})")
    parser.add_argument("--widths", help=f"workers per layout, tpXpp1 vs epXpp1 (default {DEFAULTS['widths']})")
    parser.add_argument("--prompt-len", type=int, help=f"prompt tokens (default {DEFAULTS['prompt_len']})")
    parser.add_argument("--new-tokens", type=int, help=f"tokens per prompt (default {DEFAULTS['new_tokens']})")
    parser.add_argument("--repeats", type=int, help=f"timed runs per point (default {DEFAULTS['repeats']})")
    parser.add_argument("--eplb-tokens", type=int,
                        help=f"tokens per EPLB request (default {DEFAULTS['eplb_tokens']})")
    parser.add_argument("--skip-eplb", action="store_true", help="only the tp vs ep decode part")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/moe.json"))
    parser.add_argument("--quick", action="store_true", help=f"smoke-run sizes: {QUICK}")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    pick = {key: getattr(args, key) if getattr(args, key) is not None else default for key, default in base.items()}
    return BenchConfig(model=args.model, batch_sizes=_ints(pick["batch_sizes"]), widths=_ints(pick["widths"]),
                       prompt_len=pick["prompt_len"], new_tokens=pick["new_tokens"], repeats=pick["repeats"],
                       eplb_tokens=pick["eplb_tokens"], skip_eplb=args.skip_eplb, seed=args.seed, out=args.out)


def main(argv: list[str] | None = None) -> None:
    from services.logs import configure_logging

    configure_logging("bench", "WARNING")
    config = parse_args(argv)
    started = time.perf_counter()
    print(f"moe bench: {config.model}, widths {config.widths}, batches {config.batch_sizes}", file=sys.stderr)
    decodes = measure_decode(config)
    eplb = None if config.skip_eplb else measure_eplb(config)
    table = format_table(config, decodes, eplb)
    print(table)
    elapsed = time.perf_counter() - started
    payload = {"bench": "moe", "config": {**asdict(config), "out": str(config.out)}, "machine": machine_info(),
               "wall_seconds": elapsed,
               "decode": [{**asdict(m), "decode_seconds": m.decode_seconds, "tokens_per_second": m.tokens_per_second}
                          for m in decodes],
               "eplb": asdict(eplb) if eplb else None, "table": table}
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(payload, indent=1) + "\n")
    plot_path = config.out.with_suffix(".png")
    plot(config, decodes, eplb, plot_path)
    print(f"\nwrote {config.out} and {plot_path} in {elapsed:.0f}s", file=sys.stderr)
    if eplb and not eplb.outputs_identical:
        raise SystemExit("EPLB changed the outputs (see the table)")


if __name__ == "__main__":
    main()
