"""One engine request seen from the API: first delta, the rest, usage, metrics, disconnects and SSE framing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
import structlog
from pydantic import BaseModel
from starlette.requests import Request

from services.contracts.step import TokenLogprob
from services.router.api.errors import ApiError, ClientDisconnected, error_body, from_engine_error
from services.router.api.metrics import RequestTimer
from services.router.api.protocol import UsageInfo
from services.router.contracts import EngineProtocol, GenerationDelta, GenerationRequest

log = structlog.get_logger(__name__)
T = TypeVar("T")
DONE_EVENT = "data: [DONE]\n\n"


def sse_event(chunk: BaseModel, include_usage: bool = False) -> str:
    """One server-sent event carrying `chunk` as JSON; `usage` only when the client asked for it (then null
    in every chunk but the last, as OpenAI sends it)."""
    return f"data: {chunk.model_dump_json(exclude=None if include_usage else {'usage'})}\n\n"


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable` in this task; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.current_task()
    assert task is not None
    is_disconnected = False

    async def watch() -> None:
        nonlocal is_disconnected
        await _wait_for_disconnect(request)
        is_disconnected = True
        task.cancel()  # delivered inside `awaitable` (the only place this task can be suspended)

    watcher = asyncio.create_task(watch())
    try:
        return await awaitable
    except asyncio.CancelledError:
        if is_disconnected and task.uncancel() == 0:
            raise ClientDisconnected() from None
        raise
    finally:
        watcher.cancel()


async def _close(iterator: AsyncIterator[GenerationDelta]) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):  # runs even while the stream is being cancelled
            await aclose()


class GenerationRun:
    """An admitted engine request: its deltas (the first already received), usage, finish reason, metrics."""

    def __init__(
        self, iterator: AsyncIterator[GenerationDelta], first: GenerationDelta, timer: RequestTimer,
        num_prompt_tokens: int,
    ) -> None:
        self._iterator = iterator
        self._next: GenerationDelta | None = first
        self._timer = timer
        self._is_closed = False
        self.finish_reason: str | None = None
        self.token_counts = (num_prompt_tokens, 0)  # (prompt, completion) tokens so far: usage, without a model
        self.token_ids: list[int] = []              # every token generated so far (a stop token included)
        self.logprobs: list[TokenLogprob] = []      # theirs, when asked
        self.prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # prompt tokens 1.., once known (echo)

    async def deltas(self) -> AsyncIterator[GenerationDelta]:
        """The request's deltas up to the finishing one; the engine iterator is closed however this ends."""
        try:
            while True:
                delta = self._next if self._next is not None else await self._advance()
                self._next = None
                self._timer.on_tokens(len(delta.token_ids))
                self._record_usage(delta)
                self.token_ids += delta.token_ids
                self.logprobs += delta.logprobs
                if delta.prompt_logprobs is not None:
                    self.prompt_logprobs = delta.prompt_logprobs
                self.finish_reason = delta.finish_reason
                if delta.finish_reason == "abort":  # e.g. the engine is stopping (delta.error says so): retry
                    raise ApiError(503, delta.error or "the request was aborted by the engine", "server_error",
                                   code="shutting_down" if delta.error else "request_aborted")
                if delta.finish_reason == "error":
                    raise ApiError(500, f"generation failed: {delta.error or 'unknown error'}", "server_error",
                                   code="generation_failed")
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            await self.close()

    async def collect(self) -> tuple[str, UsageInfo, str]:
        """The whole text, the usage and the finish reason."""
        text = "".join([delta.text async for delta in self.deltas()])
        assert self.finish_reason is not None
        return text, self.usage, self.finish_reason

    async def close(self) -> None:
        """Close the engine iterator (the engine then aborts the request if it was still running)."""
        if self._is_closed:
            return
        self._is_closed = True
        self._timer.finish(self.finish_reason or "abort")
        await _close(self._iterator)

    async def _advance(self) -> GenerationDelta:
        try:
            return await anext(self._iterator)
        except StopAsyncIteration:
            raise ApiError(503, "the engine ended the request without a finish reason", "server_error",
                           code="request_aborted") from None

    @property
    def usage(self) -> UsageInfo:
        prompt_tokens, completion_tokens = self.token_counts
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens)

    def _record_usage(self, delta: GenerationDelta) -> None:
        prompt_tokens, completion_tokens = self.token_counts
        self.token_counts = (delta.num_prompt_tokens or prompt_tokens,
                             max(delta.num_generated_tokens, completion_tokens))


async def start_generation(
    engine: EngineProtocol, generation: GenerationRequest, timer: RequestTimer, request: Request
) -> GenerationRun:
    """Submit `generation` and wait for its first delta, so admission errors become proper HTTP statuses."""
    iterator = engine.generate(generation)  # may raise QueueFullError / RequestError here ...
    try:
        first = await unless_disconnected(request, anext(iterator))  # ... or here, for an async generator
    except StopAsyncIteration:
        raise ApiError(503, "the engine ended the request before it started", "server_error",
                       code="request_aborted") from None
    except BaseException:  # refused or disconnected before admission: no latency is observed
        await _close(iterator)
        raise
    return GenerationRun(iterator, first, timer, len(generation.prompt_token_ids))


async def guarded_events(events: AsyncIterator[str], last: Callable[[], str] | None = None) -> AsyncIterator[str]:
    """`events`, the event `last` makes (the usage chunk, when asked), then `[DONE]`; an error mid-stream becomes an
    OpenAI error event (the status is already sent). One generator for all three: every layer of async generators
    costs each streamed token a hop."""
    try:
        async for event in events:
            yield event
        if last is not None:
            yield last()
    except Exception as exc:  # noqa: BLE001 - every failure must reach the client as an error event
        error = from_engine_error(exc)
        if error.status_code >= 500 and not isinstance(exc, ApiError):
            log.error("api.stream_failed", exc_info=exc)
        yield f"data: {json.dumps(error_body(error.info))}\n\n"
    yield DONE_EVENT
