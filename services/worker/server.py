"""Thin gRPC servicer of a worker: converts at the edge and hands steps to the single model thread."""

from __future__ import annotations

import asyncio
import functools
import os
from concurrent.futures import ThreadPoolExecutor

import grpc
import structlog

from services.contracts.step import StepBatch, StepOutput
from services.contracts.step_rows import RowTable, UnknownRow
from services.rpc.auth import TokenAuthInterceptor, protect_all
from services.rpc.errors import ErrorInterceptor
from services.rpc.reconfig.v1 import worker_pb2, worker_pb2_grpc
from services.rpc.server import listen, new_server
from services.rpc.tls import TLSConfig
from services.worker.expert_balance import ExpertMapError
from services.worker.faults import FAULTS
from services.worker.kv_import import ImportRefused
from services.worker.model_runner import LaunchedStep, PendingTokenMissing
from services.worker.shard import WorkerShard
from services.worker.switch import SwitchFailed, apply_switch

log = structlog.get_logger(__name__)


def rss_bytes() -> int:
    """Resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Serves the step stream; model work runs on one dedicated thread, never on the event loop."""

    def __init__(self, shard: WorkerShard) -> None:
        self.shard = shard
        # One thread: steps run strictly in arrival order, so every worker issues collectives in the same order.
        self.model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        # EPLB's prepare: its collectives (the stage's CPU group) run beside the steps (the device group).
        self.eplb_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eplb")
        # A step's tokens reach the host, and become its output, here: the model thread launches the next step
        # meanwhile. One thread: outputs complete in launch order.
        self.readback_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="readback")
        # Staging builds the target's shard beside the steps (not on the model thread), at a low OS priority.
        self.stage_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage")
        self.stopped = asyncio.Event()
        self.rows = RowTable()  # the requests' rows of the delta form (a cache of the router's, by slot)

    @property
    def rank(self) -> int:
        """Rank in the current world (a regroup renumbers it)."""
        return self.shard.rank

    def _run_step(self, batch: StepBatch) -> LaunchedStep:
        """On the model thread: launch the step (its output may wait for the device: _finish_step)."""
        runner = self.shard.runner
        if runner is None:
            return LaunchedStep(StepOutput(batch.step_id, self.rank,
                                           error=f"worker {self.rank} is on standby: it holds no shard"))
        if self.shard.needs_apply:
            return LaunchedStep(StepOutput(batch.step_id, self.rank, error=f"worker {self.rank} was regrouped: its "
                                                                            "layout runs again after the next ApplySwitch"))
        try:
            if batch.commit_expert_map:
                self.shard.balancer.commit(batch.commit_expert_map)
            launched = runner.launch(batch, self.rank)
            self.shard.balancer.record()
            return launched
        except PendingTokenMissing as exc:  # refused before any collective: the world stands
            log.warning("worker.step_refused", step_id=batch.step_id, error=str(exc))
            return LaunchedStep(StepOutput(batch.step_id, self.rank, error=f"step {batch.step_id}: {exc}"))
        except Exception as exc:  # a failed step answers with an error; the stream stays open
            return LaunchedStep(self._failed(batch.step_id, exc))

    def _finish_step(self, launched: LaunchedStep) -> StepOutput:
        """On the readback thread: the step's output, once its tokens are on the host."""
        try:
            return launched.result()
        except Exception as exc:  # the device failed the step after its launch
            return self._failed(launched.output.step_id, exc)

    def _failed(self, step_id: int, exc: Exception) -> StepOutput:
        log.exception("worker.step_failed", step_id=step_id)
        self.shard.leave_world(exc)  # peers may be blocked on this step's collectives: let them fail now
        return StepOutput(step_id, self.rank, error=f"{type(exc).__name__}: {exc}")

    async def _step(self, batch: StepBatch) -> StepOutput:
        loop = asyncio.get_running_loop()
        launched = await loop.run_in_executor(self.model_thread, self._run_step, batch)
        if launched.tokens is None:  # nothing to wait for
            return launched.output
        return await loop.run_in_executor(self.readback_thread, self._finish_step, launched)

    def begin_step(self, request: worker_pb2.StepRequest) -> tuple[asyncio.Future[StepOutput], tuple | None]:
        """Queue a step on the model thread (steps run in the order they arrive); its output's future and, for a
        step in the delta form, the rows it ran (its result goes back packed over them: rows_result). Steps in the
        delta form are read into full steps here, in arrival order, over the rows this worker holds."""
        loop = asyncio.get_running_loop()
        try:
            batch = StepBatch(request.step_id, self.rows.steps(request), request.commit_expert_map)
        except UnknownRow as exc:  # refused before any collective: every rank reads the same rows
            log.warning("worker.step_refused", step_id=request.step_id, error=str(exc))
            refused = loop.create_future()
            refused.set_result(StepOutput(request.step_id, self.rank, error=str(exc)))
            return refused, None
        return asyncio.ensure_future(self._step(batch)), batch.sequences if request.HasField("rows") else None

    async def GetInfo(self, request, context):  # noqa: N802
        info = self.shard.info()  # cheap, and answers during a switch (which holds the model thread)
        info.rss_bytes = rss_bytes()
        return info

    async def PrepareSwitch(self, request, context):  # noqa: N802
        """What this worker would hold in a target layout; changes nothing."""
        try:
            return await self._on_model_thread(self._with_faults, "PrepareSwitch", request, self.shard.prepare_switch)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def StageSwitch(self, request, context):  # noqa: N802
        """Build the target layout's shard while steps go on (its own thread); changes nothing live."""
        return await self._beside_steps("StageSwitch", request, context, self.shard.staging.stage_switch,
                                        grpc.StatusCode.INVALID_ARGUMENT, "staging")

    async def PreCopyKV(self, request, context):  # noqa: N802
        """A KV pre-copy round into the staged pool while steps go on (the stage thread); reads the live pools."""
        return await self._beside_steps("PreCopyKV", request, context, self.shard.staging.precopy_kv,
                                        grpc.StatusCode.FAILED_PRECONDITION, "KV pre-copy")

    async def ImportKV(self, request, context):  # noqa: N802
        """Copy another instance's KV blocks into this worker's pool (live request migration), between steps."""
        try:
            return await self._on_model_thread(self._with_faults, "ImportKV", request, self.shard.import_kv)
        except ImportRefused as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def ExportKV(self, request, context):  # noqa: N802
        """Send KV slices to another host's worker (its ImportKV), on a thread of its own beside the steps."""
        try:
            return await asyncio.to_thread(self.shard.export_kv, request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RuntimeError as exc:  # the receiver's store or group could not be joined (gloo's DistError too)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{type(exc).__name__}: {exc}")

    async def _beside_steps(self, method: str, request, context, handler, refused: grpc.StatusCode, what: str):
        """Run `handler` on the stage thread (low priority, beside the model thread's steps); a ValueError is a
        refusal (`refused`), anything else INTERNAL."""
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self.stage_thread, self._with_faults, method, request, handler)
        except ValueError as exc:
            await context.abort(refused, str(exc))
        except Exception as exc:
            log.exception("worker.stage_thread_failed", method=method, rank=self.rank,
                          operation_id=request.operation_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"{what} failed on rank {self.rank}: {exc}")

    async def ApplySwitch(self, request, context):  # noqa: N802
        """Switch layout: groups, KV migration, shard reload. Runs on the model thread, between steps."""
        log.info("worker.switch_start", rank=self.rank, operation_id=request.operation_id, topology=request.topology)
        try:
            return await self._on_model_thread(self._with_faults, "ApplySwitch", request,
                                               functools.partial(apply_switch, self.shard))
        except SwitchFailed as exc:  # every worker is in the old layout again
            await context.abort(grpc.StatusCode.ABORTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:
            log.exception("worker.switch_failed", rank=self.rank, operation_id=request.operation_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"switch failed on rank {self.rank}: {exc}")

    async def Regroup(self, request, context):  # noqa: N802
        """Leave the world and join a new generation. On the model thread: no step or switch runs meanwhile."""
        log.info("worker.regroup_start", rank=self.rank, generation=request.generation, new_rank=request.rank,
                 world_size=request.world_size)
        try:
            return await self._on_model_thread(self._with_faults, "Regroup", request, self.shard.regroup)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # the rendezvous timed out (a member did not come): the controller tries again
            log.exception("worker.regroup_failed", generation=request.generation)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"regroup to generation {request.generation} failed "
                                                             f"on this worker: {exc}")

    async def GetExpertLoad(self, request, context):  # noqa: N802
        return self.shard.balancer.load(self.rank)

    async def PrepareExpertMap(self, request, context):  # noqa: N802
        """EPLB: agree on the stage's load and stage the new map, on the EPLB thread while steps go on."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.eplb_thread, self.shard.balancer.prepare,
                                                                    request.epoch, self.rank)
        except ExpertMapError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except Exception as exc:
            log.exception("worker.expert_map_prepare_failed", epoch=request.epoch)
            self.shard.balancer.abort(request.epoch)
            await context.abort(grpc.StatusCode.ABORTED, f"rank {self.rank} failed to stage the expert map of "
                                                         f"epoch {request.epoch}: {exc}")

    async def AbortExpertMap(self, request, context):  # noqa: N802
        self.shard.balancer.abort(request.epoch)
        return worker_pb2.AbortExpertMapResponse()

    def _with_faults(self, method: str, request, handler):
        FAULTS.check("rpc", method=method, rank=self.rank, topology=getattr(request, "topology", ""))
        return handler(request)

    async def _on_model_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.model_thread, fn, *args)

    async def Shutdown(self, request, context):  # noqa: N802
        log.info("worker.shutdown_requested", rank=self.rank)
        self.stopped.set()
        return worker_pb2.ShutdownResponse()


async def start_server(servicer: WorkerServicer, host: str, port: int, token: str | None = None,
                       tls: TLSConfig | None = None) -> tuple[grpc.aio.Server, int]:
    """Start the gRPC server (every RPC needs `token` when set; mutual TLS with `tls`); returns it and the bound
    port."""
    # ErrorInterceptor: undecodable request bytes are INVALID_ARGUMENT, an unexpected exception INTERNAL with its
    # message (gRPC's default for both is a bare UNKNOWN). Steps do not come this way: services.worker.step_server.
    interceptors = [*([TokenAuthInterceptor(token, protect_all)] if token else []), ErrorInterceptor()]
    server = new_server(interceptors, options=[("grpc.max_receive_message_length", 64 << 20),
                                               ("grpc.max_send_message_length", 64 << 20)])
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    bound = listen(server, host, port, "worker", tls)
    await server.start()
    return server, bound
