"""The status of the stack as the controller reports it: plain dataclasses, converted to protobuf at the edge."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from services.contracts.phases import PREPARING_PHASES, SERVING_PHASES
from services.router.contracts import EngineStats
from services.router.load_window import LoadSnapshot
from services.router.wire import stats_from_pb, stats_to_pb
from services.rpc.reconfig.v1 import controller_pb2


class StackState(enum.Enum):
    """State of the whole stack (controller.proto StackState)."""

    STARTING = controller_pb2.STACK_STATE_STARTING
    SERVING = controller_pb2.STACK_STATE_SERVING
    FROZEN = controller_pb2.STACK_STATE_FROZEN
    DEGRADED = controller_pb2.STACK_STATE_DEGRADED


class WorkerState(enum.Enum):
    """Role of a worker in the live topology (controller.proto WorkerState)."""

    ACTIVE = controller_pb2.WORKER_STATE_ACTIVE
    STANDBY = controller_pb2.WORKER_STATE_STANDBY
    UNREACHABLE = controller_pb2.WORKER_STATE_UNREACHABLE


class OperationState(enum.Enum):
    """Progress of an operation (controller.proto OperationState)."""

    RUNNING = controller_pb2.OPERATION_STATE_RUNNING
    SUCCEEDED = controller_pb2.OPERATION_STATE_SUCCEEDED
    FAILED = controller_pb2.OPERATION_STATE_FAILED
    ROLLED_BACK = controller_pb2.OPERATION_STATE_ROLLED_BACK


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One row of the worker table."""

    rank: int
    address: str
    state: WorkerState
    pid: int = 0
    device: str = ""
    pp_rank: int = 0
    tp_rank: int = 0
    layer_start: int = 0               # layers held: [layer_start, layer_end)
    layer_end: int = 0
    kv_head_start: int = 0             # KV heads held: [kv_head_start, kv_head_end)
    kv_head_end: int = 0
    num_kv_blocks_used: int = 0        # global block ids: the same on every active worker
    num_kv_blocks_total: int = 0
    param_bytes: int = 0
    kv_cache_bytes: int = 0
    error: str = ""                    # why UNREACHABLE, or a topology mismatch
    numerics: str = ""                 # "fast" or "invariant" (WorkerInfo.numerics)
    dtype: str = ""                    # compute dtype, e.g. "float32"
    gemm: str = ""                     # what computes its products, e.g. "ordered (avx512)" (WorkerInfo.gemm)
    kernels: str = ""                  # "torch" or "triton" (WorkerInfo.kernels)

    def to_pb(self) -> controller_pb2.WorkerStatus:
        """The wire form."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["state"] = self.state.value
        return controller_pb2.WorkerStatus(**values)

    @classmethod
    def from_pb(cls, pb: controller_pb2.WorkerStatus) -> WorkerStatus:
        """From the wire form."""
        values = {f.name: getattr(pb, f.name) for f in dataclasses.fields(cls)}
        values["state"] = WorkerState(pb.state)
        return cls(**values)


@dataclass(frozen=True, slots=True)
class OperationStatus:
    """The last operation the controller ran (a reconfiguration transaction, from the next issue on)."""

    operation_id: str
    kind: str
    state: OperationState
    started_at: float                  # unix seconds
    ended_at: float = 0.0              # 0 while running
    error: str = ""
    phase_seconds: dict[str, float] = field(default_factory=dict)  # in phase order
    from_topology: str = ""
    to_topology: str = ""
    phase: str = ""                    # the phase running now
    kv_bytes_moved: int = 0
    weight_bytes_loaded: int = 0
    num_requests_preempted: int = 0
    built_groups: bool = False         # slow path: the target's process groups were built during the switch
    lost_workers: tuple[str, ...] = ()  # "recover": the workers it found gone and left out of the new world
    kv_dropped: bool = False           # the running requests' KV was dropped (they re-prefill), not migrated
    weight_bytes_resharded: int = 0    # expert bytes that changed view by all-to-all (TP <-> EP), not loaded
    staging: str = ""                  # "staged", "in-place", or "in-place: <why staging was skipped>"
    precopy: str = ""                  # KV pre-copied while serving: "N rounds", or "off: <why>"; "": not tried
    kv_bytes_precopied: int = 0        # KV bytes copied by the pre-copy rounds (kv_bytes_moved: in the freeze)

    @property
    def downtime_seconds(self) -> float:
        """Seconds requests waited for it (the cutover): from the first one the freeze held back to the resume,
        i.e. every phase but STAGING, PRECOPY and DRAINING (serving)."""
        return sum(s for phase, s in self.phase_seconds.items() if phase not in SERVING_PHASES)

    @property
    def staging_seconds(self) -> float:
        """Seconds the switch ran while the router served, before the freeze: STAGING and PRECOPY."""
        return sum(self.phase_seconds.get(phase, 0.0) for phase in PREPARING_PHASES)

    def to_pb(self) -> controller_pb2.OperationStatus:
        """The wire form."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["state"] = self.state.value
        return controller_pb2.OperationStatus(**values)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form (state by name) for `reconfigctl reconfigure --json`."""
        return _jsonable(dataclasses.asdict(self))

    @classmethod
    def from_pb(cls, pb: controller_pb2.OperationStatus) -> OperationStatus:
        """From the wire form."""
        values = {f.name: getattr(pb, f.name) for f in dataclasses.fields(cls)}
        values["state"] = OperationState(pb.state)
        values["phase_seconds"] = dict(pb.phase_seconds)
        values["lost_workers"] = tuple(pb.lost_workers)
        return cls(**values)


@dataclass(frozen=True, slots=True)
class StackStatus:
    """A snapshot of the stack: topology, state, workers, the router's scheduler, the last operation."""

    topology: str
    state: StackState
    model: str = ""
    reason: str = ""                   # why not SERVING
    workers: tuple[WorkerStatus, ...] = ()
    router_address: str = ""
    router: EngineStats | None = None  # None: no router, or it did not answer
    last_operation: OperationStatus | None = None
    updated_at: float = 0.0            # unix seconds of the refresh behind this snapshot
    lost_workers: tuple[str, ...] = ()  # lost and not replaced yet: DEGRADED until as many have joined
    layouts: tuple[str, ...] = ()      # the layouts the model allows on the workers (what a switch accepts)

    def same_as(self, other: StackStatus | None) -> bool:
        """Equal apart from the refresh time and the router's load window (what WatchStatus calls a change): the
        window's rates over the last minute drift as time passes alone, and go out at the watch's interval."""
        return other is not None and self._without_drift() == other._without_drift()

    def _without_drift(self) -> StackStatus:
        router = None if self.router is None else dataclasses.replace(self.router, window=LoadSnapshot())
        return dataclasses.replace(self, updated_at=0.0, router=router)

    def to_pb(self) -> controller_pb2.StackStatus:
        """The wire form."""
        pb = controller_pb2.StackStatus(
            topology=self.topology, state=self.state.value, reason=self.reason, model=self.model,
            workers=[w.to_pb() for w in self.workers], router_address=self.router_address,
            updated_at=self.updated_at, lost_workers=self.lost_workers, layouts=self.layouts,
        )
        if self.router is not None:
            pb.router.CopyFrom(stats_to_pb(self.router))
        if self.last_operation is not None:
            pb.last_operation.CopyFrom(self.last_operation.to_pb())
        return pb

    @classmethod
    def from_pb(cls, pb: controller_pb2.StackStatus) -> StackStatus:
        """From the wire form."""
        return cls(
            topology=pb.topology, state=StackState(pb.state), model=pb.model, reason=pb.reason,
            workers=tuple(WorkerStatus.from_pb(w) for w in pb.workers), router_address=pb.router_address,
            router=stats_from_pb(pb.router) if pb.HasField("router") else None,
            last_operation=OperationStatus.from_pb(pb.last_operation) if pb.HasField("last_operation") else None,
            updated_at=pb.updated_at, lost_workers=tuple(pb.lost_workers), layouts=tuple(pb.layouts),
        )

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form (enums by name) for `reconfigctl status --json`."""
        return _jsonable(dataclasses.asdict(self))


def _jsonable(value: Any) -> Any:
    """Enums by name, tuples as lists, recursively."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
