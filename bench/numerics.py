"""Invariant numerics against the fast mode (issue 39): decode tok/s side by side, and whether a request's greedy
tokens change with its batch or its layout.

    python bench/numerics.py [--model tiny-llama] [--dtypes float32,bfloat16] [--batch-sizes 1,16,64]
                             [--layouts tp1pp1:1,tp2pp1:2] [--kv-cache-mib 256] [--rounds 3] [--quick]

For each dtype, numerics mode and layout (its own LocalCluster of real workers), the same prompts are served at
each batch size: the batch of 16 is the first 16 prompts of the batch of 64, the batch of 1 the first prompt, so a
prompt's tokens can be compared across batches ("batch-invariant": every prompt's tokens the same at every batch
size it is in) and across layouts ("layout-invariant": each batch's tokens the same in every layout). Decode steps
are timed at the driver (forward.py's loop: one prefill step, then one step per token, no async scheduling).
The whole sweep runs --rounds times, so the two modes' runs interleave in time on a machine whose load drifts; the
fastest round of each configuration is reported (every round's tok/s in the JSON). `--in-process` times one tp1pp1
shard's decode step in this process instead. Prints a table, writes JSON and a plot (bench/report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

from report import apply_defaults, paired_bars, write_report

DEFAULTS = dict(model="tiny-llama", dtypes="float32,bfloat16", batch_sizes="1,16,64", layouts="tp1pp1:1,tp2pp1:2",
                prompt_len=24, new_tokens=48, repeats=2, kv_cache_mib=256)
QUICK = dict(model="tiny-llama", dtypes="bfloat16", batch_sizes="1,8", layouts="tp1pp1:1,tp2pp1:2", prompt_len=8,
             new_tokens=12, repeats=1, kv_cache_mib=64)
MODES = ("fast", "invariant")


def measure(args: argparse.Namespace, dtype: str, numerics: str, topology: str, num_workers: int,
            prompts: list[list[int]]) -> list[dict]:
    """Decode tok/s and tokens at each batch size, in one cluster of this dtype, mode and layout."""
    import forward
    from services.launch.cluster import ClusterConfig, LocalCluster
    from services.router.driver import Driver

    async def run(addresses: list[str]) -> list[dict]:
        rows = []
        async with Driver(addresses) as driver:
            for batch in args.batch_sizes:
                await forward._run_once(driver, prompts[:batch], 4, f"warm-{batch}")
                runs = [await forward._run_once(driver, prompts[:batch], args.new_tokens, f"r{r}-{batch}")
                        for r in range(args.repeats)]
                _, steps, compute, tokens = min(runs, key=lambda run: sum(run[1]))
                rows.append(dict(dtype=dtype, numerics=numerics, topology=topology, batch_size=batch,
                                 tokens_per_second=batch * len(steps) / sum(steps),
                                 worker_ms_per_step=1e3 * sum(compute) / len(compute), tokens=tokens,
                                 repeats_agree=all(run[3] == tokens for run in runs)))
                print(f"  {dtype} {numerics} {topology} batch {batch}: {rows[-1]['tokens_per_second']:.1f} tok/s",
                      file=sys.stderr, flush=True)
        return rows

    config = ClusterConfig(model=args.model, num_workers=num_workers, topology=topology, dtype=dtype,
                           numerics=numerics, kv_cache_bytes=int(args.kv_cache_mib) << 20, block_size=16,
                           env={"RECONFIG_LOG_LEVEL": "WARNING"})
    with LocalCluster(config) as cluster:
        return asyncio.run(run(cluster.worker_addresses))


def steps_in_process(args: argparse.Namespace) -> list[dict]:
    """A decode step of one tp1pp1 shard in this process (no workers, no driver), each mode's model built once and
    the modes timed in turn, --rounds times: the fastest step of each (dtype, mode, batch). The CPU proxy that a
    noisy machine disturbs least."""
    import time

    import torch
    from safetensors.torch import load_file

    from services.model.attention import AttentionMetadata
    from services.model.layers import ShardLoader, SingleRankGroup
    from services.model.llama import ShardedCausalLM
    from services.model.presets import resolve_model
    from services.model.spec import ModelSpec
    from services.topology import Topology, place
    from services.worker.shard import shard_numerics

    model_dir = resolve_model(args.model)
    spec = ModelSpec.from_dir(model_dir)
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    placement = place(Topology(tp=1, pp=1), spec.shape).workers[0]
    context = args.prompt_len
    blocks = -(-(context + 2) // 16)
    best: dict[tuple[str, str, int], float] = {}
    for dtype_name in str(args.dtypes).split(","):
        dtype = getattr(torch, dtype_name)
        models = {}
        for mode in MODES:
            numerics = shard_numerics(argparse.Namespace(numerics=mode, world_size=1), spec, torch.device("cpu"), dtype)
            loader = ShardLoader(tensors.__getitem__, set(tensors), dtype, torch.device("cpu"))
            model = ShardedCausalLM(spec, placement, loader, SingleRankGroup(), numerics=numerics)
            model.pack_weights()
            caches = [torch.zeros(2, max(args.batch_sizes) * blocks, 16, len(placement.kv_heads), spec.head_dim,
                                  dtype=dtype) for _ in placement.layers]
            models[mode] = model, caches
        for _ in range(int(args.rounds)):
            for mode, (model, caches) in models.items():
                for batch in args.batch_sizes:
                    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
                    meta = AttentionMetadata.build([context] * batch, [1] * batch, tables, 16, torch.device("cpu"))
                    tokens, positions = torch.randint(3, 256, (batch,)), torch.full((batch,), context)
                    with torch.inference_mode():
                        for step in range(12):
                            start = time.perf_counter()
                            model.compute_logits(model.forward(tokens, positions, caches, meta))
                            if step >= 2:  # warm
                                key = (dtype_name, mode, batch)
                                best[key] = min(best.get(key, float("inf")), time.perf_counter() - start)
    return [dict(dtype=dtype, numerics=mode, topology="1 process", batch_size=batch, step_ms=1e3 * seconds,
                 tokens_per_second=batch / seconds) for (dtype, mode, batch), seconds in best.items()]


def format_steps(rows: list[dict]) -> str:
    fast = {(r["dtype"], r["batch_size"]): r for r in rows if r["numerics"] == "fast"}
    lines = ["| dtype | batch | fast ms/step | invariant ms/step | invariant / fast tok/s |",
             "|---|---:|---:|---:|---:|"]
    for r in (r for r in rows if r["numerics"] == "invariant"):
        f = fast[r["dtype"], r["batch_size"]]
        lines.append(f"| {r['dtype']} | {r['batch_size']} | {f['step_ms']:.2f} | {r['step_ms']:.2f} | "
                     f"{r['tokens_per_second'] / f['tokens_per_second']:.2f}x |")
    return "\n".join(lines)


def invariance(rows: list[dict]) -> dict[tuple[str, str], dict[str, bool]]:
    """Per (dtype, mode): is every prompt's token list the same at every batch size (in each layout), and each
    batch's the same in every layout?"""
    found = {}
    for key in {(r["dtype"], r["numerics"]) for r in rows}:
        mine = [r for r in rows if (r["dtype"], r["numerics"]) == key]
        by_batch = all(r["tokens"][i] == other["tokens"][i] for r in mine for other in mine
                       if other["topology"] == r["topology"] for i in range(min(len(r["tokens"]),
                                                                                len(other["tokens"]))))
        by_layout = all(r["tokens"] == other["tokens"] for r in mine for other in mine
                        if other["batch_size"] == r["batch_size"])
        found[key] = dict(batch=by_batch, layout=by_layout)
    return found


def format_table(rows: list[dict]) -> str:
    found = invariance(rows)
    fast = {(r["dtype"], r["topology"], r["batch_size"]): r for r in rows if r["numerics"] == "fast"}
    lines = ["| dtype | layout | batch | fast tok/s | invariant tok/s | invariant / fast | worker ms/step fast "
             "/ invariant |", "|---|---|---:|---:|---:|---:|---|"]
    for r in (r for r in rows if r["numerics"] == "invariant"):
        f = fast[r["dtype"], r["topology"], r["batch_size"]]
        lines.append(f"| {r['dtype']} | {r['topology']} | {r['batch_size']} | {f['tokens_per_second']:.1f} | "
                     f"{r['tokens_per_second']:.1f} | {r['tokens_per_second'] / f['tokens_per_second']:.2f}x | "
                     f"{f['worker_ms_per_step']:.2f} / {r['worker_ms_per_step']:.2f} |")
    lines += ["", "| dtype | mode | a prompt's tokens the same at every batch size | a batch's tokens the same in "
                  "every layout |", "|---|---|:---:|:---:|"]
    for (dtype, mode), flags in sorted(found.items()):
        lines.append(f"| {dtype} | {mode} | {'yes' if flags['batch'] else 'no'} | "
                     f"{'yes' if flags['layout'] else 'no'} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    invariant = [r for r in rows if r["numerics"] == "invariant"]
    fast = {(r["dtype"], r["topology"], r["batch_size"]): r for r in rows if r["numerics"] == "fast"}
    labels = [f"{r['dtype'][:4]} {r['topology']} b{r['batch_size']}" for r in invariant]
    paired_bars(path, title, labels,
                ("fast", [fast[r["dtype"], r["topology"], r["batch_size"]]["tokens_per_second"] for r in invariant]),
                ("invariant", [r["tokens_per_second"] for r in invariant]), "decode tok/s", log=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in DEFAULTS:
        parser.add_argument(f"--{name.replace('_', '-')}", default=None)
    parser.add_argument("--quick", action="store_true", help="a small run (tests, a first look)")
    parser.add_argument("--rounds", type=int, default=3, help="sweeps, interleaved; the fastest of each is kept")
    parser.add_argument("--in-process", action="store_true",
                        help="time a tp1pp1 decode step in this process instead (no workers): the steadier proxy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "numerics.json")
    args = parser.parse_args(argv)
    apply_defaults(args, QUICK if args.quick else DEFAULTS)
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",")]
    args.prompt_len, args.new_tokens, args.repeats = int(args.prompt_len), int(args.new_tokens), int(args.repeats)
    if args.in_process:
        rows = steps_in_process(args)
        write_report(args, "Invariant numerics against fast: a tp1pp1 decode step in one process", format_steps(rows),
                     rows, plot)
        return
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 256) for _ in range(args.prompt_len)] for _ in range(max(args.batch_sizes))]
    runs: dict[tuple, list[dict]] = {}  # (dtype, mode, topology, batch) -> its row of each round
    for _ in range(int(args.rounds)):  # the whole sweep again: the modes' runs interleave in time
        for dtype in str(args.dtypes).split(","):
            for layout in str(args.layouts).split(","):
                topology, num_workers = layout.split(":")
                for mode in MODES:
                    for row in measure(args, dtype, mode, topology, int(num_workers), prompts):
                        runs.setdefault((dtype, mode, topology, row["batch_size"]), []).append(row)
    rows = []
    for found_rows in runs.values():  # the fastest round of each, its tokens checked against every round's
        best = dict(max(found_rows, key=lambda row: row["tokens_per_second"]))
        best["repeats_agree"] = all(row["tokens"] == best["tokens"] and row["repeats_agree"] for row in found_rows)
        best["rounds_tokens_per_second"] = [row["tokens_per_second"] for row in found_rows]
        rows.append(best)
    found = invariance(rows)
    write_report(args, "Invariant numerics against fast: decode tok/s, and tokens across batches and layouts",
                 format_table(rows), rows, plot,
                 invariance={f"{dtype} {mode}": flags for (dtype, mode), flags in found.items()})


if __name__ == "__main__":
    main()
