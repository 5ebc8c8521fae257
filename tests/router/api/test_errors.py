"""Every error of the HTTP API: exact status and OpenAI error JSON, against the real engine."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from services.router.api import ApiConfig, create_app
from services.router.contracts import GenerationRequest, QueueFullError
from tests.conftest import until
from tests.router.api.conftest import MODEL, parse_sse, wait_until_idle

pytestmark = pytest.mark.multiprocess


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    """The response is an OpenAI error with this status (and param / code when given)."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


async def post_json(client: httpx.AsyncClient, path: str, body: object) -> httpx.Response:
    """POST `body` as ASCII JSON (lone surrogates escaped as \\uXXXX, which httpx's json= cannot send)."""
    return await client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


async def test_malformed_json_is_400(client):
    response = await client.post("/v1/completions", content=b'{"model": "test-model", "prompt": ',
                                 headers={"content-type": "application/json"})
    error = assert_error(response, 400, code="invalid_json")
    assert error["type"] == "invalid_request_error"
    response = await client.post("/v1/chat/completions", content=b"not json at all",
                                 headers={"content-type": "application/json"})
    assert_error(response, 400, code="invalid_json")


async def test_a_body_not_sent_as_json_names_the_content_type(client):
    """curl -d without -H sends a form: the error says what to send instead."""
    body = json.dumps({"model": MODEL, "prompt": "hi"}).encode()
    for headers in ({"content-type": "application/x-www-form-urlencoded"}, {}):
        error = assert_error(await client.post("/v1/completions", content=body, headers=headers), 400,
                             code="invalid_content_type")
        assert "Content-Type: application/json" in error["message"], error
    ok = await client.post("/v1/completions", content=body,
                           headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"prompt": "hi"}, "model", "missing_required_parameter"),
        ({"model": MODEL}, "prompt", "missing_required_parameter"),
        ({"model": MODEL, "prompt": "hi", "temperature": 2.5}, "temperature", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, "temperature", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "top_k": -2}, "top_k", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, "max_tokens", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "seed": -1}, "seed", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "n": 0}, "n", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "n": 129}, "n", "invalid_value"),
        ({"model": MODEL, "prompt": ["a", "b"], "n": 65}, "n", "invalid_value"),  # 130 choices
        ({"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "logprobs": -1}, "logprobs", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "best_of": 3}, "best_of", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "suffix": "x"}, "suffix", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "frequency_penalty": -3}, "frequency_penalty", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "min_tokens": -1}, "min_tokens", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "min_tokens": 5, "max_tokens": 4}, "min_tokens", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"five": 1.0}}, "logit_bias", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias", None),
        ({"model": MODEL, "prompt": "hi", "stop": [""]}, "stop", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "frobnicate": 1}, "frobnicate", "unknown_parameter"),
        ({"model": MODEL, "prompt": [1, -5]}, "prompt", "invalid_value"),
        ({"model": MODEL, "prompt": 42}, "prompt", "invalid_value"),
        ({"model": MODEL, "prompt": "lone \ud800 surrogate"}, "prompt", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, None, "invalid_value"),
    ],
)
async def test_bad_completion_parameters_are_400(client, body, param, code):
    response = await post_json(client, "/v1/completions", body)
    error = assert_error(response, 400, param=param, code=code)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"model": MODEL, "messages": [{"role": "user"}]}, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "\udfff"}]}, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
         "max_completion_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
         "top_logprobs"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": []}, "tools"),
    ],
)
async def test_bad_chat_parameters_are_400(client, body, param):
    assert_error(await post_json(client, "/v1/chat/completions", body), 400, param=param)


async def test_body_that_is_not_an_object_is_400(client):
    assert_error(await client.post("/v1/completions", json=[MODEL, "hi"]), 400)
    assert_error(await client.post("/v1/completions"), 400)  # no body at all


async def test_unknown_model_is_400_model_not_found(client):
    response = await client.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    error = assert_error(response, 400, param="model", code="model_not_found")
    assert "gpt-9" in error["message"]
    response = await client.post("/v1/chat/completions",
                                 json={"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]})
    assert_error(response, 400, param="model", code="model_not_found")


async def test_prompt_longer_than_the_context_is_400(client, serving_engine):
    max_model_len = serving_engine.max_model_len
    too_long = "a" * (max_model_len + 1)  # byte-level tokenizer: one token per byte, plus bos
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": too_long})
    error = assert_error(response, 400, param="prompt", code="context_length_exceeded")
    assert str(max_model_len) in error["message"]
    serving_engine.context_note = "the KV cache holds 64: a larger --kv-cache-mb allows longer requests"
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": too_long})
    error = assert_error(response, 400, param="prompt", code="context_length_exceeded")
    assert f"is {max_model_len} tokens (the KV cache holds 64: a larger --kv-cache-mb" in error["message"]
    serving_engine.context_note = ""
    response = await client.post("/v1/chat/completions",
                                 json={"model": MODEL, "messages": [{"role": "user", "content": too_long}]})
    assert_error(response, 400, param="messages", code="context_length_exceeded")
    # The prompt fits, but not with the completion asked for.
    response = await client.post("/v1/completions",
                                 json={"model": MODEL, "prompt": "a" * 100, "max_tokens": max_model_len})
    assert_error(response, 400, param="max_tokens", code="context_length_exceeded")
    response = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": max_model_len})
    assert_error(response, 400, param="max_completion_tokens", code="context_length_exceeded")


async def test_prompt_shapes_that_are_refused(client, serving_engine):
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": [[1, 2], []]})
    assert "empty" in assert_error(response, 400, param="prompt")["message"]
    assert_error(await client.post("/v1/completions", json={"model": MODEL, "prompt": []}), 400, param="prompt")
    vocab_size = serving_engine.tokenizer.vocab_size
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": [1, vocab_size]})
    assert_error(response, 400, param="prompt")


async def test_unknown_route_and_method_are_openai_shaped(client):
    assert_error(await client.post("/v1/embeddings", json={}), 404)
    assert_error(await client.get("/v1/completions"), 405)


async def test_queue_full_is_429_with_retry_after(client, serving_engine):
    """Freeze the engine so nothing drains, fill its waiting queue, and the next HTTP request gets 429."""
    engine = serving_engine
    await engine.freeze()
    iterators, waiters = [], []
    try:
        is_full = False
        for index in range(8192):  # far above any max_waiting the fixture might use; stops at the first refusal
            iterator = engine.generate(GenerationRequest(f"fill-{index}", (1, 2, 3), max_tokens=1))
            iterators.append(iterator)
            waiters.append(asyncio.ensure_future(anext(iterator)))
            if index % 64 == 63:
                await asyncio.sleep(0)  # let the batch reach admission
                if any(w.done() and isinstance(w.exception(), QueueFullError) for w in waiters):
                    is_full = True
                    break
        assert is_full, "the waiting queue never filled"
        response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert_error(response, 429, code="queue_full")
        assert int(response.headers["retry-after"]) >= 1
        response = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert_error(response, 429, code="queue_full")  # a stream is refused before any event is sent
    finally:
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        for iterator in iterators:
            await iterator.aclose()
        engine.resume()
    await wait_until_idle(engine)


async def test_unexpected_exception_is_500_json(serving_engine):
    app = create_app(serving_engine, ApiConfig(model_aliases=(MODEL,)))

    async def explode() -> None:
        raise RuntimeError("secret internal detail")

    app.add_api_route("/explode", explode)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
        response = await http.get("/explode")
    error = assert_error(response, 500)
    assert error["type"] == "server_error"
    assert "secret internal detail" not in response.text and "Traceback" not in response.text


async def test_api_key_is_required_on_v1_only(serving_engine):
    app = create_app(serving_engine, ApiConfig(model_aliases=(MODEL,), api_key="sesame"))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
        response = await http.get("/v1/models")
        assert_error(response, 401, code="invalid_api_key")
        assert response.headers["www-authenticate"] == "Bearer"
        assert_error(await http.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        # Authentication comes before parsing: a malformed body without a key is still a 401.
        assert_error(await http.post("/v1/completions", content=b"{"), 401, code="invalid_api_key")
        assert (await http.get("/v1/models", headers={"Authorization": "Bearer sesame"})).status_code == 200
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/metrics")).status_code == 200


def test_openapi_schema_exports_without_422(app):
    schema = json.loads(json.dumps(app.openapi()))  # plain JSON, as schemathesis reads it
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready", "/metrics"} <= set(
        schema["paths"])
    for path in schema["paths"].values():
        for operation in path.values():
            assert "422" not in operation["responses"]
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "429", "500"} <= set(completions)
    assert "text/event-stream" in completions["200"]["content"]


async def test_engine_stopping_mid_request_is_an_explicit_error(client, serving_engine):
    """No accepted request is lost silently: a stream ends with an error event, a plain request gets 503."""
    request = {"model": MODEL, "prompt": "hi", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    streamed = asyncio.ensure_future(client.post("/v1/completions", json={**request, "stream": True}))
    plain = asyncio.ensure_future(client.post("/v1/completions", json=request))
    await until(lambda: serving_engine.stats().num_generation_tokens >= 4, timeout_s=10,
                what="4 tokens generated", interval_s=0.005)
    await serving_engine.stop()
    assert "the server is shutting down" in assert_error(await plain, 503, code="shutting_down")["message"]
    response = await streamed
    assert response.status_code == 200  # the stream had started
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "shutting_down" and events[-2]["error"]["type"] == "server_error"
    assert "the server is shutting down" in events[-2]["error"]["message"]
    assert all("choices" in event for event in events[:-2])
