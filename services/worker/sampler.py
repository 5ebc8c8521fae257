"""Token sampling on the last pipeline stage: greedy, temperature, top-k, top-p, per-request seeds; the step's
outputs (tokens, logprobs) from its logits.

Every row of a step is drawn at once, in tensor ops on the logits' device (`sample_tensor`): no loop over the rows
and no host synchronisation, so a GPU worker samples on the device whatever the temperature (model_runner.py).
Each row draws by inverse transform: one uniform number u, the first token whose cumulative probability (in vocab
order) passes u times the row's total. u comes from the request's seed and the position it samples
(`uniform`: integer hashing on the host, the same on every device and in every batch), or, for a request without a
seed, from the host's random generator. A row's token therefore depends on its own logits and parameters alone:
seeded sampling does not depend on the batch, the layout or the worker that draws it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from services.contracts.step import SamplingParams, SequenceOutput, SequenceStep
from services.model.device_io import to_device
from services.worker.logits_processor import process_logits
from services.worker.logprobs import token_logprobs

_SEED_STRIDE = 1_000_003  # mixes (seed, position) into one key
_M64 = (1 << 64) - 1
_UNIFORM_BITS = 24  # float32 holds every multiple of 2^-24 in (0, 1) exactly
_CANDIDATES = 1024  # top-p on a CPU: the largest logits its prefix is looked for among first


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers whose outputs look independent."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def uniform(seed: int | None, position: int) -> float:
    """The uniform number in (0, 1) a row draws by: a hash of (seed, position) for a seeded request, else random."""
    if seed is None:
        bits = random.getrandbits(_UNIFORM_BITS)
    else:
        bits = _mix64((seed * _SEED_STRIDE + position + 0x9E3779B97F4A7C15) & _M64) >> (64 - _UNIFORM_BITS)
    return (bits + 0.5) / (1 << _UNIFORM_BITS)


def _top_k(row: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Rows [R, V] with the logits below each row's k-th largest at -inf (ties with it kept): one torch.topk of
    the largest k asked, no sort of the vocabulary."""
    values = torch.topk(row, max(top_k), dim=-1).values  # [R, k_max], descending
    kth = values.gather(1, to_device([k - 1 for k in top_k], row.device)[:, None])
    return row.masked_fill(row < kth, float("-inf"))


def _top_p(row: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Rows [R, V] (top-k already applied) with all but the smallest prefix, by decreasing probability, whose mass
    reaches each row's p at -inf (the largest logit always stays: no mass comes before it). On a CPU, where the
    sort of a vocabulary is most of a step's sampling (2.2 ms a row at 49k tokens), rows whose prefix lies among
    their _CANDIDATES largest logits (nearly all of a trained model's) take those from torch.topk instead."""
    p = to_device(top_p, row.device, torch.float32)[:, None]
    if row.device.type == "cpu" and row.shape[1] > _CANDIDATES:
        values, ids = torch.topk(row, _CANDIDATES, dim=-1)  # descending
        probs = (values - torch.logsumexp(row, dim=-1, keepdim=True)).exp()
        cumulative = probs.cumsum(-1)
        keep = torch.zeros_like(row, dtype=torch.bool).scatter_(1, ids, cumulative - probs < p)
        kept = row.masked_fill(~keep, float("-inf"))
        short = (~(cumulative[:, -1:] >= p)).squeeze(1).nonzero().squeeze(1)  # (a NaN row too): the whole sort
        if not len(short):  # (the host's own tensors: no device to wait for)
            return kept
        return kept.index_copy(0, short, _top_p_sorted(row.index_select(0, short), p.index_select(0, short)))
    return _top_p_sorted(row, p)


def _top_p_sorted(row: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    ordered, order = torch.sort(row, dim=-1, descending=True, stable=True)
    probs = ordered.softmax(-1)
    drop = probs.cumsum(-1) - probs >= p
    return row.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), float("-inf"))


def _restrict(row: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Rows [R, V] (the drawn rows' tempered logits) with what top-k, then top-p, leave out at -inf."""
    vocab = row.shape[1]
    top_k = [j for j, p in enumerate(params) if 0 < p.top_k < vocab]
    if top_k:
        row = _on_rows(row, top_k, lambda part: _top_k(part, [params[j].top_k for j in top_k]))
    top_p = [j for j, p in enumerate(params) if 0.0 < p.top_p < 1.0]
    if top_p:
        row = _on_rows(row, top_p, lambda part: _top_p(part, [params[j].top_p for j in top_p]))
    return row


def _on_rows(x: torch.Tensor, rows: list[int], fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x with its rows `rows` replaced by fn of them (fn of x itself where they are all of its rows)."""
    if len(rows) == x.shape[0]:
        return fn(x)
    at = to_device(rows, x.device)
    return x.index_copy(0, at, fn(x.index_select(0, at)))


def sample_tensor(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int],
                  greedy: torch.Tensor | None = None) -> torch.Tensor:
    """logits [N, vocab] float32 -> one token id per row [N] int64, on the logits' device, without waiting for it.
    A seed is keyed by the row's num_generated. greedy: the rows' argmax, where already drawn (a decode graph's)."""
    if greedy is None:
        greedy = logits.max(dim=-1).indices  # argmax's (the first maximum)
    drawn = [i for i, p in enumerate(params) if not p.is_greedy]
    if not drawn:
        return greedy
    device, vocab = logits.device, logits.shape[1]
    every = len(drawn) == len(params)
    at_drawn = None if every else to_device(drawn, device)
    rows = logits if every else logits.index_select(0, at_drawn)
    temperatures = to_device([params[i].temperature for i in drawn], device, torch.float32)
    # Options that overflow float32 (a tiny temperature after a tiny repetition penalty: +inf; -inf times a
    # penalty that underflowed to 0: NaN) must not reach the softmax: an infinite logit is the largest finite one,
    # a NaN one is masked, and a row with nothing left keeps the argmax.
    row = (rows / temperatures[:, None]).nan_to_num(nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
    row = _restrict(row, [params[i] for i in drawn])
    cumulative = row.softmax(-1).cumsum(-1)
    u = to_device([uniform(params[i].seed, num_generated[i]) for i in drawn], device, torch.float32)
    targets = (u * cumulative[:, -1])[:, None]
    tokens = torch.searchsorted(cumulative, targets, right=True).squeeze(1).clamp_(max=vocab - 1)
    tokens = torch.where(torch.isfinite(row).any(-1), tokens, greedy if every else greedy.index_select(0, at_drawn))
    return tokens if every else greedy.index_copy(0, at_drawn, tokens)


def sample(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int]) -> list[int]:
    """logits [N, vocab] float32 -> one token id per row."""
    return sample_tensor(logits, params, num_generated).tolist()


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
