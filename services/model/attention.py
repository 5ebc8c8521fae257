"""Paged attention over a block-table KV cache (prefill and decode), CPU-friendly via torch SDPA."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.model.device_io import to_device


# decode(query [B, Hq, D], cache, slots [B * L], context_lens [B], scale, sliding_window) -> [B, Hq, D]: row b's
# keys at slots[b * L: b * L + context_lens[b]] (services/model/triton_kernels.decode_attention)
DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, "int | None"],
                           torch.Tensor]
# prefill(query [T, Hq, D], cache, batch: PrefillBatch, scale, sliding_window, out [T, Hq, D]) -> out, the chunks'
# rows written (services/model/triton_kernels.prefill_attention)
PrefillAttention = Callable[[torch.Tensor, torch.Tensor, "PrefillBatch", float, "int | None", torch.Tensor],
                            torch.Tensor]


@dataclass(frozen=True, slots=True)
class SequenceSlice:
    """Where one sequence's new tokens sit in a step's flattened token array."""

    token_start: int          # index of its first new token in the step's [T] arrays
    num_new_tokens: int
    context_len: int          # cached + new tokens after this step
    context_slots: torch.Tensor | None = None  # [context_len] flat cache slots (multi-token sequences only)


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """The step's single-token sequences, attended to in one padded SDPA call instead of one call each."""

    token_index: torch.Tensor | None  # [B] index of each decode token in the step's [T] arrays; None: T == B, in order
    slots: torch.Tensor               # [B * L] flat cache slot of each key, L = the longest context (padding: slot 0)
    context_lens: torch.Tensor        # [B]
    key_mask: torch.Tensor | None     # [B, 1, 1, L] True where the key is in the context; None: every context is L


@dataclass(frozen=True, slots=True)
class PrefillBatch:
    """A step's prefill chunks, attended to in one padded SDPA call (on a GPU: one launch, not one per chunk)."""

    token_rows: torch.Tensor       # [S, n] each chunk's rows in the step's [T] arrays (padding: row 0)
    real: torch.Tensor             # [S, n] True on a chunk's own rows
    real_token_rows: torch.Tensor  # token_rows[real]
    slots: torch.Tensor            # [S, ctx] flat cache slots of each chunk's context (padding: slot 0)
    q_pos: torch.Tensor            # [S, n] each query's position
    mask: torch.Tensor | None      # [S, 1, n, ctx] causal, within the chunk's context; padding rows see key 0
    # (None: built for a kernel, which masks as it goes)
    chunks: torch.Tensor | None = None  # [3, S] each chunk's first row, new tokens, context length (a kernel's)


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-step attention inputs shared by every layer of a worker (built once per step, not per layer)."""

    sequences: tuple[SequenceSlice, ...]   # every sequence of the step, in batch order
    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) of each new token
    block_size: int
    prefills: tuple[SequenceSlice, ...] = ()  # multi-token sequences, attended one by one (or prefill_batch)
    decodes: DecodeBatch | None = None        # single-token sequences, attended in one call
    # [T] the row of this step's keys/values each slot of slot_mapping receives; None: row i. A padded decode step
    # (CUDA graphs) repeats a real row in its padding rows, slot included: the duplicate writes carry equal bytes.
    write_rows: torch.Tensor | None = None
    prefill_batch: PrefillBatch | None = None  # the prefills in one call (on a GPU, when there are several)

    @classmethod
    def build(cls, starts: list[int], lengths: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device, prefill_kernel: bool = False) -> AttentionMetadata:
        """From each sequence's start position, number of new tokens and block table. prefill_kernel: the
        prefill chunks go to a kernel (paged_attention's `prefill`): one PrefillBatch however many, without the
        SDPA masks (else one only for several chunks, on a GPU)."""
        sequences, slots, tables, token_start = [], [], [], 0
        for start, length, table in zip(starts, lengths, block_tables, strict=True):
            context_len = start + length
            needed = -(-context_len // block_size)
            if len(table) < needed:
                raise ValueError(
                    f"block table has {len(table)} blocks, {needed} needed for {context_len} tokens"
                )
            slots += [table[p // block_size] * block_size + p % block_size for p in range(start, context_len)]
            context = _context_slots([table[:needed]], context_len, block_size, device)[0] if length != 1 else None
            sequences.append(SequenceSlice(token_start, length, context_len, context))
            tables.append(table[:needed])
            token_start += length
        slot_mapping = to_device(slots, device)
        decodes = [i for i, s in enumerate(sequences) if s.num_new_tokens == 1]
        prefills = tuple(s for s in sequences if s.num_new_tokens != 1)
        decode_batch = _decode_batch([sequences[i] for i in decodes], [tables[i] for i in decodes], block_size,
                                     token_start, device) if decodes else None
        batched = None
        if prefill_kernel and prefills:
            batched = prefill_batch(prefills, device, masks=False)
        elif len(prefills) > 1 and device.type == "cuda":
            batched = prefill_batch(prefills, device)
        return cls(tuple(sequences), slot_mapping, block_size, prefills, decode_batch, prefill_batch=batched)

    @classmethod
    def padded_decode(cls, positions: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                      write_rows: torch.Tensor, block_size: int, key_mask: bool = True) -> AttentionMetadata:
        """A decode step built on the device from device tensors alone, with shapes fixed by block_tables' (what a
        CUDA graph captures and replays): positions [B] (each row's new token), block_tables [B, N] (padded with
        any block id), context_lens [B], write_rows [B] (padding rows name the real row they repeat). Every row
        attends to N * block_size keys, masked past its context. key_mask: False leaves the mask out (a decode
        kernel's step: it reads each row's keys up to its context_lens alone)."""
        batch, num_blocks = block_tables.shape
        offsets = torch.arange(block_size, device=block_tables.device)
        slots = (block_tables[:, :, None] * block_size + offsets).view(batch, num_blocks * block_size)
        slot_mapping = slots.gather(1, positions[:, None]).squeeze(1)
        mask = _decode_keys_mask(context_lens, num_blocks * block_size, None) if key_mask else None
        return cls((), slot_mapping, block_size, (), DecodeBatch(None, slots.reshape(-1), context_lens, mask),
                   write_rows)


def write_kv(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
             rows: torch.Tensor | None = None) -> None:
    """Store new keys/values. cache [2, num_blocks, block_size, kv_heads, D]; key/value [T, kv_heads, D]; rows
    (AttentionMetadata.write_rows): slot i receives row rows[i]."""
    if rows is not None:
        key, value = key.index_select(0, rows), value.index_select(0, rows)
    num_blocks, block_size = cache.shape[1], cache.shape[2]
    flat = cache.view(2, num_blocks * block_size, cache.shape[3], cache.shape[4])
    flat[0].index_copy_(0, slot_mapping, key.to(cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(cache.dtype))


def paged_attention(query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None, decode: DecodeAttention | None = None,
                    prefill: PrefillAttention | None = None) -> torch.Tensor:
    """Causal attention of new tokens over their sequence's cached context.

    query [T, q_heads, D]; cache [2, num_blocks, block_size, kv_heads, D] (already holding this step's KV);
    returns [T, q_heads, D]. Query heads map to KV heads in contiguous groups (GQA). decode: what attends the
    single-token sequences (DecodeAttention's signature; None: one padded SDPA call); prefill: what attends the
    prefill chunks of meta.prefill_batch (PrefillAttention's; None: SDPA).
    """
    decodes = meta.decodes
    if decodes is not None:
        q = query if decodes.token_index is None else query[decodes.token_index]
        attended = (decode(q, cache, decodes.slots, decodes.context_lens, scale, sliding_window) if decode
                    else _batched_decode(q, cache, decodes, scale, sliding_window))
        if decodes.token_index is None:
            return attended  # a pure decode step
    out = torch.empty_like(query)
    num_kv_heads, head_dim = cache.shape[3], cache.shape[4]
    if decodes is not None:
        out[decodes.token_index] = attended
    flat = cache.view(2, -1, num_kv_heads, head_dim)  # [2, num_blocks * block_size, Hkv, D]
    if meta.prefill_batch is not None and prefill is not None:
        return prefill(query, cache, meta.prefill_batch, scale, sliding_window, out)
    if meta.prefill_batch is not None:
        return _batched_prefill(query, flat, meta.prefill_batch, scale, sliding_window, out)
    for seq in meta.prefills:
        q = query[seq.token_start: seq.token_start + seq.num_new_tokens]  # [n, Hq, D]
        kv = flat.index_select(1, seq.context_slots)  # [2, ctx, Hkv, D]
        k, v = kv[0].to(q.dtype), kv[1].to(q.dtype)
        mask = _mask(seq.num_new_tokens, seq.context_len, sliding_window, q.device)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, Hq, n, D]
            k.transpose(0, 1).unsqueeze(0),  # [1, Hkv, ctx, D]
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=False,
            scale=scale,
            enable_gqa=True,
        )
        out[seq.token_start: seq.token_start + seq.num_new_tokens] = attn[0].transpose(0, 1)
    return out


def prefill_batch(prefills: tuple[SequenceSlice, ...], device: torch.device, masks: bool = True) -> PrefillBatch:
    """The padded indices and mask that attend a step's prefill chunks in one call (built once per step, on the
    host but for the context slots, already on the device). masks: False leaves the [S, n, ctx] mask out (a
    kernel's batch: it masks as it goes)."""
    num_new = torch.tensor([p.num_new_tokens for p in prefills])
    context = torch.tensor([p.context_len for p in prefills])
    rows = torch.arange(int(num_new.max()))
    real = rows[None, :] < num_new[:, None]                                             # [S, n]
    token_rows = torch.where(real, torch.tensor([p.token_start for p in prefills])[:, None] + rows, 0)
    q_pos = (context - num_new)[:, None] + rows                                         # [S, n]
    mask = None
    if masks:
        k_pos = torch.arange(int(context.max()))
        mask = (k_pos <= q_pos[:, :, None]) & (k_pos < context[:, None, None])
        mask |= ~real[:, :, None] & (k_pos == 0)  # a padding row sees key 0 alone (one that sees nothing: NaN)
        mask = to_device(mask[:, None], device, mask.dtype)
    slots = torch.nn.utils.rnn.pad_sequence([p.context_slots for p in prefills], batch_first=True)  # [S, ctx]
    chunks = torch.stack([torch.tensor([p.token_start for p in prefills]), num_new, context])
    token_rows, real, real_rows, q_pos, chunks = (to_device(t, device, t.dtype) for t in (
        token_rows, real, token_rows[real], q_pos, chunks))
    return PrefillBatch(token_rows, real, real_rows, slots, q_pos, mask, chunks)


def _batched_prefill(query: torch.Tensor, flat: torch.Tensor, batch: PrefillBatch, scale: float,
                     sliding_window: int | None, out: torch.Tensor) -> torch.Tensor:
    """The prefill chunks of a step in one attention call: queries and keys padded to the longest chunk and
    context, masked per chunk (causal, its own context, the window). Writes their rows of `out` and returns it."""
    assert batch.mask is not None, "a kernel's PrefillBatch (masks=False) goes to the kernel"
    q = query[batch.token_rows]                                                           # [S, n, Hq, D]
    kv = flat[:, batch.slots]                                                             # [2, S, ctx, Hkv, D]
    mask = batch.mask
    if sliding_window is not None:
        k_pos = torch.arange(batch.slots.shape[1], device=query.device)
        mask = mask & ((batch.q_pos[:, :, None] - k_pos) < sliding_window)[:, None]
        mask |= (~batch.real[:, :, None] & (k_pos == 0))[:, None]
    attn = F.scaled_dot_product_attention(q.transpose(1, 2), kv[0].to(q.dtype).transpose(1, 2),
                                          kv[1].to(q.dtype).transpose(1, 2), attn_mask=mask, is_causal=False,
                                          scale=scale, enable_gqa=True)                  # [S, Hq, n, D]
    out[batch.real_token_rows] = attn.transpose(1, 2)[batch.real]
    return out


def _mask(num_new: int, context_len: int, sliding_window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean [n, ctx] mask: new token i (position context_len - n + i) sees keys at positions <= its own."""
    if num_new == 1 and (sliding_window is None or context_len <= sliding_window):
        return None  # a decode token sees the whole context
    q_pos = torch.arange(context_len - num_new, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= (q_pos - k_pos) < sliding_window
    return mask


def _context_slots(tables: list[list[int]], num_keys: int, block_size: int, device: torch.device) -> torch.Tensor:
    """[len(tables), num_keys] flat cache slots of the first num_keys positions of each block table (short tables
    padded with block 0)."""
    width = max(len(table) for table in tables)
    padded = to_device([table + [0] * (width - len(table)) for table in tables], device)
    offsets = torch.arange(block_size, device=device)
    return (padded[:, :, None] * block_size + offsets).view(len(tables), -1)[:, :num_keys]


def _decode_keys_mask(context_lens: torch.Tensor, num_keys: int, sliding_window: int | None) -> torch.Tensor:
    """[B, 1, 1, num_keys]: True where key position p is in the context (and within the window of the new token,
    at position context_len - 1)."""
    positions = torch.arange(num_keys, device=context_lens.device)[None, :]
    mask = positions < context_lens[:, None]
    if sliding_window is not None:
        mask &= positions > context_lens[:, None] - 1 - sliding_window
    return mask[:, None, None, :]


def _decode_batch(decodes: list[SequenceSlice], tables: list[list[int]], block_size: int, num_tokens: int,
                  device: torch.device) -> DecodeBatch:
    lengths = [s.context_len for s in decodes]
    num_keys = max(lengths)
    slots = _context_slots(tables, num_keys, block_size, device).reshape(-1)
    context_lens = to_device(lengths, device)
    key_mask = None if min(lengths) == num_keys else _decode_keys_mask(context_lens, num_keys, None)
    token_starts = [s.token_start for s in decodes]
    in_order = len(decodes) == num_tokens  # then token_starts == 0..T-1
    index = None if in_order else to_device(token_starts, device)
    return DecodeBatch(index, slots, context_lens, key_mask)


def _batched_decode(query: torch.Tensor, cache: torch.Tensor, decodes: DecodeBatch, scale: float,
                    sliding_window: int | None) -> torch.Tensor:
    """One new token per sequence (query [B, Hq, D]: the decode rows alone): gather each sequence's keys (padded),
    mask past its length. -> [B, Hq, D]"""
    num_kv_heads, head_dim = cache.shape[3], cache.shape[4]
    batch = decodes.context_lens.shape[0]
    flat = cache.view(2, -1, num_kv_heads, head_dim)  # [2, num_blocks * block_size, Hkv, D]
    kv = flat.index_select(1, decodes.slots).view(2, batch, -1, num_kv_heads, head_dim).transpose(2, 3)  # [2,B,Hkv,L,D]
    q = query
    mask = decodes.key_mask
    if sliding_window is not None:
        mask = _decode_keys_mask(decodes.context_lens, kv.shape[3], sliding_window)
    # The query heads of one KV head become that head's query rows ([B, Hkv, Hq/Hkv, D]): plain attention, no GQA
    # expansion, which keeps a fused SDPA kernel eligible with a mask (enable_gqa with a mask falls back to math).
    grouped = q.view(batch, num_kv_heads, q.shape[1] // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, kv[0].to(q.dtype), kv[1].to(q.dtype), attn_mask=mask,
                                         scale=scale)  # [B, Hkv, Hq/Hkv, D]
    return out.reshape(batch, q.shape[1], head_dim)
