"""Scheduler under worker failures: a failed step is taken back unadvanced, and lost KV is re-prefilled.

The fake workers of fakes.py check every sampled prefix against the cache, so a failed step that
advanced a sequence, or a re-prefill that misses a token, changes the generated tokens.
"""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from services.router.scheduler import ScheduledBatch, Scheduler
from tests.router.fakes import (
    PagedWorkers,
    check_blocks,
    check_every_request_done,
    contended_workloads,
    drain,
    expected_output,
    make_scheduler,
    prompt_of,
    seq_of,
    workloads,
)


def _progress(scheduler: Scheduler, names: str) -> list[tuple]:
    """What a failed step must leave unchanged, per sequence."""
    return [(s.num_computed_tokens, list(s.output_token_ids), list(s.block_ids), s.status)
            for s in map(scheduler.get, names)]


def test_a_failed_step_advances_nothing_and_runs_again():
    scheduler = make_scheduler(max_num_batched_tokens=6)
    workers, manager = PagedWorkers(scheduler.block_manager), scheduler.block_manager
    seqs = [seq_of(name, prompt_of(i, 5), 4) for i, name in enumerate("ab")]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.on_batch_done(first := scheduler.schedule(), workers.run(first))  # a: 5 tokens, b: 1 (chunked)
    before = _progress(scheduler, "ab")
    failed = scheduler.schedule()
    workers.run(failed)  # the workers may have written some of its KV before failing: a re-run overwrites it
    scheduler.on_batch_failed(failed)
    assert _progress(scheduler, "ab") == before and scheduler.num_inflight_batches == 0
    with pytest.raises(ValueError, match="not in flight"):
        scheduler.on_batch_failed(failed)
    again = scheduler.schedule()
    assert again.steps == failed.steps and again.batch_id != failed.batch_id
    scheduler.on_batch_failed(again)  # nothing ran this time
    drain(scheduler, workers)
    assert [s.output_token_ids for s in seqs] == [expected_output(s.prompt_token_ids, 4) for s in seqs]
    assert [s.num_prefills for s in seqs] == [1, 1] and scheduler.num_preemptions == 0
    assert manager.num_used == 0


def test_a_failed_step_frees_what_finished_while_it_was_in_flight():
    scheduler = make_scheduler(num_inflight_batches=2)
    manager = scheduler.block_manager
    for name in "ab":
        scheduler.add(seq_of(name, prompt_of(3, 6), 3))
    batch = scheduler.schedule()
    assert scheduler.abort("a") and scheduler.finish("b") and manager.num_used == 4  # in flight: held
    scheduler.on_batch_failed(batch)
    assert manager.num_used == 0 and not scheduler.has_unfinished


def test_preempt_all_requeues_every_running_sequence_in_admission_order():
    scheduler = make_scheduler(num_blocks=32, max_num_seqs=3)
    workers, manager = PagedWorkers(scheduler.block_manager), scheduler.block_manager
    seqs = [seq_of(name, prompt_of(i, 3 + i), 6) for i, name in enumerate("abcd")]
    for seq in seqs:
        scheduler.add(seq)
    for _ in range(3):  # a, b, c run and decode; d waits (max_num_seqs)
        scheduler.on_batch_done(batch := scheduler.schedule(), workers.run(batch))
    with pytest.raises(RuntimeError, match="frozen"):
        scheduler.kv_layout.preempt_all()
    batch = scheduler.schedule()
    scheduler.freeze()
    with pytest.raises(RuntimeError, match="in flight"):
        scheduler.kv_layout.preempt_all()
    scheduler.on_batch_failed(batch)
    assert scheduler.kv_layout.preempt_all() == seqs[:3]
    assert list(scheduler.waiting) == seqs and scheduler.num_running == 0 and manager.num_used == 0
    assert scheduler.num_preemptions == 3 and all(s.num_computed_tokens == 0 for s in seqs)
    assert scheduler.kv_layout.preempt_all() == []
    scheduler.unfreeze()
    drain(scheduler, PagedWorkers(manager))  # new workers with an empty cache: everything is re-prefilled
    assert [s.output_token_ids for s in seqs] == [expected_output(s.prompt_token_ids, 6) for s in seqs]
    assert [s.num_prefills for s in seqs] == [2, 2, 2, 1]


@settings(max_examples=80, deadline=None)
@given(st.one_of(workloads(), contended_workloads()), st.sets(st.integers(0, 40), max_size=8),
       st.sets(st.integers(0, 40), max_size=3))
def test_failed_steps_and_lost_kv_leak_no_block_and_keep_outputs_exact(workload, failures, losses):
    """`failures`: ticks whose returning step fails; `losses`: ticks where a worker dies (every step in flight
    fails and the new workers start with an empty cache)."""
    block_size, num_blocks, config, requests, stop_token_ids, aborts = workload
    scheduler = make_scheduler(num_blocks, block_size, **config)
    workers, manager = PagedWorkers(scheduler.block_manager), scheduler.block_manager
    seqs = [seq_of(f"r{i}", prompt_of(i, p), m, stop_token_ids) for i, (_, p, m) in enumerate(requests)]
    arrivals = deque(sorted(range(len(requests)), key=lambda i: (requests[i][0], i)))
    added, aborted, inflight = set(), set(), deque[ScheduledBatch]()
    num_failed = num_lost = 0
    for tick in range(20_000):
        if not arrivals and not scheduler.has_unfinished:
            break
        while arrivals and requests[arrivals[0]][0] <= tick:
            scheduler.add(seqs[arrivals[0]])
            added.add(arrivals.popleft())
        for _, index in [a for a in aborts if a[0] == tick]:
            if index in added and scheduler.abort(f"r{index}"):
                aborted.add(index)
        if tick in losses:
            num_lost += 1
            scheduler.freeze()
            while inflight:
                scheduler.on_batch_failed(inflight.popleft())
            scheduler.kv_layout.preempt_all()
            scheduler.unfreeze()
            workers = PagedWorkers(manager)
        while len(inflight) < config["num_inflight_batches"] and (batch := scheduler.schedule()) is not None:
            inflight.append(batch)
        if inflight:
            batch = inflight.popleft()
            if tick in failures:
                num_failed += 1
                if tick % 2:
                    workers.run(batch)  # it wrote its KV, then failed
                scheduler.on_batch_failed(batch)
            else:
                scheduler.on_batch_done(batch, workers.run(batch))
        check_blocks(scheduler, inflight)
    else:
        raise AssertionError("the workload did not finish")
    event(f"failed steps: {min(num_failed, 3)}")  # 3: three or more
    event(f"workers lost: {num_lost > 0}")
    assert manager.num_used == 0 and manager.num_free == manager.num_total == num_blocks
    check_every_request_done(scheduler, seqs, aborted, stop_token_ids)
