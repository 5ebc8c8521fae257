"""The SSE chunks framed without pydantic are byte for byte what the protocol models serialize to."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.router.api.chunks import chat_content_event, chunk_prefix, completion_text_event, usage_part
from services.router.api.protocol import (
    ChatChunkChoice, ChatCompletionChunk, ChatDelta, CompletionChoice, CompletionChunk, UsageInfo,
)
from services.router.api.streaming import sse_event

headers = st.fixed_dictionaries({"id": st.text(max_size=20), "created": st.integers(0, 2**40),
                                 "model": st.text(max_size=20)})
reasons = st.sampled_from([None, "stop", "length"])
usages = st.one_of(st.none(), st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)))


def _usage(counts):
    return None if counts is None else UsageInfo(prompt_tokens=counts[0], completion_tokens=counts[1],
                                                 total_tokens=sum(counts))


@given(headers, st.integers(0, 128), st.text(), reasons, st.booleans(), usages)
def test_completion_chunks(header, index, text, reason, include_usage, usage):
    expected = sse_event(CompletionChunk(**header, choices=[CompletionChoice(index=index, text=text,
                                                                             finish_reason=reason)],
                                         usage=_usage(usage)), include_usage)
    end = usage_part(include_usage, usage)
    assert completion_text_event(chunk_prefix("text_completion", header), index, text, reason, end) == expected


@given(headers, st.integers(0, 128), st.one_of(st.none(), st.text()), st.sampled_from([None, "assistant"]), reasons,
       st.booleans(), usages)
def test_chat_chunks(header, index, content, role, reason, include_usage, usage):
    choice = ChatChunkChoice(index=index, delta=ChatDelta(role=role, content=content), finish_reason=reason)
    expected = sse_event(ChatCompletionChunk(**header, choices=[choice], usage=_usage(usage)), include_usage)
    end = usage_part(include_usage, usage)
    assert chat_content_event(chunk_prefix("chat.completion.chunk", header), index, content, reason, end,
                              role) == expected
