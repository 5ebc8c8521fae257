"""/v1/models, /health, /ready and /metrics against the real engine."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.router.api import ApiConfig, create_app
from services.router.contracts import GenerationRequest
from services.router.engine import Engine
from tests.conftest import until
from tests.router.api.conftest import MODEL, PROMPT, wait_until_idle

pytestmark = pytest.mark.multiprocess

ENGINE_METRICS = (
    "reconfig:num_requests_running", "reconfig:num_requests_waiting", "reconfig:kv_cache_usage_perc",
    "reconfig:prompt_tokens", "reconfig:generation_tokens", "reconfig:num_preemptions", "reconfig:topology_info",
    "reconfig:router_stalled", "reconfig:decodes_ahead_total",
)
LATENCY_METRICS = (
    "reconfig:time_to_first_token_seconds", "reconfig:inter_token_latency_seconds",
    "reconfig:e2e_request_latency_seconds",
)


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) → value of a Prometheus text exposition."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(parsed: dict, name: str, **labels: str) -> float:
    matches = [v for (sample, sample_labels), v in parsed.items()
               if sample == name and set(labels.items()) <= sample_labels]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


async def test_models_lists_the_served_name_and_aliases(client, serving_engine):
    response = await client.get("/v1/models")
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    assert [card["id"] for card in body["data"]] == [serving_engine.model_name, MODEL]
    for card in body["data"]:
        assert card["object"] == "model" and card["owned_by"] == "reconfig"
        assert card["max_model_len"] == serving_engine.max_model_len and isinstance(card["created"], int)


async def test_health_and_readiness(client, serving_engine):
    assert (await client.get("/health")).status_code == 200
    assert serving_engine.is_ready
    response = await client.get("/ready")
    assert response.status_code == 200 and response.json() == {"status": "ready"}
    # An engine whose step loop has not started is alive but not ready.
    idle = Engine(serving_engine.driver, serving_engine.tokenizer, "idle", serving_engine.max_model_len)
    transport = httpx.ASGITransport(app=create_app(idle, ApiConfig()))
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
        assert (await http.get("/health")).status_code == 200
        response = await http.get("/ready")
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "not_ready"


async def test_metrics_after_one_request(client, serving_engine):
    before = samples((await client.get("/metrics")).text)
    assert value(before, "reconfig:time_to_first_token_seconds_count") == 0
    num_tokens = 6
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": num_tokens,
                                                          "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200
    scrape = await client.get("/metrics")
    assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain")
    after = samples(scrape.text)
    names = {name for name, _ in after}
    for metric in ENGINE_METRICS:
        assert any(name.startswith(metric) for name in names), metric
    for metric in LATENCY_METRICS:
        assert f"{metric}_bucket" in names and f"{metric}_count" in names, metric
    model = serving_engine.model_name
    assert value(after, "reconfig:topology_info", topology=str(serving_engine.topology), model_name=model) == 1
    assert value(after, "reconfig:time_to_first_token_seconds_count") == 1
    assert value(after, "reconfig:inter_token_latency_seconds_count") == num_tokens - 1
    assert value(after, "reconfig:e2e_request_latency_seconds_count") == 1
    assert value(after, "reconfig:request_success_total", finished_reason="length") == 1
    stats = serving_engine.stats()
    assert value(after, "reconfig:prompt_tokens_total") == stats.num_prompt_tokens
    assert value(after, "reconfig:generation_tokens_total") == stats.num_generation_tokens >= num_tokens
    assert value(after, "reconfig:num_requests_running") == 0
    assert value(after, "reconfig:decodes_ahead_total") == stats.num_decodes_ahead
    assert value(after, "reconfig:router_stalled") == 0
    assert value(after, "reconfig:kv_cache_usage_perc") == 0.0  # the finished request's blocks are free


async def test_queue_and_kv_cache_gauges_follow_a_request(client, serving_engine):
    await serving_engine.freeze()  # admitted requests wait: no step runs
    request = GenerationRequest("held", tuple(range(1, 40)), max_tokens=200)
    iterator = serving_engine.generate(request)
    pending = asyncio.ensure_future(anext(iterator))
    try:
        await until(lambda: serving_engine.stats().num_waiting == 1, what="the request admitted")
        parsed = samples((await client.get("/metrics")).text)
        assert value(parsed, "reconfig:num_requests_waiting") == 1
        assert value(parsed, "reconfig:kv_cache_usage_perc") == 0.0
        serving_engine.resume()
        await pending  # the first token: the request runs and holds its prompt's blocks
        parsed = samples((await client.get("/metrics")).text)
        assert value(parsed, "reconfig:num_requests_running") == 1
        assert value(parsed, "reconfig:kv_cache_usage_perc") > 0
    finally:
        serving_engine.resume()
        pending.cancel()
        await iterator.aclose()
    await wait_until_idle(serving_engine)
