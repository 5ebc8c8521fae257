"""Sampling: greedy is argmax; seeded sampling does not depend on the batch; top-k/top-p restrict the support."""

from __future__ import annotations

import torch

from services.worker.sampler import sample
from services.worker.step import GREEDY, SamplingParams


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
