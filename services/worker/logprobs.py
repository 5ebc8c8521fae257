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
from services.model.device_io import to_device


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]) -> list[TokenLogprob]:
    """logits [N, vocab] float32; row i: the logprob of token_ids[i] and its num_top[i] most likely tokens."""
    if not token_ids:
        return []
    tokens = to_device(list(token_ids), logits.device)
    values, ids = logprob_tensors(logits, tokens, None, num_top)
    return as_logprobs(token_ids, values.cpu(), ids.cpu(), num_top)


def logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor, rows: Sequence[int] | None,
                    num_top: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """token_logprobs on the logits' device, without waiting for it: for rows `rows` of logits [N, vocab] (None:
    every row, with no copy of them) and their drawn tokens (tokens [N] int64, on the device), (values [R, 1 + k]
    float32: the drawn token's logprob, then the top k; ids [R, k] int64), k the largest of num_top. `as_logprobs`
    reads them on the host."""
    if rows is not None:
        at = to_device(list(rows), logits.device)
        logits, tokens = logits.index_select(0, at), tokens.index_select(0, at)
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, vocab]
    chosen = logprobs.gather(1, tokens[:, None])  # [R, 1]
    k = min(max(num_top, default=0), logprobs.shape[1])
    if k <= 0:
        return chosen, torch.empty((logprobs.shape[0], 0), dtype=torch.int64, device=logits.device)
    top_values, top_ids = logprobs.topk(k, dim=-1)
    return torch.cat([chosen, top_values], dim=1), top_ids


def as_logprobs(tokens: Sequence[int], values: torch.Tensor, ids: torch.Tensor,
                num_top: Sequence[int]) -> list[TokenLogprob]:
    """logprob_tensors' output (on the host) as token_logprobs gives it: row i's drawn token tokens[i]."""
    values_rows, id_rows = values.tolist(), ids.tolist()
    return [TokenLogprob(token_id, row[0], tuple(zip(top[:n], row[1:1 + n])) if n > 0 else ())
            for token_id, row, top, n in zip(tokens, values_rows, id_rows, num_top, strict=True)]
