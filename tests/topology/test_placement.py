"""Layer partitions, vocabulary padding, and placement invariants over random shapes and topologies."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.topology import (
    ModelShape,
    Placement,
    Topology,
    TopologyError,
    layer_partition,
    padded_vocab_size,
    place,
    validate,
)


def make_shape(**overrides: int) -> ModelShape:
    dims = dict(
        num_layers=4, num_heads=8, num_kv_heads=2, head_dim=16, hidden_size=128, intermediate_size=704, vocab_size=1000
    )
    return ModelShape(**(dims | overrides))


def bounds(ranges: list[range]) -> list[tuple[int, int]]:
    return [(r.start, r.stop) for r in ranges]


def test_layer_partition_examples() -> None:
    assert bounds(layer_partition(4, 3)) == [(0, 1), (1, 3), (3, 4)]
    assert bounds(layer_partition(5, 3)) == [(0, 2), (2, 4), (4, 5)]
    assert bounds(layer_partition(32, 4)) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert [len(r) for r in layer_partition(30, 4)] == [7, 8, 8, 7]
    assert [len(r) for r in layer_partition(31, 8)] == [4, 4, 4, 4, 4, 4, 4, 3]
    assert bounds(layer_partition(7, 1)) == [(0, 7)]


def test_layer_partition_explicit() -> None:
    assert bounds(layer_partition(32, 3, [20, 6, 6])) == [(0, 20), (20, 26), (26, 32)]
    with pytest.raises(TopologyError, match="layer_partition sums to 31, model has 32 layers"):
        layer_partition(32, 3, [20, 6, 5])
    with pytest.raises(TopologyError, match="layer_partition has 2 entries for pp=3"):
        layer_partition(32, 3, [16, 16])
    with pytest.raises(TopologyError, match="pp=5 exceeds num_layers=4"):
        layer_partition(4, 5)


@given(num_layers=st.integers(1, 64), pp=st.integers(1, 16))
@settings(max_examples=100, deadline=None)
def test_layer_partition_matches_get_pp_indices_rule(num_layers: int, pp: int) -> None:
    if pp > num_layers:
        with pytest.raises(TopologyError):
            layer_partition(num_layers, pp)
        return
    stages = layer_partition(num_layers, pp)
    base, remainder = divmod(num_layers, pp)
    # Stages pp-2, pp-3, ..., pp-1-remainder get one extra layer; the last stage never does.
    extra = set(range(pp - 1 - remainder, pp - 1))
    assert [len(r) for r in stages] == [base + (stage in extra) for stage in range(pp)]
    assert [layer for r in stages for layer in r] == list(range(num_layers))


def test_padded_vocab_size() -> None:
    assert padded_vocab_size(1000, 1) == 1024
    assert padded_vocab_size(1024, 2) == 1024
    assert padded_vocab_size(1025, 2) == 1152
    assert padded_vocab_size(32000, 3) == 32064
    assert padded_vocab_size(151936, 8) == 152064
    with pytest.raises(ValueError):
        padded_vocab_size(0, 2)


def test_kv_heads_replicated_when_fewer_than_tp() -> None:
    placement = place(Topology(tp=4), make_shape(num_heads=8, num_kv_heads=2))
    assert [list(w.kv_heads) for w in placement.workers] == [[0], [0], [1], [1]]
    assert [list(w.q_heads) for w in placement.workers] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(w.num_kv_replicas == 2 for w in placement.workers)
    assert [w.tp_rank for w in placement.owners_of_kv_head(layer=3, kv_head=1)] == [2, 3]


def test_kv_heads_split_when_at_least_tp() -> None:
    placement = place(Topology(tp=2, pp=2), make_shape(num_heads=16, num_kv_heads=4))
    assert [bounds([w.kv_heads]) for w in placement.stage(1)] == [[(0, 2)], [(2, 4)]]
    assert all(w.num_kv_replicas == 1 for w in placement.workers)
    assert placement.owners_of_kv_head(layer=0, kv_head=3) == (placement.worker(0, 1),)


def test_placement_example_tp2pp2() -> None:
    shape = make_shape(num_layers=5, vocab_size=1000)
    placement = place(Topology.parse("tp2pp2"), shape)
    assert placement.padded_vocab_size == 1024
    assert placement.tp_group_indices(1) == [2, 3]
    worker = placement.worker(pp_rank=1, tp_rank=0)
    assert worker.index == 2 and worker.layers == range(3, 5)
    assert worker.intermediate == range(0, 352) and worker.vocab_rows == range(0, 512)
    assert worker.is_last_stage and not worker.is_first_stage
    assert placement.worker(0, 1).is_first_stage and not placement.worker(0, 1).is_last_stage
    assert placement.stage_of_layer(2) == 0 and placement.owners_of_layer(4) == placement.stage(1)
    for bad in [lambda: placement.worker(2, 0), lambda: placement.stage(-1), lambda: placement.owners_of_layer(5)]:
        with pytest.raises(IndexError):
            bad()
    with pytest.raises(IndexError):
        placement.owners_of_kv_head(layer=0, kv_head=2)


def test_place_explicit_partition_and_rejection() -> None:
    placement = place(Topology(pp=2), make_shape(num_layers=6), layer_partition=[5, 1])
    assert [w.layers for w in placement.workers] == [range(0, 5), range(5, 6)]
    with pytest.raises(TopologyError, match="tp=3 does not divide num_heads=8"):
        place(Topology(tp=3), make_shape())


@st.composite
def shapes(draw: st.DrawFn) -> ModelShape:
    num_kv_heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 16]))
    num_heads = num_kv_heads * draw(st.sampled_from([1, 2, 3, 4, 8]))
    # Mostly friendly multiples so that many topologies are valid; sometimes an arbitrary size.
    intermediate_size = draw(st.one_of(st.integers(1, 96).map(lambda k: 64 * k), st.integers(1, 3000)))
    return make_shape(
        num_layers=draw(st.integers(1, 48)),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=draw(st.integers(1, 160_000)),
    )


def check_invariants(placement: Placement, explicit: bool) -> None:
    shape, tp, pp = placement.shape, placement.topology.tp, placement.topology.pp
    assert len(placement.workers) == tp * pp
    assert [w.index for w in placement.workers] == list(range(tp * pp))
    stage_layers = [placement.stage(s)[0].layers for s in range(pp)]
    assert sorted(layer for r in stage_layers for layer in r) == list(range(shape.num_layers))
    assert [layer for r in stage_layers for layer in r] == list(range(shape.num_layers))  # contiguous, in order
    if not explicit:
        sizes = [len(r) for r in stage_layers]
        assert max(sizes) - min(sizes) <= 1
    for layer in range(shape.num_layers):
        assert len({w.pp_rank for w in placement.owners_of_layer(layer)}) == 1

    group_size = shape.num_heads // shape.num_kv_heads
    expected_replicas = tp // shape.num_kv_heads if shape.num_kv_heads < tp else 1
    for pp_rank in range(pp):
        group = placement.stage(pp_rank)
        assert [w.tp_rank for w in group] == list(range(tp))
        assert all(w.pp_rank == pp_rank and w.tp_size == tp and w.pp_size == pp for w in group)
        assert all(w.layers == stage_layers[pp_rank] for w in group)
        for attribute, total in [
            ("q_heads", shape.num_heads),
            ("intermediate", shape.intermediate_size),
            ("vocab_rows", placement.padded_vocab_size),
        ]:
            held = [index for w in group for index in getattr(w, attribute)]
            assert held == list(range(total)), attribute  # exact cover, no overlap, rank order
            assert len({len(getattr(w, attribute)) for w in group}) == 1, attribute
        for w in group:
            assert set(w.kv_heads) == {h // group_size for h in w.q_heads}
            assert w.num_kv_replicas == expected_replicas
        layer = stage_layers[pp_rank][0]
        for kv_head in range(shape.num_kv_heads):
            owners = placement.owners_of_kv_head(layer, kv_head)
            assert len(owners) == expected_replicas
            assert all(kv_head in w.kv_heads for w in owners)
    assert placement.padded_vocab_size >= shape.vocab_size
    assert placement.padded_vocab_size % (64 * tp) == 0
    assert placement.padded_vocab_size - shape.vocab_size < 64 * tp


@given(shape=shapes(), tp=st.integers(1, 8), pp=st.integers(1, 8))
@settings(max_examples=150, deadline=None)
def test_placement_invariants(shape: ModelShape, tp: int, pp: int) -> None:
    topology = Topology(tp=tp, pp=pp)
    try:
        validate(topology, shape, topology.num_workers)
    except TopologyError:
        with pytest.raises(TopologyError):
            place(topology, shape)
        return
    check_invariants(place(topology, shape), explicit=False)


@given(shape=shapes(), tp=st.sampled_from([1, 2, 4]), data=st.data())
@settings(max_examples=60, deadline=None)
def test_placement_invariants_explicit_partition(shape: ModelShape, tp: int, data: st.DataObject) -> None:
    # Entries are usually >= 1, summing to num_layers, for pp = len(partition): both branches run often.
    partition = data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=8))
    if data.draw(st.sampled_from([False] * 7 + [True])):
        partition[data.draw(st.integers(0, len(partition) - 1))] = 0
    num_layers = max(1, sum(partition) + data.draw(st.sampled_from([0, 0, 0, 1, -1])))
    shape = dataclasses.replace(shape, num_layers=num_layers)
    topology = Topology(tp=tp, pp=data.draw(st.sampled_from([len(partition), len(partition), len(partition) + 1])))
    try:
        validate(topology, shape, topology.num_workers, partition)
    except TopologyError:
        with pytest.raises(TopologyError):
            place(topology, shape, partition)
        return
    placement = place(topology, shape, partition)
    check_invariants(placement, explicit=True)
    assert [len(placement.stage(s)[0].layers) for s in range(topology.pp)] == partition


# --- expert parallelism -------------------------------------------------------------------------------------------

def make_moe_shape(**overrides) -> ModelShape:
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, moe_layers=(1, 2, 3))
    return make_shape(**(moe | overrides))


def test_expert_parallel_placement_example() -> None:
    shape = make_moe_shape(num_layers=5, moe_layers=(0, 2, 4))
    placement = place(Topology.parse("ep2pp2"), shape, num_redundant_experts=2)
    assert placement.num_physical_experts == 10 and placement.padded_vocab_size == 1024
    assert placement.tp_group_indices(1) == [2, 3]
    worker = placement.worker(pp_rank=1, tp_rank=1)
    assert worker.index == 3 and worker.layers == range(3, 5) and worker.is_last_stage
    assert (worker.ep_rank, worker.ep_size, worker.stage_rank, worker.dp_rank) == (1, 2, 1, 1)
    assert (worker.tp_rank, worker.tp_size, worker.num_kv_replicas) == (0, 1, 1)
    assert worker.expert_slots == range(5, 10) and worker.expert_intermediate == range(96)
    assert worker.q_heads == range(8) and worker.kv_heads == range(2)  # data-parallel attention: every head
    assert worker.intermediate == range(704) and worker.vocab_rows == range(1024)
    assert [w.expert_slots for w in placement.stage(0)] == [range(0, 5), range(5, 10)]
    assert placement.owners_of_kv_head(layer=0, kv_head=1) == placement.stage(0)  # each for its own requests
    with pytest.raises(IndexError):
        placement.worker(0, 2)


def test_tensor_parallel_moe_placement_splits_every_expert() -> None:
    placement = place(Topology(tp=4), make_moe_shape(), num_redundant_experts=4)  # redundancy is EP-only
    assert placement.num_physical_experts == 8
    assert [w.expert_intermediate for w in placement.workers] == [range(0, 24), range(24, 48), range(48, 72),
                                                                 range(72, 96)]
    assert all(w.expert_slots == range(8) and w.ep_size == 1 and w.ep_rank == 0 for w in placement.workers)
    assert [w.stage_rank for w in placement.workers] == [0, 1, 2, 3]
    assert place(Topology(tp=2), make_shape()).workers[1].expert_slots == range(0)  # dense: no experts


def test_expert_parallel_placement_rejections() -> None:
    with pytest.raises(TopologyError, match=r"^ep=2 needs a mixture-of-experts model \(this one is dense\)$"):
        place(Topology(ep=2), make_shape())
    with pytest.raises(TopologyError, match=r"^ep=4 does not divide the 10 physical experts \(8 \+ 2 redundant\)$"):
        place(Topology(ep=4), make_moe_shape(), num_redundant_experts=2)
    with pytest.raises(TopologyError, match=r"^tp=4 does not divide the experts' moe_intermediate_size=90$"):
        place(Topology(tp=4), make_moe_shape(moe_intermediate_size=90))


@st.composite
def moe_shapes(draw: st.DrawFn) -> ModelShape:
    shape = draw(shapes())
    num_layers = shape.num_layers
    moe_layers = tuple(sorted(draw(st.sets(st.integers(0, num_layers - 1), min_size=1, max_size=num_layers))))
    num_experts = draw(st.integers(1, 64))
    return dataclasses.replace(shape, num_experts=num_experts, num_experts_per_tok=draw(st.integers(1, num_experts)),
                               moe_intermediate_size=draw(st.integers(1, 512)), moe_layers=moe_layers)


@given(shape=moe_shapes(), ep=st.integers(2, 8), pp=st.integers(1, 6), redundant=st.integers(0, 16))
@settings(max_examples=150, deadline=None)
def test_expert_parallel_placement_invariants(shape: ModelShape, ep: int, pp: int, redundant: int) -> None:
    topology = Topology(ep=ep, pp=pp)
    try:
        validate(topology, shape, topology.num_workers, num_redundant_experts=redundant)
    except TopologyError:
        with pytest.raises(TopologyError):
            place(topology, shape, num_redundant_experts=redundant)
        return
    placement = place(topology, shape, num_redundant_experts=redundant)
    num_physical = shape.num_experts + redundant
    assert placement.num_physical_experts == num_physical
    assert [w.index for w in placement.workers] == list(range(ep * pp))
    assert placement.padded_vocab_size == padded_vocab_size(shape.vocab_size, 1)
    stage_layers = layer_partition(shape.num_layers, pp)
    for pp_rank in range(pp):
        group = placement.stage(pp_rank)
        assert [w.ep_rank for w in group] == [w.stage_rank for w in group] == [w.dp_rank for w in group] == list(
            range(ep))
        assert all(w.pp_rank == pp_rank and w.layers == stage_layers[pp_rank] for w in group)
        # the experts: contiguous equal ranges of slots, an exact cover in rank order, each expert whole
        assert [slot for w in group for slot in w.expert_slots] == list(range(num_physical))
        assert {len(w.expert_slots) for w in group} == {num_physical // ep}
        for w in group:
            assert (w.tp_rank, w.tp_size, w.ep_size, w.pp_size, w.num_kv_replicas) == (0, 1, ep, pp, 1)
            assert w.expert_intermediate == range(shape.moe_intermediate_size)
            # attention, dense MLP and vocabulary whole: the rank runs them for its own requests
            assert w.q_heads == range(shape.num_heads) and w.kv_heads == range(shape.num_kv_heads)
            assert w.intermediate == range(shape.intermediate_size)
            assert w.vocab_rows == range(placement.padded_vocab_size)
        for layer in stage_layers[pp_rank]:
            assert placement.owners_of_layer(layer) == group
