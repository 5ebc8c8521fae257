"""An API server process: the OpenAI HTTP API over the engine process (`reconfig up --api-servers N`).

Each API server accepts on the HTTP socket its engine bound (the kernel spreads connections over them), tokenizes,
and streams what the engine sends it (services.router.api.engine_client). It lives as long as its connection to the
engine: the engine drains, stops and then closes it, and the server ends once its responses are out. Ctrl-C and
SIGTERM are the engine's to act on (they reach a terminal's whole process group); a dead engine process takes its
API servers with it (their parent-death signal).
"""

from __future__ import annotations

import asyncio
import ctypes
import signal
import socket
from dataclasses import dataclass

REPORT_INTERVAL_S = 1.0  # how often a server's latency samples reach the engine's /metrics (when they changed)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class ApiServerConfig:
    """What an API server process needs besides its sockets."""

    index: int
    api_key: str | None = None
    keep_alive_s: float = 120.0


def run_api_server(config: ApiServerConfig, listen_socket: socket.socket, engine_socket: socket.socket) -> None:
    """Process target: serve HTTP on `listen_socket` (bound) over the engine at the other end of `engine_socket`."""
    from services.logs import configure_logging

    configure_logging(f"api-{config.index}")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the engine ends this server by closing its connection
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    try:
        import uvloop

        uvloop.run(serve_api(config, listen_socket, engine_socket))
    except ImportError:
        asyncio.run(serve_api(config, listen_socket, engine_socket))


async def serve_api(config: ApiServerConfig, listen_socket: socket.socket, engine_socket: socket.socket) -> None:
    import structlog

    from services.router.api.app import ApiConfig, create_app
    from services.router.api.engine_client import EngineClient
    from services.router.api.server import HttpServer
    from services.runtime.process import settle_heap

    log = structlog.get_logger("api")
    client = await EngineClient.connect(engine_socket)
    app = create_app(client, ApiConfig(model_name=client.model_name, api_key=config.api_key))
    http = HttpServer(app, config.keep_alive_s, is_draining=lambda: client.is_draining)
    http_task = await http.start(listen_socket)
    settle_heap()
    client.ready()
    log.info("api.ready", index=config.index, model=client.model_name)
    reporter = asyncio.ensure_future(_report_metrics(client, app.state.metrics))
    try:
        await client.closed.wait()  # the engine drained and stopped: the last events are in the streams
    finally:
        reporter.cancel()
        http.should_exit = True
        try:
            await asyncio.wait_for(http_task, 10)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            http_task.cancel()
        await client.close()
        log.info("api.stopped", index=config.index)


async def _report_metrics(client, metrics) -> None:
    """Send this server's latency samples to the engine whenever requests finished since the last report."""
    reported = 0
    while True:
        await asyncio.sleep(REPORT_INTERVAL_S)
        if metrics.num_observed != reported:
            reported = metrics.num_observed
            client.report_metrics(metrics.samples())
