"""KV pre-copy of a staged switch (issue 12): while the router serves, the full KV blocks of running requests are
copied into the target's staged pools in rounds; the freeze then copies only the delta and swaps. Streams in flight
stay exact, the cached KV is byte-identical there and back, and a failure in a round or in the delta copy rolls back
with the old layout (and its KV) untouched."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from services.controller.status import OperationState
from services.launch.cluster import ClusterConfig, LocalCluster
from services.model.spec import ModelSpec
from services.router.contracts import GenerationRequest
from services.topology import Topology, place, plan_kv_migration
from tests.conftest import hf_greedy, until
from tests.reconfigure.conftest import generated_tokens, open_live_stack
from tests.reconfigure.test_kv_bytes import _equal, _snapshot

pytestmark = pytest.mark.multiprocess

NUM_REQUESTS, MAX_TOKENS = 16, 72
# From tp2pp2: KV replication (4 ranks, 2 KV heads), shrink, grow, an uneven layer split of the same topology (the
# layers a rank keeps are not copied), three stages with a standby, and back.
CHAIN = [("tp4pp1", ()), ("tp2pp1", ()), ("tp2pp2", ()), ("tp2pp2", (1, 2)), ("tp1pp3", ()), ("tp2pp2", ())]


@pytest.fixture(scope="module")
def oracle(switch_checkpoint):
    """Prompts of 9 to 24 tokens (at least 2 full blocks of 4 before any switch) and their greedy outputs."""
    rng = random.Random(12)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(9, 25))] for _ in range(NUM_REQUESTS)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # this tiny model gains nothing from threads; a busy machine makes them spin for long
    try:
        expected, _ = hf_greedy(switch_checkpoint, prompts, MAX_TOKENS)
    finally:
        torch.set_num_threads(threads)
    return prompts, expected


def _start(engine, prompts, prefix: str) -> list[asyncio.Future]:
    return [asyncio.ensure_future(generated_tokens(engine, GenerationRequest(f"{prefix}{i}", tuple(p), MAX_TOKENS)))
            for i, p in enumerate(prompts)]


def _all_decoding(engine, n: int) -> bool:
    """All n requests run and have sampled a token: their prompts' full blocks are cached."""
    running = engine.scheduler.running
    return len(running) == n and all(seq.output_token_ids for seq in running)


def _check_precopied(operation) -> None:
    """A switch that pre-copied: rounds while serving, the delta in the freeze; PRECOPY is outside the downtime."""
    assert operation.state is OperationState.SUCCEEDED, operation.error
    assert operation.staging == "staged" and operation.precopy.endswith(" rounds"), operation
    assert int(operation.precopy.split()[0]) >= 1 and operation.kv_bytes_precopied > 0, operation
    phases = list(operation.phase_seconds)
    assert phases[:4] == ["STAGING", "PRECOPY", "DRAINING", "QUIESCING"], phases
    serving = operation.staging_seconds + operation.phase_seconds["DRAINING"]
    assert operation.downtime_seconds == pytest.approx(sum(operation.phase_seconds.values()) - serving)


async def test_streams_in_flight_survive_a_chain_of_pre_copied_switches(live_stack, oracle):
    prompts, expected = oracle
    engine, reconfigurer = live_stack.engine, live_stack.reconfigurer
    tasks = _start(engine, prompts, "c")
    await until(lambda: _all_decoding(engine, NUM_REQUESTS), what="every request decoding")
    precopied = moved = 0
    for target, partition in CHAIN:
        operation = await reconfigurer.reconfigure(target, layer_partition=partition)
        _check_precopied(operation)
        assert str(engine.topology) == target and live_stack.state.layer_partition == (partition or None)
        assert sum(1 for t in tasks if not t.done()) > 0, "a switch with nothing in flight proves nothing"
        precopied, moved = precopied + operation.kv_bytes_precopied, moved + operation.kv_bytes_moved
    assert moved < precopied  # the rounds copied most of the KV; the freeze only the delta
    outputs = await asyncio.gather(*tasks)
    for i, tokens in enumerate(outputs):
        assert tokens == expected[i], f"request {i}"
    stats = engine.stats()
    assert stats.num_preemptions == 0
    assert stats.extra["num_full_prefills"] == NUM_REQUESTS  # nobody was prefilled again


def _cached_slots(engine) -> dict[tuple[int, int], str]:
    """(block id, offset) -> the request whose cached token's KV is there."""
    size = engine.scheduler.block_manager.block_size
    return {(seq.block_ids[pos // size], pos % size): seq.request_id for seq in engine.scheduler.running
            for pos in range(seq.num_computed_tokens)}


async def test_a_pre_copied_switch_there_and_back_keeps_every_cached_kv_byte(live_stack, oracle, switch_checkpoint):
    prompts, expected = oracle
    prompts, expected = prompts[:6], expected[:6]
    engine, stubs = live_stack.engine, live_stack.state.worker_stubs
    head_dim = ModelSpec.from_dir(switch_checkpoint).head_dim
    tasks = _start(engine, prompts, "b")
    await until(lambda: _all_decoding(engine, len(prompts)), what="every request decoding")
    await engine.freeze()  # hold the requests still to snapshot their KV
    used, cached = engine.used_block_ids(), _cached_slots(engine)
    before = await _snapshot(stubs, used, head_dim)
    assert len(before) == 3 * 2  # every (layer, KV head) of the model
    engine.resume()
    for target in ("tp4pp1", "tp2pp2"):  # the default strategy: staged, with a pre-copy
        _check_precopied(await live_stack.reconfigurer.reconfigure(target))
    await engine.freeze()
    after, now = await _snapshot(stubs, used, head_dim), _cached_slots(engine)
    engine.resume()
    _assert_kept_slots_equal(used, cached, now, before, after)
    assert await asyncio.gather(*tasks) == expected
    assert engine.stats().num_preemptions == 0


def _assert_kept_slots_equal(used, cached, now, before, after) -> None:
    """Decoding went on between the snapshots: every slot cached before, by a request that holds it still, holds the
    same bytes (a request that finished meanwhile may have handed its blocks to another one)."""
    kept = {slot for slot, request_id in cached.items() if now.get(slot) == request_id}
    assert len(kept) > len(cached) // 2, "most requests should still be running"
    mask = torch.tensor([[(b, o) in kept for o in range(4)] for b in used])
    assert _equal({k: v[:, mask] for k, v in after.items()}, {k: v[:, mask] for k, v in before.items()})


def _copied_layer(model_dir, rank: int, live: str = "tp2pp2", target: str = "tp4pp1") -> int:
    """A layer that `rank` fills in `target` by copying (not one it keeps as is): where its faults fire."""
    shape = ModelSpec.from_dir(model_dir).shape
    old, new = place(Topology.parse(live), shape), place(Topology.parse(target), shape)
    plan = plan_kv_migration(old, range(4), new, range(4))
    return next(layer for layer in plan.new_local_layers(rank) if not plan.is_identity_for(rank, layer))


@pytest.fixture(scope="module")
def precopy_faulty_cluster(switch_checkpoint):
    """Rank 1 fails a layer of its first pre-copy round; rank 2 fails a layer of its first delta copy (the cutover
    of a pre-copied switch)."""
    faults = (f"precopy:rank=1:layer={_copied_layer(switch_checkpoint, 1)}:once=1;"
              f"migrate:rank=2:layer={_copied_layer(switch_checkpoint, 2)}:once=1")
    config = ClusterConfig(model=str(switch_checkpoint), num_workers=4, topology="tp2pp2", kv_cache_bytes=1 << 20,
                           block_size=4, faults=faults)
    with LocalCluster(config) as cluster:
        yield cluster


async def test_pre_copy_failures_roll_back_and_the_old_layout_serves_on(precopy_faulty_cluster, oracle,
                                                                        switch_checkpoint):
    prompts, expected = oracle
    head_dim = ModelSpec.from_dir(switch_checkpoint).head_dim
    async with open_live_stack(precopy_faulty_cluster) as stack:
        engine, stubs, reconfigurer = stack.engine, stack.state.worker_stubs, stack.reconfigurer
        tasks = _start(engine, prompts, "f")
        await until(lambda: _all_decoding(engine, NUM_REQUESTS), what="every request decoding")

        # 1. A pre-copy round fails: nothing was frozen, the staged pools are dropped, the old layout serves.
        operation = await reconfigurer.reconfigure("tp4pp1")
        assert operation.state is OperationState.ROLLED_BACK, operation
        assert "injected fault at precopy" in operation.error, operation.error
        assert set(operation.phase_seconds) == {"STAGING", "PRECOPY"} and operation.downtime_seconds == 0
        assert not engine.stats().is_frozen and str(engine.topology) == str(stack.state.topology) == "tp2pp2"

        # 2. The delta copy at the cutover fails: the old pools were only read, the old layout resumes whole.
        await engine.freeze()
        used, cached = engine.used_block_ids(), _cached_slots(engine)
        before = await _snapshot(stubs, used, head_dim)
        engine.resume()
        operation = await reconfigurer.reconfigure("tp4pp1")
        assert operation.state is OperationState.ROLLED_BACK, operation
        assert "rolled back (layers [] " in operation.error, operation.error
        assert operation.precopy.endswith(" rounds") and "ROLLING_BACK" in operation.phase_seconds, operation
        assert str(engine.topology) == str(stack.state.topology) == "tp2pp2" and not engine.stats().is_frozen
        await engine.freeze()
        after, now = await _snapshot(stubs, used, head_dim), _cached_slots(engine)
        engine.resume()
        _assert_kept_slots_equal(used, cached, now, before, after)

        # 3. The faults fired once: the same switch now pre-copies and succeeds.
        _check_precopied(await reconfigurer.reconfigure("tp4pp1"))
        # 4. The pre-copy off: staged still, all the KV moves in the freeze.
        reconfigurer.kv_precopy = False
        operation = await reconfigurer.reconfigure("tp2pp2")
        assert operation.state is OperationState.SUCCEEDED, operation.error
        assert operation.staging == "staged" and operation.precopy == "" and operation.kv_bytes_precopied == 0
        assert "STAGING" in operation.phase_seconds and "PRECOPY" not in operation.phase_seconds
        reconfigurer.kv_precopy = True
        # 5. In place: no staging, so no pre-copy either.
        operation = await reconfigurer.reconfigure("tp4pp1", strategy="in-place")
        assert operation.state is OperationState.SUCCEEDED, operation.error
        assert operation.staging == "in-place" and operation.precopy == "" and operation.kv_bytes_precopied == 0
        assert not {"STAGING", "PRECOPY"} & set(operation.phase_seconds)
        assert sum(1 for t in tasks if not t.done()) > 0, "the switches should have had requests in flight"
        outputs = await asyncio.gather(*tasks)
        for i, tokens in enumerate(outputs):
            assert tokens == expected[i], f"request {i}"
        stats = engine.stats()
        assert stats.num_preemptions == 0 and stats.extra["num_full_prefills"] == NUM_REQUESTS
