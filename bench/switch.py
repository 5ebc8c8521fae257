"""Live TP/PP switch vs cold restart, with requests in flight: downtime by phase, KV GB/s, peak extra memory.

    python bench/switch.py [--model llama-135m] [--restart-all] [--quick]

One stack (weightstore, 4 workers, router engine + gRPC, controller transaction) serves N long greedy requests;
once every request has its first token, the stack switches through a chain of topologies while they decode.
A cold restart of the same stack in the target topology, plus a re-prefill of the same requests (prompt and the
tokens generated so far) until each has its next token, is the baseline. Prints tables, writes JSON and a plot.
Heavy imports stay inside functions: worker processes re-import this module as `__mp_main__`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULTS = dict(model="llama-135m", num_requests=16, prompt_len=256, max_tokens=64, kv_cache_mb=96)
QUICK = dict(model="tiny-llama", num_requests=8, prompt_len=64, max_tokens=48, kv_cache_mb=4)
# Same size (tp4 replicates KV when num_kv_heads < 4), back, shrink, grow, same size into a deep pipeline.
CHAIN = "tp2pp2,tp4pp1,tp2pp2,tp2pp1,tp2pp2,tp1pp4"
PHASES = ("QUIESCING", "PREPARING_WORKERS", "APPLYING_TOPOLOGY", "MIGRATING", "REBINDING")
TOKEN = "switch-bench-token"
MIB, GB = 1 << 20, 1e9
NUM_BYTE_TOKENS = 256


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What to measure."""

    model: str
    chain: tuple[str, ...]           # start topology, then each switch target
    num_workers: int
    num_requests: int
    prompt_len: int
    max_tokens: int
    steps_between: int               # decode steps every request takes between two switches
    kv_cache_mb: int                 # KV budget per worker
    block_size: int
    restart_all: bool                # cold restart baseline for every transition (else the first only)
    memcpy_mb: int
    seed: int
    out: Path
    strategy: str = "staged"         # "staged": shards built while serving, before the freeze; "in-place"

    def __post_init__(self) -> None:
        if len(self.chain) < 2 or self.num_requests < 1 or self.max_tokens < 2 or self.steps_between < 0:
            raise ValueError("need a chain of >= 2 topologies, >= 1 request, --max-tokens >= 2, --steps-between >= 0")


@dataclass(slots=True)
class Restart:
    """Cold restart of the stack in the target topology, then a re-prefill of the live requests."""

    stop_seconds: float              # the stack it replaces: router, controller, workers, weightstore
    workers_seconds: float           # weightstore + workers started, shards loaded
    router_seconds: float            # engine connected and ready, gRPC up
    reprefill_seconds: float         # until every request has its next token again
    tokens_match: bool               # those tokens equal the uninterrupted reference

    @property
    def seconds(self) -> float:
        return self.stop_seconds + self.workers_seconds + self.router_seconds + self.reprefill_seconds


@dataclass(slots=True)
class Switch:
    """One live transition: the operation's numbers and the per-worker ones it sums away."""

    source: str
    target: str
    phase_seconds: dict[str, float]
    num_live_requests: int
    num_used_blocks: int
    live_kv_bytes: int                   # used blocks x whole-model KV bytes per block
    kv_capacity_used: float              # used blocks / capacity before the switch
    kv_bytes_received: int               # from peers' pools
    kv_bytes_local: int                  # inside a worker (head offsets changed)
    weight_bytes_loaded: int
    weight_bytes_reused: int
    migrate_seconds: float               # slowest worker's KV migration (overlaps the reload)
    reload_seconds: float                # slowest worker's shard reload
    peak_extra_bytes: int                # KV bytes above max(before, after) during the migration, worst worker
    plan_peak_extra_bytes: int           # the same as the Plan RPC computed it before the switch
    worker_peak_extra_bytes: int         # the workers' own report: their largest new layer tensor
    layer_kv_bytes: int                  # one layer's KV tensor on the worst worker (the larger of old and new)
    layer_kv_used_bytes: int             # the used blocks of that layer tensor
    num_preempted: int
    built_groups: bool
    snapshot: list[list[int]] = field(default_factory=list, repr=False)  # prompt + generated, at the freeze
    restart: Restart | None = None
    staging_seconds: float = 0.0         # shards built while serving, before the freeze (not downtime)

    @property
    def label(self) -> str:
        return f"{self.source}→{self.target}"

    @property
    def downtime_seconds(self) -> float:
        return sum(self.phase_seconds.values())

    @property
    def kv_phase_gbps(self) -> float:
        seconds = self.phase_seconds.get("MIGRATING", 0.0)
        return self.kv_bytes_received / seconds / GB if seconds else 0.0

    @property
    def kv_copy_gbps(self) -> float:
        moved = self.kv_bytes_received + self.kv_bytes_local
        return moved / self.migrate_seconds / GB if self.migrate_seconds else 0.0


class _RecordingWorker:
    """A worker stub that keeps its last ApplySwitch response (the operation only reports sums)."""

    def __init__(self, stub) -> None:
        self._stub = stub
        self.applied = None

    def __getattr__(self, name: str):
        return getattr(self._stub, name)

    async def ApplySwitch(self, request, **kwargs):  # noqa: N802
        self.applied = await self._stub.ApplySwitch(request, **kwargs)
        return self.applied


@dataclass(slots=True)
class _Stack:
    """One running stack: processes, the router engine and its gRPC server, the controller side."""

    cluster: object
    engine: object
    server: object
    state: object
    reconfigurer: object
    workers: list[_RecordingWorker]


async def start_stack(config: BenchConfig, topology: str, max_num_seqs: int = 128,
                      faults: str = "") -> tuple[_Stack, float, float]:
    """The stack of tests/reconfigure in-process (the router runs up to max_num_seqs requests at once; `faults`:
    the workers' fault rules, e.g. a slower worker); returns it, seconds to workers ready, seconds to router ready."""
    from services.controller.state import ControllerConfig, ControllerState
    from services.controller.transaction import Reconfigurer
    from services.launch.cluster import ClusterConfig, LocalCluster
    from services.model.spec import ModelSpec
    from services.router.grpc_server import start_router_grpc
    from services.router.main import RouterConfig, build_engine

    started = time.perf_counter()
    cluster = LocalCluster(ClusterConfig(
        model=config.model, num_workers=config.num_workers, topology=topology, block_size=config.block_size,
        kv_cache_bytes=config.kv_cache_mb * MIB, env={"RECONFIG_LOG_LEVEL": os.environ.get("BENCH_WORKER_LOG_LEVEL", "WARNING")}, faults=faults))
    cluster.start()
    workers_ready = time.perf_counter()
    addresses = tuple(cluster.worker_addresses)
    engine = await build_engine(RouterConfig(worker_addresses=addresses, model_dir=str(cluster.model_dir),
                                             model_name=config.model, max_num_seqs=max_num_seqs))
    server, port = await start_router_grpc(engine, "127.0.0.1", 0, TOKEN)
    state = ControllerState(ControllerConfig(token=TOKEN, worker_addresses=addresses, topology=topology,
                                             router_grpc_address=f"127.0.0.1:{port}", model_dir=str(cluster.model_dir)))
    await state.open()
    workers = [_RecordingWorker(stub) for stub in state.worker_stubs]
    reconfigurer = Reconfigurer(state, ModelSpec.from_dir(cluster.model_dir), workers, state.router_stub, TOKEN)
    stack = _Stack(cluster, engine, server, state, reconfigurer, workers)
    return stack, workers_ready - started, time.perf_counter() - workers_ready


async def stop_stack(stack: _Stack) -> float:
    """Stop router, controller channels and every process; returns the seconds it took."""
    started = time.perf_counter()
    await stack.engine.stop()
    await stack.state.close()
    await stack.server.stop(0)
    stack.cluster.stop()
    return time.perf_counter() - started


class Requests:
    """One consumer task per request; tokens[i] grows as request i streams."""

    def __init__(self, engine, prompts: list[list[int]], max_tokens: int, tag: str) -> None:
        from services.router.contracts import GenerationRequest

        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.tasks = [asyncio.ensure_future(self._consume(engine, i, GenerationRequest(f"{tag}-{i}", tuple(p),
                                                                                        max_tokens)))
                      for i, p in enumerate(prompts)]

    async def _consume(self, engine, i: int, request) -> None:
        async for delta in engine.generate(request):
            self.tokens[i].extend(delta.token_ids)
            if delta.finish_reason in ("error", "abort"):
                raise RuntimeError(f"{request.request_id} ended with {delta.finish_reason}: {delta.error}")

    @property
    def num_live(self) -> int:
        return sum(1 for task in self.tasks if not task.done())

    def have(self, counts: list[int]) -> bool:
        """Whether every live request i has at least counts[i] tokens."""
        return all(task.done() or len(tokens) >= count for task, tokens, count in zip(self.tasks, self.tokens, counts))

    async def wait_for_tokens(self, counts: list[int]) -> None:
        """Until every live request i has at least counts[i] tokens."""
        while not self.have(counts):
            await asyncio.sleep(0.005)

    async def finish(self) -> list[list[int]]:
        await asyncio.gather(*self.tasks)
        return self.tokens


async def _switch(config: BenchConfig, stack: _Stack, target: str, prompts: list[list[int]], live: Requests
                  ) -> Switch:
    """Plan, then run one transition with the live requests; collect its numbers."""
    from services.controller.status import OperationState
    from services.controller.plan import plan_switch
    from services.rpc.reconfig.v1 import worker_pb2

    source = str(stack.state.topology)
    plan = await plan_switch(stack.reconfigurer, target)
    infos = await asyncio.gather(*(w.GetInfo(worker_pb2.GetInfoRequest(), timeout=10) for w in stack.workers))
    before = stack.engine.stats()
    snapshot = [list(p) + list(t) for p, t in zip(prompts, live.tokens)]
    num_live = live.num_live
    operation = await stack.reconfigurer.reconfigure(target, strategy=config.strategy)
    if operation.state is not OperationState.SUCCEEDED:
        raise RuntimeError(f"{source}→{target}: {operation.state.name}: {operation.error}")
    replies = [w.applied for w in stack.workers]
    memory = _peak_extra(config, stack.reconfigurer.spec, source, target, infos, plan.num_kv_blocks_after)
    peak_rank = max(range(len(memory)), key=lambda r: memory[r])
    spec = stack.reconfigurer.spec
    bytes_per_block = 2 * config.block_size * spec.num_kv_heads * spec.head_dim * 4 * spec.num_layers  # fp32 KV
    return Switch(
        source=source, target=target, phase_seconds={p: operation.phase_seconds.get(p, 0.0) for p in PHASES},
        num_live_requests=num_live, num_used_blocks=before.num_kv_blocks_used,
        live_kv_bytes=before.num_kv_blocks_used * bytes_per_block,
        kv_capacity_used=before.num_kv_blocks_used / max(1, before.num_kv_blocks_total),
        kv_bytes_received=sum(r.kv_bytes_received for r in replies),
        kv_bytes_local=sum(r.kv_bytes_local for r in replies),
        weight_bytes_loaded=sum(r.weight_bytes_loaded for r in replies),
        weight_bytes_reused=sum(r.weight_bytes_reused for r in replies),
        migrate_seconds=max(r.migrate_seconds for r in replies), reload_seconds=max(r.reload_seconds for r in replies),
        peak_extra_bytes=memory[peak_rank][0], plan_peak_extra_bytes=max(w.peak_extra_bytes for w in plan.workers),
        worker_peak_extra_bytes=max(r.peak_extra_bytes for r in replies), layer_kv_bytes=memory[peak_rank][1],
        layer_kv_used_bytes=memory[peak_rank][1] * before.num_kv_blocks_used // max(1, plan.num_kv_blocks_after),
        num_preempted=operation.num_requests_preempted, built_groups=any(r.built_groups for r in replies),
        staging_seconds=operation.staging_seconds,
        snapshot=snapshot,
    )


def _peak_extra(config: BenchConfig, spec, source: str, target: str, infos, capacity: int) -> list[tuple[int, int]]:
    """Per worker: (peak extra KV bytes, one layer's KV bytes: the larger of its old and new layer tensor), from
    the pure plan with each worker's real block counts before and after (Plan passes the target's for both)."""
    from services.topology import Topology, place, plan_kv_migration

    old, new = Topology.parse(source), Topology.parse(target)
    plan = plan_kv_migration(place(old, spec.shape), range(old.num_workers), place(new, spec.shape),
                             range(new.num_workers))
    sizes = (config.block_size, spec.head_dim, 4)  # fp32 KV on CPU workers
    return [(plan.peak_extra_bytes(rank, info.num_kv_blocks, *sizes, new_num_blocks=capacity),
             max(plan.layer_bytes(rank, capacity, *sizes),
                 plan.layer_bytes(rank, info.num_kv_blocks, *sizes, new_layout=False)))
            for rank, info in enumerate(infos)]


async def _restart(config: BenchConfig, switch: Switch, stop_seconds: float, reference: list[list[int]]
                   ) -> tuple[Restart, _Stack]:
    """Start the stack in the switch's target and re-prefill its snapshot until every request has a token."""
    stack, workers_seconds, router_seconds = await start_stack(config, switch.target)
    started = time.perf_counter()
    replay = Requests(stack.engine, switch.snapshot, 1, f"restart-{switch.target}")
    tokens = await replay.finish()
    reprefill_seconds = time.perf_counter() - started
    num_generated = [len(s) - config.prompt_len for s in switch.snapshot]  # before the freeze
    match = all(t == ref[n:n + 1] for t, ref, n in zip(tokens, reference, num_generated))
    return Restart(stop_seconds, workers_seconds, router_seconds, reprefill_seconds, match), stack


def measure_copies(num_mb: int, repeats: int = 5) -> tuple[float, float]:
    """Single-thread GB/s (a worker copies KV on one thread), best of `repeats`: a plain memcpy, and the KV
    migration's copy pattern (every block id as an index tensor x one of two KV heads, gathered then scattered)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(2, num_mb * MIB // (2 * 16 * 2 * 64 * 4), 16, 2, 64)  # [2, blocks, block, heads, D]
        dst = torch.zeros_like(src)
        used = torch.arange(src.shape[1])

        def best(copy) -> float:
            seconds = float("inf")
            for _ in range(repeats):
                started = time.perf_counter()
                copy()
                seconds = min(seconds, time.perf_counter() - started)
            return seconds

        def gather_scatter() -> None:
            dst[:, used, :, 0:1] = src[:, used, :, 1:2]  # [2, blocks, block, 1, D]

        num_bytes = src.numel() * src.element_size()
        return num_bytes / best(lambda: dst.copy_(src)) / GB, num_bytes / 2 / best(gather_scatter) / GB
    finally:
        torch.set_num_threads(previous)


def make_prompts(config: BenchConfig) -> list[list[int]]:
    """Random byte-token prompts of prompt_len tokens."""
    return random_prompts(config.num_requests, config.prompt_len, config.seed)


def random_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    """`num` random byte-token prompts of `length` tokens."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(3, NUM_BYTE_TOKENS, size=(num, length)).tolist()


@dataclass(slots=True)
class Result:
    """Everything one run measured."""

    memcpy_gbps: float
    indexed_copy_gbps: float             # the migration's gather/scatter pattern, same buffers
    cold_start_seconds: float            # the first stack: workers + router ready
    reference_seconds: float             # the uninterrupted run (prefill + decode)
    switches: list[Switch]
    outputs_match: bool                  # every request's tokens equal the uninterrupted run's
    num_full_prefills: int               # in the switched run (== num_requests: nobody prefilled again)
    num_preemptions: int


async def run(config: BenchConfig) -> Result:
    """Reference run, the switched run with its transitions, then the cold restarts."""
    memcpy_gbps, indexed_copy_gbps = measure_copies(config.memcpy_mb)
    _log(f"memcpy {memcpy_gbps:.2f} GB/s, indexed copy {indexed_copy_gbps:.2f} GB/s (1 thread, {config.memcpy_mb} MiB)")
    prompts = make_prompts(config)
    stack, workers_seconds, router_seconds = await start_stack(config, config.chain[0])
    _log(f"stack {config.chain[0]} ready in {workers_seconds + router_seconds:.1f}s")
    try:
        started = time.perf_counter()
        reference = await Requests(stack.engine, prompts, config.max_tokens, "reference").finish()
        reference_seconds = time.perf_counter() - started
        _log(f"reference run (no switch) in {reference_seconds:.1f}s")
        before = stack.engine.stats()
        live = Requests(stack.engine, prompts, config.max_tokens, "live")
        await live.wait_for_tokens([1] * len(prompts))  # every request prefilled
        switches = []
        for target in config.chain[1:]:
            await live.wait_for_tokens([len(t) + config.steps_between for t in live.tokens])
            switches.append(await _switch(config, stack, target, prompts, live))
            s = switches[-1]
            _log(f"{s.label}: {1e3 * s.downtime_seconds:.0f} ms down, {s.num_live_requests} live, "
                 f"{s.kv_bytes_received / MIB:.1f} MiB KV moved")
        outputs = await live.finish()
        after = stack.engine.stats()
    finally:
        stop_seconds = await stop_stack(stack)
    for i, switch in enumerate(switches):
        if i == 0 or config.restart_all:
            switch.restart, stack = await _restart(config, switch, stop_seconds, reference)
            _log(f"cold restart into {switch.target}: {switch.restart.seconds:.1f}s")
            stop_seconds = await stop_stack(stack)
    return Result(memcpy_gbps, indexed_copy_gbps, workers_seconds + router_seconds, reference_seconds, switches,
                  outputs == reference, int(after.extra["num_full_prefills"] - before.extra["num_full_prefills"]),
                  after.num_preemptions - before.num_preemptions)


def _log(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / MIB:.1f}"


def format_table(config: BenchConfig, result: Result, num_kv_heads: int) -> str:
    """Markdown: downtime by phase next to the restart; then what moved and the memory it took."""
    from services.topology import Topology

    short = {"QUIESCING": "quiesce", "PREPARING_WORKERS": "prepare", "APPLYING_TOPOLOGY": "apply",
             "MIGRATING": "migrate", "REBINDING": "rebind"}
    lines = ["| transition | live reqs | live KV MiB (% of pool) | staging ms (serving) | downtime ms | "
             + " | ".join(f"{short[p]} ms" for p in PHASES) + " | cold restart s | restart / switch |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(PHASES) + "---:|---:|"]
    for s in result.switches:
        restart = f"{s.restart.seconds:.2f}" if s.restart else "-"
        ratio = f"{s.restart.seconds / s.downtime_seconds:.0f}x" if s.restart else "-"
        lines.append(f"| {s.label} | {s.num_live_requests} | {_mib(s.live_kv_bytes)} ({100 * s.kv_capacity_used:.0f}%)"
                     f" | {1e3 * s.staging_seconds:.0f} | {1e3 * s.downtime_seconds:.0f} | "
                     + " | ".join(f"{1e3 * s.phase_seconds[p]:.0f}" for p in PHASES) + f" | {restart} | {ratio} |")
    lines += ["", "| transition | KV moved MiB (peer + local) | KV GB/s (migrate phase) | KV GB/s (worker copy) "
              "| memcpy GB/s | weights loaded MiB (reused) | reload s | peak extra MiB (Plan RPC) "
              "| one layer KV MiB (used) | peak / layer | preempted |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in result.switches:
        ratio = s.peak_extra_bytes / s.layer_kv_bytes if s.layer_kv_bytes else 0.0
        lines.append(f"| {s.label} | {_mib(s.kv_bytes_received)} + {_mib(s.kv_bytes_local)} | {s.kv_phase_gbps:.2f} | "
                     f"{s.kv_copy_gbps:.2f} | {result.memcpy_gbps:.2f} | {_mib(s.weight_bytes_loaded)} "
                     f"({_mib(s.weight_bytes_reused)}) | {s.reload_seconds:.2f} | {_mib(s.peak_extra_bytes)} "
                     f"({_mib(s.plan_peak_extra_bytes)}) | {_mib(s.layer_kv_bytes)} ({_mib(s.layer_kv_used_bytes)}) "
                     f"| {ratio:.2f} | {s.num_preempted} |")
    restarts = [s for s in result.switches if s.restart]
    lines += ["", "| cold restart into | stop s | workers ready s | router ready s | re-prefill s | total s "
              "| next token = reference |", "|---|---:|---:|---:|---:|---:|:---:|"]
    for s in restarts:
        r = s.restart
        lines.append(f"| {s.target} | {r.stop_seconds:.2f} | {r.workers_seconds:.2f} | {r.router_seconds:.2f} | "
                     f"{r.reprefill_seconds:.2f} | {r.seconds:.2f} | {'✓' if r.tokens_match else '✗'} |")
    check = "✓" if result.outputs_match else "✗"
    replicated = [s.label for s in result.switches if Topology.parse(s.target).tp > num_kv_heads]
    lines += ["", f"Outputs: {check} every request's {config.max_tokens} greedy tokens equal the run without "
              f"switches; {result.num_full_prefills} full prefills for {config.num_requests} requests, "
              f"{result.num_preemptions} preemptions.",
              f"Notes: {config.model}, {config.num_workers} workers, {config.num_requests} requests x "
              f"{config.prompt_len} prompt tokens, {config.kv_cache_mb} MiB KV per worker, block {config.block_size}; "
              f"{len(os.sched_getaffinity(0))} CPUs. downtime = sum of phases (freeze to resume). KV-head replication "
              f"({num_kv_heads} KV heads): {', '.join(replicated) or 'none (tp <= KV heads in every target)'}.",
              "- KV moved = bytes copied from peers' pools + inside a worker; GB/s (migrate phase) = peer bytes / "
              "MIGRATING seconds, which also hold the shard reload; GB/s (worker copy) = all KV bytes / the "
              "slowest worker's migration (its per-layer barriers included). memcpy: 1 thread, "
              f"{config.memcpy_mb} MiB, best of 5; the migration's own copy pattern (block-id index tensor x head "
              f"slice) on the same buffers: {result.indexed_copy_gbps:.2f} GB/s.",
              "- peak extra = KV bytes above max(pool before, pool after) during the migration, worst worker: the "
              "pure plan run in the executor's layer order with each worker's real block counts (Plan RPC's own "
              "figure in brackets); one layer KV = that worker's larger layer tensor, old or new (used blocks).",
              "- cold restart = stop the stack it replaces + start weightstore and workers in the target + router "
              "ready + re-prefill of every request's prompt and generated tokens until its next token "
              f"(the checkpoint is in the page cache). First stack cold start: {result.cold_start_seconds:.1f}s."]
    return "\n".join(lines)


def plot(result: Result, path: Path, title: str) -> None:
    """Left: stacked phase seconds per transition. Right: switch downtime next to the cold restart (log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    switches = result.switches
    xs = list(range(len(switches)))
    figure, (phases, versus) = plt.subplots(1, 2, figsize=(max(10.0, 2.2 * len(switches)), 4.8))
    bottom = [0.0] * len(switches)
    for phase in PHASES:
        heights = [1e3 * s.phase_seconds[phase] for s in switches]
        phases.bar(xs, heights, 0.6, bottom=bottom, label=phase.lower())
        bottom = [b + h for b, h in zip(bottom, heights)]
    phases.set_xticks(xs, [s.label for s in switches], rotation=20, fontsize=8)
    phases.set_ylabel("downtime ms (freeze to resume)")
    phases.set_title("live switch: phases")
    phases.set_ylim(0, 1.3 * max(bottom))
    phases.legend(fontsize=8, ncols=3, loc="upper center")
    phases.grid(axis="y", alpha=0.3)
    width = 0.38
    versus.bar([x - width / 2 for x in xs], [s.downtime_seconds for s in switches], width, label="live switch")
    restarts = [(x, s.restart.seconds) for x, s in zip(xs, switches) if s.restart]
    versus.bar([x + width / 2 for x, _ in restarts], [seconds for _, seconds in restarts], width,
               label="cold restart + re-prefill")
    for x, seconds in restarts:
        versus.annotate(f"{seconds / switches[x].downtime_seconds:.0f}x", (x + width / 2, seconds),
                        ha="center", va="bottom", fontsize=8)
    versus.set_xticks(xs, [s.label for s in switches], rotation=20, fontsize=8)
    versus.set_yscale("log")
    versus.set_ylabel("seconds (log)")
    versus.set_title("switch vs restart")
    versus.legend(fontsize=8)
    versus.grid(axis="y", alpha=0.3, which="both")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def machine_info() -> dict:
    import torch

    return {"cpu_count": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "loadavg": os.getloadavg()}


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help=f"preset or checkpoint dir (default {DEFAULTS['model']})")
    parser.add_argument("--chain", default=CHAIN, help="start topology, then each target (comma-separated)")
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--num-requests", type=int, help=f"live requests (default {DEFAULTS['num_requests']})")
    parser.add_argument("--prompt-len", type=int, help=f"prompt tokens (default {DEFAULTS['prompt_len']})")
    parser.add_argument("--max-tokens", type=int, help=f"tokens per request (default {DEFAULTS['max_tokens']})")
    parser.add_argument("--steps-between", type=int, default=2, help="decode steps between two switches")
    parser.add_argument("--kv-cache-mb", type=int, help=f"KV budget per worker (default {DEFAULTS['kv_cache_mb']})")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--restart-all", action="store_true", help="cold restart baseline for every transition")
    parser.add_argument("--memcpy-mb", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategy", choices=("staged", "in-place"), default="staged",
                        help="staged: target shards built while serving, then the freeze (default); in-place: all of "
                             "it inside the freeze")
    parser.add_argument("--out", type=Path, default=Path("bench/results/switch.json"))
    parser.add_argument("--quick", action="store_true", help=f"smoke-run sizes: {QUICK}")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    pick = {key: getattr(args, key) if getattr(args, key) is not None else default for key, default in base.items()}
    return BenchConfig(
        model=pick["model"], chain=tuple(t.strip() for t in args.chain.split(",") if t.strip()),
        num_workers=args.num_workers, num_requests=pick["num_requests"], prompt_len=pick["prompt_len"],
        max_tokens=pick["max_tokens"], steps_between=args.steps_between, kv_cache_mb=pick["kv_cache_mb"],
        block_size=args.block_size, restart_all=args.restart_all, memcpy_mb=args.memcpy_mb, seed=args.seed,
        out=args.out, strategy=args.strategy,
    )


def main(argv: list[str] | None = None) -> None:
    from services.logs import configure_logging
    from services.model.presets import resolve_model
    from services.model.spec import ModelSpec

    configure_logging("bench", "WARNING")
    config = parse_args(argv)
    started = time.perf_counter()
    print(f"switch bench: {config.model}, {config.num_workers} workers, chain {' → '.join(config.chain)}, "
          f"{config.num_requests} requests x {config.prompt_len} tokens", file=sys.stderr)
    result = asyncio.run(run(config))
    table = format_table(config, result, ModelSpec.from_dir(resolve_model(config.model)).num_kv_heads)
    print(table)
    elapsed = time.perf_counter() - started
    records = [{**asdict(s), "label": s.label, "downtime_seconds": s.downtime_seconds,
                "kv_phase_gbps": s.kv_phase_gbps, "kv_copy_gbps": s.kv_copy_gbps,
                "restart_seconds": s.restart.seconds if s.restart else None} for s in result.switches]
    for record in records:
        del record["snapshot"]
    payload = {"bench": "switch", "config": {**asdict(config), "out": str(config.out)}, "machine": machine_info(),
               "wall_seconds": elapsed, "result": {**asdict(result), "switches": records}, "table": table}
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(payload, indent=1) + "\n")
    plot_path = config.out.with_suffix(".png")
    plot(result, plot_path, f"{config.model}: live switch vs cold restart ({machine_info()['usable_cpus']} CPUs)")
    print(f"\nwrote {config.out} and {plot_path} in {elapsed:.0f}s", file=sys.stderr)
    failed = [s.label for s in result.switches if s.num_live_requests == 0]
    if failed:
        raise SystemExit(f"no request was live during {', '.join(failed)}: raise --max-tokens")
    if not result.outputs_match or any(s.restart and not s.restart.tokens_match for s in result.switches):
        raise SystemExit("tokens differ from the run without switches (see the table)")


if __name__ == "__main__":
    main()
