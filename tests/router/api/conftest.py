"""Fixtures of the HTTP API tests: an ASGI client over the real engine, and a real uvicorn server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import torch
from fastapi import FastAPI

from services.model.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID
from services.router.api import ApiConfig, create_app
from services.router.api.server import HttpServer, bind_http_socket
from tests.conftest import until


PROMPT = "The quick brown fox"     # the greedy reference prompt (completions, and chat as the user message)
EOS_PROMPT = "Once upon a time"    # its greedy continuation meets the checkpoint's second EOS id
NUM_REFERENCE_TOKENS = 12
FACTS_FILE = "api_test_facts.json"


def _greedy(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def serving_checkpoint(tmp_path_factory) -> Path:
    """Overrides tests/router/conftest.py's: a Llama checkpoint whose vocabulary covers its tokenizer
    (make_checkpoint's 160 rows are fewer than the byte-level tokenizer's 259 ids: bos 256 would index past
    the embedding). Its generation_config names a second EOS id, a printable byte that the greedy continuation
    of EOS_PROMPT produces and that of PROMPT (completion and chat) does not; FACTS_FILE keeps the references."""
    import transformers

    from services.model.tokenizer import NUM_TOKENS, Tokenizer, write_tokenizer_files
    from services.router.api.chat import chat_prompt_token_ids
    from services.router.api.protocol import ChatMessage
    from tests.conftest import decisive_init

    directory = tmp_path_factory.mktemp("api-serving") / "llama-api"
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=NUM_TOKENS + 5, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID, pad_token_id=None, tie_word_embeddings=False,
    )
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(config).eval()
    decisive_init(model, seed=5)
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer_files(directory, config.max_position_embeddings)
    tokenizer = Tokenizer.from_dir(directory)
    chat_ids = chat_prompt_token_ids(tokenizer, [ChatMessage(role="user", content=PROMPT)])
    reference = _greedy(model, tokenizer.encode(PROMPT), NUM_REFERENCE_TOKENS)
    chat_reference = _greedy(model, chat_ids, NUM_REFERENCE_TOKENS)
    eos_continuation = _greedy(model, tokenizer.encode(EOS_PROMPT), NUM_REFERENCE_TOKENS)
    second_eos = next(token for token in eos_continuation[2:]
                      if 0x21 <= token < 0x7F and token not in reference + chat_reference)
    generation_config = {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": [EOS_TOKEN_ID, second_eos]}
    (directory / "generation_config.json").write_text(json.dumps(generation_config))
    facts = {"reference": reference, "chat_reference": chat_reference, "second_eos": second_eos}
    (directory / FACTS_FILE).write_text(json.dumps(facts))
    return directory


@pytest.fixture(scope="module")
def checkpoint_facts(serving_checkpoint) -> dict:
    """Greedy references of the serving checkpoint: `reference`, `chat_reference` (token ids), `second_eos`."""
    return json.loads((serving_checkpoint / FACTS_FILE).read_text())


MODEL = "test-model"  # an alias of the served model, so tests do not depend on the fixture's model name


@pytest.fixture
def api_config() -> ApiConfig:
    """The API settings of the app under test."""
    return ApiConfig(model_aliases=(MODEL,))


@pytest.fixture
def app(serving_engine, api_config) -> FastAPI:
    """The HTTP app over the real engine (tests/router/conftest.py: real worker processes)."""
    return create_app(serving_engine, api_config)


@pytest_asyncio.fixture
async def client(app) -> AsyncIterator[httpx.AsyncClient]:
    """An in-process client of the app (ASGI transport); app errors come back as responses, not exceptions."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://api", timeout=60) as http:
        yield http


@asynccontextmanager
async def live_server(app: FastAPI, is_draining: Callable[[], bool] = lambda: False) -> AsyncIterator[str]:
    """Serve `app` with the router's HTTP server (services.router.api.server) on a free loopback port in this event
    loop; yields its base URL."""
    sock = bind_http_socket("127.0.0.1", 0)
    server = HttpServer(app, is_draining=is_draining)
    task = await server.start(sock)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


def parse_sse(body: str) -> list[dict | str]:
    """The `data:` payloads of an SSE body: dicts for JSON events, the string "[DONE]" for the end."""
    import json

    events: list[dict | str] = []
    for block in body.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: ") and "\n" not in block, f"not one data line: {block!r}"
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def wait_until_idle(engine, timeout_s: float = 10.0) -> None:
    """Wait until the engine runs and queues nothing and every KV block is free."""
    def idle() -> bool:
        stats = engine.stats()
        return stats.num_running == 0 and stats.num_waiting == 0 and stats.num_kv_blocks_used == 0

    try:
        await until(idle, timeout_s, what="the engine idle", interval_s=0.02)
    except AssertionError as error:
        raise AssertionError(f"{error}: {engine.stats()}") from None
