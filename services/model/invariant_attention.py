"""Paged attention whose result for a token depends only on that token's query and its context's keys and values:
not on the batch (how many sequences, their lengths), not on whether the token came in a prefill chunk of any size
or in a decode step. The invariant numerics mode's attention (services/model/numerics.py); `paged_attention` is the
fast one.

On the CPU every row (one query head of one token) is computed alone by one C call for the whole step, over its
visible keys only, in the order services/model/attention_kernel.py states (its own exp; the same bits on every CPU).
On a GPU each row is computed as:
    scores = q · K^T over keys padded to a multiple of KEY_CHUNK (rows padded to a multiple of ROW_MULTIPLE)
    m      = max over the visible keys                  (max is exact in any order)
    p      = exp(scores - m), 0 past the row's context  (masked keys add exact zeros below)
    denom  = sum of p over each chunk of KEY_CHUNK keys, the chunks folded in order (cumsum)
    out    = sum of p V over each chunk (a [R, KEY_CHUNK] x [KEY_CHUNK, D] GEMM), folded in order, / denom
The chunks sit at fixed positions (from position 0), so a longer padded batch only appends chunks of zeros.
Everything is computed in float32; exp runs on whole vectors (numerics.whole_vectors); the products through
torch.matmul, rows padded as the worker's probe found needed (numerics.probe).
"""

from __future__ import annotations

import array

import torch
import torch.nn.functional as F

from services.model.attention import AttentionMetadata
from services.model.numerics import whole_vectors
from services.model import cpu_kernels

KEY_CHUNK = 64     # keys per chunk of the ordered fold
ROW_MULTIPLE = 8   # one KV head's query rows are padded to a multiple of this (>= every numerics.ROW_MULTIPLES)


def invariant_attention(query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                        sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of new tokens over their sequence's cached context, batch- and chunking-invariant.

    query [T, q_heads, D]; cache [2, num_blocks, block_size, kv_heads, D] (already holding this step's KV);
    returns [T, q_heads, D] in query's dtype.
    """
    if query.device.type == "cpu":
        return _ordered(query, cache, meta, scale, sliding_window)
    return _padded(query, cache, meta, scale, sliding_window)


def _padded(query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
            sliding_window: int | None) -> torch.Tensor:
    """A GPU's attention: rows and keys padded, products by torch.matmul (see the module's docstring)."""
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


_last_rows: tuple[AttentionMetadata, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None


def _ordered(query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
             sliding_window: int | None) -> torch.Tensor:
    """The CPU's attention: every row in one C call (attention_kernel.py), in the order its docstring states."""
    global _last_rows
    if cache.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"invariant attention on a CPU takes a float32 or bfloat16 cache, not {cache.dtype}")
    num_tokens, num_q_heads, head_dim = query.shape
    last = _last_rows  # every layer of a step attends over the same rows: built once a step
    if last is None or last[0] is not meta:
        last = _last_rows = (meta, _token_rows(meta, num_tokens))
    slots, first, positions = last[1]
    q = query.float().contiguous()
    out = torch.empty_like(q)
    if num_tokens:
        params = array.array("q", (num_tokens, num_q_heads, cache.shape[3], head_dim, sliding_window or 0,
                                   cache.dtype is torch.bfloat16, torch.get_num_threads()))
        cpu_kernels.library().ordered_attention(q.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(),
                                              slots.data_ptr(), first.data_ptr(), positions.data_ptr(),
                                              out.data_ptr(), params.buffer_info()[0], scale)
    return out.to(query.dtype)


def _token_rows(meta: AttentionMetadata, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slots, first, positions): token t's context keys are slots[first[t] + j] for j <= positions[t]."""
    first = torch.zeros(num_tokens, dtype=torch.int64)
    positions = torch.full((num_tokens,), -1, dtype=torch.int64)  # a token of no sequence attends to nothing
    parts, offset = [], 0
    decodes = meta.decodes
    if decodes is not None:
        batch = decodes.context_lens.shape[0]
        width = decodes.slots.numel() // max(batch, 1)
        rows = torch.arange(batch) if decodes.token_index is None else decodes.token_index.cpu()
        first[rows] = torch.arange(batch) * width
        positions[rows] = decodes.context_lens.cpu().to(torch.int64) - 1
        parts.append(decodes.slots.reshape(-1))
        offset = decodes.slots.numel()
    for seq in meta.prefills:
        n = seq.num_new_tokens
        first[seq.token_start: seq.token_start + n] = offset
        positions[seq.token_start: seq.token_start + n] = torch.arange(seq.context_len - n, seq.context_len)
        parts.append(seq.context_slots)
        offset += seq.context_slots.numel()
    slots = torch.cat(parts).to(torch.int64).contiguous() if parts else torch.zeros(1, dtype=torch.int64)
    return slots, first, positions


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
    # (head, sequence) is every product's batch.
    keys = flat[0].index_select(0, slots).view(batch, num_keys, num_kv_heads, head_dim).permute(2, 0, 1, 3)
    values = flat[1].index_select(0, slots).view(batch, num_keys, num_kv_heads, head_dim).permute(2, 0, 3, 1)
    # One KV head's rows: its `group` query heads of each of the n tokens, token-major, padded.
    num_rows = n * group
    padded_rows = -(-num_rows // ROW_MULTIPLE) * ROW_MULTIPLE
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
    chunked = weights.view(num_kv_heads * batch, padded_rows, num_chunks, KEY_CHUNK).transpose(1, 2)
    values = values.reshape(num_kv_heads * batch, head_dim, num_chunks, KEY_CHUNK).transpose(1, 2)
    partial = _matmul_nt(chunked, values)  # [Hkv * B, nC, R, D]: [R, C] x [C, D] per chunk
    out = partial.cumsum(1)[:, -1].view(num_kv_heads, batch, padded_rows, head_dim).div_(denominator)
    out = out[:, :, :num_rows].reshape(num_kv_heads, batch, n, group, head_dim).permute(1, 2, 0, 3, 4)
    return out.reshape(batch, n, num_q_heads, head_dim).to(query.dtype)


def _matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] x b [..., N, K] -> [..., M, N] float32 (a bfloat16 operand is exact in float32)."""
    return torch.matmul(a.float(), b.float().transpose(-1, -2))
