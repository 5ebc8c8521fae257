"""MELL vs Best-Fit and Llumnix-style balancing, live: a compressed slice of the Azure conversation trace replayed
through the front router over 4 real instances, each policy next to what `reconfig simulate` predicts (issue 16).

    .venv/bin/python bench/mell_live.py                 # mell, bf, lb over 45 s of live replay each (~3 min)
    .venv/bin/python bench/mell_live.py --quick         # 20 s of trace, 10 s live per policy (~1 min)

The slice: `--trace-seconds` of arrivals from `--trace-start-s`, gaps multiplied by `--time-scale`, prompt and output
lengths divided (rounded up) by `--prompt-divisor` / `--output-divisor` and clamped to the instances' context
(random prompt ids, seeded). 4 instances (a LocalCluster of one tp1pp1 worker, 1 torch thread, plus a router engine
and its gRPC each) stay up for all policies; a fresh FrontEngine per policy replays the slice as concurrent greedy
requests that each generate exactly their output length. The simulator gets the same slice, the instances'
capacity and block size, and decode / prefill rates measured on that policy's own live run; the table's simulation
sees the requests' growth and makes its moves once per the front's policy period, as the front does (the notes give
the others: every event at once, exact tokens, no instance cap, everything batched); its moves take the live run's
median move time, at most as many under way as the front allows (one whose request ends sooner is not made, none
starts while one of its request is under way). Prints a table, writes
bench/results/mell_live.json and .png. A bench: it never asserts; it exits non-zero if a request was lost.
Heavy imports stay inside functions: worker processes re-import this module as `__mp_main__`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_TRACE = REPO / ".." / "shared" / "traces" / "azure_llm_2023_conv.csv"
DEFAULT_OUT = REPO / "bench" / "results" / "mell_live.json"
TOKEN = "mell-live-bench-token"
MIN_PROMPT_ID, MAX_PROMPT_ID = 3, 250  # inside the byte tokenizer's vocabulary, clear of BOS / EOS / PAD


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """The slice, the instances and the runs."""

    trace: Path
    trace_start_s: float             # where the slice starts in the trace
    trace_seconds: float             # how much of the trace's arrivals it takes
    time_scale: float                # live gap = trace gap x time_scale
    prompt_divisor: int              # live prompt = ceil(trace prompt / divisor), clamped
    output_divisor: int
    model: str
    num_instances: int
    capacity_tokens: int             # KV tokens per instance (its worker's kv_cache_bytes follows)
    block_size: int
    interval_s: float                # the front's policy period
    policies: tuple[str, ...]
    seed: int
    out: Path
    log_level: str = "CRITICAL"

    def __post_init__(self) -> None:
        if min(self.trace_seconds, self.time_scale) <= 0 or min(self.prompt_divisor, self.output_divisor) < 1:
            raise ValueError("need trace_seconds > 0, time_scale > 0 and divisors >= 1")
        if self.capacity_tokens % self.block_size:
            raise ValueError("capacity_tokens must be a multiple of block_size")


@dataclass(slots=True)
class RequestRecord:
    """One live request, times in seconds since the replay began."""

    num_prompt_tokens: int
    max_tokens: int
    arrival_s: float
    submit_s: float = 0.0
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_tokens: int = 0
    finish_reason: str | None = None
    error: str = ""

    @property
    def is_lost(self) -> bool:
        return self.finish_reason != "length" or self.num_tokens != self.max_tokens

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.submit_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_s is None or self.num_tokens < 2:
            return None
        return (self.last_token_s - self.first_token_s) / (self.num_tokens - 1)


@dataclass(slots=True)
class LiveRun:
    """One policy through the front router."""

    policy: str
    records: list[RequestRecord]
    seconds: float                   # the front's integration window (start to the last request's end)
    time_average_instances: float    # front.time_average_instances()
    moves: dict[str, int]            # front.totals.moves by outcome
    decided: dict[str, int]          # migrations the policy asked for, by reason (executed or not)
    move_failures: dict[str, int]    # failed moves by error
    full_targets: dict[str, int]     # reservations a target refused for want of blocks, by what held them
    waited_for_room: int             # moves that waited for the moves out of their target first
    step_errors: dict[str, int]      # policy steps that raised, by error
    kv_bytes_moved: int
    move_downtime_s: float
    preemptions: int                 # the instance routers' preemptions by recompute during the run
    leaked_blocks: int               # KV blocks still used on the instances after the run
    capacity_tokens: int             # what the front's policy got from the instances' Stats
    loadavg: tuple[float, float]     # the machine's 1-minute load average before and after the run
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (s, instances in use, policy's)
    drops: dict[str, int] = field(default_factory=dict)  # front.totals.drops: the policy's moves not started, by why
    move_seconds: list[float] = field(default_factory=list)  # each move made: its decision (start) to its commit

    @property
    def median_move_s(self) -> float:
        """How long a move took live (the simulator's move_s): its median, 0 without any."""
        return statistics.median(self.move_seconds) if self.move_seconds else 0.0


# ---- the slice ------------------------------------------------------------------------------------------------------
def make_slice(config: BenchConfig, max_model_len: int):
    """The compressed, scaled trace window as a Workload, and the number of requests the clamp shortened."""
    import numpy as np

    from services.simulator.trace import Workload, load_trace

    trace = load_trace(config.trace)
    window = (trace.arrival_s >= config.trace_start_s) & (trace.arrival_s < config.trace_start_s + config.trace_seconds)
    arrival = (trace.arrival_s[window] - trace.arrival_s[window][0]) * config.time_scale
    prompt = -(-trace.prompt_tokens[window] // config.prompt_divisor)
    output = -(-trace.output_tokens[window] // config.output_divisor)
    clamped_output = np.minimum(output, max_model_len // 2)
    clamped_prompt = np.minimum(prompt, max_model_len - clamped_output)
    num_clamped = int(np.sum((clamped_output != output) | (clamped_prompt != prompt)))
    return Workload(arrival, clamped_prompt, clamped_output, f"{config.trace.name} slice"), num_clamped


def describe_slice(config: BenchConfig, workload, num_clamped: int, kv_bytes_per_token: int) -> dict:
    import numpy as np

    prompt, output = workload.prompt_tokens, workload.output_tokens
    return {
        "trace_window_s": [config.trace_start_s, config.trace_start_s + config.trace_seconds],
        "num_requests": len(workload), "live_arrival_s": float(workload.arrival_s[-1]),
        "arrivals_per_s": len(workload) / float(workload.arrival_s[-1]), "time_scale": config.time_scale,
        "prompt_divisor": config.prompt_divisor, "output_divisor": config.output_divisor,
        "num_clamped": num_clamped,
        "prompt_tokens_mean_p50_p99_max": [float(prompt.mean()), *map(float, np.percentile(prompt, [50, 99])),
                                           int(prompt.max())],
        "output_tokens_mean_p50_p99_max": [float(output.mean()), *map(float, np.percentile(output, [50, 99])),
                                           int(output.max())],
        "output_tokens_per_s": float(output.sum() / workload.arrival_s[-1]),
        "capacity_tokens": config.capacity_tokens, "block_size": config.block_size,
        "kv_bytes_per_token": kv_bytes_per_token,
        "final_kv_over_capacity_mean": float(((prompt + output) / config.capacity_tokens).mean()),
    }


def make_prompts(workload, seed: int) -> list[tuple[int, ...]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [tuple(int(t) for t in rng.integers(MIN_PROMPT_ID, MAX_PROMPT_ID, n)) for n in workload.prompt_tokens]


# ---- the instances --------------------------------------------------------------------------------------------------
def kv_bytes_per_token(spec) -> int:
    import torch

    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * getattr(torch, spec.torch_dtype).itemsize


@contextlib.asynccontextmanager
async def open_instances(config: BenchConfig, kv_cache_bytes: int):
    """LocalCluster + router engine + router gRPC per instance (tests/front/conftest.py's pattern); yields the
    engines and the instances' gRPC addresses."""
    from services.launch.cluster import ClusterConfig, LocalCluster
    from services.router.grpc_server import start_router_grpc
    from services.router.main import RouterConfig, build_engine

    with contextlib.ExitStack() as processes:
        clusters = [processes.enter_context(LocalCluster(ClusterConfig(
            model=config.model, num_workers=1, topology="tp1pp1", kv_cache_bytes=kv_cache_bytes,
            block_size=config.block_size, candidate_topologies=("tp1pp1",), num_threads=1,
            env={"RECONFIG_LOG_LEVEL": "WARNING"}))) for _ in range(config.num_instances)]
        engines, servers, addresses = [], [], []
        try:
            for cluster in clusters:
                engine = await build_engine(RouterConfig(worker_addresses=tuple(cluster.worker_addresses),
                                                         model_dir=str(cluster.model_dir), model_name=config.model))
                engines.append(engine)
                server, port = await start_router_grpc(engine, "127.0.0.1", 0, TOKEN)
                servers.append(server)
                addresses.append(f"127.0.0.1:{port}")
            yield engines, addresses, clusters[0].model_dir
        finally:
            for server in servers:
                await server.stop(0)
            for engine in engines:
                await engine.stop()


async def warm_up(engines, max_tokens: int = 24) -> None:
    """Batches of 1 to 8 requests of varied prompt lengths on each instance first, so the first policy does not
    pay for cold workers."""
    from services.router.contracts import GenerationRequest

    async def one(engine, tag: str, num_prompt_tokens: int) -> None:
        prompt = tuple(MIN_PROMPT_ID + t % (MAX_PROMPT_ID - MIN_PROMPT_ID) for t in range(num_prompt_tokens))
        async for _ in engine.generate(GenerationRequest(tag, prompt, max_tokens)):
            pass

    await asyncio.gather(*(one(e, f"warm-{i}-{j}", 8 + 24 * j) for i, e in enumerate(engines) for j in range(8)))


# ---- one live run ---------------------------------------------------------------------------------------------------
async def _send(front, request, record: RequestRecord, t0: float) -> None:
    await asyncio.sleep(max(0.0, t0 + record.arrival_s - time.perf_counter()))
    record.submit_s = time.perf_counter() - t0
    try:
        async for delta in front.generate(request):
            now = time.perf_counter() - t0
            if delta.token_ids:
                record.first_token_s = now if record.first_token_s is None else record.first_token_s
                record.last_token_s = now
                record.num_tokens += len(delta.token_ids)
            if delta.finish_reason is not None:
                record.finish_reason, record.error = delta.finish_reason, delta.error or ""
    except Exception as exc:  # noqa: BLE001 (a lost request is a result of the bench, not its end)
        record.error = f"{type(exc).__name__}: {exc}"


async def _sample(front, t0: float, samples: list, interval_s: float) -> None:
    while True:
        samples.append((time.perf_counter() - t0, len(front.in_use()), front.policy.num_instances))
        await asyncio.sleep(interval_s)


def _count_decisions(front, decided: Counter, step_errors: Counter) -> None:
    """Count every move the policy asks for (the front drops some without counting them: a request already moving,
    max_concurrent_moves reached) and every step that raised. Migrations leave the policy only through
    drain_migrations (its step calls it too), so wrapping that and step sees them all."""
    policy = front.policy
    step, drain = policy.step, policy.drain_migrations

    def counting_step(*args):
        try:
            return step(*args)
        except Exception as exc:
            step_errors[type(exc).__name__ + ": " + re.sub(r"\d+", "N", str(exc))] += 1
            raise

    def counting_drain():
        migrations = drain()
        decided.update(m.reason for m in migrations)
        return migrations

    policy.step, policy.drain_migrations = counting_step, counting_drain


@contextlib.contextmanager
def _count_move_failures(failures: Counter, seconds: list[float]):
    """The front counts failed moves but keeps no cause: wrap the mover it calls to count them by error (numbers
    and the request id blanked, so that errors of one kind add up), and to keep how long each move made took."""
    import services.front.engine as front_engine

    move = front_engine.move_request

    async def recording_move(request, *args, **kwargs):
        result = await move(request, *args, **kwargs)
        if result.moved:
            seconds.append(result.seconds)
        else:
            failures[re.sub(r"\d+", "N", result.error.replace(request.request_id, "<id>"))] += 1
        return result

    front_engine.move_request = recording_move
    try:
        yield
    finally:
        front_engine.move_request = move


@contextlib.contextmanager
def _count_full_targets(front, full: Counter):
    """Why a target had no room for a move's reservation: the blocks of requests moving out of it (the policy has
    them on their targets already; they leave at their commit) covered the shortfall, or not (the target is full
    without them: the policy filled it, the requests grew since its tick)."""
    import grpc

    from services.front.instances import Instance
    from services.router.block_manager import num_blocks_for

    migrate_in = Instance.migrate_in

    async def recording_migrate_in(self, request, *args, **kwargs):
        try:
            return await migrate_in(self, request, *args, **kwargs)
        except grpc.aio.AioRpcError as exc:
            needed = re.match(r"(\d+) more KV blocks are needed, (\d+) are free", exc.details() or "")
            if needed:
                leaving = sum(num_blocks_for(r.kv_tokens, self.block_size) for r in front._routes.values()
                              if r.moving and r.instance is self)
                short = int(needed[1]) - int(needed[2])
                full[("held by moves out of it" if leaving >= short else "full without them")] += 1
            raise

    Instance.migrate_in = recording_migrate_in
    try:
        yield
    finally:
        Instance.migrate_in = migrate_in


async def run_policy(config: BenchConfig, policy: str, engines, addresses, model_dir, workload, prompts) -> LiveRun:
    from services.front.engine import FrontEngine, FrontSettings
    from services.front.instances import Instance
    from services.model.tokenizer import Tokenizer
    from services.router.contracts import GenerationRequest

    instances = [Instance(f"i{k}", address, TOKEN) for k, address in enumerate(addresses)]
    preempted, loadavg = sum(e.scheduler.num_preemptions for e in engines), os.getloadavg()[0]
    front = FrontEngine(instances, Tokenizer.from_dir(model_dir), config.model,
                        FrontSettings(policy=policy, interval_s=config.interval_s))
    await front.start()
    decided, step_errors, move_failures, full_targets = Counter(), Counter(), Counter(), Counter()
    move_seconds: list[float] = []
    _count_decisions(front, decided, step_errors)
    records = [RequestRecord(len(p), int(o), float(a))
               for p, o, a in zip(prompts, workload.output_tokens, workload.arrival_s)]
    samples: list[tuple[float, int, int]] = []
    t0 = time.perf_counter()
    sampler = asyncio.create_task(_sample(front, t0, samples, config.interval_s))
    try:
        with _count_move_failures(move_failures, move_seconds), _count_full_targets(front, full_targets):
            await asyncio.gather(*(_send(front, GenerationRequest(f"{policy}-{i}", prompt, record.max_tokens),
                                         record, t0) for i, (prompt, record) in enumerate(zip(prompts, records))))
        average = front.time_average_instances()  # read at once: the window ends with the last request
        seconds, totals = front.totals.seconds, front.totals
    finally:
        sampler.cancel()
        await front.stop()
    await asyncio.sleep(0.2)  # the routers free the last requests' blocks after their streams end
    return LiveRun(policy, records, seconds, average, dict(totals.moves), dict(decided), dict(move_failures),
                   dict(full_targets), totals.waited_for_room,
                   dict(step_errors), totals.kv_bytes_moved, totals.move_downtime_s,
                   sum(e.scheduler.num_preemptions for e in engines) - preempted,
                   sum(e.scheduler.block_manager.num_used for e in engines), front.policy.config.capacity,
                   (loadavg, os.getloadavg()[0]), samples, dict(totals.drops), move_seconds)


# ---- the simulator's prediction -------------------------------------------------------------------------------------
def measured_rates(runs: list[LiveRun]) -> tuple[float, float]:
    """(decode, prefill) tokens/s per request the simulator should assume so its requests live as long as the live
    ones: decode = generated tokens after the first / their decode seconds; prefill = prompt tokens / TTFT."""
    records = [r for run in runs for r in run.records if r.first_token_s is not None]
    decode_tokens = sum(r.num_tokens - 1 for r in records)
    decode_s = sum(r.last_token_s - r.first_token_s for r in records)
    prefill_s = sum(r.ttft_s for r in records)
    return decode_tokens / decode_s, sum(r.num_prompt_tokens for r in records) / prefill_s


def simulate_policy(run: LiveRun, workload, block_size: int, bytes_per_token: int, rates: tuple[float, float],
                    max_instances: int | None, batch_interval_s: float = 0.0, update_interval_s: float = 0.0,
                    move_s: float = 0.0, max_concurrent_moves: int = 0, timing=None):
    """`reconfig simulate` of the slice with the run's policy and capacity, the given block size (1: KV sizes in
    exact tokens, as the front feeds its policy), (decode, prefill) rates, instance cap (None: none), batching
    window (0: every event its own operation), the front's policy period, move time and move limit (0: none), and
    each request's own pace (`timing`; None: the rates)."""
    from services.placement.types import KVSchedulerConfig
    from services.simulator.engine import InstanceProfile, SimulationConfig, build_events, simulate

    profile = InstanceProfile(kv_capacity_tokens=run.capacity_tokens, kv_bytes_per_token=bytes_per_token,
                              decode_tokens_per_s=rates[0], prefill_tokens_per_s=rates[1], block_size=block_size)
    scheduler = KVSchedulerConfig(capacity=run.capacity_tokens, max_instances=max_instances)
    return simulate(run.policy, build_events(workload, profile, timing), SimulationConfig(
        profile=profile, scheduler=scheduler, batch_interval_s=batch_interval_s, update_interval_s=update_interval_s,
        move_s=move_s, max_concurrent_moves=max_concurrent_moves))


def live_timing(run: LiveRun, rates: tuple[float, float]):
    """Each request's decode start and rate as measured live (RequestTiming; the run's rates for a request with
    fewer than two tokens): the simulation replays the live requests' pace, instance by instance as it was."""
    import numpy as np

    from services.simulator.events import RequestTiming

    starts, paces = [], []
    for record in run.records:
        rate = 1 / record.tpot_s if record.tpot_s else rates[0]
        first = record.first_token_s if record.first_token_s is not None else \
            record.arrival_s + record.num_prompt_tokens / rates[1]
        starts.append(first - 1 / rate)
        paces.append(rate)
    return RequestTiming(np.array(starts), np.array(paces))


def simulate_runs(runs: list[LiveRun], workload, block_size: int, bytes_per_token: int, num_instances: int,
                  interval_s: float) -> dict:
    """Per policy, capped at the live cluster's instances as its front router is (requests wait for room): at its
    own run's rates in the instances' blocks, growth and moves once per the front's policy period and each move
    taking the run's median move time ("periodic": the front's model, the table's), every event at once and moves
    instant ("sim") and in exact tokens ("exact"); the same without the cap
    ("free", what `reconfig simulate` predicts with instances on demand), and also batched in windows of the front's
    policy period ("batched": the front hands its policy each period's changes as one step); and the time-average
    instances of every policy at one profile pooled over all runs ("pooled")."""
    from services.front.engine import FrontSettings

    limit = FrontSettings().max_concurrent_moves  # the front's, which the bench runs with
    pooled_rates = measured_rates(runs)
    result = {"rates": {}, "sim": {}, "periodic": {}, "replayed": {}, "exact": {}, "free": {}, "batched": {},
              "pooled": {}, "pooled_rates": pooled_rates}
    for run in runs:
        rates = result["rates"][run.policy] = measured_rates([run])
        # the front's model: its policy period, this run's median move time, its limit of moves under way
        front = dict(update_interval_s=interval_s, move_s=run.median_move_s, max_concurrent_moves=limit)
        result["sim"][run.policy] = simulate_policy(run, workload, block_size, bytes_per_token, rates, num_instances)
        result["periodic"][run.policy] = simulate_policy(run, workload, block_size, bytes_per_token, rates,
                                                         num_instances, **front)
        result["replayed"][run.policy] = simulate_policy(run, workload, block_size, bytes_per_token, rates,
                                                         num_instances, timing=live_timing(run, rates), **front)
        result["exact"][run.policy] = simulate_policy(run, workload, 1, bytes_per_token, rates, num_instances)
        result["free"][run.policy] = simulate_policy(run, workload, block_size, bytes_per_token, rates, None)
        result["batched"][run.policy] = simulate_policy(run, workload, block_size, bytes_per_token, rates, None,
                                                        interval_s)
        result["pooled"][run.policy] = simulate_policy(run, workload, block_size, bytes_per_token,
                                                       pooled_rates, num_instances, **front).mean_instances
    return result


# ---- report ---------------------------------------------------------------------------------------------------------
def _p99(values: list[float]) -> float:
    import numpy as np

    return float(np.percentile(values, 99)) if values else math.nan


def summarize(run: LiveRun, sim, exact, free, batched, periodic, replayed, rates: tuple[float, float]) -> dict:
    """The table compares the live run with `periodic` (the front's model: growth and moves once per its policy
    period); `sim` (every event at once), `replayed` (the front's model at each request's live pace: what is left of
    the difference there is not the pace model's) and the others go to the notes."""
    ttft = [r.ttft_s for r in run.records if r.ttft_s is not None]
    tpot = [r.tpot_s for r in run.records if r.tpot_s is not None]
    moved, decided_per_s = run.moves["moved"], sum(run.decided.values()) / run.seconds
    moved_per_s = moved / run.seconds

    def ratio(value: float, result) -> float:
        return value / result.migrations_per_s if result.migrations_per_s else math.nan

    # The policy's decisions on both sides: live, every move it asked for; simulated, the moves made, those not made
    # because their request ended first and those not started (its request or max_concurrent_moves busy moving).
    sim_decided = periodic.migrations + periodic.finished_first + sum(periodic.not_started.values())
    sim_decided_per_s = sim_decided / periodic.duration_s if periodic.duration_s else math.nan
    return {
        "policy": run.policy, "live_instances": run.time_average_instances, "sim_instances": periodic.mean_instances,
        "instances_ratio": run.time_average_instances / periodic.mean_instances,
        "live_peak": max((s[1] for s in run.samples), default=0), "sim_peak": periodic.peak_instances,
        "live_migrations_per_s": moved_per_s, "sim_migrations_per_s": periodic.migrations_per_s,
        "migrations_ratio": ratio(moved_per_s, periodic),
        "asked_ratio": decided_per_s / sim_decided_per_s if sim_decided_per_s else math.nan,
        "decided_per_s": decided_per_s, "moved": moved, "failed": run.moves["failed"],
        "finished_before_move": run.moves["finished"], "decided": run.decided, "move_outcomes": run.moves,
        "move_drops": run.drops, "sim_migrations_by_reason": periodic.migrations_by_reason,
        "sim_move_s": run.median_move_s, "sim_finished_first": periodic.finished_first,
        "sim_not_started": periodic.not_started,
        "event_sim_instances": sim.mean_instances, "event_sim_migrations_per_s": sim.migrations_per_s,
        "event_sim_migrations_by_reason": sim.migrations_by_reason, "move_failures": run.move_failures,
        "full_targets": run.full_targets, "waited_for_room": run.waited_for_room,
        "policy_step_errors": run.step_errors,
        "sim_exact_instances": exact.mean_instances, "sim_exact_migrations_per_s": exact.migrations_per_s,
        "sim_exact_migrations_by_reason": exact.migrations_by_reason,
        "sim_waited": periodic.num_waited, "sim_mean_wait_s": periodic.mean_wait_s,
        "free_sim_instances": free.mean_instances, "free_sim_peak": free.peak_instances,
        "free_sim_migrations_per_s": free.migrations_per_s,
        "batched_sim_instances": batched.mean_instances, "batched_sim_migrations_per_s": batched.migrations_per_s,
        "kv_mb_moved": run.kv_bytes_moved / 1e6,
        "mean_downtime_ms": 1e3 * run.move_downtime_s / moved if moved else 0.0,
        "p99_ttft_ms": 1e3 * _p99(ttft), "p99_tpot_ms": 1e3 * _p99(tpot),
        "mean_ttft_ms": 1e3 * sum(ttft) / len(ttft), "mean_tpot_ms": 1e3 * sum(tpot) / len(tpot),
        "preemptions": run.preemptions, "leaked_blocks": run.leaked_blocks,
        "lost": sum(r.is_lost for r in run.records), "live_seconds": run.seconds,
        "sim_seconds": periodic.duration_s,
        "sim_decode_tokens_per_s": rates[0], "sim_prefill_tokens_per_s": rates[1],
        "capacity_tokens": run.capacity_tokens, "loadavg_before_after": run.loadavg,
        "replay_instances": replayed.mean_instances, "replay_migrations_per_s": replayed.migrations_per_s,
        "replay_instances_ratio": run.time_average_instances / replayed.mean_instances,
        "replay_migrations_ratio": ratio(moved_per_s, replayed),
    }


_COLUMNS = (  # (header, key, format)
    ("policy", "policy", "<6"), ("live inst", "live_instances", ">9.2f"), ("sim inst", "sim_instances", ">8.2f"),
    ("live/sim", "instances_ratio", ">8.2f"), ("peak l/s", None, ">8"),
    ("live mig/s", "live_migrations_per_s", ">10.2f"), ("sim mig/s", "sim_migrations_per_s", ">9.2f"),
    ("live/sim", "migrations_ratio", ">8.2f"), ("asked/s", "decided_per_s", ">7.2f"),
    ("asked/sim", "asked_ratio", ">9.2f"), ("failed", "failed", ">6"),
    ("KV MB", "kv_mb_moved", ">6.2f"), ("down ms", "mean_downtime_ms", ">7.1f"),
    ("p99 TTFT ms", "p99_ttft_ms", ">11.0f"), ("p99 TPOT ms", "p99_tpot_ms", ">11.1f"),
    ("preempt", "preemptions", ">7"), ("lost", "lost", ">4"),
)


def format_table(rows: list[dict]) -> str:
    lines = ["  ".join(f"{header:{spec[0]}{spec[1:].split('.')[0]}}" for header, _, spec in _COLUMNS)]
    for row in rows:
        cells = []
        for header, key, spec in _COLUMNS:
            value = f"{row['live_peak']}/{row['sim_peak']}" if key is None else row[key]
            cells.append(format(value, spec if key is not None else spec.split(".")[0]))
        lines.append("  ".join(cells))
    return "\n".join(lines)


def policy_notes(row: dict) -> list[str]:
    """What the table leaves out: the simulator's rates, moves by reason, why moves failed, failed policy steps."""
    lines = [f"{row['policy']}: simulated at decode {row['sim_decode_tokens_per_s']:.0f} tok/s, prefill "
             f"{row['sim_prefill_tokens_per_s']:.0f} tok/s (its live run's); live {row['live_seconds']:.1f} s, "
             f"simulated {row['sim_seconds']:.1f} s; load average {row['loadavg_before_after'][0]:.1f} before, "
             f"{row['loadavg_before_after'][1]:.1f} after",
             f"  moves asked live {row['decided']}; simulated {row['sim_migrations_by_reason']}; every event at "
             f"once: {row['event_sim_instances']:.2f} instances, {row['event_sim_migrations_per_s']:.2f} mig/s "
             f"{row['event_sim_migrations_by_reason']}; in exact tokens (every event at once): "
             f"{row['sim_exact_instances']:.2f} instances, {row['sim_exact_migrations_per_s']:.2f} mig/s "
             f"{row['sim_exact_migrations_by_reason']}",
             f"  simulated at most {row['live_peak_cap']} instances: {row['sim_waited']} requests waited for room "
             f"(mean {row['sim_mean_wait_s']:.2f} s); without the cap: {row['free_sim_instances']:.2f} instances "
             f"(peak {row['free_sim_peak']}), {row['free_sim_migrations_per_s']:.2f} mig/s; in windows of the "
             f"front's policy period (arrivals and departures too): {row['batched_sim_instances']:.2f} instances, "
             f"{row['batched_sim_migrations_per_s']:.2f} mig/s"]
    lines.append(f"  at each request's live pace (a replay): {row['replay_instances']:.2f} instances, "
                 f"{row['replay_migrations_per_s']:.2f} mig/s; live / replay: instances "
                 f"{row['replay_instances_ratio']:.2f}, migrations {row['replay_migrations_ratio']:.2f}")
    lines.append(f"  asked moves by outcome: {row['move_outcomes']}; dropped because {row['move_drops'] or '-'}; "
                 f"simulated with moves of {1e3 * row['sim_move_s']:.0f} ms (the live median): "
                 f"{row['sim_finished_first']} not made, their request ended first; not started because "
                 f"{row['sim_not_started'] or '-'}")
    if row["move_failures"]:
        lines.append(f"  failed moves: {row['move_failures']}")
    lines.append(f"  targets without room for a reservation: {row['full_targets'] or 'none'}; moves that waited for "
                 f"the moves out of their target: {row['waited_for_room']}")
    if row["policy_step_errors"]:
        lines.append(f"  policy steps that raised (the front then applies that tick's updates one by one): "
                     f"{row['policy_step_errors']}")
    return lines


def policy_ratios(rows: dict[str, dict], pooled: dict[str, float]) -> list[str]:
    lines = []
    for other in [name for name in ("bf", "lb", "wf") if name in rows and "mell" in rows]:
        mell, base = rows["mell"], rows[other]
        lines.append(f"MELL / {other.upper()} time-average instances: "
                     f"live {mell['live_instances'] / base['live_instances']:.3f}, "
                     f"simulated {mell['sim_instances'] / base['sim_instances']:.3f} (each at its run's rates), "
                     f"{pooled['mell'] / pooled[other]:.3f} (one profile pooled over the runs)")
    return lines


def plot(runs: list[LiveRun], sims: dict, path: Path, title: str) -> None:
    """One panel per policy: instances in use over time, live (front), the live policy's own count, simulated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(runs), 1, figsize=(11, 2.8 * len(runs)), squeeze=False, sharex=True)
    for axis, run in zip(axes[:, 0], runs):
        sim = sims[run.policy]
        times = [s[0] for s in run.samples]
        axis.step(times, [s[1] for s in run.samples], where="post", lw=1.0,
                  label=f"live: instances holding requests (mean {run.time_average_instances:.2f})")
        axis.step(times, [s[2] for s in run.samples], where="post", lw=0.8, ls=":", label="live: the policy's count")
        axis.step([t for t, _ in sim.timeline], [c for _, c in sim.timeline], where="post", lw=1.0, alpha=0.8,
                  label=f"simulated, per policy period (mean {sim.mean_instances:.2f})")
        axis.set_title(run.policy)
        axis.set_ylabel("instances")
        axis.legend(loc="upper right", fontsize=7)
        axis.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the first arrival")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ---- main -----------------------------------------------------------------------------------------------------------
async def run_all(config: BenchConfig, kv_cache_bytes: int, workload, prompts) -> list[LiveRun]:
    runs = []
    async with open_instances(config, kv_cache_bytes) as (engines, addresses, model_dir):
        await warm_up(engines)
        for policy in config.policies:
            print(f"  {policy}: replaying {len(prompts)} requests ...", file=sys.stderr, flush=True)
            runs.append(await run_policy(config, policy, engines, addresses, model_dir, workload, prompts))
    return runs


def machine_info() -> dict:
    import torch

    return {"cpu_count": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "loadavg": os.getloadavg()}


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--trace-start-s", type=float, default=600.0)
    parser.add_argument("--trace-seconds", type=float, help="arrivals taken from the trace (default 90, --quick 20)")
    parser.add_argument("--time-scale", type=float, default=0.5, help="live gap = trace gap x this")
    parser.add_argument("--prompt-divisor", type=int, default=32)
    parser.add_argument("--output-divisor", type=int, default=6)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--num-instances", type=int, default=4)
    parser.add_argument("--capacity-tokens", type=int, default=384, help="KV tokens per instance")
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--interval-s", type=float, default=0.05, help="the front's policy period")
    parser.add_argument("--policies", default="mell,bf,lb")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--log-level", default="CRITICAL",
                        help="the bench process's log level (the front's failed ticks and moves are counted anyway)")
    parser.add_argument("--quick", action="store_true", help="20 s of trace, 10 s live per policy")
    args = parser.parse_args(argv)
    config = BenchConfig(
        trace=args.trace, trace_start_s=args.trace_start_s,
        trace_seconds=args.trace_seconds or (20.0 if args.quick else 90.0),
        time_scale=args.time_scale, prompt_divisor=args.prompt_divisor, output_divisor=args.output_divisor,
        model=args.model, num_instances=args.num_instances, capacity_tokens=args.capacity_tokens,
        block_size=args.block_size, interval_s=args.interval_s,
        policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()), seed=args.seed,
        out=args.out.with_name("mell_live-quick.json") if args.quick and args.out == DEFAULT_OUT else args.out,
        log_level=args.log_level)
    return config


def cores_phrase(num_instances: int) -> str:
    """The cores the instances run on, and whether they share them: where they do, a live request decodes slower
    the more instances are busy, which the simulator's one decode rate per run does not model (bench/README: within
    10% on 16 cores, not on 2)."""
    cores = len(os.sched_getaffinity(0))
    shared = "" if cores > num_instances else \
        " (shared: live decode slows as instances get busy, which the simulator's one rate does not model)"
    return f"on {cores} usable cores{shared}"


def slice_lines(config: BenchConfig, described: dict, max_model_len: int) -> str:
    prompt, output = described["prompt_tokens_mean_p50_p99_max"], described["output_tokens_mean_p50_p99_max"]
    return (f"slice: trace {config.trace_start_s:g}-{config.trace_start_s + config.trace_seconds:g} s, "
            f"{described['num_requests']} requests over {described['live_arrival_s']:.1f} s live (gaps "
            f"x{config.time_scale:g}, {described['arrivals_per_s']:.1f}/s); prompts /{config.prompt_divisor} (mean "
            f"{prompt[0]:.0f}, p99 {prompt[2]:.0f}, max {prompt[3]}), outputs /{config.output_divisor} (mean "
            f"{output[0]:.0f}, p99 {output[2]:.0f}, max {output[3]}), {described['num_clamped']} clamped to "
            f"{max_model_len} tokens; {described['output_tokens_per_s']:.0f} output tokens/s offered\n"
            f"instances: {config.num_instances} x {config.model} tp1pp1, 1 worker, 1 thread, "
            f"{cores_phrase(config.num_instances)}; KV "
            f"{config.capacity_tokens} tokens each (blocks of {config.block_size}, {described['kv_bytes_per_token']} "
            f"B/token); a request's final KV is {described['final_kv_over_capacity_mean']:.3f} C on average; "
            f"policy period {config.interval_s * 1e3:g} ms")


def write_results(config: BenchConfig, described: dict, runs: list[LiveRun], sims: dict, rows: dict,
                  report: str, elapsed: float) -> Path:
    from services.simulator.report import result_json

    payload = {
        "bench": "mell_live", "config": {**asdict(config), "trace": str(config.trace), "out": str(config.out)},
        "machine": machine_info(), "wall_seconds": elapsed, "slice": described,
        "pooled_rates": sims["pooled_rates"], "pooled_sim_instances": sims["pooled"], "rows": rows,
        "report": report,
        "runs": [{"policy": run.policy, "samples": run.samples,
                  "simulated": result_json(sims["periodic"][run.policy]),
                  "sim_timeline": sims["periodic"][run.policy].timeline,
                  "simulated_every_event": result_json(sims["sim"][run.policy]),
                  "simulated_exact_tokens": result_json(sims["exact"][run.policy]),
                  "simulated_without_cap": result_json(sims["free"][run.policy]),
                  "requests": [{**asdict(r), "ttft_s": r.ttft_s, "tpot_s": r.tpot_s} for r in run.records]}
                 for run in runs],
    }
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(payload, indent=1) + "\n")
    plot_path = config.out.with_suffix(".png")
    plot(runs, sims["periodic"], plot_path, f"{config.model} x{config.num_instances}, {described['num_requests']} "
         f"requests, C = {config.capacity_tokens} tokens: live front router vs simulator")
    return plot_path


def main(argv: list[str] | None = None) -> int:
    from services.logs import configure_logging
    from services.model.presets import resolve_model
    from services.model.spec import ModelSpec

    config = parse_args(argv)
    configure_logging("bench", config.log_level)
    started = time.perf_counter()
    spec = ModelSpec.from_dir(resolve_model(config.model))
    bytes_per_token = kv_bytes_per_token(spec)
    max_model_len = min(spec.max_position_embeddings, config.capacity_tokens)
    workload, num_clamped = make_slice(config, max_model_len)
    described = describe_slice(config, workload, num_clamped, bytes_per_token)
    print(slice_lines(config, described, max_model_len), flush=True)
    prompts = make_prompts(workload, config.seed)
    runs = asyncio.run(run_all(config, config.capacity_tokens * bytes_per_token, workload, prompts))
    sims = simulate_runs(runs, workload, config.block_size, bytes_per_token, config.num_instances, config.interval_s)
    rows = {run.policy: {**summarize(run, sims["sim"][run.policy], sims["exact"][run.policy],
                                     sims["free"][run.policy], sims["batched"][run.policy],
                                     sims["periodic"][run.policy], sims["replayed"][run.policy],
                                     sims["rates"][run.policy]),
                         "live_peak_cap": config.num_instances} for run in runs}
    report = "\n".join([format_table(list(rows.values())), "", *[line for row in rows.values()
                                                                  for line in policy_notes(row)],
                        "", *policy_ratios(rows, sims["pooled"])])
    print("\n" + report)
    elapsed = time.perf_counter() - started
    plot_path = write_results(config, described, runs, sims, rows, report, elapsed)
    print(f"\nwrote {config.out} and {plot_path} in {elapsed:.0f} s", file=sys.stderr)
    lost = {run.policy: sum(r.is_lost for r in run.records) for run in runs}
    if any(lost.values()):
        first = next(r for run in runs for r in run.records if r.is_lost)
        print(f"requests lost: {lost}; first: {first}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
