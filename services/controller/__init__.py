"""The controller: owns the live topology and the worker table; serves GetStatus / WatchStatus; `reconfigctl`.

Its names load on first use (PEP 562): `reconfigctl` imports this package's client side, and must not pay for the
server's imports (torch among them) on every call."""

from importlib import import_module

_HOMES = {
    "serve_controller": "services.controller.server",
    "start_controller_grpc": "services.controller.server",
    "ControllerConfig": "services.controller.state",
    "ControllerState": "services.controller.state",
    **dict.fromkeys(("OperationState", "OperationStatus", "StackState", "StackStatus", "WorkerState",
                     "WorkerStatus"), "services.controller.status"),
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_HOMES[name]), name)
