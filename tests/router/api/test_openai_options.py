"""OpenAI API completeness against the real engine: logprobs (completions, chat, streams), echo with prompt
logprobs (lm-evaluation-harness' log-likelihood), n > 1, lists of prompts, penalties, min_tokens, logit_bias,
/tokenize and /detokenize."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from services.contracts.step import SamplingParams
from services.router.contracts import GenerationRequest
from tests.router.api.conftest import EOS_PROMPT, MODEL, PROMPT, parse_sse

pytestmark = pytest.mark.multiprocess

ATOL = 1e-4
BASE = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 6, "ignore_eos": True}


async def complete(client, **fields) -> dict:
    response = await client.post("/v1/completions", json={**BASE, **fields})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def hf_log_softmax(serving_checkpoint):
    """transformers' log_softmax at every position of a token sequence: [len, vocab]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(serving_checkpoint, dtype=torch.float32).eval()

    def log_softmax(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)

    return log_softmax


@pytest.fixture
def openai_client(app) -> openai.AsyncOpenAI:
    """The official client over the app in process."""
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api/v1", timeout=60)
    return openai.AsyncOpenAI(base_url="http://api/v1", api_key="unused", http_client=http, max_retries=0)


async def test_echo_with_max_tokens_0_scores_the_prompt_like_transformers(openai_client, serving_engine,
                                                                         hf_log_softmax):
    """What lm-evaluation-harness' local-completions sends for log-likelihood: echo, logprobs, max_tokens 0."""
    prompt_ids = serving_engine.tokenizer.encode(PROMPT)
    completion = await openai_client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2,
                                                        max_tokens=0, temperature=0)
    [choice] = completion.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 0 and completion.usage.prompt_tokens == len(prompt_ids)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt_ids) and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None
    reference = hf_log_softmax(prompt_ids)
    for position in range(1, len(prompt_ids)):  # token at `position` is scored by the logits before it
        expected = reference[position - 1, prompt_ids[position]].item()
        assert abs(logprobs.token_logprobs[position] - expected) <= ATOL
        top = logprobs.top_logprobs[position]
        assert 1 <= len(top) <= 3 and logprobs.tokens[position] in top  # two alternatives, plus the token
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


async def test_completion_logprobs_of_sampled_tokens(client, serving_engine, hf_log_softmax, checkpoint_facts):
    tokenizer = serving_engine.tokenizer
    body = await complete(client, logprobs=3)
    [choice] = body["choices"]
    logprobs = choice["logprobs"]
    prompt_ids = tokenizer.encode(PROMPT)
    generated = checkpoint_facts["reference"][:6]  # the greedy tokens
    assert logprobs["tokens"] == [tokenizer.decode([t], skip_special_tokens=False) for t in generated]
    reference = hf_log_softmax(prompt_ids + generated[:-1])
    for i, (token_id, value) in enumerate(zip(generated, logprobs["token_logprobs"], strict=True)):
        row = reference[len(prompt_ids) - 1 + i]
        assert token_id == row.argmax().item()  # greedy
        assert abs(value - row[token_id].item()) <= ATOL
        # The three most likely (the greedy token one of them); tokens that decode alike share a key.
        assert 1 <= len(logprobs["top_logprobs"][i]) <= 3
    # Raw logprobs: the temperature and penalties change the draw, not the values of the same tokens.
    echoed = await complete(client, logprobs=0, echo=True, max_tokens=6)
    assert echoed["choices"][0]["text"] == PROMPT + choice["text"]
    assert echoed["choices"][0]["logprobs"]["token_logprobs"][-6:] == pytest.approx(logprobs["token_logprobs"],
                                                                                   abs=ATOL)


async def test_streamed_logprobs_equal_the_whole_response(client):
    whole = (await complete(client, logprobs=2, echo=True))["choices"][0]
    response = await client.post("/v1/completions", json={**BASE, "logprobs": 2, "echo": True, "stream": True})
    chunks = [event["choices"][0] for event in parse_sse(response.text)[:-1]]
    assert chunks[0]["text"].startswith(PROMPT)
    merged = {key: sum((c["logprobs"][key] for c in chunks if c["logprobs"]), []) for key in whole["logprobs"]}
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert merged == whole["logprobs"]


async def test_chat_logprobs_and_top_logprobs(openai_client, client):
    messages = [{"role": "user", "content": PROMPT}]
    completion = await openai_client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token  # greedy: the best
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    response = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_completion_tokens": 5, "temperature": 0, "logprobs": True,
        "stream": True})
    streamed = [entry for event in parse_sse(response.text)[:-1] if event["choices"][0]["logprobs"]
                for entry in event["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e.token for e in content]
    assert all(e["top_logprobs"] == [] for e in streamed)
    plain = await openai_client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=2)
    assert plain.choices[0].logprobs is None


async def test_n_choices_and_lists_of_prompts(client):
    seeded = {"temperature": 1.0, "seed": 7, "ignore_eos": True, "max_tokens": 8}
    body = await complete(client, n=3, **seeded)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in body["choices"]]
    assert len(set(texts)) == 3  # choice i is seeded seed + i
    assert (await complete(client, n=3, **seeded))["choices"] == body["choices"]  # reproducible
    assert (await complete(client, **seeded))["choices"][0]["text"] == texts[0]
    assert (await complete(client, **{**seeded, "seed": 8}))["choices"][0]["text"] == texts[1]
    assert body["usage"]["completion_tokens"] == 24 and body["usage"]["prompt_tokens"] == len(PROMPT) + 1
    single = [(await complete(client, prompt=p))["choices"][0]["text"] for p in (PROMPT, EOS_PROMPT)]
    both = await complete(client, prompt=[PROMPT, EOS_PROMPT], n=2)
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in both["choices"]] == [single[0], single[0], single[1], single[1]]
    assert both["usage"]["prompt_tokens"] == len(PROMPT) + len(EOS_PROMPT) + 2
    response = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": True, "max_tokens": 3,
        "ignore_eos": True, "stream_options": {"include_usage": True}})
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 6
    finished = sorted(e["choices"][0]["index"] for e in events[:-2] if e["choices"][0]["finish_reason"])
    assert finished == [0, 1]


async def test_min_tokens_holds_back_eos(client, checkpoint_facts):
    stop = {"prompt": EOS_PROMPT, "ignore_eos": False, "max_tokens": 12}
    early = await complete(client, **stop)
    num_early = early["usage"]["completion_tokens"]
    assert early["choices"][0]["finish_reason"] == "stop" and num_early < 12
    held = await complete(client, **stop, min_tokens=num_early + 2)
    assert held["usage"]["completion_tokens"] >= num_early + 2
    assert held["choices"][0]["text"].startswith(early["choices"][0]["text"])
    assert held["choices"][0]["text"][len(early["choices"][0]["text"])] != chr(checkpoint_facts["second_eos"])


async def _token_ids(engine, prompt_ids: list[int], sampling: SamplingParams, num_tokens: int) -> list[int]:
    request = GenerationRequest(f"penalty-{id(sampling)}", tuple(prompt_ids), num_tokens, sampling)
    return [t for delta in [d async for d in engine.generate(request)] for t in delta.token_ids]


async def test_logit_bias_forces_a_token_and_penalties_change_the_draw(client, serving_engine):
    forced = await complete(client, logit_bias={str(ord("Z")): 100})
    assert forced["choices"][0]["text"] == "Z" * 6
    prompt_ids = serving_engine.tokenizer.encode(PROMPT)
    plain = await _token_ids(serving_engine, prompt_ids, SamplingParams(), 64)
    repeated = await _token_ids(serving_engine, prompt_ids, SamplingParams(repetition_penalty=100.0), 64)
    assert len(set(plain)) < len(plain)  # the greedy continuation repeats itself ...
    assert len(set(repeated)) == len(repeated) and not set(repeated) & set(prompt_ids)  # ... not with the penalty
    for penalty in (SamplingParams(presence_penalty=2.0), SamplingParams(frequency_penalty=2.0)):
        penalized = await _token_ids(serving_engine, prompt_ids, penalty, 64)
        assert len(set(penalized)) > len(set(plain))
    for fields in ({"presence_penalty": 2.0}, {"frequency_penalty": -2.0}, {"repetition_penalty": 1.5}):
        assert (await complete(client, **fields))["usage"]["completion_tokens"] == 6


async def test_tokenize_and_detokenize(client, serving_engine):
    tokenizer = serving_engine.tokenizer
    response = await client.post("/tokenize", json={"model": MODEL, "prompt": PROMPT})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body == {"tokens": tokenizer.encode(PROMPT), "count": len(PROMPT) + 1,
                    "max_model_len": serving_engine.max_model_len}
    without_bos = (await client.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False})).json()
    assert without_bos["tokens"] == body["tokens"][1:]
    chat = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": PROMPT}]})).json()
    assert chat["count"] > body["count"]
    detok = await client.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert detok.json() == {"prompt": PROMPT}
    for path, payload, param in (
        ("/detokenize", {"tokens": [tokenizer.vocab_size]}, "tokens"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
        ("/tokenize", {"model": "gpt-9", "prompt": "a"}, "model"),
    ):
        response = await client.post(path, json=payload)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
