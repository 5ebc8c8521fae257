"""guidellm (vLLM's load tester) as a judge: synthetic requests against `reconfig up`, tokenized by the local
checkpoint's tokenizer (no model hub), at several concurrency levels.

    python bench/load.py [--model smollm2-135m] [--streams 1,4,16] [--max-requests 32]

Prints a table (throughput, TTFT, ITL, TPOT p50/p99 per level), writes guidellm's own JSON, ours and a plot under
bench/results/. Exits non-zero if any request failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack import REPO_ROOT, Stack  # noqa: E402  (stdlib only at import time)

LATENCIES = (("TTFT", "time_to_first_token_ms"), ("ITL", "inter_token_latency_ms"),
             ("TPOT", "time_per_output_token_ms"), ("e2e", "request_latency"))


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """The stack, the synthetic requests and the concurrency levels guidellm runs one after the other."""

    model: str
    topology: str | None
    num_workers: int | None
    streams: tuple[int, ...]      # concurrent requests, one guidellm benchmark per value
    max_requests: int             # requests per benchmark
    prompt_tokens: int
    output_tokens: int            # max_tokens, with ignore_eos (guidellm sends both)
    request_format: str           # /v1/completions or /v1/chat/completions
    out: Path


@dataclass(frozen=True, slots=True)
class LevelResult:
    """One guidellm benchmark: a concurrency level. Latencies in ms (e2e in s, as guidellm reports it)."""

    strategy: str
    completed: int
    errored: int
    requests_per_second: float
    output_tokens_per_second: float
    latencies: dict[str, dict[str, float]]   # name -> {"p50", "p99"}

    @classmethod
    def from_guidellm(cls, benchmark: dict) -> LevelResult:
        metrics, strategy = benchmark["metrics"], benchmark["config"]["strategy"]
        latencies = {name: {q: metrics[key]["successful"]["percentiles"][q] for q in ("p50", "p99")}
                     for name, key in LATENCIES}
        return cls(f"{strategy['type_']}@{strategy.get('streams', '')}", metrics["request_totals"]["successful"],
                   metrics["request_totals"]["errored"], metrics["requests_per_second"]["successful"]["mean"],
                   metrics["output_tokens_per_second"]["successful"]["mean"], latencies)


def run_guidellm(config: LoadConfig, base_url: str, served_model: str, model_dir: Path, raw: Path) -> dict:
    """guidellm's CLI (its stable interface) against the stack; returns its JSON report."""
    backend = {"kind": "openai_http", "target": base_url, "model": served_model,
               "request_format": config.request_format}
    command = [
        sys.executable, "-m", "guidellm", "run", "--backend", json.dumps(backend),
        "--tokenizer", json.dumps({"kind": "hf_auto", "model": str(model_dir)}),
        "--data", json.dumps({"kind": "synthetic_text", "prompt_tokens": config.prompt_tokens,
                              "output_tokens": config.output_tokens}),
        "--profile", json.dumps({"kind": "concurrent", "streams": list(config.streams)}),
        "--constraint", json.dumps({"kind": "max_requests", "count": config.max_requests}),
        "--output", json.dumps({"kind": "json", "path": str(raw)}), "--disable-console",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    completed = subprocess.run(command, env=env, capture_output=True, text=True)
    if completed.returncode != 0 or not raw.exists():
        raise SystemExit(f"guidellm failed ({completed.returncode}):\n{completed.stderr[-3000:]}")
    return json.loads(raw.read_text())


def format_table(levels: list[LevelResult], config: LoadConfig, topology: str, version: str, cpus: int) -> str:
    lines = ["| strategy | ok | failed | req/s | out tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT p50 "
             "| TPOT p99 | e2e p50 s | e2e p99 s |", "|---|" + "---:|" * 12]
    for level in levels:
        values = " | ".join(f"{level.latencies[name][q]:.{2 if name == 'e2e' else 0}f}"
                            for name, _ in LATENCIES for q in ("p50", "p99"))
        lines.append(f"| {level.strategy} | {level.completed} | {level.errored} | {level.requests_per_second:.2f} | "
                     f"{level.output_tokens_per_second:.1f} | {values} |")
    lines += ["", f"Notes: guidellm {version}, `reconfig up` {config.model} in {topology}, {cpus} CPUs; "
              f"{config.max_requests} requests per level, synthetic prompts of {config.prompt_tokens} tokens "
              f"(the checkpoint's tokenizer), max_tokens {config.output_tokens} with ignore_eos, streamed "
              f"{config.request_format}. Latencies in ms (e2e in s); concurrent@N keeps N requests in flight."]
    return "\n".join(lines)


def plot(levels: list[LevelResult], path: Path, title: str) -> None:
    """Output tokens/s against TTFT and ITL p50, one point per concurrency level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    throughput = [level.output_tokens_per_second for level in levels]
    for axis, name in zip(axes, ("TTFT", "ITL")):
        for q, marker in (("p50", "o-"), ("p99", "s--")):
            axis.plot(throughput, [level.latencies[name][q] for level in levels], marker, label=q)
        for level, x in zip(levels, throughput):
            axis.annotate(level.strategy, (x, level.latencies[name]["p50"]), fontsize=7)
        axis.set_xlabel("output tokens/s")
        axis.set_ylabel(f"{name} (ms)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse_args(argv: list[str] | None = None) -> LoadConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="preset or checkpoint directory")
    parser.add_argument("--topology", default=None, help="reconfig up's --topology (default: its own)")
    parser.add_argument("--workers", type=int, default=None, help="reconfig up's --workers")
    parser.add_argument("--streams", default="1,4,16", help="concurrency levels, comma-separated")
    parser.add_argument("--max-requests", type=int, default=32, help="requests per level")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--request-format", default="/v1/completions",
                        choices=("/v1/completions", "/v1/chat/completions"))
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "load.json")
    args = parser.parse_args(argv)
    return LoadConfig(args.model, args.topology, args.workers, tuple(int(s) for s in args.streams.split(",")),
                      args.max_requests, args.prompt_tokens, args.output_tokens, args.request_format, args.out)


def main(argv: list[str] | None = None) -> None:
    from services.logs import configure_logging
    from services.model.presets import resolve_model

    configure_logging("bench", "WARNING")
    config = parse_args(argv)
    started = time.perf_counter()
    model_dir = resolve_model(config.model)
    config.out.parent.mkdir(parents=True, exist_ok=True)
    raw = config.out.with_name(config.out.stem + "-guidellm.json")
    print(f"load: {config.model}, guidellm at concurrency {config.streams}", file=sys.stderr, flush=True)
    with Stack(config.model, config.topology, config.num_workers) as stack:
        report = run_guidellm(config, stack.base_url, stack.info["model"], model_dir, raw)
        topology = stack.info["topology"]
    levels = [LevelResult.from_guidellm(benchmark) for benchmark in report["benchmarks"]]
    cpus = len(os.sched_getaffinity(0))
    table = format_table(levels, config, topology, report["metadata"]["guidellm_version"], cpus)
    print(table)
    payload = {"bench": "load", "config": {**asdict(config), "out": str(config.out)}, "topology": topology,
               "guidellm": report["metadata"], "guidellm_report": str(raw), "usable_cpus": cpus,
               "wall_seconds": time.perf_counter() - started, "table": table,
               "levels": [asdict(level) for level in levels]}
    config.out.write_text(json.dumps(payload, indent=1) + "\n")
    plot_path = config.out.with_suffix(".png")
    plot(levels, plot_path, f"{config.model} ({topology}): guidellm, concurrency {', '.join(map(str, config.streams))}")
    print(f"\nwrote {config.out}, {raw} and {plot_path} in {payload['wall_seconds']:.0f}s", file=sys.stderr)
    failed = sum(level.errored for level in levels)
    if failed:
        raise SystemExit(f"{failed} request(s) failed")


if __name__ == "__main__":
    main()
