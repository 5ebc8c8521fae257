"""Async scheduling through the engine and a real tp1pp1 worker: with each decode's next step sent ahead (the
worker feeding the token it sampled), every request ends with exactly what it ends with when the router waits for
each step, whatever its options, and aborted or stopped requests give their blocks back."""

from __future__ import annotations

import asyncio
import random

import pytest
import pytest_asyncio

from services.launch.cluster import ClusterConfig, LocalCluster
from services.router.contracts import GenerationRequest
from services.router.main import RouterConfig, build_engine
from services.worker.step import SamplingParams
from tests.conftest import hf_greedy

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def one_worker(serving_checkpoint):
    config = ClusterConfig(model=str(serving_checkpoint), num_workers=1, topology="tp1pp1",
                           kv_cache_bytes=1 << 20, block_size=4)
    with LocalCluster(config) as cluster:
        yield cluster


@pytest_asyncio.fixture
async def engines(one_worker):
    """An engine factory over the one worker (one engine at a time: each holds the worker's step stream)."""
    started = []

    async def start(async_scheduling: bool):
        if started:
            await started.pop().stop()
        engine = await build_engine(RouterConfig(worker_addresses=tuple(one_worker.worker_addresses),
                                                 model_dir=str(one_worker.model_dir), model_name="llama-serving",
                                                 async_scheduling=async_scheduling))
        started.append(engine)
        return engine

    yield start
    for engine in started:
        await engine.stop()


def requests(engine_tokenizer, stop_text: str) -> list[GenerationRequest]:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 160) for _ in range(rng.randrange(1, 25))] for _ in range(8)]
    greedy = [GenerationRequest(f"g{i}", tuple(p), rng.randrange(1, 24)) for i, p in enumerate(prompts)]
    return greedy + [
        GenerationRequest("seeded", tuple(prompts[0]), 20, SamplingParams(temperature=0.9, top_p=0.9, seed=3)),
        GenerationRequest("penalties", tuple(prompts[1]), 20, SamplingParams(presence_penalty=1.5,
                                                                             frequency_penalty=0.5)),
        GenerationRequest("logprobs", tuple(prompts[2]), 12, SamplingParams(num_logprobs=2)),
        GenerationRequest("stop-string", (5, 6, 7, 8), 24, stop_strings=(stop_text,)),
        GenerationRequest("min-tokens", tuple(prompts[3]), 16, stop_token_ids=frozenset(range(80)), min_tokens=6),
        GenerationRequest("one-token", tuple(prompts[4]), 1),
    ]


async def run_all(engine, batch: list[GenerationRequest]):
    async def collect(request):
        deltas = [d async for d in engine.generate(request)]
        return ([t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), deltas[-1].finish_reason,
                [(p.token_id, round(p.logprob, 4)) for d in deltas for p in d.logprobs])

    async def abandoned():  # a client that leaves after three deltas
        stream = engine.generate(GenerationRequest("gone", tuple(range(3, 40)), 200))
        for _ in range(3):
            await stream.__anext__()
        await stream.aclose()

    *results, _ = await asyncio.gather(*(collect(r) for r in batch), abandoned())
    for _ in range(200):  # the abandoned request's blocks come back once its steps in flight return
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_kv_blocks_used == 0:
            break
        await asyncio.sleep(0.02)
    assert stats.num_running == 0 and stats.num_kv_blocks_used == 0
    return results


async def test_steps_ahead_end_every_request_as_waiting_for_each_step_does(engines, serving_checkpoint):
    expected, _ = hf_greedy(serving_checkpoint, [[5, 6, 7, 8]], 24)
    engine = await engines(async_scheduling=False)
    stop_text = engine.tokenizer.decode(expected[0])[6:9]
    batch = requests(engine.tokenizer, stop_text)
    waiting = await run_all(engine, batch)
    assert engine.scheduler.num_ahead_items == 0
    engine = await engines(async_scheduling=True)
    assert engine.steps_ahead
    ahead = await run_all(engine, batch)
    assert engine.stats().num_decodes_ahead == engine.scheduler.num_ahead_items > 50
    assert ahead == waiting
    greedy = [r for r in batch if r.request_id.startswith("g")]
    oracle, _ = hf_greedy(serving_checkpoint, [list(r.prompt_token_ids) for r in greedy], 24)
    for request, result, want in zip(greedy, ahead, oracle):
        assert result[0] == want[:request.max_tokens], request.request_id
    by_id = dict(zip((r.request_id for r in batch), ahead))
    assert by_id["stop-string"][2] == "stop" and stop_text not in by_id["stop-string"][1]
    assert len(by_id["min-tokens"][0]) >= 6 and len(by_id["one-token"][0]) == 1
