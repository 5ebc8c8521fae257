"""The controller as `reconfigctl` talks to it: finding it, its RPCs, and what their failures mean to an operator."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.controller.progress import PhaseDisplay
from services.controller.status import OperationStatus, StackStatus
from services.rpc.auth import InsecureTokenError, auth_metadata, read_token_file
from services.rpc.reconfig.v1 import controller_pb2, controller_pb2_grpc, router_pb2
from services.rpc.tls import TLSConfig, TLSError, from_args, sync_channel
from services.runtime.stackfile import StackFile, StackNotFoundError
from services.runtime.stacks import select_stack

EXIT_OK, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2   # 2 is also argparse's usage error
WATCH_INTERVAL_S = 0.1     # how often the progress display hears from the controller while a phase runs
_REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
ROUTER_ERROR_PREFIX = "router at "  # the controller's message for an error of a call it forwarded to the router


class CommandFailed(RuntimeError):
    """A command that could not do its job; `exit_code` says how (1: failed or unreachable, 2: refused)."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Unreachable(CommandFailed):
    """The stack cannot be found or reached (exit 1)."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where the controller is, the token it wants, and the stack it belongs to (when found by its stack file)."""

    controller_address: str
    token: str
    stack: str = ""
    tls: TLSConfig | None = None  # mutual TLS to the controller (--tls-* or $RECONFIG_TLS_*); None: plaintext

    def channel(self) -> grpc.Channel:
        """A channel to the controller, every call on it bearing the token; CommandFailed when the token would go
        in plaintext to another host."""
        try:
            return sync_channel(self.controller_address, self.tls, carries_token=True)
        except InsecureTokenError as exc:
            raise CommandFailed(str(exc), EXIT_REFUSED) from None


def tls_from_args(args) -> TLSConfig | None:
    """The --tls-* flags (their defaults: $RECONFIG_TLS_CERT/_KEY/_CA); CommandFailed (exit 2) when incomplete or a
    file is missing."""
    try:
        return from_args(args)
    except TLSError as exc:
        raise CommandFailed(str(exc), EXIT_REFUSED) from None


def find_stack(selector: str | None) -> StackFile:
    """The stack file of the stack `selector` names (a name or a port; None: the only one running); Unreachable
    with the running stacks listed when there is no such stack, or several and no selector."""
    try:
        running = select_stack(selector)
    except StackNotFoundError as exc:
        raise Unreachable(str(exc)) from None
    if running.stack is None:
        raise Unreachable(f"stack {running.name!r} ({running.describe()}) is starting; try again when `reconfig up` "
                          "says it is up")
    return running.stack


def resolve_target(controller: str | None, token_file: Path | None, stack: str | None = None,
                   tls: TLSConfig | None = None) -> Target:
    """Flags first; what they leave open comes from the stack file written by `reconfig up` (the stack `stack`
    names, or the only one running)."""
    name = ""
    if controller is None or token_file is None:
        found = find_stack(stack)
        controller = controller or found.controller_address
        token_file = token_file or Path(found.token_file)
        name = found.name
    try:
        return Target(controller, read_token_file(token_file), name, tls)
    except (OSError, ValueError) as exc:
        raise Unreachable(f"cannot read the control-plane token: {exc}") from None


def rpc_failure(exc: grpc.RpcError, target: Target) -> CommandFailed:
    """What a failed call means to the operator: unreachable (1), refused (2, the server's message) or failed."""
    code, details = exc.code(), exc.details()
    if code not in _REFUSALS and (details or "").startswith(ROUTER_ERROR_PREFIX):  # a call the controller forwarded
        return CommandFailed(f"{code.name} from the {details}")
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return Unreachable(f"the controller at {target.controller_address} refused the token: {details}")
    if code in _REFUSALS:
        return CommandFailed(f"refused ({code.name}): {details}", EXIT_REFUSED)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Unreachable(f"cannot reach the controller at {target.controller_address}: {code.name}: {details}")
    return CommandFailed(f"the controller at {target.controller_address} failed: {code.name}: {details}")


def fetch_status(target: Target, timeout_s: float) -> StackStatus:
    """GetStatus from the controller; Unreachable with a readable reason on failure."""
    with target.channel() as channel:
        stub = controller_pb2_grpc.ControllerStub(channel)
        try:
            pb = stub.GetStatus(controller_pb2.GetStatusRequest(), timeout=timeout_s,
                                metadata=auth_metadata(target.token))
        except grpc.RpcError as exc:
            raise rpc_failure(exc, target) from None
    return StackStatus.from_pb(pb)


def fetch_plan(target: Target, topology: str, layer_partition: tuple[int, ...],
               timeout_s: float) -> controller_pb2.PlanResponse:
    """Controller.Plan; CommandFailed (exit 2 for a target the controller refuses) on failure."""
    with target.channel() as channel:
        stub = controller_pb2_grpc.ControllerStub(channel)
        try:
            return stub.Plan(controller_pb2.PlanRequest(topology=topology, layer_partition=layer_partition),
                             timeout=timeout_s, metadata=auth_metadata(target.token))
        except grpc.RpcError as exc:
            raise rpc_failure(exc, target) from None


def run_reconfigure(target: Target, request: controller_pb2.ReconfigureRequest, timeout_s: float | None,
                    display: PhaseDisplay | None = None) -> OperationStatus:
    """Controller.Reconfigure; with a display, WatchStatus runs alongside and feeds it every status of this
    operation (subscribed before the operation starts, so no phase is missed)."""
    metadata = auth_metadata(target.token)
    with target.channel() as channel:
        stub = controller_pb2_grpc.ControllerStub(channel)
        watch, follower = None, None
        try:
            if display is not None:
                watch = stub.WatchStatus(controller_pb2.WatchStatusRequest(interval_seconds=WATCH_INTERVAL_S),
                                         metadata=metadata)
                next(watch)  # the status before the operation: the stream is open
                follower = threading.Thread(target=_follow, args=(watch, request.operation_id, display),
                                            name="reconfigctl-watch", daemon=True)
                follower.start()
            pb = stub.Reconfigure(request, timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:  # our --timeout, not the operation's deadline
                raise CommandFailed(f"no answer within {timeout_s:g} s; operation {request.operation_id} may go "
                                    "on in the controller (`reconfigctl status` follows it)") from None
            raise rpc_failure(exc, target) from None
        finally:
            if watch is not None:
                watch.cancel()
            if follower is not None:
                follower.join()
    return OperationStatus.from_pb(pb)


def run_add_worker(target: Target, request: controller_pb2.AddWorkerRequest,
                   timeout_s: float | None) -> OperationStatus:
    """Controller.AddWorker: returns once the worker has joined (and the optional switch has ended)."""
    with target.channel() as channel:
        stub = controller_pb2_grpc.ControllerStub(channel)
        try:
            pb = stub.AddWorker(request, timeout=timeout_s, metadata=auth_metadata(target.token))
        except grpc.RpcError as exc:
            raise rpc_failure(exc, target) from None
    return OperationStatus.from_pb(pb)


def fetch_expert_status(target: Target, timeout_s: float) -> router_pb2.ExpertStatusResponse:
    """Controller.ExpertStatus (the router's expert maps and balancedness)."""
    with target.channel() as channel:
        stub = controller_pb2_grpc.ControllerStub(channel)
        try:
            return stub.ExpertStatus(router_pb2.ExpertStatusRequest(), timeout=timeout_s,
                                     metadata=auth_metadata(target.token))
        except grpc.RpcError as exc:
            raise rpc_failure(exc, target) from None


def run_rebalance(target: Target, timeout_s: float | None) -> router_pb2.RebalanceExpertsResponse:
    """Controller.RebalanceExperts: returns once the new expert map is live (exit 2 when refused, 1 when a worker
    failed it and the old map stays)."""
    with target.channel() as channel:
        stub = controller_pb2_grpc.ControllerStub(channel)
        try:
            return stub.RebalanceExperts(router_pb2.RebalanceExpertsRequest(), timeout=timeout_s,
                                         metadata=auth_metadata(target.token))
        except grpc.RpcError as exc:
            if (exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                    and not (exc.details() or "").startswith(ROUTER_ERROR_PREFIX)):
                raise CommandFailed(f"no answer within {timeout_s:g} s; the rebalance may go on in the router "
                                    "(`reconfigctl eplb status` shows its epoch)") from None
            raise rpc_failure(exc, target) from None


def _follow(watch, operation_id: str, display: PhaseDisplay) -> None:
    """Feed the display every status of one operation until the stream is cancelled."""
    try:
        for status in watch:
            if status.HasField("last_operation") and status.last_operation.operation_id == operation_id:
                display.update(OperationStatus.from_pb(status.last_operation))
    except grpc.RpcError:
        pass  # cancelled once Reconfigure returned (or the controller went away: Reconfigure reports that)
