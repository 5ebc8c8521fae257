"""--kernels triton (services/model/triton_kernels.py): each fused kernel against the eager ops it replaces, in
float32 and bfloat16, and the model end to end against transformers, on both step paths (the variable-shape step
and the fixed-shape one CUDA graphs replay). On a GPU the kernels compile for it; on a CPU Triton's interpreter
runs them (services/model/kernels.py), so their logic is tested in CI too.

Tolerances: float32 within float rounding (the kernels add in another order); bfloat16 within 4 ulps or 2^-6 (the eager
path rounds after each op, the kernels once; and the interpreter's float32 -> bfloat16 cast truncates)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:  # not imported here: on a CPU kernels.choose sets up its interpreter
    pytest.skip("no triton package", allow_module_level=True)

from services.contracts.step import SequenceStep, StepBatch  # noqa: E402
from services.model.attention import AttentionMetadata, paged_attention  # noqa: E402
from services.model.kernels import TORCH, choose  # noqa: E402
from services.model.layers import RotaryEmbedding  # noqa: E402
from services.model.spec import ModelSpec, RopeSpec  # noqa: E402
from tests.conftest import hf_greedy, make_checkpoint  # noqa: E402
from tests.model.kernel_checks import DEVICE, close  # noqa: E402

TRITON = choose("triton", DEVICE)
DTYPES = (torch.float32, torch.bfloat16)


def randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_add_rms_norm(dtype, hidden):
    x, delta = randn(5, hidden, dtype=dtype, seed=1), randn(5, hidden, dtype=dtype, seed=2)
    weight = 1 + randn(hidden, dtype=dtype, seed=3) / 10
    for d in (delta, None):
        (total, normed), (want_total, want_normed) = (kernels.add_rms_norm(x, d, weight, 1e-5)
                                                      for kernels in (TRITON, TORCH))
        close(total, want_total)
        close(normed, want_normed)
    assert TRITON.add_rms_norm(x[:0], delta[:0], weight, 1e-5)[1].shape == (0, hidden)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    gate_up = randn(3, 2 * 1300, dtype=dtype) * 3  # wider than one program's block
    close(TRITON.silu_mul(gate_up), TORCH.silu_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
@pytest.mark.parametrize("padded", [False, True], ids=["rows", "write-rows"])
def test_rotary_write_kv(dtype, qk_norm, padded):
    num_q, num_kv, head_dim, tokens = 6, 2, 16, 6
    rope = RotaryEmbedding(RopeSpec(theta=10000.0), head_dim, DEVICE)
    cos, sin = rope.cos_sin(torch.tensor([0, 3, 5, 7, 9, 11], device=DEVICE), dtype)
    qkv = randn(tokens, (num_q + 2 * num_kv) * head_dim, dtype=dtype)
    q_norm, k_norm = (1 + randn(head_dim, dtype=dtype, seed=s) / 10 for s in (4, 5)) if qk_norm else (None, None)
    # a padded graph batch: rows 4 and 5 repeat row 0 and write its slot again
    slots = torch.tensor([1, 5, 9, 13, 1, 1] if padded else [1, 5, 9, 13, 2, 3], device=DEVICE)
    rows = torch.tensor([0, 1, 2, 3, 0, 0], device=DEVICE) if padded else None
    caches = [torch.zeros(2, 8, 4, num_kv, head_dim, dtype=dtype, device=DEVICE) for _ in range(2)]
    q, want_q = (kernels.rotary_write_kv(qkv, num_q, num_kv, head_dim, cos, sin, cache, slots, rows, q_norm,
                                         k_norm, 1e-6) for kernels, cache in zip((TRITON, TORCH), caches))
    close(q, want_q)
    close(caches[0], caches[1])
    written = caches[0].view(2, 8 * 4, -1).any(dim=-1)  # [K/V, slot]
    assert written.nonzero()[:, 1].unique().tolist() == sorted(set(slots.tolist()))  # its slots, no other


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2, 16), (6, 2, 24), (8, 8, 32)], ids=["gqa2", "gqa3-d24", "mha"])
@pytest.mark.parametrize("window", [None, 50])
def test_decode_attention(dtype, heads, window):
    """Contexts of 1 key to several splits' worth, GQA groups of 1 to 3 (a non-power-of-two one), head dims not a
    power of two, a sliding window: as the padded SDPA over gathered keys computes them."""
    num_q, num_kv, head_dim = heads
    block_size, num_blocks = 4, 300
    cache = randn(2, num_blocks, block_size, num_kv, head_dim, dtype=dtype, seed=7)
    lengths = [1, 7, 33, 900, 130]
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(8)).tolist()
    tables, used = [], 0
    for length in lengths:  # scattered blocks, none shared
        need = -(-length // block_size)
        tables.append(order[used: used + need])
        used += need
    meta = AttentionMetadata.build([n - 1 for n in lengths], [1] * len(lengths), tables, block_size, DEVICE)
    query = randn(len(lengths), num_q, head_dim, dtype=dtype, seed=9)
    got = paged_attention(query, cache, meta, head_dim ** -0.5, window, decode=TRITON.decode_attention)
    close(got, paged_attention(query, cache, meta, head_dim ** -0.5, window))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2, 16), (6, 2, 24)], ids=["gqa2", "gqa3-d24"])
@pytest.mark.parametrize("window", [None, 20])
def test_a_mixed_step_in_one_launch_per_kind(dtype, heads, window):
    """Decodes and prefill chunks of a step: chunks of 1 to 70 tokens (tiles of 32 queries: past a chunk's end, a
    tile is skipped), from position 0 and from later ones (a chunked prompt's second chunk), two decodes among
    them; the kernels as the eager SDPA path computes them."""
    num_q, num_kv, head_dim = heads
    block_size = 4
    cache = randn(2, 80, block_size, num_kv, head_dim, dtype=dtype, seed=3)
    # (start position, new tokens): a decode, a chunk from 0, a later chunk, a decode, a 2-token chunk
    rows = [(9, 1), (0, 70), (37, 30), (20, 1), (5, 2)]
    tables, used = [], 0
    for start, new in rows:
        need = -(-(start + new) // block_size)
        tables.append(list(range(used, used + need))[::-1])  # blocks in reverse: the slot table matters
        used += need
    starts, lengths = [r[0] for r in rows], [r[1] for r in rows]
    meta = AttentionMetadata.build(starts, lengths, tables, block_size, DEVICE)
    fused = AttentionMetadata.build(starts, lengths, tables, block_size, DEVICE, prefill_kernel=True)
    assert fused.prefill_batch is not None and fused.prefill_batch.mask is None
    query = randn(sum(lengths), num_q, head_dim, dtype=dtype, seed=4)
    close(paged_attention(query, cache, fused, head_dim ** -0.5, window, decode=TRITON.decode_attention,
                          prefill=TRITON.prefill_attention),
          paged_attention(query, cache, meta, head_dim ** -0.5, window))


def test_a_decode_tile_takes_fewer_keys_for_wider_groups_and_heads():
    from services.model.triton_kernels import decode_block_n

    assert [decode_block_n(g, d) for g, d in ((1, 64), (4, 64), (3, 24), (8, 128), (16, 128))] == [64, 32, 64, 16, 16]


@pytest.mark.parametrize("style", ["llama", "qwen3", "mistral", "qwen3_moe"])
def test_the_model_with_triton_kernels_generates_what_transformers_does(tmp_path, style):
    """Greedy tokens equal transformers' on the variable-shape step and on the fixed-shape (graph) step; logits
    close to the torch kernels' (qwen3: the per-head q/k norms inside the rotary kernel; mistral: its window;
    qwen3_moe: sparse layers beside the fused attention)."""
    from tests.worker.helpers import in_process_runner

    model_dir = make_checkpoint(tmp_path / style, style, seed=3)
    spec = ModelSpec.from_dir(model_dir)
    prompts = [list(range(3, 3 + 40)), [7, 8, 9]]
    tables = [tuple(range(0, 20)), tuple(range(20, 30))]
    num_new = 6
    expected, _ = hf_greedy(model_dir, prompts, num_new)
    runners = {name: in_process_runner(spec, model_dir, graphs, device=DEVICE, kernels=kernels)
               for name, graphs, kernels in (("torch", False, "torch"), ("triton", False, "triton"),
                                             ("triton-graph", True, "triton"))}
    try:
        outputs = {}
        for name, runner in runners.items():
            tokens = [[] for _ in prompts]
            seqs = tuple(SequenceStep(f"r{i}", tuple(p), 0, t) for i, (p, t) in enumerate(zip(prompts, tables)))
            for i, out in enumerate(runner.execute(StepBatch(0, seqs), 0).outputs):
                tokens[i].append(out.token_id)
            for step in range(1, num_new):
                seqs = tuple(SequenceStep(f"r{i}", (tokens[i][-1],), len(p) + step - 1, t, return_logits=True)
                             for i, (p, t) in enumerate(zip(prompts, tables)))
                result = runner.execute(StepBatch(step, seqs), 0)
                for i, out in enumerate(result.outputs):
                    tokens[i].append(out.token_id)
            outputs[name] = tokens
        assert outputs == {name: expected for name in runners}
        for a, b in zip(runners["torch"].kv_cache.layers, runners["triton"].kv_cache.layers, strict=True):
            close(b, a)
        assert runners["triton-graph"].graphs.num_graphs == 1
    finally:
        for runner in runners.values():
            runner.kv_cache.close()


def test_kernels_are_refused_by_name_and_beside_invariant_numerics():
    from services.contracts.numerics import check_compute

    with pytest.raises(ValueError, match="kernels must be one of torch, triton"):
        choose("cutlass", DEVICE)
    with pytest.raises(ValueError, match="numerics 'invariant' computes with its own kernels"):
        check_compute("auto", "invariant", "triton")
    check_compute("bfloat16", "fast", "triton")
