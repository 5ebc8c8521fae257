"""The Reconfigure transaction (ReMP): QUIESCING → PREPARING_WORKERS → APPLYING_TOPOLOGY → MIGRATING → REBINDING,
after STAGING and PRECOPY while serving (strategy "staged": the freeze then only copies the KV delta and swaps).
The freeze's wait starts as DRAINING (the steps in flight still deliver tokens) until a request first waits for it.

The controller is the only writer of the live layout. One operation runs at a time; operations are idempotent by
id. A failure before the workers switch (freeze, prepare, capacity rebind) resumes the old layout untouched.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
import uuid

import grpc
import structlog

from services.contracts.phases import DEFAULT_STAGING_DUTY, DRAINING_PHASE, PRECOPY_PHASE, STAGING_PHASE
from services.controller.operation_progress import Progress
from services.controller.staging import (
    Precopy,
    SwitchTarget,
    peer_pools,
    planned_reloads,
    precopy_kv,
    precopy_refusal,
    prepare_workers,
    stage_workers,
    staged_pool_bytes,
    staging_needs,
    staging_verdict,
)
from services.controller.status import OperationState, OperationStatus
from services.model.spec import ModelSpec
from services.rpc.auth import auth_metadata
from services.rpc.errors import describe_error
from services.rpc.reconfig.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.topology import Topology, TopologyError, validate

log = structlog.get_logger(__name__)
# In order; STAGING and PRECOPY run while the router serves (strategy "staged"), the others inside the freeze.
# The freeze's wait is DRAINING until a request first waits for it (the router says when; serving, no downtime), then
# QUIESCING until the last step in flight is back.
FREEZE_LEASE_S = 15.0  # the router waits this long for a renewal before it stops trusting a frozen operation


class OperationBusy(RuntimeError):
    """Another operation is running (FAILED_PRECONDITION)."""


class Reconfigurer:
    """Runs Reconfigure transactions against the workers and the router."""

    def __init__(self, state, spec: ModelSpec, worker_stubs: list[worker_pb2_grpc.WorkerStub] | None,
                 router_stub: router_pb2_grpc.RouterStub | None, token: str, rpc_timeout_s: float = 60.0,
                 default_deadline_s: float = 300.0, freeze_lease_s: float = FREEZE_LEASE_S) -> None:
        self.state = state  # ControllerState: the live topology, the members and the published status
        self.spec = spec
        self._workers = worker_stubs  # None: the state's members (a recovery changes them)
        self.router = router_stub
        self.freeze_lease_s = freeze_lease_s
        self.metadata = auth_metadata(token)
        self.rpc_timeout_s = rpc_timeout_s
        self.default_deadline_s = default_deadline_s
        self.operations: dict[str, asyncio.Future[OperationStatus]] = {}
        self.running: str | None = None
        self._lease: _Lease | None = None
        # Build the target's shards while serving before each switch (strategy "staged", the default); False: every
        # switch runs in place, all of it inside the freeze.
        self.staging = True
        self.staging_budget_bytes: int | None = None  # staging only if every worker's new slices fit (None: any)
        # After staging, copy the KV of running requests in rounds while serving (the freeze copies the delta).
        self.kv_precopy = True
        # The share of a worker's stage thread that staging and the pre-copy may use (the rest it rests); 1: as fast
        # as nice 19 lets it.
        self.staging_duty = DEFAULT_STAGING_DUTY

    @property
    def workers(self) -> list[worker_pb2_grpc.WorkerStub]:
        """The members of the world, by rank."""
        return self._workers if self._workers is not None else self.state.worker_stubs

    def claim(self, operation_id: str) -> None:
        """Become the running operation (OperationBusy if another one is)."""
        if self.running is not None:
            raise OperationBusy(f"operation {self.running!r} is running; retry when it has ended")
        self.running = operation_id

    async def freeze(self, timeout: float) -> router_pb2.FreezeResponse:
        """Freeze the router under a lease that `renew_lease` keeps alive while the operation runs: if this
        controller dies mid-operation, the router stops waiting for it once the lease runs out."""
        return await self.router.Freeze(router_pb2.FreezeRequest(lease_seconds=self.freeze_lease_s),
                                        timeout=timeout, metadata=self.metadata)

    def hold_lease(self) -> _Lease:
        """Renew the freeze's lease in the background until the operation resumes the router."""
        self._lease = _Lease(self)
        return self._lease

    async def resume(self, report: router_pb2.SwitchReport) -> None:
        """Resume the router; the lease stops first, so that no renewal can re-freeze it after this."""
        if self._lease is not None:
            await self._lease.stop()
        await self.router.Resume(router_pb2.ResumeRequest(switch=report), timeout=self.rpc_timeout_s,
                                 metadata=self.metadata)
        self.state.router_resumed()

    def target(self, topology: str, layer_partition=()) -> SwitchTarget:
        """Parse and validate against the model and the worker count (TopologyError says why not)."""
        target = SwitchTarget(Topology.parse(topology), tuple(layer_partition) or None)
        validate(target.topology, self.spec.shape, len(self.workers), target.layer_partition)
        return target

    async def reconfigure(self, topology: str, operation_id: str = "", deadline_s: float = 0.0,
                          strategy: str = "", layer_partition=()) -> OperationStatus:
        """Run (or join, for a repeated operation_id) a switch; returns the operation when it has ended."""
        if strategy not in ("", "staged", "in-place"):
            raise ValueError(f"strategy {strategy!r} is not supported (supported: staged, the default: the target's "
                             "shards are built while serving; in-place: everything inside the freeze)")
        check_deadline(deadline_s)
        if operation_id and operation_id in self.operations:
            return await asyncio.shield(self.operations[operation_id])  # idempotent retry
        target = self.target(topology, layer_partition)
        if self.running is not None:
            raise OperationBusy(f"operation {self.running!r} is running; retry when it has ended")
        operation_id = operation_id or uuid.uuid4().hex[:12]
        current = self.state.topology
        status = OperationStatus(operation_id, "reconfigure", OperationState.RUNNING, time.time(),
                                 from_topology=str(current), to_topology=str(target.topology))
        if target.topology == current and target.layer_partition == self.state.layer_partition:
            done = dataclasses.replace(status, state=OperationState.SUCCEEDED, ended_at=time.time())
            self.state.record_operation(done)
            self.operations[operation_id] = _done(done)
            return done
        self.claim(operation_id)
        staged = strategy != "in-place" and self.staging
        status = dataclasses.replace(status, staging="staged" if staged else "in-place")
        future = asyncio.ensure_future(self._run(status, target, deadline_s or self.default_deadline_s, staged))
        self.operations[operation_id] = future
        try:
            return await asyncio.shield(future)
        finally:
            if future.done():
                self.running = None

    async def _run(self, status: OperationStatus, target: SwitchTarget, deadline_s: float,
                   staged: bool = False) -> OperationStatus:
        progress = Progress(self.state, status, time.monotonic() + deadline_s)
        lease = None
        try:
            if staged and (why_not := await self.staging_refusal(target, progress.timeout(self))):
                staged = False  # it would not fit beside the live shards: build them in the freeze, as in place
                progress.status = dataclasses.replace(progress.status, staging=f"in-place: {why_not}")
                log.info("controller.staging_skipped", operation_id=status.operation_id, reason=why_not)
            precopy = None
            if staged:  # the router serves on: no freeze, so no lease yet
                replies = await self._stage(progress, target)
                if self.kv_precopy:
                    precopy = await self._precopy(progress, target, [r.staged for r in replies])
            lease = self.hold_lease()
            return await self._transaction(progress, target, precopy)
        except Exception as exc:  # the deadline, an RPC error, a worker failure
            error = describe_error(exc)
            log.error("controller.reconfigure_failed", operation_id=status.operation_id, error=error)
            state = OperationState.ROLLED_BACK if progress.rolled_back else OperationState.FAILED
            return progress.finish(state, error)
        finally:
            if lease is not None:
                await lease.stop()
            self.running = None

    async def staging_refusal(self, target: SwitchTarget, timeout: float) -> str:
        """Why this switch may not stage under the staging budget ("" when it may): a worker would hold the
        target's new slices beside its live shard until the freeze."""
        if self.staging_budget_bytes is None:
            return ""
        prepared, capacity = await prepare_workers(self.workers, target, timeout, self.metadata)
        reloads = planned_reloads(self.spec, self.state.topology, self.state.layer_partition, target.topology,
                                  target.layer_partition)
        dtype_bytes = prepared[0].kv_dtype_bytes
        pools = staged_pool_bytes(self.spec, target, capacity, prepared[0].block_size,
                                  dtype_bytes) if self.kv_precopy else {}
        return staging_verdict(staging_needs(reloads, target.topology, dtype_bytes, pools), self.staging_budget_bytes)

    async def _stage(self, progress: Progress, target: SwitchTarget) -> list[worker_pb2.StageSwitchResponse]:
        """STAGING, while the router serves: every worker builds its shard of the target beside its steps. A
        failure or the deadline here changes nothing anywhere (a later ApplySwitch would build the shard itself)."""
        progress.enter(STAGING_PHASE)
        try:
            replies = await stage_workers(self.workers, target.topology, target.layer_partition,
                                          progress.status.operation_id, progress.timeout(self), self.metadata,
                                          self.staging_duty)
        except BaseException:
            progress.rolled_back = True  # nothing was frozen and nothing moved: the old layout serves as it did
            await self._unstage()
            raise
        log.info("controller.staged", operation_id=progress.status.operation_id, topology=str(target.topology),
                 workers=sum(r.staged for r in replies), seconds=round(max((r.seconds for r in replies), default=0), 4),
                 weight_bytes_loaded=sum(r.weight_bytes_loaded for r in replies))
        return replies

    async def _precopy(self, progress: Progress, target: SwitchTarget, staged: list[bool]) -> Precopy | None:
        """PRECOPY, while the router serves: the KV of running requests into the staged pools, in rounds. None when
        this switch cannot (the status says why): the freeze moves all the KV. A failure or the deadline here
        changes nothing live: the staged shards and pools are dropped."""
        why_not = precopy_refusal(target.topology, staged)
        if not why_not:
            progress.enter(PRECOPY_PHASE)
            try:
                result = await precopy_kv(self.workers, self.router, target, progress.status.operation_id,
                                          lambda: progress.timeout(self), self.metadata, self.staging_duty)
            except BaseException:
                progress.rolled_back = True
                await self._unstage()
                raise
            if isinstance(result, Precopy):
                progress.status = dataclasses.replace(progress.status, precopy=f"{result.rounds} rounds",
                                                      kv_bytes_precopied=result.bytes_copied)
                return result
            why_not = result
        progress.status = dataclasses.replace(progress.status, precopy=f"off: {why_not}")
        log.info("controller.precopy_skipped", operation_id=progress.status.operation_id, reason=why_not)
        return None

    async def _unstage(self) -> None:
        """Best effort, after a failure while serving: every worker drops what it staged (shards and KV pools)."""
        request = worker_pb2.StageSwitchRequest()  # no topology: drop
        await asyncio.gather(*(w.StageSwitch(request, timeout=self.rpc_timeout_s, metadata=self.metadata)
                               for w in self.workers), return_exceptions=True)

    async def _transaction(self, progress: Progress, target: SwitchTarget,
                           precopy: Precopy | None = None) -> OperationStatus:
        """Until APPLYING_TOPOLOGY the operation's deadline bounds every call (and expiring means: restore and
        resume); from there on it is past its commit point and runs to the end (each RPC has its own timeout)."""
        meta = self.metadata
        progress.enter(DRAINING_PHASE)
        try:
            frozen = await self.freeze(progress.timeout(self))
        except BaseException:  # a Freeze that timed out may still have frozen the router
            progress.rolled_back = True
            await self.resume(progress.report(OperationState.ROLLED_BACK))
            raise
        old_capacity, old_dp = frozen.stats.num_kv_blocks_total, self.state.topology.num_kv_pools
        try:
            # The steps in flight ran on until the first came back (DRAINING, serving); the rest waited (QUIESCING).
            progress.enter("PREPARING_WORKERS", keep=(DRAINING_PHASE, frozen.drain_seconds, "QUIESCING"))
            if precopy is None:
                prepared, capacity = await prepare_workers(self.workers, target, progress.timeout(self), meta)
            else:  # asked before the pre-copy: the live pools have not changed since
                prepared, capacity = precopy.prepared, precopy.capacity
            before = frozen.stats.num_preemptions
            # To or from an EP layout the router gives every running request a KV pool of the target (block maps);
            # after a pre-copy it lists only the blocks written since (the delta).
            rebound = await self.router.Rebind(
                router_pb2.RebindRequest(num_kv_blocks=capacity, dp_size=target.topology.num_kv_pools,
                                         precopy_operation_id=progress.status.operation_id if precopy else ""),
                timeout=progress.timeout(self), metadata=meta)
            progress.timeout(self)  # the last chance to give up cleanly
            progress.status = dataclasses.replace(
                progress.status, num_requests_preempted=rebound.stats.num_preemptions - before)
        except BaseException:
            progress.rolled_back = True  # nothing moved yet: restore the capacity, resume the old layout
            await self._restore(old_capacity, old_dp, progress.report(OperationState.ROLLED_BACK))
            raise
        timeout = self.rpc_timeout_s
        log.info("controller.kv_to_move", operation_id=progress.status.operation_id, precopied=precopy is not None,
                 blocks=len(rebound.used_block_ids), used=rebound.stats.num_kv_blocks_used)
        progress.enter("APPLYING_TOPOLOGY")
        # One RPC per worker runs both phases (the groups are selected, then KV moves layer by layer).
        switching = asyncio.ensure_future(apply_workers(self.workers, target, prepared, capacity,
                                                        rebound.used_block_ids, progress.status.operation_id,
                                                        timeout, metadata=meta, block_maps=rebound.block_maps,
                                                        precopied=precopy is not None))
        progress.enter("MIGRATING")
        try:
            results = await switching
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.ABORTED:  # every worker moved its KV back: the old layout is whole
                progress.enter("ROLLING_BACK")
                progress.rolled_back = True
                await self._restore(old_capacity, old_dp, progress.report(OperationState.ROLLED_BACK))
            else:  # a worker is gone or hung: resume anyway, so that no request waits forever (they fail fast)
                await self._restore(old_capacity, old_dp, progress.report(OperationState.FAILED))
            raise
        progress.status = dataclasses.replace(
            progress.status,
            kv_bytes_moved=sum(r.kv_bytes_received for r in results),
            weight_bytes_loaded=sum(r.weight_bytes_loaded for r in results),
            weight_bytes_resharded=sum(r.weight_bytes_resharded for r in results),
            built_groups=any(r.built_groups for r in results),
        )
        self.state.set_topology(target.topology, target.layer_partition)  # the workers hold the new layout now
        # Both phases ran in one RPC: the workers say how long selecting groups and allocating took.
        progress.enter("REBINDING", split=("MIGRATING", "APPLYING_TOPOLOGY", max(r.apply_seconds for r in results)))
        await self.rebind_and_resume(capacity, progress.report(OperationState.SUCCEEDED), [r.info for r in results])
        log.info("controller.reconfigured", operation_id=progress.status.operation_id,
                 topology=str(target.topology), phases=progress.status.phase_seconds)
        return progress.finish(OperationState.SUCCEEDED)

    async def rebind_and_resume(self, capacity: int, report: router_pb2.SwitchReport, infos=()) -> None:
        """After the commit point: point the router at the members' new layout and resume it, in one call (with
        `infos`, the members' ApplySwitch answers, it need not ask them). A failure here (a worker died just now)
        still resumes the router: its first step fails, it stalls, and the recovery takes over; nothing stays
        frozen."""
        if self._lease is not None:  # no renewal may re-freeze the router after it resumed
            await self._lease.stop()
        try:
            await self.router.Rebind(router_pb2.RebindRequest(num_kv_blocks=capacity,
                                                              worker_addresses=self.state.worker_addresses,
                                                              resume=True, switch=report, worker_infos=infos),
                                     timeout=self.rpc_timeout_s, metadata=self.metadata)
        except BaseException:
            await self.resume(report)
            raise
        self.state.router_resumed()

    async def _restore(self, old_capacity: int, old_dp: int, report: router_pb2.SwitchReport) -> None:
        """The old layout serves again: its capacity, and its KV pools with every request's old block ids."""
        with_timeout = dict(timeout=self.rpc_timeout_s, metadata=self.metadata)
        try:
            await self.router.Rebind(router_pb2.RebindRequest(num_kv_blocks=old_capacity, dp_size=old_dp),
                                     **with_timeout)
        finally:
            await self.resume(report)


class _Lease:
    """Keeps a frozen router's lease alive: re-freezes every third of it until stopped. Stopping waits for a
    renewal in flight, so none reaches the router after the Resume that follows."""

    def __init__(self, reconfigurer: Reconfigurer) -> None:
        self.reconfigurer = reconfigurer
        self.lock = asyncio.Lock()
        self.stopped = False
        self.task = asyncio.ensure_future(self._renew())

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.reconfigurer.freeze_lease_s / 3)
            async with self.lock:
                if self.stopped:
                    return
                try:
                    await self.reconfigurer.freeze(self.reconfigurer.rpc_timeout_s)
                except grpc.aio.AioRpcError as exc:
                    log.warning("controller.lease_renewal_failed", error=describe_error(exc))

    async def stop(self) -> None:
        async with self.lock:
            self.stopped = True
        self.task.cancel()


def check_deadline(deadline_s: float) -> None:
    """ValueError unless `deadline_s` is a finite number >= 0 (0: the controller's default)."""
    if not (math.isfinite(deadline_s) and deadline_s >= 0):
        raise ValueError(f"deadline_seconds must be a finite number >= 0 (0: the default), got {deadline_s}")


async def apply_workers(workers: list[worker_pb2_grpc.WorkerStub], target: SwitchTarget,
                        prepared: list[worker_pb2.PrepareSwitchResponse], capacity: int, used_block_ids,
                        operation_id: str, timeout: float, kv_channel: str = "",
                        metadata: tuple = (), old_ranks=(), drop_kv: bool = False, block_maps=(),
                        precopied: bool = False) -> list[worker_pb2.ApplySwitchResponse]:
    """APPLYING_TOPOLOGY + MIGRATING on every worker at once (the router must be frozen). After a regroup,
    `old_ranks` says which new rank holds each active index of the old layout (LOST: gone); with `drop_kv` the
    workers start the target with empty caches."""
    request = worker_pb2.ApplySwitchRequest(
        operation_id=operation_id, topology=str(target.topology), layer_partition=target.layer_partition or (),
        num_kv_blocks=capacity, used_block_ids=used_block_ids, kv_channel=kv_channel,
        peers=peer_pools(prepared),
        old_ranks=old_ranks, drop_kv=drop_kv, block_maps=block_maps, precopied=precopied,
    )
    results = await asyncio.gather(*(w.ApplySwitch(request, timeout=timeout, metadata=metadata) for w in workers),
                                   return_exceptions=True)  # every worker has finished (or rolled back) first
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:  # a worker that is gone outranks the ones that rolled back
        raise next((e for e in errors if not _is_aborted(e)), errors[0])
    return list(results)


def _is_aborted(error: BaseException) -> bool:
    return isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.ABORTED


def _done(status: OperationStatus) -> asyncio.Future[OperationStatus]:
    future = asyncio.get_running_loop().create_future()
    future.set_result(status)
    return future


def status_code_for(exc: BaseException) -> grpc.StatusCode:
    """Reconfigure's refusals as gRPC codes."""
    if isinstance(exc, (TopologyError, ValueError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, OperationBusy):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INTERNAL
