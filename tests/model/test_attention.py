"""Paged attention over scattered blocks equals dense causal attention; chunked prefill equals one shot."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.model.attention import AttentionMetadata, paged_attention, write_kv

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
    import pytest

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
