"""The router's gRPC service: a thin servicer over the engine; conversion to and from protobuf is services.router.wire's."""

from __future__ import annotations

import contextlib
import inspect
from typing import Protocol

import grpc
import structlog

from services.router.api.limits import encode_text
from services.router.contracts import EngineProtocol, SwitchReport
from services.router.driver import WorkerUnreachable
from services.router.expert_balance import ExpertBalanceAborted, ExpertBalanceError
from services.router.instance_moves import MoveRefused, RouterFrozen
from services.router.wire import (
    block_maps_to_pb,
    check_freeze,
    check_rebind,
    delta_to_pb,
    request_from_pb,
    stats_to_pb,
    switch_report_from_pb,
)
from services.rpc.auth import TokenAuthInterceptor, generate_token, is_authorized, protect_methods
from services.rpc.errors import ErrorInterceptor
from services.rpc.reconfig.v1 import router_pb2, router_pb2_grpc
from services.rpc.server import listen, new_server
from services.rpc.tls import TLSConfig

log = structlog.get_logger(__name__)

_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name  # "reconfig.v1.Router"
ADMIN_METHODS = tuple(f"/{_SERVICE}/{name}" for name in ("Freeze", "Rebind", "Resume", "Stats", "PreCopyBlocks",
                                                                   "ExpertStatus", "RebalanceExperts", "MigrateOut",
                                                                   "MigrateIn"))
DEFAULT_FREEZE_TIMEOUT_S = 60.0
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
        moves = self.engine.instance_moves
        action, request_id = request.action, request.request_id
        try:
            if action == router_pb2.MigrateOutRequest.COMMIT:
                moves.commit(request_id)
                return router_pb2.MigrateOutResponse()
            if action == router_pb2.MigrateOutRequest.ABORT:
                moves.abort(request_id)
                return router_pb2.MigrateOutResponse()
            if action == router_pb2.MigrateOutRequest.STOP:
                timeout_s = request.timeout_seconds if request.timeout_seconds > 0 else DEFAULT_FREEZE_TIMEOUT_S
                state, source = await moves.stop(request_id, timeout_s)
            else:
                state, source = await moves.export(request_id)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no request {request_id!r} is running or moving here")
        except RouterFrozen as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except MoveRefused as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except TimeoutError as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        return router_pb2.MigrateOutResponse(
            block_table=state.block_table, num_computed_tokens=state.num_computed_tokens,
            output_token_ids=state.output_token_ids, source=source, finished=state.finished,
            kv_epoch=state.kv_epoch, pool_epoch=state.pool_epoch)

    async def MigrateIn(self, request, context):  # noqa: N802
        """The target side of a live move from another instance: reserve, pull or release."""
        moves = self.engine.instance_moves
        try:
            if request.action == router_pb2.MigrateInRequest.RELEASE:
                await moves.release(request.request_id)
                return router_pb2.MigrateInResponse()
            if request.action == router_pb2.MigrateInRequest.PULL:
                if len(request.src_block_ids) != len(request.dst_block_ids):
                    raise ValueError("src_block_ids and dst_block_ids must have the same length")
                try:
                    pulled = await moves.pull(request.request_id, request.source, request.src_block_ids,
                                                   request.dst_block_ids)
                except grpc.aio.AioRpcError as exc:  # a worker's refusal keeps its code (the mover reads it)
                    if exc.code() not in _WORKER_REFUSALS:
                        raise
                    await context.abort(exc.code(), f"worker: {exc.details()}")
                return router_pb2.MigrateInResponse(kv_bytes=pulled.kv_bytes, seconds=pulled.seconds)
            generation = request_from_pb(request.request, self.engine.tokenizer)
            return router_pb2.MigrateInResponse(block_ids=moves.reserve(generation, request.num_tokens))
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


async def start_router_grpc(engine: AdminEngine, host: str, port: int, token: str | None,
                            tls: TLSConfig | None = None) -> tuple[grpc.aio.Server, int]:
    """Start the Router service on host:port (0: any free port); returns the server and the bound port.
    Without a token the admin RPCs are unreachable (they need a token nobody holds)."""
    if not token:
        log.warning("router.grpc_admin_disabled", reason="no control-plane token")
        token = generate_token()
    server = new_server([TokenAuthInterceptor(token, protect_methods(*ADMIN_METHODS)), ErrorInterceptor()])
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(engine, token), server)
    bound = listen(server, host, port, "router gRPC server", tls)
    await server.start()
    return server, bound
