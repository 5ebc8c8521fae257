"""Weight shard slices (checked against what the sharded model loads) and shard reload plans."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

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
    expert_tensor_names,
    initial_phy2log,
    place,
    plan_weight_reload,
    rebalance,
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


# --- mixture of experts -------------------------------------------------------------------------------------------

def make_moe_shape(num_layers: int = 3, moe_layers: tuple[int, ...] = (0, 2), num_experts: int = 4,
                   num_kv_heads: int = 2) -> ModelShape:
    return ModelShape(num_layers=num_layers, num_heads=4, num_kv_heads=num_kv_heads, head_dim=4, hidden_size=16,
                      intermediate_size=24, vocab_size=100, num_experts=num_experts, num_experts_per_tok=2,
                      moe_intermediate_size=12, moe_layers=moe_layers)


QWEN3_MOE = WeightFlags(qk_norm=True, moe_style="qwen3_moe")
MIXTRAL = WeightFlags(moe_style="mixtral")


def _hf_config(style: str):
    import transformers

    common = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4, vocab_size=100,
                  num_experts_per_tok=2, tie_word_embeddings=False)
    if style == "qwen3_moe":  # layer 1 dense (mlp_only_layers), 0 and 2 sparse
        return transformers.Qwen3MoeConfig(**common, num_hidden_layers=3, intermediate_size=24, num_experts=4,
                                           moe_intermediate_size=12, mlp_only_layers=[1], decoder_sparse_step=1)
    return transformers.MixtralConfig(**common, num_hidden_layers=2, intermediate_size=12, num_local_experts=4)


@pytest.mark.parametrize(("flags", "shape"), [(QWEN3_MOE, make_moe_shape()),
                                               (MIXTRAL, make_moe_shape(num_layers=2, moe_layers=(0, 1)))])
def test_moe_shard_slices_name_every_tensor_transformers_saves(flags: WeightFlags, shape: ModelShape,
                                                               tmp_path) -> None:
    """tp1pp1 loads every tensor of a checkpoint saved by transformers, whole, under the names and shapes it has."""
    import transformers
    from safetensors import safe_open

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_hf_config(flags.moe_style)).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as checkpoint:
        saved = {name: tuple(checkpoint.get_slice(name).get_shape()) for name in checkpoint.keys()}
    whole = shard_slices(layout("tp1pp1", shape).workers[0], shape, flags)
    assert {piece.tensor: piece.full_shape for piece in whole} == saved
    assert all(piece.start == 0 and piece.stop == piece.full_shape[piece.dim] for piece in whole)


def test_sparse_layers_hold_router_and_experts_instead_of_the_dense_mlp() -> None:
    shape = make_moe_shape()
    names = {piece.tensor for piece in shard_slices(layout("tp1pp1", shape).workers[0], shape, QWEN3_MOE)}
    assert "model.layers.1.mlp.gate_proj.weight" in names and "model.layers.1.mlp.gate.weight" not in names
    assert "model.layers.0.mlp.gate_proj.weight" not in names and "model.layers.0.mlp.gate.weight" in names
    assert {f"model.layers.2.mlp.experts.{e}.down_proj.weight" for e in range(4)} <= names


def test_tensor_parallel_cuts_every_expert_by_its_intermediate_dimension() -> None:
    shape = make_moe_shape()
    worker = layout("tp2pp1", shape).workers[1]
    slices = shard_slices(worker, shape, QWEN3_MOE)
    assert WeightSlice("model.layers.0.mlp.experts.3.gate_proj.weight", 0, 6, 12, (12, 16)) in slices
    assert WeightSlice("model.layers.0.mlp.experts.3.up_proj.weight", 0, 6, 12, (12, 16)) in slices
    assert WeightSlice("model.layers.0.mlp.experts.3.down_proj.weight", 1, 6, 12, (16, 12)) in slices
    assert WeightSlice("model.layers.0.mlp.gate.weight", 0, 0, 4, (4, 16)) in slices  # the router whole
    assert WeightSlice("model.layers.1.mlp.gate_proj.weight", 0, 12, 24, (24, 16)) in slices  # dense layer as ever


def test_expert_parallel_holds_its_slots_experts_whole_and_attention_whole() -> None:
    shape = make_moe_shape()
    placement = place(Topology.parse("ep2pp1"), shape, num_redundant_experts=2)  # 6 slots, 3 per rank
    phy2log = (3, 0, 3, 1, 2, 0)  # expert 3 twice on rank 0: its slices once
    slices = shard_slices(placement.workers[0], shape, MIXTRAL, {0: phy2log, 2: phy2log})
    experts = {piece.tensor for piece in slices if ".experts." in piece.tensor}
    assert experts == {f"model.layers.{layer}.block_sparse_moe.experts.{e}.w{w}.weight"
                       for layer in (0, 2) for e in (0, 3) for w in (1, 2, 3)}
    assert all(piece.start == 0 and piece.stop == piece.full_shape[piece.dim] for piece in slices)
    assert {piece.tensor for piece in slices} >= {"model.embed_tokens.weight", "lm_head.weight",
                                                  "model.layers.1.mlp.down_proj.weight",
                                                  "model.layers.2.self_attn.k_proj.weight"}
    default = shard_slices(placement.workers[1], shape, MIXTRAL)  # no maps: the initial one
    initial = initial_phy2log(4, 6, 2)
    assert {piece.tensor for piece in default if ".experts." in piece.tensor} == {
        name for layer in (0, 2) for slot in range(3, 6)
        for name in expert_tensor_names("mixtral", layer, initial[slot])}


def test_moe_shard_slices_errors() -> None:
    shape = make_moe_shape()
    worker = layout("tp1pp1", shape).workers[0]
    with pytest.raises(ValueError, match=r"needs WeightFlags.moe_style in \('qwen3_moe', 'mixtral'\), got ''"):
        shard_slices(worker, shape, WeightFlags())
    with pytest.raises(ValueError, match=r"expert map has 3 slots, expected 4"):
        shard_slices(worker, shape, QWEN3_MOE, {0: (0, 1, 2)})
    with pytest.raises(ValueError, match=r"logical experts \[3\] have no physical slot"):
        shard_slices(worker, shape, QWEN3_MOE, {2: (0, 1, 2, 2)})
    dense = make_shape()
    assert shard_slices(layout("tp1pp1", dense).workers[0], dense, WeightFlags()) == shard_slices(
        layout("tp1pp1", dense).workers[0], dense, WeightFlags(), {0: (5, 5)})  # maps of a dense model: unused


def test_weight_flags_read_moe_style() -> None:
    spec = SimpleNamespace(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True, tie_word_embeddings=False,
                           moe_style="qwen3_moe")
    assert WeightFlags.of(spec) == QWEN3_MOE
    assert WeightFlags.of(SimpleNamespace(**(vars(spec) | {"moe_style": ""}))).moe_style == ""


def test_tp2_to_tp1_moe_loads_the_other_half_of_every_expert() -> None:
    shape = make_moe_shape()
    plans = plan_weight_reload(layout("tp2pp1", shape), [0, 1], layout("tp1pp1", shape), [0], QWEN3_MOE)
    down = "model.layers.2.mlp.experts.1.down_proj.weight"
    assert WeightSlice(down, 1, 0, 6, (16, 12)) in plans[0].keep
    assert WeightSlice(down, 1, 6, 12, (16, 12)) in plans[0].load
    assert WeightSlice("model.layers.2.mlp.gate.weight", 0, 0, 4, (4, 16)) in plans[0].keep  # the router: held


def test_expert_map_change_loads_only_the_experts_a_rank_gains() -> None:
    shape = make_moe_shape()
    placement = place(Topology.parse("ep2pp1"), shape, num_redundant_experts=2)
    old_map = initial_phy2log(4, 6, 2)
    new_map = rebalance([1.0, 1.0, 1.0, 100.0], 2, 6, old_map)  # expert 3, on rank 1 only, is hot
    plans = plan_weight_reload(placement, [0, 1], placement, [0, 1], MIXTRAL, {0: old_map, 2: old_map},
                               {0: new_map, 2: new_map})
    for rank in (0, 1):
        slots = placement.workers[rank].expert_slots
        gained = {new_map[s] for s in slots} - {old_map[s] for s in slots}
        lost = {old_map[s] for s in slots} - {new_map[s] for s in slots}
        assert {piece.tensor for piece in plans[rank].load} == {
            name for layer in (0, 2) for e in gained for name in expert_tensor_names("mixtral", layer, e)}
        assert {piece.tensor for piece in plans[rank].drop} == {
            name for layer in (0, 2) for e in lost for name in expert_tensor_names("mixtral", layer, e)}
    assert any(plan.load for plan in plans.values())


@st.composite
def moe_reloads(draw: st.DrawFn):
    num_layers = draw(st.integers(1, 6))
    moe_layers = tuple(sorted(draw(st.sets(st.integers(0, num_layers - 1), min_size=1))))
    shape = make_moe_shape(num_layers, moe_layers, num_experts=draw(st.sampled_from([2, 3, 4, 6, 8])),
                           num_kv_heads=draw(st.sampled_from([1, 2, 4])))
    world = draw(st.integers(1, 8))
    redundant = draw(st.sampled_from([0, 0, 1, 2, 4]))
    candidates = candidate_topologies(shape, world, num_redundant_experts=redundant)
    ends = []
    for _ in range(2):
        topology = draw(st.sampled_from(candidates))
        placement = place(topology, shape, num_redundant_experts=redundant)
        num_physical, ranks = placement.num_physical_experts, topology.stage_size
        maps = {layer: rebalance(draw(st.lists(st.integers(0, 50), min_size=shape.num_experts,
                                               max_size=shape.num_experts)), ranks if topology.ep > 1 else 1,
                                 num_physical) for layer in moe_layers if draw(st.booleans())}
        ends.append((placement, list(draw(st.permutations(range(world)))[: topology.num_workers]), maps))
    return ends, draw(st.sampled_from([QWEN3_MOE, MIXTRAL, WeightFlags(qkv_bias=True, moe_style="mixtral")]))


@given(moe_reloads())
@settings(max_examples=80, deadline=None)
def test_moe_reload_partitions_old_and_new_shards(case) -> None:
    """TP <-> TP, EP <-> EP (any maps), TP <-> EP: keep + load is the new shard, keep + drop the old one; the new
    workers together hold every tensor whole."""
    ((old, old_ranks, old_maps), (new, new_ranks, new_maps)), flags = case
    plans = plan_weight_reload(old, old_ranks, new, new_ranks, flags, old_maps, new_maps)
    old_workers, new_workers = dict(zip(old_ranks, old.workers)), dict(zip(new_ranks, new.workers))
    for rank, reload in plans.items():
        before = shard_slices(old_workers[rank], old.shape, flags, old_maps) if rank in old_workers else frozenset()
        after = shard_slices(new_workers[rank], new.shape, flags, new_maps) if rank in new_workers else frozenset()
        assert coverage(reload.keep | reload.load) == coverage(after)
        assert coverage(reload.keep | reload.drop) == coverage(before)
    whole = shard_slices(place(Topology(), new.shape).workers[0], new.shape, flags)
    held = set().union(*(shard_slices(worker, new.shape, flags, new_maps) for worker in new.workers))
    assert coverage(_disjoint(held)) == coverage(whole)
