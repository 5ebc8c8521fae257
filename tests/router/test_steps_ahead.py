"""Async scheduling through the engine and real workers of a single-stage layout (tp1pp1, tp2pp1): with each
decode's next step sent ahead (the workers feeding the token they sampled), every request ends with exactly what it
ends with when the router waits for each step, whatever its options, and aborted or stopped requests give their
blocks back. With two TP ranks, requests sampled without a seed wait for each step (each rank would draw another
token)."""

from __future__ import annotations

import asyncio
import random

import pytest
import pytest_asyncio

from services.launch.cluster import ClusterConfig, LocalCluster
from services.router.async_scheduler import AsyncScheduler
from services.router.contracts import GenerationRequest
from services.router.main import RouterConfig, build_engine
from services.router.scheduler import Scheduler
from services.contracts.step import SamplingParams
from tests.conftest import hf_greedy, until

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module", params=[(1, "tp1pp1"), (2, "tp2pp1")], ids=["tp1pp1", "tp2pp1"])
def single_stage(request, serving_checkpoint):
    num_workers, topology = request.param
    config = ClusterConfig(model=str(serving_checkpoint), num_workers=num_workers, topology=topology,
                           kv_cache_bytes=1 << 20, block_size=4)
    with LocalCluster(config) as cluster:
        yield cluster


@pytest_asyncio.fixture
async def engines(single_stage):
    """An engine factory over the workers (one engine at a time: each holds the workers' step streams)."""
    started = []

    async def start(async_scheduling: bool):
        if started:
            await started.pop().stop()
        engine = await build_engine(RouterConfig(worker_addresses=tuple(single_stage.worker_addresses),
                                                 model_dir=str(single_stage.model_dir), model_name="llama-serving",
                                                 async_scheduling=async_scheduling))
        started.append(engine)
        return engine

    yield start
    for engine in started:
        await engine.stop()


def requests(stop_text: str) -> list[GenerationRequest]:
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
        GenerationRequest("unseeded", tuple(prompts[5]), 16, SamplingParams(temperature=0.8)),  # tokens vary
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
    # The abandoned request's blocks come back once its steps in flight return.
    await until(lambda: (stats := engine.stats()).num_running == 0 and stats.num_kv_blocks_used == 0,
                timeout_s=120, what="the abandoned request's blocks freed")
    return dict(zip((r.request_id for r in batch), results))


async def test_steps_ahead_end_every_request_as_waiting_for_each_step_does(engines, serving_checkpoint):
    expected, _ = hf_greedy(serving_checkpoint, [[5, 6, 7, 8]], 24)
    engine = await engines(async_scheduling=False)
    stop_text = engine.tokenizer.decode(expected[0])[6:9]
    batch = requests(stop_text)
    waiting = await run_all(engine, batch)
    assert engine.scheduler.num_ahead_items == 0 and type(engine.scheduler) is Scheduler  # the base waits
    engine = await engines(async_scheduling=True)
    assert engine.steps_ahead and isinstance(engine.scheduler, AsyncScheduler)  # the layer goes ahead
    ahead = await run_all(engine, batch)
    assert engine.stats().num_decodes_ahead == engine.scheduler.num_ahead_items > 50
    unseeded = ahead.pop("unseeded"), waiting.pop("unseeded")
    assert ahead == waiting
    assert [len(tokens) for tokens, *_ in unseeded] == [16, 16]
    greedy = [r for r in batch if r.request_id.startswith("g")]
    oracle, _ = hf_greedy(serving_checkpoint, [list(r.prompt_token_ids) for r in greedy], 24)
    for request, want in zip(greedy, oracle):
        assert ahead[request.request_id][0] == want[:request.max_tokens], request.request_id
    assert ahead["stop-string"][2] == "stop" and stop_text not in ahead["stop-string"][1]
    assert len(ahead["min-tokens"][0]) >= 6 and len(ahead["one-token"][0]) == 1
