"""The controller's gRPC server and lifecycle: serve until cancelled or SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import grpc
import structlog

from services.controller.autopilot.calibrate import CalibrationPlan
from services.controller.autopilot.intents import load_intents
from services.controller.autopilot.loop import Autopilot, AutopilotConfig, default_layouts
from services.controller.autopilot.metrics import start_metrics_server
from services.controller.autopilot.policy import parse_policy
from services.controller.autopilot.profile import Profile, machine_key, profile_path
from services.controller.servicer import ControllerServicer
from services.controller.state import ControllerConfig, ControllerState
from services.controller.status import StackState
from services.controller.transaction import Reconfigurer
from services.model.spec import ModelSpec

__all__ = ["ControllerConfig", "run_controller", "serve_controller", "start_controller_grpc"]
from services.rpc.auth import TokenAuthInterceptor, protect_all
from services.rpc.errors import ErrorInterceptor
from services.rpc.reconfig.v1 import controller_pb2_grpc
from services.rpc.server import listen, new_server

log = structlog.get_logger(__name__)
_GRACE_S = 1.0  # open WatchStatus streams are cancelled after this


def make_reconfigurer(state: ControllerState) -> Reconfigurer | None:
    """The transaction runner, when the controller knows the model and has a router to drive."""
    config = state.config
    if not config.model_dir or state.router_stub is None:
        return None
    reconfigurer = Reconfigurer(state, ModelSpec.from_dir(config.model_dir), None, state.router_stub,
                                config.token, rpc_timeout_s=config.switch_rpc_timeout_s)
    if config.staging_budget_mb is not None:
        reconfigurer.staging_budget_bytes = config.staging_budget_mb << 20
    reconfigurer.staging_duty = config.staging_duty
    return reconfigurer


def make_autopilot(state: ControllerState, reconfigurer: Reconfigurer | None) -> Autopilot | None:
    """The autopilot (any mode, `off` included: it can be turned on at runtime), with the cached profile and the
    intents file when there are; None without a reconfigurer."""
    if reconfigurer is None:
        return None
    config = state.config
    model = Path(config.model_dir).name or config.model
    machine = machine_key(num_workers=len(config.worker_addresses))
    path = Path(config.profile_file) if config.profile_file else profile_path(model, machine)
    profile = None
    if path.is_file():
        try:
            profile = Profile.load(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("autopilot.profile_unreadable", path=str(path), error=str(exc))
    intents = load_intents(Path(config.intents_file)) if config.intents_file else None
    pilot_config = AutopilotConfig(mode=config.autopilot, interval_s=config.autopilot_interval_s,
                                   policy=parse_policy(config.autopilot_policy), profile_path=str(path))
    return Autopilot(reconfigurer, pilot_config, profile, intents, model=model, machine=machine)


async def _calibrate_at_start(autopilot: Autopilot, state: ControllerState) -> None:
    """The first start of an autopilot with no profile for this model and machine: measure one (in the background,
    once the router answers; the stack serves meanwhile)."""
    try:
        while (await state.refresh()).state is not StackState.SERVING:  # refresh paces itself by its RPC deadlines
            await state.wait_for_change(state.version, state.config.refresh_interval_s)
        plan = CalibrationPlan(layouts=default_layouts(autopilot.reconfigurer))
        log.info("autopilot.calibrating_at_start", layouts=list(plan.layouts))
        await autopilot.calibrate(plan)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 (the controller serves on; `reconfigctl calibrate` can retry)
        autopilot.error = f"calibration at start failed: {exc}"
        log.warning("autopilot.calibration_failed", error=str(exc))


async def start_controller_grpc(state: ControllerState, host: str, port: int, token: str,
                                servicer: ControllerServicer | None = None) -> tuple[grpc.aio.Server, int]:
    """Start the Controller service (every RPC needs the token); returns the server and the bound port."""
    server = new_server([TokenAuthInterceptor(token, protect_all), ErrorInterceptor()])
    servicer = servicer or ControllerServicer(state, make_reconfigurer(state))
    controller_pb2_grpc.add_ControllerServicer_to_server(servicer, server)
    bound = listen(server, host, port, "controller", state.config.tls)
    await server.start()
    return server, bound


def _stop_on_signals(stop: asyncio.Event) -> Callable[[], None]:
    """SIGTERM/SIGINT set `stop` (main thread only); returns a function that removes the handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def remove() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)

    return remove


async def serve_controller(config: ControllerConfig, on_ready: Callable[[int], None] | None = None,
                           handle_signals: bool = True) -> None:
    """Run the controller until cancelled (or SIGTERM/SIGINT when handle_signals); on_ready(bound_port) once up."""
    state = ControllerState(config)
    await state.open()
    await state.recover()
    stop = asyncio.Event()
    remove_handlers = _stop_on_signals(stop) if handle_signals else (lambda: None)
    server: grpc.aio.Server | None = None
    refresher: asyncio.Task | None = None
    watcher: asyncio.Task | None = None
    tasks: list[asyncio.Task] = []
    metrics_server = None
    try:
        reconfigurer = make_reconfigurer(state)
        autopilot = make_autopilot(state, reconfigurer)
        servicer = ControllerServicer(state, reconfigurer, autopilot=autopilot)
        server, port = await start_controller_grpc(state, config.host, config.port, config.token, servicer)
        refresher = asyncio.create_task(state.run(), name="controller-refresh")
        if servicer.recoverer is not None:  # heartbeats and router stalls trigger a recovery
            watcher = asyncio.create_task(servicer.recoverer.watch(), name="controller-recovery")
        if autopilot is not None:
            tasks.append(asyncio.create_task(autopilot.run(), name="autopilot"))
            if autopilot.profile is None and config.autopilot != "off" and config.calibrate_at_start:
                tasks.append(asyncio.create_task(_calibrate_at_start(autopilot, state), name="autopilot-calibrate"))
            if config.metrics_port is not None:
                metrics_server, _ = start_metrics_server(autopilot, config.host, config.metrics_port)
                log.info("controller.metrics", port=metrics_server.server_port)
        log.info("controller.ready", port=port, topology=config.topology, workers=len(config.worker_addresses),
                 router=config.router_grpc_address)
        if on_ready is not None:
            on_ready(port)
        await stop.wait()
        log.info("controller.stopping")
    finally:
        remove_handlers()
        for task in (*tasks, watcher, refresher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if server is not None:
            await server.stop(_GRACE_S)
        if metrics_server is not None:
            metrics_server.shutdown()
        await state.close()


def run_controller(config: ControllerConfig, ready: Connection | None = None) -> None:
    """Process target (LocalCluster.spawn_service): serve, and send {"port": bound_port} over `ready` once up."""
    from services.runtime.process import run_service

    on_ready = (lambda port: ready.send({"port": port})) if ready is not None else None
    run_service("controller", serve_controller(config, on_ready), ready)
