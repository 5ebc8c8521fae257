"""A TP layout's experts as two grouped GEMMs (services/model/triton_moe.py, --kernels triton) against the product per
expert of the torch kernels, in float32 and bfloat16, from one token to a prefill's worth; the load they count (a
padded graph's repeated rows left out); the table the kernels read the experts through, refreshed in place when an
in-place switch's rollback brings the experts back. On a CPU Triton's interpreter runs the kernels. Tolerances as
tests/model/test_triton_kernels.py's."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("no triton package", allow_module_level=True)

from services.model.expert_table import ExpertTable  # noqa: E402
from services.model.kernels import choose  # noqa: E402
from services.model.layers import ShardLoader, SingleRankGroup  # noqa: E402
from services.model.moe import SparseMoeBlock  # noqa: E402
from services.topology import Topology, place  # noqa: E402
from tests.model.kernel_checks import DEVICE, close  # noqa: E402
from tests.model.moe_blocks import HIDDEN, block_spec, block_tensors, tokens  # noqa: E402

TRITON = choose("triton", DEVICE)


def _blocks(style: str, dtype: torch.dtype, topology: Topology = Topology(1, 1), rank: int = 0):
    """(spec, tensors, loader, the block with torch's kernels, the block with the grouped experts). The grouped
    block routes with torch's ops here (test_the_router_in_one_launch checks the router kernel): in bf16 a weight
    an ulp apart can move a sum that cancels by more than the tolerance."""
    spec = block_spec(style)
    tensors = block_tensors(spec)
    loader = ShardLoader(tensors.__getitem__, set(tensors), dtype, DEVICE)
    wp = place(topology, spec.shape).workers[rank]
    eager = SparseMoeBlock(spec, wp, 0, loader, SingleRankGroup())
    grouped = SparseMoeBlock(spec, wp, 0, loader, SingleRankGroup(),
                             kernels=dataclasses.replace(TRITON, moe_route=None))
    return spec, tensors, loader, eager, grouped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("style", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("count", [1, 7, 300])  # 300 tokens x top-2: past 1,024 assignments, tiles of 64 rows
def test_grouped_experts_equal_the_product_per_expert(style, dtype, count):
    spec, tensors, _, eager, grouped = _blocks(style, dtype)
    assert grouped.graphable and not eager.graphable
    x = tokens(spec, tensors, count, seed=count, hot_expert=None).to(device=DEVICE, dtype=dtype)
    close(grouped(x), eager(x))
    assert torch.equal(grouped.take_load(), eager.take_load())


@pytest.mark.parametrize("num_slots,top_k,tokens", [(8, 2, 3), (20, 4, 700), (128, 8, 1100)])
def test_the_tile_table_of_one_launch(num_slots, top_k, tokens):
    """_align_kernel's counts, first rows, first tiles and every tile's slot against torch's, and the load it adds
    (padding rows left out): from a decode's handful of assignments to 8,800 (a prefill's, three chunks of the
    kernel's loop over them)."""
    from services.model.triton_moe import _tile_table, block_m

    generator = torch.Generator().manual_seed(tokens)
    flat = torch.randint(0, num_slots, (tokens * top_k,), generator=generator).to(DEVICE)
    repeats = torch.arange(tokens, device=DEVICE)
    repeats[tokens // 2:] = 0  # the second half: padding rows repeating row 0
    load = torch.full((num_slots,), 5, dtype=torch.int64, device=DEVICE)
    rows_per_tile = block_m(flat.numel())
    counts, starts, tile_starts, tile_slot = _tile_table(flat, num_slots, rows_per_tile, top_k, load, repeats)
    expected = torch.bincount(flat, minlength=num_slots)
    tiles = (expected + rows_per_tile - 1) // rows_per_tile
    assert torch.equal(counts.long(), expected)
    assert torch.equal(starts.long(), torch.cumsum(expected, 0) - expected)
    assert torch.equal(tile_starts.long(), torch.cumsum(tiles, 0) - tiles)
    ids = torch.arange(tile_slot.numel(), device=DEVICE)
    owner = torch.searchsorted(torch.cumsum(tiles, 0), ids, right=True)
    used = owner < num_slots
    assert torch.equal(tile_slot.long()[used], owner[used]) and bool((tile_slot.long()[~used] >= num_slots).all())
    real = flat.view(tokens, top_k)[repeats == torch.arange(tokens, device=DEVICE)].reshape(-1)  # the first half
    assert torch.equal(load, 5 + torch.bincount(real, minlength=num_slots))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_experts,top_k,renormalize", [(8, 2, True), (60, 4, False), (128, 8, True)])
def test_the_router_in_one_launch(num_experts, top_k, renormalize, dtype):
    """triton_moe.route against moe.route's softmax, top-k and renormalisation: the same experts, in order, and
    weights within float rounding (cast to the weights' dtype)."""
    from services.model import moe, triton_moe

    generator = torch.Generator().manual_seed(num_experts)
    x = torch.randn(37, 16, generator=generator).to(device=DEVICE, dtype=dtype)
    router = torch.randn(num_experts, 16, generator=generator).to(device=DEVICE, dtype=dtype)
    expected_weights, expected_ids = moe.route(x, router, top_k, renormalize, cast_weights=True)
    weights, ids = triton_moe.route(torch.nn.functional.linear(x, router), top_k, renormalize, dtype)
    assert torch.equal(ids, expected_ids)
    close(weights, expected_weights)


def test_a_block_with_the_router_kernel_equals_torchs():
    """The grouped block with every Triton kernel, the router's included, against torch's block (float32)."""
    spec = block_spec("qwen3_moe")
    tensors = block_tensors(spec)
    loader = ShardLoader(tensors.__getitem__, set(tensors), torch.float32, DEVICE)
    wp = place(Topology(1, 1), spec.shape).workers[0]
    x = tokens(spec, tensors, 40, seed=6, hot_expert=None).to(DEVICE)
    eager = SparseMoeBlock(spec, wp, 0, loader, SingleRankGroup())
    close(SparseMoeBlock(spec, wp, 0, loader, SingleRankGroup(), kernels=TRITON)(x), eager(x))


def test_a_tp_slice_of_the_experts_gives_its_partial_sums():
    """tp2's rank 1 holds the second half of every expert's intermediate columns: its partial output equals the
    per-expert path's (the all-reduce adds the halves)."""
    spec, tensors, _, eager, grouped = _blocks("qwen3_moe", torch.float32, Topology(tp=2), rank=1)
    assert grouped.table.intermediate == spec.moe_intermediate_size // 2
    x = tokens(spec, tensors, 9, seed=1, hot_expert=3).to(DEVICE)
    close(grouped(x), eager(x))


def test_padding_rows_are_computed_but_not_counted():
    spec, tensors, _, _, grouped = _blocks("qwen3_moe", torch.float32)
    x = tokens(spec, tensors, 3, seed=2, hot_expert=None).to(DEVICE)
    grouped(x[:2])
    real = grouped.take_load()
    padded = torch.cat([x[:2], x[:1].expand(2, HIDDEN)])  # a batch of 2 padded to 4 by repeating row 0
    out = grouped(padded, repeats=torch.tensor([0, 1, 0, 0], device=DEVICE))
    assert torch.equal(grouped.take_load(), real) and int(real.sum()) == 2 * spec.num_experts_per_tok
    torch.testing.assert_close(out[2:], out[:1].expand(2, HIDDEN))


def test_an_in_place_switch_and_its_rollback_refresh_the_table_in_place():
    spec, tensors, loader, _, grouped = _blocks("qwen3_moe", torch.float32)
    x = tokens(spec, tensors, 5, seed=4, hot_expert=None).to(DEVICE)
    before = grouped(x)
    offsets = grouped.table.gate_up_offsets  # what a captured graph reads
    grouped.release_experts()
    with pytest.raises(RuntimeError, match="restore them first"):
        grouped(x)
    grouped.restore_experts(loader)
    assert grouped.table.gate_up_offsets is offsets
    torch.testing.assert_close(grouped(x), before, atol=0, rtol=0)


def test_experts_the_kernels_cannot_read_in_place_keep_the_product_per_expert():
    gate_up, down = torch.zeros(8, 4, device=DEVICE), torch.zeros(4, 4, device=DEVICE)
    assert ExpertTable.build([(gate_up, down), (gate_up.clone(), down.clone())]) is not None
    assert ExpertTable.build([(gate_up, down), (gate_up, down.t())]) is None  # not contiguous
    assert ExpertTable.build([(gate_up, down), (gate_up[:6], down)]) is None  # another slice's shape
    assert ExpertTable.build([(gate_up, down), (gate_up.double(), down)]) is None
    assert ExpertTable.build([]) is None


def test_ep_layouts_and_invariant_numerics_keep_the_product_per_expert():
    from services.model.numerics import invariant_numerics

    spec = block_spec("qwen3_moe")
    tensors = block_tensors(spec)
    loader = ShardLoader(tensors.__getitem__, set(tensors), torch.float32, DEVICE)
    ep = SparseMoeBlock(spec, place(Topology(ep=2), spec.shape).workers[0], 0, loader, SingleRankGroup(),
                        kernels=TRITON)
    assert not ep.graphable
    invariant = invariant_numerics(4, 64, (1, 2), moe_intermediate_size=spec.moe_intermediate_size)
    block = SparseMoeBlock(spec, place(Topology(1, 1), spec.shape).workers[0], 0, loader, SingleRankGroup(),
                           numerics=invariant, kernels=TRITON)
    assert not block.graphable


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_tp_layouts_moe_decode_is_graphed_with_the_grouped_experts(tmp_path):
    from tests.conftest import make_checkpoint
    from services.model.spec import ModelSpec
    from services.worker.model_runner import ModelRunner
    from tests.worker.helpers import in_process_runner

    model_dir = make_checkpoint(tmp_path / "moe", "qwen3_moe", seed=3)
    spec = ModelSpec.from_dir(model_dir)
    for kernels, refused in (("triton", None), ("torch", "MoE layers route tokens with data-dependent shapes")):
        runner = in_process_runner(spec, model_dir, False, device=DEVICE, kernels=kernels)
        try:
            assert isinstance(runner, ModelRunner)
            why = runner.graph_support()
            assert why == refused or (refused is not None and why.startswith(refused))
        finally:
            runner.kv_cache.close()
