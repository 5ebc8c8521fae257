"""A→B→A with no step between leaves every used KV block of every layer byte-identical (invariant 3).

The bytes are read straight out of the workers' shared-memory KV pools — nothing is asked of the workers but
where their pools are.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.controller.transaction import SwitchTarget, apply_workers, prepare_workers
from services.model.spec import ModelSpec
from services.router.contracts import GenerationRequest
from services.rpc.reconfig.v1 import worker_pb2
from services.topology import Topology
from services.weightstore.shm import ShmSegment
from tests.conftest import hf_greedy, until
from tests.reconfigure.conftest import generated_tokens

pytestmark = pytest.mark.multiprocess


async def kv_layer_views(stubs, head_dim: int):
    """Every active worker's KV layer tensors, read out of its shared-memory pool: yields (info, layer, view
    [2, blocks, block_size, local KV heads, head_dim]); a view is valid until the next one is yielded."""
    for stub in stubs:
        info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
        if info.num_kv_blocks == 0:
            continue  # standby
        pools = await stub.PrepareSwitch(worker_pb2.PrepareSwitchRequest(topology=info.topology), timeout=10)
        num_heads = info.kv_head_end - info.kv_head_start
        for layer, name in pools.kv_segments.items():
            segment = ShmSegment.attach(name, readonly=True, copy_on_write=True)
            try:
                flat = torch.frombuffer(segment.buffer, dtype=torch.float32)
                cache = flat[: 2 * info.num_kv_blocks * info.block_size * num_heads * head_dim]
                yield info, layer, cache.view(2, info.num_kv_blocks, info.block_size, num_heads, head_dim)
            finally:
                segment.close()


async def _snapshot(stubs, used: list[int], head_dim: int) -> dict[tuple[int, int], torch.Tensor]:
    """(layer, global KV head) -> K/V of the used blocks [2, used, block_size, head_dim], from every owner."""
    used_t = torch.tensor(used)
    snapshot: dict[tuple[int, int], torch.Tensor] = {}
    async for info, layer, cache in kv_layer_views(stubs, head_dim):
        for i, head in enumerate(range(info.kv_head_start, info.kv_head_end)):
            data = cache[:, used_t, :, i].clone()
            if (layer, head) in snapshot:  # a replica must hold the same bytes
                assert torch.equal(snapshot[(layer, head)], data), (layer, head, info.rank)
            snapshot[(layer, head)] = data
    return snapshot


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
    before = await _snapshot(stubs, used, head_dim)
    assert len(before) == 3 * 2  # every (layer, KV head) of the model
    await _switch(stubs, middle, used, channel)
    assert _equal(await _snapshot(stubs, used, head_dim), before)  # the middle layout holds the same KV
    await _switch(stubs, "tp2pp2", used, channel)
    assert _equal(await _snapshot(stubs, used, head_dim), before)
    engine.resume()
    expected, _ = hf_greedy(switch_checkpoint, prompts, 30)
    assert await asyncio.gather(*tasks) == expected


def _equal(after: dict, before: dict) -> bool:
    return after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_block_runs():
    from services.worker.kv_migration import block_runs

    assert block_runs([]) == []
    assert block_runs([0, 1, 2, 5, 6, 9]) == [(0, 3, 0), (5, 7, 3), (9, 10, 5)]
