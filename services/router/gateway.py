"""The engine's side of its API server processes: each connection's requests, and one message per turn of the
engine's loop carrying every token those requests produced (services.router.ipc says what crosses).

    API server (HTTP, tokenizer, detokenizer, stop strings)  --("add", "finish")-->  ApiGateway --> Engine
    API server  <--("out": one message per step, every request of that server)--  GatewayStream <-- Engine

The engine puts a request's tokens into its GatewayStream as it does into an in-process RequestStream; the stream
only appends a tuple to its connection's next message, and the gateway sends every connection's message once the
loop turn that produced them is over. Text, stop strings and the SSE framing cost the engine nothing: a slow client
slows its API server, never the step loop.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import structlog

from services.contracts.step import TokenLogprob
from services.router import ipc
from services.router.contracts import EngineDrainingError, GenerationRequest, QueueFullError, RequestError
from services.router.load_window import RequestTimer
from services.router.metrics_merge import MergedRequestMetrics
from services.router.sequence import Sequence, SequenceStatus

log = structlog.get_logger(__name__)


class GatewayStream:
    """One API server's request as the engine streams it (an OutputStream)."""

    __slots__ = ("connection", "key", "request_id", "finished", "timer", "_prompt_logprobs_due")

    def __init__(self, connection: ApiConnection, key: int, request: GenerationRequest) -> None:
        self.connection, self.key, self.request_id = connection, key, request.request_id
        self.finished = False
        self.timer: RequestTimer | None = None
        self._prompt_logprobs_due = request.prompt_logprobs

    def push(self, new_token_ids: tuple[int, ...], seq: Sequence, logprobs: tuple[TokenLogprob, ...] = ()) -> bool:
        if self.finished:
            return False
        prompt_logprobs = None
        if self._prompt_logprobs_due and seq.has_prompt_logprobs:
            prompt_logprobs, self._prompt_logprobs_due = tuple(seq.prompt_logprobs), False
        reason = seq.status.finish_reason
        self.connection.put((self.key, new_token_ids, reason, None, logprobs, prompt_logprobs))
        if reason is not None:
            self._end()
        return False  # stop strings are the API server's: it tells the engine ("finish", key, "stop")

    def finish(self, reason: str, error: str | None = None) -> None:
        if not self.finished:
            self.connection.put((self.key, (), reason, error, (), None))
            self._end()

    def _end(self) -> None:
        self.finished = True
        self.connection.release(self)


class ApiConnection:
    """One API server: its requests by key, and the outputs of this loop turn not sent yet."""

    def __init__(self, gateway: ApiGateway, index: int, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.gateway, self.index, self.reader, self.writer = gateway, index, reader, writer
        self.streams: dict[int, GatewayStream] = {}
        self.outputs: list[tuple] = []
        self.ready = asyncio.get_running_loop().create_future()  # its HTTP server listens
        self.closed = asyncio.Event()  # the API server's end closed (it stopped, or died)

    def put(self, output: tuple) -> None:
        if not self.outputs:
            self.gateway.flush_soon(self)
        self.outputs.append(output)

    def flush(self) -> None:
        if self.outputs and not self.writer.is_closing():
            ipc.send(self.writer, ("out", self.outputs))
        self.outputs = []

    def release(self, stream: GatewayStream) -> None:
        """Its request ended (the end is in this turn's message): the engine lets it go."""
        if self.streams.get(stream.key) is stream:
            del self.streams[stream.key]
        self.gateway.engine.close_stream(stream.request_id, stream)

    async def serve(self) -> None:
        """Read the API server's messages until it closes; then abort what it left running."""
        engine = self.gateway.engine
        ipc.send(self.writer, ("hello", self.gateway.info))
        ipc.send(self.writer, ("state", engine.is_ready, engine.is_draining))
        try:
            while (message := await ipc.receive(self.reader)) is not None:
                self._handle(message)
        finally:
            for stream in list(self.streams.values()):
                stream.finish("abort")
            self.streams.clear()
            if not self.ready.done():
                self.ready.set_exception(ConnectionError(f"API server {self.index} closed before it was ready"))
            self.closed.set()

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            self._add(message[1], message[2])
        elif kind == "finish":
            self._finish(message[1], message[2])
        elif kind == "stats":
            engine = self.gateway.engine
            ipc.send(self.writer, ("stats", message[1], engine.stats(), engine.switch_totals()))
        elif kind == "metrics":
            self.gateway.metrics.update(self.index, message[2])
            if message[1] is not None:
                ipc.send(self.writer, ("metrics", message[1], self.gateway.render_metrics()))
        elif kind == "ready":
            if not self.ready.done():
                self.ready.set_result(None)
        else:
            log.warning("gateway.unknown_message", kind=kind, api_server=self.index)

    def _add(self, key: int, request: GenerationRequest) -> None:
        stream = GatewayStream(self, key, request)
        try:
            self.gateway.engine.open_stream(request, stream)
        except QueueFullError as exc:
            ipc.send(self.writer, ("refused", key, "queue_full", str(exc), exc.retry_after_s))
        except RequestError as exc:
            ipc.send(self.writer, ("refused", key, "invalid", str(exc), 0.0))
        except EngineDrainingError as exc:
            ipc.send(self.writer, ("refused", key, "draining", str(exc), 0.0))
        else:
            self.streams[key] = stream

    def _finish(self, key: int, reason: str) -> None:
        """The API server ended a request: its client went away ("abort"), or a stop string ("stop")."""
        stream = self.streams.pop(key, None)
        if stream is None:  # it ended here meanwhile
            return
        engine = self.gateway.engine
        if reason == "stop":
            engine.scheduler.finish(stream.request_id, SequenceStatus.FINISHED_STOPPED)
        else:
            engine.scheduler.abort(stream.request_id)  # in flight: marked now, freed when its step returns
        stream.finished = True  # the API server knows: nothing more goes to it
        engine.close_stream(stream.request_id, stream)
        engine.wake()


class ApiGateway:
    """The engine's API server connections: requests in, one message per loop turn out to each."""

    def __init__(self, engine, info: ipc.EngineInfo, render_engine_metrics: Callable[[], bytes]) -> None:
        self.engine = engine
        self.info = info
        self.connections: list[ApiConnection] = []
        self.metrics = MergedRequestMetrics()
        self._render_engine_metrics = render_engine_metrics
        self._dirty: list[ApiConnection] = []
        engine.draining_listeners.append(self.broadcast_state)

    async def serve(self, index: int, sock: socket.socket) -> ApiConnection:
        """Start serving an API server over its end of a socket pair; returns its connection (its `ready` future
        resolves when its HTTP server listens)."""
        reader, writer = await ipc.open_streams(sock)
        connection = ApiConnection(self, index, reader, writer)
        self.connections.append(connection)
        task = asyncio.ensure_future(connection.serve())
        task.add_done_callback(lambda _: self._closed(connection))
        return connection

    def _closed(self, connection: ApiConnection) -> None:
        if connection in self.connections:
            self.connections.remove(connection)
        connection.writer.close()

    def flush_soon(self, connection: ApiConnection) -> None:
        """Send `connection`'s outputs once this loop turn is over (with every other output it produces)."""
        if not self._dirty:
            asyncio.get_running_loop().call_soon(self._flush)
        self._dirty.append(connection)

    def _flush(self) -> None:
        dirty, self._dirty = self._dirty, []
        for connection in dirty:
            connection.flush()

    def broadcast_state(self) -> None:
        for connection in self.connections:
            ipc.send(connection.writer, ("state", self.engine.is_ready, self.engine.is_draining))

    def render_metrics(self) -> bytes:
        """The whole /metrics exposition: the engine's gauges and counters, then every API server's latencies."""
        return self._render_engine_metrics() + self.metrics.render()

    async def close(self) -> None:
        """End every connection (after the engine stopped: the last outputs go first); the API servers then stop."""
        self._flush()
        for connection in list(self.connections):
            connection.writer.close()
        for connection in list(self.connections):
            try:
                await connection.writer.wait_closed()
            except (ConnectionError, OSError):
                pass
