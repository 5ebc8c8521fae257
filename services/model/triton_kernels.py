"""Fused Triton kernels of a decoder layer's elementwise and attention work (issue 38), and their launchers.

Five kernels replace the eager ops a decode step replays one small launch at a time:
- `add_rms_norm`: the residual add and the next RMSNorm in one pass over a row (or the norm alone);
- `rotary_write_kv`: q/k rotary (after Qwen3's per-head q/k norms, where the model has them) with the new keys
  and values written straight into the paged cache, slot by slot (`write_rows`: a padded graph's repeated rows);
- `decode_attention`: one new token per sequence over its cached keys, read where they lie through the step's
  flat slot table (no gather, no padding of keys to a bucket): the query heads of one KV head together (GQA),
  the keys cut into splits (flash-decoding) whose partial softmaxes a second kernel folds;
- `prefill_attention`: a step's prefill chunks in one launch, variable-length flash attention over the paged cache
  (a program per chunk's tile of 32 queries and query head; keys read in place, causal, windowed);
- `silu_mul`: SwiGLU's silu(gate) * up.

Every kernel loads in the tensor's dtype and computes in float32, rounding where the eager path rounds (the norm's
output before its weight, the silu before its product), so fp32 results match the eager ones to float rounding
and bf16 ones to an ulp. On a GPU they compile for it; on a CPU they run in Triton's interpreter
(TRITON_INTERPRET=1, set by services/model/kernels.py before this module is imported): slow, for the tests of
their logic only. Three of the interpreter's ways shape the code: a loop's bounds are never loaded values (a
tile past a row's keys is skipped by an `if` inside a loop of fixed trip count), every value is float32 between a
load and a store (its bfloat16 arithmetic works on the raw bits; its float32 -> bfloat16 cast truncates, where a
GPU rounds to nearest even), and its tl.dot gets float32 operands (_INTERPRETED).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from services.model.attention import PrefillBatch

_NORM_MAX = 32768  # widest row add_rms_norm takes in one program (hidden sizes are well below)
# In Triton's interpreter the products of tl.dot take float32 operands: it multiplies bfloat16 ones through a
# conversion to float16 that loses their range. On a GPU they stay in the tensor's dtype (tensor cores).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, sum_ptr, out_ptr, n_cols, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x += tl.load(delta_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        total = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n_cols + cols, total, mask=mask)
        x = total.to(tl.float32)  # the norm reads the sum as stored (the eager path's x + delta, rounded)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded before the weight, as HF does
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)) for x, delta [T, H] (delta None: (x, rms_norm(x)))."""
    rows, cols = x.shape
    if cols > _NORM_MAX:
        raise ValueError(f"add_rms_norm takes rows of up to {_NORM_MAX} elements, not {cols}")
    x = x.contiguous()
    total = torch.empty_like(x) if delta is not None else x
    out = torch.empty_like(x)
    if rows:
        _add_rms_norm_kernel[(rows,)](x, delta.contiguous() if delta is not None else x, weight, total, out, cols,
                                      eps, HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(cols))
    return total, out


@triton.jit
def _rotary_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, rows_ptr, q_norm_ptr, k_norm_ptr, q_out_ptr,
                            cache_ptr, qkv_stride, kv_stride, slot_stride, eps,
                            NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                            HEADS: tl.constexpr, DIM: tl.constexpr, HAS_ROWS: tl.constexpr,
                            HAS_QK_NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    src = t
    if HAS_ROWS:
        src = tl.load(rows_ptr + t).to(tl.int64)
    heads = tl.arange(0, HEADS)[:, None]
    d = tl.arange(0, DIM)[None, :]
    half = HEAD_DIM // 2
    swapped = (d + half) % HEAD_DIM  # rotate_half's partner; its sign lies in sin (RotaryEmbedding.cos_sin)
    in_dim = d < HEAD_DIM
    # queries: row t, rotated with row t's angles
    q_mask = (heads < NUM_Q) & in_dim
    q_base = qkv_ptr + t * qkv_stride + heads * HEAD_DIM
    q = tl.load(q_base + d, mask=q_mask, other=0.0).to(tl.float32)
    q_swapped = tl.load(q_base + swapped, mask=q_mask, other=0.0).to(tl.float32)
    if HAS_QK_NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(q * q, axis=1) / HEAD_DIM + eps)[:, None]
        q_w = tl.load(q_norm_ptr + d, mask=in_dim, other=0.0).to(tl.float32)
        q_w_swapped = tl.load(q_norm_ptr + swapped, mask=in_dim, other=0.0).to(tl.float32)
        q = ((q * rstd).to(q_out_ptr.dtype.element_ty).to(tl.float32) * q_w).to(q_out_ptr.dtype.element_ty)
        q = q.to(tl.float32)
        q_swapped = (q_swapped * rstd).to(q_out_ptr.dtype.element_ty).to(tl.float32) * q_w_swapped
        q_swapped = q_swapped.to(q_out_ptr.dtype.element_ty).to(tl.float32)
    cos = tl.load(cos_ptr + t * HEAD_DIM + d, mask=in_dim, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * HEAD_DIM + d, mask=in_dim, other=0.0).to(tl.float32)
    tl.store(q_out_ptr + t * (NUM_Q * HEAD_DIM) + heads * HEAD_DIM + d,
             (q * cos + q_swapped * sin).to(q_out_ptr.dtype.element_ty), mask=q_mask)
    # keys and values: row src (a padded graph's repeated row), into slot t's place in the cache
    kv_mask = (heads < NUM_KV) & in_dim
    k_base = qkv_ptr + src * qkv_stride + (NUM_Q + heads) * HEAD_DIM
    k = tl.load(k_base + d, mask=kv_mask, other=0.0).to(tl.float32)
    k_swapped = tl.load(k_base + swapped, mask=kv_mask, other=0.0).to(tl.float32)
    if HAS_QK_NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(k * k, axis=1) / HEAD_DIM + eps)[:, None]
        k_w = tl.load(k_norm_ptr + d, mask=in_dim, other=0.0).to(tl.float32)
        k_w_swapped = tl.load(k_norm_ptr + swapped, mask=in_dim, other=0.0).to(tl.float32)
        k = ((k * rstd).to(q_out_ptr.dtype.element_ty).to(tl.float32) * k_w).to(q_out_ptr.dtype.element_ty)
        k = k.to(tl.float32)
        k_swapped = (k_swapped * rstd).to(q_out_ptr.dtype.element_ty).to(tl.float32) * k_w_swapped
        k_swapped = k_swapped.to(q_out_ptr.dtype.element_ty).to(tl.float32)
    cos = tl.load(cos_ptr + src * HEAD_DIM + d, mask=in_dim, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + src * HEAD_DIM + d, mask=in_dim, other=0.0).to(tl.float32)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # the key rounded to the activations' dtype first (the eager path rotates in it), then to the cache's
    key = (k * cos + k_swapped * sin).to(q_out_ptr.dtype.element_ty)
    place = cache_ptr + slot * slot_stride + heads * HEAD_DIM + d
    tl.store(place, key.to(cache_ptr.dtype.element_ty), mask=kv_mask)
    value = tl.load(k_base + NUM_KV * HEAD_DIM + d, mask=kv_mask, other=0.0)
    tl.store(place + kv_stride, value.to(cache_ptr.dtype.element_ty), mask=kv_mask)


def rotary_write_kv(qkv: torch.Tensor, num_q: int, num_kv: int, head_dim: int, cos: torch.Tensor,
                    sin: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                    write_rows: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
                    k_norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) * D] (q, k, v heads side by side) -> rotated queries [T, Hq, D]; the rotated keys and
    the values go into `cache` [2, num_blocks, block_size, Hkv, D] at slot_mapping [T] (slot i from row
    write_rows[i], or row i). q_norm / k_norm: per-head RMSNorm weights [D] applied before the rotary (Qwen3)."""
    tokens = qkv.shape[0]
    if qkv.stride(1) != 1 or cache.stride(4) != 1 or cache.stride(3) != head_dim or \
            cache.stride(1) != cache.shape[2] * cache.stride(2):
        raise ValueError("rotary_write_kv needs rows of qkv and the cache's slots contiguous")
    q_out = torch.empty((tokens, num_q, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens:
        has_norm = q_norm is not None
        _rotary_write_kv_kernel[(tokens,)](
            qkv, cos.contiguous(), sin.contiguous(), slot_mapping,
            write_rows if write_rows is not None else slot_mapping, q_norm if has_norm else cos,
            k_norm if has_norm else cos, q_out, cache, qkv.stride(0), cache.stride(0), cache.stride(2), eps,
            NUM_Q=num_q, NUM_KV=num_kv, HEAD_DIM=head_dim, HEADS=triton.next_power_of_2(max(num_q, num_kv)),
            DIM=triton.next_power_of_2(head_dim), HAS_ROWS=write_rows is not None, HAS_QK_NORM=has_norm)
    return q_out


@triton.jit
def _decode_split_kernel(q_ptr, cache_ptr, slots_ptr, context_ptr, max_ptr, sum_ptr, acc_ptr,
                         num_keys, window, kv_stride, slot_stride, scale_log2, NUM_KV: tl.constexpr,
                         GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, DIM: tl.constexpr,
                         BLOCK_N: tl.constexpr, TILES: tl.constexpr, HAS_WINDOW: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, DIM)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + (b * NUM_KV + h) * GROUP * HEAD_DIM + g[:, None] * HEAD_DIM + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    context = tl.load(context_ptr + b)
    keys_per_split = TILES * BLOCK_N
    first = split * keys_per_split  # this split's keys: [first, first + keys_per_split) within the context
    lo = first
    if HAS_WINDOW:
        lo = tl.maximum(lo, context - window)  # keys at positions > context - 1 - window
    hi = tl.minimum(first + keys_per_split, context)
    running_max = tl.full([GROUP_P], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, DIM], tl.float32)
    for start in range(0, TILES * BLOCK_N, BLOCK_N):
        n = first + start + tl.arange(0, BLOCK_N)
        if (first + start < hi) & (first + start + BLOCK_N > lo):  # a tile with a key of this row's
            visible = (n >= lo) & (n < hi)
            slot = tl.load(slots_ptr + b * num_keys + n, mask=visible, other=0).to(tl.int64)
            place = cache_ptr + slot[:, None] * slot_stride + h * HEAD_DIM + d[None, :]
            kv_mask = visible[:, None] & d_mask[None, :]
            k = tl.load(place, mask=kv_mask, other=0.0).to(tl.float32)                        # [BLOCK_N, DIM]
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale_log2               # [GROUP_P, BLOCK_N]
            scores = tl.where(visible[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            alpha = tl.exp2(running_max - new_max)
            p = tl.exp2(scores - new_max[:, None])
            v = tl.load(place + kv_stride, mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            running_sum = running_sum * alpha + tl.sum(p, axis=1)
            running_max = new_max
    at = ((b * NUM_KV + h) * num_splits + split) * GROUP_P + g
    tl.store(max_ptr + at, running_max)
    tl.store(sum_ptr + at, running_sum)
    tl.store(acc_ptr + at[:, None] * DIM + d[None, :], acc)


@triton.jit
def _decode_merge_kernel(max_ptr, sum_ptr, acc_ptr, out_ptr, NUM_KV: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         SPLITS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                         HEAD_DIM: tl.constexpr, DIM: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS)[:, None]
    g = tl.arange(0, GROUP_P)[None, :]
    at = ((b * NUM_KV + h) * NUM_SPLITS + s) * GROUP_P + g                                       # [SPLITS, GROUP_P]
    real = (s < NUM_SPLITS) & (g < GROUP_P)
    split_max = tl.load(max_ptr + at, mask=real, other=float("-inf"))
    row_max = tl.max(split_max, axis=0)                                                           # [GROUP_P]
    weight = tl.where(split_max > float("-inf"), tl.exp2(split_max - row_max[None, :]), 0.0)    # empty splits: 0
    total = tl.sum(weight * tl.load(sum_ptr + at, mask=real, other=0.0), axis=0)
    d = tl.arange(0, DIM)[None, None, :]
    acc = tl.load(acc_ptr + at[:, :, None] * DIM + d, mask=real[:, :, None], other=0.0)          # [S, G, DIM]
    out = tl.sum(weight[:, :, None] * acc, axis=0) / total[:, None]                              # [GROUP_P, DIM]
    g2 = tl.arange(0, GROUP_P)[:, None]
    d2 = tl.arange(0, DIM)[None, :]
    tl.store(out_ptr + (b * NUM_KV + h) * GROUP * HEAD_DIM + g2 * HEAD_DIM + d2, out.to(out_ptr.dtype.element_ty),
             mask=(g2 < GROUP) & (d2 < HEAD_DIM))


def decode_splits(num_keys: int, batch: int, num_kv_heads: int) -> int:
    """Key splits of a decode step (a function of its shape alone, so a graph's is fixed): enough programs to fill
    a GPU, each split >= 256 keys, at most 16."""
    wanted = -(-1024 // max(1, batch * num_kv_heads))
    return max(1, min(16, num_keys // 256, wanted))


def decode_block_n(group: int, head_dim: int) -> int:
    """Keys per tile of decode_attention: its scores and products hold group x keys x head_dim float32 values in
    registers (8,192 of them: 64 per thread of 4 warps), so wider query groups and heads take fewer keys (16-64)."""
    wanted = 8192 // (triton.next_power_of_2(group) * triton.next_power_of_2(head_dim))
    return max(16, min(64, 1 << max(0, wanted.bit_length() - 1)))


def decode_attention(query: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, context_lens: torch.Tensor,
                     scale: float, sliding_window: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """One new token per sequence: query [B, Hq, D] over its keys in `cache` [2, num_blocks, block_size, Hkv, D],
    slots [B * L] (row b's keys at slots[b * L: b * L + context_lens[b]], the rest never read) -> [B, Hq, D].
    block_n: keys per tile (None: decode_block_n's)."""
    batch, num_q, head_dim = query.shape
    num_kv = cache.shape[3]
    block_n = block_n or decode_block_n(num_q // num_kv, head_dim)
    if cache.stride(4) != 1 or cache.stride(3) != head_dim or cache.stride(1) != cache.shape[2] * cache.stride(2):
        raise ValueError("decode_attention needs the cache's slots contiguous")
    out = torch.empty_like(query)
    if not batch:
        return out
    num_keys = slots.numel() // batch
    # tiles of block_n keys per split, a power of two (a compile-time constant: few distinct ones, whatever the
    # step's longest context); the splits then cover num_keys
    tiles = triton.next_power_of_2(-(-num_keys // (decode_splits(num_keys, batch, num_kv) * block_n)))
    splits = -(-num_keys // (tiles * block_n))
    group = num_q // num_kv
    group_p, dim = triton.next_power_of_2(group), triton.next_power_of_2(head_dim)
    partial = torch.empty((batch, num_kv, splits, group_p), dtype=torch.float32, device=query.device)
    sums = torch.empty_like(partial)
    acc = torch.empty((batch, num_kv, splits, group_p, dim), dtype=torch.float32, device=query.device)
    _decode_split_kernel[(batch, num_kv, splits)](
        query.contiguous(), cache, slots, context_lens, partial, sums, acc, num_keys, sliding_window or 0,
        cache.stride(0), cache.stride(2), scale * 1.4426950408889634,
        NUM_KV=num_kv, GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, DIM=dim, BLOCK_N=block_n,
        TILES=tiles, HAS_WINDOW=sliding_window is not None)
    _decode_merge_kernel[(batch, num_kv)](partial, sums, acc, out, NUM_KV=num_kv, NUM_SPLITS=splits,
                                          SPLITS=triton.next_power_of_2(splits), GROUP=group, GROUP_P=group_p,
                                          HEAD_DIM=head_dim, DIM=dim)
    return out


@triton.jit
def _prefill_kernel(q_ptr, cache_ptr, slots_ptr, chunks_ptr, out_ptr, num_chunks, slots_width, window, kv_stride,
                    slot_stride, scale_log2, NUM_Q: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    chunk = tl.program_id(0).to(tl.int64)
    m_first = tl.program_id(1) * BLOCK_M
    head = tl.program_id(2)
    kv_head = head // GROUP
    start = tl.load(chunks_ptr + chunk)
    num_new = tl.load(chunks_ptr + num_chunks + chunk)
    context = tl.load(chunks_ptr + 2 * num_chunks + chunk)
    m = m_first + tl.arange(0, BLOCK_M)
    d = tl.arange(0, DIM)
    m_mask = m < num_new
    d_mask = d < HEAD_DIM
    q_pos = context - num_new + m                                  # each query row's position
    rows = (start + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * (NUM_Q * HEAD_DIM) + head * HEAD_DIM + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    hi = tl.minimum(context, context - num_new + m_first + BLOCK_M)  # causal: past the tile's last query, nothing
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, context - num_new + m_first - window + 1)  # before the tile's first query's window
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM], tl.float32)
    for tile in range(0, TILES):
        n_first = tile * BLOCK_N
        if (m_first < num_new) & (n_first < hi) & (n_first + BLOCK_N > lo):
            n = n_first + tl.arange(0, BLOCK_N)
            n_mask = n < hi
            slot = tl.load(slots_ptr + chunk * slots_width + n, mask=n_mask, other=0).to(tl.int64)
            place = cache_ptr + slot[:, None] * slot_stride + kv_head * HEAD_DIM + d[None, :]
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(place, mask=kv_mask, other=0.0)
            if DOT_F32:
                k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2    # [BLOCK_M, BLOCK_N]
            visible = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible &= (q_pos[:, None] - n[None, :]) < window
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            shift = tl.where(new_max > float("-inf"), new_max, 0.0)  # a row with no key yet: nothing to scale
            alpha = tl.exp2(running_max - shift)
            p = tl.exp2(scores - shift[:, None])
            v = tl.load(place + kv_stride, mask=kv_mask, other=0.0)
            if DOT_F32:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            running_sum = running_sum * alpha + tl.sum(p, axis=1)
            running_max = new_max
    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * (NUM_Q * HEAD_DIM) + head * HEAD_DIM + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill_attention(query: torch.Tensor, cache: torch.Tensor, batch: PrefillBatch, scale: float,
                      sliding_window: int | None, out: torch.Tensor, block_m: int = 32,
                      block_n: int = 32) -> torch.Tensor:
    """A step's prefill chunks in one launch (variable-length flash attention over the paged cache): each chunk's
    queries (rows batch.chunks[0] onwards of query [T, Hq, D]) over its context's keys, read in place through
    batch.slots, causal and within the window. Writes those rows of `out` [T, Hq, D] and returns it."""
    num_q, head_dim = query.shape[1], query.shape[2]
    num_kv = cache.shape[3]
    if batch.chunks is None:
        raise ValueError("prefill_attention needs a PrefillBatch with its chunks (AttentionMetadata.build's "
                         "prefill_kernel)")
    if cache.stride(4) != 1 or cache.stride(3) != head_dim or cache.stride(1) != cache.shape[2] * cache.stride(2):
        raise ValueError("prefill_attention needs the cache's slots contiguous")
    num_chunks, width = batch.slots.shape
    max_new = batch.token_rows.shape[1]
    dim = max(16, triton.next_power_of_2(head_dim))  # tl.dot's smallest side
    _prefill_kernel[(num_chunks, triton.cdiv(max_new, block_m), num_q)](
        query.contiguous(), cache, batch.slots, batch.chunks, out, num_chunks, width, sliding_window or 0,
        cache.stride(0), cache.stride(2), scale * 1.4426950408889634, NUM_Q=num_q, GROUP=num_q // num_kv,
        HEAD_DIM=head_dim, DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n,
        TILES=triton.next_power_of_2(triton.cdiv(width, block_n)), HAS_WINDOW=sliding_window is not None,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", DOT_F32=_INTERPRETED)
    return out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded, as F.silu's
    tl.store(out_ptr + row * width + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 I] (gate, then up) -> silu(gate) * up [T, I]."""
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    gate_up = gate_up.contiguous()
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(width))
        _silu_mul_kernel[(rows, triton.cdiv(width, block))](gate_up, out, width, BLOCK=block)
    return out
