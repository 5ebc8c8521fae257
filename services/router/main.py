"""Router process: the engine over the workers' step streams, the OpenAI HTTP API and the gRPC service."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from services.launch.driver import Driver
from services.model.spec import ModelSpec
from services.model.tokenizer import Tokenizer
from services.router.api.server import DEFAULT_KEEP_ALIVE_S, HttpServer, bind_http_socket
from services.router.config import SchedulerConfig
from services.router.engine import Engine
from services.router.expert_balance import EplbSettings
from services.topology import Topology

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Where the router listens, which workers it drives, and its scheduling limits."""

    worker_addresses: tuple[str, ...]
    model_dir: str
    model_name: str = ""                 # served model id; defaults to the directory / preset name
    host: str = "127.0.0.1"
    http_port: int = 8000                # 0: any free port (reported on ready)
    grpc_port: int = 0
    token: str | None = None             # control-plane token protecting the admin RPCs
    api_key: str | None = None           # optional bearer key for the OpenAI API
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024
    recovery_timeout_s: float = 60.0     # a stalled engine (a worker failed a step) fails its requests past this
    http_keep_alive_s: float = DEFAULT_KEEP_ALIVE_S  # idle HTTP connections live this long: past client pools
    shutdown_grace_s: float = 5.0        # on SIGTERM, admitted requests get this long to finish (new ones: 503)
    eplb: bool = False                   # MoE, EP layouts: rebalance the experts every eplb_step_interval steps
    eplb_step_interval: int = 3000

    def __post_init__(self) -> None:
        if self.http_keep_alive_s <= 0:
            raise ValueError("http_keep_alive_s must be > 0")
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown_grace_s must be >= 0")


async def build_engine(config: RouterConfig) -> Engine:
    """Connect to the workers and start the engine loop."""
    model_dir = Path(config.model_dir)
    spec = ModelSpec.from_dir(model_dir)
    driver = Driver(list(config.worker_addresses), token=config.token)
    await driver.connect()
    # A request must fit the model's positions and the KV cache (as vLLM caps max_model_len).
    max_model_len = min(spec.max_position_embeddings, driver.num_kv_blocks * driver.block_size)
    scheduler_config = SchedulerConfig(
        max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, max_waiting=config.max_waiting,
        num_inflight_batches=Topology.parse(driver.infos[0].topology).pp,  # one micro-batch per PP stage
    )
    engine = Engine(driver, Tokenizer.from_dir(model_dir), config.model_name or model_dir.name,
                    max_model_len, scheduler_config, vocab_size=spec.vocab_size,
                    recovery_timeout_s=config.recovery_timeout_s,
                    eplb=EplbSettings(enabled=config.eplb, step_interval=config.eplb_step_interval))
    await engine.start()
    return engine


async def serve_router(config: RouterConfig, on_ready: Callable[[dict], None] | None = None) -> None:
    """Serve HTTP + gRPC until SIGTERM/SIGINT; then drain (services.router.api.server), and stop the engine."""
    from services.router.api.app import ApiConfig, create_app
    from services.router.grpc_server import start_router_grpc

    engine = await build_engine(config)
    app = create_app(engine, ApiConfig(model_name=engine.model_name, api_key=config.api_key))
    http_socket = bind_http_socket(config.host, config.http_port)
    http = HttpServer(app, config.http_keep_alive_s, is_draining=lambda: engine.is_draining)
    http_task = await http.start(http_socket)
    grpc_server, grpc_port = await start_router_grpc(engine, config.host, config.grpc_port, config.token)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = {"http_port": http_socket.getsockname()[1], "grpc_port": grpc_port}
    log.info("router.ready", **ready, model=engine.model_name, topology=str(engine.topology))
    if on_ready is not None:
        on_ready(ready)
    try:
        await asyncio.wait([asyncio.ensure_future(stop.wait()), http_task], return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Drain first: admitted requests finish over open connections while new ones get 503 (Connection: close);
        # only then does the server stop listening and close its idle connections.
        unfinished = await engine.drain(config.shutdown_grace_s)
        http.should_exit = True
        await grpc_server.stop(grace=2.0)
        await engine.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(http_task, 5)
        log.info("router.stopped", unfinished=unfinished)


def run_router(config: RouterConfig, ready=None) -> None:
    """Process target (LocalCluster.spawn_service): serve and report readiness over `ready`."""
    from services.launch.process import run_service

    run_service("router", serve_router(config, on_ready=ready.send if ready else None), ready)
