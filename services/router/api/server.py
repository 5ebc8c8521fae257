"""The router's HTTP server: uvicorn, set up so that a connection it closes never carries a request it will not answer.

HTTP/1.1 clients keep idle connections in a pool and reuse them until their own idle expiry (httpx and the openai
client built on it: 5 s; undici: 4 s; aiohttp: 15 s; Go's net/http: 90 s). A server that closes an idle connection
races with a client that reuses it: the client checks the connection is still open, writes its request a moment
later, and meets the server's close; the request dies with a reset and nobody retries it (a POST is not
idempotent). uvicorn closes idle connections after 5 s, the same as httpx's pool, so under load a client picking a
connection idle for just under 5 s loses that race (tests/router/api/test_keep_alive.py reproduces it). Three rules:

- the server's idle timeout outlives the common client pools (120 s by default), so the client always closes first;
  responses say `Keep-Alive: timeout=N` for the clients that read it (undici does);
- a connection is never closed while request bytes wait unread in its socket (the idle timer or a shutdown can fire
  in the same loop turn a request arrives; uvloop runs due timers before it reads sockets);
- on shutdown the router drains: it refuses new requests with 503 and `Connection: close`, lets the admitted ones
  finish within a grace period, and only then stops listening and closes what is idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import struct
import termios
from collections.abc import Callable

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

DEFAULT_KEEP_ALIVE_S = 120.0  # longer than every common client pool's idle expiry (Go's net/http: 90 s)


def unread_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes received on the transport's socket that the event loop has not read yet (0 once it is closing)."""
    sock = transport.get_extra_info("socket")
    if sock is None or transport.is_closing():
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:  # already closed under us
        return 0


class _Graceful:
    """What both of uvicorn's HTTP/1.1 protocols get here: no connection closes holding a request it has not read
    yet (mixed in before H11Protocol or HttpToolsProtocol, which name these hooks alike)."""

    _close_when_idle = False  # a shutdown found a request waiting: answer it, then close

    def timeout_keep_alive_handler(self) -> None:
        if unread_bytes(self.transport):
            # A request arrived in the same loop turn as the idle deadline: it is read next. Re-arm, so that a peer
            # that sent half a request and went silent is still closed.
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)
            return
        super().timeout_keep_alive_handler()

    def shutdown(self) -> None:
        if (self.cycle is None or self.cycle.response_complete) and unread_bytes(self.transport):
            self._close_when_idle = True
            return
        super().shutdown()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._close_when_idle:
            self.shutdown()


class GracefulH11Protocol(_Graceful, H11Protocol):
    """uvicorn's pure-Python HTTP/1.1 protocol, graceful."""


class GracefulHttpToolsProtocol(_Graceful, HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol over httptools (C), graceful: what the router serves with (h11 costs ~130 us of
    CPU for every server-sent event it frames)."""


class ConnectionHeadersMiddleware:
    """Tells clients how long an idle connection lives (`Keep-Alive: timeout=N`), or, while the server drains,
    that this connection ends with the response (`Connection: close`), so that no client reuses it."""

    def __init__(self, app: ASGIApp, keep_alive_s: float, is_draining: Callable[[], bool]) -> None:
        self.app = app
        self._keep_alive = (b"keep-alive", f"timeout={int(keep_alive_s)}".encode())
        self._is_draining = is_draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                header = (b"connection", b"close") if self._is_draining() else self._keep_alive
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class HttpServer(uvicorn.Server):
    """uvicorn for the router: the graceful protocol, the idle timeout above, no signal handling of its own (the
    router process owns SIGTERM/SIGINT and drains before it stops this server)."""

    def __init__(self, app: ASGIApp, keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
                 is_draining: Callable[[], bool] = lambda: False) -> None:
        if keep_alive_s <= 0:
            raise ValueError("keep_alive_s must be > 0")
        super().__init__(uvicorn.Config(
            ConnectionHeadersMiddleware(app, keep_alive_s, is_draining), http=GracefulHttpToolsProtocol,
            timeout_keep_alive=keep_alive_s, log_level="warning", access_log=False, lifespan="off",
        ))

    @contextlib.contextmanager
    def capture_signals(self):  # uvicorn >= 0.29
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass

    async def start(self, sock: socket.socket) -> asyncio.Task:
        """Serve on `sock` (bound); returns the serving task once the server accepts connections."""
        task = asyncio.create_task(self.serve(sockets=[sock]))
        while not self.started:
            if task.done():
                await task  # surfaces the startup error
            await asyncio.sleep(0.01)
        return task


def bind_http_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for the HTTP server (port 0: any free port)."""
    # IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only for sockets it can tell are TCP; otherwise
    # every response and SSE event waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"the HTTP server cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


async def serve_until_signal(engine, grpc_server, grpc_port: int, *, host: str, http_port: int, api_key: str | None,
                             keep_alive_s: float, shutdown_grace_s: float, service: str,
                             on_ready: Callable[[dict], None] | None = None, **fields) -> None:
    """Serve the OpenAI API over `engine` (and its already started gRPC server) until SIGTERM/SIGINT or the HTTP
    server ends; then drain: admitted requests finish over open connections while new ones get 503
    (Connection: close), and only then do the servers stop listening and the engine stop."""
    import signal

    import structlog

    from services.router.api.app import ApiConfig, create_app

    log = structlog.get_logger(service)
    app = create_app(engine, ApiConfig(model_name=engine.model_name, api_key=api_key))
    http_socket = bind_http_socket(host, http_port)
    http = HttpServer(app, keep_alive_s, is_draining=lambda: engine.is_draining)
    http_task = await http.start(http_socket)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = {"http_port": http_socket.getsockname()[1], "grpc_port": grpc_port,
             "max_model_len": engine.max_model_len, "context_note": engine.context_note}
    log.info(f"{service}.ready", **ready, model=engine.model_name, **fields)
    if on_ready is not None:
        on_ready(ready)
    try:
        await asyncio.wait([asyncio.ensure_future(stop.wait()), http_task], return_when=asyncio.FIRST_COMPLETED)
    finally:
        unfinished = await engine.drain(shutdown_grace_s)
        http.should_exit = True
        await grpc_server.stop(grace=2.0)
        await engine.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(http_task, 5)
        log.info(f"{service}.stopped", unfinished=unfinished)
