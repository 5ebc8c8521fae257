"""Sampling: greedy is argmax; seeded sampling does not depend on the batch; top-k/top-p restrict the support."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.logits_processor import process_logits
from services.worker.logprobs import token_logprobs
from services.worker.sampler import sample, sample_outputs, uniform
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


def test_draws_follow_the_distribution_temperature_top_k_and_top_p_leave():
    """4,000 seeded draws of one row: each token's frequency within 4 standard deviations of its probability under
    the temperature, top-k and top-p asked (and zero outside them)."""
    logits = torch.log(torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04]))
    draws = 4000
    cases = [(SamplingParams(temperature=1.0), logits.softmax(-1)),
             (SamplingParams(temperature=2.0), (logits / 2).softmax(-1)),
             (SamplingParams(temperature=1.0, top_k=3), torch.cat([logits[:3].softmax(-1), torch.zeros(3)])),
             (SamplingParams(temperature=1.0, top_p=0.75), torch.cat([logits[:3].softmax(-1), torch.zeros(3)])),
             (SamplingParams(temperature=1.0, top_k=4, top_p=0.6), torch.cat([logits[:2].softmax(-1),
                                                                              torch.zeros(4)]))]
    for params, expected in cases:
        seeded = [dataclasses.replace(params, seed=s) for s in range(draws)]
        tokens = sample(logits.expand(draws, -1), seeded, [0] * draws)
        counts = torch.bincount(torch.tensor(tokens), minlength=6).double() / draws
        spread = (expected.double() * (1 - expected.double()) / draws).sqrt()
        assert ((counts - expected.double()).abs() <= 4 * spread + 1e-9).all(), (params, counts, expected)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 0.5, 1.0, 3.0]), st.sampled_from([0, 1, 5, 40]),
                          st.sampled_from([1.0, 0.9, 0.3]), st.one_of(st.none(), st.integers(0, 2**63 - 1)),
                          st.integers(0, 500)), min_size=1, max_size=12),
       st.integers(0, 2**16))
def test_a_seeded_rows_token_is_the_one_it_draws_alone(rows, seed):
    """Whatever else a step samples (greedy, temperature, top-k, top-p, other seeds, rows without one), a greedy
    or seeded row draws what it draws alone: the step's tokens depend on each row's logits and parameters only."""
    logits = torch.randn(len(rows), 40, generator=torch.Generator().manual_seed(seed)) * 3
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s) for t, k, p, s, _ in rows]
    generated = [n for *_, n in rows]
    together = sample(logits, params, generated)
    for i, p in enumerate(params):
        if p.draws_alike:
            assert together[i] == sample(logits[i:i + 1], [p], [generated[i]])[0]


def test_top_p_among_the_largest_logits_keeps_what_the_whole_sort_keeps():
    """A CPU's top-p looks for the prefix among the 1,024 largest logits first: the same tokens kept as the sort of
    the whole vocabulary, for peaked rows (found there) and flat ones (not: those take the sort), -inf rows too."""
    from services.worker.sampler import _top_p, _top_p_sorted

    generator = torch.Generator().manual_seed(4)
    rows = torch.cat([torch.randn(3, 5000, generator=generator) * 6,  # peaked: the prefix lies among the largest
                      torch.randn(2, 5000, generator=generator) * 0.1,  # flat: 1,024 of 5,000 hold ~20% of the mass
                      torch.full((1, 5000), float("-inf"))])
    top_p = [0.9, 0.5, 0.99, 0.9, 0.5, 0.9]
    expected = _top_p_sorted(rows, torch.tensor(top_p)[:, None])
    got = _top_p(rows, top_p)
    assert torch.equal(torch.isfinite(got), torch.isfinite(expected))
    assert 1 < int(torch.isfinite(got[0]).sum()) < 1024 and int(torch.isfinite(got[3]).sum()) > 1024


def test_a_seeds_uniforms_are_fixed_numbers():
    """The uniforms are integer hashes of (seed, position): the same on every host and device, release after
    release (a change here changes every seeded request's tokens)."""
    assert [round(uniform(s, n), 6) for s, n in ((0, 0), (42, 3), (2**63 - 1, 7))] == UNIFORMS
    assert 0 < uniform(None, 0) < 1


UNIFORMS = [0.883311, 0.271446, 0.326124]


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
