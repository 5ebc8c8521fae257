"""The front router process: the OpenAI HTTP API over the instances (services.router.api, unchanged) and the
Front gRPC service (list, drain, add, remove, start, stop instances) that `reconfigctl instances` calls."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from services.front.autoscale import Autoscaler, AutoscaleSettings
from services.front.engine import FrontEngine, FrontSettings
from services.front.instance_admin import MoveRefused
from services.front.instances import Instance
from services.front.launcher import InstanceLauncher, LaunchError, Launches, PipeLauncher
from services.front.mover import MoveSettings
from services.model.tokenizer import Tokenizer
from services.placement import POLICY_NAMES
from services.router.api.server import DEFAULT_KEEP_ALIVE_S, serve_until_signal
from services.rpc.auth import TokenAuthInterceptor, generate_token, protect_all
from services.rpc.errors import ErrorInterceptor
from services.rpc.reconfig.v1 import front_pb2, front_pb2_grpc
from services.rpc.server import listen, new_server
from services.rpc.tls import TLSConfig

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class FrontConfig:
    """Which instances the front router serves, where it listens, and how it places and moves requests."""

    instance_addresses: tuple[str, ...]  # the instance routers' gRPC addresses; instance i is named i0, i1, ...
    model_dir: str
    model_name: str = ""
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 0
    token: str | None = None             # control-plane token of the instances (and of the Front service)
    api_key: str | None = None
    policy: str = "mell"
    interval_s: float = 0.05
    migrate: bool = True
    max_precopy_rounds: int = 3
    http_keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    shutdown_grace_s: float = 5.0
    autoscale: AutoscaleSettings = AutoscaleSettings()  # start/stop instances by itself (needs the launcher)
    tls: TLSConfig | None = None         # mutual TLS on its gRPC server and its channels to the instances

    def __post_init__(self) -> None:
        if not self.instance_addresses:
            raise ValueError("the front router needs at least one instance address")
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {', '.join(POLICY_NAMES)}, not {self.policy!r}")
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")


def instance_status_pb(state: dict) -> front_pb2.InstanceStatus:
    return front_pb2.InstanceStatus(**state)


@contextlib.asynccontextmanager
async def _refusals(context, name: str):
    """An operation on instance `name`: NOT_FOUND when there is none, FAILED_PRECONDITION when it is refused."""
    try:
        yield
    except KeyError:
        await context.abort(grpc.StatusCode.NOT_FOUND, f"no instance named {name!r}")
    except MoveRefused as exc:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))


class FrontServicer(front_pb2_grpc.FrontServicer):
    """Thin: the engine decides, this converts."""

    def __init__(self, engine: FrontEngine, launches: Launches | None = None) -> None:
        self.engine = engine
        self.launches = launches  # None: a front started alone cannot start or stop instances' processes

    def _status(self, name: str) -> front_pb2.InstanceStatus:
        return instance_status_pb(next(s for s in self.engine.instance_states() if s["name"] == name))

    async def ListInstances(self, request, context):  # noqa: N802
        totals = self.engine.totals
        return front_pb2.ListInstancesResponse(
            instances=[instance_status_pb(s) for s in self.engine.instance_states()],
            policy=self.engine.settings.policy, moves=totals.moves, kv_bytes_moved=totals.kv_bytes_moved,
            time_average_instances=self.engine.time_average_instances(), num_replaced=totals.replaced)

    async def DrainInstance(self, request, context):  # noqa: N802
        async with _refusals(context, request.name):
            moved, failed, instance = await self.engine.drain_instance(request.name, request.drain)
        return front_pb2.DrainInstanceResponse(num_moved=moved, num_failed=failed,
                                               instance=self._status(instance.name))

    async def AddInstance(self, request, context):  # noqa: N802
        try:
            instance = await self.engine.add_instance(request.address)
        except grpc.aio.AioRpcError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{request.address} does not answer: {exc.details()}")
        return self._status(instance.name)

    async def RemoveInstance(self, request, context):  # noqa: N802
        async with _refusals(context, request.name):
            await self.engine.remove_instance(request.name)
        return front_pb2.RemoveInstanceResponse()

    async def StartInstance(self, request, context):  # noqa: N802
        if self.launches is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this front router was started alone: start the "
                                "instance's services yourself, then `reconfigctl instances add ADDRESS`")
        try:
            instance = await self.launches.start(request.topology)
        except (LaunchError, grpc.aio.AioRpcError) as exc:
            details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the instance did not start: {details}")
        return self._status(instance.name)

    async def StopInstance(self, request, context):  # noqa: N802
        if self.launches is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this front router was started alone: `reconfigctl "
                                "instances remove NAME`, then stop the instance's services yourself")
        try:
            async with _refusals(context, request.name):
                await self.launches.stop(request.name)
        except LaunchError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{request.name} is not served any more, but its "
                                f"processes did not stop: {exc}")
        return front_pb2.StopInstanceResponse()


async def start_front_grpc(engine: FrontEngine, host: str, port: int, token: str | None,
                           launches: Launches | None = None,
                           tls: TLSConfig | None = None) -> tuple[grpc.aio.Server, int]:
    server = new_server([TokenAuthInterceptor(token or generate_token(), protect_all), ErrorInterceptor()])
    front_pb2_grpc.add_FrontServicer_to_server(FrontServicer(engine, launches), server)
    bound = listen(server, host, port, "front gRPC server", tls)
    await server.start()
    return server, bound


def build_front(config: FrontConfig) -> FrontEngine:
    instances = [Instance(f"i{index}", address, config.token, tls=config.tls)
                 for index, address in enumerate(config.instance_addresses)]
    settings = FrontSettings(policy=config.policy, interval_s=config.interval_s, migrate=config.migrate,
                             move=MoveSettings(max_rounds=config.max_precopy_rounds))
    model_dir = Path(config.model_dir)
    return FrontEngine(instances, Tokenizer.from_dir(model_dir), config.model_name or model_dir.name, settings)


async def serve_front(config: FrontConfig, on_ready: Callable[[dict], None] | None = None,
                      launcher: InstanceLauncher | None = None, keep: tuple[str, ...] = ()) -> None:
    """Serve HTTP + the Front gRPC until SIGTERM/SIGINT; then drain and stop. launcher: starts and stops
    instances' processes (`reconfig up --instances`), except those in `keep`."""
    engine = build_front(config)
    await engine.start()
    launches = Launches(engine, launcher, keep) if launcher is not None else None
    autoscaler = None
    if launches is not None and config.autoscale.enabled:
        autoscaler = engine.autoscaler = Autoscaler(engine, launches, config.autoscale)
        autoscaler.start()
    grpc_server, grpc_port = await start_front_grpc(engine, config.host, config.grpc_port, config.token, launches,
                                                    config.tls)
    try:
        await serve_until_signal(engine, grpc_server, grpc_port, host=config.host, http_port=config.http_port,
                                 api_key=config.api_key, keep_alive_s=config.http_keep_alive_s,
                                 shutdown_grace_s=config.shutdown_grace_s, service="front", on_ready=on_ready,
                                 instances=len(config.instance_addresses), policy=config.policy)
    finally:
        if autoscaler is not None:
            await autoscaler.stop()


def run_front(config: FrontConfig, launcher_connection=None, keep: tuple[str, ...] = (), ready=None) -> None:
    """Process target (LocalCluster.spawn_service): serve and report readiness over `ready`; with the launcher's
    pipe, start and stop instances (all but `keep`)."""
    from services.runtime.process import run_service

    launcher = PipeLauncher(launcher_connection) if launcher_connection is not None else None
    run_service("front", serve_front(config, on_ready=ready.send if ready else None, launcher=launcher, keep=keep),
                ready)
