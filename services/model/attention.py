"""Paged attention over a block-table KV cache (prefill and decode), CPU-friendly via torch SDPA."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class SequenceSlice:
    """Where one sequence's new tokens sit in a step's flattened token array."""

    token_start: int          # index of its first new token in the step's [T] arrays
    num_new_tokens: int
    context_len: int          # cached + new tokens after this step
    block_table: torch.Tensor  # [num_blocks_used] global block ids, int64


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """The step's single-token sequences, attended to in one padded SDPA call instead of one call each."""

    token_index: torch.Tensor   # [B] index of each decode token in the step's [T] arrays
    block_tables: torch.Tensor  # [B, max_blocks] padded with block 0 (masked out)
    key_mask: torch.Tensor      # [B, 1, 1, max_blocks * block_size] True where the key is in the context


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-step attention inputs shared by every layer of a worker."""

    sequences: tuple[SequenceSlice, ...]   # every sequence of the step, in batch order
    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) of each new token
    block_size: int
    prefills: tuple[SequenceSlice, ...] = ()  # multi-token sequences, attended one by one
    decodes: DecodeBatch | None = None        # single-token sequences, attended in one call

    @classmethod
    def build(cls, starts: list[int], lengths: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device) -> AttentionMetadata:
        """From each sequence's start position, number of new tokens and block table."""
        sequences, slots, token_start = [], [], 0
        for start, length, table in zip(starts, lengths, block_tables, strict=True):
            context_len = start + length
            needed = -(-context_len // block_size)
            if len(table) < needed:
                raise ValueError(
                    f"block table has {len(table)} blocks, {needed} needed for {context_len} tokens"
                )
            table_t = torch.tensor(table[:needed], dtype=torch.int64, device=device)
            positions = torch.arange(start, context_len, device=device)
            slots.append(table_t[positions // block_size] * block_size + positions % block_size)
            sequences.append(SequenceSlice(token_start, length, context_len, table_t))
            token_start += length
        slot_mapping = torch.cat(slots) if slots else torch.empty(0, dtype=torch.int64, device=device)
        decodes = [s for s in sequences if s.num_new_tokens == 1]
        prefills = tuple(s for s in sequences if s.num_new_tokens != 1)
        return cls(tuple(sequences), slot_mapping, block_size, prefills, _decode_batch(decodes, block_size, device))


def write_kv(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new keys/values. cache [2, num_blocks, block_size, kv_heads, D]; key/value [T, kv_heads, D]."""
    num_blocks, block_size = cache.shape[1], cache.shape[2]
    flat = cache.view(2, num_blocks * block_size, cache.shape[3], cache.shape[4])
    flat[0].index_copy_(0, slot_mapping, key.to(cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(cache.dtype))


def paged_attention(query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of new tokens over their sequence's cached context.

    query [T, q_heads, D]; cache [2, num_blocks, block_size, kv_heads, D] (already holding this step's KV);
    returns [T, q_heads, D]. Query heads map to KV heads in contiguous groups (GQA).
    """
    out = torch.empty_like(query)
    num_kv_heads, head_dim = cache.shape[3], cache.shape[4]
    if meta.decodes is not None:
        out[meta.decodes.token_index] = _batched_decode(query, cache, meta.decodes, scale, sliding_window)
    for seq in meta.prefills:
        q = query[seq.token_start: seq.token_start + seq.num_new_tokens]  # [n, Hq, D]
        kv = cache[:, seq.block_table].reshape(2, -1, num_kv_heads, head_dim)[:, : seq.context_len]
        k, v = kv[0].to(q.dtype), kv[1].to(q.dtype)  # [ctx, Hkv, D]
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


def _decode_batch(decodes: list[SequenceSlice], block_size: int, device: torch.device) -> DecodeBatch | None:
    if not decodes:
        return None
    max_blocks = max(len(s.block_table) for s in decodes)
    tables = torch.zeros(len(decodes), max_blocks, dtype=torch.int64, device=device)
    for i, seq in enumerate(decodes):
        tables[i, : len(seq.block_table)] = seq.block_table
    lengths = torch.tensor([s.context_len for s in decodes], device=device)
    key_mask = torch.arange(max_blocks * block_size, device=device)[None, :] < lengths[:, None]
    index = torch.tensor([s.token_start for s in decodes], dtype=torch.int64, device=device)
    return DecodeBatch(index, tables, key_mask[:, None, None, :])


def _batched_decode(query: torch.Tensor, cache: torch.Tensor, decodes: DecodeBatch, scale: float,
                    sliding_window: int | None) -> torch.Tensor:
    """One new token per sequence: gather each sequence's blocks (padded), mask past its length. -> [B, Hq, D]"""
    num_kv_heads, head_dim = cache.shape[3], cache.shape[4]
    batch, max_blocks = decodes.block_tables.shape
    kv = cache[:, decodes.block_tables]  # [2, B, max_blocks, block_size, Hkv, D]
    kv = kv.reshape(2, batch, -1, num_kv_heads, head_dim).transpose(2, 3)  # [2, B, Hkv, L, D]
    q = query[decodes.token_index].unsqueeze(2)  # [B, Hq, 1, D]
    mask = decodes.key_mask
    if sliding_window is not None:
        lengths = mask.sum(-1, keepdim=True)
        positions = torch.arange(mask.shape[-1], device=mask.device)
        mask = mask & (positions > lengths - 1 - sliding_window)  # key within the window of the new token
    out = F.scaled_dot_product_attention(q, kv[0].to(q.dtype), kv[1].to(q.dtype), attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.squeeze(2)
