"""Thin gRPC servicer of the controller: converts ControllerState's snapshots at the edge."""

from __future__ import annotations

import asyncio
import time

import grpc

from services.controller.autopilot.loop import Autopilot, calibration_plan
from services.controller.autopilot.view import status_pb
from services.controller.experts import ExpertOperations, NoRouter, RouterCallFailed
from services.controller.state import ControllerState
from services.controller.status import OperationState, OperationStatus
from services.controller.plan import plan_switch
from services.controller.recovery import Recoverer
from services.controller.transaction import OperationBusy, Reconfigurer, check_deadline, status_code_for
from services.topology import TopologyError
from services.rpc.errors import check_address
from services.rpc.reconfig.v1 import controller_pb2, controller_pb2_grpc

MIN_WATCH_INTERVAL_S = 0.1  # a client cannot make the controller spin


class ControllerServicer(controller_pb2_grpc.ControllerServicer):
    """GetStatus and WatchStatus over ControllerState; Reconfigure and Plan over the Reconfigurer; the EPLB RPCs
    over ExpertOperations (forwarded to the router)."""

    def __init__(self, state: ControllerState, reconfigurer: Reconfigurer | None = None,
                 recoverer: Recoverer | None = None, experts: ExpertOperations | None = None,
                 autopilot: Autopilot | None = None) -> None:
        self.state = state
        self.reconfigurer = reconfigurer
        self.autopilot = autopilot
        self.recoverer = recoverer or (Recoverer(reconfigurer) if reconfigurer is not None else None)
        self.experts = experts or ExpertOperations.for_state(state, reconfigurer)

    async def GetStatus(self, request, context):  # noqa: N802 (gRPC naming)
        """The state of the stack, refreshed before answering."""
        return (await self.state.refresh()).to_pb()

    async def WatchStatus(self, request, context):  # noqa: N802
        """The current status, then one on every change and at least every interval, until cancelled."""
        interval_s = request.interval_seconds if request.interval_seconds > 0 else self.state.config.refresh_interval_s
        interval_s = max(interval_s, MIN_WATCH_INTERVAL_S)
        status = await self.state.refresh()
        while True:
            version = self.state.version  # read before yielding: a change during the write is not missed
            yield status.to_pb()
            status = await self.state.wait_for_change(version, interval_s)

    async def Reconfigure(self, request, context):  # noqa: N802
        """Run (or join, by operation_id) a switch of the live layout."""
        reconfigurer = await self._reconfigurer(context)
        try:
            check_deadline(request.deadline_seconds)  # for dry runs too: a plan accepts what the switch would
            if request.dry_run:
                plan = await plan_switch(reconfigurer, request.topology, request.layer_partition)
                return OperationStatus(
                    request.operation_id, "plan", OperationState.SUCCEEDED, time.time(), time.time(),
                    from_topology=plan.from_topology, to_topology=plan.to_topology,
                    kv_bytes_moved=sum(w.kv_bytes_in for w in plan.workers),
                    weight_bytes_loaded=sum(w.weight_bytes_load for w in plan.workers),
                ).to_pb()
            operation = await reconfigurer.reconfigure(
                request.topology, request.operation_id, request.deadline_seconds, request.strategy,
                request.layer_partition,
            )
        except (TopologyError, ValueError, OperationBusy) as exc:
            await context.abort(status_code_for(exc), str(exc))
        return operation.to_pb()

    async def Plan(self, request, context):  # noqa: N802
        """What a switch would move; changes nothing."""
        reconfigurer = await self._reconfigurer(context)
        try:
            return await plan_switch(reconfigurer, request.topology, request.layer_partition)
        except (TopologyError, ValueError) as exc:
            await context.abort(status_code_for(exc), str(exc))

    async def AddWorker(self, request, context):  # noqa: N802
        """Bring a joining worker into the world (and optionally switch into a layout that uses it)."""
        await self._reconfigurer(context)
        try:
            check_address(request.address)
            operation = await self.recoverer.add_worker(request.address, request.topology, request.operation_id)
        except (TopologyError, ValueError, OperationBusy) as exc:
            await context.abort(status_code_for(exc), str(exc))
        return operation.to_pb()

    async def ExpertStatus(self, request, context):  # noqa: N802
        """MoE: the router's expert maps, rank loads and balancedness."""
        try:
            return await self.experts.status()
        except (NoRouter, RouterCallFailed) as exc:
            await context.abort(_expert_code(exc), str(exc))

    async def RebalanceExperts(self, request, context):  # noqa: N802
        """MoE: an EPLB rebalance now; refused while a layout operation runs, and holds new ones off until done."""
        try:
            return await self.experts.rebalance()
        except (NoRouter, RouterCallFailed, OperationBusy) as exc:
            await context.abort(_expert_code(exc), str(exc))

    async def GetAutopilot(self, request, context):  # noqa: N802
        """The autopilot's mode, profile and last decision."""
        return status_pb(await self._autopilot(context))

    async def SetAutopilot(self, request, context):  # noqa: N802
        """Change the autopilot's mode."""
        autopilot = await self._autopilot(context)
        try:
            autopilot.set_mode(request.mode)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return status_pb(autopilot)

    async def Calibrate(self, request, context):  # noqa: N802
        """Measure the layouts, streaming progress; the last message carries the new status."""
        autopilot = await self._autopilot(context)
        reconfigurer = autopilot.reconfigurer
        try:
            plan = calibration_plan(request, reconfigurer)
            busy = autopilot.calibrating or reconfigurer.running
            if busy:
                raise OperationBusy(f"a calibration or an operation is running ({busy}); retry when it has ended")
        except (TopologyError, ValueError, OperationBusy) as exc:
            await context.abort(status_code_for(exc), str(exc))
        progress: asyncio.Queue[tuple[str, float]] = asyncio.Queue()
        task = asyncio.ensure_future(autopilot.calibrate(plan, lambda what, done: progress.put_nowait((what, done))))
        try:
            while not task.done() or not progress.empty():
                getter = asyncio.ensure_future(progress.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    what, done = getter.result()
                    yield controller_pb2.CalibrateProgress(message=what, done=done)
                else:
                    getter.cancel()
            task.result()
        except (TopologyError, ValueError, OperationBusy, RuntimeError) as exc:
            await context.abort(status_code_for(exc) if not isinstance(exc, RuntimeError)
                                else grpc.StatusCode.ABORTED, str(exc))
        finally:
            if not task.done():  # the client went away: the calibration goes on and is adopted when it ends
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
        yield controller_pb2.CalibrateProgress(message="done", done=1.0, status=status_pb(autopilot))

    async def _autopilot(self, context) -> Autopilot:
        if self.autopilot is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this controller has no autopilot: it was started without a model directory "
                                "or a router")
        return self.autopilot

    async def _reconfigurer(self, context) -> Reconfigurer:
        if self.reconfigurer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this controller cannot reconfigure: it was started without a model directory "
                                "or a router")
        return self.reconfigurer


def _expert_code(exc: BaseException) -> grpc.StatusCode:
    """A forwarded call keeps the router's code; no router, or another operation running, is a precondition."""
    return exc.code if isinstance(exc, RouterCallFailed) else grpc.StatusCode.FAILED_PRECONDITION
