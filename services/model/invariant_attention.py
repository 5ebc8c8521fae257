"""Paged attention whose result for a token depends only on that token's query and its context's keys and values:
not on the batch (how many sequences, their lengths), not on whether the token came in a prefill chunk of any size
or in a decode step. The invariant numerics mode's attention (services/model/numerics.py); `paged_attention` is the
fast one.

Each row (one query head of one token) is computed as:
    scores = q · K^T over keys padded to a multiple of KEY_CHUNK (on a GPU rows padded to a multiple of ROW_MULTIPLE)
    m      = max over the visible keys                  (max is exact in any order)
    p      = exp(scores - m), 0 past the row's context  (masked keys add exact zeros below)
    denom  = sum of p over each chunk of KEY_CHUNK keys, the chunks folded in order (cumsum)
    out    = sum of p V / denom: on the CPU one ordered product ([R, L] x [L, D], every key added in order from the
             first, so a longer padded batch only adds exact zeros at the end); on a GPU per chunk (a
             [R, KEY_CHUNK] x [KEY_CHUNK, D] GEMM), the chunks folded in order
The chunks sit at fixed positions (from position 0), so a longer padded batch only appends chunks of zeros.
Everything is computed in float32; exp runs on whole vectors (numerics.whole_vectors). On the CPU both products
run through ordered_gemm.ordered_matmul (a BLAS's batched GEMM gives a row other bits at other shapes there), the
gathered values read in place; on a GPU through torch.matmul, its rows padded as the worker's probe found needed
(numerics.probe).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.model.attention import AttentionMetadata
from services.model.numerics import whole_vectors
from services.model.ordered_gemm import ordered_matmul

KEY_CHUNK = 64     # keys per chunk of the ordered fold
ROW_MULTIPLE = 8   # one KV head's query rows are padded to a multiple of this (>= every numerics.ROW_MULTIPLES)


def invariant_attention(query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                        sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of new tokens over their sequence's cached context, batch- and chunking-invariant.

    query [T, q_heads, D]; cache [2, num_blocks, block_size, kv_heads, D] (already holding this step's KV);
    returns [T, q_heads, D] in query's dtype.
    """
    num_kv_heads, head_dim = cache.shape[3], cache.shape[4]
    flat = cache.view(2, -1, num_kv_heads, head_dim)  # [2, num_blocks * block_size, Hkv, D]
    out = torch.empty_like(query)
    decodes = meta.decodes
    if decodes is not None:
        batch = decodes.context_lens.shape[0]
        q = query if decodes.token_index is None else query[decodes.token_index]  # [B, Hq, D]
        rows = _attend(q[:, None], flat, decodes.slots.view(batch, -1), (decodes.context_lens - 1)[:, None], scale,
                       sliding_window)[:, 0]  # [B, Hq, D]
        if decodes.token_index is None:
            return rows  # a pure decode step
        out[decodes.token_index] = rows
    for seq in meta.prefills:
        n = seq.num_new_tokens
        positions = torch.arange(seq.context_len - n, seq.context_len, device=query.device)
        out[seq.token_start: seq.token_start + n] = _attend(
            query[None, seq.token_start: seq.token_start + n], flat, seq.context_slots[None], positions[None], scale,
            sliding_window)[0]
    return out


def _attend(query: torch.Tensor, flat: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, scale: float,
            sliding_window: int | None) -> torch.Tensor:
    """query [B, n, Hq, D]: n new tokens of each of B sequences; slots [B, L] the flat cache slots of each one's
    keys (L > every position; past a row's own position keys are masked); positions [B, n]. -> [B, n, Hq, D]."""
    batch, n, num_q_heads, head_dim = query.shape
    num_kv_heads = flat.shape[2]
    group = num_q_heads // num_kv_heads
    num_chunks = -(-slots.shape[1] // KEY_CHUNK)
    num_keys = num_chunks * KEY_CHUNK
    slots = F.pad(slots, (0, num_keys - slots.shape[1])).reshape(-1)  # slot 0 past the end: masked below
    # (head, sequence) is every product's batch: keys and values as gathered, [B, L, Hkv, D] viewed head-major.
    keys = flat[0].index_select(0, slots).view(batch, num_keys, num_kv_heads, head_dim).permute(2, 0, 1, 3)
    values = flat[1].index_select(0, slots).view(batch, num_keys, num_kv_heads, head_dim).permute(2, 0, 3, 1)
    on_cpu = query.device.type == "cpu"  # the ordered GEMM: every row alone, keys added in order from the first
    # One KV head's rows: its `group` query heads of each of the n tokens, token-major (padded for a GPU's GEMM).
    num_rows = n * group
    padded_rows = num_rows if on_cpu else -(-num_rows // ROW_MULTIPLE) * ROW_MULTIPLE
    q = query.view(batch, n, num_kv_heads, group, head_dim).permute(2, 0, 1, 3, 4)
    q = F.pad(q.reshape(num_kv_heads, batch, num_rows, head_dim), (0, 0, 0, padded_rows - num_rows))
    row_positions = F.pad(positions[:, :, None].expand(batch, n, group).reshape(batch, num_rows),
                          (0, padded_rows - num_rows))  # a padding row sees key 0 (its result is dropped)
    limit = row_positions[..., None]  # [B, R, 1]
    key_positions = torch.arange(num_keys, device=query.device)
    visible = key_positions <= limit  # [B, R, L]
    if sliding_window is not None:
        visible &= key_positions > limit - sliding_window
    # Scores: [R, D] x [D, L] per (head, sequence) (a column's product does not depend on L).
    scores = _matmul_nt(q, keys).mul_(scale).masked_fill_(~visible, float("-inf"))
    weights = whole_vectors(torch.exp, scores.sub_(scores.amax(-1, keepdim=True)))  # [Hkv, B, R, L] float32
    denominator = weights.view(num_kv_heads, batch, padded_rows, num_chunks, KEY_CHUNK).sum(-1).cumsum(-1)[..., -1:]
    if on_cpu:  # [R, L] x [L, D] per (head, sequence), values read in place; masked keys add exact zeros
        out = ordered_matmul(weights, values).div_(denominator)
    else:  # in chunks at fixed positions (a GPU's GEMM reduces a longer L in another order)
        chunked = weights.view(num_kv_heads * batch, padded_rows, num_chunks, KEY_CHUNK).transpose(1, 2)
        values = values.reshape(num_kv_heads * batch, head_dim, num_chunks, KEY_CHUNK).transpose(1, 2)
        partial = _matmul_nt(chunked, values)  # [Hkv * B, nC, R, D]: [R, C] x [C, D] per chunk
        out = partial.cumsum(1)[:, -1].view(num_kv_heads, batch, padded_rows, head_dim).div_(denominator)
    out = out[:, :, :num_rows].reshape(num_kv_heads, batch, n, group, head_dim).permute(1, 2, 0, 3, 4)
    return out.reshape(batch, n, num_q_heads, head_dim).to(query.dtype)


def _matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] x b [..., N, K] -> [..., M, N] float32, invariantly (see the module's docstring); on a GPU in
    float32 (a bfloat16 operand is exact in it)."""
    if a.device.type == "cpu":
        return ordered_matmul(a, b)
    return torch.matmul(a.float(), b.float().transpose(-1, -2))
