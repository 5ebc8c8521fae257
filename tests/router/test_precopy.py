"""KV pre-copy bookkeeping (KVPrecopy, Engine.precopy_blocks / kv_to_move): which blocks the rounds hand out while
serving, and which ones the freeze must still copy (the delta).

The examples build Sequences by hand. The random workloads run the real scheduler (through an Engine over a fake
driver) with the paged fake workers of fakes.py, and keep a second store for the target's pool: each round's
blocks are copied into it a few ticks later (as the workers do, while the steps go on), the cutover copies the delta
and then *serves from the target's store*. A stale block (a copy of a block that changed or changed hands since,
left out of the delta) would change the "sampled" tokens, and is checked position by position at each cutover.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from services.router.block_manager import num_blocks_for
from services.router.precopy import KVPrecopy, full_blocks
from tests.router.fakes import (
    PagedWorkers,
    check_every_request_done,
    engine_over_fake_workers,
    prompt_of,
    running,
    seq_of,
)


# ---- examples ----------------------------------------------------------------------------------------------

def test_full_blocks_are_the_ones_finished_steps_wrote_every_slot_of():
    for computed, full in ((0, []), (3, []), (4, [7]), (7, [7]), (8, [7, 3]), (11, [7, 3]), (12, [7, 3, 9])):
        assert full_blocks(running("a", [7, 3, 9], computed), 4) == full, computed
    assert full_blocks(running("b", [5, 6], 2), 1) == [5, 6]  # block_size 1: every cached token fills a block


def test_each_full_block_is_handed_out_once_per_operation():
    precopy = KVPrecopy("op", num_kv_blocks=16)
    a, b = running("a", [5, 1, 8], 9), running("b", [0, 2], 8)
    assert precopy.next_round([a, b], 4) == [0, 1, 2, 5]  # a's last block holds 1 of 4 tokens: not full
    assert precopy.next_round([a, b], 4) == []  # nothing written since
    a.num_computed_tokens = 12  # a's steps filled its third block
    assert precopy.next_round([b, a], 4) == [8]
    assert (precopy.num_rounds, precopy.num_copied) == (3, 5)
    assert precopy.delta([a, b], [0, 1, 2, 5, 8]) == []


def test_ids_at_or_above_the_target_capacity_are_never_handed_out_and_stay_in_the_delta():
    precopy = KVPrecopy("op", num_kv_blocks=4)
    a = running("a", [6, 2, 3, 9], 16)
    assert precopy.next_round([a], 4) == [2, 3]
    assert precopy.delta([a], [2, 3, 6, 9]) == [6, 9]


def test_the_partly_filled_blocks_are_warmed_every_round_and_never_recorded():
    precopy = KVPrecopy("op", num_kv_blocks=8)
    # b holds 5 tokens in 3 blocks (the last one reserved for its step in flight, past the capacity)
    a, b = running("a", [5, 1, 3], 9), running("b", [0, 6, 9], 5)
    assert precopy.warm([a, b], 4) == [3, 6]
    assert precopy.next_round([a, b], 4) == [0, 1, 5]
    assert precopy.warm([a, b], 4) == [3, 6] and precopy.delta([a, b], [0, 1, 3, 5, 6, 9]) == [3, 6, 9]


def test_a_preempted_request_loses_its_copies_until_it_fills_its_blocks_again():
    precopy = KVPrecopy("op", num_kv_blocks=8)
    a = running("a", [1, 2], 8)
    assert precopy.next_round([a], 4) == [1, 2]
    # Preempted (its KV dropped), then re-prefilled into the same ids in another order; only one block full yet.
    a.num_preemptions, a.block_ids, a.num_computed_tokens = 1, [2, 1], 5
    assert precopy.delta([a], [1, 2]) == [1, 2]  # the copies are of its previous life
    assert precopy.next_round([a], 4) == [2]  # handed out again, once full again
    assert precopy.delta([a], [1, 2]) == [1]
    a.num_computed_tokens = 8
    assert precopy.next_round([a], 4) == [1] and precopy.delta([a], [1, 2]) == []


def test_a_preemption_between_rounds_that_leaves_nothing_full_keeps_the_old_copies_invalid():
    precopy = KVPrecopy("op", num_kv_blocks=8)
    a = running("a", [3, 4], 8)
    assert precopy.next_round([a], 4) == [3, 4]
    a.num_preemptions, a.block_ids, a.num_computed_tokens = 1, [3], 2  # re-prefilling: nothing full yet
    assert precopy.next_round([a], 4) == []
    assert precopy.delta([a], [3]) == [3]


def test_a_block_freed_and_reused_by_another_request_is_in_the_delta_unless_copied_for_it():
    precopy = KVPrecopy("op", num_kv_blocks=8)
    a = running("a", [3], 4)
    assert precopy.next_round([a], 4) == [3]
    b = running("b", [3], 2)  # a finished; b got block 3 and wrote half of it
    assert precopy.delta([b], [3]) == [3]
    assert precopy.next_round([b], 4) == []  # not full: not handed out
    b.num_computed_tokens = 4
    assert precopy.next_round([b], 4) == [3]  # full now: handed out again, for b
    assert precopy.delta([b], [3]) == [] and precopy.num_copied == 2


def test_a_finished_request_holds_nothing_valid():
    precopy = KVPrecopy("op", num_kv_blocks=8)
    a, b = running("a", [0, 1], 8), running("b", [2], 4)
    precopy.next_round([a, b], 4)
    # a finished and its ids are in use again (by someone the delta is not told about): nothing of a counts.
    assert precopy.delta([b], [0, 1, 2]) == [0, 1]


def test_the_delta_is_the_used_ids_minus_the_valid_copies_ascending():
    precopy = KVPrecopy("op", num_kv_blocks=16)
    a, b = running("a", [4, 1, 11], 9), running("b", [0, 7, 9], 6)
    assert precopy.next_round([a, b], 4) == [0, 1, 4]
    assert precopy.delta([a, b], [11, 9, 7, 4, 1, 0, 9]) == [7, 9, 11]
    assert KVPrecopy("other", 16).delta([a, b], [9, 0, 4]) == [0, 4, 9]  # no round: every used block


def test_a_request_that_wrote_nothing_since_the_last_round_contributes_only_its_blocks_not_full_then():
    precopy = KVPrecopy("op", num_kv_blocks=32)
    seqs = [running("a", [9, 2, 5], 10), running("b", [1, 4], 8), running("c", [6], 3), running("d", [30, 31], 8)]
    assert precopy.next_round(seqs, 4) == [1, 2, 4, 9, 30, 31]
    assert precopy.delta(seqs, [9, 2, 5, 1, 4, 6, 30, 31]) == [5, 6]  # a's and c's last blocks
    precopy = KVPrecopy("op", num_kv_blocks=31)  # a smaller target: block 31 is never pre-copied
    assert precopy.next_round(seqs, 4) == [1, 2, 4, 9, 30]
    assert precopy.delta(seqs, [9, 2, 5, 1, 4, 6, 30, 31]) == [5, 6, 31]


def test_num_copied_counts_every_block_handed_out_in_the_operation():
    precopy = KVPrecopy("op", num_kv_blocks=8)
    a = running("a", [1, 2], 8)
    precopy.next_round([a], 4)
    a.num_preemptions, a.num_computed_tokens = 1, 4
    assert precopy.next_round([a], 4) == [1]
    assert precopy.num_copied == 3  # 2 in the first round, 1 in the second (a preemption keeps the count)


# ---- Engine.precopy_blocks / kv_to_move ---------------------------------------------------------------------

def map_ids(maps) -> list[int]:
    """The ids of a round's block maps between layouts of one pool (where blocks keep them)."""
    assert set(maps) <= {(0, 0)} and all(src == dst for src, dst in maps.values()), maps
    return maps[0, 0][0] if maps else []


def test_engine_rounds_per_operation_and_the_delta_ends_the_record():
    engine = engine_over_fake_workers(16, 4)
    scheduler = engine.scheduler
    workers = PagedWorkers(scheduler.block_manager)
    scheduler.add(seq_of("a", prompt_of(0, 9), 8))
    scheduler.add(seq_of("b", prompt_of(1, 4), 8))
    batch = scheduler.schedule()  # both prompts: a holds 3 blocks (2 full after the step), b 1 (full)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        engine.precopy_blocks("op-1", 0)
    a, b = scheduler.get("a"), scheduler.get("b")
    # The step is in flight: nothing full yet; every block is partly written (or reserved): warm
    maps, warm, copied, used = engine.precopy_blocks("op-1", 16)
    assert (map_ids(maps), map_ids(warm), copied, used) == ([], sorted(a.block_ids + b.block_ids), 0, 4)
    scheduler.on_batch_done(batch, workers.run(batch))
    maps, warm, copied, used = engine.precopy_blocks("op-1", 16)
    ids = map_ids(maps)
    assert ids == sorted(a.block_ids[:2] + b.block_ids[:1]) and (copied, used) == (3, 4)
    assert map_ids(warm) == [a.block_ids[2]]  # a's last block: 1 of its 4 slots written
    maps, again, copied, used = engine.precopy_blocks("op-1", 16)
    assert (maps, again, copied, used) == ({}, warm, 3, 4)
    maps, _, copied, _ = engine.precopy_blocks("op-2", 16)  # another operation starts afresh
    assert (map_ids(maps), copied) == (ids, 3)
    with pytest.raises(ValueError, match="op-1"):
        engine.kv_to_move("op-1")  # op-2 replaced its record
    assert engine.switch_ops.precopy is None  # ... and the failed call ended op-2's as well: the switch gives up on it
    engine.precopy_blocks("op-3", 16)
    assert engine.kv_to_move("op-3") == [a.block_ids[2]]  # a's third block holds 1 of its 4 slots: not full
    assert engine.switch_ops.precopy is None
    with pytest.raises(ValueError, match="op-3"):
        engine.kv_to_move("op-3")  # the record ended with the delta
    assert engine.kv_to_move("") == sorted(a.block_ids + b.block_ids)  # without a pre-copy: every used block


# ---- random workloads with switches ----------------------------------------------------------------------------

@dataclass
class PrecopyRun:
    """What a simulated workload went through (for the tests to check their scenario happened)."""

    num_rounds: int = 0
    num_handed_out: int = 0
    num_cutovers: int = 0
    num_delta: int = 0
    num_stale: int = 0  # handed out for a request, then in the delta: the request was preempted or finished since
    num_reused: int = 0  # stale ids whose holder at the cutover is another request
    num_preemptions: int = 0


@st.composite
def precopy_workloads(draw):
    block_size = draw(st.integers(1, 4))
    requests = draw(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 24), st.integers(1, 12)),
                             min_size=2, max_size=10))
    largest = max(num_blocks_for(p + m - 1, block_size) for _, p, m in requests)
    config = dict(max_model_len=64, max_num_seqs=draw(st.integers(1, 8)),
                  max_num_batched_tokens=draw(st.integers(1, 32)), num_inflight_batches=draw(st.integers(1, 3)))
    num_blocks = draw(st.integers(largest, largest * 3 // 2 + 1))  # little room: preemptions and reused ids
    ticks = st.integers(0, 40)
    switches = sorted(draw(st.dictionaries(ticks, st.integers(largest, largest * 3), min_size=1, max_size=3)).items())
    rounds = draw(st.sets(ticks, min_size=2, max_size=30))
    copy_delay = draw(st.integers(0, 3))
    aborts = draw(st.lists(st.tuples(ticks, st.integers(0, len(requests) - 1)), max_size=2))
    return block_size, num_blocks, config, requests, switches, rounds, copy_delay, aborts


@settings(max_examples=400, deadline=None)
@given(precopy_workloads())
def test_rounds_and_delta_rebuild_every_cached_position_in_the_target_pool(workload):
    run = simulate_precopy(*workload)
    event(f"cutovers with stale copies: {run.num_stale > 0}")
    event(f"preempted: {run.num_preemptions > 0}")


def test_a_contended_workload_with_many_switches_exercises_stale_and_reused_copies():
    requests = [(i // 3, 5 + (7 * i) % 19, 4 + (5 * i) % 9) for i in range(30)]
    config = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=12, num_inflight_batches=2)
    assert max(num_blocks_for(p + m - 1, 4) for _, p, m in requests) == 9
    switches = [(t, 9 + t % 3) for t in range(20, 200, 20)]  # 9 to 11 blocks: the cache shrinks and grows
    rounds = set(range(0, 200, 3))
    run = simulate_precopy(4, 10, config, requests, switches, rounds, copy_delay=2, aborts=[(15, 3), (40, 11)])
    assert run.num_cutovers == len(switches) and run.num_rounds > 30 and run.num_handed_out > 50
    assert run.num_stale > 0 and run.num_reused > 0 and run.num_preemptions > 0
    assert run.num_delta < run.num_handed_out  # the rounds did most of the copying


def simulate_precopy(block_size, num_blocks, config, requests, switches, rounds, copy_delay, aborts) -> PrecopyRun:
    """Replay a workload (arrival tick, prompt length, max_tokens) with aborts (tick, index), pre-copy rounds at
    `rounds` ticks (the workers copy a round's blocks `copy_delay` ticks later, steps going on meanwhile; a round
    waits for the previous copy, as the controller awaits PreCopyKV) and cutovers (tick, target capacity): freeze,
    drain, rebind, delta, then serve from the target's store. Rounds after the last cutover belong to an operation
    that never cuts over (abandoned). Workers execute a step when it is scheduled; the router learns of it when the
    micro-batch returns (in order), so a round sees steps in flight whose writes it must not count."""
    engine = engine_over_fake_workers(num_blocks, block_size, **config)
    scheduler = engine.scheduler
    manager = scheduler.block_manager
    workers = PagedWorkers(manager)  # workers.cache: the live pool
    seqs = [seq_of(f"r{i}", prompt_of(i, p), m) for i, (_, p, m) in enumerate(requests)]
    arrivals = deque(sorted(range(len(requests)), key=lambda i: (requests[i][0], i)))
    switches, run, added, aborted = deque(switches), PrecopyRun(), set(), set()
    inflight: deque[tuple] = deque()  # (batch, sampled): executed, not returned yet
    operations = itertools.count()
    op = target = handed = last_round = pending = None

    def start_operation():
        nonlocal op, target, handed, last_round
        op = f"op{next(operations)}"
        target = {}  # the target's pool (StagedKV): allocated at the first round
        handed = {}  # (request_id, preemptions) -> ids handed out for it in this operation
        last_round = {}

    def copy(ids):
        for block in ids:
            target[block] = list(workers.cache[block])

    def precopy_round(capacity: int):
        nonlocal pending
        if pending is not None:  # the previous round's PreCopyKV has to answer first
            copy(pending[1])
            pending = None
        if op is None:
            start_operation()
        before = {s.request_id: (s.num_preemptions, set(full_blocks(s, block_size))) for s in scheduler.running}
        maps, warm_maps, copied, used = engine.precopy_blocks(op, capacity)
        ids, warm = map_ids(maps), map_ids(warm_maps)
        run.num_rounds += 1
        run.num_handed_out += len(ids)
        assert ids == sorted(set(ids)) and all(0 <= b < capacity for b in ids)
        assert used == manager.num_used
        owner = {b: s for s in scheduler.running for b in s.block_ids}
        for block in ids:
            seq = owner[block]  # a block of a running request ...
            assert block in before[seq.request_id][1]  # ... and full
            ids_of = handed.setdefault((seq.request_id, seq.num_preemptions), set())
            assert block not in ids_of, f"{block} handed out twice for {seq.request_id}"
            ids_of.add(block)
        assert copied == sum(len(v) for v in handed.values())  # every block handed out in the operation
        for seq in scheduler.running:  # every full block below the capacity is handed out now
            full = {b for b in full_blocks(seq, block_size) if b < capacity}
            assert full <= handed.get((seq.request_id, seq.num_preemptions), set()), seq.request_id
            last_round[seq.request_id] = (seq.num_preemptions, seq.num_computed_tokens, list(seq.block_ids))
        # The warm blocks: every running request's blocks past its full ones, below the capacity. The workers copy
        # them too, as they are then: the cutover must find every one of them stale (they are in the delta).
        assert warm == sorted(b for s in scheduler.running for b in s.block_ids[s.num_computed_tokens // block_size:]
                              if b < capacity)
        assert not set(warm) & set(ids)
        pending = (tick + copy_delay, ids + warm)

    def cutover(capacity: int):
        nonlocal op, pending
        scheduler.freeze()  # Freeze: the steps in flight return first
        while inflight:
            batch, sampled = inflight.popleft()
            scheduler.on_batch_done(batch, sampled)
        if pending is not None:
            copy(pending[1])
            pending = None
        # Rebind at the freeze: the target's capacity (owners of ids past it preempted).
        scheduler.kv_layout.rebind(capacity)
        used = manager.used_block_ids()
        holders = list(scheduler.running)
        assert sorted(b for s in holders for b in s.block_ids) == used
        if op is None:  # no round ran: everything moves in the freeze
            assert engine.kv_to_move("") == used
            start_operation()
            delta = used
        else:
            delta = engine.kv_to_move(op)
            valid = {b for s in holders
                     for b in handed.get((s.request_id, s.num_preemptions), set()) & set(s.block_ids)}
            assert delta == sorted(set(used) - valid)
            for seq in holders:
                mine = [b for b in delta if b in seq.block_ids]
                state = last_round.get(seq.request_id)
                if state is not None and state == (seq.num_preemptions, seq.num_computed_tokens, seq.block_ids):
                    # wrote nothing since the last round: only what was not full (or past the capacity) then
                    full = set(full_blocks(seq, block_size))
                    assert mine == sorted(b for b in seq.block_ids if b not in full or b >= capacity)
            handed_for: dict[int, set[str]] = {}  # block -> the requests it was handed out for
            for (request_id, _), ids_of in handed.items():
                for block in ids_of:
                    handed_for.setdefault(block, set()).add(request_id)
            stale = [b for b in delta if b in handed_for]
            run.num_stale += len(stale)
            run.num_reused += sum(1 for b in stale if manager.owner(b) not in handed_for[b])
        copy(delta)
        run.num_delta += len(delta)
        run.num_cutovers += 1
        for seq in holders:  # every position a finished step cached is in the target's pool
            for position in range(seq.num_computed_tokens):
                block, slot = seq.block_ids[position // block_size], position % block_size
                assert target[block][slot] == workers.cache[block][slot] == seq.all_token_ids[position], (
                    f"{seq.request_id} position {position} (block {block}) differs in the target pool")
        workers.cache = target  # the target layout serves from here on
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
            cutover(switches.popleft()[1])
        if tick in rounds:
            precopy_round(switches[0][1] if switches else manager.num_total)
        if pending is not None and pending[0] <= tick:
            copy(pending[1])
            pending = None
        while len(inflight) < config["num_inflight_batches"]:
            batch = scheduler.schedule()
            if batch is None:
                break
            inflight.append((batch, workers.run(batch)))  # the workers write the step's KV now
        if inflight:
            batch, sampled = inflight.popleft()
            scheduler.on_batch_done(batch, sampled)
    run.num_preemptions = scheduler.num_preemptions
    assert manager.num_used == 0
    check_every_request_done(scheduler, seqs, aborted, frozenset())
    return run


# ---- random block tables, no scheduler ------------------------------------------------------------------------

@st.composite
def block_tables(draw):
    """Running sequences with disjoint block tables, each holding blocks for its cached tokens (+1 step's worth)."""
    block_size = draw(st.integers(1, 4))
    num_blocks = draw(st.integers(1, 24))
    free = draw(st.permutations(range(num_blocks)))
    seqs = []
    for i in range(draw(st.integers(0, 6))):
        computed = draw(st.integers(0, 12))
        needed = num_blocks_for(computed + draw(st.integers(0, block_size)), block_size)
        if needed > len(free):
            break
        ids, free = free[:needed], free[needed:]
        seqs.append(running(f"s{i}", ids, computed, draw(st.integers(0, 2))))
    return block_size, num_blocks, seqs, draw(st.integers(1, num_blocks + 2))


@settings(max_examples=200, deadline=None)
@given(block_tables(), st.data())
def test_a_round_hands_out_exactly_the_full_blocks_below_the_capacity(tables, data):
    block_size, num_blocks, seqs, capacity = tables
    precopy = KVPrecopy("op", capacity)
    full = {b for s in seqs for b in full_blocks(s, block_size) if b < capacity}
    assert precopy.next_round(seqs, block_size) == sorted(full)
    used = sorted(b for s in seqs for b in s.block_ids)
    assert precopy.delta(seqs, used) == sorted(set(used) - full)
    # Some requests are preempted (their copies no longer count) and some advance (more full blocks).
    changed = data.draw(st.sets(st.sampled_from([s.request_id for s in seqs]))) if seqs else set()
    for seq in seqs:
        if seq.request_id in changed:
            seq.num_preemptions += 1
    assert precopy.delta(seqs, used) == sorted(
        set(used) - {b for s in seqs if s.request_id not in changed for b in full_blocks(s, block_size)
                     if b < capacity})
    again = precopy.next_round(seqs, block_size)
    assert again == sorted(b for s in seqs if s.request_id in changed for b in full_blocks(s, block_size)
                           if b < capacity)
    assert precopy.delta(seqs, used) == sorted(set(used) - full)
    assert all(b < capacity for b in again) and precopy.num_rounds == 2
