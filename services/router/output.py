"""Per-request output: where the engine puts a request's tokens (an OutputStream), and the in-process one:
incremental detokenization, stop strings, and the queue of deltas a front end reads."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

from services.contracts.step import TokenLogprob
from services.model.tokenizer import Tokenizer
from services.router.contracts import GenerationDelta, GenerationRequest
from services.router.load_window import RequestTimer
from services.router.sequence import Sequence


class OutputStream(Protocol):
    """Where the engine puts an admitted request's tokens: RequestStream here, or an API server's
    (services.router.gateway)."""

    finished: bool               # set once it carried the request's end: nothing more goes in
    timer: RequestTimer | None   # the request's latencies (set by the engine at admission)

    def push(self, new_token_ids: tuple[int, ...], seq: Sequence, logprobs: tuple[TokenLogprob, ...] = ()) -> bool:
        """A step's new tokens for the request (seq: its state after the step); True when a stop string ended it."""
        ...

    def finish(self, reason: str, error: str | None = None) -> None:
        """End it without new tokens (abort, error, migrated)."""
        ...


class RequestStream:
    """Turns a request's new tokens into text deltas; withholds text that may begin a stop string."""

    def __init__(self, request: GenerationRequest, tokenizer: Tokenizer) -> None:
        self.request = request
        self._deltas: deque[GenerationDelta] = deque()
        self._waiter: asyncio.Future | None = None  # get() waits on it for the next delta
        self._error: Exception | None = None  # fail()
        self._decoder = tokenizer.incremental_decoder()
        self._pending = ""  # decoded text not yet emitted
        self._holdback = max((len(s) for s in request.stop_strings), default=1) - 1
        self._num_generated = 0
        self._num_prompt_tokens = len(request.prompt_token_ids)
        self._is_prompt_logprobs_sent = not request.prompt_logprobs
        self.finished = False
        self.timer: RequestTimer | None = None

    async def get(self) -> GenerationDelta:
        """The next delta (waits for it); raises what fail() was given."""
        while not self._deltas:
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._deltas.popleft()

    def fail(self, error: Exception) -> None:
        """The request ends with `error` instead of a delta (an engine in another process refused it)."""
        self.finished, self._error = True, error
        self._wake()

    def drain(self) -> list[GenerationDelta]:
        """The deltas queued so far, without waiting (a caller that pushes and reads in one task)."""
        deltas = list(self._deltas)
        self._deltas.clear()
        return deltas

    def _put(self, delta: GenerationDelta) -> None:
        self._deltas.append(delta)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None:
            if not self._waiter.done():
                self._waiter.set_result(None)
            self._waiter = None

    def push(self, new_token_ids: tuple[int, ...], seq: Sequence, logprobs: tuple[TokenLogprob, ...] = ()) -> bool:
        """Emit what new tokens add (with their logprobs, when asked); returns True when a stop string ended the
        request. The first delta after the prefill carries the prompt logprobs, when asked."""
        if self.finished:
            return False
        self._num_generated = len(seq.output_token_ids)
        prompt_logprobs = None
        if not self._is_prompt_logprobs_sent and seq.has_prompt_logprobs:
            prompt_logprobs, self._is_prompt_logprobs_sent = tuple(seq.prompt_logprobs), True
        done = seq.status.is_finished
        texted = new_token_ids
        if done and new_token_ids and new_token_ids[-1] in self.request.stop_token_ids:
            texted = new_token_ids[:-1]  # a stop token ends the text; it is not part of it (as OpenAI does)
        push = self._decoder.push
        pending = self._pending + (push(texted[0]) if len(texted) == 1 else "".join(push(t) for t in texted))
        if done:
            pending += self._decoder.flush()
        stop_strings = self.request.stop_strings
        if stop_strings and self._num_generated >= self.request.min_tokens and (cut := self._first_stop(pending)) >= 0:
            self._emit(self._delta(new_token_ids, pending[:cut], "stop", None, logprobs, prompt_logprobs))
            return True
        if done:
            self._emit(self._delta(new_token_ids, pending, seq.status.finish_reason or "stop", None, logprobs,
                                   prompt_logprobs))
            return False
        keep = min(self._holdback, len(pending))  # what may begin a stop string waits for the next tokens
        self._pending = pending[len(pending) - keep:] if keep else ""
        self._put(self._delta(new_token_ids, pending[:len(pending) - keep] if keep else pending, None, None, logprobs,
                              prompt_logprobs))
        return False

    def finish(self, reason: str, error: str | None = None) -> None:
        """End the stream without new tokens (abort, error)."""
        if not self.finished:
            self.finished = True
            self._put(self._delta((), "", reason, error))

    def _first_stop(self, text: str) -> int:
        """Where the first stop string begins in `text`; -1: nowhere."""
        hits = [i for i in (text.find(s) for s in self.request.stop_strings if s) if i >= 0]
        return min(hits) if hits else -1

    def _emit(self, delta: GenerationDelta) -> None:
        self.finished = True
        self._pending = ""
        self._put(delta)

    def _delta(self, token_ids: tuple[int, ...], text: str, reason: str | None, error: str | None = None,
               logprobs: tuple[TokenLogprob, ...] = (),
               prompt_logprobs: tuple[TokenLogprob, ...] | None = None) -> GenerationDelta:
        return GenerationDelta(token_ids, text, reason, self._num_prompt_tokens, self._num_generated, error, logprobs,
                               prompt_logprobs)
