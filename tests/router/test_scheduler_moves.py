"""Moving requests between two schedulers (instances): park on the source, reserve and adopt on the target, with
the paged fake workers of fakes.py carrying the KV; every token equals the unmoved run's."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.block_manager import num_blocks_for
from services.router.contracts import QueueFullError, RequestError
from services.router.scheduler import Scheduler
from services.router.sequence import Sequence, SequenceStatus
from tests.router.fakes import PagedWorkers, expected_output, make_scheduler, prompt_of, run_step, seq_of


def _copy_kv(source: PagedWorkers, target: PagedWorkers, src_ids: list[int], dst_ids: list[int]) -> None:
    for src, dst in zip(src_ids, dst_ids):
        target.cache[dst] = list(source.cache[src])


def _move(a: Scheduler, wa: PagedWorkers, b: Scheduler, wb: PagedWorkers, request_id: str) -> Sequence:
    """What services.router.instance_moves and the front's mover do, at the scheduler level."""
    assert a.moves.park(request_id)  # between steps here
    return _move_parked(a, wa, b, wb, request_id)


def _move_parked(a: Scheduler, wa: PagedWorkers, b: Scheduler, wb: PagedWorkers, request_id: str) -> Sequence:
    """Reserve, copy the KV, adopt on b; free on a."""
    seq = a.get(request_id)
    template = Sequence(request_id, list(seq.prompt_token_ids), seq.max_tokens, seq.sampling, seq.stop_token_ids)
    dst = b.moves.reserve(template, seq.num_computed_tokens)
    needed = num_blocks_for(seq.num_computed_tokens, a.block_manager.block_size)
    _copy_kv(wa, wb, seq.block_ids[:needed], dst[:needed])
    moved = b.moves.adopt(request_id, list(seq.output_token_ids), seq.num_computed_tokens)
    a.finish(request_id, SequenceStatus.FINISHED_ABORTED)  # the commit frees it on the source
    return moved


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 23), st.integers(1, 20)), min_size=1, max_size=6),
       st.lists(st.integers(0, 40), max_size=12), st.integers(2, 6))
def test_moved_requests_finish_with_their_unmoved_tokens(requests, move_at, block_size):
    """Requests decode on two schedulers; at random steps one decoding request moves to the other instance
    (either way). Outputs equal the unmoved run, no request re-prefills, every block comes back."""
    schedulers = [make_scheduler(num_blocks=256, block_size=block_size) for _ in range(2)]  # no preemption
    workers = [PagedWorkers(s.block_manager) for s in schedulers]
    for i, (length, max_tokens) in enumerate(requests):
        schedulers[0].add(seq_of(f"r{i}", prompt_of(i, length), max_tokens))
    outputs: dict[str, list[int]] = {}
    where = {f"r{i}": 0 for i in range(len(requests))}
    moves = sorted(move_at)
    for step in range(2000):
        if not any(s.has_unfinished for s in schedulers):
            break
        while moves and moves[0] <= step:
            moves.pop(0)
            decoding = sorted(r for r, at in where.items()
                              if (seq := schedulers[at].get(r)) is not None and seq in schedulers[at].running
                              and not seq.is_prefill)
            if decoding:
                request_id = decoding[step % len(decoding)]
                source = where[request_id]
                _move(schedulers[source], workers[source], schedulers[1 - source], workers[1 - source], request_id)
                where[request_id] = 1 - source
        for scheduler, worker in zip(schedulers, workers):
            batch = scheduler.schedule()
            if batch is not None:
                for update in scheduler.on_batch_done(batch, worker.run(batch)):
                    if update.finished:
                        outputs[update.seq.request_id] = list(update.seq.output_token_ids)
    for i, (length, max_tokens) in enumerate(requests):
        assert outputs[f"r{i}"] == expected_output(prompt_of(i, length), max_tokens)
    for scheduler in schedulers:
        assert scheduler.block_manager.num_used == 0 and not scheduler.moves.parked
        assert scheduler.num_preemptions == 0


def test_park_waits_for_the_step_in_flight_and_unpark_puts_it_back():
    scheduler = make_scheduler(block_size=4)
    worker = PagedWorkers(scheduler.block_manager)
    scheduler.add(seq_of("a", prompt_of(0, 5), 10))
    batch = scheduler.schedule()  # the prefill
    scheduler.on_batch_done(batch, worker.run(batch))
    batch = scheduler.schedule()  # a decode in flight
    assert scheduler.moves.park("a") is False  # parks when the step returns
    assert scheduler.schedule() is None  # not scheduled meanwhile
    scheduler.on_batch_done(batch, worker.run(batch))
    assert "a" in scheduler.moves.parked and scheduler.schedule() is None
    with pytest.raises(KeyError):
        scheduler.moves.park("nope")
    scheduler.moves.unpark("a")
    while scheduler.has_unfinished:
        batch = scheduler.schedule()
        updates = scheduler.on_batch_done(batch, worker.run(batch))
    assert list(updates[0].seq.output_token_ids) == expected_output(prompt_of(0, 5), 10)


def test_reserve_refuses_what_cannot_run_and_grows_on_a_second_call():
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_model_len=40)
    with pytest.raises(RequestError, match="cannot be the KV"):
        scheduler.moves.reserve(seq_of("a", prompt_of(0, 5), 3), 8)  # more tokens than the request ever has
    with pytest.raises(RequestError, match="context"):
        scheduler.moves.reserve(seq_of("b", prompt_of(0, 30), 20), 31)
    with pytest.raises(RequestError, match="KV blocks"):
        scheduler.moves.reserve(seq_of("f", prompt_of(0, 5), 30), 6)  # 35 tokens: 9 blocks, the pool ever has 6
    ids = scheduler.moves.reserve(seq_of("c", prompt_of(0, 5), 19), 6)
    assert len(ids) == 2 and scheduler.moves.is_moving_in("c")
    grown = scheduler.moves.reserve(seq_of("c", prompt_of(0, 5), 19), 13)
    assert grown[:2] == ids and len(grown) == 4
    assert len(scheduler.moves.reserve(seq_of("e", prompt_of(1, 5), 3), 5)) == 2
    with pytest.raises(QueueFullError):
        scheduler.moves.reserve(seq_of("c", prompt_of(0, 5), 19), 23)  # 6 blocks: 2 more, none free now
    with pytest.raises(RequestError, match="do not fit"):
        scheduler.moves.adopt("c", [1, 2, 3], 6)  # 5 + 3 tokens: 7 cached, not 6
    with pytest.raises(KeyError):
        scheduler.moves.adopt("d", [1], 5)
    scheduler.moves.adopt("c", [1, 2, 3, 4, 5, 6, 7, 8], 12)  # trims the reservation to the KV that came
    assert len(scheduler.get("c").block_ids) == 3 and scheduler.block_manager.num_used == 3 + 2


def test_a_layout_change_cancels_moves_in_progress():
    """Rebind (a switch) ends every move: a parked request runs here again, a reservation is given back."""
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    worker = PagedWorkers(scheduler.block_manager)
    scheduler.add(seq_of("out", prompt_of(0, 5), 10))
    for _ in range(2):
        batch = scheduler.schedule()
        scheduler.on_batch_done(batch, worker.run(batch))
    assert scheduler.moves.park("out")
    scheduler.moves.reserve(seq_of("in", prompt_of(1, 5), 10), 6)
    scheduler.freeze()
    scheduler.kv_layout.rebind(16)
    assert not scheduler.moves.parked and scheduler.get("in") is None and scheduler.get("out") in scheduler.running
    assert scheduler.block_manager.num_used == len(scheduler.get("out").block_ids)


def test_a_preempted_request_parks_without_kv_and_moves_by_reprefill():
    """Preempted back to the waiting queue after it generated, a request parks at once (no KV); unparked it goes
    back to the front of the queue; moved, the target re-prefills prompt + outputs and the outputs are exact."""
    a, b = make_scheduler(block_size=4), make_scheduler(block_size=4)
    wa, wb = PagedWorkers(a.block_manager), PagedWorkers(b.block_manager)
    a.add(seq_of("x", prompt_of(3, 6), 12))
    a.add(seq_of("y", prompt_of(4, 5), 12))
    for _ in range(3):
        batch = a.schedule()
        a.on_batch_done(batch, wa.run(batch))
    a.freeze()
    a.kv_layout.preempt_all()  # both lose their KV and wait, first in the queue
    a.unfreeze()
    assert a.moves.park("x") and list(a.waiting) == [a.get("y")] and a.get("x").block_ids == []
    a.moves.unpark("x")
    assert [s.request_id for s in a.waiting] == ["x", "y"]
    assert a.moves.park("x")
    seq = a.get("x")
    moved = Sequence("x", list(seq.prompt_token_ids), seq.max_tokens, seq.sampling, seq.stop_token_ids,
                     output_token_ids=list(seq.output_token_ids))
    b.add(moved)  # what InstanceMoves.admit does for a move without KV
    a.finish("x", SequenceStatus.FINISHED_ABORTED)
    outputs = {}
    for scheduler, worker in ((a, wa), (b, wb)):
        while scheduler.has_unfinished:
            batch = scheduler.schedule()
            for update in scheduler.on_batch_done(batch, worker.run(batch)):
                if update.finished:
                    outputs[update.seq.request_id] = list(update.seq.output_token_ids)
    assert outputs == {"x": expected_output(prompt_of(3, 6), 12), "y": expected_output(prompt_of(4, 5), 12)}
    assert a.block_manager.num_used == 0 and b.block_manager.num_used == 0


def test_a_request_prefilling_again_after_a_preemption_parks_between_its_chunks():
    """The front moves a request it has seen generate; preempted, the source prefills its prompt and outputs again,
    in chunks of 4 tokens here. Parked with that step in flight, it parks when the step returns: without the KV of
    a chunk that did not complete the prefill (it moves by re-prefill), with it once the prefill completed (it moves
    its KV). Outputs are the unmoved run's either way, and every block comes back."""
    outputs = {}
    for park_after_chunks, moves_kv in ((1, False), (2, False), (3, True)):
        a, b = make_scheduler(block_size=4, max_num_batched_tokens=4), make_scheduler(block_size=4)
        wa, wb = PagedWorkers(a.block_manager), PagedWorkers(b.block_manager)
        a.add(seq_of("x", prompt_of(3, 10), 12))
        for _ in range(5):  # three chunks of prompt (the last samples a token), then two decodes
            run_step(a, wa)
        a.freeze()
        a.kv_layout.preempt_all()
        a.unfreeze()
        seq = a.get("x")
        assert seq.num_computed_tokens == 0 and len(seq.output_token_ids) == 3  # 10 + 2 to prefill again: 3 chunks
        for _ in range(park_after_chunks - 1):
            run_step(a, wa)
        batch = a.schedule()  # the next chunk, in flight
        assert batch.items[0].seq is seq and seq.is_prefill
        assert a.moves.park("x") is False and a.schedule() is None
        a.on_batch_done(batch, wa.run(batch))
        assert "x" in a.moves.parked
        assert (seq.num_computed_tokens > 0) is moves_kv and bool(seq.block_ids) is moves_kv
        assert a.block_manager.num_used == len(seq.block_ids)
        if moves_kv:
            _move_parked(a, wa, b, wb, "x")
        else:
            b.add(Sequence("x", list(seq.prompt_token_ids), seq.max_tokens, seq.sampling, seq.stop_token_ids,
                           output_token_ids=list(seq.output_token_ids)))
            a.finish("x", SequenceStatus.FINISHED_ABORTED)
        while b.has_unfinished:
            for update in run_step(b, wb)[1]:
                if update.finished:
                    outputs[park_after_chunks] = list(update.seq.output_token_ids)
        assert a.block_manager.num_used == 0 and b.block_manager.num_used == 0
        assert b.get("x") is None or b.get("x").num_preemptions == 0
    assert outputs == {n: expected_output(prompt_of(3, 10), 12) for n in (1, 2, 3)}


def test_a_request_moves_before_its_first_token():
    """Parked in the waiting queue (not started), or with a chunk of its first prefill in flight that does not
    complete it, a request parks without KV and starts on the target as a new one; with the last chunk in flight it
    parks with its KV and first token and moves them. Outputs are the unmoved run's, every block comes back."""
    prompt = prompt_of(5, 10)  # 3 chunks of at most 4 tokens
    for chunks_before, moves_kv in ((None, False), (0, False), (1, False), (2, True)):
        a, b = make_scheduler(block_size=4, max_num_batched_tokens=4), make_scheduler(block_size=4)
        wa, wb = PagedWorkers(a.block_manager), PagedWorkers(b.block_manager)
        a.add(seq_of("x", prompt, 9))
        seq = a.get("x")
        if chunks_before is None:
            assert a.moves.park("x") and list(a.waiting) == [] and not seq.block_ids
        else:
            for _ in range(chunks_before):
                run_step(a, wa)
            batch = a.schedule()
            assert a.moves.park("x") is False and a.schedule() is None
            a.on_batch_done(batch, wa.run(batch))
        assert "x" in a.moves.parked and bool(seq.block_ids) is moves_kv and len(seq.output_token_ids) == int(moves_kv)
        if moves_kv:
            _move_parked(a, wa, b, wb, "x")
        else:
            b.add(Sequence("x", list(seq.prompt_token_ids), seq.max_tokens, seq.sampling, seq.stop_token_ids))
            a.finish("x", SequenceStatus.FINISHED_ABORTED)
        while b.has_unfinished:
            _, updates = run_step(b, wb)
        assert list(updates[0].seq.output_token_ids) == expected_output(prompt, 9), chunks_before
        assert a.block_manager.num_used == 0 and b.block_manager.num_used == 0
    # A failed move puts a request parked from the queue back at its head.
    a = make_scheduler(block_size=4)
    a.add(seq_of("y", prompt, 5))
    a.add(seq_of("z", prompt, 5))
    assert a.moves.park("z")
    a.moves.unpark("z")
    assert [s.request_id for s in a.waiting] == ["z", "y"]
