"""ControllerState: the live topology and the worker table, refreshed from the workers and the router."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import time
from dataclasses import dataclass, replace

import grpc
import structlog

from services.contracts.phases import DEFAULT_STAGING_DUTY
from services.controller.status import (
    OperationState,
    OperationStatus,
    StackState,
    StackStatus,
    WorkerState,
    WorkerStatus,
)
from services.model.spec import ModelSpec
from services.router.contracts import EngineStats
from services.router.wire import stats_from_pb
from services.rpc.auth import auth_metadata
from services.rpc.errors import describe_error
from services.rpc.reconfig.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.rpc.tls import TLSConfig, aio_channel
from services.topology import Topology, candidate_topologies

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    """Where the controller listens, what it watches, and how often."""

    token: str                                 # control-plane token: clients must present it, the router wants it
    worker_addresses: tuple[str, ...]          # host:port of each worker, by rank
    topology: str                              # live topology at start, e.g. "tp2pp2"
    router_grpc_address: str | None = None     # None: no router to watch (requests are not reported)
    model: str = ""                            # served model name, for display
    host: str = "127.0.0.1"
    port: int = 50051                          # 0: any free port (reported through on_ready)
    refresh_interval_s: float = 1.0            # how often the table is refreshed (and WatchStatus at least sends)
    rpc_timeout_s: float = 2.0                 # deadline of each GetInfo / Stats call
    model_dir: str = ""                        # checkpoint directory: Reconfigure validates targets against it
    switch_rpc_timeout_s: float = 120.0        # deadline of each RPC of a Reconfigure transaction
    eplb_rpc_timeout_s: float = 300.0          # deadline of a forwarded RebalanceExperts (prepare + commit)
    state_file: str = ""                       # where the live layout and the last operation survive a restart
    heartbeat_misses: int = 2                  # refreshes a worker may miss in a row before it counts as lost
    staging_budget_mb: int | None = None       # a switch stages only if each worker's new slices fit (None: any)
    staging_duty: float = DEFAULT_STAGING_DUTY  # the share of a stage thread staging and the pre-copy may use
    autopilot: str = "off"                     # the autopilot's mode at start: off, advise or auto
    autopilot_interval_s: float = 1.0          # between its ticks
    autopilot_policy: str = ""                 # policy settings, "cooldown_s=5,min_dwell_s=30,..." ("": defaults)
    intents_file: str = ""                     # SLO intents (TOML/JSON) the autopilot follows; "": none
    profile_file: str = ""                     # the layout profile; "": cached per model and machine
    calibrate_at_start: bool = True            # advise/auto without a cached profile: measure one at start
    metrics_port: int | None = None            # the controller's /metrics (autopilot); None: not served, 0: any
    tls: TLSConfig | None = None               # mutual TLS on its server and its channels (None: plaintext)

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("the controller needs a control-plane token")
        if not self.worker_addresses:
            raise ValueError("the controller needs at least one worker address")
        Topology.parse(self.topology)  # TopologyError (a ValueError) on bad text
        if self.refresh_interval_s <= 0 or self.rpc_timeout_s <= 0:
            raise ValueError("refresh_interval_s and rpc_timeout_s must be positive")


class ControllerState:
    """Owns the live topology; refreshes the worker table (GetInfo) and the router's stats (Stats) on demand."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.topology = Topology.parse(config.topology)  # the controller is the only writer of the live layout
        self.layer_partition: tuple[int, ...] | None = None
        self.last_operation: OperationStatus | None = None
        # The world: members by rank (a recovery renumbers them), its generation, and who was lost since start.
        self.worker_addresses: list[str] = list(config.worker_addresses)
        self.full_size = len(config.worker_addresses)  # full strength: DEGRADED while fewer members
        self.generation = 0
        self.lost_workers: list[str] = []
        self.misses: dict[str, int] = {}  # heartbeats missed in a row, by member address
        self._worker_channels: dict[str, grpc.aio.Channel] = {}
        self._channels: list[grpc.aio.Channel] = []
        self._router_stub: router_pb2_grpc.RouterStub | None = None
        self._shape = ModelSpec.from_dir(config.model_dir).shape if config.model_dir else None
        self._status = StackStatus(topology=str(self.topology), state=StackState.STARTING, model=config.model,
                                   reason="waiting for the first refresh", router_address=self._router_address)
        self._version = 0
        self._changed = asyncio.Event()          # replaced on every change; watchers wait on the one they saw
        self._refresh: asyncio.Future[StackStatus] | None = None
        # Bumped when an operation resumes the router: a refresh begun before asked a router that may have been
        # stalled then, and must not publish that stall (the recovery would run again for it).
        self._epoch = 0
        self._refresh_epoch = 0
        self._stale_refreshes: set[asyncio.Future] = set()

    @property
    def _router_address(self) -> str:
        return self.config.router_grpc_address or ""

    async def open(self) -> None:
        """Open the channels to the workers and the router (they connect lazily)."""
        for address in self.worker_addresses:
            self._worker_channels[address] = self._channel(address)
        if self.config.router_grpc_address:
            channel = self._channel(self.config.router_grpc_address)
            self._channels.append(channel)
            self._router_stub = router_pb2_grpc.RouterStub(channel)

    def _channel(self, address: str) -> grpc.aio.Channel:
        """A channel to a worker or the router: every call on it bears the token."""
        return aio_channel(address, self.config.tls, carries_token=True)

    async def close(self) -> None:
        """Stop the refreshes in progress and close the channels."""
        for refresh in [self._refresh, *self._stale_refreshes]:
            if refresh is not None and not refresh.done():
                refresh.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await refresh
        for channel in [*self._channels, *self._worker_channels.values()]:
            await channel.close()
        self._channels.clear()
        self._worker_channels.clear()

    @property
    def status(self) -> StackStatus:
        """The latest snapshot (no RPC)."""
        return self._status

    @property
    def version(self) -> int:
        """Bumped on every change of the status (refresh times aside)."""
        return self._version

    async def refresh(self) -> StackStatus:
        """Ask every worker and the router now; concurrent callers share one refresh (begun since the router's
        last resume)."""
        if self._refresh is None or self._refresh.done() or self._refresh_epoch != self._epoch:
            if self._refresh is not None and not self._refresh.done():
                self._stale_refreshes.add(self._refresh)  # it ends on its own (publishing nothing); close() waits
                self._refresh.add_done_callback(self._stale_refreshes.discard)
            self._refresh, self._refresh_epoch = asyncio.ensure_future(self._refresh_once()), self._epoch
        return await asyncio.shield(self._refresh)  # a cancelled caller does not cancel the others' refresh

    async def wait_for_change(self, version: int, timeout_s: float) -> StackStatus:
        """The status once its version differs from `version`, or after `timeout_s` whatever it is."""
        changed = self._changed
        if self._version == version:
            # asyncio.wait, not wait_for: on Python 3.11 wait_for can swallow a cancellation that arrives as the
            # wait ends, and a watcher loop would then never stop.
            waiter = asyncio.ensure_future(changed.wait())
            try:
                await asyncio.wait({waiter}, timeout=timeout_s)
            finally:
                waiter.cancel()
        return self._status

    @property
    def worker_stubs(self) -> list[worker_pb2_grpc.WorkerStub]:
        """One stub per member, by rank."""
        return [worker_pb2_grpc.WorkerStub(self._worker_channels[a]) for a in self.worker_addresses]

    def stub_for(self, address: str) -> worker_pb2_grpc.WorkerStub:
        """A stub for a member or a worker about to join (its channel is kept)."""
        if address not in self._worker_channels:
            self._worker_channels[address] = self._channel(address)
        return worker_pb2_grpc.WorkerStub(self._worker_channels[address])

    async def set_members(self, addresses: list[str], generation: int, lost: list[str]) -> None:
        """Commit a new world (only a recovery or AddWorker calls this): its members by rank and generation, and
        the workers lost from it; channels of workers that left are closed."""
        self.worker_addresses, self.generation = list(addresses), generation
        self.lost_workers = [a for a in dict.fromkeys([*self.lost_workers, *lost]) if a not in addresses]
        if len(self.worker_addresses) >= self.full_size:  # back at full strength: the lost ones are replaced
            self.lost_workers = []
        for address in [a for a in self._worker_channels if a not in addresses]:
            await self._worker_channels.pop(address).close()
        for address in addresses:
            self.stub_for(address)  # every member has its channel
        # Every member just answered the recovery's probe and its Regroup: count heartbeats afresh (a miss from a
        # busy moment before would otherwise start a second recovery that finds nothing lost).
        self.misses = {}
        self._save()  # the next refresh shows the new table

    @property
    def router_stub(self) -> router_pb2_grpc.RouterStub | None:
        return self._router_stub

    def set_topology(self, topology: Topology, layer_partition: tuple[int, ...] | None) -> None:
        """Commit a new live layout (only the Reconfigure transaction calls this)."""
        self.topology, self.layer_partition = topology, layer_partition
        self._publish(replace(self._status, topology=str(topology)))
        self._save()

    def record_operation(self, operation: OperationStatus) -> None:
        """Set the last operation (the reconfiguration transaction reports its progress here)."""
        self.last_operation = operation
        self._publish(self._with_operation(self._status))
        self._save()

    async def recover(self) -> None:
        """After a (re)start: take the last operation from the state file and the live layout from the workers
        (they hold it; the controller's start-up flag may be stale after switches)."""
        if self.config.state_file and os.path.exists(self.config.state_file):
            try:
                saved = json.loads(open(self.config.state_file).read())
                operation = saved.get("last_operation")
                if operation:
                    operation["state"] = OperationState[operation["state"]]
                    operation["lost_workers"] = tuple(operation.get("lost_workers", ()))
                    self.last_operation = OperationStatus(**operation)
                self.layer_partition = tuple(saved["layer_partition"]) if saved.get("layer_partition") else None
                if saved.get("worker_addresses"):  # the world after recoveries, not the start-up list
                    await self.set_members(saved["worker_addresses"], int(saved.get("generation", 0)),
                                           list(saved.get("lost_workers", ())))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("controller.state_file_unreadable", path=self.config.state_file, error=str(exc))
        infos = [i for i in await asyncio.gather(*(self.probe(a) for a in self.worker_addresses))
                 if not isinstance(i, str)]
        self.generation = max([self.generation, *(i.generation for i in infos)])
        live = {i.topology for i in infos if i.num_kv_blocks > 0}
        if len(live) == 1 and len(infos) == len(self.worker_addresses):
            topology = Topology.parse(live.pop())
            if topology != self.topology:
                log.warning("controller.recovered_topology", configured=str(self.topology), live=str(topology))
                self.topology = topology
        await self.refresh()

    def _save(self) -> None:
        if not self.config.state_file:
            return
        op = self.last_operation
        saved = {"topology": str(self.topology), "layer_partition": list(self.layer_partition or ()),
                 "worker_addresses": self.worker_addresses, "generation": self.generation,
                 "lost_workers": self.lost_workers,
                 "last_operation": None if op is None else {**dataclasses.asdict(op), "state": op.state.name}}
        temporary = f"{self.config.state_file}.tmp"
        with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(saved, f)
        os.replace(temporary, self.config.state_file)

    async def run(self) -> None:
        """Refresh every refresh_interval_s until cancelled."""
        while True:
            try:
                await self.refresh()
            except Exception:  # never let one bad refresh stop the loop
                log.exception("controller.refresh_failed")
            await asyncio.sleep(self.config.refresh_interval_s)

    def router_resumed(self) -> None:
        """An operation resumed the router (any stall it had is over): refreshes begun before are stale."""
        self._epoch += 1

    async def _refresh_once(self) -> StackStatus:
        addresses, epoch = list(self.worker_addresses), self._epoch
        infos, router = await asyncio.gather(
            asyncio.gather(*(self.probe(a) for a in addresses)),
            self._router_stats(),
        )
        if addresses != self.worker_addresses or epoch != self._epoch:
            return self._status  # the world changed or the router resumed meanwhile: this round is of the past
        for address, info in zip(addresses, infos, strict=True):  # heartbeats: GetInfo is the beat
            self.misses[address] = self.misses.get(address, 0) + 1 if isinstance(info, str) else 0
        status = self._build(infos, router)
        self._publish(status)
        return status

    def lost_members(self) -> list[str]:
        """Members that missed `heartbeat_misses` heartbeats in a row."""
        return [a for a in self.worker_addresses if self.misses.get(a, 0) >= self.config.heartbeat_misses]

    async def probe(self, address: str) -> worker_pb2.WorkerInfo | str:
        """The worker's GetInfo within rpc_timeout_s (the heartbeat), or why it did not answer."""
        try:
            return await self.stub_for(address).GetInfo(worker_pb2.GetInfoRequest(), timeout=self.config.rpc_timeout_s,
                                      metadata=auth_metadata(self.config.token))
        except (grpc.aio.AioRpcError, OSError) as exc:
            return describe_error(exc)

    async def _router_stats(self) -> EngineStats | str | None:
        if self._router_stub is None:
            return None
        try:
            pb = await self._router_stub.Stats(router_pb2.StatsRequest(), timeout=self.config.rpc_timeout_s,
                                               metadata=auth_metadata(self.config.token))
        except (grpc.aio.AioRpcError, OSError) as exc:
            return describe_error(exc)
        return stats_from_pb(pb)

    def _build(self, infos: list[worker_pb2.WorkerInfo | str], router: EngineStats | str | None) -> StackStatus:
        """The status from one round of answers; every problem found becomes part of the reason."""
        live = str(self.topology)
        reasons: list[str] = []
        if isinstance(router, str):
            reasons.append(f"router {self._router_address} unreachable: {router}")
            router = None
        elif router is not None and router.topology and router.topology != live:
            reasons.append(f"router schedules for {router.topology}, the live topology is {live}")
        used = router.num_kv_blocks_used if router is not None else 0
        workers = []
        for rank, (address, info) in enumerate(zip(self.worker_addresses, infos, strict=True)):
            worker = self._worker_status(rank, address, info, live, used)
            if worker.error:
                reasons.append(f"worker {rank} ({address}) {worker.error}")
            workers.append(worker)
        if router is not None and router.stalled:
            reasons.append(f"the router cannot run steps: {router.stalled}")
        reasons.extend(self._membership_reasons())
        if reasons:
            state, reason = StackState.DEGRADED, "; ".join(reasons)
        elif router is not None and router.is_frozen:
            state, reason = StackState.FROZEN, "the router is frozen: no step is scheduled"
        else:
            state, reason = StackState.SERVING, ""
        layouts = () if self._shape is None else tuple(
            str(t) for t in candidate_topologies(self._shape, len(self.worker_addresses)))
        status = StackStatus(topology=live, state=state, model=self.config.model, reason=reason,
                             workers=tuple(workers), router_address=self._router_address, router=router,
                             updated_at=time.time(), lost_workers=tuple(self.lost_workers), layouts=layouts)
        return self._with_operation(status)

    def _membership_reasons(self) -> list[str]:
        if not self.lost_workers and len(self.worker_addresses) >= self.full_size:
            return []
        lost = f"lost {', '.join(self.lost_workers)}; " if self.lost_workers else ""
        return [f"{lost}serving on {len(self.worker_addresses)} of {self.full_size} workers "
                "(start a replacement and `reconfigctl add-worker ADDRESS`)"]

    @staticmethod
    def _worker_status(rank: int, address: str, info: worker_pb2.WorkerInfo | str, live: str,
                       num_kv_blocks_used: int) -> WorkerStatus:
        if isinstance(info, str):
            return WorkerStatus(rank=rank, address=address, state=WorkerState.UNREACHABLE,
                                error=f"unreachable: {info}")
        is_active = info.layer_end > info.layer_start  # a standby worker holds no layer
        error = ""
        if info.rank != rank:
            error = f"reports rank {info.rank}"
        elif info.topology != live:
            error = f"runs {info.topology}, the live topology is {live}"
        return WorkerStatus(
            rank=rank, address=address, state=WorkerState.ACTIVE if is_active else WorkerState.STANDBY,
            pid=info.pid, device=info.device, pp_rank=info.pp_rank, tp_rank=info.tp_rank,
            layer_start=info.layer_start, layer_end=info.layer_end,
            kv_head_start=info.kv_head_start, kv_head_end=info.kv_head_end,
            num_kv_blocks_used=num_kv_blocks_used if is_active else 0, num_kv_blocks_total=info.num_kv_blocks,
            param_bytes=info.param_bytes, kv_cache_bytes=info.kv_cache_bytes, error=error,
            numerics=info.numerics, dtype=info.dtype, gemm=info.gemm,
            kernels=info.kernels,
        )

    def _with_operation(self, status: StackStatus) -> StackStatus:
        return replace(status, last_operation=self.last_operation)

    def _publish(self, status: StackStatus) -> None:
        changed = not status.same_as(self._status)
        self._status = status
        if changed:
            self._version += 1
            event, self._changed = self._changed, asyncio.Event()
            event.set()
