"""Recovery from a lost worker vs a cold restart, with requests in flight: time to stall, to resume, to next token.

    python bench/recovery.py [--model llama-135m] [--quick]

Each kill scenario runs N greedy requests to the end (the reference) on a fresh 4-worker stack with the controller's
loops (refresh, Recoverer.watch), then again, and kills one worker (SIGKILL) once each request has --kill-after tokens:
1. tp2pp2, rank 1 (its KV has no replica: dropped, re-prefill); 2. tp4pp1, rank 2, only when num_kv_heads < 4 (KV
migrates from the replicas). 3. Baseline: cold restart of 3 workers in scenario 1's degraded layout (switch.py's
start_stack) + re-prefill until each request's next token. 4. On scenario 1's stack, requests decoding again:
start_joiner + add_worker back to tp2pp2. Tokens must equal the reference (exit 1 otherwise). Prints tables, writes
JSON and a plot. Heavy imports stay inside functions: worker processes re-import this module as `__mp_main__`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import switch  # noqa: E402  (stdlib only at import time)

DEFAULTS = dict(model="llama-135m", num_requests=16, prompt_len=256, max_tokens=64, kv_cache_mb=96)
QUICK = dict(model="tiny-llama", num_requests=8, prompt_len=32, max_tokens=48, kv_cache_mb=4)
START, REPLICATED, VICTIM, REPLICATED_VICTIM = "tp2pp2", "tp4pp1", 1, 2
PHASES, MIB, TOKEN = switch.PHASES, switch.MIB, "recovery-bench-token"


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What to measure."""

    model: str
    num_requests: int
    prompt_len: int
    max_tokens: int
    kill_after: int                  # tokens every request has when the worker is killed (mid-decode)
    kv_cache_mb: int                 # KV budget per worker
    block_size: int
    refresh_interval_s: float        # controller refresh: heartbeats and the router's stall report
    seed: int
    out: Path

    def __post_init__(self) -> None:
        if self.num_requests < 1 or not 1 <= self.kill_after < self.max_tokens - 1:
            raise ValueError("need >= 1 request and 1 <= --kill-after < --max-tokens - 1")

    def for_switch(self, num_workers: int) -> switch.BenchConfig:
        """The same sizes as bench/switch.py's config (its start_stack and make_prompts take one)."""
        return switch.BenchConfig(self.model, (START, START), num_workers, self.num_requests, self.prompt_len,
                                  self.max_tokens, 0, self.kv_cache_mb, self.block_size, False, 0, self.seed, self.out)


@dataclass(slots=True)
class Recovery:
    """One scenario; seconds from the kill (replacement: from starting the joiner)."""

    scenario: str
    source: str
    target: str
    stalled_s: float | None          # the router's engine reports a stall
    detected_s: float | None         # the recover operation starts (the controller noticed)
    resumed_s: float                 # the recover operation ended, router resumed (replacement: full strength)
    next_token_s: float | None       # every request has a token generated after the kill
    operations: list[dict]           # kind, phase_seconds, kv_bytes_moved, kv_dropped, lost_workers
    kv_dropped: bool
    num_reprefilled: int             # engine.num_full_prefills delta
    tokens_match: bool               # every request's tokens equal the reference
    joiner_start_s: float = 0.0
    snapshot: list[list[int]] = field(default_factory=list, repr=False)  # prompt + tokens at the kill

    @property
    def frozen_s(self) -> float:
        return sum(sum(op["phase_seconds"].values()) for op in self.operations)


@dataclass(slots=True)
class _Stack:
    """switch.stop_stack's fields, the recovery side, and every operation seen: id -> [status, start, end]."""

    cluster: object
    engine: object
    server: object
    state: object
    reconfigurer: object
    recoverer: object
    tasks: list = field(default_factory=list)
    seen: dict = field(default_factory=dict)


async def start_stack(config: BenchConfig, topology: str) -> _Stack:
    """The stack of tests/reconfigure/test_worker_loss.py: 4 workers and the controller's loops in process."""
    from services.controller.recovery import Recoverer
    from services.controller.state import ControllerConfig, ControllerState
    from services.controller.transaction import Reconfigurer
    from services.launch.cluster import ClusterConfig, LocalCluster
    from services.model.spec import ModelSpec
    from services.router.grpc_server import start_router_grpc
    from services.router.main import RouterConfig, build_engine

    cluster = LocalCluster(ClusterConfig(model=config.model, num_workers=4, topology=topology,
                                         block_size=config.block_size, kv_cache_bytes=config.kv_cache_mb * MIB,
                                         env={"RECONFIG_LOG_LEVEL": "WARNING"}))
    cluster.start()
    addresses = tuple(cluster.worker_addresses)
    engine = await build_engine(RouterConfig(worker_addresses=addresses, model_dir=str(cluster.model_dir),
                                             model_name=config.model))  # recovery_timeout_s > 0: steps stall
    server, port = await start_router_grpc(engine, "127.0.0.1", 0, TOKEN)
    state = ControllerState(ControllerConfig(
        token=TOKEN, worker_addresses=addresses, topology=topology, router_grpc_address=f"127.0.0.1:{port}",
        model_dir=str(cluster.model_dir), refresh_interval_s=config.refresh_interval_s))
    await state.open()
    reconfigurer = Reconfigurer(state, ModelSpec.from_dir(cluster.model_dir), None, state.router_stub, TOKEN)
    stack = _Stack(cluster, engine, server, state, reconfigurer, Recoverer(reconfigurer))
    record = state.record_operation

    def recorded(operation) -> None:  # an operation ends after the router resumed
        record(operation)
        seen = stack.seen.setdefault(operation.operation_id, [operation, time.perf_counter(), None])
        seen[0] = operation
        if operation.state.name != "RUNNING":
            seen[2] = time.perf_counter()

    state.record_operation = recorded
    stack.tasks = [asyncio.ensure_future(state.run()), asyncio.ensure_future(stack.recoverer.watch())]
    return stack


async def stop_stack(stack: _Stack) -> float:
    for task in stack.tasks:
        task.cancel()
    await asyncio.gather(*stack.tasks, return_exceptions=True)
    return await switch.stop_stack(stack)


class Requests(switch.Requests):
    """switch.Requests, with a bounded wait for the end."""

    async def finish(self) -> list[list[int]]:
        await asyncio.wait_for(asyncio.gather(*self.tasks), 600)
        return self.tokens


async def _seconds_until(predicate, started: float, timeout_s: float = 300.0) -> float:
    while not predicate():
        if time.perf_counter() - started > timeout_s:
            raise TimeoutError(f"not within {timeout_s:.0f}s")
        await asyncio.sleep(0.002)
    return time.perf_counter() - started


def _operations(stack: _Stack, known: set[str]) -> list[dict]:
    """The operations that started after `known` was taken, with their start and end in perf_counter seconds."""
    return [{"kind": op.kind, "state": op.state.name, "from": op.from_topology, "to": op.to_topology,
             "phase_seconds": {p: op.phase_seconds.get(p, 0.0) for p in PHASES}, "kv_bytes_moved": op.kv_bytes_moved,
             "kv_dropped": op.kv_dropped, "lost_workers": list(op.lost_workers), "error": op.error,
             "started": started, "ended": ended}
            for key, (op, started, ended) in stack.seen.items() if key not in known]


async def lose_worker(config: BenchConfig, stack: _Stack, prompts: list[list[int]], victim: int, scenario: str
                      ) -> tuple[Recovery, list[list[int]]]:
    """Reference run, then the same requests again with `victim` killed mid-decode; returns the reference too."""
    engine, source = stack.engine, str(stack.state.topology)
    reference = await Requests(engine, prompts, config.max_tokens, "reference").finish()
    live = Requests(engine, prompts, config.max_tokens, "live")
    await _seconds_until(lambda: live.have([config.kill_after] * len(prompts)), time.perf_counter())
    counts, snapshot = [len(t) + 1 for t in live.tokens], [p + t for p, t in zip(prompts, live.tokens)]
    prefills, known = engine.num_full_prefills, set(stack.seen)

    def recovered() -> dict | None:
        return next((op for op in _operations(stack, known) if op["kind"] == "recover" and op["ended"]), None)

    started = time.perf_counter()
    os.kill(stack.cluster.worker_pids[victim], signal.SIGKILL)
    stalled_s, _, next_token_s = await asyncio.gather(_seconds_until(lambda: bool(engine.stalled), started),
                                                      _seconds_until(recovered, started),
                                                      _seconds_until(lambda: live.have(counts), started))
    outputs, op = await live.finish(), recovered()
    if op["state"] != "SUCCEEDED":
        raise RuntimeError(f"{scenario}: recovery {op['state']}: {op['error']}")
    resumed_s = op["ended"] - started
    _log(f"{scenario}: stalled {stalled_s:.3f}s, resumed {resumed_s:.3f}s, next token {next_token_s:.3f}s")
    return Recovery(scenario, source, op["to"], stalled_s, op["started"] - started, resumed_s, next_token_s,
                    _operations(stack, known), op["kv_dropped"], engine.num_full_prefills - prefills,
                    outputs == reference, snapshot=snapshot), reference


async def replace_worker(config: BenchConfig, stack: _Stack, prompts: list[list[int]], reference: list[list[int]]
                         ) -> Recovery:
    """With the requests decoding again: a joiner starts, add_worker brings it in and switches back to START."""
    engine, source = stack.engine, str(stack.state.topology)
    live = Requests(engine, prompts, config.max_tokens, "replace")
    await _seconds_until(lambda: live.have([config.kill_after] * len(prompts)), time.perf_counter())
    prefills, known = engine.num_full_prefills, set(stack.seen)
    started = time.perf_counter()
    joiner = await asyncio.to_thread(stack.cluster.start_joiner)  # the engine keeps decoding meanwhile
    joiner_start_s = time.perf_counter() - started
    switched = await stack.recoverer.add_worker(joiner, topology=START)
    resumed_s = time.perf_counter() - started
    if switched.state.name != "SUCCEEDED":
        raise RuntimeError(f"add-worker then switch to {START}: {switched.state.name}: {switched.error}")
    outputs = await live.finish()
    _log(f"replacement: joiner up {joiner_start_s:.2f}s, {START} again {resumed_s:.2f}s after the start")
    return Recovery("4. replacement", source, str(stack.state.topology), None, None, resumed_s, None,
                    _operations(stack, known), False, engine.num_full_prefills - prefills, outputs == reference,
                    joiner_start_s)


async def cold_restart(config: BenchConfig, lost: Recovery, reference: list[list[int]], stop_s: float
                       ) -> switch.Restart:
    """switch.py's baseline: a 3-worker stack in the degraded layout, re-prefill until every next token."""
    stack, workers_s, router_s = await switch.start_stack(config.for_switch(3), lost.target)
    started = time.perf_counter()
    tokens = await Requests(stack.engine, lost.snapshot, 1, "restart").finish()
    reprefill_s = time.perf_counter() - started
    await switch.stop_stack(stack)
    done = [len(s) - config.prompt_len for s in lost.snapshot]
    match = all(t == ref[n:n + 1] for t, ref, n in zip(tokens, reference, done))
    _log(f"cold restart into {lost.target}: {stop_s + workers_s + router_s + reprefill_s:.2f}s")
    return switch.Restart(stop_s, workers_s, router_s, reprefill_s, match)


async def run(config: BenchConfig, num_kv_heads: int) -> tuple[list[Recovery], switch.Restart]:
    prompts = switch.make_prompts(config.for_switch(4))
    stack = await start_stack(config, START)
    try:
        lost, reference = await lose_worker(config, stack, prompts, VICTIM, "1. kill, KV dropped")
        replaced = await replace_worker(config, stack, prompts, reference)
    finally:
        stop_s = await stop_stack(stack)
    restart = await cold_restart(config, lost, reference, stop_s)
    recoveries = [lost]
    if num_kv_heads < 4:  # tp4 holds each KV head on two workers
        stack = await start_stack(config, REPLICATED)
        try:
            recoveries.append((await lose_worker(config, stack, prompts, REPLICATED_VICTIM, "2. kill, KV kept"))[0])
        finally:
            await stop_stack(stack)
    else:
        _log(f"2. skipped: {config.model} has {num_kv_heads} KV heads, so {REPLICATED} holds no KV replica")
    return recoveries + [replaced], restart


def _log(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def format_table(config: BenchConfig, recoveries: list[Recovery], restart: switch.Restart, num_kv_heads: int) -> str:
    """Markdown: the timeline from the kill per scenario (cold restart as row 3), then the operations' phases."""
    r0, rs = recoveries[0], restart
    lines = ["| scenario | layout | stalled s | detected s | resumed s | every next token s | frozen s | KV "
             "| re-prefilled | cold restart / live |", "|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in recoveries:
        ratio = f"{rs.seconds / r.next_token_s:.1f}x" if r.next_token_s else "-"
        lines.append(f"| {r.scenario} | {r.source}→{r.target} | {_s(r.stalled_s)} | {_s(r.detected_s)} | "
                     f"{_s(r.resumed_s)} | {_s(r.next_token_s)} | {r.frozen_s:.2f} | "
                     f"{'dropped' if r.kv_dropped else 'kept'} | {r.num_reprefilled} | {ratio} |")
        if r is r0:
            lines.append(f"| 3. cold restart | 3 workers, {r.target} | - | - | {rs.seconds - rs.reprefill_seconds:.2f} "
                         f"| {rs.seconds:.2f} | {rs.seconds:.2f} | lost | {config.num_requests} | 1.0x |")
    lines += ["", "| scenario | operation | from → to | " + " | ".join(f"{p.lower()} ms" for p in PHASES)
              + " | total ms | KV moved MiB | lost |", "|---|---|---|" + "---:|" * (len(PHASES) + 2) + "---|"]
    for r in recoveries:
        for op in r.operations:
            phases = op["phase_seconds"]
            lines.append(f"| {r.scenario} | {op['kind']} | {op['from']} → {op['to']} | "
                         + " | ".join(f"{1e3 * phases[p]:.0f}" for p in PHASES)
                         + f" | {1e3 * sum(phases.values()):.0f} | {op['kv_bytes_moved'] / MIB:.2f} "
                         f"| {', '.join(op['lost_workers']) or '-'} |")
    checks = ", ".join(f"{r.scenario} {'✓' if r.tokens_match else '✗'}" for r in recoveries)
    skipped = "" if num_kv_heads < 4 else f" Scenario 2 skipped: {num_kv_heads} KV heads, tp4 replicates none."
    lines += ["", f"Outputs: each request's {config.max_tokens} greedy tokens equal the run without the kill: {checks}"
              f"; cold restart's next tokens {'✓' if rs.tokens_match else '✗'}.",
              f"Notes: {config.model} ({num_kv_heads} KV heads), 4 CPU workers on {len(os.sched_getaffinity(0))} CPUs "
              f"(a 2-core machine: oversubscribed, noisy), {config.num_requests} requests x {config.prompt_len} "
              f"prompt tokens, killed at {config.kill_after}/{config.max_tokens} tokens, {config.kv_cache_mb} MiB KV "
              f"per worker, refresh {config.refresh_interval_s:g}s.{skipped} Seconds from the SIGKILL (replacement: "
              f"from starting the joiner, up in {recoveries[-1].joiner_start_s:.2f}s). Cold restart into {r0.target}: "
              f"stop {rs.stop_seconds:.2f} + workers {rs.workers_seconds:.2f} + router {rs.router_seconds:.2f} + "
              f"re-prefill {rs.reprefill_seconds:.2f} s; it leaves out noticing the failure (ratio: a lower bound)."]
    return "\n".join(lines)


def plot(recoveries: list[Recovery], restart: switch.Restart, path: Path, title: str) -> None:
    """Timeline from the kill per scenario; the cold restart by part."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(10.0, 3.6))
    kills = [r for r in recoveries if r.next_token_s is not None]
    labels = ("to stall", "to detection", "recovery", "to next token")
    for y, r in enumerate(kills):
        marks = [0.0, r.stalled_s, r.detected_s, r.resumed_s, r.next_token_s]
        for i, (a, b) in enumerate(zip(marks, marks[1:])):
            axes.barh(y, b - a, left=a, color=f"C{i}", label=labels[i] if y == 0 else None)
    parts = [restart.stop_seconds, restart.workers_seconds, restart.router_seconds, restart.reprefill_seconds]
    for i, (part, label) in enumerate(zip(parts, ("stop", "workers ready", "router ready", "re-prefill"))):
        axes.barh(len(kills), part, left=sum(parts[:i]), color=f"C{i + 4}", label=f"restart: {label}")
    axes.set_yticks(range(len(kills) + 1), [r.scenario for r in kills] + ["3. cold restart"])
    axes.set_xlabel("seconds from the kill")
    axes.legend(fontsize=7)
    axes.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help=f"preset or checkpoint dir (default {DEFAULTS['model']})")
    parser.add_argument("--num-requests", type=int, help=f"live requests (default {DEFAULTS['num_requests']})")
    parser.add_argument("--prompt-len", type=int, help=f"prompt tokens (default {DEFAULTS['prompt_len']})")
    parser.add_argument("--max-tokens", type=int, help=f"tokens per request (default {DEFAULTS['max_tokens']})")
    parser.add_argument("--kill-after", type=int, help="tokens each request has at the kill (default max/4)")
    parser.add_argument("--kv-cache-mb", type=int, help=f"KV budget per worker (default {DEFAULTS['kv_cache_mb']})")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--refresh-interval-s", type=float, default=0.2, help="controller refresh (heartbeats)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/recovery.json"))
    parser.add_argument("--quick", action="store_true", help=f"smoke-run sizes: {QUICK}")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    pick = {key: getattr(args, key) if getattr(args, key) is not None else default for key, default in base.items()}
    return BenchConfig(pick["model"], pick["num_requests"], pick["prompt_len"], pick["max_tokens"],
                       args.kill_after or pick["max_tokens"] // 4, pick["kv_cache_mb"], args.block_size,
                       args.refresh_interval_s, args.seed, args.out)


def main(argv: list[str] | None = None) -> None:
    from services.logs import configure_logging
    from services.model.presets import resolve_model
    from services.model.spec import ModelSpec

    configure_logging("bench", "WARNING")
    config = parse_args(argv)
    num_kv_heads = ModelSpec.from_dir(resolve_model(config.model)).num_kv_heads
    started = time.perf_counter()
    print(f"recovery bench: {config.model}, 4 workers, {config.num_requests} requests x {config.prompt_len} tokens",
          file=sys.stderr)
    recoveries, restart = asyncio.run(run(config, num_kv_heads))
    table = format_table(config, recoveries, restart, num_kv_heads)
    print(table)
    elapsed = time.perf_counter() - started
    records = [{k: v for k, v in asdict(r).items() if k != "snapshot"} | {"frozen_s": r.frozen_s} for r in recoveries]
    payload = {"bench": "recovery", "config": {**asdict(config), "out": str(config.out)},
               "machine": switch.machine_info(), "wall_seconds": elapsed,
               "result": {"recoveries": records, "restart": {**asdict(restart), "seconds": restart.seconds}},
               "table": table}
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(payload, indent=1) + "\n")
    plot_path = config.out.with_suffix(".png")
    plot(recoveries, restart, plot_path, f"{config.model}: recovery from a lost worker vs cold restart "
         f"({len(os.sched_getaffinity(0))} CPUs)")
    print(f"\nwrote {config.out} and {plot_path} in {elapsed:.0f}s", file=sys.stderr)
    if not restart.tokens_match or not all(r.tokens_match for r in recoveries):
        raise SystemExit("tokens differ from the run without the kill (see the table)")


if __name__ == "__main__":
    main()
