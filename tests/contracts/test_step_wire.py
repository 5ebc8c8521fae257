"""The step contract's protobuf round trip: every field of a step survives to_pb / from_pb, set or left out."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from services.contracts.step import (GREEDY, PENDING_TOKEN, SamplingParams, SequenceOutput, SequenceStep, StepBatch,
                                  StepOutput, TokenLogprob)
from services.rpc.reconfig.v1 import worker_pb2

ids = st.lists(st.integers(0, 50_000), max_size=6).map(tuple)
sampling = st.one_of(st.just(GREEDY), st.builds(
    SamplingParams, temperature=st.sampled_from([0.0, 0.5, 1.25]), top_p=st.sampled_from([1.0, 0.75]),
    top_k=st.integers(0, 40), seed=st.one_of(st.none(), st.integers(0, 2**31)),
    presence_penalty=st.sampled_from([0.0, 0.5]), frequency_penalty=st.sampled_from([0.0, -0.25]),
    repetition_penalty=st.sampled_from([1.0, 1.5]),
    logit_bias=st.lists(st.tuples(st.integers(0, 300), st.sampled_from([-2.0, 1.5])), max_size=2,
                        unique_by=lambda t: t[0]).map(lambda pairs: tuple(sorted(pairs))),
    num_logprobs=st.one_of(st.none(), st.integers(0, 5))))
steps = st.builds(
    SequenceStep, request_id=st.text(min_size=1, max_size=12), token_ids=st.one_of(ids, st.just((PENDING_TOKEN,))),
    start_position=st.integers(0, 4096), block_table=ids, sampling=sampling, sample=st.booleans(),
    return_logits=st.booleans(), num_generated=st.integers(0, 512),
    output_token_counts=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 9)), max_size=4).map(tuple),
    distinct_prompt_token_ids=ids, suppressed_token_ids=ids, prompt_logprob_token_ids=ids, dp_rank=st.integers(0, 7))


@given(st.lists(steps, max_size=4), st.integers(0, 2**40), st.integers(0, 9))
def test_every_field_of_a_step_survives_the_wire(sequences, step_id, commit_expert_map):
    batch = StepBatch(step_id, tuple(sequences), commit_expert_map)
    wire = worker_pb2.StepRequest.FromString(batch.to_pb().SerializeToString())
    assert StepBatch.from_pb(wire) == batch
    for sent in wire.sequences:  # what is left at its default is not sent at all
        assert sent.HasField("sampling") == (SequenceStep.from_pb(sent).sampling != GREEDY)


logprobs = st.builds(TokenLogprob, token_id=st.integers(0, 300), logprob=st.sampled_from([-0.5, -3.25]),
                     top=st.lists(st.tuples(st.integers(0, 300), st.sampled_from([-0.5, -1.0])), max_size=2)
                     .map(tuple))
outputs = st.builds(SequenceOutput, request_id=st.text(min_size=1, max_size=12), token_id=st.integers(-1, 50_000),
                    logits=st.binary(max_size=8), logprob=st.one_of(st.none(), logprobs),
                    prompt_logprobs=st.lists(logprobs, max_size=3).map(tuple))


@given(st.lists(outputs, max_size=4), st.text(max_size=8), st.sampled_from([0.0, 0.125]))
def test_every_field_of_a_step_result_survives_the_wire(results, error, seconds):
    output = StepOutput(5, 2, tuple(results), error, seconds, seconds / 2, seconds / 4)
    assert StepOutput.from_pb(worker_pb2.StepResult.FromString(output.to_pb().SerializeToString())) == output


def test_the_fields_come_back_in_order():
    """from_pb builds a step positionally: every field of the dataclass is one of its arguments, in this order."""
    assert [f.name for f in dataclasses.fields(SequenceStep)] == [
        "request_id", "token_ids", "start_position", "block_table", "sampling", "sample", "return_logits",
        "num_generated", "output_token_counts", "distinct_prompt_token_ids", "suppressed_token_ids",
        "prompt_logprob_token_ids", "dp_rank"]
