"""Does a layout decode as fast after a switch into it as when the stack starts in it? Fresh vs switched, side by side.

    python bench/after_switch.py                        # smollm2-135m, 4 workers: tp1pp1 and tp1pp2 (~2 min)
    python bench/after_switch.py --cases tp1pp1,tp1pp2>tp1pp1 --rounds 3
    python bench/after_switch.py --quick                # tiny-llama, 2 workers: tp1pp1 (~1 min)

Twice a switch left its target slower than a fresh stack of the same layout for the rest of its life: the router
kept the start layout's micro-batches in flight (tp1pp4 -> tp1pp2: 1.6x the time per token), and the layers a
staged switch brought in were packed for MKL on the stage thread, which lives on (1.4 of 2 cores used by the steps,
1.9 fresh). This bench keeps such regressions visible. A case is `L` (a stack started in L) or `S>L` (started in S,
switched to L with `--strategy`, default staged); each case runs `--rounds` bursts of `--active` greedy requests
(random byte prompts of `--prompt-len` tokens, exactly `--new-tokens` each) on its own stack, after one warm-up
burst. Reported per case: the median burst's mean TPOT, tokens/s, the workers' CPU use during the bursts (in
cores: `/proc/<pid>/stat` user + system over the bursts' wall time), and each switched case ÷ the fresh case of
its layout (TPOT, >1: slower after the switch). The switched cases' tokens must equal the fresh case's (same prompts,
greedy). Prints a table, writes JSON and a plot (bench/results/after_switch.* by default). A bench: it never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline import run_mode  # noqa: E402
from report import apply_defaults, write_report  # noqa: E402
from stack import REPO_ROOT  # noqa: E402
from switch import BenchConfig, random_prompts, start_stack, stop_stack  # noqa: E402

DEFAULTS = dict(model="smollm2-135m", cases="tp1pp1,tp1pp2>tp1pp1,tp1pp2,tp1pp4>tp1pp2", active=10, prompt_len=64,
                new_tokens=48, rounds=3, num_workers=4)
QUICK = dict(model="tiny-llama", cases="tp1pp1,tp1pp2>tp1pp1", active=4, prompt_len=16, new_tokens=16, rounds=2,
             num_workers=2)


@dataclass(slots=True)
class Case:
    label: str
    layout: str
    source: str | None                    # None: the stack started in `layout`
    tpot_ms: list[float] = field(default_factory=list)        # per burst: mean over the requests
    tokens_per_s: list[float] = field(default_factory=list)   # per burst
    cores: float = 0.0                     # CPU of the workers over the bursts, in cores
    worker_cores: list[float] = field(default_factory=list)  # each worker's
    switch_ms: float = 0.0                 # the switch's reported downtime (switched cases)
    tokens: list[list[int]] = field(default_factory=list)     # the last burst's, per request

    @property
    def tpot(self) -> float:
        return statistics.median(self.tpot_ms)

    @property
    def rate(self) -> float:
        return statistics.median(self.tokens_per_s)


def log(message: str) -> None:
    print(f"[after_switch {time.strftime('%H:%M:%S')}] {message}", flush=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def burst(engine, prompts: list[list[int]], new_tokens: int, tag: str) -> tuple[float, float, list[list[int]]]:
    """The prompts at once (one micro-batch of decodes, the default scheduler); (mean TPOT ms, tokens/s, tokens)."""
    result = await run_mode(engine, prompts, new_tokens, "one", tag)
    return result["tpot_ms"], result["tokens_per_s"], result["tokens"]


async def run_case(args, case: Case) -> Case:
    config = BenchConfig(model=args.model, chain=(case.source or case.layout, case.layout),
                         num_workers=args.num_workers, num_requests=args.active, prompt_len=args.prompt_len,
                         max_tokens=args.new_tokens, steps_between=0, kv_cache_mb=args.kv_cache_mb, block_size=16,
                         restart_all=False, memcpy_mb=1, seed=args.seed, out=args.out)
    stack, _, _ = await start_stack(config, case.source or case.layout, max_num_seqs=max(128, args.active))
    try:
        await burst(stack.engine, random_prompts(4, args.prompt_len, 7), 4, "warmup")
        if case.source is not None:
            operation = await stack.reconfigurer.reconfigure(case.layout, strategy=args.strategy)
            if operation.state.name != "SUCCEEDED":
                raise RuntimeError(f"{case.label}: the switch ended {operation.state.name}: {operation.error}")
            case.switch_ms = operation.downtime_seconds * 1e3
            await burst(stack.engine, random_prompts(4, args.prompt_len, 8), 4, "warmup-after")
        pids = list(stack.cluster.worker_pids)  # standbys compute nothing: the sum is the active workers'
        prompts = random_prompts(args.active, args.prompt_len, args.seed)
        cpu_before, wall = [cpu_seconds(p) for p in pids], 0.0
        for round_ in range(args.rounds):
            started = time.perf_counter()
            tpot, rate, case.tokens = await burst(stack.engine, prompts, args.new_tokens, f"r{round_}")
            wall += time.perf_counter() - started
            case.tpot_ms.append(tpot)
            case.tokens_per_s.append(rate)
        case.worker_cores = [(cpu_seconds(p) - b) / wall for p, b in zip(pids, cpu_before)]
        case.cores = sum(case.worker_cores)
        log(f"{case.label}: TPOT {case.tpot:.1f} ms (bursts {', '.join(f'{t:.1f}' for t in case.tpot_ms)}), "
            f"{case.rate:.1f} tok/s, {case.cores:.2f} cores ({' + '.join(f'{c:.2f}' for c in case.worker_cores)})")
    finally:
        await stop_stack(stack)
    return case


def parse_cases(text: str) -> list[Case]:
    cases = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        source, _, layout = item.rpartition(">")
        cases.append(Case(item, layout, source or None))
    return cases


def rows(cases: list[Case], strategy: str) -> list[dict]:
    fresh = {c.layout: c for c in cases if c.source is None}
    out = []
    for c in cases:
        base = fresh.get(c.layout)
        ratio = c.tpot / base.tpot if base is not None and c.source is not None else None
        same = None if base is None or c.source is None else c.tokens == base.tokens
        out.append(dict(case=c.label if c.source is None else f"{c.label} ({strategy})", layout=c.layout,
                        source=c.source, tpot_ms=c.tpot, tpot_ms_bursts=c.tpot_ms, tokens_per_s=c.rate,
                        cores=c.cores, switch_ms=c.switch_ms, tpot_vs_fresh=ratio, same_tokens=same))
    return out


def table(table_rows: list[dict]) -> str:
    lines = ["| case | TPOT ms (median burst) | tokens/s | workers' CPU (cores) | TPOT ÷ fresh | "
             "same tokens as fresh |", "|---|---:|---:|---:|---:|:---:|"]
    for r in table_rows:
        ratio = "-" if r["tpot_vs_fresh"] is None else f"**{r['tpot_vs_fresh']:.2f}x**"
        same = "-" if r["same_tokens"] is None else ("✓" if r["same_tokens"] else "✗")
        lines.append(f"| {r['case']} | {r['tpot_ms']:.1f} | {r['tokens_per_s']:.1f} | {r['cores']:.2f} | {ratio} | "
                     f"{same} |")
    return "\n".join(lines)


def plot(table_rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(1.6 * len(table_rows) + 3, 4))
    xs = range(len(table_rows))
    colors = ["tab:blue" if r["source"] is None else "tab:orange" for r in table_rows]
    axes.bar(list(xs), [r["tpot_ms"] for r in table_rows], color=colors)
    for x, r in zip(xs, table_rows):
        for tpot in r["tpot_ms_bursts"]:
            axes.plot(x, tpot, "k.", markersize=4)
    axes.set_xticks(list(xs), [r["case"].replace(" (", "\n(") for r in table_rows])
    axes.set_ylabel("mean TPOT per burst, ms (bar: median)")
    axes.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--cases", help="L (fresh) or S>L (started in S, switched to L), comma-separated")
    parser.add_argument("--active", type=int, help="requests per burst")
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--rounds", type=int, help="bursts measured per case")
    parser.add_argument("--num-workers", type=int)
    parser.add_argument("--kv-cache-mb", type=int, default=256, help="KV budget per worker")
    parser.add_argument("--strategy", default="staged", choices=("staged", "in-place"))
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "after_switch.json")
    args = parser.parse_args(argv)
    from services.logs import configure_logging

    configure_logging("bench", "WARNING")
    apply_defaults(args, QUICK if args.quick else DEFAULTS)
    started = time.perf_counter()
    cases = [asyncio.run(run_case(args, case)) for case in parse_cases(args.cases)]
    table_rows = rows(cases, args.strategy)
    title = f"{args.model}: decode after a switch vs a fresh stack ({args.active} requests)"
    write_report(args, title, table(table_rows), table_rows, plot, wall_seconds=time.perf_counter() - started,
                 cases=[asdict(c) | {"tokens": None} for c in cases])
    return 0 if all(r["same_tokens"] is not False for r in table_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
