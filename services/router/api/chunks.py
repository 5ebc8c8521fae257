"""Streamed chunks framed as JSON text directly: the per-token path of an SSE stream. A chunk that carries only text
(no logprobs: nearly every one) is a fixed frame around its text, so it is written from a prefix made once per
request and json.dumps of the text, without building and validating pydantic models for every token (they cost ~20
us a chunk). The frames are byte for byte what the models serialize to (tests/router/api/test_chunks.py)."""

from __future__ import annotations

import json
from typing import Any

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # pydantic's compact UTF-8 JSON


def chunk_prefix(kind: str, header: dict[str, Any]) -> str:
    """`data: {"id":...,"object":KIND,"created":...,"model":...,"choices":[` of a stream's every chunk."""
    return (f'data: {{"id":{_dumps(header["id"])},"object":"{kind}","created":{int(header["created"])},'
            f'"model":{_dumps(header["model"])},"choices":[')


def usage_part(include_usage: bool, usage: tuple[int, int] | None) -> str:
    """The chunk's end: no usage key (not asked), null, or the counts (prompt, completion) so far."""
    if not include_usage:
        return "}\n\n"
    if usage is None:
        return ',"usage":null}\n\n'
    prompt, completion = usage
    return (f',"usage":{{"prompt_tokens":{prompt},"completion_tokens":{completion},'
            f'"total_tokens":{prompt + completion}}}}}\n\n')


def completion_text_event(prefix: str, index: int, text: str, finish_reason: str | None, end: str) -> str:
    """A completions chunk of text only (no logprobs)."""
    reason = "null" if finish_reason is None else f'"{finish_reason}"'
    return f'{prefix}{{"index":{index},"text":{_dumps(text)},"logprobs":null,"finish_reason":{reason}}}]{end}'


def chat_content_event(prefix: str, index: int, content: str | None, finish_reason: str | None, end: str,
                       role: str | None = None) -> str:
    """A chat chunk without logprobs: the delta names only what it adds ({"content": ...}; the last one {})."""
    delta = ",".join(part for part in (f'"role":"{role}"' if role is not None else "",
                                       f'"content":{_dumps(content)}' if content is not None else "") if part)
    reason = "null" if finish_reason is None else f'"{finish_reason}"'
    return f'{prefix}{{"index":{index},"delta":{{{delta}}},"logprobs":null,"finish_reason":{reason}}}]{end}'
