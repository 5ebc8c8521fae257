"""The serving path's host cost, in CPU time the processes themselves count (so it holds on any core count): a real
`reconfig up` stack (tiny-llama, tp1pp1 by default) serving N concurrent streamed /v1/completions, measured over the
steady decode phase.

    python bench/serving_cpu.py [--batch 64] [--new-tokens 512] [--api-servers 1,2] [--model tiny-llama]
                                [--temperature 0]

For each configuration: the CPU seconds of every process of the stack (utime + stime of /proc/PID/stat, all its
threads) over the window where all N requests decode (from the moment each has streamed 8 tokens to the moment the
first has streamed all but 8), divided by the decode steps in it (tokens streamed / N) for the engine and the
workers, and by the tokens streamed for the API servers. Where one process does both (the router before the API
servers had processes of their own) its CPU is reported both ways. Then the bytes of a decode step's messages to and
from a worker at 128- and 4096-token contexts, built by the router's own wire code for a 64-request batch, and the
host work of such a step alone, in this process (bench/wire_sizes.py step_work_us: the router's scheduling, encoding
and result handling, the worker's row reading, without the stack: on a shared machine it moves with the machine's
speed too, so compare commits with runs interleaved).

The client is a minimal HTTP/1.1 reader on raw asyncio streams in this process (its CPU is not counted): it only reads
the token count each event's usage carries (`continuous_usage_stats`, which every configuration pays alike). Prints
a table, writes JSON and a plot (bench/results/ by default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import apply_defaults, write_report  # noqa: E402
from stack import Stack  # noqa: E402

DEFAULTS = dict(model="tiny-llama", topology="tp1pp1", batch=64, prompt_len=64, new_tokens=512, api_servers="0,1,2")
EDGE_TOKENS = 8          # tokens at each end of a stream left out of the window (prefill, the last steps)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14 and 15)


_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":(\d+)')


class SseStream:
    """One streamed completion over a raw HTTP/1.1 connection; counts the tokens its server-sent events carry (a
    lagging consumer gets several tokens in one event), from the usage each chunk carries."""

    def __init__(self, host: str, port: int, body: dict) -> None:
        self.host, self.port, self.body = host, port, json.dumps(body).encode()
        self.num_tokens = 0

    async def run(self) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(self.body) + self.body)
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP {status!r}: {(await reader.read(2000)).decode(errors='replace')}")
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # headers
        pending = b""
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)  # chunked transfer encoding
            if size == 0:
                break
            pending += await reader.readexactly(size + 2)
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if (usage := _COMPLETION_TOKENS.search(event)) is not None:
                    self.num_tokens = int(usage.group(1))
        writer.close()


async def serve_batch(base_url: str, args: argparse.Namespace, vocab: int) -> tuple[list[SseStream], float, float]:
    """Stream args.batch requests at once; returns the streams and the window (start, end) of the steady decode."""
    host, port = base_url.removeprefix("http://").split(":")
    rng = random.Random(0)
    streams = [SseStream(host, int(port), {
        "model": args.model, "prompt": [rng.randrange(3, vocab) for _ in range(args.prompt_len)],
        "max_tokens": args.new_tokens, "temperature": args.temperature, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        for _ in range(args.batch)]
    tasks = [asyncio.ensure_future(s.run()) for s in streams]
    start = end = None
    while end is None:
        await asyncio.sleep(0.005)
        if all(t.done() for t in tasks) or any(t.done() and t.exception() for t in tasks):
            await asyncio.gather(*tasks)
            raise RuntimeError("the streams ended before the window did: more --new-tokens")
        if start is None and min(s.num_tokens for s in streams) >= EDGE_TOKENS:
            start = (time.perf_counter(), sum(s.num_tokens for s in streams))
            start_cpu = snapshot()
        if start is not None and max(s.num_tokens for s in streams) >= args.new_tokens - EDGE_TOKENS:
            end = (time.perf_counter(), sum(s.num_tokens for s in streams))
            end_cpu = snapshot()
    await asyncio.gather(*tasks)
    return streams, (start, end), (start_cpu, end_cpu)


PIDS: dict[str, int] = {}


def snapshot() -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in PIDS.items()}


def measure(args: argparse.Namespace, api_servers: int) -> dict:
    extra = ["--api-servers", str(api_servers)]  # the default max_num_seqs (128) holds the batch
    with Stack(args.model, topology=args.topology, num_workers=1, kv_cache_mb=args.kv_cache_mb,
               extra_args=extra) as stack:
        PIDS.clear()
        PIDS.update({name: pid for name, pid in stack.info["pids"].items() if name != "launcher"})
        vocab = vocab_size(args.model)
        asyncio.run(serve_batch(stack.base_url, args, vocab))  # warm-up: graphs, caches, allocator
        streams, window, cpu = asyncio.run(serve_batch(stack.base_url, args, vocab))
    (t0, events0), (t1, events1) = window
    tokens = events1 - events0
    steps = tokens / args.batch
    used = {name: cpu[1][name] - cpu[0][name] for name in cpu[0]}
    engine = [n for n in used if n in ("router", "engine")]
    apis = [n for n in used if n.startswith("api")] or engine  # the router serves HTTP itself without API servers
    workers = [n for n in used if n.startswith("worker")]
    engine_cpu, api_cpu = sum(used[n] for n in engine), sum(used[n] for n in apis)
    return dict(api_servers=api_servers, processes=sorted(used), seconds=t1 - t0, tokens=tokens, steps=steps,
                decode_tokens_per_s=tokens / (t1 - t0), cpu_seconds=used,
                engine_ms_per_step=engine_cpu / steps * 1e3, api_us_per_token=api_cpu / tokens * 1e6,
                worker_ms_per_step=sum(used[n] for n in workers) / steps * 1e3,
                shared=apis == engine, all_tokens=sum(s.num_tokens for s in streams))


def vocab_size(model: str) -> int:
    """The ids a prompt may use: the tokenizer's and the model's both."""
    from services.model.presets import resolve_model
    from services.model.tokenizer import Tokenizer

    model_dir = resolve_model(model)
    return min(Tokenizer.from_dir(model_dir).vocab_size, json.loads((model_dir / "config.json").read_text())["vocab_size"])


def message_sizes(batch: int, contexts: tuple[int, ...]) -> list[dict]:
    """Bytes of a steady decode step's request to a worker and its result, by context length."""
    from wire_sizes import decode_step_bytes

    return [dict(context=c, **decode_step_bytes(batch, c)) for c in contexts]


def format_table(rows: list[dict], sizes: list[dict], batch: int, work: dict) -> str:
    lines = ["| API servers | decode tok/s | engine CPU ms / step | API CPU us / token | worker CPU ms / step | "
             "processes |", "|---|---|---|---|---|---|"]
    for r in rows:
        shared = " (one process: both)" if r["shared"] else ""
        lines.append(f"| {r['api_servers']}{shared} | {r['decode_tokens_per_s']:,.0f} | {r['engine_ms_per_step']:.2f} | "
                     f"{r['api_us_per_token']:.1f} | {r['worker_ms_per_step']:.2f} | {', '.join(r['processes'])} |")
    lines += ["", f"| context (tokens) | step request bytes ({batch} decodes): full form | delta form | "
              "step result bytes: full form | delta form |", "|---|---|---|---|---|"]
    lines += [f"| {s['context']} | {s['request_bytes']:,} | {s['delta_request_bytes']:,} | {s['result_bytes']:,} | "
              f"{s['delta_result_bytes']:,} |" for s in sizes]
    lines += ["", f"The same step's host work alone, in one process ({batch} decodes, steps ahead, no model): router "
              f"{work['router_us_per_step']:.0f} us, worker "
              f"{work['worker_us_per_step']:.0f} us per step."]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    labels = [str(r["api_servers"]) for r in rows]
    left.bar(labels, [r["engine_ms_per_step"] for r in rows])
    left.axhline(1.0, color="gray", linestyle="--", label="goal 1 ms")
    left.set_xlabel("API servers")
    left.set_ylabel("engine CPU ms / decode step")
    left.legend()
    right.bar(labels, [r["api_us_per_token"] for r in rows], color="tab:orange")
    right.axhline(40.0, color="gray", linestyle="--", label="goal 40 us")
    right.set_xlabel("API servers")
    right.set_ylabel("API CPU us / streamed token")
    right.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--topology")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--api-servers", help="comma-separated counts to run, e.g. 0,1,2 (0: the engine's process "
                                              "serves HTTP itself, as before API servers had processes)")
    parser.add_argument("--kv-cache-mb", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="the requests' (0: greedy; above it the worker draws every row with the sampler)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "serving_cpu.json")
    args = parser.parse_args(argv)
    apply_defaults(args, DEFAULTS)
    rows = []
    for count in (int(c) for c in args.api_servers.split(",")):
        print(f"[serving-cpu] {args.model} {args.topology}, {args.batch} streams, --api-servers {count}", flush=True)
        rows.append(measure(args, count))
    sizes = message_sizes(args.batch, (128, 4096))
    from wire_sizes import step_work_us

    work = step_work_us(args.batch)
    sampled = f", temperature {args.temperature}" if args.temperature else ""
    title = (f"{args.model} {args.topology}: {args.batch} SSE streams, {args.new_tokens} new tokens{sampled}; CPU of "
             f"each process over the steady decode ({os.cpu_count()} cores)")
    write_report(args, title, format_table(rows, sizes, args.batch, work), rows, plot, message_sizes=sizes,
                 step_work=work)


if __name__ == "__main__":
    main()
