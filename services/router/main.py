"""Router process: the engine over the workers' step streams, the OpenAI HTTP API and the gRPC service."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from services.model.spec import ModelSpec
from services.model.tokenizer import Tokenizer
from services.router.api.server import DEFAULT_KEEP_ALIVE_S, serve_until_signal
from services.router.config import SchedulerConfig
from services.router.driver import Driver
from services.router.engine import Engine
from services.router.expert_balance import EplbSettings
from services.rpc.tls import TLSConfig

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
    spread_decodes: bool = False         # PP: decodes spread over the micro-batches in flight (SchedulerConfig)
    async_scheduling: bool = True        # single-stage layouts: decodes go a step ahead (SchedulerConfig)
    api_servers: int = 1                 # HTTP in that many processes of their own; 0: in this process
    tls: TLSConfig | None = None         # mutual TLS on its gRPC server and to the workers (None: plaintext)

    def __post_init__(self) -> None:
        if self.http_keep_alive_s <= 0:
            raise ValueError("http_keep_alive_s must be > 0")
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown_grace_s must be >= 0")
        if self.api_servers < 0:
            raise ValueError("api_servers must be >= 0")


async def build_engine(config: RouterConfig) -> Engine:
    """Connect to the workers and start the engine loop."""
    model_dir = Path(config.model_dir)
    spec = ModelSpec.from_dir(model_dir)
    driver = Driver(list(config.worker_addresses), token=config.token, tls=config.tls)
    await driver.connect()
    # A request must fit the model's positions and the KV cache (as vLLM caps max_model_len).
    kv_tokens = driver.num_kv_blocks * driver.block_size
    max_model_len = min(spec.max_position_embeddings, kv_tokens)
    scheduler_config = SchedulerConfig(
        max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, max_waiting=config.max_waiting,
        spread_decodes=config.spread_decodes, async_scheduling=config.async_scheduling,
    )
    engine = Engine(driver, Tokenizer.from_dir(model_dir), config.model_name or model_dir.name,
                    max_model_len, scheduler_config, vocab_size=spec.vocab_size,
                    recovery_timeout_s=config.recovery_timeout_s,
                    eplb=EplbSettings(enabled=config.eplb, step_interval=config.eplb_step_interval))
    if kv_tokens < spec.max_position_embeddings:
        engine.context_note = (f"the model allows {spec.max_position_embeddings} tokens; the KV cache holds "
                               f"{kv_tokens}: a larger --kv-cache-mb allows longer requests")
    await engine.start()
    return engine


async def serve_router(config: RouterConfig, on_ready: Callable[[dict], None] | None = None) -> None:
    """Serve HTTP + gRPC until SIGTERM/SIGINT; then drain (services.router.api.server), and stop the engine. HTTP is
    served by config.api_servers processes of their own (services.router.api_servers), or by this one with 0."""
    from services.router.grpc_server import start_router_grpc
    from services.runtime.process import settle_heap

    engine = await build_engine(config)
    grpc_server, grpc_port = await start_router_grpc(engine, config.host, config.grpc_port, config.token,
                                                      config.tls)
    settle_heap()
    if config.api_servers == 0:
        await serve_until_signal(engine, grpc_server, grpc_port, host=config.host, http_port=config.http_port,
                                 api_key=config.api_key, keep_alive_s=config.http_keep_alive_s,
                                 shutdown_grace_s=config.shutdown_grace_s, service="router", on_ready=on_ready,
                                 topology=str(engine.topology))
        return
    from services.router.api.metrics import render_engine_metrics
    from services.router.api.process import ApiServerConfig
    from services.router.api_servers import serve_with_api_servers
    from services.router.ipc import EngineInfo

    info = EngineInfo(model_name=engine.model_name, model_dir=config.model_dir, max_model_len=engine.max_model_len,
                      context_note=engine.context_note, vocab_size=engine.vocab_size)
    await serve_with_api_servers(
        engine, grpc_server, grpc_port, host=config.host, http_port=config.http_port, num_servers=config.api_servers,
        config=ApiServerConfig(index=0, api_key=config.api_key, keep_alive_s=config.http_keep_alive_s), info=info,
        render_engine_metrics=lambda: render_engine_metrics(engine, engine.model_name),
        shutdown_grace_s=config.shutdown_grace_s, on_ready=on_ready)


def run_router(config: RouterConfig, ready=None) -> None:
    """Process target (LocalCluster.spawn_service): serve and report readiness over `ready`."""
    from services.runtime.process import run_service

    run_service("router", serve_router(config, on_ready=ready.send if ready else None), ready)
