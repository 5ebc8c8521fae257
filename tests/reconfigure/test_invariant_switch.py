"""Invariant numerics through live switches (issue 39): 64 greedy bf16 streams carried through tp1pp1 -> tp2pp1 ->
tp1pp2 -> tp2pp2 are bitwise the tokens of the same requests served unswitched together, and of each served alone."""

from __future__ import annotations

import asyncio
import random

import pytest
import pytest_asyncio

from services.controller.status import OperationState
from services.launch.cluster import ClusterConfig, LocalCluster
from services.router.contracts import GenerationRequest
from tests.conftest import make_checkpoint, until
from tests.reconfigure.conftest import generated_tokens, open_live_stack

pytestmark = pytest.mark.multiprocess

CHAIN = ["tp2pp1", "tp1pp2", "tp2pp2"]
NUM_REQUESTS = 64


@pytest.fixture(scope="module")
def invariant_cluster(tmp_path_factory):
    """4 workers in bfloat16 with invariant numerics, starting in tp1pp1 (3 on standby)."""
    checkpoint = make_checkpoint(tmp_path_factory.mktemp("invariant") / "llama-invariant", "llama", seed=7)
    config = ClusterConfig(model=str(checkpoint), num_workers=4, topology="tp1pp1", dtype="bfloat16",
                           numerics="invariant", kv_cache_bytes=4 << 20, block_size=4)
    with LocalCluster(config) as cluster:
        yield cluster


@pytest_asyncio.fixture
async def stack(invariant_cluster):
    async with open_live_stack(invariant_cluster, leave_in="tp1pp1") as live:
        yield live


def _requests(tag: str) -> list[GenerationRequest]:
    rng = random.Random(39)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(1, 40))] for _ in range(NUM_REQUESTS)]
    return [GenerationRequest(f"{tag}-{i}", tuple(p), rng.randrange(100, 140)) for i, p in enumerate(prompts)]


async def test_switches_change_no_token_of_64_bf16_streams(stack):
    engine, reconfigurer = stack.engine, stack.reconfigurer
    alone = [await generated_tokens(engine, request) for request in _requests("alone")]
    together = await asyncio.gather(*(generated_tokens(engine, r) for r in _requests("together")))
    assert together == alone
    tasks = [asyncio.ensure_future(generated_tokens(engine, r)) for r in _requests("switched")]
    await until(lambda: engine.stats().num_running == NUM_REQUESTS, what="every request running before a switch",
                timeout_s=120)
    for target in CHAIN:
        assert any(not t.done() for t in tasks), "a switch with nothing in flight proves nothing"
        operation = await reconfigurer.reconfigure(target)
        assert operation.state is OperationState.SUCCEEDED, operation.error
    switched = await asyncio.gather(*tasks)
    assert [i for i, (got, want) in enumerate(zip(switched, alone)) if got != want] == []
    assert len({tuple(tokens) for tokens in alone}) > NUM_REQUESTS // 2  # streams of their own, not one repeated
