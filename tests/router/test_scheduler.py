"""Scheduler: admission, continuous batching, chunked prefill, preemption by recompute, abort, freeze/rebind.

The steps run on the paged fake workers of tests/router/fakes.py: a wrong block table, a block shared by two live
sequences, or a preempted sequence that does not re-prefill its whole prefix changes the generated tokens.
"""

from __future__ import annotations

import random
from collections import deque

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from services.contracts.step import PENDING_TOKEN, SamplingParams
from services.router.async_scheduler import AsyncScheduler
from services.router.config import SchedulerConfig
from services.router.contracts import GenerationRequest, QueueFullError, RequestError
from services.router.scheduler import Scheduler
from services.router.sequence import Sequence, SequenceStatus
from tests.router.fakes import (
    PagedWorkers,
    check_blocks,
    check_every_request_done,
    contended_workloads,
    drain,
    expected_output,
    make_scheduler,
    prompt_of,
    run_step,
    seq_of,
    workloads,
)



def test_sequence_token_accounting():
    seq = seq_of("a", [4], 3)
    assert (seq.num_tokens, seq.num_uncomputed_tokens, seq.is_prefill) == (1, 1, True)  # a 1-token prompt
    seq.num_computed_tokens = 1
    seq.output_token_ids.append(9)
    assert (seq.all_token_ids, seq.num_uncomputed_tokens, seq.is_prefill) == ([4, 9], 1, False)  # a decode
    seq.num_computed_tokens = 0  # preempted: prompt and output are fed again
    assert (seq.num_uncomputed_tokens, seq.is_prefill, seq.is_finished) == (2, True, False)
    seq.status = SequenceStatus.FINISHED_ABORTED
    assert seq.is_finished and seq.status.finish_reason == "abort"
    assert SequenceStatus.WAITING.finish_reason is None


# ---- admission ---------------------------------------------------------------------------------------------

def test_add_refuses_requests_that_can_never_run():
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_model_len=40)
    with pytest.raises(RequestError, match="empty"):
        scheduler.add(seq_of("a", [], 4))
    with pytest.raises(RequestError) as error:
        scheduler.add(seq_of("b", prompt_of(0, 30), 11))
    assert "30" in str(error.value) and "11" in str(error.value) and "40" in str(error.value)
    with pytest.raises(RequestError, match="KV blocks"):
        scheduler.add(seq_of("c", prompt_of(0, 30), 4))  # 33 cached tokens need 9 blocks, the cache has 8
    with pytest.raises(RequestError, match="max_tokens"):
        scheduler.add(seq_of("d", [1], -1))
    scheduler.add(seq_of("e", prompt_of(0, 30), 3))  # 32 cached tokens: exactly 8 blocks
    with pytest.raises(RequestError, match="already in use"):
        scheduler.add(seq_of("e", [1], 1))
    assert scheduler.num_waiting == 1


def test_queue_full_raises_with_retry_after_and_frozen_still_admits():
    scheduler = make_scheduler(max_waiting=2, retry_after_s=2.5)
    scheduler.freeze()
    scheduler.add(seq_of("a", [1], 1))
    scheduler.add(seq_of("b", [1], 1))
    with pytest.raises(QueueFullError) as error:
        scheduler.add(seq_of("c", [1], 1))
    assert error.value.retry_after_s == 2.5
    assert scheduler.schedule() is None and scheduler.num_waiting == 2


# ---- batching ----------------------------------------------------------------------------------------------

def test_prefill_then_decodes_build_steps_like_the_offline_loop():
    scheduler, prompt = make_scheduler(block_size=4), prompt_of(1, 5)
    workers = PagedWorkers(scheduler.block_manager)
    seq = seq_of("a", prompt, 3)
    scheduler.add(seq)
    batch, updates = run_step(scheduler, workers)
    (step,) = batch.steps
    assert (step.token_ids, step.start_position, step.block_table, step.sample, step.num_generated) == (
        tuple(prompt), 0, (0, 1), True, 0)
    want = expected_output(prompt, 3)
    assert [(u.new_token_ids, u.finished) for u in updates] == [((want[0],), False)]
    assert seq.first_scheduled_time is not None and seq.first_token_time is not None
    batch, _ = run_step(scheduler, workers)
    assert batch.steps[0].token_ids == (want[0],) and batch.steps[0].start_position == 5
    assert batch.steps[0].num_generated == 1
    _, updates = run_step(scheduler, workers)
    assert updates[0].finished and seq.status is SequenceStatus.FINISHED_LENGTH
    assert seq.output_token_ids == want and seq.status.finish_reason == "length"
    assert scheduler.block_manager.num_used == 0 and not scheduler.has_unfinished
    assert scheduler.schedule() is None and scheduler.get("a") is None


def test_chunked_prefill_feeds_exactly_the_prompt_and_samples_once():
    scheduler, prompt = make_scheduler(max_num_batched_tokens=8), prompt_of(2, 20)
    workers = PagedWorkers(scheduler.block_manager)
    seq = seq_of("a", prompt, 2)
    scheduler.add(seq)
    fed, samples = [], []
    for _ in range(3):
        batch, updates = run_step(scheduler, workers)
        (step,) = batch.steps
        assert step.start_position == len(fed)
        fed += step.token_ids
        samples.append(step.sample)
        assert updates[0].new_token_ids == (() if not step.sample else (seq.output_token_ids[0],))
    assert fed == prompt and samples == [False, False, True] and seq.num_prefills == 1
    drain(scheduler, workers)
    assert seq.output_token_ids == expected_output(prompt, 2)


def test_decodes_go_first_and_the_token_budget_holds():
    scheduler = make_scheduler(max_num_batched_tokens=6)
    workers = PagedWorkers(scheduler.block_manager)
    for name in ("a", "b"):
        scheduler.add(seq_of(name, prompt_of(3, 3), 5))
    run_step(scheduler, workers)  # both prompts: 6 tokens
    scheduler.add(seq_of("c", prompt_of(4, 10), 5))
    batch, _ = run_step(scheduler, workers)
    assert [(s.request_id, len(s.token_ids), s.sample) for s in batch.steps] == [
        ("a", 1, True), ("b", 1, True), ("c", 4, False)]
    batch, _ = run_step(scheduler, workers)  # c's next chunk comes after the decodes
    assert [(s.request_id, len(s.token_ids)) for s in batch.steps] == [("a", 1), ("b", 1), ("c", 4)]
    assert batch.num_tokens == 6


def test_max_num_seqs_bounds_the_running_set():
    scheduler = make_scheduler(max_num_seqs=2)
    workers = PagedWorkers(scheduler.block_manager)
    for name in "abc":
        scheduler.add(seq_of(name, [5, 6], 2))
    batch, _ = run_step(scheduler, workers)
    assert [s.request_id for s in batch.steps] == ["a", "b"] and scheduler.num_waiting == 1
    batch, _ = run_step(scheduler, workers)  # a and b finish in this step; c is admitted only after
    assert [s.request_id for s in batch.steps] == ["a", "b"]
    batch, _ = run_step(scheduler, workers)
    assert [s.request_id for s in batch.steps] == ["c"]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    scheduler = make_scheduler(max_model_len=16, max_num_batched_tokens=16, enable_chunked_prefill=False)
    workers = PagedWorkers(scheduler.block_manager)
    scheduler.add(seq_of("a", prompt_of(0, 10), 3))
    scheduler.add(seq_of("b", prompt_of(1, 10), 3))
    batch, _ = run_step(scheduler, workers)
    assert [(s.request_id, len(s.token_ids)) for s in batch.steps] == [("a", 10)]
    batch, _ = run_step(scheduler, workers)
    assert [(s.request_id, len(s.token_ids)) for s in batch.steps] == [("a", 1), ("b", 10)]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_model_len=32, max_num_batched_tokens=16, enable_chunked_prefill=False)


def test_inflight_micro_batches_are_disjoint():
    scheduler = make_scheduler(num_inflight_batches=2, max_num_batched_tokens=4)
    workers = PagedWorkers(scheduler.block_manager)
    for name in "abc":
        scheduler.add(seq_of(name, prompt_of(5, 4), 3))
    first, second = scheduler.schedule(), scheduler.schedule()
    assert [s.request_id for s in first.steps] == ["a"] and [s.request_id for s in second.steps] == ["b"]
    assert scheduler.num_inflight_batches == 2
    scheduler.on_batch_done(first, workers.run(first))
    third = scheduler.schedule()  # a decodes (b is still in flight), c's prompt fills the rest of the budget
    assert [(s.request_id, len(s.token_ids)) for s in third.steps] == [("a", 1), ("c", 3)]
    assert scheduler.schedule() is None  # every sequence is in flight
    with pytest.raises(ValueError, match="not in flight"):
        scheduler.on_batch_done(first, {})
    scheduler.on_batch_done(second, workers.run(second))
    scheduler.on_batch_done(third, workers.run(third))
    drain(scheduler, workers)
    assert scheduler.block_manager.num_used == 0


def test_spread_decodes_share_the_pipeline_micro_batches():
    """With spread_decodes, the running decodes go into the pp micro-batches in flight ceil(running / pp) at a
    time; without, the first micro-batch takes them all and the pipeline holds one."""
    for spread, expected in ((True, [3, 3, 2]), (False, [8])):
        scheduler = make_scheduler(num_inflight_batches=3, spread_decodes=spread)
        workers = PagedWorkers(scheduler.block_manager)
        seqs = [seq_of(f"r{i}", prompt_of(i, 3), 4) for i in range(8)]
        for seq in seqs:
            scheduler.add(seq)
        first = scheduler.schedule(3)  # the 8 prefills (new prompts are not decodes)
        scheduler.on_batch_done(first, workers.run(first))
        batches = []
        while (batch := scheduler.schedule(3)) is not None:
            batches.append(batch)
        assert [len(b.items) for b in batches] == expected, spread
        assert sorted(s.request_id for b in batches for s in b.steps) == [f"r{i}" for i in range(8)]
        for batch in batches:
            scheduler.on_batch_done(batch, workers.run(batch))
        drain(scheduler, workers)
        assert all(s.output_token_ids == expected_output(s.prompt_token_ids, 4) for s in seqs)
        assert scheduler.block_manager.num_used == 0


# ---- steps ahead (async scheduling) ---------------------------------------------------------------------------

def test_steps_ahead_are_the_async_layer_s():
    """async_scheduling picks the class once: the base Scheduler waits for every step even when the layout would
    allow steps ahead; the AsyncScheduler layer sends a decode's next step, fed PENDING_TOKEN, before it returns."""
    base, layered = make_scheduler(async_scheduling=False), make_scheduler(async_scheduling=True)
    assert type(base) is Scheduler and isinstance(layered, AsyncScheduler)
    prompt = prompt_of(1, 6)
    for scheduler in (base, layered):
        workers = PagedWorkers(scheduler.block_manager)
        seq = seq_of("a", prompt, 5)
        scheduler.add(seq)
        prefill = scheduler.schedule(ahead=True)
        ahead = scheduler.schedule(ahead=True)
        if scheduler is base:  # nothing until the prefill returns
            assert ahead is None
        else:
            assert [item.step.token_ids for item in ahead.items] == [(PENDING_TOKEN,)]
        steps = [prefill] + ([ahead] if ahead is not None else [])
        while steps or scheduler.has_unfinished:  # as an engine: keep ahead=True, one step more in flight
            batch = steps.pop(0) if steps else scheduler.schedule(ahead=True)
            if (nxt := scheduler.schedule(ahead=True)) is not None:
                steps.append(nxt)
            assert scheduler is layered or all(item.step.token_ids != (PENDING_TOKEN,) for item in batch.items)
            scheduler.on_batch_done(batch, workers.run(batch))
        assert seq.output_token_ids == expected_output(prompt, 5)
        assert scheduler.block_manager.num_used == 0
    assert base.num_ahead_items == 0 and layered.num_ahead_items > 0


def test_a_decode_goes_out_ahead_of_the_step_sampling_its_input():
    prompt = prompt_of(1, 6)
    scheduler = make_scheduler(block_size=4)
    workers = PagedWorkers(scheduler.block_manager)
    seq = seq_of("a", prompt, 5)
    scheduler.add(seq)
    prefill = scheduler.schedule(ahead=True)
    assert scheduler.schedule(ahead=False) is None  # without ahead: nothing until the prefill returns
    first = scheduler.schedule(ahead=True)
    [item] = first.items
    assert item.step.token_ids == (PENDING_TOKEN,) and item.step.start_position == 6 and item.step.sample
    assert item.step.num_generated == 1 and len(item.step.block_table) == 2  # position 6 is in a second block
    assert scheduler.schedule(ahead=True) is None  # one step ahead at most
    scheduler.on_batch_done(prefill, workers.run(prefill))
    second = scheduler.schedule(ahead=True)  # ahead of `first`, now the newest in flight
    assert second.items[0].step.start_position == 7
    for batch in (first, second):
        scheduler.on_batch_done(batch, workers.run(batch))
    drain(scheduler, workers)
    assert seq.output_token_ids == expected_output(prompt, 5)
    assert scheduler.num_ahead_items == 2  # outputs 2 and 3 (drain() schedules the rest one step at a time)
    assert scheduler.block_manager.num_used == 0


@pytest.mark.parametrize("request_args", [
    dict(max_tokens=1),                                     # the step in flight samples the last token
    dict(sampling=SamplingParams(presence_penalty=0.5)),   # a penalty counts the token in flight
    dict(sampling=SamplingParams(num_logprobs=1)),          # logprobs: its update carries them (kept synchronous)
    dict(min_tokens=3),                                     # stop tokens masked until the third token
])
def test_no_step_ahead_where_the_next_step_needs_more_than_the_pending_token(request_args):
    scheduler = make_scheduler()
    args = dict(max_tokens=8) | request_args
    scheduler.add(Sequence.from_request(GenerationRequest("a", tuple(prompt_of(2, 5)), **args)))
    prefill = scheduler.schedule(ahead=True)
    assert prefill is not None and scheduler.schedule(ahead=True) is None
    assert scheduler.num_ahead_items == 0


def test_with_several_samplers_only_greedy_and_seeded_requests_go_ahead():
    """ahead_random=False (TP ranks each sample): a request sampled without a seed would draw another token on
    each rank, so it waits for its step; greedy and seeded ones go ahead."""
    scheduler = make_scheduler()
    for request_id, sampling in (("greedy", SamplingParams()), ("seeded", SamplingParams(temperature=0.7, seed=1)),
                                 ("random", SamplingParams(temperature=0.7))):
        scheduler.add(Sequence.from_request(GenerationRequest(request_id, tuple(prompt_of(5, 4)), 8, sampling)))
    scheduler.schedule(ahead=True, ahead_random=False)
    ahead = scheduler.schedule(ahead=True, ahead_random=False)
    assert [item.seq.request_id for item in ahead.items] == ["greedy", "seeded"]


def test_ahead_only_of_the_newest_step_in_flight():
    """Two micro-batches in flight (a pipeline): the decodes of the older one wait for it; the worker feeds only
    what its previous step sampled."""
    scheduler = make_scheduler(num_inflight_batches=2)
    workers = PagedWorkers(scheduler.block_manager)
    scheduler.add(seq_of("a", prompt_of(3, 4), 6))
    older = scheduler.schedule(2, ahead=True)
    scheduler.add(seq_of("b", prompt_of(4, 4), 6))
    newer = scheduler.schedule(2)
    assert [i.seq.request_id for i in newer.items] == ["b"]
    third = scheduler.schedule(2, ahead=True)  # "a" is in flight in the older step: not ahead of it
    assert [(i.seq.request_id, i.step.token_ids) for i in third.items] == [("b", (PENDING_TOKEN,))]
    for batch in (older, newer, third):
        scheduler.on_batch_done(batch, workers.run(batch))
    drain(scheduler, workers)


def test_a_request_ending_with_a_step_ahead_in_flight_frees_its_blocks_when_that_step_returns():
    prompt = prompt_of(6, 4)
    want = expected_output(prompt, 10)
    scheduler = make_scheduler(block_size=2)
    workers = PagedWorkers(scheduler.block_manager)
    stopped = seq_of("stop", prompt, 10, stop_token_ids={want[0]})  # its prefill samples its stop token
    ended = seq_of("string", prompt_of(7, 4), 10)                   # the engine ends it (a stop string)
    for seq in (stopped, ended):
        scheduler.add(seq)
    prefill = scheduler.schedule(ahead=True)
    ahead = scheduler.schedule(ahead=True)
    assert len(ahead.items) == 2
    updates = scheduler.on_batch_done(prefill, workers.run(prefill))
    assert [u.finished for u in updates] == [True, False] and stopped.output_token_ids == [want[0]]
    assert scheduler.finish("string")
    assert scheduler.block_manager.num_used == len(stopped.block_ids) + len(ended.block_ids) > 0  # still in flight
    assert scheduler.on_batch_done(ahead, workers.run(ahead)) == []  # computed, discarded
    assert scheduler.block_manager.num_used == 0 and not scheduler.has_unfinished
    assert stopped.output_token_ids == [want[0]] and len(ended.output_token_ids) == 1


def test_a_step_ahead_of_a_failed_step_is_taken_back_too():
    prompt = prompt_of(8, 5)
    scheduler = make_scheduler(block_size=2)
    workers = PagedWorkers(scheduler.block_manager)
    seq = seq_of("a", prompt, 6)
    scheduler.add(seq)
    scheduler.on_batch_done(batch := scheduler.schedule(ahead=True), workers.run(batch))  # prefill, token 1
    failed = scheduler.schedule(ahead=True)
    ahead = scheduler.schedule(ahead=True)
    assert ahead.items[0].step.start_position == 6
    scheduler.on_batch_failed(failed)
    assert len(seq.block_ids) == 3  # the 5 cached tokens and the one to feed; the step ahead's slot given back
    # Were the step ahead to come back with a token (a real worker refuses it: PendingTokenMissing), it is stale.
    assert scheduler.on_batch_done(ahead, {"a": 0}) == [] and seq.num_computed_tokens == 5
    drain(scheduler, workers)
    assert seq.output_token_ids == expected_output(prompt, 6)
    assert scheduler.block_manager.num_used == 0


def test_a_step_ahead_that_fails_leaves_the_step_before_it_its_kv():
    """The step ahead could not be sent (or failed alone): the step before it, still in flight, keeps its blocks."""
    prompt = prompt_of(10, 8)
    scheduler = make_scheduler(block_size=4)
    workers = PagedWorkers(scheduler.block_manager)
    seq = seq_of("a", prompt, 6)
    scheduler.add(seq)
    prefill = scheduler.schedule(ahead=True)  # positions 0-7: two blocks
    ahead = scheduler.schedule(ahead=True)    # position 8: a third
    assert len(seq.block_ids) == 3
    scheduler.on_batch_failed(ahead)
    assert len(seq.block_ids) == 2
    assert scheduler.schedule(ahead=True) is None  # after a failure, none ahead until nothing is in flight
    scheduler.on_batch_done(prefill, workers.run(prefill))
    decode, again = scheduler.schedule(ahead=True), scheduler.schedule(ahead=True)  # nothing in flight: ahead again
    assert again.items[0].step.token_ids == (PENDING_TOKEN,)
    for batch in (decode, again):
        scheduler.on_batch_done(batch, workers.run(batch))
    drain(scheduler, workers)
    assert seq.output_token_ids == expected_output(prompt, 6)
    assert scheduler.block_manager.num_used == 0


def test_a_request_id_reused_while_the_step_ahead_of_its_last_owner_is_in_flight():
    """A client may reuse the id of a request that ended (aborted here) while its steps were in flight: the new
    request waits until the old one's last step has returned its blocks (blocks are bound by request id, one holder
    at a time), then runs as if alone; both give their blocks back."""
    prompt = prompt_of(11, 6)
    scheduler = make_scheduler(block_size=2)
    workers = PagedWorkers(scheduler.block_manager)
    old = seq_of("a", prompt, 8)
    scheduler.add(old)
    prefill = scheduler.schedule(ahead=True)
    ahead = scheduler.schedule(ahead=True)
    assert scheduler.abort("a")
    scheduler.on_batch_done(prefill, workers.run(prefill))
    new = seq_of("a", prompt, 4)
    scheduler.add(new)
    assert scheduler.schedule(ahead=True) is None  # the old request's step ahead still holds its blocks
    scheduler.on_batch_done(ahead, workers.run(ahead))
    assert scheduler.block_manager.num_used == 0  # the old request's blocks are back
    first = scheduler.schedule(ahead=True)  # now the new request's prefill
    assert [item.seq for item in first.items] == [new]
    scheduler.on_batch_done(first, workers.run(first))
    drain(scheduler, workers)
    assert new.output_token_ids == expected_output(prompt, 4)
    assert scheduler.block_manager.num_used == 0


def test_a_request_parks_once_its_step_ahead_returns_too():
    scheduler = make_scheduler()
    workers = PagedWorkers(scheduler.block_manager)
    seq = seq_of("a", prompt_of(9, 4), 8)
    scheduler.add(seq)
    prefill = scheduler.schedule(ahead=True)
    ahead = scheduler.schedule(ahead=True)
    assert scheduler.moves.park("a") is False
    scheduler.on_batch_done(prefill, workers.run(prefill))
    assert "a" not in scheduler.moves.parked and scheduler.schedule(ahead=True) is None  # parking: nothing more ahead
    scheduler.on_batch_done(ahead, workers.run(ahead))
    assert scheduler.moves.parked["a"] is seq and seq.num_computed_tokens == 5 and len(seq.output_token_ids) == 2


def test_stop_token_finishes_the_sequence():
    prompt = prompt_of(6, 4)
    want = expected_output(prompt, 10)
    scheduler = make_scheduler()
    workers = PagedWorkers(scheduler.block_manager)
    seq = seq_of("a", prompt, 10, stop_token_ids={want[2]})
    scheduler.add(seq)
    drain(scheduler, workers)
    assert seq.output_token_ids == want[:want.index(want[2]) + 1]
    assert seq.status is SequenceStatus.FINISHED_STOPPED and seq.status.finish_reason == "stop"


# ---- preemption --------------------------------------------------------------------------------------------

def test_out_of_blocks_preempts_the_newest_which_re_prefills_its_whole_prefix():
    scheduler = make_scheduler(num_blocks=4, block_size=2)
    workers = PagedWorkers(scheduler.block_manager)
    a, b = seq_of("a", prompt_of(7, 4), 3), seq_of("b", prompt_of(8, 4), 3)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler, workers)  # both prefilled: all 4 blocks used
    batch, _ = run_step(scheduler, workers)  # a's decode needs a 3rd block: b (newest) is preempted
    assert [s.request_id for s in batch.steps] == ["a"]
    assert b.status is SequenceStatus.WAITING and b.block_ids == [] and b.num_computed_tokens == 0
    assert (b.num_preemptions, scheduler.num_preemptions, list(scheduler.waiting)) == (1, 1, [b])
    b_output_before = list(b.output_token_ids)
    while b.status is SequenceStatus.WAITING:
        batch, _ = run_step(scheduler, workers)
    (step,) = [s for s in batch.steps if s.request_id == "b"]
    assert (list(step.token_ids), step.start_position) == (b.prompt_token_ids + b_output_before, 0)
    drain(scheduler, workers)
    assert a.output_token_ids == expected_output(a.prompt_token_ids, 3)
    assert b.output_token_ids == expected_output(b.prompt_token_ids, 3)
    assert b.num_prefills == 2 and a.num_prefills == 1 and scheduler.block_manager.num_free == 4


def test_a_sequence_waits_for_a_newer_one_in_flight_rather_than_preempting_itself():
    scheduler = make_scheduler(num_blocks=4, block_size=2, num_inflight_batches=2, max_num_batched_tokens=4)
    workers = PagedWorkers(scheduler.block_manager)
    a, b = seq_of("a", prompt_of(9, 4), 2), seq_of("b", prompt_of(10, 4), 2)
    scheduler.add(a)
    scheduler.add(b)
    first, second = scheduler.schedule(), scheduler.schedule()
    scheduler.on_batch_done(first, workers.run(first))
    assert scheduler.schedule() is None  # a needs a block that b (newer, in flight) holds: a waits, keeping its KV
    assert a.status is SequenceStatus.RUNNING and a.block_ids and scheduler.num_preemptions == 0
    scheduler.on_batch_done(second, workers.run(second))
    batch, _ = run_step(scheduler, workers)  # b is back: a preempts it
    assert [s.request_id for s in batch.steps] == ["a"] and list(scheduler.waiting) == [b]
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)
    drain(scheduler, workers)
    assert a.output_token_ids == expected_output(a.prompt_token_ids, 2)
    assert b.output_token_ids == expected_output(b.prompt_token_ids, 2)
    assert (a.num_prefills, b.num_prefills) == (1, 2)


def test_an_older_prefill_takes_a_newer_decode_out_of_the_step_for_its_blocks():
    scheduler = make_scheduler(num_blocks=5, block_size=2, num_inflight_batches=2, max_num_batched_tokens=4)
    workers = PagedWorkers(scheduler.block_manager)
    a, b = seq_of("a", prompt_of(12, 10), 1), seq_of("b", prompt_of(13, 2), 3)
    scheduler.add(a)
    scheduler.add(b)
    first, second = scheduler.schedule(), scheduler.schedule()  # a: 4 prompt tokens; b: its whole prompt
    for batch in (first, second):
        scheduler.on_batch_done(batch, workers.run(batch))
    # b's decode (first, takes the 4th block) leaves a's next 3 tokens one block short: b, newer, is taken out.
    batch, _ = run_step(scheduler, workers)
    assert [(s.request_id, s.start_position, len(s.token_ids)) for s in batch.steps] == [("a", 4, 3)]
    assert b.status is SequenceStatus.WAITING and (a.num_preemptions, b.num_preemptions) == (0, 1)
    drain(scheduler, workers)
    assert a.output_token_ids == expected_output(a.prompt_token_ids, 1)
    assert b.output_token_ids == expected_output(b.prompt_token_ids, 3)


def test_two_requests_that_cannot_share_the_cache_do_not_preempt_each_other_forever():
    """The livelock a review found: each request preempted itself whenever it lacked a block while the other one
    was in flight, so neither finished (999 preemptions in 3,000 ticks; r0 never got past its prompt)."""
    config = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=4, num_inflight_batches=2)
    # r0 caches 20 tokens: all 7 blocks of 3; r1 caches 17: 6 blocks.
    scheduler, seqs, finished_at = simulate(3, 7, config, [(0, 20, 1), (0, 6, 12)], frozenset(), [],
                                            max_ticks=30)
    assert [s.num_preemptions for s in seqs] == [0, 2]  # only the newer one is preempted
    assert finished_at == [9, 20] and scheduler.num_preemptions == 2


# ---- abort, finish -----------------------------------------------------------------------------------------

def test_abort_frees_everything_in_every_state():
    scheduler = make_scheduler(num_inflight_batches=2, max_num_batched_tokens=4)
    workers, manager = PagedWorkers(scheduler.block_manager), scheduler.block_manager
    for name in "abcd":
        scheduler.add(seq_of(name, prompt_of(11, 4), 5))
    first, second = scheduler.schedule(), scheduler.schedule()  # a, b in flight; c, d waiting
    assert scheduler.abort("d") and scheduler.num_waiting == 1  # waiting
    assert scheduler.abort("b") and manager.num_used == 2  # in flight: blocks kept until the step returns
    assert scheduler.get("b") is None and scheduler.num_running == 1
    updates = scheduler.on_batch_done(second, workers.run(second))
    assert updates == [] and manager.num_used == 1
    scheduler.on_batch_done(first, workers.run(first))
    assert scheduler.abort("a") and manager.num_used == 0  # running, not in flight
    assert not scheduler.abort("a") and not scheduler.abort("nope")
    assert scheduler.finish("c", SequenceStatus.FINISHED_STOPPED)
    assert not scheduler.has_unfinished and manager.num_free == manager.num_total
    with pytest.raises(ValueError):
        scheduler.finish("x", SequenceStatus.RUNNING)


# ---- live reconfiguration ----------------------------------------------------------------------------------

def test_freeze_stops_scheduling_and_in_flight_steps_still_complete():
    scheduler = make_scheduler()
    workers = PagedWorkers(scheduler.block_manager)
    scheduler.add(seq_of("a", [1, 2, 3], 2))
    batch = scheduler.schedule()
    scheduler.freeze()
    assert scheduler.is_frozen and scheduler.schedule() is None
    scheduler.on_batch_done(batch, workers.run(batch))
    assert scheduler.schedule() is None
    scheduler.unfreeze()
    drain(scheduler, workers)
    assert scheduler.get("a") is None


def test_rebind_shrink_preempts_newest_owners_of_ids_past_the_new_size():
    scheduler = make_scheduler(num_blocks=12, block_size=2)
    workers, manager = PagedWorkers(scheduler.block_manager), scheduler.block_manager
    seqs = [seq_of(name, prompt_of(i, 5), 3) for i, name in enumerate("abc")]
    for seq in seqs:
        scheduler.add(seq)
    batch = scheduler.schedule()  # a: 0-2, b: 3-5, c: 6-8
    with pytest.raises(RuntimeError):
        scheduler.kv_layout.rebind(4)  # not frozen
    scheduler.freeze()
    with pytest.raises(RuntimeError):
        scheduler.kv_layout.rebind(4)  # a step in flight
    scheduler.on_batch_done(batch, workers.run(batch))
    with pytest.raises(ValueError, match="need more than"):
        scheduler.kv_layout.rebind(3)  # each request needs 4 blocks at the end
    assert scheduler.kv_layout.rebind(4) == [seqs[2], seqs[1]]
    assert (manager.num_total, manager.num_used, scheduler.num_switch_preemptions) == (4, 3, 2)
    assert list(scheduler.waiting) == [seqs[1], seqs[2]] and scheduler.num_preemptions == 2
    assert scheduler.kv_layout.rebind(16) == [] and manager.num_total == 16
    scheduler.unfreeze()
    drain(scheduler, workers)
    assert all(s.output_token_ids == expected_output(s.prompt_token_ids, 3) for s in seqs)
    assert [s.num_prefills for s in seqs] == [1, 2, 2]
    assert manager.num_free == 16


# ---- random workloads --------------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.one_of(workloads(), contended_workloads()), st.booleans(), st.sets(st.integers(0, 60), max_size=3))
def test_random_workloads_finish_correctly_under_every_invariant(workload, ahead, failures):
    """With `ahead`, one more step than the micro-batches is kept in flight, as the engine does (async
    scheduling), and the decodes of the newest step go out again before it returns. The steps returning at the
    ticks in `failures` fail (and so does a step ahead of a failed one, as a worker refuses it)."""
    scheduler, _, _ = simulate(*workload, ahead=ahead, failures=failures)
    event(f"preempted: {scheduler.num_preemptions > 0}")
    event(f"steps ahead: {scheduler.num_ahead_items > 0}")


def test_a_heavy_pipelined_workload_with_scarce_blocks_preempts_and_still_finishes_correctly():
    rng = random.Random(0)
    requests = [(rng.randrange(0, 40), rng.randrange(1, 40), rng.randrange(1, 20)) for _ in range(60)]
    config = dict(max_model_len=64, max_num_seqs=16, max_num_batched_tokens=24, num_inflight_batches=2)
    for ahead in (False, True):
        scheduler, _, _ = simulate(4, 16, config, requests, frozenset(), [(30, 5), (31, 17)], ahead=ahead)
        assert scheduler.num_preemptions > 10 and (scheduler.num_ahead_items > 0) == ahead


def simulate(block_size, num_blocks, config, requests, stop_token_ids, aborts,
             max_ticks=None, ahead=False, failures=()) -> tuple[Scheduler, list[Sequence], list[int]]:
    """Replay a workload (arrival tick, prompt length, max_tokens) with aborts (tick, index); check everything.

    Progress: while a request is unfinished some micro-batch is in flight (the pipeline never idles), a sequence
    is preempted only for an older one that stays running (so the oldest running one never is), and every
    request finishes within `max_ticks` ticks of its arrival. By default that is 4 ticks per token of the whole
    workload (prompts + max_tokens): the most seen over 200,000 random workloads, a search for the slowest
    included, is 2.2; a livelock never ends.
    Returns the scheduler, the sequences and the tick at which each one finished.
    """
    max_ticks = 4 * sum(p + m for _, p, m in requests) if max_ticks is None else max_ticks
    scheduler = make_scheduler(num_blocks, block_size, **config)
    workers, manager = PagedWorkers(scheduler.block_manager), scheduler.block_manager
    seqs = [seq_of(f"r{i}", prompt_of(i, p), m, stop_token_ids) for i, (_, p, m) in enumerate(requests)]
    arrivals = deque(sorted(range(len(requests)), key=lambda i: (requests[i][0], i)))
    add_order, first_scheduled, aborted, inflight = [], [], set(), deque()
    age, finished_at = {}, [None] * len(seqs)
    for tick in range(max(a for a, _, _ in requests) + max_ticks + config["num_inflight_batches"] + ahead):
        if not arrivals and not scheduler.has_unfinished:
            break
        while arrivals and requests[arrivals[0]][0] <= tick:
            scheduler.add(seqs[arrivals[0]])
            age[seqs[arrivals[0]].request_id] = len(add_order)
            add_order.append(arrivals.popleft())
        for _, index in [a for a in aborts if a[0] == tick]:
            if index in add_order and scheduler.abort(f"r{index}"):
                aborted.add(index)
        while len(inflight) < config["num_inflight_batches"] + ahead:
            running = list(scheduler.running)
            batch = scheduler.schedule(scheduler.config.num_inflight_batches, ahead=ahead)
            for victim in (s for s in running if s.status is SequenceStatus.WAITING):
                assert any(age[s.request_id] < age[victim.request_id] for s in scheduler.running), (
                    f"{victim.request_id} was preempted, and no older sequence is running")
            if batch is None:
                break
            busy = {item.seq.request_id: item.step for b in inflight for item in b.items}
            names = [item.seq.request_id for item in batch.items]
            newest = {item.seq.request_id: item.step for item in inflight[-1].items} if inflight else {}
            for item in batch.items:
                if item.step.token_ids == (PENDING_TOKEN,):  # a step ahead of its sampling step, the newest
                    step, previous = item.step, newest[item.seq.request_id]
                    assert ahead and previous.sample
                    assert sum(item.seq in (i.seq for i in b.items) for b in inflight) == 1
                    assert step.start_position == previous.start_position + len(previous.token_ids)
                    assert step.sample and step.num_generated == len(item.seq.output_token_ids) + 1
                    assert step.num_generated < item.seq.max_tokens
            ahead_names = {i.seq.request_id for i in batch.items if i.step.token_ids == (PENDING_TOKEN,)}
            assert len(set(names)) == len(names) and not set(busy) & (set(names) - ahead_names), (
                "micro-batches overlap")
            assert batch.num_tokens <= config["max_num_batched_tokens"]
            assert scheduler.num_running <= config["max_num_seqs"]
            for item in batch.items:
                step, seq = item.step, item.seq
                if step.token_ids == (PENDING_TOKEN,):
                    continue
                assert step.start_position == seq.num_computed_tokens and step.num_generated == len(
                    seq.output_token_ids)
                end = step.start_position + len(step.token_ids)
                assert len(step.token_ids) >= 1
                assert list(step.token_ids) == seq.all_token_ids[step.start_position:end]
                assert step.sample == (end == seq.num_tokens)
                if int(seq.request_id[1:]) not in first_scheduled:
                    first_scheduled.append(int(seq.request_id[1:]))
            inflight.append(batch)
        assert inflight or not scheduler.has_unfinished, "the pipeline idles while requests are unfinished"
        if inflight:
            batch = inflight.popleft()  # the pipeline returns micro-batches in order
            refused = any(i.step.token_ids == (PENDING_TOKEN,)
                          and workers.sampled.get(i.seq.request_id, (-1,))[0] != i.step.start_position
                          for i in batch.items)
            if tick in failures or refused:
                scheduler.on_batch_failed(batch)
                workers.sampled = {}  # what a worker keeps after a failed step
            else:
                scheduler.on_batch_done(batch, workers.run(batch))
        check_blocks(scheduler, inflight)
        for i in add_order:
            if finished_at[i] is None and seqs[i].is_finished:
                finished_at[i] = tick
            assert finished_at[i] is not None or tick - requests[i][0] < max_ticks, (
                f"r{i} did not finish within {max_ticks} ticks of its arrival")
    else:
        raise AssertionError("the workload did not finish")
    assert manager.num_used == 0 and manager.num_free == manager.num_total == num_blocks
    assert first_scheduled == sorted(first_scheduled, key=add_order.index), "first scheduling is not FCFS"
    check_every_request_done(scheduler, seqs, aborted, stop_token_ids)
    return scheduler, seqs, finished_at
