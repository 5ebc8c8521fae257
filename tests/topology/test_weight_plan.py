"""Weight shard slices (checked against what the sharded model loads) and shard reload plans."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.model.layers import ShardLoader, SingleRankGroup
from services.model.llama import ShardedCausalLM
from services.model.spec import ModelSpec, RopeSpec
from services.topology import (
    ModelShape,
    Placement,
    Topology,
    WeightFlags,
    WeightSlice,
    candidate_topologies,
    place,
    plan_weight_reload,
    shard_slices,
)

ALL_FLAGS = WeightFlags(qkv_bias=True, o_bias=True, mlp_bias=True, qk_norm=True, tie_word_embeddings=True)


def make_shape(num_layers: int = 4, num_heads: int = 8, num_kv_heads: int = 2, vocab_size: int = 200) -> ModelShape:
    return ModelShape(num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=4,
                      hidden_size=16, intermediate_size=840, vocab_size=vocab_size)


def layout(text: str, shape: ModelShape, partition: list[int] | None = None) -> Placement:
    return place(Topology.parse(text), shape, partition)


def coverage(slices) -> dict[tuple[str, int], list[tuple[int, int]]]:
    """(tensor, dim) -> sorted, merged [start, stop) intervals; asserts the slices do not overlap."""
    intervals: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
    for piece in slices:
        intervals[piece.tensor, piece.dim].append((piece.start, piece.stop))
    merged = {}
    for key, spans in intervals.items():
        spans.sort()
        out = [spans[0]]
        for start, stop in spans[1:]:
            assert start >= out[-1][1], f"overlapping slices of {key}: {spans}"
            out[-1:] = [(out[-1][0], stop)] if start == out[-1][1] else [out[-1], (start, stop)]
        merged[key] = out
    return merged


class RecordingLoader(ShardLoader):
    """A ShardLoader over zero tensors that records every slice the model asks for."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__(lambda name: torch.zeros(shapes[name]), set(shapes), torch.float32, torch.device("cpu"))
        self.shapes = shapes
        self.loaded: set[tuple[str, int, int, int]] = set()

    def full(self, name: str) -> torch.Tensor:
        self.loaded.add((name, 0, 0, self.shapes[name][0]))
        return super().full(name)

    def rows(self, name: str, rows: range) -> torch.Tensor:
        self.loaded.add((name, 0, rows.start, min(rows.stop, self.shapes[name][0])))
        return super().rows(name, rows)

    def cols(self, name: str, cols: range) -> torch.Tensor:
        self.loaded.add((name, 1, cols.start, cols.stop))
        return super().cols(name, cols)


@pytest.mark.parametrize("flags", [WeightFlags(), ALL_FLAGS, WeightFlags(qkv_bias=True, tie_word_embeddings=True),
                                   WeightFlags(o_bias=True, qk_norm=True), WeightFlags(mlp_bias=True)])
@pytest.mark.parametrize("topology", ["tp1pp1", "tp2pp2", "tp4pp1", "tp8pp1"])
def test_shard_slices_are_what_the_sharded_model_loads(flags: WeightFlags, topology: str) -> None:
    shape = make_shape(num_layers=2, vocab_size=130)  # tp8: 64-row vocab slices, the upper ones all padding
    spec = ModelSpec(model_type="qwen3", hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                     num_layers=shape.num_layers, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                     head_dim=shape.head_dim, vocab_size=shape.vocab_size, max_position_embeddings=64,
                     rms_norm_eps=1e-6, rope=RopeSpec(theta=10000.0), tie_word_embeddings=flags.tie_word_embeddings,
                     qkv_bias=flags.qkv_bias, o_bias=flags.o_bias, mlp_bias=flags.mlp_bias, qk_norm=flags.qk_norm)
    assert WeightFlags.of(spec) == flags
    whole = shard_slices(layout("tp1pp1", shape).workers[0], shape, flags)
    assert sum(piece.numel for piece in whole) == spec.num_parameters  # full shapes agree with the spec's count
    shapes = {piece.tensor: piece.full_shape for piece in whole}
    for worker in layout(topology, shape).workers:
        loader = RecordingLoader(shapes)
        ShardedCausalLM(spec, worker, loader, SingleRankGroup())
        expected = {(p.tensor, p.dim, p.start, p.stop) for p in shard_slices(worker, shape, flags)}
        assert {record for record in loader.loaded if record[2] < record[3]} == expected


def test_same_layout_loads_nothing() -> None:
    shape = make_shape()
    tp2pp2 = layout("tp2pp2", shape)
    plans = plan_weight_reload(tp2pp2, [0, 1, 2, 3], tp2pp2, [0, 1, 2, 3], ALL_FLAGS)
    for rank, reload in plans.items():
        assert reload.load == frozenset() and reload.drop == frozenset() and reload.load_bytes(2) == 0
        assert reload.keep == shard_slices(tp2pp2.workers[rank], shape, ALL_FLAGS)


def test_shrink_keeps_the_first_stage_and_loads_the_second() -> None:
    shape = make_shape(num_layers=4)
    plans = plan_weight_reload(layout("tp2pp2", shape), [0, 1, 2, 3], layout("tp2pp1", shape), [0, 1], WeightFlags())
    kept = {piece.tensor for piece in plans[0].keep}
    loaded = {piece.tensor for piece in plans[0].load}
    assert {name for name in kept if name.startswith("model.layers.")} == {
        f"model.layers.{layer}.{part}" for layer in (0, 1) for part in (
            "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
            "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}
    assert "model.embed_tokens.weight" in kept and {"model.norm.weight", "lm_head.weight"} <= loaded
    assert all(name.startswith(("model.layers.2.", "model.layers.3.")) for name in loaded - {
        "model.norm.weight", "lm_head.weight"})
    for rank in (2, 3):  # leaving workers free their whole shard
        assert plans[rank].keep == plans[rank].load == frozenset()
        assert plans[rank].drop == shard_slices(layout("tp2pp2", shape).workers[rank], shape, WeightFlags())


def test_tp2_to_tp1_loads_only_the_missing_half() -> None:
    shape = make_shape(num_layers=1, num_heads=8, num_kv_heads=2)
    plans = plan_weight_reload(layout("tp2pp1", shape), [0, 1], layout("tp1pp1", shape), [0], WeightFlags())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert WeightSlice(q, 0, 0, 16, (32, 16)) in plans[0].keep
    assert WeightSlice(q, 0, 16, 32, (32, 16)) in plans[0].load
    down = "model.layers.0.mlp.down_proj.weight"
    assert WeightSlice(down, 1, 420, 840, (16, 840)) in plans[0].load
    # rank 0 loads the other half of q, k, v, o, gate, up, down and vocabulary rows 128..199 of embed, lm_head
    half_layer = (32 * 16 + 2 * 8 * 16 + 16 * 32 + 3 * 840 * 16) // 2
    assert plans[0].load_bytes(2) == 2 * (half_layer + 2 * 72 * 16)
    full = shard_slices(layout("tp1pp1", shape).workers[0], shape, WeightFlags())
    assert plans[0].keep_bytes(2) + plans[0].load_bytes(2) == sum(p.nbytes(2) for p in full)
    assert plans[1].drop_bytes(4) == 4 * sum(p.numel for p in shard_slices(
        layout("tp2pp1", shape).workers[1], shape, WeightFlags()))


def test_grow_into_standby_loads_everything_there() -> None:
    shape = make_shape()
    new = layout("tp2pp2", shape)
    plans = plan_weight_reload(layout("tp2pp1", shape), [5, 7], new, [5, 7, 1, 2], ALL_FLAGS)
    assert plans[1].load == shard_slices(new.workers[2], shape, ALL_FLAGS) and plans[1].keep == frozenset()
    assert plans[5].load == frozenset()  # same TP rank, a subset of its old layers: all kept
    tied_head = [p for p in plans[1].load if p.tensor == "model.embed_tokens.weight"]
    assert len(tied_head) == 1  # the last stage holds embedding rows as its tied lm_head


@st.composite
def reloads(draw: st.DrawFn):
    num_kv_heads = draw(st.sampled_from([1, 2, 4, 8]))
    shape = make_shape(draw(st.integers(1, 12)), num_kv_heads * draw(st.sampled_from([1, 2, 4])), num_kv_heads,
                       vocab_size=draw(st.integers(1, 300)))
    world = draw(st.integers(1, 8))
    candidates = candidate_topologies(shape, world)
    old_topology, new_topology = draw(st.sampled_from(candidates)), draw(st.sampled_from(candidates))
    order = draw(st.permutations(range(world)))
    new_order = order if draw(st.booleans()) else draw(st.permutations(range(world)))
    flags = WeightFlags(*(draw(st.booleans()) for _ in range(5)))
    return (place(old_topology, shape), list(order[: old_topology.num_workers]), place(new_topology, shape),
            list(new_order[: new_topology.num_workers]), flags)


@given(reloads())
@settings(max_examples=80, deadline=None)
def test_reload_partitions_old_and_new_shards(reload_case) -> None:
    old, old_ranks, new, new_ranks, flags = reload_case
    old_workers, new_workers = dict(zip(old_ranks, old.workers)), dict(zip(new_ranks, new.workers))
    plans = plan_weight_reload(old, old_ranks, new, new_ranks, flags)
    assert set(plans) == set(old_ranks) | set(new_ranks)
    for rank, reload in plans.items():
        before = shard_slices(old_workers[rank], old.shape, flags) if rank in old_workers else frozenset()
        after = shard_slices(new_workers[rank], new.shape, flags) if rank in new_workers else frozenset()
        # keep ∪ load is exactly the new shard; keep ∪ drop is exactly the old one; kept bytes are never loaded
        assert coverage(reload.keep | reload.load) == coverage(after)
        assert coverage(reload.keep | reload.drop) == coverage(before)
        assert reload.load_bytes(2) == 2 * (sum(p.numel for p in after) - sum(p.numel for p in reload.keep))
        if rank in old_workers and rank in new_workers and old_workers[rank] == new_workers[rank]:
            assert reload.load == reload.drop == frozenset()
    # together the new workers hold every tensor of the model, whole (replicas overlap)
    whole = shard_slices(place(Topology(), new.shape).workers[0], new.shape, flags)
    held = set().union(*(shard_slices(worker, new.shape, flags) for worker in new.workers))
    assert coverage(_disjoint(held)) == coverage(whole)


def _disjoint(slices):
    """The same elements as `slices`, cut at every slice bound so that no two pieces overlap."""
    by_key: dict[tuple[str, int], list[WeightSlice]] = defaultdict(list)
    for piece in slices:
        by_key[piece.tensor, piece.dim].append(piece)
    for pieces in by_key.values():
        bounds = sorted({bound for piece in pieces for bound in (piece.start, piece.stop)})
        for start, stop in zip(bounds, bounds[1:]):
            if any(piece.start <= start and stop <= piece.stop for piece in pieces):
                yield pieces[0].with_bounds(start, stop)
