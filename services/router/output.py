"""Per-request output: incremental detokenization, stop strings, and the queue of deltas a front end reads."""

from __future__ import annotations

import asyncio

from services.model.tokenizer import Tokenizer
from services.router.contracts import GenerationDelta, GenerationRequest
from services.router.sequence import Sequence, SequenceStatus
from services.worker.step import TokenLogprob

_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class RequestStream:
    """Turns a request's new tokens into text deltas; withholds text that may begin a stop string."""

    def __init__(self, request: GenerationRequest, tokenizer: Tokenizer) -> None:
        self.request = request
        self._queue: asyncio.Queue[GenerationDelta] = asyncio.Queue()
        self._decoder = tokenizer.incremental_decoder()
        self._pending = ""  # decoded text not yet emitted
        self._holdback = max((len(s) for s in request.stop_strings), default=1) - 1
        self._num_generated = 0
        self._is_prompt_logprobs_sent = not request.prompt_logprobs
        self.finished = False

    async def get(self) -> GenerationDelta:
        return await self._queue.get()

    def drain(self) -> list[GenerationDelta]:
        """The deltas queued so far, without waiting (a caller that pushes and reads in one task)."""
        deltas = []
        while not self._queue.empty():
            deltas.append(self._queue.get_nowait())
        return deltas

    def push(self, new_token_ids: tuple[int, ...], seq: Sequence, logprobs: tuple[TokenLogprob, ...] = ()) -> bool:
        """Emit what new tokens add (with their logprobs, when asked); returns True when a stop string ended the
        request. The first delta after the prefill carries the prompt logprobs, when asked."""
        if self.finished:
            return False
        self._num_generated = len(seq.output_token_ids)
        extra: dict = {"logprobs": logprobs}
        if not self._is_prompt_logprobs_sent and seq.has_prompt_logprobs:
            extra["prompt_logprobs"], self._is_prompt_logprobs_sent = tuple(seq.prompt_logprobs), True
        done = seq.status.is_finished
        texted = new_token_ids
        if done and new_token_ids and new_token_ids[-1] in self.request.stop_token_ids:
            texted = new_token_ids[:-1]  # a stop token ends the text; it is not part of it (as OpenAI does)
        self._pending += "".join(self._decoder.push(t) for t in texted)
        if done:
            self._pending += self._decoder.flush()
        cut = self._first_stop() if self._num_generated >= self.request.min_tokens else None
        if cut is not None:
            self._emit(self._delta(new_token_ids, self._pending[:cut], "stop", **extra))
            return True
        if done:
            self._emit(self._delta(new_token_ids, self._pending, _FINISH_REASONS.get(seq.status, "stop"), **extra))
            return False
        keep = min(self._holdback, len(self._pending))
        text, self._pending = self._pending[: len(self._pending) - keep], self._pending[len(self._pending) - keep:]
        self._queue.put_nowait(self._delta(new_token_ids, text, None, **extra))
        return False

    def finish(self, reason: str, error: str | None = None) -> None:
        """End the stream without new tokens (abort, error)."""
        if not self.finished:
            self.finished = True
            self._queue.put_nowait(self._delta((), "", reason, error))

    def _first_stop(self) -> int | None:
        hits = [i for i in (self._pending.find(s) for s in self.request.stop_strings if s) if i >= 0]
        return min(hits) if hits else None

    def _emit(self, delta: GenerationDelta) -> None:
        self.finished = True
        self._pending = ""
        self._queue.put_nowait(delta)

    def _delta(self, token_ids: tuple[int, ...], text: str, reason: str | None, error: str | None = None,
               logprobs: tuple[TokenLogprob, ...] = (),
               prompt_logprobs: tuple[TokenLogprob, ...] | None = None) -> GenerationDelta:
        return GenerationDelta(
            token_ids=tuple(token_ids), text=text, finish_reason=reason,
            num_prompt_tokens=len(self.request.prompt_token_ids), num_generated_tokens=self._num_generated,
            error=error, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        )
