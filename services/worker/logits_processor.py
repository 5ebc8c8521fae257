"""What a request's options do to its logits before a token is drawn, in vLLM's order: logit bias and min_tokens'
suppression of stop tokens, then the repetition, frequency and presence penalties.

Workers keep no per-request state (a switch may move the last stage elsewhere), so the token history a penalty
needs comes with each step (SequenceStep.output_token_counts, .distinct_prompt_token_ids), and only for requests
that use one. All rows that need processing are processed together: a few [rows, vocab] tensors per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.worker.step import SequenceStep


def needs_processing(step: SequenceStep) -> bool:
    """Whether the step's logits differ from the model's before sampling."""
    return bool(step.sampling.logit_bias or step.suppressed_token_ids) or step.sampling.has_output_penalties


def _scatter_index(rows: Sequence[Sequence[int]], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every id in rows[r] inside the vocabulary; ids past it are ignored."""
    pairs = [(r, t) for r, ids in enumerate(rows) for t in ids if 0 <= t < vocab_size]
    if not pairs:
        return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    index = torch.tensor(pairs, dtype=torch.long)
    return index[:, 0], index[:, 1]


def process_logits(logits: torch.Tensor, steps: Sequence[SequenceStep]) -> torch.Tensor:
    """logits [N, vocab] float32, one row per step -> the logits to sample from (the input when no step needs
    processing; never modified in place, so raw logprobs can still be taken from it)."""
    rows = [i for i, step in enumerate(steps) if needs_processing(step)]
    if not rows:
        return logits
    selected = [steps[i] for i in rows]
    vocab_size = logits.shape[1]
    device = logits.device
    sub = logits[rows].clone()  # [R, vocab]
    bias_rows = [[t for t, _ in s.sampling.logit_bias] for s in selected]
    r, t = _scatter_index(bias_rows, vocab_size)
    values = [b for s in selected for t_, b in s.sampling.logit_bias if 0 <= t_ < vocab_size]
    sub.index_put_((r.to(device), t.to(device)), torch.tensor(values, dtype=sub.dtype, device=device),
                   accumulate=True)
    r, t = _scatter_index([s.suppressed_token_ids for s in selected], vocab_size)
    sub.index_put_((r.to(device), t.to(device)), torch.tensor(float("-inf"), dtype=sub.dtype, device=device))
    counts = torch.zeros_like(sub)  # [R, vocab]: occurrences in the generated tokens
    r, t = _scatter_index([[t_ for t_, _ in s.output_token_counts] for s in selected], vocab_size)
    occurrences = [c for s in selected for t_, c in s.output_token_counts if 0 <= t_ < vocab_size]
    counts.index_put_((r.to(device), t.to(device)), torch.tensor(occurrences, dtype=sub.dtype, device=device))
    seen = counts > 0  # [R, vocab]: in the prompt or the output (repetition penalty)
    r, t = _scatter_index([s.distinct_prompt_token_ids for s in selected], vocab_size)
    seen.index_put_((r.to(device), t.to(device)), torch.tensor(True, device=device))

    def column(name: str) -> torch.Tensor:  # [R, 1]
        return torch.tensor([getattr(s.sampling, name) for s in selected], dtype=sub.dtype, device=device)[:, None]

    repetition = column("repetition_penalty")
    sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    sub = sub - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0).to(sub.dtype)
    processed = logits.clone()
    processed[rows] = sub
    return processed
