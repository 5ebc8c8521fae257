"""Live switches of an MoE model between tensor- and expert-parallel layouts (issue 14, Moebius): the router gives
every running request a KV pool of the target (block maps), the workers move KV by (layer, head, pool) and the
expert weights change view; requests in flight finish with transformers' tokens, every used KV byte survives
tp4 -> ep4 -> tp4, and a fault in the middle of the KV move or of the experts' in-place all-to-all rolls back with the
old layout byte-identical."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from services.controller.plan import plan_switch
from services.controller.status import OperationState
from services.controller.transaction import SwitchTarget, apply_workers, prepare_workers
from services.launch.cluster import ClusterConfig, LocalCluster
from services.model.expert_reshard import RESHARD_ENV
from services.model.spec import ModelSpec
from services.router.contracts import GenerationRequest
from services.router.wire import block_maps_to_pb
from services.topology import Topology
from tests.conftest import hf_greedy, make_checkpoint, until
from tests.reconfigure.conftest import generated_tokens, open_live_stack
from tests.reconfigure.helpers import kv_layer_views, same_kv

pytestmark = pytest.mark.multiprocess

# In place, the experts change view by all-to-all; staged, the target's shards are built from the store beside the
# steps and the KV of running requests is pre-copied into the pools of the target (their ids reserved by the router).
CHAIN = [("ep4pp1", "in-place"), ("tp4pp1", "in-place"), ("ep2pp2", "staged"), ("ep2pp1", "staged"),
         ("tp2pp2", "staged")]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """Qwen3-MoE style: 3 layers (layer 1 dense), 4 query / 2 KV heads, 8 experts of 32 intermediate."""
    return make_checkpoint(tmp_path_factory.mktemp("ep-switch") / "qwen3-moe", "qwen3_moe", seed=7)


def _cluster(checkpoint, faults: str = "") -> LocalCluster:
    """4 workers in tp4pp1; experts move by all-to-all in every switch that can (over gloo the default is the
    weight store, faster on one host: this exercises the path GPUs take)."""
    return LocalCluster(ClusterConfig(model=str(checkpoint), num_workers=4, topology="tp4pp1", kv_cache_bytes=1 << 20,
                                      block_size=4, faults=faults, env={RESHARD_ENV: "on"}))


async def test_streams_survive_a_rollback_and_tp_ep_switches(moe_checkpoint):
    """16 streams; tp4 -> ep4 fails in a pre-copy round (rank 1, while serving), then on rank 2 in the middle of the
    KV move (layer 2) and rolls back, then (in place) in the experts' all-to-all of layer 2; then tp4 -> ep4 -> tp4
    in place, -> ep2pp2 -> ep2pp1 -> tp2pp2 staged with their KV pre-copied: every stream ends with transformers'
    tokens, none re-prefilled."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(2, 30))] for _ in range(16)]
    lengths = [rng.randrange(70, 110) for _ in prompts]  # outlast the chain on a busy machine
    expected, _ = hf_greedy(moe_checkpoint, prompts, max(lengths))
    faults = "precopy:rank=1:layer=0:once=1;migrate:rank=2:layer=2:once=1;reshard:rank=2:layer=2:once=1"
    with _cluster(moe_checkpoint, faults) as cluster:
        async with open_live_stack(cluster, leave_in=None) as stack:
            engine = stack.engine
            tasks = [asyncio.ensure_future(generated_tokens(engine, GenerationRequest(f"m{i}", tuple(p), n)))
                     for i, (p, n) in enumerate(zip(prompts, lengths))]
            await until(lambda: engine.stats().num_running == len(prompts), what="every request running")
            outputs, stats = await _chain(stack, tasks, ModelSpec.from_dir(moe_checkpoint).head_dim)
    for i, tokens in enumerate(outputs):
        assert tokens == expected[i][: lengths[i]], f"request {i}"
    assert stats.num_preemptions == 0
    assert stats.extra["num_full_prefills"] == len(prompts)


async def _chain(stack, tasks, head_dim: int):
    engine, stubs = stack.engine, stack.state.worker_stubs
    # A pre-copy round into the EP target's pools fails on rank 1 while serving: nothing was frozen, the router's
    # reservations and the staged pools are dropped, tp4 serves on.
    operation = await stack.reconfigurer.reconfigure("ep4pp1")
    assert operation.state is OperationState.ROLLED_BACK and "injected fault at precopy" in operation.error, operation
    assert set(operation.phase_seconds) == {"STAGING", "PRECOPY"} and operation.downtime_seconds == 0
    assert str(engine.topology) == "tp4pp1" and not engine.stats().is_frozen
    # Staged: the KV move fails, the staged shards are dropped. In place: the experts' all-to-all fails at layer 2
    # after layer 0's old experts were let go (one layer of extra memory): they come back from the store.
    for strategy, error in (("staged", "rolled back (layers ["), ("in-place", "failed to build its shard")):
        await engine.freeze()  # hold the requests still to read their KV before the failed switch
        tables, filled = _tables(engine), _filled(engine)
        before = _positions(await _snapshot(stubs, tables, head_dim), filled)
        engine.resume()
        operation = await stack.reconfigurer.reconfigure("ep4pp1", strategy=strategy)
        assert operation.state is OperationState.ROLLED_BACK, operation
        assert ("STAGING" in operation.phase_seconds) == (strategy == "staged")
        assert error in operation.error and str(engine.topology) == "tp4pp1", operation.error
        await engine.freeze()  # steps ran since: requests only appended to their tables
        for request_id, (pool, ids) in _tables(engine).items():
            assert pool == tables[request_id][0] and ids[: len(tables[request_id][1])] == tables[request_id][1]
        after = _positions(await _snapshot(stubs, tables, head_dim), filled)
        assert same_kv(after, before)  # every position cached before the switch: the same bytes in the old layout
        engine.resume()
    for target, strategy in CHAIN:
        operation = await stack.reconfigurer.reconfigure(target, strategy=strategy)
        assert operation.state is OperationState.SUCCEEDED, operation.error
        assert str(engine.topology) == target
        if strategy == "in-place":  # TP <-> EP of one width and the same stages: experts change view by all-to-all
            assert operation.weight_bytes_resharded > 0, (target, operation)
        else:  # 1 -> 2 KV pools per stage, 2 -> 2 (each request keeps its pool), 2 -> 1: pre-copied, the freeze
            # copies the last blocks only
            assert operation.precopy.endswith("rounds") and operation.kv_bytes_precopied > 0, operation.precopy
            assert 0 < operation.kv_bytes_moved < operation.kv_bytes_precopied, operation
        assert any(not t.done() for t in tasks), "a switch with nothing in flight proves nothing"
    return await asyncio.gather(*tasks), engine.stats()


def _tables(engine) -> dict[str, tuple[int, list[int]]]:
    """request_id -> (its KV pool, its block ids) in the router now."""
    blocks = engine.scheduler.block_manager
    return {s.request_id: (blocks.rank_of(s), list(s.block_ids)) for s in engine.scheduler.running if s.block_ids}


def _filled(engine) -> dict[str, int]:
    """request_id -> positions cached now (their KV never changes afterwards: decode appends)."""
    return {s.request_id: s.num_computed_tokens for s in engine.scheduler.running if s.block_ids}


def _positions(snapshot, filled: dict[str, int]) -> dict:
    """Each (request, layer, head) entry cut to the request's cached positions: [2, positions, D]."""
    cut = {}
    for (request_id, layer, head), data in snapshot.items():
        flat = data.reshape(2, -1, data.shape[-1])
        cut[request_id, layer, head] = flat[:, : filled[request_id]]
    return cut


async def _snapshot(stubs, tables, head_dim: int) -> dict[tuple[str, int, int], torch.Tensor]:
    """(request, layer, KV head) -> K/V of the request's blocks [2, blocks, block_size, D], read out of the
    workers' shared-memory pools; replicas (TP ranks sharing a KV head) must agree."""
    snapshot: dict[tuple[str, int, int], torch.Tensor] = {}
    async for info, layer, cache in kv_layer_views(stubs, head_dim):
        pool = info.ep_rank if info.ep_size > 1 else 0
        for request_id, (request_pool, ids) in tables.items():
            if request_pool != pool:
                continue
            for i, head in enumerate(range(info.kv_head_start, info.kv_head_end)):
                data = cache[:, torch.tensor(ids), :, i].clone()
                key = (request_id, layer, head)
                if key in snapshot:
                    assert torch.equal(snapshot[key], data), (key, info.rank)
                snapshot[key] = data
    return snapshot


async def _switch(engine, stubs, topology: str) -> list:
    """One switch driven by hand with the router frozen throughout (no step between switches); the workers'
    ApplySwitch replies."""
    target = SwitchTarget(Topology.parse(topology))
    prepared, capacity = await prepare_workers(stubs, target, 60)
    maps = await engine.rebind(capacity, dp_size=target.topology.num_kv_pools)
    replies = await apply_workers(stubs, target, prepared, capacity, engine.used_block_ids() if maps is None else [],
                                  f"bytes-{topology}", 60, block_maps=block_maps_to_pb(maps) if maps else ())
    await engine.rebind(capacity, tuple(engine.driver.addresses))  # the same workers, in their new layout
    return replies


async def test_tp_ep_tp_keeps_every_kv_byte(moe_checkpoint):
    """With the router frozen throughout, tp4 -> ep4 -> tp4 leaves every used KV byte of every request, layer and
    KV head where the request's block table says, in the middle layout too."""
    head_dim = ModelSpec.from_dir(moe_checkpoint).head_dim
    prompts = [[7 + i, 40, 3 * i + 5, 99, 12] * (i + 1) for i in range(8)]
    with _cluster(moe_checkpoint) as cluster:
        outputs = await _there_and_back(cluster, prompts, head_dim)
    expected, _ = hf_greedy(moe_checkpoint, prompts, 30)
    assert outputs == expected


async def _there_and_back(cluster, prompts, head_dim):
    async with open_live_stack(cluster, leave_in=None) as stack:
        engine, stubs = stack.engine, stack.state.worker_stubs
        tasks = [asyncio.ensure_future(generated_tokens(engine, GenerationRequest(f"b{i}", tuple(p), 30)))
                 for i, p in enumerate(prompts)]
        await until(lambda: engine.stats().num_generation_tokens >= 8 * 5, what="KV of prompts and outputs")
        await engine.freeze()
        plan = await plan_switch(stack.reconfigurer, "ep4pp1")  # what the switch below will move
        assert all(w.weight_bytes_reshard > 0 for w in plan.workers) and sum(w.kv_bytes_in for w in plan.workers)
        # In place: one sparse layer of a worker's experts (2 sparse layers here) beyond its shards, as planned
        assert all(2 * w.expert_peak_extra_bytes == w.weight_bytes_reshard for w in plan.workers)
        before_tables = _tables(engine)
        before = await _snapshot(stubs, before_tables, head_dim)
        assert len(before) == len(before_tables) * 3 * 2  # every request, layer and KV head
        replies = await _switch(engine, stubs, "ep4pp1")
        assert [r.expert_peak_extra_bytes for r in replies] == [w.expert_peak_extra_bytes for w in plan.workers]
        middle = _tables(engine)
        assert {rid for rid in middle} == set(before_tables) and len({p for p, _ in middle.values()}) > 1
        # Each request went to the pool the Plan said (Moebius' rule), with the blocks it held
        assert {p.request_id: (p.dst_pool, p.num_blocks) for p in plan.placements} == {
            rid: (pool, len(ids)) for rid, (pool, ids) in middle.items()}
        assert [(p.num_requests, p.num_blocks) for p in plan.pools] == [
            (sum(1 for pool, _ in middle.values() if pool == q), sum(len(ids) for pool, ids in middle.values()
                                                                     if pool == q)) for q in range(4)]
        assert same_kv(await _snapshot(stubs, middle, head_dim), before)  # each request whole on its EP rank
        await _switch(engine, stubs, "tp4pp1")
        assert same_kv(await _snapshot(stubs, _tables(engine), head_dim), before)
        engine.resume()
        return await asyncio.gather(*tasks)
