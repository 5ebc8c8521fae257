"""What a request's options do to its logits before a token is drawn, in vLLM's order: logit bias and min_tokens'
suppression of stop tokens, then the repetition, frequency and presence penalties.

Workers keep no per-request state (a switch may move the last stage elsewhere), so the token history a penalty
needs comes with each step (SequenceStep.output_token_counts, .distinct_prompt_token_ids), and only for requests
that use one. All rows that need processing are processed together: a few [rows, vocab] tensors per step, on the
logits' device; what comes from the host goes up through pinned memory (services/model/device_io.py), so a GPU
worker processes and samples a step without waiting for the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.contracts.step import SequenceStep
from services.model.device_io import to_device


def needs_processing(step: SequenceStep) -> bool:
    """Whether the step's logits differ from the model's before sampling."""
    return bool(step.sampling.logit_bias or step.suppressed_token_ids) or step.sampling.has_output_penalties


def _entries(rows: Sequence[Sequence[tuple[int, float]]], vocab_size: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row index, token id, value) of every (token id, value) in rows[r] inside the vocabulary, as tensors on
    `device`; ids past the vocabulary are ignored."""
    kept = [(r, t, v) for r, pairs in enumerate(rows) for t, v in pairs if 0 <= t < vocab_size]
    row_index, token_ids, values = zip(*kept) if kept else ((), (), ())
    return (to_device(row_index, device), to_device(token_ids, device), to_device(values, device, torch.float32))


def process_logits(logits: torch.Tensor, steps: Sequence[SequenceStep]) -> torch.Tensor:
    """logits [N, vocab] float32, one row per step -> the logits to sample from (the input when no step needs
    processing; never modified in place, so raw logprobs can still be taken from it)."""
    rows = [i for i, step in enumerate(steps) if needs_processing(step)]
    if not rows:
        return logits
    selected = [steps[i] for i in rows]
    vocab_size = logits.shape[1]
    device = logits.device
    at = to_device(rows, device)
    sub = logits.index_select(0, at)  # [R, vocab], a copy
    r, t, bias = _entries([s.sampling.logit_bias for s in selected], vocab_size, device)
    sub.index_put_((r, t), bias.to(sub.dtype), accumulate=True)
    r, t, _ = _entries([[(t_, 0.0) for t_ in s.suppressed_token_ids] for s in selected], vocab_size, device)
    sub.index_put_((r, t), torch.full((), float("-inf"), dtype=sub.dtype, device=device))
    counts = torch.zeros_like(sub)  # [R, vocab]: occurrences in the generated tokens
    r, t, occurrences = _entries([s.output_token_counts for s in selected], vocab_size, device)
    counts.index_put_((r, t), occurrences.to(sub.dtype))
    seen = counts > 0  # [R, vocab]: in the prompt or the output (repetition penalty)
    r, t, _ = _entries([[(t_, 0.0) for t_ in s.distinct_prompt_token_ids] for s in selected], vocab_size, device)
    seen.index_put_((r, t), torch.ones((), dtype=torch.bool, device=device))

    def column(name: str) -> torch.Tensor:  # [R, 1]
        return to_device([getattr(s.sampling, name) for s in selected], device, sub.dtype)[:, None]

    repetition = column("repetition_penalty")
    sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    sub = sub - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0).to(sub.dtype)
    return logits.index_copy(0, at, sub)
