"""KV pre-copy of a staged switch (issue 12): while the router serves, the full KV blocks of running requests are
copied into the target's staged pools in rounds; the freeze then copies only the delta and swaps. Streams in flight
stay exact, the cached KV is byte-identical there and back, and a failure in a round or in the delta copy rolls back
with the old layout (and its KV) untouched."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from services.controller import transaction
from services.controller.status import OperationState
from services.launch.cluster import ClusterConfig, LocalCluster
from services.model.spec import ModelSpec
from services.router.contracts import GenerationRequest
from services.topology import Topology, place, plan_kv_migration
from tests.conftest import hf_greedy, until
from tests.reconfigure.conftest import generated_tokens, open_live_stack
from tests.reconfigure.helpers import same_kv, snapshot_kv

pytestmark = pytest.mark.multiprocess

NUM_REQUESTS, MAX_TOKENS = 16, 72
WAVE = 8  # requests started before a switch or a pre-copy round when the latest ones are past half their tokens
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


@pytest.fixture
def hold_requests_while_staging(monkeypatch):
    """hold(engine): from then on, the requests of `engine` stand still (the router frozen, as in a freeze) while
    the workers stage a switch. Staging takes 1-12 s on a busy 2-core machine (the first one here ~1 s), as long as
    these requests decode: left to serve on, they could all finish before the first pre-copy round, which then
    rightly copies nothing ("2 rounds", 0 bytes) or fires no injected fault. Staging while serving is
    test_staging's; the pre-copy rounds, what this file tests, still run while the router serves."""
    stage_workers = transaction.stage_workers

    def hold(engine) -> None:
        async def stage_held(*args, **kwargs):
            await engine.freeze()
            try:
                return await stage_workers(*args, **kwargs)
            finally:
                engine.resume()

        monkeypatch.setattr(transaction, "stage_workers", stage_held)

    return hold


def _start(engine, prompts, prefix: str) -> list[asyncio.Future]:
    return [asyncio.ensure_future(generated_tokens(engine, GenerationRequest(f"{prefix}{i}", tuple(p), MAX_TOKENS)))
            for i, p in enumerate(prompts)]


def _all_decoding(engine, n: int, prefix: str | None = None) -> bool:
    """All n requests (those of `prefix`, else every one) run and have sampled a token: their prompts' full blocks
    are cached."""
    running = [seq for seq in engine.scheduler.running if prefix is None or seq.request_id.startswith(prefix)]
    return len(running) == n and all(seq.output_token_ids for seq in running)


class _Streams:
    """Greedy requests over the oracle's prompts, and the tokens each must produce: a first NUM_REQUESTS, then WAVE
    more whenever the latest ones are past half their tokens (keep_decoding). A switch serves on for its pre-copy
    rounds and its drain, so a few switches last as long as a request decodes. The earlier requests are then nearly
    done: the KV pool holds them all at once (at most 24 of at most 25 blocks), with no preemption."""

    def __init__(self, engine, oracle, tag: str) -> None:
        self.engine, self.tag = engine, tag
        self.prompts, self.expected = oracle
        self.tasks: list[asyncio.Future] = []
        self.wanted: list[list[int]] = []
        self.latest = ("", 0)  # the latest requests: the prefix of their ids, how many

    async def start(self, n: int) -> None:
        """n more requests (the next prompts), once every one of them decodes."""
        first, prefix = len(self.tasks) % NUM_REQUESTS, f"{self.tag}{len(self.tasks)}-"
        self.tasks += _start(self.engine, self.prompts[first:first + n], prefix)
        self.wanted += self.expected[first:first + n]
        self.latest = (prefix, n)
        await until(lambda: _all_decoding(self.engine, n, prefix), what=f"the requests {prefix}* decoding")

    async def keep_decoding(self) -> None:
        """Before a switch: more requests when one of the latest has less than half its tokens to go (or ended)."""
        prefix, n = self.latest
        latest = [seq for seq in self.engine.scheduler.running if seq.request_id.startswith(prefix)]
        if len(latest) < n or any(MAX_TOKENS - len(seq.output_token_ids) < MAX_TOKENS // 2 for seq in latest):
            await self.start(WAVE)

    def in_flight(self) -> int:
        return sum(1 for t in self.tasks if not t.done())

    async def check(self) -> None:
        """Every request produced the tokens it would have without the switches, and none was prefilled again."""
        outputs = await asyncio.gather(*self.tasks)
        for i, tokens in enumerate(outputs):
            assert tokens == self.wanted[i], f"request {i}"
        stats = self.engine.stats()
        assert stats.num_preemptions == 0
        assert stats.extra["num_full_prefills"] == len(self.tasks)


class _RoundsKeepDecoding:
    """A Reconfigurer's router stub that tops the requests up (_Streams.keep_decoding) before each pre-copy round: on
    a busy machine a round's copies, on a stage thread of nice 19, can take as long as the latest requests' tokens;
    the freeze after the last round must still find requests decoding."""

    def __init__(self, stub, streams: _Streams) -> None:
        self._stub, self._streams = stub, streams

    def __getattr__(self, name: str):
        return getattr(self._stub, name)

    async def PreCopyBlocks(self, request, **kwargs):  # noqa: N802
        await self._streams.keep_decoding()
        return await self._stub.PreCopyBlocks(request, **kwargs)


def _check_precopied(operation) -> None:
    """A switch that pre-copied: rounds while serving, the delta in the freeze; PRECOPY is outside the downtime."""
    assert operation.state is OperationState.SUCCEEDED, operation.error
    assert operation.staging == "staged" and operation.precopy.endswith(" rounds"), operation
    assert int(operation.precopy.split()[0]) >= 1 and operation.kv_bytes_precopied > 0, operation
    phases = list(operation.phase_seconds)
    assert phases[:4] == ["STAGING", "PRECOPY", "DRAINING", "QUIESCING"], phases
    serving = operation.staging_seconds + operation.phase_seconds["DRAINING"]
    assert operation.downtime_seconds == pytest.approx(sum(operation.phase_seconds.values()) - serving)


async def test_streams_in_flight_survive_a_chain_of_pre_copied_switches(live_stack, oracle,
                                                                        hold_requests_while_staging, monkeypatch):
    engine, reconfigurer = live_stack.engine, live_stack.reconfigurer
    hold_requests_while_staging(engine)
    streams = _Streams(engine, oracle, "c")
    monkeypatch.setattr(reconfigurer, "router", _RoundsKeepDecoding(reconfigurer.router, streams))
    await streams.start(NUM_REQUESTS)
    precopied = moved = 0
    for target, partition in CHAIN:
        await streams.keep_decoding()
        operation = await reconfigurer.reconfigure(target, layer_partition=partition)
        _check_precopied(operation)
        assert str(engine.topology) == target and live_stack.state.layer_partition == (partition or None)
        assert streams.in_flight() > 0, "a switch with nothing in flight proves nothing"
        precopied, moved = precopied + operation.kv_bytes_precopied, moved + operation.kv_bytes_moved
    assert moved < precopied  # the rounds copied most of the KV; the freeze only the delta
    await streams.check()


def _cached_slots(engine) -> dict[tuple[int, int], str]:
    """(block id, offset) -> the request whose cached token's KV is there."""
    size = engine.scheduler.block_manager.block_size
    return {(seq.block_ids[pos // size], pos % size): seq.request_id for seq in engine.scheduler.running
            for pos in range(seq.num_computed_tokens)}


async def test_a_pre_copied_switch_there_and_back_keeps_every_cached_kv_byte(live_stack, oracle, switch_checkpoint,
                                                                              hold_requests_while_staging):
    prompts, expected = oracle
    prompts, expected = prompts[:6], expected[:6]
    engine, stubs = live_stack.engine, live_stack.state.worker_stubs
    hold_requests_while_staging(engine)
    head_dim = ModelSpec.from_dir(switch_checkpoint).head_dim
    tasks = _start(engine, prompts, "b")
    await until(lambda: _all_decoding(engine, len(prompts)), what="every request decoding")
    await engine.freeze()  # hold the requests still to snapshot their KV
    used, cached = engine.used_block_ids(), _cached_slots(engine)
    before = await snapshot_kv(stubs, used, head_dim)
    assert len(before) == 3 * 2  # every (layer, KV head) of the model
    engine.resume()
    for target in ("tp4pp1", "tp2pp2"):  # the default strategy: staged, with a pre-copy
        _check_precopied(await live_stack.reconfigurer.reconfigure(target))
    await engine.freeze()
    after, now = await snapshot_kv(stubs, used, head_dim), _cached_slots(engine)
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
    assert same_kv({k: v[:, mask] for k, v in after.items()}, {k: v[:, mask] for k, v in before.items()})


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
                                                                        switch_checkpoint,
                                                                        hold_requests_while_staging):
    head_dim = ModelSpec.from_dir(switch_checkpoint).head_dim
    async with open_live_stack(precopy_faulty_cluster) as stack:
        engine, stubs, reconfigurer = stack.engine, stack.state.worker_stubs, stack.reconfigurer
        hold_requests_while_staging(engine)
        streams = _Streams(engine, oracle, "f")
        await streams.start(NUM_REQUESTS)

        # 1. A pre-copy round fails: nothing was frozen, the staged pools are dropped, the old layout serves.
        operation = await reconfigurer.reconfigure("tp4pp1")
        assert operation.state is OperationState.ROLLED_BACK, operation
        assert "injected fault at precopy" in operation.error, operation.error
        assert set(operation.phase_seconds) == {"STAGING", "PRECOPY"} and operation.downtime_seconds == 0
        assert not engine.stats().is_frozen and str(engine.topology) == str(stack.state.topology) == "tp2pp2"

        # 2. The delta copy at the cutover fails: the old pools were only read, the old layout resumes whole.
        await engine.freeze()
        used, cached = engine.used_block_ids(), _cached_slots(engine)
        before = await snapshot_kv(stubs, used, head_dim)
        engine.resume()
        operation = await reconfigurer.reconfigure("tp4pp1")
        assert operation.state is OperationState.ROLLED_BACK, operation
        assert "rolled back (layers [] " in operation.error, operation.error
        assert operation.precopy.endswith(" rounds") and "ROLLING_BACK" in operation.phase_seconds, operation
        assert str(engine.topology) == str(stack.state.topology) == "tp2pp2" and not engine.stats().is_frozen
        await engine.freeze()
        after, now = await snapshot_kv(stubs, used, head_dim), _cached_slots(engine)
        engine.resume()
        _assert_kept_slots_equal(used, cached, now, before, after)

        # 3. The faults fired once: the same switch now pre-copies and succeeds.
        await streams.keep_decoding()
        _check_precopied(await reconfigurer.reconfigure("tp4pp1"))
        # 4. The pre-copy off: staged still, all the KV moves in the freeze.
        await streams.keep_decoding()
        reconfigurer.kv_precopy = False
        operation = await reconfigurer.reconfigure("tp2pp2")
        assert operation.state is OperationState.SUCCEEDED, operation.error
        assert operation.staging == "staged" and operation.precopy == "" and operation.kv_bytes_precopied == 0
        assert "STAGING" in operation.phase_seconds and "PRECOPY" not in operation.phase_seconds
        reconfigurer.kv_precopy = True
        # 5. In place: no staging, so no pre-copy either.
        await streams.keep_decoding()
        operation = await reconfigurer.reconfigure("tp4pp1", strategy="in-place")
        assert operation.state is OperationState.SUCCEEDED, operation.error
        assert operation.staging == "in-place" and operation.precopy == "" and operation.kv_bytes_precopied == 0
        assert not {"STAGING", "PRECOPY"} & set(operation.phase_seconds)
        assert streams.in_flight() > 0, "the switches should have had requests in flight"
        await streams.check()
