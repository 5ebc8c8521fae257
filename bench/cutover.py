"""Cutover of staged switches with KV pre-copy, against in-place switches and a cold restart (issue 12).

    python bench/cutover.py [--model smollm2-135m] [--active 10,16,50,100,200] [--quick]

For each number of active requests N: one stack (weightstore, 4 workers, router engine + gRPC, controller
transaction, all in this process but the workers) in the chain's first topology; a reference stream of N greedy
requests without a switch; then a fresh stream of the same N requests through the chain with strategy "staged"
(STAGING + PRECOPY while serving, the freeze copies the KV delta), and another through the chain "in-place".
Every token's arrival is timestamped, so the client-side gaps during each switch are measured next to the
controller's cutover (the freeze). Prints tables and the targets' verdicts, writes JSON and a plot.
Heavy imports stay inside functions: worker processes re-import this module as `__mp_main__`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from switch import GB, MIB, BenchConfig, Requests, _Stack, machine_info, make_prompts, measure_copies, \
    start_stack, stop_stack  # noqa: E402

CHAIN = "tp1pp4,tp3pp1,tp1pp2,tp1pp4"  # SmolLM2: 9 heads / 3 KV heads, so TP is 1 or 3
DEFAULTS = dict(model="smollm2-135m", active="10,16,50,100,200", prompt_len=128, max_tokens=256, kv_tokens=96,
                chain=CHAIN)
QUICK = dict(model="tiny-llama", active="4,16", prompt_len=32, max_tokens=128, kv_tokens=64,
             chain="tp1pp4,tp2pp1,tp1pp2,tp1pp4")
FREEZE_PHASES = ("QUIESCING", "PREPARING_WORKERS", "APPLYING_TOPOLOGY", "MIGRATING", "REBINDING")
STRATEGIES = ("staged", "in-place")
RESTART_AT = 16  # the cold restart baseline: first transition at this N (or the nearest one run)
MIN_TOKENS = 4   # every request has this many tokens before the first switch


@dataclass(frozen=True, slots=True)
class CutoverConfig:
    """What to measure."""

    model: str
    chain: tuple[str, ...]
    active: tuple[int, ...]          # live requests per stack
    num_workers: int
    prompt_len: int
    max_tokens: int                  # a cap: the streams end tail_tokens after the chain
    tail_tokens: int                 # tokens every request takes after the last switch, then the client leaves
    steps_between: int               # decode steps every request takes between two switches
    kv_tokens: int                   # generated tokens per request the KV budget is sized for, at max(active)
    kv_cache_mb: int                 # KV budget per worker (0: max(active) x (prompt + kv_tokens) fit every layout)
    block_size: int
    memcpy_mb: int
    seed: int
    out: Path
    paced: float = 0.0               # > 0: a third stream per N, staged with this staging duty ("staged@D")

    def __post_init__(self) -> None:
        if len(self.chain) < 2 or not self.active or min(self.active) < 1 or self.max_tokens <= MIN_TOKENS \
                or self.tail_tokens < 1:
            raise ValueError(f"need a chain of >= 2 topologies, --active >= 1, --max-tokens > {MIN_TOKENS}, "
                             "--tail-tokens >= 1")

    @property
    def strategies(self) -> tuple[str, ...]:
        return STRATEGIES + ((f"staged@{self.paced:g}",) if self.paced else ())

    def stack_config(self, num_requests: int, kv_cache_mb: int) -> BenchConfig:
        """switch.py's config for one N (start_stack, make_prompts and the restart read it)."""
        return BenchConfig(model=self.model, chain=self.chain, num_workers=self.num_workers,
                           num_requests=num_requests, prompt_len=self.prompt_len, max_tokens=self.max_tokens,
                           steps_between=self.steps_between, kv_cache_mb=kv_cache_mb, block_size=self.block_size,
                           restart_all=False, memcpy_mb=self.memcpy_mb, seed=self.seed, out=self.out)


@dataclass(slots=True)
class SwitchRecord:
    """One transition under one strategy, with what the client saw during it."""

    num_active: int
    strategy: str
    source: str
    target: str
    num_live: int
    num_used_blocks: int
    phase_seconds: dict[str, float]
    downtime_seconds: float          # the freeze (cutover) as the controller reports it
    staging_seconds: float           # STAGING + PRECOPY, while serving
    staging: str                     # "staged" / "in-place" / "in-place: <why>"
    precopy: str                     # "N rounds" / "off: <why>" / ""
    precopy_rounds: int
    kv_bytes_precopied: int
    kv_bytes_received: int           # in the freeze (the delta when pre-copied), from peers
    kv_bytes_local: int              # in the freeze, inside a worker
    migrate_seconds: float           # slowest worker's copy in the freeze (delta + one agree when pre-copied)
    used_precopy: bool               # every active worker of the target: only the delta moved in the freeze
    used_staged: bool                # every active worker of the target took the shard it staged
    num_preempted: int
    max_used_block_id: int           # before the call (a shrink preempts the owners of ids past the new capacity)
    num_blocks_before: int           # the router's capacity before and after the switch
    num_blocks_after: int
    call_start: float                # perf_counter around reconfigure()
    freeze_start: float              # call_start + staging_seconds
    call_end: float
    worst_freeze_gap: float = 0.0    # largest inter-token gap overlapping [freeze_start, call_end]
    worst_window_gap: float = 0.0    # largest gap overlapping [call_start, call_end]
    staging_tpot: float = math.nan   # mean gap of tokens that arrived in [call_start, freeze_start]
    num_staging_gaps: int = 0
    source_tpot: float = math.nan    # mean gap outside every switch while the stack served in `source`
    num_source_gaps: int = 0
    # 2 x normal + 50 ms counts the straddling gap as two steps of the stream's layouts at large; with layouts of
    # different speeds it is one step of each: median gap in `source` + median gap in `target` + 50 ms.
    layout_gap_bound: float = math.nan
    snapshot: list[list[int]] = field(default_factory=list, repr=False)  # prompt + tokens at the call

    @property
    def label(self) -> str:
        return f"{self.source}→{self.target}"

    @property
    def delta_bytes(self) -> int:
        return self.kv_bytes_received + self.kv_bytes_local

    @property
    def delta_gbps(self) -> float:
        return self.delta_bytes / self.migrate_seconds / GB if self.migrate_seconds else 0.0


@dataclass(slots=True)
class Stream:
    """One stream of N requests through the chain under one strategy."""

    num_active: int
    strategy: str
    switches: list[SwitchRecord]
    normal_gap: float                # median gap fully outside every switch window
    outside_tpot: float              # mean of those gaps
    num_outside_gaps: int
    outside_tpot_by_layout: dict[str, float]
    outputs_match: bool
    num_mismatched: int
    num_preemptions: int
    num_full_prefills: int
    seconds: float


@dataclass(slots=True)
class Restart:
    """Stop + cold start in the target + re-prefill of the live requests until their next token."""

    num_active: int
    target: str
    stop_seconds: float
    workers_seconds: float
    router_seconds: float
    reprefill_seconds: float
    tokens_match: bool
    staged_cutover: float
    in_place_cutover: float

    @property
    def seconds(self) -> float:
        return self.stop_seconds + self.workers_seconds + self.router_seconds + self.reprefill_seconds


class TimedRequests(Requests):
    """Requests whose every delta's arrival (perf_counter) is kept per request."""

    def __init__(self, engine, prompts: list[list[int]], max_tokens: int, tag: str) -> None:
        self.arrivals: list[list[float]] = [[] for _ in prompts]
        self.limits: list[int | None] = [None] * len(prompts)  # the client leaves at this many tokens
        super().__init__(engine, prompts, max_tokens, tag)

    async def _consume(self, engine, i: int, request) -> None:
        stream = engine.generate(request)
        try:
            async for delta in stream:
                if delta.token_ids:
                    self.arrivals[i].append(time.perf_counter())
                self.tokens[i].extend(delta.token_ids)
                if delta.finish_reason in ("error", "abort"):
                    raise RuntimeError(f"{request.request_id} ended with {delta.finish_reason}: {delta.error}")
                if self.limits[i] is not None and len(self.tokens[i]) >= self.limits[i]:
                    break  # the client goes away: the engine aborts the request and frees its blocks
        finally:
            await stream.aclose()

    def stop_after(self, num_tokens: int) -> None:
        """Every request ends (client side) once it has num_tokens more tokens than now."""
        self.limits = [len(tokens) + num_tokens for tokens in self.tokens]

    def gaps(self) -> list[tuple[float, float]]:
        """(start, end) of every gap between two deltas of one request, from the moment every request has its
        first token on (the prefills' steps, and the time to first token, left out)."""
        decoding = max((times[0] for times in self.arrivals if times), default=0.0)
        return [(a, b) for times in self.arrivals for a, b in zip(times, times[1:]) if a >= decoding]


async def drained(engine) -> None:
    """Until the engine holds no request and no block: a client that left mid-step (PP micro-batches in flight) is
    freed when that step returns, and the next stream must not start on top of its block ids."""
    while (stats := engine.stats()).num_running or stats.num_waiting or stats.num_kv_blocks_used:
        await asyncio.sleep(0.01)


def kv_budget_mb(config: CutoverConfig, spec) -> int:
    """The smallest per-worker KV budget (MiB) in which max(active) requests of prompt + kv_tokens fit in every
    layout of the chain (+10% and a block per request), so that no switch has to preempt. The streams end
    tail_tokens after the chain, long before max_tokens where N is large."""
    import torch

    from services.topology import Topology, place
    from services.worker.kv_cache import kv_bytes_per_block

    per_request = -(-(config.prompt_len + config.kv_tokens) // config.block_size) + 1
    num_blocks = math.ceil(1.1 * max(config.active) * per_request)
    worst = max(kv_bytes_per_block(len(wp.layers), len(wp.kv_heads), spec.head_dim, config.block_size, torch.float32)
                for topology in config.chain for wp in place(Topology.parse(topology), spec.shape).workers)
    return max(4, math.ceil(num_blocks * worst / MIB))


async def switch_once(stack: _Stack, num_active: int, strategy: str, target: str, prompts: list[list[int]],
                      live: TimedRequests) -> SwitchRecord:
    """One reconfigure() call with the stream decoding; its numbers and the workers' ApplySwitch replies."""
    from services.controller.status import OperationState
    from services.topology import Topology

    source = str(stack.state.topology)
    for worker in stack.workers:
        worker.applied = None
    before = stack.engine.stats()
    snapshot = [list(p) + list(t) for p, t in zip(prompts, live.tokens)]
    num_live = live.num_live
    max_used = max(stack.engine.used_block_ids(), default=-1)
    call_start = time.perf_counter()
    operation = await stack.reconfigurer.reconfigure(target, strategy=strategy.split("@")[0])
    call_end = time.perf_counter()
    if operation.state is not OperationState.SUCCEEDED:
        raise RuntimeError(f"N={num_active} {strategy} {source}→{target}: {operation.state.name}: {operation.error}")
    replies = [w.applied for w in stack.workers if w.applied is not None]
    active = replies[:Topology.parse(target).num_workers]  # the standbys of the target stage nothing
    rounds = int(operation.precopy.split()[0]) if operation.precopy.endswith("rounds") else 0
    return SwitchRecord(
        num_active=num_active, strategy=strategy, source=source, target=target, num_live=num_live,
        num_used_blocks=before.num_kv_blocks_used, phase_seconds=dict(operation.phase_seconds),
        downtime_seconds=operation.downtime_seconds, staging_seconds=operation.staging_seconds,
        staging=operation.staging, precopy=operation.precopy, precopy_rounds=rounds,
        kv_bytes_precopied=operation.kv_bytes_precopied,
        kv_bytes_received=sum(r.kv_bytes_received for r in replies),
        kv_bytes_local=sum(r.kv_bytes_local for r in replies),
        migrate_seconds=max((r.migrate_seconds for r in replies), default=0.0),
        used_precopy=bool(active) and all(r.used_precopy for r in active),
        used_staged=bool(active) and all(r.used_staged for r in active),
        num_preempted=operation.num_requests_preempted, max_used_block_id=max_used,
        num_blocks_before=before.num_kv_blocks_total, num_blocks_after=stack.engine.stats().num_kv_blocks_total,
        call_start=call_start,
        freeze_start=call_start + operation.staging_seconds, call_end=call_end, snapshot=snapshot)


def attach_gaps(stream: Stream, gaps: list[tuple[float, float]]) -> None:
    """Client-side gaps per switch (worst over the freeze, mean while staging) and outside every window.
    A gap counts for staging when its token arrived in [call start, freeze start]: a window shorter than a few
    gaps would otherwise only keep the short ones."""
    switches = stream.switches
    windows = [(s.call_start, s.call_end) for s in switches]
    outside = [(a, b) for a, b in gaps if all(b <= start or a >= end for start, end in windows)]
    seconds = [b - a for a, b in outside]
    stream.normal_gap = statistics.median(seconds) if seconds else math.nan
    stream.outside_tpot = statistics.fmean(seconds) if seconds else math.nan
    stream.num_outside_gaps = len(outside)
    # Between two switches the stack serves in one layout: the staging's baseline is its source layout's gaps.
    segments = list(zip([-math.inf] + [s.call_end for s in switches], [s.call_start for s in switches] + [math.inf],
                        [switches[0].source] + [s.target for s in switches]))
    by_layout: dict[str, list[float]] = {}
    for a, b in outside:
        layout = next((name for start, end, name in segments if start <= a and b <= end), None)
        if layout is not None:
            by_layout.setdefault(layout, []).append(b - a)
    stream.outside_tpot_by_layout = {name: statistics.fmean(values) for name, values in by_layout.items()}
    normal_by_layout = {name: statistics.median(values) for name, values in by_layout.items()}
    for s in switches:
        s.source_tpot = stream.outside_tpot_by_layout.get(s.source, math.nan)
        s.layout_gap_bound = (normal_by_layout.get(s.source, math.nan) + normal_by_layout.get(s.target, math.nan)
                              + 0.05)
        s.num_source_gaps = len(by_layout.get(s.source, ()))
        freeze = [b - a for a, b in gaps if a < s.call_end and b > s.freeze_start]
        window = [b - a for a, b in gaps if a < s.call_end and b > s.call_start]
        staging = [b - a for a, b in gaps if s.call_start <= b <= s.freeze_start]
        s.worst_freeze_gap = max(freeze, default=0.0)
        s.worst_window_gap = max(window, default=0.0)
        s.staging_tpot = statistics.fmean(staging) if staging else math.nan
        s.num_staging_gaps = len(staging)


async def run_stream(config: CutoverConfig, stack: _Stack, strategy: str, prompts: list[list[int]]
                     ) -> tuple[Stream, list[list[int]]]:
    """A fresh stream of len(prompts) requests through the chain; the switches start at MIN_TOKENS tokens, the
    clients leave tail_tokens after the last one. Returns the stream (outputs unchecked) and its tokens."""
    await drained(stack.engine)
    if str(stack.state.topology) != config.chain[0]:  # a chain that does not come back: start where it starts
        await stack.reconfigurer.reconfigure(config.chain[0], strategy="in-place")
    before = stack.engine.stats()
    started = time.perf_counter()
    live = TimedRequests(stack.engine, prompts, config.max_tokens, f"{strategy}-{len(prompts)}")
    await live.wait_for_tokens([MIN_TOKENS] * len(prompts))
    switches = []
    for target in config.chain[1:]:
        await live.wait_for_tokens([len(t) + config.steps_between for t in live.tokens])
        switches.append(await switch_once(stack, len(prompts), strategy, target, prompts, live))
        s = switches[-1]
        _log(f"N={len(prompts)} {strategy} {s.label}: cutover {1e3 * s.downtime_seconds:.0f} ms, staging "
             f"{1e3 * s.staging_seconds:.0f} ms, {s.precopy or '-'}, delta {s.delta_bytes / 1024:.0f} KiB, "
             f"{s.num_live} live")
    live.stop_after(config.tail_tokens)
    outputs = await live.finish()
    after = stack.engine.stats()
    stream = Stream(len(prompts), strategy, switches, math.nan, math.nan, 0, {}, False, len(prompts),
                    after.num_preemptions - before.num_preemptions,
                    int(after.extra["num_full_prefills"] - before.extra["num_full_prefills"]),
                    time.perf_counter() - started)
    attach_gaps(stream, live.gaps())
    return stream, outputs


def check(stream: Stream, outputs: list[list[int]], reference: list[list[int]]) -> None:
    """Every request's tokens must be the reference's first ones (the client left before max_tokens)."""
    stream.num_mismatched = sum(1 for o, r in zip(outputs, reference) if not o or o != r[:len(o)])
    stream.outputs_match = stream.num_mismatched == 0


async def cold_restart(config: BenchConfig, num_requests: int, staged: SwitchRecord, in_place: SwitchRecord,
                       stop_seconds: float, reference: list[list[int]]) -> Restart:
    """switch._restart's steps: the stack cold in the target, then the staged switch's snapshot re-prefilled until
    every request has its next token (which must equal the reference's)."""
    stack, workers_seconds, router_seconds = await start_stack(config, staged.target, max(128, num_requests))
    try:
        started = time.perf_counter()
        tokens = await Requests(stack.engine, staged.snapshot, 1, f"restart-{staged.target}").finish()
        reprefill_seconds = time.perf_counter() - started
    finally:
        await stop_stack(stack)
    generated = [len(s) - config.prompt_len for s in staged.snapshot]
    match = all(t == ref[n:n + 1] for t, ref, n in zip(tokens, reference, generated))
    return Restart(num_requests, staged.target, stop_seconds, workers_seconds, router_seconds, reprefill_seconds,
                   match, staged.downtime_seconds, in_place.downtime_seconds)


@dataclass(slots=True)
class Result:
    """Everything one run measured."""

    memcpy_gbps: float
    indexed_copy_gbps: float
    kv_cache_mb: int
    streams: list[Stream]
    restart: Restart | None
    reference_seconds: dict[int, float]


async def run(config: CutoverConfig, spec) -> Result:
    """Per N: a stack, the reference stream, one stream per strategy through the chain; one cold restart."""
    memcpy_gbps, indexed_gbps = measure_copies(config.memcpy_mb)
    _log(f"memcpy {memcpy_gbps:.2f} GB/s, indexed copy {indexed_gbps:.2f} GB/s (1 thread, {config.memcpy_mb} MiB)")
    kv_mb = config.kv_cache_mb or kv_budget_mb(config, spec)
    restart_at = min(config.active, key=lambda n: (abs(n - RESTART_AT), n))
    streams, restart, reference_seconds = [], None, {}
    for num_active in config.active:
        stack_config = config.stack_config(num_active, kv_mb)
        prompts = make_prompts(stack_config)
        stack, workers_seconds, router_seconds = await start_stack(stack_config, config.chain[0], max(128, num_active))
        _log(f"N={num_active}: stack {config.chain[0]} ready in {workers_seconds + router_seconds:.1f}s "
             f"({kv_mb} MiB KV per worker)")
        try:
            await Requests(stack.engine, prompts[:8], MIN_TOKENS, f"warmup-{num_active}").finish()
            mine, outputs = [], []
            default_duty = stack.reconfigurer.staging_duty
            for strategy in config.strategies:
                # "staged@D": staged, with the workers' staging (and pre-copy) paced to a duty of D (else the default)
                stack.reconfigurer.staging_duty = float(strategy.split("@")[1]) if "@" in strategy else default_duty
                stream, tokens = await run_stream(config, stack, strategy, prompts)
                mine.append(stream)
                outputs.append(tokens)
            num_tokens = max(len(t) for tokens in outputs for t in tokens)
            await drained(stack.engine)
            started = time.perf_counter()
            reference = await Requests(stack.engine, prompts, num_tokens, f"reference-{num_active}").finish()
            reference_seconds[num_active] = time.perf_counter() - started
            _log(f"N={num_active}: reference stream (no switch, {stack.state.topology}, {num_tokens} tokens) in "
                 f"{reference_seconds[num_active]:.1f}s")
            for stream, tokens in zip(mine, outputs):
                check(stream, tokens, reference)
            streams += mine
        finally:
            stop_seconds = await stop_stack(stack)
        if num_active == restart_at:
            restart = await cold_restart(stack_config, num_active, mine[0].switches[0], mine[1].switches[0],
                                         stop_seconds, reference)
            _log(f"N={num_active}: cold restart into {restart.target} + re-prefill: {restart.seconds:.2f}s")
    return Result(memcpy_gbps, indexed_gbps, kv_mb, streams, restart, reference_seconds)


def _log(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{1e3 * seconds:,.0f}"


def overhead(s: SwitchRecord) -> float:
    """TPOT while staging over TPOT outside any switch in the same (source) layout, in % (nan without gaps)."""
    return 100 * (s.staging_tpot / s.source_tpot - 1) if s.num_staging_gaps and s.num_source_gaps else math.nan


def gap_bound(stream: Stream) -> float:
    return 2 * stream.normal_gap + 0.05


def format_tables(config: CutoverConfig, result: Result) -> str:
    """Markdown: one row per N x transition x strategy; then the streams; then the restart."""
    short = dict(QUIESCING="quiesce", PREPARING_WORKERS="prepare", APPLYING_TOPOLOGY="apply", MIGRATING="migrate",
                 REBINDING="rebind")
    lines = ["| N | transition | strategy | live | cutover ms | " + " / ".join(short[p] for p in FREEZE_PHASES)
             + " ms | staging / pre-copy / drain ms | rounds | pre-copied MiB | delta KiB | delta GB/s | ÷ memcpy "
             "| worst gap ms (≤ 2x normal + 50) | TPOT overhead |",
             "|---:|---|---|---:|---:|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for stream in result.streams:
        for s in stream.switches:
            phases = " / ".join(_ms(s.phase_seconds.get(p, 0.0)) for p in FREEZE_PHASES)
            bound = gap_bound(stream)
            mark = "✓" if s.worst_freeze_gap <= bound else "✗"
            extra = overhead(s)
            lines.append(
                f"| {s.num_active} | {s.label} | {s.strategy} | {s.num_live} | {_ms(s.downtime_seconds)} | {phases} | "
                f"{_ms(s.phase_seconds.get('STAGING', 0.0))} / {_ms(s.phase_seconds.get('PRECOPY', 0.0))} / "
                f"{_ms(s.phase_seconds.get('DRAINING', 0.0))} | "
                f"{s.precopy_rounds or '-'} | {s.kv_bytes_precopied / MIB:.1f} | "
                f"{s.delta_bytes / 1024:,.0f} | {s.delta_gbps:.2f} | {s.delta_gbps / result.memcpy_gbps:.2f} | "
                f"{_ms(s.worst_freeze_gap)} ({_ms(bound)}) {mark} | "
                f"{'-' if math.isnan(extra) else f'{extra:+.0f}%'} |")
    lines += ["", "| N | strategy | normal gap ms | TPOT outside ms | gaps outside | preemptions | full prefills "
              "| stream s | outputs = reference |", "|---:|---|---:|---:|---:|---:|---:|---:|:---:|"]
    for st in result.streams:
        check = "✓" if st.outputs_match else f"✗ ({st.num_mismatched} differ)"
        lines.append(f"| {st.num_active} | {st.strategy} | {_ms(st.normal_gap)} | {_ms(st.outside_tpot)} | "
                     f"{st.num_outside_gaps} | {st.num_preemptions} | {st.num_full_prefills} | {st.seconds:.1f} | "
                     f"{check} |")
    r = result.restart
    if r:
        lines += ["", "| cold restart into | N | stop s | workers ready s | router ready s | re-prefill s | total s "
                  "| ÷ staged cutover | ÷ in-place cutover | next token = reference |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
                  f"| {r.target} | {r.num_active} | {r.stop_seconds:.2f} | {r.workers_seconds:.2f} | "
                  f"{r.router_seconds:.2f} | {r.reprefill_seconds:.2f} | {r.seconds:.2f} | "
                  f"{r.seconds / r.staged_cutover:.0f}x | {r.seconds / r.in_place_cutover:.0f}x | "
                  f"{'✓' if r.tokens_match else '✗'} |"]
    lines += ["", f"Notes: {config.model}, {config.num_workers} CPU workers, {len(os.sched_getaffinity(0))} CPUs; "
              f"{config.prompt_len}-token random prompts, greedy; per N one stack, a fresh stream per strategy: "
              f"switches from {MIN_TOKENS} tokens on, {config.steps_between} steps apart, the clients leave "
              f"{config.tail_tokens} tokens after the last one; then the reference stream (no switch) as long as the "
              f"longest. {result.kv_cache_mb} MiB KV per worker, block {config.block_size}. memcpy "
              f"{result.memcpy_gbps:.2f} GB/s (1 thread, {config.memcpy_mb} MiB; the migration's indexed copy "
              f"{result.indexed_copy_gbps:.2f} GB/s).",
              "- cutover = the operation's downtime: from the first request the freeze held back (QUIESCING: the rest "
              "of the steps in flight come back) to the resume; drain = the freeze's start, while the steps in flight "
              "still delivered their tokens (DRAINING); staging = STAGING + PRECOPY while serving. delta = KV bytes copied in the freeze (peer + local, all workers; everything in place), "
              "delta GB/s = delta / the slowest worker's migrate_seconds (its copy and one agreement).",
              "- gaps are between two deltas of one request at the client (in-process). worst gap = largest gap "
              "overlapping [freeze start, end of the call]; normal = median gap outside every switch call; TPOT "
              "overhead = mean gap of the tokens that arrived while staging / mean gap outside every switch in the "
              "same (source) layout, - 1."]
    return "\n".join(lines)


def summarize(result: Result) -> str:
    """The issue's targets, met or not, with the numbers."""
    staged = [(st, s) for st in result.streams if st.strategy == "staged" for s in st.switches]
    in_place = {(s.num_active, s.label): s for st in result.streams if st.strategy == "in-place" for s in st.switches}
    lines = ["", "Targets:"]
    gap_ok = [s.worst_freeze_gap <= gap_bound(st) for st, s in staged]
    worst = max(staged, key=lambda p: p[1].worst_freeze_gap - gap_bound(p[0]))
    lines.append(f"- worst gap during a staged switch <= 2x normal + 50 ms: {'met' if all(gap_ok) else 'not met'} "
                 f"({sum(gap_ok)}/{len(gap_ok)} switches; worst margin N={worst[1].num_active} {worst[1].label}: "
                 f"{_ms(worst[1].worst_freeze_gap)} ms vs {_ms(gap_bound(worst[0]))} ms)")
    by_layout = [s for _, s in staged if not math.isnan(s.layout_gap_bound)]
    if by_layout:
        ok = [s.worst_freeze_gap <= s.layout_gap_bound for s in by_layout]
        tight = max(by_layout, key=lambda s: s.worst_freeze_gap - s.layout_gap_bound)
        lines.append(f"- ... against one step of each layout (source normal + target normal + 50 ms): "
                     f"{sum(ok)}/{len(ok)} switches (worst margin N={tight.num_active} {tight.label}: "
                     f"{_ms(tight.worst_freeze_gap)} ms vs {_ms(tight.layout_gap_bound)} ms)")
    extras = [(overhead(s), s) for _, s in staged if not math.isnan(overhead(s))]
    if extras:
        high = max(extras, key=lambda e: e[0])
        pooled = statistics.fmean(e for e, _ in extras)
        lines.append(f"- TPOT overhead while staging <= 10%: {'met' if high[0] <= 10 else 'not met'} (mean over "
                     f"{len(extras)} switches {pooled:+.0f}%, worst {high[0]:+.0f}% at N={high[1].num_active} "
                     f"{high[1].label})")
    paced = [(st, s) for st in result.streams if st.strategy.startswith("staged@") for s in st.switches]
    if paced:
        def means(pairs):
            over = [overhead(s) for _, s in pairs if not math.isnan(overhead(s))]
            return (statistics.fmean(over) if over else math.nan, max(over, default=math.nan),
                    statistics.fmean(s.staging_seconds for _, s in pairs))
        (o1, w1, t1), (o2, w2, t2) = means(staged), means(paced)
        lines.append(f"- {paced[0][0].strategy} next to staged: TPOT overhead while staging mean {o2:+.0f}% vs "
                     f"{o1:+.0f}%, worst {w2:+.0f}% vs {w1:+.0f}%; staging + pre-copy {t2:.2f} s vs {t1:.2f} s "
                     f"on average ({t2 / t1:.2f}x)")
    ratios = [s.delta_gbps / result.memcpy_gbps for _, s in staged if s.delta_bytes]
    if ratios:
        lines.append(f"- KV delta copy vs memcpy ({result.memcpy_gbps:.2f} GB/s): median "
                     f"{statistics.median(ratios):.2f}x, range {min(ratios):.2f}-{max(ratios):.2f}x (reported)")
    by_n = {}
    for _, s in staged:
        by_n.setdefault(s.num_active, []).append(s)
    if (near := min(by_n, key=lambda n: abs(n - RESTART_AT), default=None)) is not None:
        worst_cut = max(by_n[near], key=lambda s: s.downtime_seconds)
        verdict = "met" if worst_cut.downtime_seconds <= 0.05 else "not met"
        lines.append(f"- cutover <= 50 ms at {near} active: {verdict}"
                     f" ({sum(s.downtime_seconds <= 0.05 for s in by_n[near])}/{len(by_n[near])} switches; longest "
                     f"{worst_cut.label} {_ms(worst_cut.downtime_seconds)} ms)")
    for n, switches in sorted(by_n.items()):
        cut = ", ".join(f"{s.label} {_ms(s.downtime_seconds)} (in place "
                        f"{_ms(in_place[(n, s.label)].downtime_seconds)})" for s in switches)
        lines.append(f"- cutover ms at {n} active: {cut}")
    if result.restart:
        r = result.restart
        ratio = r.seconds / r.staged_cutover
        lines.append(f"- cold restart ÷ cutover >= 100x: {'met' if ratio >= 100 else 'not met'} ({r.seconds:.2f} s / "
                     f"{_ms(r.staged_cutover)} ms = {ratio:.0f}x at N={r.num_active}, {r.target}; in place "
                     f"{r.seconds / r.in_place_cutover:.0f}x)")
    missed = [f"N={s.num_active} {s.label} ({s.staging}; pre-copy {s.precopy or 'not tried'})" for _, s in staged
              if not (s.used_precopy and s.used_staged)]
    lines.append(f"- staged switches that used their staged shards and the pre-copy: {len(staged) - len(missed)}/"
                 f"{len(staged)}" + (f"; not: {', '.join(missed)}" if missed else ""))
    ok = all(st.outputs_match for st in result.streams) and (not result.restart or result.restart.tokens_match)
    preempted = sum(st.num_preemptions for st in result.streams)
    lines.append(f"- outputs: {'✓' if ok else '✗'} every switched stream's greedy tokens equal the reference "
                 f"(no switch); {preempted} preemptions")
    return "\n".join(lines)


def plot(result: Result, path: Path, title: str) -> None:
    """Left: cutover ms vs active requests per transition, staged vs in-place (log y). Right: the worst gap
    during the freeze next to the 2x normal + 50 ms bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figure, (cutover, gaps) = plt.subplots(1, 2, figsize=(12, 4.8))
    labels = list(dict.fromkeys(s.label for st in result.streams for s in st.switches))
    colors = dict(zip(labels, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for strategy, style in zip(STRATEGIES, ("-o", "--s")):
        for label in labels:
            points = sorted((s.num_active, s) for st in result.streams if st.strategy == strategy
                            for s in st.switches if s.label == label)
            cutover.plot([n for n, _ in points], [1e3 * s.downtime_seconds for _, s in points], style,
                         color=colors[label], label=f"{label} {strategy}")
            gaps.plot([n for n, _ in points], [1e3 * s.worst_freeze_gap for _, s in points], style,
                      color=colors[label], label=f"{label} {strategy}")
    bounds = sorted((st.num_active, 1e3 * gap_bound(st)) for st in result.streams if st.strategy == "staged")
    gaps.plot([n for n, _ in bounds], [b for _, b in bounds], ":k", label="2x normal + 50 ms (staged)")
    ns = sorted({st.num_active for st in result.streams})
    for axes, ylabel, name in ((cutover, "cutover ms (freeze, log)", "cutover"),
                               (gaps, "worst inter-token gap ms (log)", "client gap during the freeze")):
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.set_xticks(ns, [str(n) for n in ns])
        axes.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axes.set_xlabel("active requests")
        axes.set_ylabel(ylabel)
        axes.set_title(name)
        axes.grid(alpha=0.3, which="both")
        axes.legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse_args(argv: list[str] | None = None) -> CutoverConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help=f"preset or checkpoint dir (default {DEFAULTS['model']})")
    parser.add_argument("--chain", help=f"start topology, then each target (default {DEFAULTS['chain']})")
    parser.add_argument("--active", help=f"live requests per stack, comma-separated (default {DEFAULTS['active']})")
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, help=f"prompt tokens (default {DEFAULTS['prompt_len']})")
    parser.add_argument("--max-tokens", type=int,
                        help=f"tokens per request, a cap: the clients leave --tail-tokens after the last switch "
                             f"(default {DEFAULTS['max_tokens']})")
    parser.add_argument("--tail-tokens", type=int, default=4, help="tokens each request takes after the last switch")
    parser.add_argument("--kv-tokens", type=int,
                        help=f"generated tokens per request the default KV budget is sized for, at max(active) "
                             f"(default {DEFAULTS['kv_tokens']})")
    parser.add_argument("--steps-between", type=int, default=2, help="decode steps between two switches")
    parser.add_argument("--kv-cache-mb", type=int, default=0,
                        help="KV budget per worker (default: max(active) requests fit every layout of the chain)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--memcpy-mb", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/cutover.json"))
    parser.add_argument("--quick", action="store_true", help=f"smoke-run sizes: {QUICK}")
    parser.add_argument("--paced", type=float, default=0.0, metavar="DUTY",
                        help="also run each N staged with the workers' staging paced to this duty (0 < DUTY <= 1; "
                             "1: unpaced), next to the default one")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    pick = {key: getattr(args, key) if getattr(args, key) is not None else default for key, default in base.items()}
    return CutoverConfig(
        model=pick["model"], chain=tuple(t.strip() for t in pick["chain"].split(",") if t.strip()),
        active=tuple(int(n) for n in pick["active"].split(",") if n.strip()), num_workers=args.num_workers,
        prompt_len=pick["prompt_len"], max_tokens=pick["max_tokens"], tail_tokens=args.tail_tokens,
        steps_between=args.steps_between, kv_tokens=pick["kv_tokens"], kv_cache_mb=args.kv_cache_mb,
        block_size=args.block_size, memcpy_mb=args.memcpy_mb, seed=args.seed, out=args.out, paced=args.paced)


def main(argv: list[str] | None = None) -> None:
    from services.logs import configure_logging
    from services.model.presets import resolve_model
    from services.model.spec import ModelSpec

    configure_logging("bench", "WARNING")
    config = parse_args(argv)
    spec = ModelSpec.from_dir(resolve_model(config.model))
    started = time.perf_counter()
    print(f"cutover bench: {config.model}, {config.num_workers} workers, chain {' → '.join(config.chain)}, "
          f"N = {', '.join(map(str, config.active))}", file=sys.stderr)
    result = asyncio.run(run(config, spec))
    text = format_tables(config, result) + "\n" + summarize(result)
    print(text)
    elapsed = time.perf_counter() - started
    streams = []
    for st in result.streams:
        record = asdict(st)
        for s, raw in zip(st.switches, record["switches"]):
            del raw["snapshot"]
            raw.update(label=s.label, delta_bytes=s.delta_bytes, delta_gbps=s.delta_gbps,
                       staging_tpot_overhead_pct=overhead(s), gap_bound_seconds=gap_bound(st))
        streams.append(record)
    restart = {**asdict(result.restart), "seconds": result.restart.seconds} if result.restart else None
    payload = {"bench": "cutover", "config": {**asdict(config), "out": str(config.out)}, "machine": machine_info(),
               "wall_seconds": elapsed, "result": {**asdict(result), "streams": streams, "restart": restart},
               "text": text}
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(payload, indent=1, default=str).replace("NaN", "null") + "\n")
    plot_path = config.out.with_suffix(".png")
    plot(result, plot_path, f"{config.model}: staged (KV pre-copy) vs in-place cutover, "
                            f"{machine_info()['usable_cpus']} CPUs")
    print(f"\nwrote {config.out} and {plot_path} in {elapsed:.0f}s", file=sys.stderr)
    short = [f"N={s.num_active} {s.strategy} {s.label}" for st in result.streams for s in st.switches
             if s.num_live < s.num_active]
    if short:
        print(f"warning: not every request was live during {', '.join(short)}: raise --max-tokens", file=sys.stderr)
    if not all(st.outputs_match for st in result.streams) or (result.restart and not result.restart.tokens_match):
        raise SystemExit("tokens differ from the run without switches (see the tables)")


if __name__ == "__main__":
    main()
