"""One operation's phase bookkeeping while it runs (the Reconfigure transaction's and a recovery's): the seconds
of each phase, the deadline its RPCs are bounded by until the commit point, the status published to the controller
state at every change, and the switch report the router's metrics take. (progress.py draws it for an operator.)"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

from services.controller.status import OperationState, OperationStatus
from services.rpc.reconfig.v1 import router_pb2


class DeadlineExceeded(TimeoutError):
    """The operation did not reach its commit point in time (the old layout is restored)."""


class RpcTimeout(Protocol):
    """What bounds each RPC of an operation (the Reconfigurer)."""

    rpc_timeout_s: float


class Progress:
    """Phase bookkeeping of one operation, published to the controller state at every change."""

    def __init__(self, state, status: OperationStatus, deadline: float = float("inf")) -> None:
        self.deadline = deadline  # time.monotonic() by which the operation must have reached its commit point
        self.state = state
        self.status = status
        self.rolled_back = False
        self._phase_started = time.perf_counter()
        state.record_operation(status)

    def timeout(self, reconfigurer: RpcTimeout) -> float:
        """The RPC timeout within the operation's deadline; DeadlineExceeded once it has passed."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded(f"the operation's deadline passed in {self.status.phase}")
        return min(reconfigurer.rpc_timeout_s, remaining)

    def _move_seconds(self, source: str, target: str, seconds: float) -> None:
        """Attribute `seconds` measured under phase `source` to phase `target` instead."""
        phases = dict(self.status.phase_seconds)
        moved = min(seconds, phases.get(source, 0.0))
        phases[source] = phases.get(source, 0.0) - moved
        phases[target] = phases.get(target, 0.0) + moved
        self.status = dataclasses.replace(self.status, phase_seconds=phases)

    def enter(self, phase: str, split: tuple[str, str, float] | None = None,
              keep: tuple[str, float, str] | None = None) -> None:
        """Close the running phase and start `phase`. split (source, target, seconds): move that many seconds from
        one closed phase to another; keep (source, seconds, target): leave at most that many in the source and
        move the rest to the target."""
        self._close_phase()
        if split is not None:
            self._move_seconds(*split)
        if keep is not None:
            source, kept, target = keep
            self._move_seconds(source, target, max(0.0, self.status.phase_seconds.get(source, 0.0) - kept))
        self.status = dataclasses.replace(self.status, phase=phase)
        self.state.record_operation(self.status)

    def finish(self, state: OperationState, error: str = "") -> OperationStatus:
        self._close_phase()
        self.status = dataclasses.replace(self.status, state=state, error=error, phase="", ended_at=time.time())
        self.state.record_operation(self.status)
        return self.status

    def report(self, state: OperationState) -> router_pb2.SwitchReport:
        """The switch so far for the router's metrics (the open phase counted up to now), ending in `state`."""
        status, seconds = self.status, dict(self.status.phase_seconds)
        if status.phase:
            seconds[status.phase] = seconds.get(status.phase, 0.0) + time.perf_counter() - self._phase_started
        return router_pb2.SwitchReport(
            operation_id=status.operation_id, from_topology=status.from_topology, to_topology=status.to_topology,
            phase_seconds=seconds, kv_bytes_moved=status.kv_bytes_moved, weight_bytes_loaded=status.weight_bytes_loaded,
            kv_bytes_precopied=status.kv_bytes_precopied,
            num_requests_preempted=status.num_requests_preempted, state=state.name,
        )

    def _close_phase(self) -> None:
        now = time.perf_counter()
        if self.status.phase:
            seconds = dict(self.status.phase_seconds)
            seconds[self.status.phase] = seconds.get(self.status.phase, 0.0) + now - self._phase_started
            self.status = dataclasses.replace(self.status, phase_seconds=seconds)
        self._phase_started = now
