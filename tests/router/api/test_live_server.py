"""A real uvicorn server: the official openai client, and clients that disconnect mid-request."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.conftest import until
from tests.router.api.conftest import MODEL, NUM_REFERENCE_TOKENS, PROMPT, live_server, wait_until_idle

pytestmark = pytest.mark.multiprocess

LONG = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}


async def wait_until_generating(engine, timeout_s: float = 10.0) -> None:
    """Wait until a request has produced a few tokens (so its first delta has reached the API)."""
    await until(lambda: engine.stats().num_generation_tokens >= 3, timeout_s, what="the request to start generating",
                interval_s=0.005)


async def test_openai_client_completions_and_chat(app, serving_engine, checkpoint_facts):
    decode = serving_engine.tokenizer.decode
    async with live_server(app) as base_url:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        extra = {"extra_body": {"ignore_eos": True}}
        completion = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=NUM_REFERENCE_TOKENS, temperature=0, **extra)
        assert completion.choices[0].text == decode(checkpoint_facts["reference"])
        assert completion.usage.completion_tokens == NUM_REFERENCE_TOKENS

        messages = [{"role": "user", "content": PROMPT}]
        chat = await client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=NUM_REFERENCE_TOKENS, temperature=0, **extra)
        expected_chat = decode(checkpoint_facts["chat_reference"])
        assert chat.choices[0].message.content == expected_chat
        assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"

        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=NUM_REFERENCE_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, **extra)
        chunks = [chunk async for chunk in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_chat
        assert chunks[-1].usage.completion_tokens == NUM_REFERENCE_TOKENS

        stream = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=NUM_REFERENCE_TOKENS, temperature=0, stream=True, **extra)
        assert "".join([chunk.choices[0].text async for chunk in stream]) == completion.choices[0].text

        models = await client.models.list()
        assert MODEL in [model.id for model in models.data]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=1)
        assert refused.value.status_code == 400 and refused.value.code == "model_not_found"
        await client.close()


async def test_stream_disconnect_frees_the_request(app, serving_engine):
    async with live_server(app) as base_url, httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        async with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
            assert response.status_code == 200
            lines = response.aiter_lines()
            first = await anext(lines)
            assert first.startswith("data: {")
            assert serving_engine.stats().num_running == 1
        # Leaving the block closed the connection after one event of 200.
        await wait_until_idle(serving_engine)
        assert serving_engine.stats().num_generation_tokens < LONG["max_tokens"]


async def test_non_streaming_disconnect_frees_the_request(app, serving_engine):
    async with live_server(app) as base_url, httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        request = asyncio.ensure_future(http.post("/v1/completions", json=LONG))
        await wait_until_generating(serving_engine)
        request.cancel()  # the client gives up: its connection closes
        with pytest.raises(asyncio.CancelledError):
            await request
        await wait_until_idle(serving_engine)
        assert serving_engine.stats().num_generation_tokens < LONG["max_tokens"]
        # The server is still healthy and serves the next request.
        response = await http.post("/v1/completions", json={**LONG, "max_tokens": 2})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


async def test_shutdown_drain_finishes_admitted_requests_and_refuses_new_ones(app, serving_engine, checkpoint_facts):
    """What the router does on SIGTERM before it stops listening (services.router.main.serve_router)."""
    async with live_server(app, is_draining=lambda: serving_engine.is_draining) as base_url, \
            httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        async with http.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 40, "stream": True}) as stream:
            await wait_until_generating(serving_engine)
            drain = asyncio.create_task(serving_engine.drain(grace_s=60))
            refused = await http.post("/v1/completions", json={**LONG, "max_tokens": 2})
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "shutting_down"
            assert refused.headers["connection"] == "close"  # the client does not reuse a connection of ours
            assert (await http.get("/ready")).status_code == 503
            events = [line async for line in stream.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and all('"error"' not in event for event in events)
        text = "".join(json.loads(event[6:])["choices"][0]["text"] for event in events[:-1])
        assert text.startswith(serving_engine.tokenizer.decode(checkpoint_facts["reference"]))
        assert await drain == 0  # nothing left for stop() to abort
