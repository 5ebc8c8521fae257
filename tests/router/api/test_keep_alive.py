"""The keep-alive race (issue 19): a connection the router closes is never one a client just sent a request on.

Each race is reproduced deterministically and shown to lose the request under uvicorn's stock behaviour, then shown
to be answered by the router's HTTP server (services.router.api.server). The app behind the server does not matter
to connection handling, so a minimal ASGI app stands in for the engine here; the live-server tests run the same
server over the real engine.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.router.api.server import (
    DEFAULT_KEEP_ALIVE_S, GracefulH11Protocol, GracefulHttpToolsProtocol, HttpServer, bind_http_socket, unread_bytes,
)
from tests.conftest import wait_until

GRACEFUL = pytest.mark.parametrize("graceful", [GracefulHttpToolsProtocol, GracefulH11Protocol],
                                   ids=["httptools", "h11"])

UVICORN_DEFAULT_KEEP_ALIVE_S = 5.0       # what the router used before: uvicorn's default
CLIENT_POOL_EXPIRY_S = httpx.Limits().keepalive_expiry  # 5 s: httpx's pool, and so the openai client's
COMMON_CLIENT_POOL_EXPIRY_S = {"httpx/openai": CLIENT_POOL_EXPIRY_S, "undici": 4.0, "aiohttp": 15.0, "go": 90.0}
REQUEST = b"GET / HTTP/1.1\r\nhost: test\r\n\r\n"


async def ok_app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@contextlib.asynccontextmanager
async def serving(keep_alive_s: float = DEFAULT_KEEP_ALIVE_S, protocol: type | None = None, is_draining=lambda: False):
    """The router's HTTP server over ok_app on a free port (optionally with another HTTP protocol class)."""
    server = HttpServer(ok_app, keep_alive_s, is_draining)
    if protocol is not None:
        server.config.http = protocol
    sock = bind_http_socket("127.0.0.1", 0)
    task = await server.start(sock)
    try:
        yield server, sock.getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


async def reuse_at_pool_expiry(keep_alive_s: float) -> BaseException | None:
    """A pooled client reuses its connection just before its pool's expiry, and its busy event loop writes the
    request a moment later (an async trace hook holds the write), after the server's idle deadline: the error, or
    None when the request was answered on the reused connection."""
    idle_s, write_delay_s = CLIENT_POOL_EXPIRY_S - 1.0, 2.0  # taken at expiry - 1 s, written at expiry + 1 s
    events: list[str] = []

    async def record(name: str, info: dict) -> None:
        events.append(name)

    async def write_late(name: str, info: dict) -> None:
        events.append(name)
        if name == "http11.send_request_headers.started":
            await asyncio.sleep(write_delay_s)  # not synchronisation: the late write under test

    async with serving(keep_alive_s) as (_, port), httpx.AsyncClient() as client:
        url = f"http://127.0.0.1:{port}/"
        assert (await client.get(url, extensions={"trace": record})).status_code == 200
        await asyncio.sleep(idle_s)  # not synchronisation: the connection idles in the pool, the situation under test
        try:
            response = await client.get(url, extensions={"trace": write_late})
        except httpx.TransportError as exc:
            return exc
        assert response.status_code == 200
        assert events.count("connection.connect_tcp.started") == 1, "the pooled connection was not reused"
        return None


async def test_a_client_reusing_its_pooled_connection_at_expiry_is_answered():
    old, new = await asyncio.gather(reuse_at_pool_expiry(UVICORN_DEFAULT_KEEP_ALIVE_S),
                                    reuse_at_pool_expiry(DEFAULT_KEEP_ALIVE_S))
    # uvicorn's 5 s equals the client's pool: the request meets the server's close and is lost.
    assert isinstance(old, httpx.ReadError | httpx.RemoteProtocolError), old
    assert new is None, f"the router's server lost the request: {new!r}"


def test_the_idle_timeout_outlives_common_client_pools():
    assert DEFAULT_KEEP_ALIVE_S > max(COMMON_CLIENT_POOL_EXPIRY_S.values())


async def send_behind_the_loop(port: int, server: HttpServer, fire) -> tuple[bytes, asyncio.StreamReader,
                                                                              asyncio.StreamWriter]:
    """Open a connection, get one answer, then write a second request and, before the event loop reads it, run
    `fire(protocol)` (an idle deadline or a shutdown landing in the same loop turn); returns the second answer (b""
    when the connection was reset or closed instead) and the open streams."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(REQUEST)
    assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
    [protocol] = server.server_state.connections
    writer.write(REQUEST)  # the socket sends at once; the server's loop does not run until we await
    # The kernel may deliver loopback data in its softirq. wait_until blocks the loop on purpose: the server must
    # not read the request before fire().
    wait_until(lambda: unread_bytes(protocol.transport) >= len(REQUEST), timeout_s=10,
               what="the request to reach the server's socket", interval_s=0.001)
    fire(protocol)
    try:
        return await asyncio.wait_for(reader.readuntil(b"ok"), 10), reader, writer
    except (asyncio.IncompleteReadError, ConnectionResetError):
        return b"", reader, writer


@pytest.mark.parametrize("stock", [HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
@pytest.mark.parametrize("hook", ["timeout_keep_alive_handler", "shutdown"], ids=["idle-deadline", "shutdown"])
async def test_stock_uvicorn_drops_a_request_waiting_in_the_socket(stock, hook):
    async with serving(protocol=stock) as (server, port):
        answer, _, writer = await send_behind_the_loop(port, server, getattr(stock, hook))
        writer.close()
        assert answer == b""


@GRACEFUL
async def test_a_request_waiting_when_the_idle_deadline_fires_is_answered(graceful):
    async with serving(protocol=graceful) as (server, port):
        answer, reader, writer = await send_behind_the_loop(port, server, graceful.timeout_keep_alive_handler)
        assert answer.startswith(b"HTTP/1.1 200")
        writer.write(REQUEST)  # and the connection lives on
        assert (await asyncio.wait_for(reader.readuntil(b"ok"), 10)).startswith(b"HTTP/1.1 200")
        writer.close()


@GRACEFUL
async def test_a_request_waiting_when_shutdown_starts_is_answered_then_the_connection_closes(graceful):
    async with serving(protocol=graceful) as (server, port):
        answer, reader, writer = await send_behind_the_loop(port, server, graceful.shutdown)
        assert answer.startswith(b"HTTP/1.1 200")
        assert await asyncio.wait_for(reader.read(), 10) == b""  # then closed by the server
        writer.close()


async def test_responses_announce_the_idle_timeout_and_close_while_draining():
    draining = False
    async with serving(is_draining=lambda: draining) as (_, port), httpx.AsyncClient() as client:
        response = await client.get(f"http://127.0.0.1:{port}/")
        assert response.headers["keep-alive"] == f"timeout={int(DEFAULT_KEEP_ALIVE_S)}"
        draining = True
        response = await client.get(f"http://127.0.0.1:{port}/")
        assert response.headers["connection"] == "close" and "keep-alive" not in response.headers


def test_the_server_frames_with_httptools():
    assert HttpServer(ok_app).config.http is GracefulHttpToolsProtocol


def test_a_non_positive_idle_timeout_is_refused():
    with pytest.raises(ValueError, match="keep_alive_s"):
        HttpServer(ok_app, 0)
