"""Thin gRPC servicer of the controller: converts ControllerState's snapshots at the edge."""

from __future__ import annotations

from services.controller.state import ControllerState
from services.rpc.reconfig.v1 import controller_pb2_grpc

MIN_WATCH_INTERVAL_S = 0.1  # a client cannot make the controller spin


class ControllerServicer(controller_pb2_grpc.ControllerServicer):
    """GetStatus and WatchStatus over ControllerState (Reconfigure and Plan come with live reconfiguration)."""

    def __init__(self, state: ControllerState) -> None:
        self.state = state

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
