"""Fuzz the router's HTTP API over a real engine and real workers: schemathesis cases from the app's own OpenAPI
schema (positive and negative), requests that reach the engine (streams, stops, seeds, disconnects) and raw
malformed requests. No 5xx, every answer as the schema says, and afterwards the engine is healthy: the oracle's
tokens, nothing running, no KV block held. Then the regression tests of what the fuzzers found."""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import zlib

import pytest
import requests
import schemathesis
from hypothesis import given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from services.router.api.limits import INLINE_ENCODE_CHARS
from tests.conftest import until
from tests.fuzz.conftest import (
    FUZZ_CONTEXT,
    FUZZ_SETTINGS,
    API_KEY,
    MAX_REQUEST_BYTES,
    MODEL,
    ORACLE_MAX_TOKENS,
    ORACLE_PROMPT,
    HttpTarget,
)

pytestmark = pytest.mark.multiprocess

MIN_CASES = 1000
# Generated cases per operation: the two generation endpoints get nearly all of them (a GET without parameters
# has one case).
BUDGET = {"POST /v1/completions": 400, "POST /v1/chat/completions": 400, "GET /v1/models": 20,
          "GET /health": 10, "GET /ready": 10, "GET /metrics": 10, "POST /tokenize": 40, "POST /detokenize": 40}
SERVED_CASES = 150
RAW_CASES = 150
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance, negative_data_rejection]
# Requests sent by each fuzzer and the statuses they got (the health test reads them after the fuzzers ran).
CASES: collections.Counter[str] = collections.Counter()
STATUSES: collections.Counter[int] = collections.Counter()


@pytest.fixture(scope="module")
def http_schema(http_target) -> schemathesis.BaseSchema:
    """The app's own OpenAPI document, loaded by schemathesis, reading event streams to their end: schemathesis
    (>= 4.32) stops reading a stream after 20 events by default, and the served fuzzer checks every stream ends
    with [DONE] (n choices of up to FUZZ_CONTEXT tokens each send far more events)."""
    schema = schemathesis.openapi.from_dict(http_target.schema)
    schema.config.max_stream_events = 10 * FUZZ_CONTEXT * 3  # more than any request sends (n <= 3, echo)
    return schema


def _with_served_model(case: schemathesis.Case) -> None:
    """Name the served model in most bodies (else nearly every case stops at model_not_found); about one random
    name in eight is kept so the unknown-model path is fuzzed too. Schemathesis revalidates the edited body."""
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        if zlib.crc32(body["model"].encode("utf-8", "surrogatepass")) % 8:
            body["model"] = MODEL


def _send(target: HttpTarget, case: schemathesis.Case, label: str, checks=CHECKS) -> requests.Response:
    response = case.call(base_url=target.base_url, session=target.session, timeout=30)
    CASES[label] += 1
    STATUSES[response.status_code] += 1
    case.validate_response(response, checks=checks)
    return response


@pytest.mark.parametrize("label", BUDGET)
def test_schema_cases_get_conformant_non_5xx_answers(label, http_target, http_schema):
    """Positive and negative cases of one operation: each answer is not a 5xx and conforms to the schema
    (status, content type, body, headers); schema-violating requests are refused."""
    method, path = label.split(" ")
    operation = http_schema[path][method]
    modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if method == "POST" else [])
    strategy = st.one_of(*(operation.as_strategy(generation_mode=mode) for mode in modes))

    @settings(FUZZ_SETTINGS, max_examples=BUDGET[label])
    @given(case=strategy)
    def fuzz(case: schemathesis.Case) -> None:
        _with_served_model(case)
        _send(http_target, case, label)

    fuzz()


@st.composite
def served_requests(draw) -> tuple[str, dict, bool]:
    """Requests the engine runs (or refuses for their length): random prompts and sampling, stop strings,
    streams with usage, and streams the client drops after the first event."""
    body: dict = {"model": MODEL}
    is_chat = draw(st.booleans())
    if is_chat:
        message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                         "content": st.text(max_size=12)})
        body["messages"] = draw(st.lists(message, min_size=1, max_size=2))
    else:
        body["prompt"] = draw(st.one_of(st.text(max_size=40), st.lists(st.integers(0, 263), max_size=40)))
    optional = {
        "max_completion_tokens" if is_chat else "max_tokens": st.integers(1, FUZZ_CONTEXT),
        "temperature": st.floats(0.0, 2.0), "top_p": st.floats(0.01, 1.0), "top_k": st.integers(-1, 300),
        "seed": st.integers(0, (1 << 64) - 1), "ignore_eos": st.booleans(), "user": st.text(max_size=8),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
        "n": st.integers(1, 3), "presence_penalty": st.floats(-2.0, 2.0), "repetition_penalty": st.floats(0.5, 2.0),
        "logit_bias": st.dictionaries(st.integers(0, 263).map(str), st.floats(-100, 100), max_size=3),
        "min_tokens": st.integers(0, 2),
    }
    if is_chat:
        optional["logprobs"], optional["top_logprobs"] = st.just(True), st.integers(0, 5)
    else:
        optional["logprobs"], optional["echo"] = st.integers(0, 5), st.booleans()
    for name in draw(st.sets(st.sampled_from(sorted(optional)))):
        body[name] = draw(optional[name])
    is_dropped = False
    if draw(st.booleans()):
        body["stream"] = True
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans())}
        is_dropped = draw(st.booleans())
    return "/v1/chat/completions" if is_chat else "/v1/completions", body, is_dropped


def test_served_requests_finish_or_are_refused_cleanly(http_target, http_schema):
    """Requests that reach the engine get 200 (JSON or SSE ending in [DONE]) or a 400 about their prompt or
    length; dropped streams are aborted by the engine."""
    optional_lengths = ("max_tokens", "max_completion_tokens")

    @settings(FUZZ_SETTINGS, max_examples=SERVED_CASES)
    @given(request=served_requests())
    def fuzz(request: tuple[str, dict, bool]) -> None:
        path, body, is_dropped = request
        if is_dropped:  # read the first event, then hang up
            with http_target.session.post(http_target.base_url + path, json=body, stream=True,
                                          timeout=30) as response:
                CASES["served"] += 1
                STATUSES[response.status_code] += 1
                assert response.status_code in (200, 400), response.text
                next(response.iter_lines(), None)
            return
        response = _send(http_target, http_schema[path]["POST"].Case(body=body), "served",
                         checks=CHECKS[:-1])
        assert response.status_code in (200, 400), response.text
        if response.status_code == 400:  # too long, empty, ids past the tokenizer's vocabulary, options at odds
            assert response.json()["error"]["param"] in (
                "prompt", "messages", *optional_lengths, "min_tokens", "logit_bias", "top_logprobs"), response.text
        elif body.get("stream"):
            assert response.text.endswith("data: [DONE]\n\n"), response.text

    fuzz()


@st.composite
def raw_requests(draw) -> tuple[str, str, dict[str, str | None], bytes]:
    """Requests no schema describes: wrong methods and paths, odd content types, broken or hostile bodies."""
    method = draw(st.sampled_from(["POST", "GET", "PUT", "DELETE", "PATCH", "OPTIONS"]))
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/", "/v1/../health",
                                 "/v1/completions/x", "/%ff", "/v1/completions?stream=true"]))
    content_type = draw(st.sampled_from(["application/json", "application/json; charset=latin-1", "text/plain",
                                         "application/x-www-form-urlencoded", "multipart/form-data", ""]))
    headers = {"Content-Type": content_type} if content_type else {}
    # One request in four has no key (None drops the session's), or a wrong or mangled one: 401 on /v1/*.
    bad_keys = st.one_of(st.none(), st.just(f"bearer {API_KEY}"),
                         st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
                                 max_size=24).filter(lambda value: not value[:1].isspace()))  # what HTTP/1.1 carries
    authorization = f"Bearer {API_KEY}" if draw(st.integers(0, 3)) else draw(bad_keys)
    headers["Authorization"] = authorization
    valid = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    body = draw(st.one_of(
        st.binary(max_size=256),
        st.text(max_size=128).map(lambda s: s.encode("utf-8", "surrogatepass")),
        st.integers(1, 5000).map(lambda depth: b"[" * depth + b"]" * depth),                      # deep nesting
        st.integers(1, 5000).map(lambda depth: b'{"a":' * depth + b"1" + b"}" * depth),
        st.sampled_from([b"", b"null", b"[]", b"{}", b"NaN", b'{"model": "' + MODEL.encode() + b'", "prompt": NaN}',
                         json.dumps({**valid, "temperature": float("nan")}).encode(),
                         json.dumps({**valid, "max_tokens": 10 ** 30}).encode(),
                         json.dumps({**valid, "prompt": [10 ** 30]}).encode(),
                         json.dumps({**valid, "prompt": [True, False]}).encode(),
                         json.dumps({**valid, "prompt": "x" * 300_000}).encode(),              # long prompt
                         json.dumps({**valid, "prompt": "x" * MAX_REQUEST_BYTES}).encode(),    # oversized body
                         json.dumps(valid).encode()[:-3]]),                                     # truncated
        st.builds(lambda value: json.dumps({**valid, "prompt": value}).encode(),
                  st.recursive(st.integers(-2, 300) | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3),
                               max_leaves=12)),
    ))
    return method, path, headers, body


def test_raw_malformed_requests_get_client_errors(http_target):
    """Malformed, oversized, unauthenticated and misrouted requests get a 2xx or an OpenAI-shaped 4xx, never a
    5xx."""

    @settings(FUZZ_SETTINGS, max_examples=RAW_CASES)
    @given(request=raw_requests())
    def fuzz(request: tuple[str, str, dict[str, str | None], bytes]) -> None:
        method, path, headers, body = request
        response = http_target.session.request(method, http_target.base_url + path, headers=headers, data=body,
                                               timeout=30)
        CASES["raw"] += 1
        STATUSES[response.status_code] += 1
        assert response.status_code < 500, (request, response.status_code, response.text)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["message"] and error["type"], response.text

    fuzz()


def test_engine_healthy_after_fuzzing(http_target, oracle_tokens):
    """After the fuzzers: >= MIN_CASES requests were sent, none got a 5xx, nothing is left running or holding KV
    blocks, and a greedy completion still equals the oracle."""
    if not CASES:
        pytest.skip("the fuzzers did not run in this session (deselected)")
    total = sum(CASES.values())
    print(f"\nHTTP fuzz: {total} requests {dict(CASES)}; statuses {dict(sorted(STATUSES.items()))}")
    assert total >= MIN_CASES, dict(CASES)
    assert not any(status >= 500 for status in STATUSES), dict(STATUSES)
    engine = http_target.engine

    async def drained() -> None:  # a dropped stream is aborted once the server notices the hang-up
        await until(lambda: not ((stats := engine.stats()).num_running or stats.num_waiting
                                 or stats.num_kv_blocks_used), timeout_s=120, what="every request drained")

    http_target.loop.run(asyncio.wait_for(drained(), 10))
    response = http_target.session.post(f"{http_target.base_url}/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": ORACLE_PROMPT, "max_tokens": ORACLE_MAX_TOKENS, "temperature": 0,
        "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == ORACLE_MAX_TOKENS
    assert body["choices"][0]["text"] == engine.tokenizer.decode(oracle_tokens)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)
    assert stats.extra["num_step_errors"] == 0
    assert requests.get(f"{http_target.base_url}/ready", timeout=5).status_code == 200


# ---- regressions: what the fuzzers found ---------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, param", [
    ("prompt", [True, False, True], "prompt"),   # was accepted as the token ids [1, 0, 1]
    ("prompt", [["1", 2]], "prompt"),
    ("max_tokens", "4", "max_tokens"),           # was accepted as 4
    ("temperature", "0.5", "temperature"),
    ("seed", 1.5, "seed"),
    ("stream", "true", "stream"),
    ("ignore_eos", 1, "ignore_eos"),
])
def test_json_types_are_not_coerced(http_target, field, value, param):
    """A value of the wrong JSON type is a 400 naming the field, as the schema says (no lax coercion)."""
    response = http_target.session.post(f"{http_target.base_url}/v1/completions", timeout=10, json={
        "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_chat_message_types_are_not_coerced(http_target):
    """A chat message whose content is a number is refused, not turned into text."""
    response = http_target.session.post(f"{http_target.base_url}/v1/chat/completions", timeout=10, json={
        "model": MODEL, "messages": [{"role": "user", "content": 7}]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages"


def test_oversized_bodies_get_413(http_target):
    """A body over max_request_bytes is refused with an OpenAI-shaped 413, by Content-Length or while a chunked
    upload streams in; the server keeps serving."""
    url = f"{http_target.base_url}/v1/completions"
    body = json.dumps({"model": MODEL, "prompt": "x" * MAX_REQUEST_BYTES}).encode()
    headers = {"Content-Type": "application/json"}
    by_length = http_target.session.post(url, data=body, headers=headers, timeout=10)
    chunked = http_target.session.post(url, data=(body[i:i + 65536] for i in range(0, len(body), 65536)),
                                       headers=headers, timeout=10)
    for response in (by_length, chunked):
        assert response.status_code == 413, response.text
        assert "larger than" in response.json()["error"]["message"]
    assert requests.get(f"{http_target.base_url}/health", timeout=5).status_code == 200


def test_long_prompts_are_tokenized_off_the_event_loop(http_target):
    """Long completion prompts and chat messages are tokenized on another thread, so a megabyte prompt cannot
    stall every stream on the loop (the byte-level tokenizer took ~1.7 s per million characters on it)."""
    tokenizer, loop_thread_id = http_target.engine.tokenizer, http_target.loop.thread.ident
    long_text = "y" * (INLINE_ENCODE_CHARS + 1)
    threads: dict[str, int] = {}
    encode = tokenizer.encode

    def recording_encode(text: str, add_bos: bool = True) -> list[int]:
        threads["long" if len(text) > INLINE_ENCODE_CHARS else "short"] = threading.get_ident()
        return encode(text, add_bos)

    tokenizer.encode = recording_encode
    try:
        for path, body in (("/v1/completions", {"prompt": long_text}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]}),
                           ("/v1/completions", {"prompt": "hi", "max_tokens": 1})):
            threads.clear()
            response = http_target.session.post(http_target.base_url + path, json={"model": MODEL, **body},
                                                timeout=30)
            if "long" in threads:  # too long for the 32-token context, once tokenized
                assert response.status_code == 400 and threads["long"] != loop_thread_id, (path, threads)
            else:
                assert response.status_code == 200 and threads["short"] == loop_thread_id, (path, threads)
    finally:
        del tokenizer.encode


def test_tiny_temperature_is_greedy(http_target, oracle_tokens):
    """A temperature just above 0 samples greedily (1e-40, a float32 subnormal on the wire, divided the logits to
    inf: NaN probabilities failed the step, and the request answered 500)."""
    errors_before = http_target.engine.stats().extra["num_step_errors"]
    response = http_target.session.post(f"{http_target.base_url}/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": ORACLE_PROMPT, "max_tokens": ORACLE_MAX_TOKENS, "temperature": 1e-40,
        "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == http_target.engine.tokenizer.decode(oracle_tokens)
    assert http_target.engine.stats().extra["num_step_errors"] == errors_before
