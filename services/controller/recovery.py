"""Recovery: re-forming the workers' world after one is lost, and adding a replacement.

A lost worker (kill -9, a crash, a hang) breaks the torch.distributed world of every other member: their
collectives fail and the router stalls on its next step. The controller notices (missed heartbeats, or the router
reporting a stall) and runs a "recover" operation:

    QUIESCING           freeze the router (under a lease) — its in-flight steps have failed or finish
    PREPARING_WORKERS   probe every member; the ones that answer are the survivors. They leave the broken world
                        and join a new generation, renumbered 0..n-1 (Regroup). Target: the live layout if it still
                        fits n workers (a standby steps in), else the best one that does (degraded_topology:
                        host-aware, the members ordered host by host, a stage's group inside a host first).
    APPLYING_TOPOLOGY   the KV of the running requests survives when every (layer, KV head) slice is still held by
    MIGRATING           a survivor (replicas, or a lost standby): it migrates as in a switch. Otherwise the router
                        drops it (drop_kv: those requests re-prefill their prompt and tokens so far) and the
                        workers start the target with empty caches.
    REBINDING           the router streams to the survivors and resumes. The stack reports DEGRADED until a
                        replacement has joined.

A failure during the recovery (another worker lost) starts the next attempt from the probe; each attempt uses a new
generation. AddWorker brings a worker started in join mode into the world the same way (Regroup with one more
member, then the live layout again, with its KV kept in place) and optionally switches into a larger layout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import grpc
import structlog

from services.controller.operation_progress import Progress
from services.controller.status import OperationState, OperationStatus
from services.controller.transaction import (
    OperationBusy,
    Reconfigurer,
    SwitchTarget,
    apply_workers,
    prepare_workers,
)
from services.rpc.errors import describe_error
from services.rpc.reconfig.v1 import router_pb2, worker_pb2
from services.runtime.host import address_host
from services.topology import (
    LOST,
    Topology,
    TopologyError,
    degraded_topology,
    host_major_order,
    lost_kv,
    place,
    validate,
)

log = structlog.get_logger(__name__)
MAX_ATTEMPTS = 3          # a recovery retries this often when members keep failing under it


def _host_major(addresses: list[str]) -> list[str]:
    """The new world's members, host by host (a stage's group then stays inside a host where it can)."""
    return [addresses[i] for i in host_major_order([address_host(a) for a in addresses])]


class RecoveryFailed(RuntimeError):
    """No attempt re-formed a working world (the router was resumed: its requests fail after its timeout)."""


class Recoverer:
    """Runs recover and add-worker operations; shares the one-operation-at-a-time rule with the Reconfigurer."""

    def __init__(self, reconfigurer: Reconfigurer) -> None:
        self.reconfigurer = reconfigurer
        self.state = reconfigurer.state  # its probe (GetInfo within rpc_timeout_s) tells a member is lost

    # ---- the watch loop ----------------------------------------------------------------------------------------
    def needs_recovery(self) -> str:
        """Why the world must be re-formed now ("" when it need not): members that missed their heartbeats, or
        a router that cannot run steps."""
        lost = self.state.lost_members()
        if lost:
            return f"worker {', '.join(lost)} missed {self.state.config.heartbeat_misses} heartbeats"
        router = self.state.status.router
        if router is not None and router.stalled:
            return f"the router stalled: {router.stalled}"
        return ""

    async def watch(self) -> None:
        """Recover whenever needs_recovery() says so (checked after every refresh), until cancelled."""
        version = -1
        while True:
            await self.state.wait_for_change(version, self.state.config.refresh_interval_s)
            version = self.state.version
            reason = self.needs_recovery()
            if not reason or self.reconfigurer.running is not None:
                continue
            try:
                await self.recover(reason)
            except OperationBusy:
                continue
            except Exception:  # recorded in the operation; the next round tries again if still needed
                log.exception("controller.recovery_failed")
            await self.state.refresh()

    # ---- operations --------------------------------------------------------------------------------------------
    async def recover(self, reason: str, operation_id: str = "") -> OperationStatus:
        """Re-form the world from the members that answer and resume serving on them."""
        return await self._operation("recover", operation_id, reason, None)

    async def add_worker(self, address: str, topology: str = "", operation_id: str = "") -> OperationStatus:
        """Regroup a joining worker in as the newest member (a standby), then, with `topology`, switch into it."""
        target = None
        if topology:  # refuse a bad target before touching anything
            target = Topology.parse(topology)
            validate(target, self.reconfigurer.spec.shape, len(self.state.worker_addresses) + 1)
        if address in self.state.worker_addresses:
            raise ValueError(f"{address} is already a member (rank {self.state.worker_addresses.index(address)})")
        info = await self.state.probe(address)
        if isinstance(info, str):
            raise ValueError(f"{address} does not answer: {info}")
        if info.state != "JOINING":
            raise ValueError(f"{address} is not a joining worker (it is {info.state or 'unknown'}): start it in "
                             "join mode")
        status = await self._operation("add-worker", operation_id, f"add {address}", address)
        if status.state is not OperationState.SUCCEEDED or target is None:
            return status
        return await self.reconfigurer.reconfigure(str(target), f"{status.operation_id}-switch")

    async def _operation(self, kind: str, operation_id: str, reason: str, joining: str | None) -> OperationStatus:
        reconfigurer = self.reconfigurer
        operation_id = operation_id or uuid.uuid4().hex[:12]
        reconfigurer.claim(operation_id)
        status = OperationStatus(operation_id, kind, OperationState.RUNNING, time.time(),
                                 from_topology=str(self.state.topology), to_topology=str(self.state.topology))
        progress = Progress(self.state, status)
        log.warning("controller.recovery_start", operation_id=operation_id, kind=kind, reason=reason)
        lease = reconfigurer.hold_lease()
        resumed = False
        try:
            progress.enter("QUIESCING")
            await reconfigurer.freeze(reconfigurer.rpc_timeout_s)
            error = ""
            for attempt in range(1, MAX_ATTEMPTS + 1):
                try:
                    await self._attempt(progress, joining)
                    resumed = True
                    log.warning("controller.recovered", operation_id=operation_id, kind=kind, attempt=attempt,
                                topology=str(self.state.topology), members=self.state.worker_addresses,
                                lost=list(progress.status.lost_workers), kv_dropped=progress.status.kv_dropped)
                    return progress.finish(OperationState.SUCCEEDED)
                except (grpc.aio.AioRpcError, TopologyError, ValueError, RecoveryFailed) as exc:
                    error = describe_error(exc)
                    log.warning("controller.recovery_attempt_failed", operation_id=operation_id, attempt=attempt,
                                error=error)
            raise RecoveryFailed(f"{MAX_ATTEMPTS} attempts failed; the last: {error}")
        except Exception as exc:
            return progress.finish(OperationState.FAILED, describe_error(exc))
        finally:
            if not resumed:  # never leave the router frozen: it fails its requests after its own timeout
                try:
                    await reconfigurer.resume(progress.report(OperationState.FAILED))
                except grpc.aio.AioRpcError as exc:
                    log.error("controller.resume_failed", error=describe_error(exc))
            await lease.stop()
            reconfigurer.running = None

    async def _attempt(self, progress: Progress, joining: str | None) -> None:
        reconfigurer, state, meta = self.reconfigurer, self.state, self.reconfigurer.metadata
        timeout = reconfigurer.rpc_timeout_s
        progress.enter("PREPARING_WORKERS")
        members = list(state.worker_addresses)
        infos = await asyncio.gather(*(state.probe(a) for a in members))
        survivors = [a for a, info in zip(members, infos, strict=True) if not isinstance(info, str)]
        lost = [a for a in members if a not in survivors]
        if not survivors:
            raise RecoveryFailed("no member answers")
        # A joiner comes in last (a standby: the live layout keeps its KV in place); a recovery renumbers host by host.
        world = survivors + [joining] if joining else _host_major(survivors)
        current, partition = state.topology, state.layer_partition
        hosts = [address_host(a) for a in world]
        target = SwitchTarget(degraded_topology(current, reconfigurer.spec.shape, len(world), hosts=hosts),
                              partition if current.num_workers <= len(world) else None)
        generation = max([state.generation, *(i.generation for i in infos if not isinstance(i, str))]) + 1
        stubs = [state.stub_for(a) for a in world]
        regrouped = await asyncio.gather(*(
            stub.Regroup(worker_pb2.RegroupRequest(
                generation=generation, rank=rank, world_size=len(world), topology=str(current),
                layer_partition=partition or (), operation_id=progress.status.operation_id),
                timeout=timeout, metadata=meta)
            for rank, stub in enumerate(stubs)), return_exceptions=True)
        state.generation = generation  # tried: the next attempt must not reuse its store prefix
        failed = [f"{a}: {describe_error(r)}" for a, r in zip(world, regrouped, strict=True)
                  if isinstance(r, BaseException)]
        if failed:
            raise RecoveryFailed(f"regroup to generation {generation} failed on {'; '.join(failed)}")
        # Which new rank holds each active index of the live layout (LOST: that worker is gone).
        holder = {r.previous_rank: rank for rank, r in enumerate(regrouped) if r.previous_rank >= 0}
        old_ranks = [holder.get(index, LOST) for index in range(current.num_workers)]
        missing = lost_kv(place(current, reconfigurer.spec.shape, partition), old_ranks)
        drop_kv = bool(missing) or not all(r.kv_intact for r in regrouped)
        progress.status = dataclasses.replace(progress.status, to_topology=str(target.topology),
                                              lost_workers=tuple(lost), kv_dropped=drop_kv)
        prepared, capacity = await prepare_workers(stubs, target, timeout, meta)
        frozen = await reconfigurer.router.Stats(router_pb2.StatsRequest(), timeout=timeout, metadata=meta)
        rebound = await reconfigurer.router.Rebind(router_pb2.RebindRequest(num_kv_blocks=capacity, drop_kv=drop_kv),
                                                   timeout=timeout, metadata=meta)
        progress.status = dataclasses.replace(
            progress.status, num_requests_preempted=rebound.stats.num_preemptions - frozen.num_preemptions)
        progress.enter("APPLYING_TOPOLOGY")
        progress.enter("MIGRATING")
        results = await apply_workers(stubs, target, prepared, capacity, rebound.used_block_ids,
                                      progress.status.operation_id, timeout, metadata=meta, old_ranks=old_ranks,
                                      drop_kv=drop_kv)
        progress.status = dataclasses.replace(progress.status,
                                              kv_bytes_moved=sum(r.kv_bytes_received for r in results),
                                              weight_bytes_loaded=sum(r.weight_bytes_loaded for r in results))
        await state.set_members(world, generation, lost)
        state.set_topology(target.topology, target.layer_partition)
        progress.enter("REBINDING", split=("MIGRATING", "APPLYING_TOPOLOGY", max(r.apply_seconds for r in results)))
        await reconfigurer.rebind_and_resume(capacity, progress.report(OperationState.SUCCEEDED))
