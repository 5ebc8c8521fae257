"""Edge limits of the router's front ends: the size of an HTTP body, the smallest temperature that samples, and
long texts tokenized off the event loop."""

from __future__ import annotations

import asyncio

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.model.tokenizer import Tokenizer
from services.router.api.errors import ApiError, error_response

DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # a 128k-token prompt is a few MiB of JSON at most, even \u-escaped
INLINE_ENCODE_CHARS = 16_384          # shorter texts are tokenized on the loop: a thread hop costs more


def _too_large_message(max_bytes: int) -> str:
    return f"the request body is larger than {max_bytes} bytes"


class BodyLimitMiddleware:
    """Refuses HTTP request bodies over `max_bytes` with 413: by Content-Length before reading, or once the bytes
    received (chunked uploads) pass it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:  # the server already refused malformed lengths
            await error_response(ApiError(413, _too_large_message(self.max_bytes)))(scope, receive, send)
            return
        num_received = 0

        async def limited_receive() -> Message:
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_bytes:
                    # Raised where the app reads its body (FastAPI passes HTTPException through to the error
                    # handlers, which answer it as an OpenAI error).
                    raise HTTPException(413, _too_large_message(self.max_bytes))
            return message

        await self.app(scope, limited_receive, send)


async def encode_text(tokenizer: Tokenizer, text: str, add_bos: bool = True) -> list[int]:
    """Token ids of `text`; a long text is tokenized on a thread (tokenizers releases the GIL), so a megabyte
    prompt does not stall every other stream on the loop."""
    if len(text) <= INLINE_ENCODE_CHARS:
        return tokenizer.encode(text, add_bos=add_bos)
    return await asyncio.to_thread(tokenizer.encode, text, add_bos)
