"""The engine process's API servers (`--api-servers N`): started as processes of their own on the HTTP socket the
engine binds, connected by socket pairs to its gateway, started again if one dies, and stopped after the engine
drained (services.router.api.process is their side).

On SIGTERM/SIGINT the engine drains first: new requests get 503 `shutting_down` with `Connection: close`, admitted
ones finish within the grace period; then the engine stops (what is still running ends with an error event that
says the server is stopping), closes every API server's connection, and waits for them to exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import signal
import socket
from collections.abc import Callable

import structlog

from services.router.api.process import ApiServerConfig, run_api_server
from services.router.api.server import bind_http_socket
from services.router.gateway import ApiConnection, ApiGateway

log = structlog.get_logger(__name__)
START_TIMEOUT_S = 120.0
LISTEN_BACKLOG = 2048


class ApiServerPool:
    """N API server processes over one gateway; a server that dies is started again (its requests end with an
    error: their clients were on its connections)."""

    def __init__(self, gateway: ApiGateway, listen_socket: socket.socket, config: ApiServerConfig,
                 num_servers: int) -> None:
        self.gateway, self.listen_socket, self.config, self.num_servers = gateway, listen_socket, config, num_servers
        self.processes: dict[int, mp.process.BaseProcess] = {}
        self._next_index = 0
        self._stopping = False
        self._watchers: set[asyncio.Task] = set()

    @property
    def pids(self) -> dict[str, int]:
        return {f"api-{slot}": process.pid for slot, process in self.processes.items()}

    async def start(self) -> None:
        """Start every server and wait until each listens."""
        connections = [await self._spawn(slot) for slot in range(self.num_servers)]
        await asyncio.wait_for(asyncio.gather(*(c.ready for c in connections)), START_TIMEOUT_S)

    async def _spawn(self, slot: int) -> ApiConnection:
        ours, theirs = socket.socketpair()
        index, self._next_index = self._next_index, self._next_index + 1  # a restarted server reports anew
        config = ApiServerConfig(index=index, api_key=self.config.api_key, keep_alive_s=self.config.keep_alive_s)
        process = mp.get_context("spawn").Process(target=run_api_server, args=(config, self.listen_socket, theirs),
                                                  name=f"reconfig-api-{slot}", daemon=False)
        process.start()
        theirs.close()
        self.processes[slot] = process
        connection = await self.gateway.serve(index, ours)
        watcher = asyncio.ensure_future(self._watch(slot, process, connection))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        return connection

    async def _watch(self, slot: int, process: mp.process.BaseProcess, connection: ApiConnection) -> None:
        await connection.closed.wait()
        if self._stopping:
            return
        await asyncio.get_running_loop().run_in_executor(None, process.join, 10)
        log.error("api.server_lost", slot=slot, pid=process.pid, exitcode=process.exitcode)
        try:
            await asyncio.wait_for((await self._spawn(slot)).ready, START_TIMEOUT_S)
        except (asyncio.TimeoutError, ConnectionError) as exc:
            log.error("api.server_restart_failed", slot=slot, error=str(exc))

    async def stop(self, timeout_s: float = 15.0) -> None:
        """After the gateway closed the connections: wait for the servers to exit (then kill what is left)."""
        self._stopping = True
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, p.join, timeout_s) for p in self.processes.values()))
        for process in self.processes.values():
            if process.is_alive():
                log.warning("api.server_kill", pid=process.pid)
                process.kill()
                process.join(5)
        for watcher in self._watchers:
            watcher.cancel()


async def serve_with_api_servers(engine, grpc_server, grpc_port: int, *, host: str, http_port: int,
                                 num_servers: int, config: ApiServerConfig, info, render_engine_metrics,
                                 shutdown_grace_s: float, on_ready: Callable[[dict], None] | None = None) -> None:
    """Serve until SIGTERM/SIGINT with `num_servers` API server processes; then drain, stop and end them."""
    listen_socket = bind_http_socket(host, http_port)
    listen_socket.listen(LISTEN_BACKLOG)
    gateway = ApiGateway(engine, info, render_engine_metrics)
    pool = ApiServerPool(gateway, listen_socket, config, num_servers)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await pool.start()
        ready = {"http_port": listen_socket.getsockname()[1], "grpc_port": grpc_port,
                 "max_model_len": engine.max_model_len, "context_note": engine.context_note, "pids": pool.pids}
        log.info("router.ready", **{k: v for k, v in ready.items() if k != "pids"}, api_servers=num_servers,
                 model=engine.model_name, topology=str(engine.topology))
        if on_ready is not None:
            on_ready(ready)
        await stop.wait()
    finally:
        unfinished = await engine.drain(shutdown_grace_s)
        await grpc_server.stop(grace=2.0)
        await engine.stop()
        await gateway.close()
        await pool.stop()
        with contextlib.suppress(OSError):
            listen_socket.close()
        log.info("router.stopped", unfinished=unfinished)
