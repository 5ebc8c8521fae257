"""Paged attention over scattered blocks equals dense causal attention; chunked prefill equals one shot."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from services.model.attention import AttentionMetadata, paged_attention, prefill_batch, write_kv

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def _dense(q, k, v, window=None):
    """Reference: causal attention of a whole sequence, GQA by repeating KV heads."""
    n = q.shape[0]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    if window is not None:
        pos = torch.arange(n)
        mask &= (pos[:, None] - pos[None, :]) < window
    rep = HEADS // KV_HEADS
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1), v.repeat_interleave(rep, 1).transpose(0, 1),
        attn_mask=mask, scale=DIM**-0.5)
    return out.transpose(0, 1)


def _run(chunks, q, k, v, table, window=None):
    cache = torch.zeros(2, 16, BLOCK, KV_HEADS, DIM)
    outs, start = [], 0
    for length in chunks:
        meta = AttentionMetadata.build([start], [length], [table], BLOCK, torch.device("cpu"))
        write_kv(cache, k[start:start + length], v[start:start + length], meta.slot_mapping)
        outs.append(paged_attention(q[start:start + length], cache, meta, DIM**-0.5, window))
        start += length
    return torch.cat(outs), cache


def test_scattered_blocks_and_chunks_equal_dense():
    torch.manual_seed(0)
    n = 11
    q, k, v = torch.randn(n, HEADS, DIM), torch.randn(n, KV_HEADS, DIM), torch.randn(n, KV_HEADS, DIM)
    table = [9, 2, 14]  # non-contiguous, out of order
    expected = _dense(q, k, v)
    for chunks in ([11], [5, 6], [3, 1, 1, 6], [1] * 11):
        out, cache = _run(chunks, q, k, v, table)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Token 5 lives in the second block (id 2) at offset 1.
    torch.testing.assert_close(cache[0, 2, 1], k[5])


def test_sliding_window():
    torch.manual_seed(1)
    n = 10
    q, k, v = torch.randn(n, HEADS, DIM), torch.randn(n, KV_HEADS, DIM), torch.randn(n, KV_HEADS, DIM)
    out, _ = _run([4, 1, 5], q, k, v, [0, 1, 2], window=3)
    torch.testing.assert_close(out, _dense(q, k, v, window=3), atol=1e-5, rtol=1e-5)


def test_batch_of_sequences_is_independent():
    torch.manual_seed(2)
    lengths, tables = [3, 7], [[0, 1], [5, 3]]
    qs = [torch.randn(n, HEADS, DIM) for n in lengths]
    ks = [torch.randn(n, KV_HEADS, DIM) for n in lengths]
    vs = [torch.randn(n, KV_HEADS, DIM) for n in lengths]
    cache = torch.zeros(2, 8, BLOCK, KV_HEADS, DIM)
    meta = AttentionMetadata.build([0, 0], lengths, tables, BLOCK, torch.device("cpu"))
    write_kv(cache, torch.cat(ks), torch.cat(vs), meta.slot_mapping)
    out = paged_attention(torch.cat(qs), cache, meta, DIM**-0.5)
    torch.testing.assert_close(out[:3], _dense(qs[0], ks[0], vs[0]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[3:], _dense(qs[1], ks[1], vs[1]), atol=1e-5, rtol=1e-5)


def test_short_block_table_is_an_error():
    with pytest.raises(ValueError, match="2 needed for 5 tokens"):
        AttentionMetadata.build([0], [5], [[0]], BLOCK, torch.device("cpu"))


def test_decodes_of_different_lengths_in_one_batch_equal_dense():
    torch.manual_seed(3)
    lengths, tables = [2, 9, 5], [[7], [0, 4, 6], [3, 1]]
    qs = [torch.randn(n, HEADS, DIM) for n in lengths]
    ks = [torch.randn(n, KV_HEADS, DIM) for n in lengths]
    vs = [torch.randn(n, KV_HEADS, DIM) for n in lengths]
    cache = torch.zeros(2, 8, BLOCK, KV_HEADS, DIM)
    prefill = AttentionMetadata.build([0, 0, 0], [n - 1 for n in lengths], tables, BLOCK, torch.device("cpu"))
    write_kv(cache, torch.cat([k[:-1] for k in ks]), torch.cat([v[:-1] for v in vs]), prefill.slot_mapping)
    decode = AttentionMetadata.build([n - 1 for n in lengths], [1, 1, 1], tables, BLOCK, torch.device("cpu"))
    assert decode.decodes is not None and not decode.prefills
    write_kv(cache, torch.stack([k[-1] for k in ks]), torch.stack([v[-1] for v in vs]), decode.slot_mapping)
    out = paged_attention(torch.stack([q[-1] for q in qs]), cache, decode, DIM**-0.5)
    for i in range(3):
        torch.testing.assert_close(out[i], _dense(qs[i], ks[i], vs[i])[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 4])
def test_prefill_chunks_in_one_call_equal_dense(window):
    """The batched prefill (one padded SDPA call for every chunk of a step: what a GPU runs) against dense causal
    attention, with chunks that start mid-sequence, of unequal lengths, beside a decode, and a sliding window."""
    torch.manual_seed(4)
    lengths, tables = [9, 5, 12, 6], [[7, 2, 5], [0, 4], [3, 1, 6, 8], [9, 10]]
    starts, news = [4, 0, 2, 5], [5, 5, 10, 1]  # chunks of 5, 5 and 10 tokens after a cached prefix; one decode
    qs = [torch.randn(n, HEADS, DIM) for n in lengths]
    ks = [torch.randn(n, KV_HEADS, DIM) for n in lengths]
    vs = [torch.randn(n, KV_HEADS, DIM) for n in lengths]
    cache = torch.zeros(2, 12, BLOCK, KV_HEADS, DIM)
    cpu = torch.device("cpu")
    cached = AttentionMetadata.build([0, 0], [4, 2], [tables[0], tables[2]], BLOCK, cpu)
    write_kv(cache, torch.cat([ks[0][:4], ks[2][:2]]), torch.cat([vs[0][:4], vs[2][:2]]), cached.slot_mapping)
    cached = AttentionMetadata.build([0], [5], [tables[3]], BLOCK, cpu)
    write_kv(cache, ks[3][:5], vs[3][:5], cached.slot_mapping)
    meta = AttentionMetadata.build(starts, news, tables, BLOCK, cpu)
    assert meta.prefill_batch is None and len(meta.prefills) == 3  # built on a GPU only; here by hand
    meta = dataclasses.replace(meta, prefill_batch=prefill_batch(meta.prefills, cpu))
    rows = [slice(s, s + n) for s, n in zip(starts, news)]
    write_kv(cache, torch.cat([k[r] for k, r in zip(ks, rows)]), torch.cat([v[r] for v, r in zip(vs, rows)]),
             meta.slot_mapping)
    out = paged_attention(torch.cat([q[r] for q, r in zip(qs, rows)]), cache, meta, DIM**-0.5, window)
    offset = 0
    for q, k, v, r, n in zip(qs, ks, vs, rows, news):
        torch.testing.assert_close(out[offset:offset + n], _dense(q, k, v, window)[r], atol=1e-5, rtol=1e-5)
        offset += n
