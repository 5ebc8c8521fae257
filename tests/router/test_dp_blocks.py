"""Data-parallel KV accounting (EP layouts): one block pool per DP rank, requests bound to a rank, rebalancing.

The fake workers below keep one paged KV store per DP rank, indexed by (dp_rank, block id) as the workers of an EP
layout do: a step that names the wrong rank, or a block shared by two live requests of one rank, changes the
"sampled" tokens (the fake model is a function of the cached prefix).
"""

from __future__ import annotations

import itertools
from collections import deque
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.contracts.step_rows import RowEncoder
from services.router.api.metrics import ApiMetrics
from services.router.block_manager import BlockManager, num_blocks_for
from services.router.config import SchedulerConfig
from services.router.contracts import EngineStats, RequestError, SwitchTotals
from services.router.dp_blocks import DataParallelBlocks, assign_requests
from services.router.engine import Engine
from services.router.scheduler import ScheduledBatch, Scheduler
from services.router.sequence import Sequence, SequenceStatus
from tests.router.fakes import expected_output, next_token, prompt_of, seq_of


class DataParallelWorkers:
    """Executes steps against one paged KV store of token ids per DP rank."""

    def __init__(self, blocks: DataParallelBlocks) -> None:
        self.blocks = blocks
        self.cache: dict[tuple[int, int], list[int | None]] = {}

    def run(self, batch: ScheduledBatch) -> dict[str, int]:
        size, sampled = self.blocks.block_size, {}
        for item in batch.items:
            step, seq = item.step, item.seq
            end = step.start_position + len(step.token_ids)
            assert len(step.block_table) == num_blocks_for(end, size)
            assert all(0 <= b < self.blocks.num_blocks_per_rank for b in step.block_table)
            assert 0 <= step.dp_rank < self.blocks.num_ranks
            for offset, token in enumerate(step.token_ids):
                position = step.start_position + offset
                block = self.cache.setdefault((step.dp_rank, step.block_table[position // size]), [None] * size)
                block[position % size] = token
            if step.sample:
                prefix = [self.cache[step.dp_rank, step.block_table[p // size]][p % size] for p in range(end)]
                assert prefix == seq.all_token_ids, f"{seq.request_id}: cached prefix differs from its tokens"
                sampled[step.request_id] = next_token(prefix)
        return sampled


def make_scheduler(num_ranks: int, num_blocks: int, block_size: int, max_model_len=256, **config) -> Scheduler:
    clock = itertools.count(1)
    return Scheduler(SchedulerConfig(max_model_len=max_model_len, **config),
                     DataParallelBlocks(num_ranks, num_blocks, block_size), clock=lambda: float(next(clock)))


def step_of(batch: ScheduledBatch, request_id: str):
    return next(item.step for item in batch.items if item.seq.request_id == request_id)


def done(scheduler: Scheduler, workers: DataParallelWorkers, batch: ScheduledBatch) -> None:
    scheduler.on_batch_done(batch, workers.run(batch))


# ---- binding requests to ranks -----------------------------------------------------------------------------

def test_requests_go_to_the_least_used_rank_and_keep_it():
    scheduler = make_scheduler(num_ranks=2, num_blocks=8, block_size=4)
    blocks, workers = scheduler.block_manager, DataParallelWorkers(scheduler.block_manager)
    for name, length in (("a", 12), ("b", 4), ("c", 8), ("d", 4)):
        scheduler.add(seq_of(name, prompt_of(ord(name), length), 6))
    batch = scheduler.schedule()
    # a: both empty, lowest rank; b: 0 < 3; c: 1 < 3; d: 3 == 3, lowest rank.
    assert {item.seq.request_id: item.step.dp_rank for item in batch.items} == {"a": 0, "b": 1, "c": 1, "d": 0}
    assert {item.seq.request_id: item.step.block_table for item in batch.items} == {
        "a": (0, 1, 2), "b": (0,), "c": (1, 2), "d": (3,)}  # ids repeat across ranks, never within one
    assert blocks.per_rank_used() == (4, 3) and (blocks.num_used, blocks.num_total) == (7, 16)
    done(scheduler, workers, batch)
    for _ in range(5):  # decodes stay on their rank while they hold blocks
        batch = scheduler.schedule()
        assert {item.seq.request_id: item.step.dp_rank for item in batch.items} == {"a": 0, "b": 1, "c": 1, "d": 0}
        done(scheduler, workers, batch)
    assert not scheduler.has_unfinished and blocks.per_rank_used() == (0, 0)


def test_a_request_longer_than_one_rank_is_refused():
    scheduler = make_scheduler(num_ranks=2, num_blocks=4, block_size=1, max_model_len=64)
    with pytest.raises(RequestError, match="needs 5 KV blocks, each data-parallel rank's cache has 4"):
        scheduler.add(seq_of("a", prompt_of(0, 5), 1))  # 8 blocks over both ranks, but a request lives on one
    scheduler.add(seq_of("b", prompt_of(0, 4), 1))  # exactly one rank


def test_new_prefills_keep_off_only_the_rank_that_is_short():
    # block_size 1: a sequence of n cached tokens holds n blocks.
    scheduler = make_scheduler(num_ranks=2, num_blocks=4, block_size=1)
    blocks, workers = scheduler.block_manager, DataParallelWorkers(scheduler.block_manager)
    scheduler.add(a := seq_of("a", prompt_of(1, 1), 3))
    scheduler.add(seq_of("b", prompt_of(2, 3), 1))
    scheduler.add(c := seq_of("c", prompt_of(3, 1), 3))
    batch = scheduler.schedule()  # a -> 0, b -> 1 (0 < 1), c -> 0 (1 < 3)
    assert [item.step.dp_rank for item in batch.items] == [0, 1, 0]
    done(scheduler, workers, batch)  # b is done: rank 1 is empty
    done(scheduler, workers, scheduler.schedule())  # a and c take rank 0's last blocks
    assert blocks.per_rank_used() == (4, 0)
    scheduler.add(seq_of("d", prompt_of(4, 1), 1))
    batch = scheduler.schedule()
    # a lacks a block: it preempts c (same rank); c re-prefills at once on rank 1, and so does the new d, although
    # rank 0 was short (new prefills stay off only the short rank).
    assert c.num_preemptions == 1 and scheduler.num_preemptions == 1
    assert [(item.seq.request_id, item.step.dp_rank, item.step.start_position) for item in batch.items] == [
        ("a", 0, 2), ("c", 1, 0), ("d", 1, 0)]
    done(scheduler, workers, batch)
    while scheduler.has_unfinished:
        done(scheduler, workers, scheduler.schedule())
    assert a.output_token_ids == expected_output(a.prompt_token_ids, 3)
    assert c.output_token_ids == expected_output(c.prompt_token_ids, 3)


def test_a_short_sequence_does_not_preempt_a_newer_one_of_another_rank():
    scheduler = make_scheduler(num_ranks=2, num_blocks=5, block_size=1)
    workers = DataParallelWorkers(scheduler.block_manager)
    for name in "abcd":
        scheduler.add(seq_of(name, prompt_of(ord(name), 2), 3))
    batch = scheduler.schedule()
    assert [item.step.dp_rank for item in batch.items] == [0, 1, 0, 1]
    done(scheduler, workers, batch)
    batch = scheduler.schedule()  # a and b take their rank's last block; c and d lack one
    # The only sequence newer than c is d, on rank 1: preempting it would free nothing c can use.
    assert [item.seq.request_id for item in batch.items] == ["a", "b"] and scheduler.num_preemptions == 0
    done(scheduler, workers, batch)
    while scheduler.has_unfinished:
        done(scheduler, workers, scheduler.schedule())


# ---- rebind, migration, stats ------------------------------------------------------------------------------

def test_rebind_resizes_every_rank_and_preempts_owners_past_the_new_size_on_any_rank():
    scheduler = make_scheduler(num_ranks=2, num_blocks=8, block_size=1)
    blocks, workers = scheduler.block_manager, DataParallelWorkers(scheduler.block_manager)
    for name, length in (("a", 2), ("b", 2), ("c", 2), ("d", 1)):
        scheduler.add(seq_of(name, prompt_of(ord(name), length), 2))
    done(scheduler, workers, scheduler.schedule())  # a [0, 1] and c [2, 3] on rank 0; b [0, 1] and d [2] on rank 1
    assert blocks.used_block_ids_per_rank() == ([0, 1, 2, 3], [0, 1, 2])
    scheduler.freeze()
    with pytest.raises(ValueError, match="need more than 2 blocks"):
        scheduler.kv_layout.rebind(2)  # a, b, c: 2 prompt tokens + 1 more cached one
    assert blocks.num_blocks_per_rank == 8 and scheduler.num_switch_preemptions == 0  # unchanged
    preempted = scheduler.kv_layout.rebind(3)  # c's block 3 on rank 0 is past it; nothing on rank 1 is
    assert [s.request_id for s in preempted] == ["c"] and scheduler.num_switch_preemptions == 1
    assert (blocks.num_blocks_per_rank, blocks.num_total, blocks.per_rank_used()) == (3, 6, (2, 3))
    assert scheduler.kv_layout.rebind(7) == [] and blocks.num_total == 14
    scheduler.unfreeze()
    while scheduler.has_unfinished:
        done(scheduler, workers, scheduler.schedule())
    assert blocks.per_rank_used() == (0, 0) and blocks.num_free == 14


def test_used_block_ids_refuses_several_pools_in_use():
    blocks = DataParallelBlocks(2, 4, 2)
    assert blocks.used_block_ids() == []  # nothing to move: a recovery that dropped the KV may rebind
    a, b = seq_of("a", [1, 2, 3], 1), seq_of("b", [4], 1)
    blocks.allocate(a)
    blocks.allocate(b)
    assert (blocks.rank_of(a), blocks.rank_of(b), a.block_ids, b.block_ids) == (0, 1, [0, 1], [0])
    assert blocks.owner(0, dp_rank=1) == "b" and blocks.owner(1, dp_rank=1) is None
    with pytest.raises(RuntimeError, match="data-parallel"):
        blocks.used_block_ids()
    assert blocks.used_block_ids_per_rank() == ([0, 1], [0])
    blocks.free(a)
    assert blocks.rank_of(a) is None and a.block_ids == []


def test_engine_stats_and_metrics_report_each_rank():
    info = SimpleNamespace(topology="ep2pp1", num_kv_blocks=8)
    driver = SimpleNamespace(infos=[info, info], num_kv_blocks=8, block_size=2, dp_size=2,
                             worker_times=lambda: (), rows=RowEncoder())
    engine = Engine(driver, tokenizer=None, model_name="m", max_model_len=64)
    scheduler = engine.scheduler
    scheduler.add(seq_of("a", prompt_of(0, 5), 2))
    scheduler.add(seq_of("b", prompt_of(1, 2), 2))
    scheduler.schedule()
    stats = engine.stats()
    assert stats.num_kv_blocks_used_per_dp_rank == (3, 1)
    assert (stats.num_kv_blocks_total, stats.num_kv_blocks_used) == (8, 3)  # per worker: the fullest rank

    class StatsOnly:
        def stats(self) -> EngineStats:
            return stats

        def switch_totals(self) -> SwitchTotals:
            return SwitchTotals()

    text = ApiMetrics(StatsOnly(), "m").render()[0].decode()
    assert 'reconfig:kv_blocks_used_per_dp_rank{dp_rank="0",model_name="m"} 3.0' in text
    assert 'reconfig:kv_blocks_used_per_dp_rank{dp_rank="1",model_name="m"} 1.0' in text
    assert "reconfig:kv_cache_usage_perc{model_name=\"m\"} 0.375" in text
    one_rank = Engine(SimpleNamespace(**{**vars(driver), "dp_size": 1}), None, "m", max_model_len=64)
    assert one_rank.stats().num_kv_blocks_used_per_dp_rank == ()  # as before: RouterStats carries nothing per rank


# ---- random workloads --------------------------------------------------------------------------------------

workloads = st.lists(st.tuples(st.integers(0, 12), st.integers(1, 14), st.integers(0, 10)), min_size=1, max_size=12)


@settings(max_examples=120, deadline=None)
@given(num_ranks=st.integers(1, 3), block_size=st.integers(1, 4), num_blocks=st.integers(6, 12),
       max_num_batched_tokens=st.integers(4, 24), num_inflight_batches=st.integers(1, 2), requests=workloads,
       aborts=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 11)), max_size=3))
def test_random_workloads_keep_every_rank_consistent(num_ranks, block_size, num_blocks, max_num_batched_tokens,
                                                     num_inflight_batches, requests, aborts):
    """Every request finishes with the expected tokens; at every step each rank's blocks are owned by one request
    each, a request keeps its rank while it holds blocks, steps name it, and a victim is younger than a running
    sequence of its own rank."""
    scheduler = make_scheduler(num_ranks, num_blocks, block_size, max_model_len=num_blocks * block_size,
                               max_num_batched_tokens=max_num_batched_tokens,
                               num_inflight_batches=num_inflight_batches)
    blocks, workers = scheduler.block_manager, DataParallelWorkers(scheduler.block_manager)
    seqs, arrivals, inflight = [], deque(sorted(range(len(requests)), key=lambda i: (requests[i][0], i))), deque()
    aborted, bound, age = set(), {}, {}
    for tick in itertools.count():
        assert tick < 5000, "the workload did not finish"
        if not arrivals and not scheduler.has_unfinished:
            break
        while arrivals and requests[arrivals[0]][0] <= tick:
            index = arrivals.popleft()
            _, length, max_tokens = requests[index]
            seq = seq_of(f"r{index}", prompt_of(index, length), max_tokens)
            try:
                scheduler.add(seq)
            except RequestError:  # longer than one rank's pool (or the context)
                continue
            age[seq.request_id] = len(seqs)
            seqs.append(seq)
        for _, index in (a for a in aborts if a[0] == tick):
            if index < len(seqs) and scheduler.abort(seqs[index].request_id):
                aborted.add(seqs[index].request_id)
        while len(inflight) < num_inflight_batches:
            before = {s.request_id: blocks.rank_of(s) for s in scheduler.running}
            batch = scheduler.schedule()
            for victim in (s for s in seqs if s.request_id in before and s.status is SequenceStatus.WAITING):
                assert any(age[s.request_id] < age[victim.request_id] and before.get(s.request_id) in (
                    None, before[victim.request_id]) for s in scheduler.running), f"{victim.request_id} preempted"
            if batch is None:
                break
            for item in batch.items:
                assert item.step.dp_rank == blocks.rank_of(item.seq)
            inflight.append(batch)
        if inflight:
            done(scheduler, workers, inflight.popleft())
        bound = _check_ranks(scheduler, inflight, bound)
    for seq in seqs:
        assert seq.is_finished
        if seq.request_id not in aborted:
            assert seq.output_token_ids == expected_output(seq.prompt_token_ids, seq.max_tokens)
            assert seq.num_prefills == seq.num_preemptions + 1
    assert blocks.per_rank_used() == (0,) * num_ranks and blocks.num_free == blocks.num_total


def _check_ranks(scheduler: Scheduler, inflight: deque[ScheduledBatch], bound: dict) -> dict:
    """Each rank's block ids are held once; a request holding blocks since the last check kept its rank."""
    blocks = scheduler.block_manager
    holders = {s.request_id: s for s in scheduler.running}
    holders.update({item.seq.request_id: item.seq for batch in inflight for item in batch.items})
    holders = {rid: s for rid, s in holders.items() if s.block_ids}
    now = {rid: blocks.rank_of(s) for rid, s in holders.items()}
    for rank in range(blocks.num_ranks):
        owned = [b for rid, s in holders.items() if now[rid] == rank for b in s.block_ids]
        assert len(owned) == len(set(owned)), f"a block of rank {rank} is owned by two sequences"
        assert blocks.per_rank_used()[rank] == len(owned)
        assert all(blocks.owner(b, rank) == rid for rid, s in holders.items() if now[rid] == rank
                   for b in s.block_ids)
    for rid, (rank, num_preemptions) in bound.items():
        if rid in holders and holders[rid].num_preemptions == num_preemptions:
            assert now[rid] == rank, f"{rid} moved from rank {rank} to {now[rid]} while holding blocks"
    return {rid: (now[rid], s.num_preemptions) for rid, s in holders.items()}


# ---- E == 1 is the single BlockManager ---------------------------------------------------------------------

class OneRankMachine(RuleBasedStateMachine):
    """Random allocate / step / truncate / free / resize on a one-rank facade and a plain BlockManager: the same
    block ids, counts, refusals and resize outcomes (the Scheduler schedules on the facade only)."""

    @initialize(num_blocks=st.integers(1, 16), block_size=st.integers(1, 4))
    def setup(self, num_blocks, block_size):
        self.facade, self.plain = DataParallelBlocks(1, num_blocks, block_size), BlockManager(num_blocks, block_size)
        self.pairs: dict[str, tuple[Sequence, Sequence]] = {}
        self.counter = 0

    @rule(num_prompt_tokens=st.integers(1, 20), chunk=st.integers(1, 20))
    def allocate(self, num_prompt_tokens, chunk):
        name, self.counter = f"s{self.counter}", self.counter + 1
        pair = seq_of(name, prompt_of(self.counter, num_prompt_tokens), 1), seq_of(name, [0] * num_prompt_tokens, 1)
        chunk = min(chunk, num_prompt_tokens)
        needed = self.plain.num_blocks_needed(pair[1], chunk)
        assert self.facade.num_blocks_needed(pair[0], chunk) == needed
        fits = self.plain.can_allocate(needed)
        assert self.facade.can_allocate(needed, pair[0]) == fits
        if fits:
            self.facade.allocate(pair[0], chunk)
            self.plain.allocate(pair[1], chunk)
            for seq in pair:
                seq.num_computed_tokens = chunk
            self.pairs[name] = pair
        else:
            for manager, seq in ((self.facade, pair[0]), (self.plain, pair[1])):
                with pytest.raises(RuntimeError):
                    manager.allocate(seq, chunk)

    @precondition(lambda self: self.pairs)
    @rule(data=st.data(), num_new_tokens=st.integers(0, 9), failed=st.booleans())
    def step(self, data, num_new_tokens, failed):
        facade_seq, plain_seq = self.pairs[data.draw(st.sampled_from(sorted(self.pairs)))]
        appended = self.facade.append_slots(facade_seq, num_new_tokens)
        assert self.plain.append_slots(plain_seq, num_new_tokens) == appended
        for manager, seq in ((self.facade, facade_seq), (self.plain, plain_seq)):
            if failed:  # the step failed: its new slots go back
                manager.truncate(seq, seq.num_computed_tokens)
            elif appended:
                seq.num_computed_tokens += num_new_tokens

    @precondition(lambda self: self.pairs)
    @rule(data=st.data())
    def free(self, data):
        facade_seq, plain_seq = self.pairs.pop(data.draw(st.sampled_from(sorted(self.pairs))))
        self.facade.free(facade_seq)
        self.plain.free(plain_seq)

    @rule(num_blocks=st.integers(1, 20))
    def resize(self, num_blocks):
        blocking = self.plain.resize(num_blocks)
        assert self.facade.resize(num_blocks) == {self.pairs_owner(b) for b in blocking}

    def pairs_owner(self, block_id: int) -> str:
        return next(name for name, (_, plain) in self.pairs.items() if block_id in plain.block_ids)

    @invariant()
    def same_accounting(self):
        facade, plain = self.facade, self.plain
        assert all(a.block_ids == b.block_ids for a, b in self.pairs.values())
        assert (facade.num_total, facade.num_used, facade.num_free, facade.usage) == (
            plain.num_total, plain.num_used, plain.num_free, plain.usage)
        assert facade.num_blocks_per_rank == plain.num_total and facade.per_rank_used() == (plain.num_used,)
        assert facade.used_block_ids() == plain.used_block_ids()
        assert all(facade.rank_of(a) == (0 if a.block_ids else None) for a, _ in self.pairs.values())


TestOneRankMachine = OneRankMachine.TestCase
TestOneRankMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_a_scheduler_given_a_block_manager_schedules_on_it_as_one_rank():
    manager = BlockManager(8, 4)
    scheduler = Scheduler(SchedulerConfig(max_model_len=32), manager)
    scheduler.add(seq_of("a", prompt_of(0, 9), 1))
    batch = scheduler.schedule()
    assert batch.items[0].step.dp_rank == 0 and manager.num_used == 3 and scheduler.block_manager.num_ranks == 1
    with pytest.raises(ValueError, match="in use"):
        DataParallelBlocks.of(manager)


# ---- rebalancing -------------------------------------------------------------------------------------------

block_counts = st.dictionaries(st.text("abcdefgh", min_size=1, max_size=3), st.integers(0, 40), max_size=14)


def test_assign_requests_puts_the_longest_first_on_the_least_loaded_rank():
    assert assign_requests({"a": 5, "b": 9, "c": 4, "d": 4, "e": 1}, 2) == {"b": 0, "a": 1, "c": 1, "d": 0, "e": 1}
    assert assign_requests({}, 3) == {}
    with pytest.raises(ValueError, match="num_ranks"):
        assign_requests({"a": 1}, 0)
    with pytest.raises(ValueError, match="negative"):
        assign_requests({"a": -1}, 2)


@settings(max_examples=200, deadline=None)
@given(counts=block_counts, num_ranks=st.integers(1, 5), data=st.data())
def test_assign_requests_assigns_everyone_deterministically_within_the_bound(counts, num_ranks, data):
    assignment = assign_requests(counts, num_ranks)
    assert set(assignment) == set(counts) and all(0 <= r < num_ranks for r in assignment.values())
    shuffled = dict(data.draw(st.permutations(list(counts.items()))))
    assert assign_requests(shuffled, num_ranks) == assignment  # the contents decide, not the order
    loads = [sum(c for rid, c in counts.items() if assignment[rid] == rank) for rank in range(num_ranks)]
    largest = max(counts.values(), default=0)
    lower_bound = max(sum(loads) / num_ranks, largest)  # no assignment does better
    assert max(loads) <= lower_bound + largest  # so: <= optimal + largest


@settings(max_examples=150, deadline=None)
@given(counts=st.lists(st.integers(0, 20), max_size=7), num_ranks=st.integers(1, 3))
def test_assign_requests_is_within_four_thirds_of_the_optimum(counts, num_ranks):
    assignment = assign_requests({f"r{i}": c for i, c in enumerate(counts)}, num_ranks)
    loads = [0] * num_ranks
    for rid, rank in assignment.items():
        loads[rank] += counts[int(rid[1:])]
    optimum = min((max(sum(c for c, r in zip(counts, ranks) if r == rank) for rank in range(num_ranks))
                   for ranks in itertools.product(range(num_ranks), repeat=len(counts))), default=0)
    assert 3 * max(loads) <= 4 * optimum  # Graham's LPT bound


# ---- switching the number of pools (TP <-> EP) -------------------------------------------------------------

def _move_cache(workers: DataParallelWorkers, maps) -> None:
    """What the workers' KV migration does with the block maps: (old pool, old id) -> (new pool, new id)."""
    old = workers.cache
    workers.cache = {}
    for (src_pool, dst_pool), (src_ids, dst_ids) in maps.items():
        for src, dst in zip(src_ids, dst_ids, strict=True):
            if (src_pool, src) in old:
                workers.cache[dst_pool, dst] = list(old[src_pool, src])


@settings(max_examples=80, deadline=None)
@given(old_ranks=st.integers(1, 3), new_ranks=st.integers(1, 4), block_size=st.integers(1, 4),
       num_blocks=st.integers(8, 14), new_blocks=st.integers(4, 30), requests=workloads,
       switch_at=st.integers(1, 12), roll_back=st.booleans())
def test_a_switch_between_pool_counts_keeps_every_request_exact(old_ranks, new_ranks, block_size, num_blocks,
                                                                 new_blocks, requests, switch_at, roll_back):
    """Mid-workload the router moves to another number of KV pools (a TP <-> EP switch): every running request
    that fits gets a pool and ids there, the fake workers move their cache by the block maps, and every request
    still ends with the expected tokens; a rolled-back switch gives every request its old pool and ids back."""
    scheduler = make_scheduler(old_ranks, num_blocks, block_size, max_model_len=num_blocks * block_size)
    workers = DataParallelWorkers(scheduler.block_manager)
    seqs = []
    for index, (_, length, max_tokens) in enumerate(requests):
        seq = seq_of(f"r{index}", prompt_of(index, length), max_tokens)
        try:
            scheduler.add(seq)
        except RequestError:
            continue
        seqs.append(seq)
    for _ in range(switch_at):
        if (batch := scheduler.schedule()) is not None:
            done(scheduler, workers, batch)
    scheduler.freeze()
    before = {s.request_id: (scheduler.block_manager.rank_of(s), list(s.block_ids)) for s in scheduler.running}
    capacity = max(new_blocks, max((scheduler.max_blocks(s) for s in seqs), default=1))
    maps, preempted = scheduler.kv_layout.repartition(new_ranks, capacity)
    blocks = scheduler.block_manager
    if roll_back:
        # The same width: ids were kept anyway.
        assert scheduler.kv_layout.restore_partition() == (old_ranks != new_ranks)
        after = {s.request_id: (scheduler.block_manager.rank_of(s), list(s.block_ids)) for s in scheduler.running}
        assert after == {rid: value for rid, value in before.items() if rid not in {s.request_id for s in preempted}}
    else:
        scheduler.kv_layout.commit_partition()
        assert blocks.num_ranks == new_ranks and blocks.num_blocks_per_rank == capacity
        moved = sum(len(src) for src, _ in maps.values())
        assert moved == sum(len(s.block_ids) for s in scheduler.running)
        for (src_pool, dst_pool), (src_ids, dst_ids) in maps.items():
            assert len(src_ids) == len(dst_ids) and len(set(dst_ids)) == len(dst_ids)
            assert all(0 <= b < capacity for b in dst_ids)
        _move_cache(workers, maps)
        workers.blocks = blocks
    assert not scheduler.kv_layout.restore_partition()  # committed or restored: nothing left to undo
    scheduler.unfreeze()
    for _ in range(5000):
        if not scheduler.has_unfinished:
            break
        if (batch := scheduler.schedule()) is not None:
            done(scheduler, workers, batch)
    for seq in seqs:
        assert seq.is_finished and seq.output_token_ids == expected_output(seq.prompt_token_ids, seq.max_tokens)
        assert seq.num_prefills == seq.num_preemptions + 1
    assert scheduler.block_manager.num_used == 0


def test_repartition_to_fewer_pools_preempts_the_requests_that_do_not_fit():
    scheduler = make_scheduler(num_ranks=2, num_blocks=4, block_size=1)
    workers = DataParallelWorkers(scheduler.block_manager)
    for name in "ab":
        scheduler.add(seq_of(name, prompt_of(ord(name), 3), 2))
    done(scheduler, workers, scheduler.schedule())  # a on rank 0, b on rank 1: 3 blocks each
    scheduler.freeze()
    maps, preempted = scheduler.kv_layout.repartition(1, 5)  # one pool of 5 ids: a (first of equals) fits, b no more
    a, b = scheduler.get("a"), scheduler.get("b")
    assert preempted == [b] and b.block_ids == [] and scheduler.num_switch_preemptions == 1
    assert maps == {(0, 0): ([0, 1, 2], [0, 1, 2])} and a.block_ids == [0, 1, 2]
    scheduler.kv_layout.commit_partition()
    _move_cache(workers, maps)
    workers.blocks = scheduler.block_manager
    scheduler.unfreeze()
    while scheduler.has_unfinished:
        done(scheduler, workers, scheduler.schedule())
    for seq in (a, b):
        assert seq.output_token_ids == expected_output(seq.prompt_token_ids, 2)


def test_a_request_aborted_during_a_rolled_back_repartition_frees_its_old_blocks():
    scheduler = make_scheduler(num_ranks=1, num_blocks=8, block_size=1)
    workers = DataParallelWorkers(scheduler.block_manager)
    for name in "ab":
        scheduler.add(seq_of(name, prompt_of(ord(name), 3), 4))
    done(scheduler, workers, scheduler.schedule())
    old = scheduler.block_manager
    scheduler.freeze()
    scheduler.kv_layout.repartition(2, 8)
    assert scheduler.abort("a")  # a client goes away while the switch runs
    assert scheduler.kv_layout.restore_partition()  # and the switch rolls back
    assert scheduler.block_manager is old and old.num_used == len(scheduler.get("b").block_ids)
    scheduler.unfreeze()
    while scheduler.has_unfinished:
        done(scheduler, workers, scheduler.schedule())
    assert old.num_used == 0 and old.num_free == old.num_total
