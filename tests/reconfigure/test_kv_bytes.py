"""A→B→A with no step between leaves every used KV block of every layer byte-identical (invariant 3).

The bytes are read straight out of the workers' shared-memory KV pools — nothing is asked of the workers but
where their pools are.
"""

from __future__ import annotations

import asyncio

import pytest

from services.controller.transaction import SwitchTarget, apply_workers, prepare_workers
from services.model.spec import ModelSpec
from services.router.contracts import GenerationRequest
from services.topology import Topology
from tests.conftest import hf_greedy, until
from tests.reconfigure.conftest import generated_tokens
from tests.reconfigure.helpers import same_kv, snapshot_kv

pytestmark = pytest.mark.multiprocess


async def _switch(stubs, topology: str, used: list[int], channel: str) -> None:
    target = SwitchTarget(Topology.parse(topology))
    prepared, capacity = await prepare_workers(stubs, target, 60)
    await apply_workers(stubs, target, prepared, capacity, used, f"bytes-{topology}", 60, channel)


# shm: peers read each other's pools; dist: torch.distributed send/recv (gloo here, NCCL on GPUs).
@pytest.mark.parametrize("middle,channel", [("tp4pp1", "shm"), ("tp2pp1", "shm"), ("tp1pp3", "shm"),
                                            ("tp4pp1", "dist"), ("tp1pp3", "dist")])
async def test_there_and_back_keeps_every_kv_byte(live_stack, switch_checkpoint, middle, channel):
    engine, stubs = live_stack.engine, live_stack.state.worker_stubs
    head_dim = ModelSpec.from_dir(switch_checkpoint).head_dim
    prompts = [[7 + i, 40, 3 * i + 5, 99, 12] * (i + 1) for i in range(6)]
    tasks = [asyncio.ensure_future(generated_tokens(engine, GenerationRequest(f"b{i}", tuple(p), 30)))
             for i, p in enumerate(prompts)]
    await until(lambda: engine.stats().num_generation_tokens >= 6 * 5,  # every request has KV of prompt + output
                timeout_s=120, what="30 tokens generated")
    await engine.freeze()
    used = engine.used_block_ids()
    assert used
    before = await snapshot_kv(stubs, used, head_dim)
    assert len(before) == 3 * 2  # every (layer, KV head) of the model
    await _switch(stubs, middle, used, channel)
    assert same_kv(await snapshot_kv(stubs, used, head_dim), before)  # the middle layout holds the same KV
    await _switch(stubs, "tp2pp2", used, channel)
    assert same_kv(await snapshot_kv(stubs, used, head_dim), before)
    engine.resume()
    expected, _ = hf_greedy(switch_checkpoint, prompts, 30)
    assert await asyncio.gather(*tasks) == expected


def test_block_runs():
    from services.worker.kv_migration import block_runs

    assert block_runs([]) == []
    assert block_runs([0, 1, 2, 5, 6, 9]) == [(0, 3, 0), (5, 7, 3), (9, 10, 5)]
