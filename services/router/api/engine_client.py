"""The engine as an API server process sees it (EngineProtocol over services.router.ipc): requests go to the engine
process already tokenized, token ids come back one message per step, and everything a client sees is made here:
the text (incremental detokenization), stop strings (found here, then ended in the engine), logprobs, latencies.

A request's tokens wait in its RequestStream until its consumer (the HTTP response) takes them; a consumer that lags
takes everything that arrived meanwhile as one delta, so a slow client costs one event, not one per token, and
never holds the engine back.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import AsyncIterator

import structlog

from services.model.tokenizer import Tokenizer
from services.router import ipc
from services.router.contracts import (
    EngineDrainingError,
    EngineStats,
    GenerationDelta,
    GenerationRequest,
    QueueFullError,
    RequestError,
    SwitchTotals,
)
from services.router.output import RequestStream
from services.router.sequence import Sequence, SequenceStatus

log = structlog.get_logger(__name__)
_STATUS = {"stop": SequenceStatus.FINISHED_STOPPED, "length": SequenceStatus.FINISHED_LENGTH,
           "abort": SequenceStatus.FINISHED_ABORTED}
ENGINE_GONE = "the engine process ended; retry the request"


class _Request:
    """One request of this API server: its output stream and the state the stream reads."""

    __slots__ = ("stream", "seq")

    def __init__(self, request: GenerationRequest, tokenizer: Tokenizer) -> None:
        self.stream = RequestStream(request, tokenizer)
        self.seq = Sequence.from_request(request)


def merge_deltas(deltas: list[GenerationDelta]) -> GenerationDelta:
    """Several deltas of one request as one (its consumer lagged behind the steps)."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    prompt_logprobs = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    return GenerationDelta(
        token_ids=tuple(t for d in deltas for t in d.token_ids), text="".join(d.text for d in deltas),
        finish_reason=last.finish_reason, num_prompt_tokens=last.num_prompt_tokens,
        num_generated_tokens=last.num_generated_tokens, error=last.error,
        logprobs=tuple(lp for d in deltas for lp in d.logprobs), prompt_logprobs=prompt_logprobs)


class EngineClient:
    """An API server's connection to the engine process (EngineProtocol)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, info: ipc.EngineInfo) -> None:
        self._reader, self._writer = reader, writer
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.context_note = info.context_note
        self.vocab_size = info.vocab_size
        self.tokenizer = Tokenizer.from_dir(info.model_dir)
        self.is_draining = False
        self._engine_ready = False
        self._requests: dict[int, _Request] = {}
        self._keys = itertools.count()
        self._tags = itertools.count()
        self._replies: dict[int, asyncio.Future] = {}
        self._stats: tuple[EngineStats, SwitchTotals] | None = None
        self.closed = asyncio.Event()  # the engine ended the connection: this server stops
        self._task = asyncio.ensure_future(self._read())

    @classmethod
    async def connect(cls, sock: socket.socket) -> EngineClient:
        """Open the connection over this process's end of the socket pair; waits for the engine's hello."""
        reader, writer = await ipc.open_streams(sock)
        message = await ipc.receive(reader)
        if not (isinstance(message, tuple) and message[0] == "hello"):
            raise ConnectionError(f"the engine did not say hello: {message!r}")
        return cls(reader, writer, message[1])

    @property
    def is_ready(self) -> bool:
        return self._engine_ready and not self.is_draining and not self.closed.is_set()

    def ready(self) -> None:
        """Tell the engine this server's HTTP listens."""
        ipc.send(self._writer, ("ready",))

    # ---- EngineProtocol --------------------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        if self.closed.is_set():
            raise EngineDrainingError(ENGINE_GONE)
        key = next(self._keys)
        self._requests[key] = entry = _Request(request, self.tokenizer)
        stream = entry.stream
        ipc.send(self._writer, ("add", key, request))
        try:
            while True:
                delta = await stream.get()  # raises the engine's refusal
                if more := stream.drain():  # the consumer lagged behind the steps: one delta for all
                    delta = merge_deltas([delta, *more])
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            if self._requests.pop(key, None) is not None and not self.closed.is_set():
                ipc.send(self._writer, ("finish", key, "abort"))  # its consumer went away while it ran

    def stats(self) -> EngineStats:
        """The engine's stats as of the last refresh_stats()."""
        if self._stats is None:
            raise RuntimeError("no engine stats yet: await refresh_stats() first")
        return self._stats[0]

    def switch_totals(self) -> SwitchTotals:
        return self._stats[1] if self._stats is not None else SwitchTotals()

    async def refresh_stats(self) -> EngineStats:
        self._stats = await self._ask("stats")
        return self._stats[0]

    async def render_metrics(self, samples: list) -> bytes:
        """The /metrics exposition of the whole engine: its series and every API server's latencies (these
        `samples` of this server's included)."""
        return (await self._ask("metrics", samples))[0]

    def report_metrics(self, samples: list) -> None:
        """Send this server's latency samples for the engine's /metrics (no answer)."""
        if not self.closed.is_set():
            ipc.send(self._writer, ("metrics", None, samples))

    async def close(self) -> None:
        self._writer.close()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    # ---- the engine's messages -------------------------------------------------------------------------------------
    async def _ask(self, kind: str, *args) -> tuple:
        if self.closed.is_set():
            raise EngineDrainingError(ENGINE_GONE)
        tag = next(self._tags)
        reply = self._replies[tag] = asyncio.get_running_loop().create_future()
        ipc.send(self._writer, (kind, tag, *args))
        return await reply

    async def _read(self) -> None:
        try:
            while (message := await ipc.receive(self._reader)) is not None:
                kind = message[0]
                if kind == "out":
                    self._outputs(message[1])
                elif kind == "state":
                    self._engine_ready, self.is_draining = message[1], message[2]
                elif kind == "refused":
                    self._refused(*message[1:])
                elif kind in ("stats", "metrics"):
                    future = self._replies.pop(message[1], None)
                    if future is not None and not future.done():
                        future.set_result(message[2:])
        finally:
            self.closed.set()
            for entry in self._requests.values():
                entry.stream.finish("abort", ENGINE_GONE)  # after the engine's own aborts, when it sent them
            for future in self._replies.values():
                if not future.done():
                    future.set_exception(EngineDrainingError(ENGINE_GONE))

    def _outputs(self, outputs: list[tuple]) -> None:
        for key, token_ids, reason, error, logprobs, prompt_logprobs in outputs:
            entry = self._requests.get(key)
            if entry is None:  # ended here already (its client left, or a stop string)
                continue
            stream, seq = entry.stream, entry.seq
            if reason is not None and (reason not in _STATUS or (reason == "abort" and not token_ids)):
                stream.finish(reason, error)  # abort, error, or an end without tokens
            else:
                seq.output_token_ids.extend(token_ids)
                if prompt_logprobs is not None:
                    seq.prompt_logprobs = list(prompt_logprobs)
                if reason is not None:
                    seq.status = _STATUS[reason]
                if stream.push(token_ids, seq, logprobs) and reason is None:  # a stop string: end it there too
                    ipc.send(self._writer, ("finish", key, "stop"))
            if stream.finished:
                del self._requests[key]

    def _refused(self, key: int, kind: str, message: str, retry_after_s: float) -> None:
        entry = self._requests.pop(key, None)
        if entry is None:
            return
        if kind == "queue_full":
            entry.stream.fail(QueueFullError(message, retry_after_s))
        elif kind == "draining":
            entry.stream.fail(EngineDrainingError(message))
        else:
            entry.stream.fail(RequestError(message))
