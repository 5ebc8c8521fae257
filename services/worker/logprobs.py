"""Log-probabilities on the last stage: one log_softmax per step over the rows that asked, then only the chosen
token's value and the top-k values and ids leave the worker (never whole rows).

They are the log-softmax of the raw model logits, before logit bias, penalties and temperature: vLLM's default
("raw" logprobs), so a request's logprobs do not depend on its sampling options and equal the model's own
distribution (what log-likelihood evaluations need).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.contracts.step import TokenLogprob


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]) -> list[TokenLogprob]:
    """logits [N, vocab] float32; row i: the logprob of token_ids[i] and its num_top[i] most likely tokens."""
    if not token_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, vocab]
    targets = torch.tensor(token_ids, dtype=torch.long, device=logits.device)[:, None]
    chosen = logprobs.gather(1, targets)[:, 0].tolist()
    k = min(max(num_top), logprobs.shape[1])
    top_values, top_ids = ([], []) if k <= 0 else (t.tolist() for t in logprobs.topk(k, dim=-1))
    return [
        TokenLogprob(token_id, chosen[i], tuple(zip(top_ids[i][:n], top_values[i][:n])) if n > 0 else ())
        for i, (token_id, n) in enumerate(zip(token_ids, num_top, strict=True))
    ]
