"""Token sampling on the last pipeline stage: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from services.worker.step import SamplingParams

_SEED_STRIDE = 1_000_003  # mixes (seed, position) into one generator seed


def sample(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int]) -> list[int]:
    """logits [N, vocab] float32 -> one token id per row."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.is_greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if 0.0 < p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            drop = cumulative - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest prefix reaching top_p
            row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        generator = None
        if p.seed is not None:
            generator = torch.Generator().manual_seed((p.seed * _SEED_STRIDE + num_generated[i]) % (1 << 63))
        tokens[i] = int(torch.multinomial(row.softmax(-1), 1, generator=generator))
    return tokens
