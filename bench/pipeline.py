"""Pipeline parallelism under decode load: one micro-batch of every decode vs the decodes spread over pp micro-batches.

    python bench/pipeline.py [--model smollm2-135m] [--layouts tp1pp2:2,tp1pp4:4] [--active 16,64] [--quick]

For each layout, one stack (weightstore, the workers, the router engine in this process); for each number of
active requests N, the same N greedy requests (random byte prompts, exactly --new-tokens each) run twice:
- `one`: the scheduler puts every running decode into one micro-batch (the default): the batch passes the stages
  one after the other while the others idle;
- `spread` (SchedulerConfig.spread_decodes, RouterConfig.spread_decodes): the decodes are spread over the pp
  micro-batches in flight (at most ceil(running / pp) each), so every stage works on its share at once.
Reports generated tokens/s (submission to the last token), mean TPOT, the ratio spread / one, and whether both
modes produced the same tokens. Prints a table, writes JSON and a plot (bench/results/ by default).
Heavy imports stay inside functions: worker processes re-import this module as `__mp_main__`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import apply_defaults, paired_bars, write_report  # noqa: E402
from stack import REPO_ROOT  # noqa: E402
from streams import stream_all  # noqa: E402
from switch import MIB, random_prompts  # noqa: E402

DEFAULTS = dict(model="smollm2-135m", layouts="tp1pp2:2,tp1pp4:4", active="16,64", prompt_len=32, new_tokens=48)
QUICK = dict(model="tiny-llama", layouts="tp1pp2:2", active="8", prompt_len=16, new_tokens=16)
MODES = ("one", "spread")


def log(message: str) -> None:
    print(f"[pipeline {time.strftime('%H:%M:%S')}] {message}", flush=True)


async def run_mode(engine, prompts: list[list[int]], new_tokens: int, mode: str, tag: str) -> dict:
    """The requests at once through `engine`, the scheduler in `mode`; tokens/s, TPOT, the tokens."""
    scheduler = engine.scheduler
    scheduler.config = dataclasses.replace(scheduler.config, spread_decodes=mode == "spread")
    return await stream_all(engine, prompts, new_tokens, f"{tag}-{mode}")


async def run_layout(args, topology: str, num_workers: int) -> list[dict]:
    from services.launch.cluster import ClusterConfig, LocalCluster
    from services.router.main import RouterConfig, build_engine

    actives = [int(n) for n in args.active.split(",")]
    kv_mb = max(8, max(actives) * (args.prompt_len + args.new_tokens) * 40 // 1024)  # generous for the presets
    cluster = LocalCluster(ClusterConfig(model=args.model, num_workers=num_workers, topology=topology,
                                         block_size=16, kv_cache_bytes=kv_mb * MIB,
                                         env={"RECONFIG_LOG_LEVEL": "WARNING"}))
    cluster.start()
    rows = []
    try:
        engine = await build_engine(RouterConfig(worker_addresses=tuple(cluster.worker_addresses),
                                                 model_dir=str(cluster.model_dir), model_name=args.model,
                                                 max_num_seqs=max(128, max(actives))))
        try:
            await run_mode(engine, random_prompts(4, args.prompt_len, 7), 4, "spread", "warmup")
            for n in actives:
                prompts = random_prompts(n, args.prompt_len, args.seed + n)
                results = {}
                for mode in MODES:
                    results[mode] = await run_mode(engine, prompts, args.new_tokens, mode, f"n{n}")
                    log(f"{topology} N={n} {mode}: {results[mode]['tokens_per_s']:.1f} tok/s, "
                        f"TPOT {results[mode]['tpot_ms']:.1f} ms")
                same = results["one"]["tokens"] == results["spread"]["tokens"]
                rows.append(dict(layout=topology, active=n, same_tokens=same,
                                 ratio=results["spread"]["tokens_per_s"] / results["one"]["tokens_per_s"],
                                 **{f"{mode}_{key}": results[mode][key] for mode in MODES
                                    for key in ("tokens_per_s", "tpot_ms", "seconds")}))
        finally:
            await engine.stop()
    finally:
        cluster.stop()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| layout | active | one tok/s | spread tok/s | spread ÷ one | TPOT one ms | TPOT spread ms "
             "| same tokens |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['active']} | {r['one_tokens_per_s']:.1f} | {r['spread_tokens_per_s']:.1f} "
                     f"| **{r['ratio']:.2f}×** | {r['one_tpot_ms']:.1f} | {r['spread_tpot_ms']:.1f} | "
                     f"{'yes' if r['same_tokens'] else 'NO'} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    paired_bars(path, title, [f"{r['layout']}\nN={r['active']}" for r in rows],
                ("one micro-batch", [r["one_tokens_per_s"] for r in rows]),
                ("spread over pp", [r["spread_tokens_per_s"] for r in rows]), "generated tokens/s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--layouts", help="topology:workers,...")
    parser.add_argument("--active", help="numbers of concurrent requests, e.g. 16,64")
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "pipeline.json")
    args = parser.parse_args(argv)
    apply_defaults(args, QUICK if args.quick else DEFAULTS)
    rows = []
    for layout in args.layouts.split(","):
        topology, workers = layout.split(":")
        rows += asyncio.run(run_layout(args, topology, int(workers)))
    title = f"{args.model}: decode through a pipeline, one micro-batch vs spread"
    write_report(args, title, table(rows), rows, plot)
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
