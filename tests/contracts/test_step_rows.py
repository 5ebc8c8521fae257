"""The delta form of steps: whatever the router's requests do (prefill in chunks, decode, cross blocks, go ahead,
take penalties, get preempted, end, reuse ids), the worker reads back exactly the steps the router meant; a decode
step weighs the same at any context; a worker missing a row refuses the step; a new epoch sends everything again."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.contracts.step import GREEDY, PENDING_TOKEN, SamplingParams, SequenceOutput, SequenceStep, StepOutput
from services.contracts.step_rows import RowEncoder, RowTable, UnknownRow, rows_result
from services.rpc.reconfig.v1 import worker_pb2

BLOCK_SIZE = 4
SAMPLINGS = (GREEDY, SamplingParams(temperature=0.75, seed=5), SamplingParams(temperature=1.0, top_k=3))


class Request:
    """A request as the router schedules it: position, blocks, tokens generated."""

    def __init__(self, request_id: str, prompt_len: int, sampling: SamplingParams, blocks) -> None:
        self.request_id, self.prompt_len, self.sampling, self._blocks = request_id, prompt_len, sampling, blocks
        self.position, self.generated, self.table = 0, 0, ()

    def next_step(self, chunk: int, ahead: bool, penalties: bool, dp_rank: int) -> SequenceStep:
        if self.position < self.prompt_len:  # a prefill chunk (the last one samples)
            count = min(chunk, self.prompt_len - self.position)
            tokens = tuple(range(self.position, self.position + count))
        else:
            count, tokens = 1, (PENDING_TOKEN if ahead else 1000 + self.generated,)
        end = self.position + count
        while len(self.table) * BLOCK_SIZE < end:
            self.table += (next(self._blocks),)
        sample = end >= self.prompt_len
        step = SequenceStep(self.request_id, tokens, self.position, self.table, self.sampling, sample,
                            num_generated=self.generated, dp_rank=dp_rank,
                            output_token_counts=((7, self.generated),) if penalties and self.generated else ())
        self.position, self.generated = end, self.generated + sample
        return step

    def preempt(self) -> None:
        self.position, self.generated, self.table = 0, 0, ()  # its KV is gone: it prefills again, in new blocks


actions = st.lists(st.tuples(
    st.sampled_from(["step", "step", "step", "step", "new", "end", "preempt", "reset"]),
    st.integers(0, 5), st.integers(1, 9), st.booleans(), st.booleans(), st.integers(0, 1)), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(actions)
def test_the_worker_reads_back_exactly_the_steps_sent(script):
    encoder, table = RowEncoder(), RowTable()
    ids = iter(range(10**6))
    requests: dict[str, Request] = {}
    for number, (action, pick, size, flag, other_flag, dp_rank) in enumerate(script):
        names = sorted(requests)
        if action == "new" or not names:
            name = f"r{pick}"  # ids are reused once their request ended
            if name not in requests:
                requests[name] = Request(name, size, SAMPLINGS[pick % len(SAMPLINGS)], ids)
            continue
        chosen = names[pick % len(names)]
        if action == "end":
            del requests[chosen]
            encoder.forget(chosen)
        elif action == "preempt":
            requests[chosen].preempt()
        elif action == "reset":
            encoder.reset()
        else:
            batch = [r.next_step(size, flag, other_flag and r.request_id == chosen, dp_rank if r.request_id == chosen
                                 else 0) for r in requests.values()]
            wire = worker_pb2.StepRequest.FromString(encoder.encode(number, batch).SerializeToString())
            assert table.steps(wire) == tuple(batch)
            assert table.num_rows == encoder.num_rows


def _decode_batch(encoder: RowEncoder, context: int, step_id: int) -> worker_pb2.StepRequest:
    num_blocks = -(-(context + 1) // BLOCK_SIZE)
    return encoder.encode(step_id, [
        SequenceStep(f"r{i}", (5,), context, tuple(range(i * 1000, i * 1000 + num_blocks)), num_generated=context - 60)
        for i in range(64)])


def test_a_decode_step_weighs_the_same_at_any_context():
    sizes = {}
    for context in (128, 4096):
        encoder = RowEncoder()
        first = _decode_batch(encoder, context, 1)
        second = _decode_batch(encoder, context + 1, 2)
        assert len(first.sequences) == 64 and not second.sequences  # in full once, then only what changed
        sizes[context] = second.ByteSize()
    assert sizes[128] == sizes[4096] < 1400  # 64 rows: 17 bytes each and the header


def test_a_missing_row_refuses_the_step_and_a_new_epoch_sends_every_row_again():
    encoder, table = RowEncoder(), RowTable()
    table.steps(_decode_batch(encoder, 40, 1))
    stale = RowTable()  # a worker that did not see the first step (a restarted one)
    with pytest.raises(UnknownRow, match="does not hold"):
        stale.steps(_decode_batch(encoder, 41, 2))
    encoder.reset()
    again = _decode_batch(encoder, 42, 3)
    assert len(again.sequences) == 64
    assert stale.steps(again) == table.steps(again)


def test_results_carry_the_tokens_packed_and_only_the_extras_in_full():
    steps = tuple(SequenceStep(f"r{i}", (5,), 9, (0, 1, 2)) for i in range(4))
    extra = SequenceOutput("r2", 17, logits=b"\x00\x00\x80?")
    output = StepOutput(3, 0, (SequenceOutput("r0", 11), SequenceOutput("r1", -1), extra), compute_seconds=0.5)
    result = worker_pb2.StepResult.FromString(rows_result(output, steps).SerializeToString())
    assert [r.request_id for r in result.results] == ["r2"]
    back = StepOutput.from_pb(result)
    assert back.tokens == (11, -1, 17, -1) and back.compute_seconds == 0.5
    assert back.sampled([s.request_id for s in steps]) == {"r0": 11, "r2": 17}
    assert back.expanded([s.request_id for s in steps]).outputs == (SequenceOutput("r0", 11), extra)
