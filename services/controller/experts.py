"""The controller's side of EPLB: forwards ExpertStatus and RebalanceExperts to the router, which owns the expert
maps (it counts the steps and commits a new map with one of them), and keeps a rebalance and a layout operation
from running at once.

A rebalance claims the Reconfigurer's one-operation slot, as Reconfigure, recover and add-worker do: a Reconfigure
while it runs is refused (FAILED_PRECONDITION, naming it), and it is refused while one of them runs. The router's
own automatic trigger (--eplb) does not pass through the controller and is not serialized here.
"""

from __future__ import annotations

import asyncio
import uuid

import grpc
import structlog

from services.controller.state import ControllerState
from services.controller.transaction import OperationBusy, Reconfigurer
from services.rpc.auth import auth_metadata
from services.rpc.reconfig.v1 import router_pb2, router_pb2_grpc

log = structlog.get_logger(__name__)
REBALANCE_OPERATION_PREFIX = "eplb-rebalance-"


class NoRouter(RuntimeError):
    """The controller was started without a router (FAILED_PRECONDITION)."""


class RouterCallFailed(RuntimeError):
    """The router answered a forwarded call with an error: its status code is kept, its message named."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class ExpertOperations:
    """ExpertStatus and RebalanceExperts, forwarded to the router with the control-plane token."""

    def __init__(self, router: router_pb2_grpc.RouterStub | None, router_address: str, metadata: tuple,
                 reconfigurer: Reconfigurer | None, status_timeout_s: float, rebalance_timeout_s: float) -> None:
        self.router = router
        self.router_address = router_address
        self.metadata = metadata
        self.reconfigurer = reconfigurer  # None: no layout operation can run, so nothing to serialize with
        self.status_timeout_s = status_timeout_s
        self.rebalance_timeout_s = rebalance_timeout_s  # the router's prepare and commit wait up to 120 s each

    async def status(self) -> router_pb2.ExpertStatusResponse:
        """The router's per-layer expert maps, rank loads and balancedness."""
        return await self._call("ExpertStatus", router_pb2.ExpertStatusRequest(), self.status_timeout_s)

    async def rebalance(self) -> router_pb2.RebalanceExpertsResponse:
        """One EPLB rebalance now, holding the operation slot until the router has answered. The router's call is
        shielded: a client that gives up does not cancel a rebalance half-way (its staged map would be left
        behind), and no layout operation starts before the router is done with it."""
        router = self._router()
        operation_id = REBALANCE_OPERATION_PREFIX + uuid.uuid4().hex[:12]
        if self.reconfigurer is not None:
            try:
                self.reconfigurer.claim(operation_id)
            except OperationBusy as exc:
                raise OperationBusy(f"cannot rebalance the experts now: {exc}") from None
        forward = asyncio.ensure_future(self._call("RebalanceExperts", router_pb2.RebalanceExpertsRequest(),
                                                   self.rebalance_timeout_s, router))
        forward.add_done_callback(lambda _: self._release(operation_id))
        response = await asyncio.shield(forward)
        log.info("controller.experts_rebalanced", operation_id=operation_id, epoch=response.epoch,
                 balancedness_before=round(response.balancedness_before, 4),
                 balancedness_after=round(response.balancedness_after, 4), bytes_moved=response.bytes_moved)
        return response

    @classmethod
    def for_state(cls, state: ControllerState, reconfigurer: Reconfigurer | None) -> ExpertOperations:
        """The controller's router (opened channel), token and deadlines."""
        config = state.config
        return cls(state.router_stub, config.router_grpc_address or "", auth_metadata(config.token), reconfigurer,
                   status_timeout_s=config.switch_rpc_timeout_s, rebalance_timeout_s=config.eplb_rpc_timeout_s)

    def _release(self, operation_id: str) -> None:
        if self.reconfigurer is not None and self.reconfigurer.running == operation_id:
            self.reconfigurer.running = None

    def _router(self) -> router_pb2_grpc.RouterStub:
        if self.router is None:
            raise NoRouter("this controller has no router: the expert maps live in the router "
                           "(start the controller with --router-grpc)")
        return self.router

    async def _call(self, method: str, request, timeout_s: float, router: router_pb2_grpc.RouterStub | None = None):
        router = router or self._router()
        try:
            return await getattr(router, method)(request, timeout=timeout_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise RouterCallFailed(exc.code(), f"router at {self.router_address}: {exc.details()}") from None
