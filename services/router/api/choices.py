"""The choices of completions and chat completions, whole or as streamed chunks: text, echo, logprobs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from services.contracts.step import TokenLogprob
from services.model.tokenizer import Tokenizer
from services.router.api.chunks import chat_content_event, chunk_prefix, completion_text_event, usage_part
from services.router.api.logprobs import chat_logprobs, completion_logprobs
from services.router.api.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatDelta, CompletionChoice,
    CompletionChunk, CompletionLogprobs, StreamOptions,
)
from services.router.api.streaming import GenerationRun, sse_event


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of a completions request: its token ids, and its text when it came as text."""

    token_ids: list[int]
    text: str | None = None

    def echo_text(self, tokenizer: Tokenizer) -> str:
        """What echo returns: the text as sent, or the decoded ids."""
        return self.text if self.text is not None else tokenizer.decode(self.token_ids)


@dataclass(frozen=True, slots=True)
class CompletionFormat:
    """How a completions request wants its choices: echo, and logprobs with this many alternatives."""

    tokenizer: Tokenizer
    echo: bool = False
    num_logprobs: int | None = None

    def prompt_part(self, prompt: Prompt, prompt_logprobs: tuple[TokenLogprob, ...] | None) -> tuple[
            str, list[int], list[TokenLogprob | None]]:
        """The echoed text, tokens and logprobs (the first token has none)."""
        if not self.echo:
            return "", [], []
        values = [None, *(prompt_logprobs or [None] * (len(prompt.token_ids) - 1))]
        return prompt.echo_text(self.tokenizer), list(prompt.token_ids), values

    def logprobs(self, token_ids: list[int], values: list[TokenLogprob | None],
                 text_offset: int = 0) -> CompletionLogprobs | None:
        if self.num_logprobs is None:
            return None
        return completion_logprobs(self.tokenizer, token_ids, values, text_offset)

    def choice(self, index: int, run: GenerationRun, text: str, prompt: Prompt) -> CompletionChoice:
        """A whole choice."""
        echoed, token_ids, values = self.prompt_part(prompt, run.prompt_logprobs)
        return CompletionChoice(index=index, text=echoed + text, finish_reason=run.finish_reason,
                                logprobs=self.logprobs(token_ids + run.token_ids, values + list(run.logprobs)))

    async def events(self, index: int, run: GenerationRun, prompt: Prompt, header: dict[str, Any],
                     options: StreamOptions) -> AsyncIterator[str]:
        """A choice's chunks: the echoed prompt first (once its logprobs are known, when asked), then the text."""
        is_echo_pending, text_offset = self.echo, 0
        prefix = chunk_prefix("text_completion", header)
        async for delta in run.deltas():
            values: list[TokenLogprob | None] = list(delta.logprobs)
            text, token_ids = delta.text, list(delta.token_ids)
            if is_echo_pending and (self.num_logprobs is None or delta.prompt_logprobs is not None):
                is_echo_pending = False
                echoed, echoed_ids, echoed_values = self.prompt_part(prompt, delta.prompt_logprobs)
                text, token_ids, values = echoed + text, echoed_ids + token_ids, echoed_values + values
            logprobs = self.logprobs(token_ids, values, text_offset) if token_ids else None
            if logprobs is not None and logprobs.tokens:
                text_offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
            if logprobs is None and (text or delta.finish_reason):  # the per-token path: no model built
                yield completion_text_event(prefix, index, text, delta.finish_reason, _end(run, options))
            elif logprobs is not None:
                choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                          finish_reason=delta.finish_reason)
                usage = run.usage if options.is_continuous else None
                yield sse_event(CompletionChunk(**header, choices=[choice], usage=usage), options.include_usage)


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """How a chat request wants its choices: with logprobs or not."""

    tokenizer: Tokenizer
    with_logprobs: bool = False

    def choice(self, index: int, run: GenerationRun, text: str) -> ChatChoice:
        """A whole choice."""
        logprobs = chat_logprobs(self.tokenizer, run.logprobs) if self.with_logprobs else None
        return ChatChoice(index=index, message=AssistantMessage(content=text), logprobs=logprobs,
                          finish_reason=run.finish_reason)

    async def events(self, index: int, run: GenerationRun, header: dict[str, Any],
                     options: StreamOptions) -> AsyncIterator[str]:
        """A choice's chunks: the role first (as OpenAI, before any text), the content, then the finish reason."""

        def chunk(delta: ChatDelta, finish_reason: str | None = None, logprobs: Any = None) -> str:
            if logprobs is None:  # the per-token path: no model built
                return chat_content_event(prefix, index, delta.content, finish_reason, _end(run, options), delta.role)
            choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
            usage = run.usage if options.is_continuous else None
            return sse_event(ChatCompletionChunk(**header, choices=[choice], usage=usage), options.include_usage)

        prefix = chunk_prefix("chat.completion.chunk", header)
        yield chunk(ChatDelta(role="assistant", content=""))
        async for delta in run.deltas():
            logprobs = chat_logprobs(self.tokenizer, delta.logprobs) if self.with_logprobs and delta.logprobs else None
            if delta.text or logprobs is not None:
                yield chunk(ChatDelta(content=delta.text), logprobs=logprobs)
        yield chunk(ChatDelta(), run.finish_reason)


def _end(run: GenerationRun, options: StreamOptions) -> str:
    return usage_part(options.include_usage, run.token_counts if options.is_continuous else None)
