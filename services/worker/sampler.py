"""Token sampling on the last pipeline stage: greedy, temperature, top-k, top-p, per-request seeds; the step's
outputs (tokens, logprobs) from its logits."""

from __future__ import annotations

import torch

from services.contracts.step import SamplingParams, SequenceOutput, SequenceStep
from services.worker.logits_processor import process_logits
from services.worker.logprobs import token_logprobs

_SEED_STRIDE = 1_000_003  # mixes (seed, position) into one generator seed


def sample(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int]) -> list[int]:
    """logits [N, vocab] float32 -> one token id per row."""
    tokens = logits.max(dim=-1).indices.tolist()  # argmax's (the first maximum), ~3x faster on CPU
    for i, p in enumerate(params):
        if p.is_greedy:
            continue
        # Options that overflow float32 (a tiny temperature after a tiny repetition penalty: +inf; -inf times a
        # penalty that underflowed to 0: NaN) must not reach the softmax: an infinite logit is the largest finite
        # one, a NaN one is masked, and a row with nothing left keeps the argmax.
        row = (logits[i] / p.temperature).nan_to_num(nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
        if not torch.isfinite(row).any():
            continue
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


def sample_outputs(steps: list[SequenceStep], wanted: list[int], logits: torch.Tensor,
                   num_prompt_rows: int) -> list[SequenceOutput]:
    """The outputs of one step on the last stage (TP rank 0).

    logits [num_prompt_rows + len(wanted), vocab] float32: first the positions whose prompt logprobs were asked
    (steps in order, len(step.prompt_logprob_token_ids) rows each), then the last position of each step in
    `wanted` (those that sample or return logits). Tokens are drawn from the processed logits; logprobs come from
    the raw ones, all rows that asked in one log_softmax.
    """
    last_logits = logits[num_prompt_rows:]
    chosen = [steps[i] for i in wanted]
    tokens = sample(process_logits(last_logits, chosen), [s.sampling for s in chosen],
                    [s.num_generated for s in chosen])
    prompt_steps = [s for s in steps if s.prompt_logprob_token_ids]
    asking = [j for j, s in enumerate(chosen) if s.sample and s.sampling.num_logprobs is not None]
    rows = torch.cat([logits[:num_prompt_rows], last_logits[asking]])
    targets = [t for s in prompt_steps for t in s.prompt_logprob_token_ids] + [tokens[j] for j in asking]
    num_top = ([s.sampling.num_logprobs or 0 for s in prompt_steps for _ in s.prompt_logprob_token_ids]
               + [chosen[j].sampling.num_logprobs or 0 for j in asking])
    computed = iter(token_logprobs(rows, targets, num_top))
    prompt_logprobs = {s.request_id: tuple(next(computed) for _ in s.prompt_logprob_token_ids) for s in prompt_steps}
    sampled_logprobs = {chosen[j].request_id: next(computed) for j in asking}
    outputs = [
        SequenceOutput(
            s.request_id,
            token if s.sample else -1,
            last_logits[j].numpy().tobytes() if s.return_logits else b"",
            sampled_logprobs.get(s.request_id),
            prompt_logprobs.pop(s.request_id, ()),
        )
        for j, (s, token) in enumerate(zip(chosen, tokens, strict=True))
    ]
    # A prefill chunk that neither samples nor returns logits still returns its prompt logprobs.
    outputs += [SequenceOutput(request_id, -1, prompt_logprobs=values) for request_id, values in prompt_logprobs.items()]
    return outputs
