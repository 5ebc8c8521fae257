"""KV pre-copy of switches that change KV pools (to, from or between expert-parallel layouts): PoolPrecopy reserves
every request's pool and ids in the target at the first round that sees it, the rounds copy full blocks to those
ids, and the freeze's repartition keeps them, so its block maps hold only what the rounds did not copy.

The random workloads run the real scheduler over data-parallel pools (through an Engine over a fake driver) with
paged fake workers whose store is keyed by (pool, block id): each round's maps are copied into a second store for
the target a few ticks later (as the workers do, while the steps go on), the cutover copies the delta maps and then
serves from the target's store in its pools. A stale copy left out of the delta would change the "sampled"
tokens, and is checked position by position at each cutover.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from services.router.block_manager import num_blocks_for
from services.router.dp_blocks import DataParallelBlocks, repartition
from services.router.precopy import PoolPrecopy
from services.worker.kv_migration import check_block_maps
from tests.router.fakes import (
    PagedWorkers,
    check_every_request_done,
    engine_over_fake_workers,
    prompt_of,
    running,
    seq_of,
)


def live_pools(num_ranks: int, num_blocks: int, block_size: int, tables: dict[str, tuple[int, list[int]]],
               ) -> DataParallelBlocks:
    """Live pools where each request holds exactly the ids of `tables` (request_id -> (rank, ids))."""
    blocks = DataParallelBlocks(num_ranks, num_blocks, block_size)
    for request_id, (rank, ids) in tables.items():
        pool = blocks._pools[rank]
        for block in ids:
            pool._free.remove(block)
            pool._owner[block] = request_id
        blocks._rank[request_id] = rank
    for pool in blocks._pools:
        pool._free.sort()
    return blocks


# ---- examples ----------------------------------------------------------------------------------------------

def test_tp_to_ep_reserves_longest_first_onto_the_emptiest_pool_and_copies_full_blocks_to_the_reserved_ids():
    a, b, c = running("a", [5, 1, 8], 9), running("b", [0, 2], 8), running("c", [3], 2)
    live = live_pools(1, 16, 4, {"a": (0, [5, 1, 8]), "b": (0, [0, 2]), "c": (0, [3])})
    precopy = PoolPrecopy("op", num_pools=2, num_kv_blocks=8, block_size=4, same_pools=False)
    copy, warm = precopy.next_round([c, b, a], live)
    # a (3 blocks) -> pool 0 ids 0-2; b (2) -> pool 1 ids 0-1; c (1) -> pool 1 id 2
    assert copy == {(0, 0): ([5, 1], [0, 1]), (0, 1): ([0, 2], [0, 1])}
    assert warm == {(0, 0): ([8], [2]), (0, 1): ([3], [2])}
    assert (precopy.num_rounds, precopy.num_copied) == (1, 4)
    assert precopy.next_round([a, b, c], live) == ({}, warm)  # nothing written since
    a.num_computed_tokens = 12  # a's third block filled
    assert precopy.next_round([a, b, c], live)[0] == {(0, 0): ([8], [2])}


def test_the_freeze_keeps_the_reservations_and_maps_only_what_the_rounds_did_not_copy():
    a, b = running("a", [5, 1, 8], 9), running("b", [0, 2], 8)
    live = live_pools(1, 16, 4, {"a": (0, [5, 1, 8]), "b": (0, [0, 2])})
    precopy = PoolPrecopy("op", num_pools=2, num_kv_blocks=8, block_size=4, same_pools=False)
    precopy.next_round([a, b], live)
    # Since the round: a filled its third block and got a fourth; b was preempted and re-prefilled into [4].
    a.block_ids.append(9)
    a.num_computed_tokens = 13
    live._pools[0]._owner[9] = "a"
    b.num_preemptions, b.block_ids, b.num_computed_tokens = 1, [4], 3
    plan = repartition(live, {"a": a.block_ids, "b": b.block_ids}, 2, 8, precopy.reservations([a, b], live))
    # a keeps pool 0 and its ids 0-2, takes 3 for its new block; only the blocks not copied move in the freeze
    assert plan.block_tables["a"] == [0, 1, 2, 3]
    # b's copies are of its previous life: its reservation was given back, it is placed anew, whole
    assert plan.block_tables["b"] == [0]
    assert plan.block_maps == {(0, 0): ([8, 9], [2, 3]), (0, 1): ([4], [0])}
    assert plan.blocks.per_rank_used() == (4, 1) and not plan.unplaced


def test_a_reservation_is_given_back_when_its_request_ends_or_moves_pool():
    a, b = running("a", [0, 1], 8), running("b", [2], 4)
    live = live_pools(2, 8, 4, {"a": (0, [0, 1]), "b": (1, [2])})
    precopy = PoolPrecopy("op", num_pools=1, num_kv_blocks=8, block_size=4, same_pools=False)
    precopy.next_round([a, b], live)
    assert precopy.target.per_rank_used() == (3,)
    precopy.next_round([b], live)  # a ended
    assert precopy.target.per_rank_used() == (1,) and set(precopy.reserved) == {"b"}
    live._rank["b"] = 0  # b's blocks are another pool's now: what was copied is not its KV
    copy, _ = precopy.next_round([b], live)
    assert copy == {(0, 0): ([2], [0])} and precopy.reserved["b"].src_pool == 0


def test_same_pool_counts_keep_every_request_in_its_pool():
    a, b = running("a", [0, 1], 8), running("b", [0], 4)
    live = live_pools(2, 8, 4, {"a": (1, [0, 1]), "b": (0, [0])})
    precopy = PoolPrecopy("op", num_pools=2, num_kv_blocks=4, block_size=4, same_pools=True)
    copy, _ = precopy.next_round([a, b], live)
    assert copy == {(1, 1): ([0, 1], [0, 1]), (0, 0): ([0], [0])}


def test_a_target_pool_too_full_reserves_what_it_can_and_the_freeze_moves_the_request_whole():
    a, b = running("a", [0, 1, 2], 12), running("b", [3, 4], 8)
    live = live_pools(1, 8, 4, {"a": (0, [0, 1, 2]), "b": (0, [3, 4])})
    precopy = PoolPrecopy("op", num_pools=1, num_kv_blocks=4, block_size=4, same_pools=False)
    copy, _ = precopy.next_round([a, b], live)
    assert copy == {(0, 0): ([0, 1, 2, 3], [0, 1, 2, 3])}  # b got one of its two ids
    plan = repartition(live, {"a": a.block_ids, "b": b.block_ids}, 1, 4, precopy.reservations([a, b], live))
    assert plan.block_tables == {"a": [0, 1, 2]} and plan.unplaced == ("b",)  # b no longer fits: preempted
    assert plan.block_maps == {}


def test_the_engine_pre_copies_between_pool_counts_and_its_rebind_keeps_the_reservations():
    engine = engine_over_fake_workers(16, 4, dp_size=1)
    scheduler = engine.scheduler
    workers = PoolWorkers(4)
    for i, length in enumerate((9, 5, 13)):
        scheduler.add(seq_of(f"r{i}", prompt_of(i, length), 8))
    batch = scheduler.schedule()
    scheduler.on_batch_done(batch, workers.run(batch))
    with pytest.raises(ValueError, match="num_kv_pools"):
        engine.precopy_blocks("op", 8, num_kv_pools=0)
    maps, warm, copied, used = engine.precopy_blocks("op", 8, num_kv_pools=2)
    assert isinstance(engine.switch_ops.precopy, PoolPrecopy) and copied == 2 + 1 + 3 and used == 3 + 2 + 4
    assert {dst for _, dst in maps} == {0, 1}  # the requests spread over both target pools
    with pytest.raises(ValueError, match="2 pools of 8 blocks, not 2 of 9"):
        engine.precopy_blocks("op", 9, num_kv_pools=2)
    scheduler.freeze()
    with pytest.raises(ValueError, match="other"):
        run_sync(engine.rebind(8, dp_size=2, precopy_operation_id="other"))
    assert engine.switch_ops.precopy is None  # a rebind that names another operation ends the record: nothing is kept
    engine.precopy_blocks("op2", 8, num_kv_pools=2)
    delta = run_sync(engine.rebind(8, dp_size=2, precopy_operation_id="op2"))
    assert sum(len(src) for src, _ in delta.values()) == used - copied  # the partly filled last blocks
    assert engine.switch_ops.precopy is None and scheduler.block_manager.num_ranks == 2


def test_plan_rebind_places_the_running_requests_as_the_rebind_would_and_changes_nothing():
    engine = engine_over_fake_workers(16, 4, dp_size=1)
    scheduler = engine.scheduler
    workers = PoolWorkers(4)
    for i, length in enumerate((9, 5, 13, 2)):
        scheduler.add(seq_of(f"r{i}", prompt_of(i, length), 8))
    batch = scheduler.schedule()
    scheduler.on_batch_done(batch, workers.run(batch))
    tables = {s.request_id: list(s.block_ids) for s in scheduler.running}
    # To two pools of 5 blocks: longest first onto the least loaded (r2: 4 blocks, r0: 3, r1: 2, r3: 1)
    assert engine.plan_rebind(5, dp_size=2) == [("r2", 0, 0, 4), ("r0", 0, 1, 3), ("r1", 0, 1, 2), ("r3", 0, 0, 1)]
    assert engine.plan_rebind(3, dp_size=2) == [("r2", 0, -1, 4), ("r0", 0, 0, 3), ("r1", 0, 1, 2),
                                                ("r3", 0, 1, 1)]  # r2 fits in no pool of 3: preempted
    # One pool on both sides: ids are kept, the holders of ids past the capacity are preempted
    expected = [(rid, 0, 0 if max(tables[rid]) < 6 else -1, len(tables[rid]))
                for rid in ("r2", "r0", "r1", "r3")]
    assert engine.plan_rebind(6) == expected and any(dst < 0 for _, _, dst, _ in expected)
    assert {s.request_id: s.block_ids for s in scheduler.running} == tables  # nothing changed
    assert scheduler.block_manager.num_ranks == 1
    scheduler.freeze()
    run_sync(engine.rebind(5, dp_size=2))
    assert {s.request_id: scheduler.block_manager.rank_of(s) for s in scheduler.running} == {
        "r2": 0, "r0": 1, "r1": 1, "r3": 0}  # the rebind placed them as planned
    with pytest.raises(ValueError, match="dp_size"):
        engine.plan_rebind(5, dp_size=0)


# ---- random workloads with switches between pool counts -----------------------------------------------------

def run_sync(coroutine):
    """Run a coroutine that awaits nothing (Engine.rebind without new workers)."""
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("the coroutine awaited something")


class PoolWorkers(PagedWorkers):
    """PagedWorkers keyed by (pool, block id), the pool being the step's DP rank, as the workers of an
    expert-parallel layout keep one KV pool per DP rank (the pools change with the switches: ids are not checked
    against one manager)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.cache: dict[tuple[int, int], list[int | None]] = {}

    def _key(self, step, block_id: int):
        return step.dp_rank, block_id

    def _check(self, step, end: int) -> None:
        assert len(step.block_table) == num_blocks_for(end, self.block_size)


@dataclass
class PoolRun:
    """What a simulated workload went through (for the tests to check their scenario happened)."""

    num_rounds: int = 0
    num_handed_out: int = 0
    num_cutovers: int = 0
    num_delta: int = 0
    num_used_at_cutovers: int = 0
    num_preemptions: int = 0


@st.composite
def pool_workloads(draw):
    block_size = draw(st.integers(1, 4))
    requests = draw(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 24), st.integers(1, 12)),
                             min_size=2, max_size=10))
    largest = max(num_blocks_for(p + m - 1, block_size) for _, p, m in requests)
    config = dict(max_model_len=64, max_num_seqs=draw(st.integers(1, 8)),
                  max_num_batched_tokens=draw(st.integers(1, 32)), num_inflight_batches=draw(st.integers(1, 3)))
    num_pools = draw(st.integers(1, 3))
    num_blocks = draw(st.integers(largest, largest * 3 // 2 + 1))
    ticks = st.integers(0, 40)
    targets = st.tuples(st.integers(1, 3), st.integers(largest, largest * 2))
    switches = sorted(draw(st.dictionaries(ticks, targets, min_size=1, max_size=3)).items())
    rounds = draw(st.sets(ticks, min_size=2, max_size=30))
    copy_delay = draw(st.integers(0, 3))
    aborts = draw(st.lists(st.tuples(ticks, st.integers(0, len(requests) - 1)), max_size=2))
    return block_size, num_pools, num_blocks, config, requests, switches, rounds, copy_delay, aborts


@settings(max_examples=300, deadline=None)
@given(pool_workloads())
def test_rounds_and_delta_maps_rebuild_every_cached_position_in_the_target_pools(workload):
    run = simulate_pool_precopy(*workload)
    event(f"the rounds copied part of the KV: {run.num_delta < run.num_used_at_cutovers}")
    event(f"preempted: {run.num_preemptions > 0}")


def test_a_contended_workload_switching_between_one_two_and_three_pools_copies_most_kv_in_the_rounds():
    requests = [(i // 3, 5 + (7 * i) % 19, 4 + (5 * i) % 9) for i in range(30)]
    config = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=12, num_inflight_batches=2)
    switches = [(t, (1 + t // 20 % 3, 9 + t % 3)) for t in range(20, 200, 20)]  # 1, 2, 3 pools, 9 to 11 blocks
    rounds = set(range(0, 200, 3))
    run = simulate_pool_precopy(4, 2, 10, config, requests, switches, rounds, copy_delay=2,
                                aborts=[(15, 3), (40, 11)])
    assert run.num_cutovers == len(switches) and run.num_rounds > 30 and run.num_handed_out > 50
    assert run.num_delta < run.num_used_at_cutovers / 2  # the rounds did most of the copying


def simulate_pool_precopy(block_size, num_pools, num_blocks, config, requests, switches, rounds, copy_delay,
                          aborts) -> PoolRun:
    """Replay a workload (arrival tick, prompt length, max_tokens) over `num_pools` live KV pools with aborts,
    pre-copy rounds at `rounds` ticks (copied `copy_delay` ticks later, a round waiting for the previous copy) and
    cutovers (tick, (target pools, target capacity)): freeze, drain, Rebind with the pre-copy (its delta maps),
    then serve from the target's store in its pools."""
    engine = engine_over_fake_workers(num_blocks, block_size, dp_size=num_pools, **config)
    scheduler = engine.scheduler
    workers = PoolWorkers(block_size)
    seqs = [seq_of(f"r{i}", prompt_of(i, p), m) for i, (_, p, m) in enumerate(requests)]
    arrivals = deque(sorted(range(len(requests)), key=lambda i: (requests[i][0], i)))
    switches, run, added, aborted = deque(switches), PoolRun(), set(), set()
    inflight: deque[tuple] = deque()
    operations = itertools.count()
    op = target = pending = None
    pools_now = num_pools

    def copy(maps):
        for (src_pool, dst_pool), (src_ids, dst_ids) in maps.items():
            for src, dst in zip(src_ids, dst_ids):
                target[dst_pool, dst] = list(workers.cache.get((src_pool, src), [None] * block_size))

    def precopy_round(pools: int, capacity: int):
        nonlocal op, target, pending
        if pending is not None:
            copy(pending[1])
            pending = None
        if op is None:
            op, target = f"op{next(operations)}", {}
        live = scheduler.block_manager
        maps, warm, _, used = engine.precopy_blocks(op, capacity, num_kv_pools=pools)
        run.num_rounds += 1
        run.num_handed_out += sum(len(src) for src, _ in maps.values())
        assert used == live.num_used
        check_block_maps({**maps})
        owner = {(live.rank_of(s), b): s for s in scheduler.running for b in s.block_ids}
        for (src_pool, dst_pool), (src_ids, dst_ids) in maps.items():
            assert all(0 <= d < capacity for d in dst_ids) and 0 <= dst_pool < pools
            for block in src_ids:
                seq = owner[src_pool, block]  # a full block of a running request
                assert seq.block_ids.index(block) < seq.num_computed_tokens // block_size
        merged = {pair: (maps.get(pair, ([], []))[0] + ids[0], maps.get(pair, ([], []))[1] + ids[1])
                  for pair, ids in warm.items()}
        check_block_maps({**maps, **merged})  # no target block is written twice in a round
        pending = (tick + copy_delay, {**maps, **merged})

    def cutover(pools: int, capacity: int):
        nonlocal op, target, pending, pools_now
        scheduler.freeze()
        while inflight:
            batch, sampled = inflight.popleft()
            scheduler.on_batch_done(batch, sampled)
        if pending is not None:
            copy(pending[1])
            pending = None
        run.num_used_at_cutovers += scheduler.block_manager.num_used
        if op is None:
            op, target = f"op{next(operations)}", {}
            maps = run_sync(engine.rebind(capacity, dp_size=pools))
        else:
            maps = run_sync(engine.rebind(capacity, dp_size=pools, precopy_operation_id=op))
        if pools == 1 and pools_now == 1:  # one pool on both sides: blocks keep their ids, no maps
            assert maps is None
            maps = {(0, 0): (blocks_now := scheduler.block_manager.used_block_ids(), blocks_now)}
        check_block_maps(maps)
        copy(maps)
        run.num_delta += sum(len(src) for src, _ in maps.values())
        run.num_cutovers += 1
        blocks = scheduler.block_manager
        assert blocks.num_ranks == pools
        for seq in scheduler.running:  # every position a finished step cached is in the target's pools
            pool = blocks.rank_of(seq)
            for position in range(seq.num_computed_tokens):
                block, slot = seq.block_ids[position // block_size], position % block_size
                assert target[pool, block][slot] == seq.all_token_ids[position], (
                    f"{seq.request_id} position {position} (pool {pool} block {block}) differs in the target")
        scheduler.kv_layout.commit_partition()
        workers.cache = target
        pools_now = pools
        op = None
        scheduler.unfreeze()

    for tick in itertools.count():
        assert tick < 5000, "the workload did not finish"
        if not arrivals and not scheduler.has_unfinished and not switches:
            break
        while arrivals and requests[arrivals[0]][0] <= tick:
            scheduler.add(seqs[arrivals[0]])
            added.add(arrivals.popleft())
        for _, index in [a for a in aborts if a[0] == tick]:
            if index in added and scheduler.abort(f"r{index}"):
                aborted.add(index)
        if switches and switches[0][0] <= tick:
            cutover(*switches.popleft()[1])
        if tick in rounds and switches and not (switches[0][1][0] == 1 and pools_now == 1):
            precopy_round(*switches[0][1])
        if pending is not None and pending[0] <= tick:
            copy(pending[1])
            pending = None
        while len(inflight) < config["num_inflight_batches"]:
            batch = scheduler.schedule()
            if batch is None:
                break
            inflight.append((batch, workers.run(batch)))
        if inflight:
            batch, sampled = inflight.popleft()
            scheduler.on_batch_done(batch, sampled)
    run.num_preemptions = scheduler.num_preemptions
    assert scheduler.block_manager.num_used == 0
    check_every_request_done(scheduler, seqs, aborted, frozenset())
    return run
