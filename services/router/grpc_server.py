"""The router's gRPC service: a thin servicer over the engine; conversion to and from protobuf happens here only."""

from __future__ import annotations

import contextlib
import inspect
import math
import uuid
from collections.abc import Sequence
from typing import Protocol

import grpc
import structlog

from services.launch.driver import WorkerUnreachable
from services.model.tokenizer import Tokenizer
from services.router.api.limits import encode_text
from services.router.contracts import (
    EngineProtocol,
    EngineStats,
    GenerationDelta,
    GenerationRequest,
    SwitchReport,
)
from services.rpc.auth import TokenAuthInterceptor, generate_token, is_authorized, protect_methods
from services.rpc.errors import ErrorInterceptor, check_address
from services.router.expert_balance import ExpertBalanceAborted, ExpertBalanceError
from services.router.migration import MigrationRefused, RouterFrozen
from services.router.load_window import LoadSnapshot
from services.rpc.reconfig.v1 import router_pb2, router_pb2_grpc, worker_pb2
from services.worker.step import SamplingParams, WorkerTime

log = structlog.get_logger(__name__)

_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name  # "reconfig.v1.Router"
ADMIN_METHODS = tuple(f"/{_SERVICE}/{name}" for name in ("Freeze", "Rebind", "Resume", "Stats", "PreCopyBlocks",
                                                                   "ExpertStatus", "RebalanceExperts", "MigrateOut",
                                                                   "MigrateIn"))
DEFAULT_FREEZE_TIMEOUT_S = 60.0
MAX_KV_BLOCKS = 1 << 22       # the block manager lists its free ids: a larger capacity is a bad request, not a GiB
# A worker's answers to ImportKV that the router passes on as they are: the source's KV is out of this worker's reach
# (another host, a GPU pool), or the request does not fit this pool.
_WORKER_REFUSALS = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)


class AdminEngine(EngineProtocol, Protocol):
    """The engine as the controller drives it (services.router.engine.Engine implements it)."""

    async def freeze(self, timeout_s: float = DEFAULT_FREEZE_TIMEOUT_S, lease_s: float = 0.0) -> float:
        """Stop scheduling; return once the in-flight steps are done (TimeoutError past timeout_s), with the seconds
        before a request first waited for the freeze. lease_s > 0: resume by itself unless resumed or frozen again
        within lease_s."""
        ...

    def rebind(self, num_kv_blocks: int, worker_addresses: tuple[str, ...] | None = None,
               drop_kv: bool = False, dp_size: int = 0, worker_infos: list | None = None,
               precopy_operation_id: str = "") -> object:
        """Take a new KV capacity (frozen only), optionally new workers (and their infos), dropping the KV, and
        another number of KV pools (then it returns the block maps: after that operation's pre-copy, of what it
        did not copy); may return an awaitable."""
        ...

    def kv_to_move(self, precopy_operation_id: str = "") -> list[int]:
        """Frozen: the used block ids a KV migration copies now (only the delta after a pre-copy)."""
        ...

    def precopy_blocks(self, operation_id: str, num_kv_blocks: int, num_kv_pools: int = 1) -> tuple:
        """A KV pre-copy round while serving: (block maps to copy, block maps to warm, handed out so far, used
        now)."""
        ...

    def plan_rebind(self, num_kv_blocks: int, dp_size: int = 1) -> list[tuple[str, int, int, int]]:
        """What a rebind would do to the running requests now: (request_id, pool, pool after or -1, blocks)."""
        ...

    def resume(self) -> object:
        """Schedule again; may return an awaitable."""
        ...

    def record_switch(self, report: SwitchReport) -> None:
        """Count a finished layout switch (for /metrics)."""
        ...


def sampling_from_pb(pb: router_pb2.GenerateRequest) -> SamplingParams:
    """Sampling parameters of a request; ValueError on values out of range."""
    if not pb.HasField("sampling"):
        return SamplingParams()
    s = pb.sampling
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {s.temperature}")
    if not 0 <= s.top_p <= 1:
        raise ValueError(f"top_p must be in [0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {s.top_k}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(s, name) <= 2:
            raise ValueError(f"{name} must be in [-2, 2], got {getattr(s, name)}")
    if not (math.isfinite(s.repetition_penalty) and s.repetition_penalty >= 0):
        raise ValueError(f"repetition_penalty must be a finite number > 0 (0: none), got {s.repetition_penalty}")
    bad_bias = next(((t, b) for t, b in s.logit_bias.items() if t < 0 or not -100 <= b <= 100), None)
    if bad_bias is not None:
        raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {bad_bias}")
    if s.HasField("num_logprobs") and not 0 <= s.num_logprobs <= 20:
        raise ValueError(f"num_logprobs must be in [0, 20], got {s.num_logprobs}")
    return SamplingParams.from_pb(s)


def request_from_pb(pb: router_pb2.GenerateRequest, tokenizer: Tokenizer,
                    encoded_prompt: Sequence[int] | None = None) -> GenerationRequest:
    """A GenerationRequest from the wire; ValueError on malformed input (the engine checks lengths).
    `encoded_prompt`: pb.prompt already tokenized (else it is tokenized here)."""
    if bool(pb.prompt_token_ids) == bool(pb.prompt):
        raise ValueError("set exactly one of prompt_token_ids and prompt")
    if pb.prompt_token_ids:
        prompt_token_ids = tuple(pb.prompt_token_ids)
    else:
        prompt_token_ids = tuple(encoded_prompt if encoded_prompt is not None else tokenizer.encode(pb.prompt))
    bad = [t for t in prompt_token_ids if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})")
    if pb.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {pb.max_tokens}")
    if not 0 <= pb.min_tokens <= pb.max_tokens:
        raise ValueError(f"min_tokens must be in [0, max_tokens], got {pb.min_tokens}")
    stop_token_ids = frozenset(pb.stop_token_ids) | (frozenset() if pb.ignore_eos else tokenizer.eos_token_ids)
    return GenerationRequest(
        request_id=pb.request_id or f"grpc-{uuid.uuid4().hex}",
        prompt_token_ids=prompt_token_ids,
        max_tokens=pb.max_tokens,
        sampling=sampling_from_pb(pb),
        stop_token_ids=stop_token_ids,
        stop_strings=tuple(s for s in pb.stop if s),
        min_tokens=pb.min_tokens,
    )


def check_freeze(pb: router_pb2.FreezeRequest) -> None:
    """ValueError unless the lease is a finite number of seconds >= 0."""
    if not (math.isfinite(pb.lease_seconds) and pb.lease_seconds >= 0):
        raise ValueError(f"lease_seconds must be a finite number >= 0, got {pb.lease_seconds}")


def check_rebind(pb: router_pb2.RebindRequest) -> None:
    """ValueError unless the capacity is not absurd and every worker address reads host:port (the scheduler
    refuses a capacity below 1)."""
    if pb.num_kv_blocks > MAX_KV_BLOCKS:
        raise ValueError(f"num_kv_blocks must be at most {MAX_KV_BLOCKS}, got {pb.num_kv_blocks}")
    for address in pb.worker_addresses:
        check_address(address)
    if pb.worker_infos and len(pb.worker_infos) != len(pb.worker_addresses):
        raise ValueError(f"{len(pb.worker_infos)} worker infos for {len(pb.worker_addresses)} worker addresses")


def block_maps_to_pb(maps) -> list[worker_pb2.BlockMap]:
    """{(old pool, new pool): (old ids, new ids)} -> BlockMap messages, by pool pair."""
    return [worker_pb2.BlockMap(src_pool=src, dst_pool=dst, src_block_ids=old, dst_block_ids=new)
            for (src, dst), (old, new) in sorted(maps.items())]


def delta_to_pb(request_id: str, delta: GenerationDelta) -> router_pb2.GenerateResponse:
    """One streamed response."""
    return router_pb2.GenerateResponse(
        request_id=request_id, token_ids=delta.token_ids, text=delta.text,
        finish_reason=delta.finish_reason or "",
        usage=router_pb2.Usage(prompt_tokens=delta.num_prompt_tokens, completion_tokens=delta.num_generated_tokens),
        error=delta.error or "",
        logprobs=[logprob.to_pb() for logprob in delta.logprobs],
    )


def stats_to_pb(stats: EngineStats) -> router_pb2.RouterStats:
    """EngineStats → RouterStats."""
    return router_pb2.RouterStats(
        num_running=stats.num_running, num_waiting=stats.num_waiting,
        num_kv_blocks_total=stats.num_kv_blocks_total, num_kv_blocks_used=stats.num_kv_blocks_used,
        num_preemptions=stats.num_preemptions, num_prompt_tokens=stats.num_prompt_tokens,
        num_generation_tokens=stats.num_generation_tokens, topology=stats.topology,
        is_frozen=stats.is_frozen, extra=stats.extra, stalled=stats.stalled,
        num_kv_blocks_used_per_dp_rank=stats.num_kv_blocks_used_per_dp_rank,
        window=window_to_pb(stats.window),
        worker_time=[router_pb2.WorkerTime(rank=w.rank, forward_seconds=w.forward_seconds,
                                           head_seconds=w.head_seconds, steps=w.steps) for w in stats.worker_time],
        block_size=stats.block_size, max_model_len=stats.max_model_len,
    )


def stats_from_pb(pb: router_pb2.RouterStats) -> EngineStats:
    """RouterStats → EngineStats (the controller's view of the router)."""
    return EngineStats(
        num_running=pb.num_running, num_waiting=pb.num_waiting,
        num_kv_blocks_total=pb.num_kv_blocks_total, num_kv_blocks_used=pb.num_kv_blocks_used,
        num_preemptions=pb.num_preemptions, num_prompt_tokens=pb.num_prompt_tokens,
        num_generation_tokens=pb.num_generation_tokens, topology=pb.topology,
        is_frozen=pb.is_frozen, extra=dict(pb.extra), stalled=pb.stalled,
        num_kv_blocks_used_per_dp_rank=tuple(pb.num_kv_blocks_used_per_dp_rank),
        window=window_from_pb(pb.window),
        worker_time=tuple(WorkerTime(w.rank, w.forward_seconds, w.head_seconds, w.steps) for w in pb.worker_time),
        block_size=pb.block_size, max_model_len=pb.max_model_len,
    )


def window_to_pb(window: LoadSnapshot) -> router_pb2.LoadWindow:
    return router_pb2.LoadWindow(
        window_seconds=window.window_s, arrival_rate=window.arrival_rate,
        mean_prompt_tokens=window.mean_prompt_tokens, mean_output_tokens=window.mean_output_tokens,
        ttft_p50_seconds=window.ttft_p50_s, ttft_p99_seconds=window.ttft_p99_s,
        tpot_mean_seconds=window.tpot_mean_s, tpot_p99_seconds=window.tpot_p99_s, num_finished=window.num_finished,
        mean_context_tokens=window.mean_context_tokens, num_requests=window.num_requests,
        prompt_tokens_std=window.prompt_tokens_std, output_tokens_std=window.output_tokens_std,
        arrival_dispersion=window.arrival_dispersion,
    )


def window_from_pb(pb: router_pb2.LoadWindow) -> LoadSnapshot:
    return LoadSnapshot(
        window_s=pb.window_seconds, arrival_rate=pb.arrival_rate, mean_prompt_tokens=pb.mean_prompt_tokens,
        mean_output_tokens=pb.mean_output_tokens, ttft_p50_s=pb.ttft_p50_seconds, ttft_p99_s=pb.ttft_p99_seconds,
        tpot_mean_s=pb.tpot_mean_seconds, tpot_p99_s=pb.tpot_p99_seconds, num_finished=pb.num_finished,
        mean_context_tokens=pb.mean_context_tokens, num_requests=pb.num_requests,
        prompt_tokens_std=pb.prompt_tokens_std, output_tokens_std=pb.output_tokens_std,
        arrival_dispersion=pb.arrival_dispersion or 1.0,  # 0: a router that does not report it (or arrivals
        # perfectly even): read as random, which the policy treats the same
    )


def switch_report_from_pb(pb: router_pb2.SwitchReport) -> SwitchReport:
    """SwitchReport (wire) → SwitchReport (contract)."""
    return SwitchReport(
        operation_id=pb.operation_id, from_topology=pb.from_topology, to_topology=pb.to_topology, state=pb.state,
        phase_seconds=dict(pb.phase_seconds), kv_bytes_moved=pb.kv_bytes_moved,
        kv_bytes_precopied=pb.kv_bytes_precopied,
        weight_bytes_loaded=pb.weight_bytes_loaded, num_requests_preempted=pb.num_requests_preempted,
    )


async def _maybe_await(value: object) -> object:
    """The value, awaited first when it is awaitable (the engine's methods may be either)."""
    return (await value) if inspect.isawaitable(value) else value


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Generate for clients; Freeze/Rebind/Resume/Stats for the controller. Errors map in ErrorInterceptor."""

    def __init__(self, engine: AdminEngine, token: str = "") -> None:
        self.engine = engine
        self.token = token  # the control-plane token: continuing a migrated request needs it

    async def Generate(self, request, context):  # noqa: N802 (gRPC naming)
        """Stream a request's deltas; a cancelled call closes the engine's stream, which frees the blocks."""
        tokenizer = self.engine.tokenizer
        # A long prompt is tokenized off the loop (a 4 MB message would stall every stream for seconds).
        is_text = request.prompt and not request.prompt_token_ids
        encoded = await encode_text(tokenizer, request.prompt) if is_text else None
        generation = request_from_pb(request, tokenizer, encoded)
        migrated = None
        if request.HasField("migrated"):
            if not is_authorized(context.invocation_metadata(), self.token):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "continuing a migrated request needs the "
                                                                     "control-plane token")
            migrated = (list(request.migrated.output_token_ids), request.migrated.num_computed_tokens)
        try:
            deltas = self.engine.generate(generation, migrated) if migrated else self.engine.generate(generation)
            async with contextlib.aclosing(deltas) as deltas:
                async for delta in deltas:
                    yield delta_to_pb(generation.request_id, delta)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no KV is reserved for {generation.request_id!r} here "
                                                           "(MigrateIn RESERVE first)")

    async def MigrateOut(self, request, context):  # noqa: N802
        """The source side of a live move to another instance: export, stop, commit or abort."""
        migrations = self.engine.migrations
        action, request_id = request.action, request.request_id
        try:
            if action == router_pb2.MigrateOutRequest.COMMIT:
                migrations.commit(request_id)
                return router_pb2.MigrateOutResponse()
            if action == router_pb2.MigrateOutRequest.ABORT:
                migrations.abort(request_id)
                return router_pb2.MigrateOutResponse()
            if action == router_pb2.MigrateOutRequest.STOP:
                timeout_s = request.timeout_seconds if request.timeout_seconds > 0 else DEFAULT_FREEZE_TIMEOUT_S
                state, source = await migrations.stop(request_id, timeout_s)
            else:
                state, source = await migrations.export(request_id)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no request {request_id!r} is running or moving here")
        except RouterFrozen as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except MigrationRefused as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except TimeoutError as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        return router_pb2.MigrateOutResponse(
            block_table=state.block_table, num_computed_tokens=state.num_computed_tokens,
            output_token_ids=state.output_token_ids, source=source, finished=state.finished,
            kv_epoch=state.kv_epoch, pool_epoch=state.pool_epoch)

    async def MigrateIn(self, request, context):  # noqa: N802
        """The target side of a live move from another instance: reserve, pull or release."""
        migrations = self.engine.migrations
        try:
            if request.action == router_pb2.MigrateInRequest.RELEASE:
                await migrations.release(request.request_id)
                return router_pb2.MigrateInResponse()
            if request.action == router_pb2.MigrateInRequest.PULL:
                if len(request.src_block_ids) != len(request.dst_block_ids):
                    raise ValueError("src_block_ids and dst_block_ids must have the same length")
                try:
                    pulled = await migrations.pull(request.request_id, request.source, request.src_block_ids,
                                                   request.dst_block_ids)
                except grpc.aio.AioRpcError as exc:  # a worker's refusal keeps its code (the mover reads it)
                    if exc.code() not in _WORKER_REFUSALS:
                        raise
                    await context.abort(exc.code(), f"worker: {exc.details()}")
                return router_pb2.MigrateInResponse(kv_bytes=pulled.kv_bytes, seconds=pulled.seconds)
            generation = request_from_pb(request.request, self.engine.tokenizer)
            return router_pb2.MigrateInResponse(block_ids=migrations.reserve(generation, request.num_tokens))
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no KV is reserved for {request.request_id!r} here")
        except RouterFrozen as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def Freeze(self, request, context):  # noqa: N802
        """Stop scheduling (under a lease when lease_seconds > 0); return once in-flight steps are done."""
        check_freeze(request)
        timeout_s = request.timeout_seconds if request.timeout_seconds > 0 else DEFAULT_FREEZE_TIMEOUT_S
        drained = await self.engine.freeze(timeout_s, request.lease_seconds)
        return router_pb2.FreezeResponse(stats=stats_to_pb(self.engine.stats()), drain_seconds=drained)

    async def Rebind(self, request, context):  # noqa: N802
        """Take a new KV capacity (and workers, and drop the KV they lost); only while frozen."""
        check_rebind(request)
        if not self.engine.stats().is_frozen:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "Rebind needs a frozen router: call Freeze first")
        try:
            maps = await _maybe_await(self.engine.rebind(request.num_kv_blocks, tuple(request.worker_addresses) or None,
                                                         request.drop_kv, request.dp_size,
                                                         list(request.worker_infos) or None,
                                                         request.precopy_operation_id))
        except WorkerUnreachable as exc:  # the old streams stay in place
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        if request.resume:
            await self._resume(request)
        stats = self.engine.stats()
        if maps is not None:  # pools renumbered: the maps say which blocks move where
            return router_pb2.RebindResponse(stats=stats_to_pb(stats), block_maps=block_maps_to_pb(maps))
        # With several pools an id names a block of one pool: only block maps can say what moves.
        several_pools = len(stats.num_kv_blocks_used_per_dp_rank) > 1
        moving = [] if several_pools else self.engine.kv_to_move(request.precopy_operation_id)
        return router_pb2.RebindResponse(stats=stats_to_pb(stats), used_block_ids=moving)

    async def PreCopyBlocks(self, request, context):  # noqa: N802
        """A KV pre-copy round while serving: the full blocks not handed out before in this operation."""
        if not request.operation_id:
            raise ValueError("PreCopyBlocks needs an operation_id")
        found = self.engine.precopy_blocks(request.operation_id, request.num_kv_blocks, request.dp_size or 1)
        return router_pb2.PreCopyBlocksResponse(block_maps=block_maps_to_pb(found.block_maps),
                                                warm_block_maps=block_maps_to_pb(found.warm_block_maps),
                                                num_precopied=found.num_copied, num_used=found.num_used)

    async def PlanRebind(self, request, context):  # noqa: N802
        """Where the running requests' KV would go in a target, changing nothing (a switch's Plan)."""
        placements = self.engine.plan_rebind(request.num_kv_blocks, request.dp_size or 1)
        return router_pb2.PlanRebindResponse(placements=[
            router_pb2.RequestPlacement(request_id=rid, src_pool=src, dst_pool=dst, num_blocks=n)
            for rid, src, dst, n in placements])

    async def Resume(self, request, context):  # noqa: N802
        """Schedule again; a switch report that comes with it is counted first (it shows on the next scrape)."""
        await self._resume(request)
        return router_pb2.ResumeResponse(stats=stats_to_pb(self.engine.stats()))

    async def _resume(self, request) -> None:
        """Resume, or Rebind with resume: count the switch report first, if any."""
        if request.HasField("switch"):
            self.engine.record_switch(switch_report_from_pb(request.switch))
        await _maybe_await(self.engine.resume())

    async def Stats(self, request, context):  # noqa: N802
        """A snapshot of the engine."""
        return stats_to_pb(self.engine.stats())

    async def ExpertStatus(self, request, context):  # noqa: N802
        """MoE: per-layer expert maps, rank loads and balancedness (expert_parallel false otherwise)."""
        experts = getattr(self.engine, "experts", None)
        if experts is None:
            return router_pb2.ExpertStatusResponse()
        try:
            return await experts.status()
        except ExpertBalanceAborted as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def RebalanceExperts(self, request, context):  # noqa: N802
        """MoE: EPLB now; the new map is live when this returns."""
        experts = getattr(self.engine, "experts", None)
        if experts is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this router has no EPLB")
        try:
            return await experts.rebalance()
        except ExpertBalanceError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ExpertBalanceAborted as exc:
            await context.abort(grpc.StatusCode.ABORTED, str(exc))


async def start_router_grpc(engine: AdminEngine, host: str, port: int,
                            token: str | None) -> tuple[grpc.aio.Server, int]:
    """Start the Router service on host:port (0: any free port); returns the server and the bound port.
    Without a token the admin RPCs are unreachable (they need a token nobody holds)."""
    if not token:
        log.warning("router.grpc_admin_disabled", reason="no control-plane token")
        token = generate_token()
    server = grpc.aio.server(interceptors=[TokenAuthInterceptor(token, protect_methods(*ADMIN_METHODS)),
                                           ErrorInterceptor()])
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(engine, token), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind the router gRPC server to {host}:{port}")
    await server.start()
    return server, bound
