"""Sampling: greedy is argmax; seeded sampling does not depend on the batch; top-k/top-p restrict the support."""

from __future__ import annotations

import math

import pytest
import torch

from services.worker.logits_processor import process_logits
from services.worker.logprobs import token_logprobs
from services.worker.sampler import sample, sample_outputs
from services.contracts.step import GREEDY, SamplingParams, SequenceStep


def test_greedy_is_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    assert sample(logits, [GREEDY] * 5, [0] * 5) == logits.argmax(-1).tolist()


def test_seeded_sampling_is_batch_independent_and_position_keyed():
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(1, 50, generator=gen)
    params = SamplingParams(temperature=1.0, seed=42)
    alone = [sample(row, [params], [step])[0] for step in range(20)]
    others = torch.randn(3, 50, generator=gen)
    batched = [sample(torch.cat([others, row]), [SamplingParams(temperature=1.0)] * 3 + [params],
                      [0, 0, 0, step])[3] for step in range(20)]
    assert alone == batched
    assert len(set(alone)) > 1  # different positions draw different tokens


def test_top_k_one_is_greedy_and_top_k_restricts_support():
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(3))
    assert sample(logits, [SamplingParams(temperature=5.0, top_k=1, seed=0)], [0]) == logits.argmax(-1).tolist()
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    drawn = {sample(logits, [SamplingParams(temperature=10.0, top_k=3, seed=s)], [0])[0] for s in range(60)}
    assert drawn <= allowed and len(drawn) > 1


def test_top_p_keeps_smallest_prefix_reaching_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    drawn = {sample(logits, [SamplingParams(temperature=1.0, top_p=0.7, seed=s)], [0])[0] for s in range(80)}
    assert drawn == {0, 1}


def test_a_tiny_temperature_samples_greedily_instead_of_nan():
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(5))
    tiny = SamplingParams(temperature=1e-40, seed=1)  # logits / 1e-40 would overflow to inf, softmax to NaN
    assert tiny.is_greedy
    assert sample(logits, [tiny, tiny], [0, 0]) == logits.argmax(-1).tolist()


def test_options_that_overflow_float32_still_draw_a_token():
    """Found by the HTTP fuzzer: a repetition penalty of 5e-300 (> 0, so valid) is 0 in float32, and dividing by it
    gave inf logits; a tiny temperature overflows finite ones. The step failed with a NaN softmax."""
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(9))
    step = SequenceStep("r", (1,), 5, (0,), SamplingParams(temperature=1e-5, repetition_penalty=5e-300, seed=3),
                        output_token_counts=((4, 2), (7, 1)), distinct_prompt_token_ids=(1, 2),
                        suppressed_token_ids=(0,))
    processed = process_logits(logits, [step])
    [token] = sample(processed, [step.sampling], [0])
    assert 0 < token < 40
    everything_masked = torch.full((1, 40), float("-inf"))
    assert 0 <= sample(everything_masked, [SamplingParams(temperature=1.0, seed=1)], [0])[0] < 40


# ---- logits processing: bias, min_tokens suppression, penalties -------------------------------------------------

def _reference_processed(row: list[float], step: SequenceStep) -> list[float]:
    """The formulas, one token at a time: bias, suppression, then repetition (HF: divide positive, multiply
    negative, for tokens in prompt or output), frequency (per occurrence) and presence (once) on the output."""
    s = step.sampling
    counts = dict(step.output_token_counts)
    out = list(row)
    for token, bias in s.logit_bias:
        out[token] += bias
    for token in step.suppressed_token_ids:
        out[token] = -math.inf
    for token in range(len(out)):
        if token in counts or token in step.distinct_prompt_token_ids:
            out[token] = out[token] / s.repetition_penalty if out[token] > 0 else out[token] * s.repetition_penalty
        if token in counts:
            out[token] -= s.frequency_penalty * counts[token] + s.presence_penalty
    return out


def test_penalties_bias_and_suppression_match_the_formulas():
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(7)) * 3
    steps = [
        SequenceStep("plain", (1,), 0, (0,)),
        SequenceStep("all", (1,), 0, (0,), SamplingParams(
            presence_penalty=0.5, frequency_penalty=-0.7, repetition_penalty=1.3, logit_bias=((2, 4.0), (11, -9.5))),
            output_token_counts=((0, 3), (4, 1), (7, 2)), distinct_prompt_token_ids=(1, 4, 9),
            suppressed_token_ids=(5,)),
        SequenceStep("repeat", (1,), 0, (0,), SamplingParams(repetition_penalty=0.6),
                     output_token_counts=((3, 1),), distinct_prompt_token_ids=(0, 10)),
        SequenceStep("frequency", (1,), 0, (0,), SamplingParams(frequency_penalty=2.0, presence_penalty=-2.0),
                     output_token_counts=((6, 4),)),
    ]
    processed = process_logits(logits, steps)
    for i, step in enumerate(steps):
        expected = torch.tensor(_reference_processed(logits[i].tolist(), step))
        torch.testing.assert_close(processed[i], expected, atol=1e-5, rtol=0)
    assert torch.equal(processed[0], logits[0])
    assert process_logits(logits, steps[:1]) is logits  # nothing to process: no copy


def test_a_huge_logit_bias_forces_a_token_and_suppression_forbids_one():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(2))
    forced = SamplingParams(temperature=1.0, seed=4, logit_bias=((17, 100.0),))
    steps = [SequenceStep("a", (1,), 0, (0,), forced), SequenceStep("b", (1,), 0, (0,), GREEDY,
                                                                 suppressed_token_ids=(int(logits[1].argmax()),))]
    outputs = sample_outputs(steps, [0, 1], logits, 0)
    assert outputs[0].token_id == 17
    assert outputs[1].token_id == int(logits[1].topk(2).indices[1])


def test_logprobs_are_raw_and_only_rows_that_asked_get_them():
    """Raw logprobs: the log_softmax of the logits before bias and temperature; top-k ids best first."""
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(9))
    expected = torch.log_softmax(logits, -1)
    biased = SamplingParams(temperature=0.5, seed=1, logit_bias=((3, 50.0),), num_logprobs=4)
    steps = [
        SequenceStep("prompt", (1, 2, 3), 0, (0,), SamplingParams(num_logprobs=2), sample=False,
                     prompt_logprob_token_ids=(9, 30)),
        SequenceStep("none", (1,), 0, (0,)),
        SequenceStep("biased", (1,), 0, (0,), biased),
    ]
    outputs = {o.request_id: o for o in sample_outputs(steps, [1, 2], logits[:4], 2)}  # rows 0-1: prompt, 2-3: last
    assert outputs["none"].logprob is None and outputs["none"].prompt_logprobs == ()
    chosen = outputs["biased"]
    assert chosen.token_id == 3
    assert chosen.logprob.logprob == pytest.approx(expected[3, 3].item(), abs=1e-6)
    assert [t for t, _ in chosen.logprob.top] == expected[3].topk(4).indices.tolist()
    prompt = outputs["prompt"].prompt_logprobs
    assert outputs["prompt"].token_id == -1
    assert [(p.token_id, round(p.logprob, 5)) for p in prompt] == [
        (9, round(expected[0, 9].item(), 5)), (30, round(expected[1, 30].item(), 5))]
    assert [len(p.top) for p in prompt] == [2, 2]


def test_token_logprobs_without_alternatives():
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(1))
    values = token_logprobs(logits, [4, 6], [0, 0])
    assert [v.top for v in values] == [(), ()]
    assert values[1].logprob == pytest.approx(torch.log_softmax(logits[1], -1)[6].item(), abs=1e-6)
