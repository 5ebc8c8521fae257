"""/v1/completions and /v1/chat/completions against the real engine: outputs, usage, streaming format, stops."""

from __future__ import annotations

import asyncio

import pytest

from services.router.api.chat import chat_prompt_token_ids
from services.router.api.protocol import ChatMessage
from tests.router.api.conftest import EOS_PROMPT, MODEL, NUM_REFERENCE_TOKENS, PROMPT, parse_sse

pytestmark = pytest.mark.multiprocess

GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": NUM_REFERENCE_TOKENS, "ignore_eos": True}


async def complete(client, **fields) -> dict:
    response = await client.post("/v1/completions", json={**GREEDY, "prompt": PROMPT, **fields})
    assert response.status_code == 200, response.text
    return response.json()


async def test_greedy_completion_equals_transformers(client, serving_engine, checkpoint_facts):
    tokenizer = serving_engine.tokenizer
    prompt_ids = tokenizer.encode(PROMPT)
    body = await complete(client)
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    [choice] = body["choices"]
    assert choice["text"] == tokenizer.decode(checkpoint_facts["reference"])
    assert choice["finish_reason"] == "length" and choice["index"] == 0 and choice["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": NUM_REFERENCE_TOKENS,
                             "total_tokens": len(prompt_ids) + NUM_REFERENCE_TOKENS}
    # Every accepted prompt shape is the same request.
    for prompt in (prompt_ids, [PROMPT], [prompt_ids]):
        assert (await complete(client, prompt=prompt))["choices"][0]["text"] == choice["text"]


async def test_served_model_name_and_alias_both_work(client, serving_engine):
    body = await complete(client, model=serving_engine.model_name, max_tokens=2)
    assert body["model"] == serving_engine.model_name


async def test_default_max_tokens_is_16(client):
    body = await complete(client, max_tokens=None)
    assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"


async def test_stop_string_truncates_and_finishes_with_stop(client, checkpoint_facts):
    full = (await complete(client))["choices"][0]["text"]
    stop = next(chr(token) for token in checkpoint_facts["reference"][1:] if 0x21 <= token < 0x7F)
    assert stop in full
    body = await complete(client, stop=[stop, "never-generated"])
    assert body["choices"][0]["text"] == full[: full.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] < NUM_REFERENCE_TOKENS


async def test_eos_finishes_unless_ignore_eos(client, checkpoint_facts):
    second_eos = chr(checkpoint_facts["second_eos"])  # a printable byte the checkpoint names as an EOS id
    ignoring = await complete(client, prompt=EOS_PROMPT)
    text = ignoring["choices"][0]["text"]
    assert second_eos in text and ignoring["choices"][0]["finish_reason"] == "length"
    stopped = await complete(client, prompt=EOS_PROMPT, ignore_eos=False)
    assert stopped["choices"][0]["text"].removesuffix(second_eos) == text[: text.index(second_eos)]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] < NUM_REFERENCE_TOKENS


async def test_stop_token_text_is_left_out(client, checkpoint_facts):
    second_eos = chr(checkpoint_facts["second_eos"])
    stopped = await complete(client, prompt=EOS_PROMPT, ignore_eos=False)
    assert second_eos not in stopped["choices"][0]["text"]


async def test_seeded_sampling_repeats(client):
    sampled = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 1234, "max_tokens": 8}
    first = (await complete(client, **sampled))["choices"][0]["text"]
    assert (await complete(client, **sampled))["choices"][0]["text"] == first
    others = {(await complete(client, **{**sampled, "seed": seed}))["choices"][0]["text"] for seed in (1, 2, 3)}
    assert others != {first}  # the seed matters


async def test_streamed_completion_format(client):
    whole = (await complete(client))["choices"][0]["text"]
    response = await client.post("/v1/completions", json={**GREEDY, "prompt": PROMPT, "stream": True,
                                                           "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert len(chunks) >= 2  # streamed, not one blob
    assert {chunk["id"] for chunk in events[:-1]} == {chunks[0]["id"]}
    assert all(chunk["object"] == "text_completion" and chunk["model"] == MODEL for chunk in events[:-1])
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == whole
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert all(chunk["usage"] is None for chunk in chunks)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == NUM_REFERENCE_TOKENS
    # Without include_usage no chunk has a usage field.
    response = await client.post("/v1/completions", json={**GREEDY, "prompt": PROMPT, "stream": True})
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]" and all("usage" not in chunk for chunk in events[:-1])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_continuous_usage_stats(client, path):
    # vLLM's stream_options.continuous_usage_stats, which guidellm always sends (it was a 400 "Extra inputs").
    # guidellm's exact body: stop null, ignore_eos; every chunk then carries its choice's usage so far.
    prompt = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": PROMPT}]}
    body = {**GREEDY, "stop": None, "stream": True, **prompt}
    plain = parse_sse((await client.post(path, json={**body, "stream_options": {"include_usage": True}})).text)
    response = await client.post(path, json={**body, "stream_options": {"include_usage": True,
                                                                         "continuous_usage_stats": True}})
    assert response.status_code == 200, response.text
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    assert events[-2] == {**plain[-2], "id": events[-2]["id"], "created": events[-2]["created"]}
    chunks, final = events[:-2], events[-2]["usage"]
    assert [c["choices"] for c in chunks] == [c["choices"] for c in plain[:-2]]  # same chunks, usage added
    completed = [c["usage"]["completion_tokens"] for c in chunks]
    assert completed == sorted(completed) and completed[-1] == NUM_REFERENCE_TOKENS
    assert all(c["usage"]["prompt_tokens"] == final["prompt_tokens"] and
               c["usage"]["total_tokens"] == final["prompt_tokens"] + c["usage"]["completion_tokens"] for c in chunks)
    # Without include_usage the option changes nothing (as vLLM).
    alone = parse_sse((await client.post(path, json={**body, "stream_options": {"continuous_usage_stats": True}})).text)
    assert all("usage" not in chunk for chunk in alone[:-1])


async def test_chat_greedy_equals_transformers_on_the_chat_template(client, serving_engine, serving_checkpoint,
                                                                    checkpoint_facts):
    import transformers

    messages = [{"role": "user", "content": PROMPT}]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(serving_checkpoint)
    hf_ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ours = chat_prompt_token_ids(serving_engine.tokenizer, [ChatMessage(**messages[0])])
    assert ours == list(hf_ids)
    response = await client.post("/v1/chat/completions", json={**GREEDY, "messages": messages})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant",
                                 "content": serving_engine.tokenizer.decode(checkpoint_facts["chat_reference"])}
    assert choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(ours)
    assert body["usage"]["completion_tokens"] == NUM_REFERENCE_TOKENS


async def test_chat_text_parts_and_max_completion_tokens(client):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    as_string = [messages[0], {"role": "user", "content": "Hello\nthere"}]
    request = {"model": MODEL, "temperature": 0, "ignore_eos": True, "max_completion_tokens": 5}
    parts = (await client.post("/v1/chat/completions", json={**request, "messages": messages})).json()
    joined = (await client.post("/v1/chat/completions", json={**request, "messages": as_string})).json()
    assert parts["choices"] == joined["choices"]
    assert parts["usage"]["completion_tokens"] == 5


async def test_chat_without_max_tokens_may_use_the_rest_of_the_context(client, serving_engine):
    request = {"model": MODEL, "temperature": 0, "ignore_eos": True, "messages": [{"role": "user", "content": "Hi"}]}
    body = (await client.post("/v1/chat/completions", json=request)).json()
    usage = body["usage"]
    assert usage["total_tokens"] == serving_engine.max_model_len
    assert body["choices"][0]["finish_reason"] == "length"


async def test_concurrent_requests_get_their_own_outputs(client):
    """Requests of mixed lengths sharing batches each get what they get alone."""
    prompts = [f"{PROMPT} {index}" for index in range(6)]
    alone = [(await complete(client, prompt=prompt, max_tokens=3 + index))["choices"][0]["text"]
             for index, prompt in enumerate(prompts)]
    together = await asyncio.gather(*(complete(client, prompt=prompt, max_tokens=3 + index)
                                      for index, prompt in enumerate(prompts)))
    assert [body["choices"][0]["text"] for body in together] == alone
    streamed = await asyncio.gather(*(client.post("/v1/completions", json={
        **GREEDY, "prompt": prompt, "max_tokens": 3 + index, "stream": True}) for index, prompt in enumerate(prompts)))
    texts = ["".join(event["choices"][0]["text"] for event in parse_sse(response.text)[:-1]) for response in streamed]
    assert texts == alone


async def test_streamed_chat_format(client):
    request = {**GREEDY, "messages": [{"role": "user", "content": PROMPT}]}
    whole = (await client.post("/v1/chat/completions", json=request)).json()
    response = await client.post("/v1/chat/completions",
                                 json={**request, "stream": True, "stream_options": {"include_usage": True}})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    first, *middle, last, usage_chunk = events[:-1]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in events[:-1])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(set(chunk["choices"][0]["delta"]) == {"content"} for chunk in middle)
    assert "".join(chunk["choices"][0]["delta"]["content"] for chunk in middle) == \
        whole["choices"][0]["message"]["content"]
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
