"""Async scheduling in a single-stage layout (one worker by default, `--topology tp2pp1` for TP ranks): the router
waiting for each step's tokens vs sending each decode's next step ahead (the workers feeding the token they
sampled), side by side in one run.

    python bench/async_steps.py [--models tiny-llama,smollm2-135m] [--active 1,16,64] [--reps 2] [--quick]
                                [--device cuda]

For each model, one stack (weightstore, the layout's workers, the router's engine in this process); for each number
of concurrent requests N, the same N greedy requests (random prompts, exactly --new-tokens each) run in both modes,
`--reps` times each, alternating (wait, ahead, ahead, wait, ...) so that drift hits both:
- `wait` (SchedulerConfig.async_scheduling off): the next step goes out once the previous one's tokens are back;
- `ahead` (the default): the engine keeps one step more in flight, each decode's next step sent before the one
  sampling its input returns, so the router's work (scheduling, the wire, the clients' streams) overlaps the
  worker's compute.
Reports generated tokens/s (submission to the last token; the mean over the reps), mean TPOT, the ratio
ahead / wait, the worker's model time over the wall time (how busy the router keeps it), the median time to first
token of 1-token requests arriving one at a time mid-decode (a run of its own per mode: what async scheduling costs
a new request), and whether both modes produced the same tokens. Prints a table, writes JSON and a plot
(bench/results/ by default).
Heavy imports stay inside functions: worker processes re-import this module as `__mp_main__`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import apply_defaults, paired_bars, write_report  # noqa: E402
from stack import REPO_ROOT  # noqa: E402
from streams import stream_all  # noqa: E402
from switch import MIB, random_prompts  # noqa: E402

DEFAULTS = dict(models="tiny-llama,smollm2-135m", active="1,16,64", prompt_len=32, new_tokens=64, reps=2)
QUICK = dict(models="tiny-llama", active="1,16", prompt_len=16, new_tokens=16, reps=1)
MODES = ("wait", "ahead")


def log(message: str) -> None:
    print(f"[async-steps {time.strftime('%H:%M:%S')}] {message}", flush=True)


async def run_mode(engine, prompts: list[list[int]], new_tokens: int, mode: str, tag: str,
                   probe: bool = False) -> dict:
    """The requests at once through `engine` in `mode`; tokens/s, TPOT, the worker's busy share, the tokens; with
    `probe`, also the median time to first token of requests arriving mid-decode (which disturb the rest)."""
    scheduler = engine.scheduler
    scheduler.config = dataclasses.replace(scheduler.config, async_scheduling=mode == "ahead")
    work_before = sum(w.forward_seconds + w.head_seconds for w in engine.driver.worker_times())
    streams = asyncio.ensure_future(stream_all(engine, prompts, new_tokens, f"{tag}-{mode}"))
    ttfts = await probe_ttfts(engine, streams, len(prompts), f"{tag}-{mode}") if probe else []
    result = await streams
    work = sum(w.forward_seconds + w.head_seconds for w in engine.driver.worker_times()) - work_before
    return dict(result, worker_busy=work / result["seconds"],
                probe_ttft_ms=statistics.median(ttfts) * 1e3 if ttfts else float("nan"))


async def probe_ttfts(engine, streams: asyncio.Future, num_streams: int, tag: str, num_probes: int = 8) -> list[float]:
    """While `streams` decode, one 1-token request at a time (an 8-token prompt), each once the streams have made
    two steps more: the time to its token, a request arriving mid-decode (async scheduling puts its prefill behind
    one more step)."""
    from services.router.contracts import GenerationRequest

    generated = lambda: engine.stats().num_generation_tokens  # noqa: E731
    ttfts, next_at = [], generated() + num_streams  # every stream has its first token
    while not streams.done() and len(ttfts) < num_probes:
        if generated() < next_at:
            await asyncio.sleep(0.001)  # a bench's poll, not a test's synchronization
            continue
        began, first = time.perf_counter(), None
        async for _ in engine.generate(GenerationRequest(f"{tag}-probe{len(ttfts)}", tuple(range(3, 11)), 1)):
            first = first or time.perf_counter()
        ttfts.append(first - began)
        next_at = generated() + 2 * num_streams
    return ttfts


async def run_model(args, model: str) -> list[dict]:
    from services.launch.cluster import ClusterConfig, LocalCluster
    from services.router.main import RouterConfig, build_engine
    from services.topology import Topology

    actives = [int(n) for n in args.active.split(",")]
    kv_mb = max(16, max(actives) * (args.prompt_len + args.new_tokens) * 80 // 1024)  # the presets' KV, generously
    topology = Topology.parse(args.topology)
    cluster = LocalCluster(ClusterConfig(model=model, num_workers=topology.num_workers, topology=args.topology,
                                         block_size=16,
                                         kv_cache_bytes=kv_mb * MIB, device=args.device,
                                         num_threads=args.worker_threads,
                                         gpus=(0,) if args.device == "cuda" else None,
                                         gpu_sharing=args.device == "cuda" and topology.num_workers > 1,
                                         env={"RECONFIG_LOG_LEVEL": "WARNING"}))
    cluster.start()
    rows = []
    try:
        engine = await build_engine(RouterConfig(worker_addresses=tuple(cluster.worker_addresses),
                                                 model_dir=str(cluster.model_dir), model_name=model,
                                                 max_num_seqs=max(128, max(actives))))
        try:
            for mode in MODES:  # warm both paths (first steps, and on a GPU the decode graphs)
                await run_mode(engine, random_prompts(max(actives), args.prompt_len, 7), 4, mode, "warmup")
            for n in actives:
                prompts = random_prompts(n, args.prompt_len, args.seed + n)
                runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
                for rep in range(args.reps):
                    for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                        runs[mode].append(await run_mode(engine, prompts, args.new_tokens, mode, f"n{n}-{rep}"))
                mean = {mode: {key: statistics.mean(r[key] for r in runs[mode])
                               for key in ("tokens_per_s", "tpot_ms", "seconds", "worker_busy")} for mode in MODES}
                for mode in MODES:  # apart from the runs above: the probes take steps of their own
                    probed = await run_mode(engine, prompts, args.new_tokens, mode, f"n{n}-probe", probe=True)
                    mean[mode]["probe_ttft_ms"] = probed["probe_ttft_ms"]
                same = all(r["tokens"] == runs["wait"][0]["tokens"] for mode in MODES for r in runs[mode])
                rows.append(dict(model=model, active=n, same_tokens=same,
                                 ratio=mean["ahead"]["tokens_per_s"] / mean["wait"]["tokens_per_s"],
                                 **{f"{mode}_{key}": value for mode in MODES for key, value in mean[mode].items()}))
                log(f"{model} N={n}: wait {mean['wait']['tokens_per_s']:.1f} tok/s, ahead "
                    f"{mean['ahead']['tokens_per_s']:.1f} tok/s ({rows[-1]['ratio']:.2f}x), same tokens: {same}")
        finally:
            await engine.stop()
    finally:
        cluster.stop()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | N | wait tok/s | ahead tok/s | ahead ÷ wait | TPOT wait ms | TPOT ahead ms "
             "| worker busy wait / ahead | TTFT mid-decode wait / ahead ms | same tokens |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['active']} | {r['wait_tokens_per_s']:.1f} | {r['ahead_tokens_per_s']:.1f} "
                     f"| **{r['ratio']:.2f}×** | {r['wait_tpot_ms']:.2f} | {r['ahead_tpot_ms']:.2f} | "
                     f"{r['wait_worker_busy']:.0%} / {r['ahead_worker_busy']:.0%} | "
                     f"{r['wait_probe_ttft_ms']:.1f} / {r['ahead_probe_ttft_ms']:.1f} | "
                     f"{'yes' if r['same_tokens'] else 'NO'} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    paired_bars(path, title, [f"{r['model']}\nN={r['active']}" for r in rows],
                ("wait for each step", [r["wait_tokens_per_s"] for r in rows]),
                ("next step ahead", [r["ahead_tokens_per_s"] for r in rows]), "generated tokens/s", log=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models")
    parser.add_argument("--active", help="numbers of concurrent requests, e.g. 1,16,64")
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--reps", type=int, help="runs of each mode per N, alternating")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--topology", default="tp1pp1", help="a single-stage layout (tp1pp1, tp2pp1, ...)")
    parser.add_argument("--worker-threads", type=int,
                        help="the worker's torch threads (default: its share of the cores, all of them here)")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "async_steps.json")
    args = parser.parse_args(argv)
    apply_defaults(args, QUICK if args.quick else DEFAULTS)
    rows = []
    for model in args.models.split(","):
        rows += asyncio.run(run_model(args, model))
    threads = f", {args.worker_threads} thread(s)" if args.worker_threads else ""
    title = f"{args.topology} ({args.device}{threads}): waiting for each step vs the next step ahead"
    write_report(args, title, table(rows), rows, plot)
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
