"""The controller: owns the live topology and the worker table; serves GetStatus / WatchStatus; `reconfigctl`."""

from services.controller.server import serve_controller, start_controller_grpc
from services.controller.state import ControllerConfig, ControllerState
from services.controller.status import (
    OperationState,
    OperationStatus,
    StackState,
    StackStatus,
    WorkerState,
    WorkerStatus,
)

__all__ = [
    "ControllerConfig",
    "ControllerState",
    "OperationState",
    "OperationStatus",
    "StackState",
    "StackStatus",
    "WorkerState",
    "WorkerStatus",
    "serve_controller",
    "start_controller_grpc",
]
