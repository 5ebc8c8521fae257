"""Replay a slice of the Azure LLM conversation trace against `reconfig up`, next to Hugging Face `generate`.

    python bench/serve.py [--configs tp2pp2:4,tp1pp1:1] [--num-requests 64] [--model tiny-llama]

Prints a markdown table, writes JSON and a plot (TTFT / TPOT / end-to-end CDFs) under bench/results/.
Exits non-zero if a request failed or a greedy output differs from Hugging Face's.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import gc
import json
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack import REPO_ROOT, Stack  # noqa: E402  (stdlib only at import time)

DEFAULT_TRACE = REPO_ROOT / ".." / "shared" / "traces" / "azure_llm_2023_conv.csv"
MIN_PROMPT_TOKEN_ID, MAX_PROMPT_TOKEN_ID = 3, 255  # random byte tokens of the presets' tokenizer
MIN_OUTPUT_TOKENS = 2  # so every request has a TPOT
HF = "hf-generate"


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """Which slice of the trace, how it is scaled, and what serves it."""

    model: str
    trace: Path
    start: int                                # first trace row (0 = the row after the header)
    num_requests: int
    prompt_scale: float                       # prompt tokens = ContextTokens x prompt_scale, clamped
    output_scale: float                       # max_tokens = GeneratedTokens x output_scale, clamped
    time_scale: float                         # arrival offsets = trace offsets x time_scale
    max_prompt_tokens: int
    max_output_tokens: int
    layouts: tuple[tuple[str, int], ...]      # (topology, num_workers) per `reconfig up`
    kv_cache_mb: int
    hf_threads: tuple[int, ...]               # torch threads of the Hugging Face baseline, one run each
    hf_repeats: int                           # generate calls per request; the fastest is kept
    request_timeout: float                    # seconds per request, from its send
    startup_timeout: float                    # seconds for a stack to become ready
    seed: int
    out: Path

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.start < 0 or min(self.prompt_scale, self.output_scale, self.time_scale) <= 0:
            raise ValueError("need --num-requests >= 1, --start >= 0 and positive scales")
        if self.hf_repeats < 1 or not self.hf_threads or min(self.hf_threads) < 1:
            raise ValueError("need --hf-repeats >= 1 and --hf-threads >= 1")
        if self.max_prompt_tokens < 1 or self.max_output_tokens < MIN_OUTPUT_TOKENS:
            raise ValueError(f"need --max-prompt-tokens >= 1 and --max-output-tokens >= {MIN_OUTPUT_TOKENS}")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One replayed request: when it arrives (seconds after the first) and what it asks for."""

    index: int
    arrival: float
    prompt: tuple[int, ...]
    max_tokens: int
    trace_context_tokens: int
    trace_generated_tokens: int


@dataclass(slots=True)
class RequestResult:
    """What one request got; times in seconds from its send (HF: from its arrival, queueing included)."""

    index: int
    ttft: float | None = None                 # first chunk carrying text
    first_text_token: int = 0                 # index of the token that chunk ends with (from the HF tokens)
    e2e: float | None = None
    num_tokens: int = 0                       # completion tokens (usage)
    send_lag: float = 0.0                     # client-side lateness of the send vs the scheduled arrival
    finished_at: float = 0.0                  # seconds after the first scheduled arrival
    text: str = ""
    error: str | None = None
    matches_hf: bool | None = None

    @property
    def tpot(self) -> float | None:
        num_later_tokens = self.num_tokens - 1 - self.first_text_token  # tokens after the first chunk's
        if self.error or self.ttft is None or self.e2e is None or num_later_tokens < 1:
            return None
        return (self.e2e - self.ttft) / num_later_tokens


@dataclass(slots=True)
class ConfigResult:
    """One served configuration (or the HF baseline) over the whole slice."""

    name: str
    num_workers: int
    requests: list[RequestResult] = field(default_factory=list)
    wall_seconds: float = 0.0                 # first arrival to last completion
    server: dict = field(default_factory=dict)  # router /metrics after the replay

    def summary(self) -> dict:
        """Counts, throughput and latency percentiles (ms) of the completed requests."""
        import numpy as np

        done = [r for r in self.requests if r.error is None]
        out: dict = {"completed": len(done), "failed": len(self.requests) - len(done),
                     "matches_hf": sum(bool(r.matches_hf) for r in done),
                     "request_throughput": len(done) / self.wall_seconds if self.wall_seconds else 0.0,
                     "output_token_throughput": sum(r.num_tokens for r in done) / self.wall_seconds
                     if self.wall_seconds else 0.0}
        for metric in ("ttft", "tpot", "e2e"):
            values = [v for v in (getattr(r, metric) for r in done) if v is not None]
            out[f"num_{metric}"] = len(values)
            for q in (50, 99):
                out[f"{metric}_p{q}_ms"] = float(1e3 * np.percentile(values, q)) if values else None
        out["send_lag_max_ms"] = 1e3 * max((r.send_lag for r in self.requests), default=0.0)
        return out


def load_requests(config: ReplayConfig, vocab_size: int) -> list[TraceRequest]:
    """`num_requests` consecutive trace rows from `start`, scaled; prompts are seeded random byte tokens."""
    rows = []
    with open(config.trace, newline="") as file:
        for i, row in enumerate(csv.DictReader(file)):
            if i >= config.start + config.num_requests:
                break
            if i >= config.start:
                rows.append(row)
    if len(rows) < config.num_requests:
        raise SystemExit(f"{config.trace} has only {len(rows)} rows from row {config.start}")
    times = [datetime.fromisoformat(row["TIMESTAMP"][:26]) for row in rows]  # 7 fractional digits: keep 6
    rng = random.Random(config.seed)
    high = min(MAX_PROMPT_TOKEN_ID, vocab_size - 1)
    requests = []
    for i, (row, when) in enumerate(zip(rows, times)):
        context, generated = int(row["ContextTokens"]), int(row["GeneratedTokens"])
        num_prompt = min(max(round(context * config.prompt_scale), 1), config.max_prompt_tokens)
        max_tokens = min(max(round(generated * config.output_scale), MIN_OUTPUT_TOKENS), config.max_output_tokens)
        prompt = tuple(rng.randint(MIN_PROMPT_TOKEN_ID, high) for _ in range(num_prompt))
        arrival = (when - times[0]).total_seconds() * config.time_scale
        requests.append(TraceRequest(i, arrival, prompt, max_tokens, context, generated))
    return requests


def run_transformers(config: ReplayConfig, requests: list[TraceRequest]) -> list[ConfigResult]:
    """HF greedy generate, one request at a time in arrival order, against the same arrival times; one result per
    thread count (on a shared machine either may be the faster: the ratio is taken against the best)."""
    import torch
    import transformers

    from services.model.presets import PRESETS, resolve_model
    from services.model.tokenizer import PAD_TOKEN_ID, Tokenizer

    class TokenClock(transformers.StoppingCriteria):
        """Never stops; records when each token was produced (the first right after prefill)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    model_dir = resolve_model(config.model)
    tokenizer = Tokenizer.from_dir(model_dir)
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # exactly max_tokens tokens, as ignore_eos on the stack
    if config.model in PRESETS or model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = PAD_TOKEN_ID  # batch of 1: never used, silences a warning

    def generate(prompt: tuple[int, ...], max_tokens: int) -> tuple[float, list[float], list[int]]:
        clock, input_ids = TokenClock(), torch.tensor([prompt])  # [1, prompt_len]
        started = time.perf_counter()
        with torch.inference_mode():
            output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                    max_new_tokens=max_tokens, stopping_criteria=[clock])
        return started, clock.times, output[0, input_ids.shape[1]:].tolist()

    previous_threads, results = torch.get_num_threads(), []
    try:
        for num_threads in config.hf_threads:
            torch.set_num_threads(num_threads)
            generate(requests[0].prompt, 4)  # warm-up
            results.append(_replay_one_at_a_time(requests, generate, tokenizer, f"{HF} {num_threads}t",
                                                 config.hf_repeats))
    finally:
        torch.set_num_threads(previous_threads)
    return results


def _replay_one_at_a_time(requests: list[TraceRequest], generate, tokenizer, name: str,
                          num_repeats: int) -> ConfigResult:
    """Every request through `generate`, timed for real (the fastest of `num_repeats` calls: a stall of another
    process on a shared machine must not count against HF); the queue simulated on the arrival times."""
    result, free_at = ConfigResult(name, 0), 0.0
    for request in requests:
        runs = [generate(request.prompt, request.max_tokens) for _ in range(num_repeats)]
        started, times, tokens = min(runs, key=lambda run: run[1][-1] - run[0])
        if len(tokens) != request.max_tokens:
            raise RuntimeError(f"HF generate stopped early ({len(tokens)} of {request.max_tokens} tokens)")
        begin = max(request.arrival, free_at)  # simulated: waits for the previous request to finish
        first = _first_text_token(tokenizer, tokens)
        end = begin + times[-1] - started
        result.requests.append(RequestResult(
            request.index, ttft=begin - request.arrival + times[first] - started, first_text_token=first,
            e2e=end - request.arrival, num_tokens=len(tokens), finished_at=end, text=tokenizer.decode(tokens),
        ))
        free_at = end
    result.wall_seconds = free_at - requests[0].arrival
    return result


def _first_text_token(tokenizer, tokens: list[int]) -> int:
    """Index of the token whose delta is the first to carry text (the router holds back partial UTF-8)."""
    decoder = tokenizer.incremental_decoder()
    for i, token_id in enumerate(tokens):
        if decoder.push(token_id):
            return i
    return len(tokens) - 1


async def _send(client, model: str, request: TraceRequest, t0: float, timeout: float) -> RequestResult:
    """Wait for the request's arrival time, stream it, time its chunks."""
    await asyncio.sleep(max(0.0, t0 + request.arrival - time.perf_counter()))
    sent = time.perf_counter()
    result = RequestResult(request.index, send_lag=sent - t0 - request.arrival)
    texts, first_chunk = [], None
    try:
        async with asyncio.timeout(timeout):
            stream = await client.completions.create(
                model=model, prompt=list(request.prompt), max_tokens=request.max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices:
                    first_chunk = first_chunk or now
                    if chunk.choices[0].text and result.ttft is None:
                        result.ttft = now - sent
                    texts.append(chunk.choices[0].text)
                if chunk.usage is not None:
                    result.num_tokens = chunk.usage.completion_tokens
    except Exception as exc:  # noqa: BLE001 - every failure is counted and reported, never raised
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    done = time.perf_counter()
    result.e2e, result.finished_at, result.text = done - sent, done - t0, "".join(texts)
    if result.ttft is None and first_chunk is not None:  # no text at all: the first chunk stands in
        result.ttft = first_chunk - sent
    if result.error is None and result.num_tokens != request.max_tokens:
        result.error = f"got {result.num_tokens} of {request.max_tokens} tokens"
    return result


async def replay(base_url: str, requests: list[TraceRequest], timeout: float) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time (concurrently); returns results and first-arrival→last-finish."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                                  timeout=timeout) as client:
        model = (await client.models.list()).data[0].id
        for request in requests[:2]:  # warm-up, untimed
            await _send(client, model, TraceRequest(-1, 0.0, request.prompt, 4, 0, 0), time.perf_counter(), timeout)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_send(client, model, r, t0, timeout) for r in requests))
    return list(results), max(r.finished_at for r in results)


def run_stack(config: ReplayConfig, topology: str, num_workers: int, requests: list[TraceRequest]) -> ConfigResult:
    """Start `reconfig up` for one layout, replay the slice, stop it."""
    print(f"  {topology} ({num_workers} workers): starting", file=sys.stderr, flush=True)
    with Stack(config.model, topology, num_workers, config.kv_cache_mb, config.startup_timeout) as stack:
        results, wall = asyncio.run(replay(stack.base_url, requests, config.request_timeout))
        server = stack.scrape()
        if any(r.error for r in results):
            print(f"  reconfig up log tail:\n{stack.log_tail()}", file=sys.stderr)
    return ConfigResult(topology, num_workers, results, wall, server)


def format_table(results: list[ConfigResult], config: ReplayConfig, requests: list[TraceRequest],
                 num_cpus: int) -> str:
    """Markdown table plus the methodology notes."""
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"

    lines = ["| config | workers | ok | failed | = HF | req/s | out tok/s | ÷ HF | TTFT p50 | TTFT p99 | TPOT p50 "
             "| TPOT p99 | e2e p50 | e2e p99 |", "|---|" + "---:|" * 13]
    hf_throughput = max(r.summary()["output_token_throughput"] for r in results if r.name.startswith(HF))
    for result in results:
        s = result.summary()
        lines.append(
            f"| {result.name} | {result.num_workers or '-'} | {s['completed']} | {s['failed']} | "
            f"{'ref' if result is results[0] else s['matches_hf']} | {s['request_throughput']:.2f} | "
            f"{s['output_token_throughput']:.1f} | {s['output_token_throughput'] / hf_throughput:.2f}x | "
            + " | ".join(ms(s[f"{m}_p{q}_ms"]) for m in ("ttft", "tpot", "e2e") for q in (50, 99)) + " |")
    prompts, outputs = [len(r.prompt) for r in requests], [r.max_tokens for r in requests]
    span = requests[-1].arrival
    num_late = sum(r.first_text_token > 0 for r in results[0].requests)
    lines += [
        "", f"Notes: {config.model}, {len(requests)} requests (trace rows {config.start}.."
        f"{config.start + len(requests) - 1}) over {span:.1f}s ({len(requests) / max(span, 1e-9):.1f} req/s offered); "
        f"prompt tokens = context x {config.prompt_scale:g} in [1, {config.max_prompt_tokens}] "
        f"(mean {sum(prompts) / len(prompts):.0f}), output tokens = generated x {config.output_scale:g} "
        f"in [{MIN_OUTPUT_TOKENS}, {config.max_output_tokens}] (mean "
        f"{sum(outputs) / len(outputs):.0f}), arrivals = trace offsets x {config.time_scale}. {num_cpus} CPUs. "
        "Latencies in ms.",
        "- reconfig: `reconfig up` per config (its own torch threads per worker); each request streamed through the "
        "openai client (greedy, ignore_eos) at its arrival time, timed from its send (client send lag up to "
        f"{max(r.summary()['send_lag_max_ms'] for r in results):.0f} ms, not counted). Throughput: completed requests "
        "and tokens over first arrival to last completion.",
        f"- TTFT = time to the first chunk with text. The router sends no chunk for a token without text (one that "
        f"begins a UTF-8 character, or a special token): for {num_late} of {len(requests)} requests that is token 2 "
        "or later (same tokens on every side). TPOT = (e2e - TTFT) / tokens after that first chunk's; requests "
        "with none have no TPOT.",
        f"- {HF} Nt: transformers float32, N torch threads, greedy, eos off, one request at a time in arrival order "
        f"(each the fastest of {config.hf_repeats} generate call(s)). "
        "Each generate is timed for real (every token timestamped); the queue is simulated on the same arrival "
        "times: a request starts when it arrives or the previous one finishes; TTFT = wait + time to the same "
        "first text-carrying token (prefill alone when that is the first token), e2e = wait + generate time.",
        "- = HF: completed requests whose streamed text equals the decoded HF tokens (of the first HF row). ÷ HF: "
        "output tokens/s over the fastest HF row's; with arrivals compressed below the service time (saturation), "
        "HF's is its one-request-at-a-time throughput.",
    ]
    oversubscribed = [r.name for r in results if r.num_workers + 1 > num_cpus]
    if oversubscribed:
        lines.append(f"- oversubscribed (workers + router > {num_cpus} CPUs): {', '.join(oversubscribed)}")
    return "\n".join(lines)


def plot(results: list[ConfigResult], path: Path, title: str) -> None:
    """CDFs of TTFT, TPOT and e2e latency, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for axis, metric, label in zip(axes, ("ttft", "tpot", "e2e"), ("TTFT", "TPOT", "end-to-end latency")):
        for result in results:
            values = sorted(1e3 * v for v in (getattr(r, metric) for r in result.requests if r.error is None)
                            if v is not None)
            if values:
                axis.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                          label=f"{result.name} ({result.num_workers} w)" if result.num_workers else result.name)
        axis.set_xscale("log")
        axis.set_xlabel(f"{label} (ms, log)")
        axis.set_ylabel("fraction of requests")
        axis.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse_args(argv: list[str] | None = None) -> ReplayConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama", help="preset (tiny-llama, llama-135m) or checkpoint dir")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                        help="TIMESTAMP,ContextTokens,GeneratedTokens CSV [../shared/traces/azure_llm_2023_conv.csv]")
    parser.add_argument("--start", type=int, default=0, help="first trace row")
    parser.add_argument("--num-requests", type=int, default=64, help="consecutive trace rows replayed")
    parser.add_argument("--prompt-scale", type=float, default=1 / 16, help="x ContextTokens")
    parser.add_argument("--output-scale", type=float, default=1 / 8, help="x GeneratedTokens")
    parser.add_argument("--time-scale", type=float, default=0.25, help="< 1 compresses the arrivals")
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--max-output-tokens", type=int, default=64)
    parser.add_argument("--configs", default="tp2pp2:4,tp1pp1:1", help="topology:workers, comma-separated")
    parser.add_argument("--kv-cache-mb", type=int, default=64, help="KV cache per worker")
    parser.add_argument("--request-timeout", type=float, default=60.0, help="seconds per request")
    parser.add_argument("--startup-timeout", type=float, default=120.0, help="seconds to /ready")
    parser.add_argument("--hf-threads", default="", help="HF baseline's torch threads, comma-separated [1,usable CPUs]")
    parser.add_argument("--hf-repeats", type=int, default=1, help="HF generate calls per request, fastest kept")
    parser.add_argument("--seed", type=int, default=0, help="of the random prompts")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "serve.json")
    args = parser.parse_args(argv)
    layouts = []
    for item in args.configs.split(","):
        topology, _, workers = item.strip().partition(":")
        layouts.append((topology, int(workers) if workers else _num_workers(topology)))
    return ReplayConfig(
        model=args.model, trace=args.trace.resolve(), start=args.start, num_requests=args.num_requests,
        prompt_scale=args.prompt_scale, output_scale=args.output_scale, time_scale=args.time_scale,
        max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_output_tokens, layouts=tuple(layouts),
        kv_cache_mb=args.kv_cache_mb, request_timeout=args.request_timeout, startup_timeout=args.startup_timeout,
        hf_threads=tuple(int(n) for n in args.hf_threads.split(",")) if args.hf_threads
        else tuple(sorted({1, len(os.sched_getaffinity(0))})), hf_repeats=args.hf_repeats, seed=args.seed,
        out=args.out,
    )


def _num_workers(topology: str) -> int:
    from services.topology import Topology

    return Topology.parse(topology).num_workers


def machine_info() -> dict:
    import torch
    import transformers

    return {"cpu_count": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "loadavg": os.getloadavg()}


def main(argv: list[str] | None = None) -> None:
    from services.logs import configure_logging
    from services.model.presets import resolve_model
    from services.model.tokenizer import Tokenizer

    configure_logging("bench", "WARNING")
    config = parse_args(argv)
    started = time.perf_counter()
    requests = load_requests(config, Tokenizer.from_dir(resolve_model(config.model)).vocab_size)
    print(f"serve bench: {config.model}, {len(requests)} requests over {requests[-1].arrival:.1f}s", file=sys.stderr)
    results = run_transformers(config, requests)
    print(f"  {HF}: done", file=sys.stderr, flush=True)
    gc.collect()  # drop the HF model before the stacks start
    baseline = results[0]
    for other in results[1:]:  # the HF runs at other thread counts must produce the same tokens
        for mine, reference in zip(other.requests, baseline.requests):
            mine.matches_hf = mine.text == reference.text
    for topology, num_workers in config.layouts:
        result = run_stack(config, topology, num_workers, requests)
        for mine, reference in zip(result.requests, baseline.requests):
            mine.matches_hf = mine.error is None and mine.text == reference.text
            mine.first_text_token = reference.first_text_token  # same tokens when the text matches
        results.append(result)
    info = machine_info()
    table = format_table(results, config, requests, info["usable_cpus"])
    print(table)
    elapsed = time.perf_counter() - started
    payload = {
        "bench": "serve", "config": {**asdict(config), "trace": str(config.trace), "out": str(config.out)},
        "machine": info, "wall_seconds": elapsed, "table": table,
        "requests": [{"index": r.index, "arrival": r.arrival, "prompt_tokens": len(r.prompt),
                      "max_tokens": r.max_tokens, "trace_context_tokens": r.trace_context_tokens,
                      "trace_generated_tokens": r.trace_generated_tokens} for r in requests],
        "results": [{"name": r.name, "num_workers": r.num_workers, "wall_seconds": r.wall_seconds,
                     "summary": r.summary(), "server_metrics": r.server,
                     "requests": [{**{k: v for k, v in asdict(q).items() if k != "text"}, "tpot": q.tpot}
                                  for q in r.requests]} for r in results],
    }
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(payload, indent=1) + "\n")
    plot_path = config.out.with_suffix(".png")
    plot(results, plot_path, f"{config.model}: trace replay, {len(requests)} requests ({info['usable_cpus']} CPUs)")
    print(f"\nwrote {config.out} and {plot_path} in {elapsed:.0f}s", file=sys.stderr)
    failed = sum(r.summary()["failed"] for r in results)
    mismatched = sum(r.summary()["completed"] - r.summary()["matches_hf"] for r in results if r is not baseline)
    if failed or mismatched:
        raise SystemExit(f"{failed} failed request(s), {mismatched} output(s) differ from Hugging Face")


if __name__ == "__main__":
    main()
