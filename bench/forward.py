"""Decode throughput of reconfig topologies next to Hugging Face `generate` on the same checkpoint.

    python bench/forward.py [--model tiny-llama] [--batch-sizes 1,8,32] [--quick]

Prints a markdown table, writes JSON (raw numbers, machine info) and a plot next to it.
Heavy imports stay inside functions: worker processes re-import this module as `__mp_main__`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULTS = dict(batch_sizes="1,8,32", topologies="tp1pp1:1,tp2pp1:2,tp1pp2:2,tp2pp2:4", prompt_len=32, new_tokens=32)
QUICK = dict(batch_sizes="1,4", topologies="tp1pp1:1,tp2pp1:2", prompt_len=8, new_tokens=8)
NUM_BYTE_TOKENS = 256  # prompts are random byte tokens of the presets' tokenizer
HF = "hf"


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What to measure."""

    model: str
    batch_sizes: tuple[int, ...]
    layouts: tuple[tuple[str, int], ...]  # (topology, num_workers)
    prompt_len: int
    new_tokens: int                       # tokens per prompt: 1 from prefill, new_tokens - 1 decode steps
    hf_threads: tuple[int, ...]
    worker_threads: int | None            # torch threads per worker; None: reconfig's default (cores // active)
    warmup_tokens: int
    repeats: int
    block_size: int
    seed: int
    out: Path

    def __post_init__(self) -> None:
        if self.new_tokens < 2 or self.prompt_len < 1 or self.repeats < 1 or not self.hf_threads:
            raise ValueError("need --new-tokens >= 2, --prompt-len >= 1, --repeats >= 1 and an HF thread count")


@dataclass(slots=True)
class Measurement:
    """One configuration (a topology, or HF generate) at one batch size: the fastest of `repeats` runs."""

    name: str                             # topology, or "hf"
    num_workers: int                      # worker processes (0 for HF: the bench process itself)
    num_threads: int                      # torch threads per process
    batch_size: int
    prefill_seconds: float
    decode_seconds: float                 # all decode steps
    num_decode_steps: int
    step_seconds: list[float] = field(default_factory=list)          # per decode step
    compute_step_seconds: list[float] = field(default_factory=list)  # last stage's own compute per step
    tokens: list[list[int]] = field(default_factory=list)           # greedy tokens per prompt
    runs_agree: bool = True                                          # every repeat produced the same tokens
    matches_hf: bool | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.batch_size * self.num_decode_steps / self.decode_seconds

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.decode_seconds / self.num_decode_steps


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


async def _run_once(driver, prompts: list[list[int]], new_tokens: int, tag: str):
    """One prefill step, then new_tokens - 1 timed decode steps; each prompt owns a contiguous block range."""
    from services.contracts.step import SequenceStep

    need = _blocks_for(len(prompts[0]) + new_tokens, driver.block_size)
    tables = [tuple(range(i * need, (i + 1) * need)) for i in range(len(prompts))]
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    steps = [SequenceStep(ids[i], tuple(p), 0, tables[i]) for i, p in enumerate(prompts)]
    started = time.perf_counter()
    output = await driver.step(steps)
    prefill_seconds = time.perf_counter() - started
    by_id = {o.request_id: o.token_id for o in output.outputs}
    tokens = [[by_id[i]] for i in ids]
    step_seconds, compute_seconds = [], []
    for k in range(new_tokens - 1):
        position = len(prompts[0]) + k
        steps = [SequenceStep(ids[i], (tokens[i][-1],), position, tables[i], num_generated=k + 1)
                 for i in range(len(prompts))]
        started = time.perf_counter()
        output = await driver.step(steps)
        step_seconds.append(time.perf_counter() - started)
        compute_seconds.append(output.compute_seconds)
        by_id = {o.request_id: o.token_id for o in output.outputs}
        for i, request_id in enumerate(ids):
            tokens[i].append(by_id[request_id])
    return prefill_seconds, step_seconds, compute_seconds, tokens


async def _measure_layout(addresses: list[str], topology: str, num_workers: int, config: BenchConfig,
                          prompts: dict[int, list[list[int]]]) -> list[Measurement]:
    from services.router.driver import Driver

    results = []
    async with Driver(addresses) as driver:
        num_threads = max(info.num_threads for info in driver.infos if info.num_kv_blocks > 0)
        for batch_size in config.batch_sizes:
            await _run_once(driver, prompts[batch_size], config.warmup_tokens, "warmup")
            runs = [await _run_once(driver, prompts[batch_size], config.new_tokens, f"run{r}")
                    for r in range(config.repeats)]
            _, steps, compute, tokens = min(runs, key=lambda run: sum(run[1]))
            prefill = min(run[0] for run in runs)
            results.append(Measurement(topology, num_workers, num_threads, batch_size, prefill, sum(steps), len(steps),
                                       steps, compute, tokens, all(run[3] == tokens for run in runs)))
            _progress(results[-1])
    return results


def measure_reconfig(config: BenchConfig, prompts: dict[int, list[list[int]]]) -> list[Measurement]:
    """Start a LocalCluster per layout and time prefill and decode steps at every batch size."""
    from services.launch.cluster import ClusterConfig, LocalCluster
    from services.model.presets import resolve_model
    from services.model.spec import ModelSpec

    spec = ModelSpec.from_dir(resolve_model(config.model))
    # Whole-model fp32 KV of every sequence at the largest batch: an upper bound on any worker's share.
    num_blocks = max(config.batch_sizes) * _blocks_for(config.prompt_len + config.new_tokens, config.block_size)
    bytes_per_block = 2 * config.block_size * spec.num_kv_heads * spec.head_dim * 4 * spec.num_layers
    results = []
    for topology, num_workers in config.layouts:
        cluster_config = ClusterConfig(
            model=config.model, num_workers=num_workers, topology=topology, block_size=config.block_size,
            kv_cache_bytes=(num_blocks + 1) * bytes_per_block, num_threads=config.worker_threads,
            env={"RECONFIG_LOG_LEVEL": "WARNING"},
        )
        with LocalCluster(cluster_config) as cluster:
            results += asyncio.run(_measure_layout(cluster.worker_addresses, topology, num_workers, config, prompts))
    return results


def measure_transformers(config: BenchConfig, prompts: dict[int, list[list[int]]]) -> list[Measurement]:
    """HF greedy generate; a stopping criterion timestamps every generated token, so decode steps are timed
    one by one like ours (generate's own per-step work included)."""
    import torch
    import transformers

    from services.model.presets import PRESETS, resolve_model
    from services.model.tokenizer import PAD_TOKEN_ID

    class StepClock(transformers.StoppingCriteria):
        """Never stops; records when each token was produced (the first right after prefill)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(resolve_model(config.model), dtype=torch.float32)
    model.eval()
    # No eos: both sides generate exactly new_tokens greedy tokens. (min_new_tokens would instead mask eos in HF
    # only, changing its tokens wherever eos is the argmax; eos_token_id=None passed to generate() is overridden
    # by the model's generation_config, so clear it there.)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_TOKEN_ID

    def run_once(input_ids: torch.Tensor, num_tokens: int) -> tuple[float, list[float], torch.Tensor]:
        clock = StepClock()
        started = time.perf_counter()
        with torch.inference_mode():
            output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                    max_new_tokens=num_tokens, stopping_criteria=[clock])
        steps = [after - before for before, after in zip(clock.times, clock.times[1:])]
        return clock.times[0] - started, steps, output[:, input_ids.shape[1]:]

    results, previous_threads = [], torch.get_num_threads()
    try:
        for num_threads in config.hf_threads:
            torch.set_num_threads(num_threads)
            for batch_size in config.batch_sizes:
                input_ids = torch.tensor(prompts[batch_size])  # [batch, prompt_len]: same lengths, no padding
                run_once(input_ids, config.warmup_tokens)
                runs = [run_once(input_ids, config.new_tokens) for _ in range(config.repeats)]
                _, steps, tokens = min(runs, key=lambda run: sum(run[1]))
                # A sequence that stopped early would be padded; presets never generate pad (lm_head row 0).
                is_padded = config.model in PRESETS and bool((tokens == PAD_TOKEN_ID).any())
                if tokens.shape[1] != config.new_tokens or len(steps) != config.new_tokens - 1 or is_padded:
                    raise RuntimeError(f"HF generate stopped early ({tokens.shape[1]} of {config.new_tokens} tokens)")
                results.append(Measurement(
                    HF, 0, num_threads, batch_size, min(run[0] for run in runs), sum(steps), len(steps), steps,
                    tokens=tokens.tolist(), runs_agree=all(torch.equal(run[2], tokens) for run in runs),
                ))
                _progress(results[-1])
    finally:
        torch.set_num_threads(previous_threads)
    return results


def _progress(m: Measurement) -> None:
    print(f"  {m.name} workers={m.num_workers} threads={m.num_threads} batch={m.batch_size}: "
          f"{m.tokens_per_second:.1f} tok/s", file=sys.stderr, flush=True)


def _label(m: Measurement) -> str:
    return f"HF generate ({m.num_threads} thr)" if m.name == HF else f"{m.name} ({m.num_workers} w)"


def _worker_ms(m: Measurement) -> str:
    if not m.compute_step_seconds:
        return "-"
    return f"{1e3 * statistics.mean(m.compute_step_seconds):.2f}"


def format_table(results: list[Measurement], num_cpus: int, hf_threads: int) -> str:
    """Markdown table plus notes; ratios are against HF generate at the same batch with the row's thread count per
    process when it was measured, else with `hf_threads`."""
    reference = {(m.batch_size, m.num_threads): m for m in results if m.name == HF}
    lines = ["| config | workers | threads/proc | batch | decode tok/s | ms/step | worker ms/step | prefill ms "
             "| vs HF | greedy = HF |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for m in results:
        ref = reference.get((m.batch_size, m.num_threads)) or reference[m.batch_size, hf_threads]
        ratio = f"{m.tokens_per_second / ref.tokens_per_second:.2f}x ({ref.num_threads} thr)"
        check = "ref" if m.matches_hf is None else ("✓" if m.matches_hf else "✗")
        lines.append(f"| {m.name} | {m.num_workers or '-'} | {m.num_threads} | {m.batch_size} | "
                     f"{m.tokens_per_second:.1f} | {m.ms_per_step:.2f} | {_worker_ms(m)} | "
                     f"{1e3 * m.prefill_seconds:.1f} | "
                     f"{ratio} | {check} |")
    oversubscribed = sorted({m.name for m in results if m.num_workers > num_cpus})
    lines += ["", f"Notes: {num_cpus} CPUs. Decode tok/s = batch x decode steps / decode seconds (prefill excluded).",
              "- reconfig: each decode step timed at the driver (gRPC round trip included); PP stages run one "
              "micro-batch at a time (no pipelining in this loop). The bench (driver) process also needs CPU time.",
              "- worker ms/step: the last stage's own step time as it reports it (with PP, includes waiting "
              "for the previous stage's hidden states).",
              "- HF: each decode step timed inside generate (a stopping criterion timestamps every token); "
              "generate's own per-step work included."]
    if oversubscribed:
        lines.append(f"- oversubscribed ({num_cpus} CPUs, more worker processes): {', '.join(oversubscribed)}")
    return "\n".join(lines)


def plot(results: list[Measurement], path: Path, title: str) -> None:
    """Grouped bars: decode tok/s per batch size, one bar per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(_label(m) for m in results))
    batch_sizes = sorted({m.batch_size for m in results})
    value = {(_label(m), m.batch_size): m.tokens_per_second for m in results}
    width = 0.8 / len(labels)
    figure, axes = plt.subplots(figsize=(max(6.0, 0.6 * len(batch_sizes) * len(labels)), 4.5))
    for j, label in enumerate(labels):
        xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(batch_sizes))]
        axes.bar(xs, [value.get((label, b), 0.0) for b in batch_sizes], width, label=label)
    axes.set_xticks(range(len(batch_sizes)), [f"batch {b}" for b in batch_sizes])
    axes.set_yscale("log")
    axes.set_ylabel("decode tokens/s (log)")
    axes.set_title(title)
    axes.legend(fontsize=8)
    axes.grid(axis="y", alpha=0.3, which="both")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def make_prompts(config: BenchConfig) -> dict[int, list[list[int]]]:
    """Same-length random byte-token prompts; a smaller batch uses a prefix of the largest batch's prompts."""
    import numpy as np

    from services.model.presets import resolve_model
    from services.model.spec import ModelSpec

    vocab_size = min(NUM_BYTE_TOKENS, ModelSpec.from_dir(resolve_model(config.model)).vocab_size)
    rng = np.random.default_rng(config.seed)
    prompts = rng.integers(0, vocab_size, size=(max(config.batch_sizes), config.prompt_len)).tolist()
    return {b: prompts[:b] for b in config.batch_sizes}


def machine_info() -> dict:
    import torch
    import transformers

    return {"cpu_count": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "processor": platform.processor(), "loadavg": os.getloadavg()}


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama", help="preset (tiny-llama, llama-135m) or checkpoint dir")
    parser.add_argument("--batch-sizes", help=f"comma-separated (default {DEFAULTS['batch_sizes']})")
    parser.add_argument("--topologies", help=f"topology:workers, comma-separated (default {DEFAULTS['topologies']})")
    parser.add_argument("--prompt-len", type=int, help=f"prompt tokens (default {DEFAULTS['prompt_len']})")
    parser.add_argument("--new-tokens", type=int, help=f"tokens per prompt (default {DEFAULTS['new_tokens']})")
    parser.add_argument("--hf-threads", default="1,2", help="torch thread counts for the HF baseline")
    parser.add_argument("--worker-threads", type=int,
                        help="torch threads per worker (default: reconfig's own, usable cores // active workers)")
    parser.add_argument("--warmup-tokens", type=int, default=4, help="tokens of the untimed warm-up run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per point; the fastest is kept")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/forward.json"))
    parser.add_argument("--quick", action="store_true", help=f"smoke-run sizes: {QUICK}")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    pick = {key: getattr(args, key) if getattr(args, key) is not None else default for key, default in base.items()}
    layouts = []
    for item in pick["topologies"].split(","):
        topology, _, workers = item.strip().partition(":")
        layouts.append((topology, int(workers) if workers else _num_workers(topology)))
    return BenchConfig(
        model=args.model, batch_sizes=_ints(pick["batch_sizes"]), layouts=tuple(layouts),
        prompt_len=pick["prompt_len"], new_tokens=pick["new_tokens"], hf_threads=_ints(args.hf_threads),
        worker_threads=args.worker_threads,
        warmup_tokens=min(args.warmup_tokens, pick["new_tokens"]), repeats=args.repeats,
        block_size=args.block_size, seed=args.seed, out=args.out,
    )


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def _num_workers(topology: str) -> int:
    from services.topology import Topology

    return Topology.parse(topology).num_workers


def main(argv: list[str] | None = None) -> None:
    from services.logs import configure_logging

    configure_logging("bench", "WARNING")
    config = parse_args(argv)
    started = time.perf_counter()
    prompts = make_prompts(config)
    print(f"forward bench: {config.model}, batches {config.batch_sizes}, prompt {config.prompt_len}, "
          f"{config.new_tokens} new tokens", file=sys.stderr)
    results = measure_transformers(config, prompts)
    gc.collect()  # drop the HF model before the workers start
    results += measure_reconfig(config, prompts)
    reference = {m.batch_size: m for m in results if m.name == HF and m.num_threads == config.hf_threads[0]}
    for m in results:
        ref = reference[m.batch_size]
        if m is not ref:
            m.matches_hf = m.runs_agree and ref.runs_agree and m.tokens == ref.tokens
    info = machine_info()
    table = format_table(results, info["usable_cpus"], config.hf_threads[0])
    print(table)
    config.out.parent.mkdir(parents=True, exist_ok=True)
    elapsed = time.perf_counter() - started
    records = [{**asdict(m), "tokens_per_second": m.tokens_per_second, "ms_per_step": m.ms_per_step,
                "median_step_ms": 1e3 * statistics.median(m.step_seconds) if m.step_seconds else None}
               for m in results]
    payload = {"bench": "forward", "config": {**asdict(config), "out": str(config.out)}, "machine": info,
               "wall_seconds": elapsed, "results": records, "table": table}
    config.out.write_text(json.dumps(payload, indent=1) + "\n")
    plot_path = config.out.with_suffix(".png")
    plot(results, plot_path, f"{config.model}: decode tokens/s ({info['usable_cpus']} CPUs)")
    print(f"\nwrote {config.out} and {plot_path} in {elapsed:.0f}s", file=sys.stderr)
    if not all(m.matches_hf is not False for m in results):
        raise SystemExit("greedy tokens differ from Hugging Face (see the table)")


if __name__ == "__main__":
    main()
