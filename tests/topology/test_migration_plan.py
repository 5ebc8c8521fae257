"""KV migration plans: examples, validation, and a symbolic execution of random plans on labelled caches."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.topology import (
    LOST,
    KVLostError,
    KVMigrationPlan,
    KVTransfer,
    ModelShape,
    Placement,
    Topology,
    candidate_topologies,
    lost_kv,
    place,
    plan_kv_migration,
)
from services.topology.migration_plan import kv_pool, num_kv_pools

NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM = 3, 2, 2
USED_BLOCKS = [0, 2]  # block 1 is free: the executor moves only blocks in use


def make_shape(num_layers: int = 4, num_heads: int = 8, num_kv_heads: int = 4) -> ModelShape:
    return ModelShape(num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=HEAD_DIM,
                      hidden_size=64, intermediate_size=840, vocab_size=100)


def layout(text: str, shape: ModelShape, partition: list[int] | None = None) -> Placement:
    return place(Topology.parse(text), shape, partition)


def as_tuples(transfers: tuple[KVTransfer, ...]) -> list[tuple[int, tuple[int, int], int, int, int, int]]:
    return [(t.layer, (t.kv_heads.start, t.kv_heads.stop), t.src_rank, t.dst_rank, t.src_head_offset,
             t.dst_head_offset) for t in transfers]


# --- symbolic execution ---------------------------------------------------------------------------------------------

def labels(layer: int, heads: range) -> np.ndarray:
    """A layer tensor [2, blocks, block_size, local_kv_heads, head_dim] whose every element names its origin."""
    kv, block, slot, head, dim = np.meshgrid(np.arange(2), np.arange(NUM_BLOCKS), np.arange(BLOCK_SIZE),
                                             np.array(list(heads), dtype=np.int64), np.arange(HEAD_DIM), indexing="ij")
    return ((((kv * 100 + layer) * 100 + head) * NUM_BLOCKS + block) * BLOCK_SIZE + slot) * HEAD_DIM + dim


def start_caches(plan: KVMigrationPlan) -> dict[int, dict[int, np.ndarray]]:
    """rank -> layer -> the correct old-layout tensor."""
    return {rank: {layer: labels(layer, plan.old_local_kv_heads(rank)) for layer in plan.old_local_layers(rank)}
            for rank in plan.old_ranks if rank != LOST}


def execute(plan: KVMigrationPlan, caches: dict[int, dict[int, np.ndarray]]) -> tuple[dict, dict[int, int]]:
    """Run the plan layer by layer as the executor does; check every copy; return new caches and peak extra."""
    old = {rank: dict(layers) for rank, layers in caches.items()}
    new: dict[int, dict[int, np.ndarray]] = {rank: {} for rank in plan.new_ranks}
    live = {rank: sum(t.size for t in old.get(rank, {}).values()) for rank in plan.ranks()}
    start, peak = dict(live), dict(live)
    for layer in plan.layers():
        writes: Counter[tuple[int, int]] = Counter()  # (dst, local head slot) -> times written
        for rank in plan.new_ranks:
            if layer not in plan.new_local_layers(rank):
                continue
            if plan.is_identity_for(rank, layer):
                new[rank][layer] = old[rank][layer]  # kept as is (still a source for others): no allocation
            else:
                new[rank][layer] = np.full_like(labels(layer, plan.new_local_kv_heads(rank)), -1)
                live[rank] += new[rank][layer].size
                peak[rank] = max(peak[rank], live[rank])
        for t in plan.for_layer(layer):
            assert t.layer == layer and len(t.kv_heads) >= 1
            src_heads, dst_heads = plan.old_local_kv_heads(t.src_rank), plan.new_local_kv_heads(t.dst_rank)
            # reads only slots the source held, writes only slots the destination owns in the new layout
            assert layer in plan.old_local_layers(t.src_rank) and layer in plan.new_local_layers(t.dst_rank)
            assert 0 <= t.src_head_offset and t.src_head_offset + len(t.kv_heads) <= len(src_heads)
            assert 0 <= t.dst_head_offset and t.dst_head_offset + len(t.kv_heads) <= len(dst_heads)
            assert src_heads[t.src_head_offset] == t.kv_heads.start == dst_heads[t.dst_head_offset]
            writes.update((t.dst_rank, t.dst_head_offset + i) for i in range(len(t.kv_heads)))
            if plan.is_identity_for(t.dst_rank, layer):
                assert t.is_local and t.src_head_offset == t.dst_head_offset
                continue
            assert layer in old[t.src_rank], "a transfer reads a layer its source no longer holds"
            source = old[t.src_rank][layer]
            src_slots = slice(t.src_head_offset, t.src_head_offset + len(t.kv_heads))
            dst_slots = slice(t.dst_head_offset, t.dst_head_offset + len(t.kv_heads))
            new[t.dst_rank][layer][:, USED_BLOCKS, :, dst_slots] = source[:, USED_BLOCKS, :, src_slots]
        owners = [rank for rank in plan.new_ranks if layer in plan.new_local_layers(rank)]
        expected = {(rank, slot) for rank in owners for slot in range(len(plan.new_local_kv_heads(rank)))}
        assert set(writes) == expected and set(writes.values()) == {1}, "each new (dst, head) written exactly once"
        for rank in plan.old_ranks:  # free the old layer right after it moved
            if rank != LOST and layer in old[rank]:
                freed = old[rank].pop(layer)
                live[rank] -= 0 if plan.is_identity_for(rank, layer) else freed.size
    assert all(not layers for layers in old.values())
    return new, {rank: peak[rank] - max(start[rank], live[rank]) for rank in plan.ranks()}


def assert_lands_on_new_owners(plan: KVMigrationPlan, new: dict[int, dict[int, np.ndarray]]) -> None:
    for rank in plan.new_ranks:
        assert sorted(new[rank]) == list(plan.new_local_layers(rank))
        for layer, tensor in new[rank].items():
            want = labels(layer, plan.new_local_kv_heads(rank))
            np.testing.assert_array_equal(tensor[:, USED_BLOCKS], want[:, USED_BLOCKS])


# --- random migrations ----------------------------------------------------------------------------------------------

@st.composite
def partitions(draw: st.DrawFn, topology: Topology, num_layers: int) -> list[int] | None:
    if topology.pp == 1 or not draw(st.booleans()):
        return None
    cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=topology.pp - 1, max_size=topology.pp - 1)))
    bounds = [0, *cuts, num_layers]
    return [bounds[i + 1] - bounds[i] for i in range(topology.pp)]


@st.composite
def migrations(draw: st.DrawFn) -> tuple[Placement, list[int], Placement, list[int]]:
    """Random shape, (tp, pp) pairs, partitions and rank assignments: same size, shrink, grow, any subset."""
    force_replication = draw(st.booleans())
    num_kv_heads = draw(st.sampled_from([1, 2] if force_replication else [1, 2, 3, 4, 8]))
    shape = make_shape(draw(st.integers(1, 24)), num_kv_heads * draw(st.sampled_from([1, 2, 4])), num_kv_heads)
    world = draw(st.integers(1, 8))
    candidates = candidate_topologies(shape, world)
    replicated = [t for t in candidates if t.tp > num_kv_heads]
    old_topology = draw(st.sampled_from(replicated if force_replication and replicated else candidates))
    new_topology = draw(st.sampled_from(candidates))
    old = place(old_topology, shape, draw(partitions(old_topology, shape.num_layers)))
    new = place(new_topology, shape, draw(partitions(new_topology, shape.num_layers)))
    order = draw(st.permutations(range(world)))
    old_ranks = list(order[: old_topology.num_workers])
    if draw(st.booleans()):  # reuse the old workers first (same size / shrink to a subset / grow with standbys)
        pool = old_ranks + [rank for rank in order if rank not in old_ranks]
        new_ranks = list(draw(st.permutations(pool[: new_topology.num_workers])))
    else:
        new_ranks = list(draw(st.permutations(range(world)))[: new_topology.num_workers])
    return old, old_ranks, new, new_ranks


def one_layer(plan: KVMigrationPlan, rank: int, new_layout: bool = True) -> int:
    return plan.layer_bytes(rank, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM, 1, new_layout=new_layout)


@given(migrations())
@settings(max_examples=120, deadline=None)
def test_every_slice_lands_on_exactly_its_new_owners(migration) -> None:
    plan = plan_kv_migration(*migration)
    new, peak_extra = execute(plan, start_caches(plan))
    assert_lands_on_new_owners(plan, new)
    assert sorted(plan.layers()) == list(range(plan.old.shape.num_layers))
    for rank in plan.ranks():
        # the accounting matches the executed timeline, and stays within one layer tensor
        assert plan.peak_extra_bytes(rank, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM, 1) == peak_extra[rank]
        assert peak_extra[rank] <= max(one_layer(plan, rank), one_layer(plan, rank, new_layout=False))
        assert set(plan.sends_of(rank)) | set(plan.receives_of(rank)) == {
            t for t in plan.transfers if rank in (t.src_rank, t.dst_rank)}


@given(migrations())
@settings(max_examples=60, deadline=None)
def test_there_and_back_restores_every_label(migration) -> None:
    old, old_ranks, new, new_ranks = migration
    there, back = plan_kv_migration(old, old_ranks, new, new_ranks), plan_kv_migration(new, new_ranks, old, old_ranks)
    start = start_caches(there)
    middle, _ = execute(there, start)
    end, _ = execute(back, middle)
    for rank in old_ranks:
        assert sorted(end[rank]) == sorted(start[rank])
        for layer in start[rank]:
            np.testing.assert_array_equal(end[rank][layer][:, USED_BLOCKS], start[rank][layer][:, USED_BLOCKS])


@given(migrations())
@settings(max_examples=60, deadline=None)
def test_same_layout_moves_nothing(migration) -> None:
    old, old_ranks, _, _ = migration
    plan = plan_kv_migration(old, old_ranks, old, old_ranks)
    assert all(t.is_local and t.src_head_offset == t.dst_head_offset for t in plan.transfers)
    assert plan.bytes_moved(5, 16, 64, 2) == {}
    for rank in old_ranks:
        assert all(plan.is_identity_for(rank, layer) for layer in plan.old_local_layers(rank))
        assert plan.peak_extra_bytes(rank, 100, 16, 64, 2) == 0


@given(migrations(), st.integers(0, 50), st.sampled_from([1, 2, 4]))
@settings(max_examples=60, deadline=None)
def test_bytes_moved_counts_remote_transfers(migration, num_used_blocks: int, dtype_bytes: int) -> None:
    plan = plan_kv_migration(*migration)
    expected: Counter[tuple[int, int]] = Counter()
    for t in plan.transfers:
        if t.src_rank != t.dst_rank:
            expected[t.src_rank, t.dst_rank] += len(t.kv_heads) * num_used_blocks * 16 * HEAD_DIM * 2 * dtype_bytes
    moved = plan.bytes_moved(num_used_blocks, 16, HEAD_DIM, dtype_bytes)
    assert moved == {pair: size for pair, size in expected.items()}
    assert all(src != dst for src, dst in moved)


# --- examples -------------------------------------------------------------------------------------------------------

def test_tp2pp2_to_tp4pp1_on_the_same_workers() -> None:
    shape = make_shape(num_layers=4, num_heads=8, num_kv_heads=4)
    plan = plan_kv_migration(layout("tp2pp2", shape), [0, 1, 2, 3], layout("tp4pp1", shape), [0, 1, 2, 3])
    # stage 0 (layers 0, 1): rank 0 heads 0-1, rank 1 heads 2-3; tp4: rank i holds head i of every layer
    assert as_tuples(plan.for_layer(0)) == [
        (0, (0, 1), 0, 0, 0, 0), (0, (1, 2), 0, 1, 1, 0), (0, (2, 3), 1, 2, 0, 0), (0, (3, 4), 1, 3, 1, 0)]
    assert as_tuples(plan.for_layer(3)) == [
        (3, (0, 1), 2, 0, 0, 0), (3, (1, 2), 2, 1, 1, 0), (3, (2, 3), 3, 2, 0, 0), (3, (3, 4), 3, 3, 1, 0)]
    assert plan.new_local_layers(3) == range(0, 4) and plan.old_local_layers(3) == range(2, 4)
    assert plan.old_local_kv_heads(1) == range(2, 4) and plan.new_local_kv_heads(1) == range(1, 2)
    assert not any(plan.is_identity_for(rank, layer) for rank in range(4) for layer in range(4))
    # per layer 3 heads cross the wire: 3 * 2 (K, V) * 10 blocks * 16 slots * 64 dims * 2 bytes
    assert sum(plan.bytes_moved(10, 16, 64, 2).values()) == 4 * 3 * 2 * 10 * 16 * 64 * 2


def test_shrink_moves_the_leaving_workers_kv_and_leaves_them_empty() -> None:
    shape = make_shape(num_layers=6, num_heads=8, num_kv_heads=2)
    plan = plan_kv_migration(layout("tp2pp2", shape), [0, 1, 2, 3], layout("tp2pp1", shape), [0, 1])
    for rank in (2, 3):
        assert plan.receives_of(rank) == () and plan.new_local_layers(rank) == range(0)
        assert {t.layer for t in plan.sends_of(rank)} == {3, 4, 5}
        assert all(t.dst_rank == rank - 2 for t in plan.sends_of(rank))
        assert plan.peak_extra_bytes(rank, 10, 16, 64, 2) == 0
    assert all(plan.is_identity_for(rank, layer) for rank in (0, 1) for layer in range(3))
    assert plan.bytes_moved(1, 1, 1, 1) == {(2, 0): 6, (3, 1): 6}


def test_grow_fills_standby_workers_and_merges_contiguous_heads() -> None:
    shape = make_shape(num_layers=4, num_heads=8, num_kv_heads=8)
    plan = plan_kv_migration(layout("tp1pp1", shape), [0], layout("tp2pp2", shape), [0, 1, 2, 3])
    # one large copy per (layer, destination): 4 contiguous heads from rank 0
    assert as_tuples(plan.receives_of(3)) == [(2, (4, 8), 0, 3, 4, 0), (3, (4, 8), 0, 3, 4, 0)]
    assert as_tuples(plan.receives_of(0)) == [(0, (0, 4), 0, 0, 0, 0), (1, (0, 4), 0, 0, 0, 0)]
    assert plan.peak_extra_bytes(3, 10, 16, 64, 2) == 0  # a joining worker only allocates


def test_replicated_sources_share_the_sending() -> None:
    shape = make_shape(num_layers=6, num_heads=8, num_kv_heads=2)
    # tp4: ranks (0, 1) hold head 0, ranks (2, 3) head 1; reversing the ranks makes every head move
    plan = plan_kv_migration(layout("tp4pp1", shape), [0, 1, 2, 3], layout("tp4pp1", shape), [3, 2, 1, 0])
    for layer in range(6):
        senders = Counter(t.src_rank for t in plan.for_layer(layer))
        assert senders == {0: 1, 1: 1, 2: 1, 3: 1} and not any(t.is_local for t in plan.for_layer(layer))
    # shrinking to one worker: head 0 stays local, head 1 alternates between its two replicas
    plan = plan_kv_migration(layout("tp4pp1", shape), [0, 1, 2, 3], layout("tp1pp1", shape), [0])
    assert Counter(t.src_rank for t in plan.transfers if not t.is_local) == {2: 3, 3: 3}
    # growing into replication: one old owner feeds every replica
    plan = plan_kv_migration(layout("tp1pp1", shape), [0], layout("tp4pp1", shape), [0, 1, 2, 3])
    assert as_tuples(plan.for_layer(0)) == [
        (0, (0, 1), 0, 0, 0, 0), (0, (0, 1), 0, 1, 0, 0), (0, (1, 2), 0, 2, 1, 0), (0, (1, 2), 0, 3, 1, 0)]


def test_uneven_and_explicit_layer_splits() -> None:
    shape = make_shape(num_layers=7, num_heads=4, num_kv_heads=4)
    plan = plan_kv_migration(layout("tp1pp3", shape), [0, 1, 2], layout("tp1pp2", shape, [6, 1]), [2, 0])
    assert [plan.old_local_layers(rank) for rank in (0, 1, 2)] == [range(0, 2), range(2, 5), range(5, 7)]
    assert plan.new_local_layers(2) == range(0, 6) and plan.new_local_layers(0) == range(6, 7)
    new, _ = execute(plan, start_caches(plan))
    assert_lands_on_new_owners(plan, new)


def test_layer_order_interleaves_freeing_and_filling() -> None:
    shape = make_shape(num_layers=12, num_heads=8, num_kv_heads=4)
    old, new = layout("tp1pp2", shape), layout("tp2pp1", shape)
    plan = plan_kv_migration(old, [0, 1], new, [0, 1])
    in_layer_order = KVMigrationPlan(old, (0, 1), new, (0, 1), plan.transfers, tuple(range(12)))
    layer = one_layer(plan, 1)  # one new layer tensor (2 heads); an old one is twice that (4 heads)
    assert plan.layers() == [0, 6, 1, 7, 2, 8, 3, 9, 4, 10, 5, 11]
    for rank in (0, 1):
        # the first layer a rank frees comes after one it fills (the other rank frees first): 2 new layers
        assert plan.peak_extra_bytes(rank, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM, 1) <= 2 * layer
    # migrating layers 0..11 in order, rank 1 fills seven new layers before it frees its first old one
    assert in_layer_order.peak_extra_bytes(1, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM, 1) == 7 * layer


def test_peak_extra_when_the_block_count_changes() -> None:
    shape = make_shape(num_layers=4, num_heads=8, num_kv_heads=4)
    plan = plan_kv_migration(layout("tp2pp1", shape), [0, 1], layout("tp2pp1", shape), [0, 1])
    assert plan.peak_extra_bytes(0, 10, 16, 64, 2) == 0
    # with more blocks every layer is reallocated: one new layer at a time above the final size
    new_layer = 2 * 20 * 16 * 2 * 64 * 2
    assert plan.peak_extra_bytes(0, 10, 16, 64, 2, new_num_blocks=20) == new_layer - new_layer // 2


@given(migrations(), st.data())
@settings(max_examples=300, deadline=None)
def test_lost_workers_kv_comes_from_replicas_or_is_reported_lost(migration, data) -> None:
    """Workers of the old layout die (the survivors keep their slices): every slice some survivor holds is
    planned from a survivor and lands on its new owners; if a slice lived only on the dead, KVLostError."""
    old, old_ranks, new, _ = migration
    lost = data.draw(st.sets(st.sampled_from(old_ranks), min_size=1, max_size=len(old_ranks)))
    survivors = [rank for rank in old_ranks if rank not in lost]
    with_lost = [LOST if rank in lost else rank for rank in old_ranks]
    holders = {(layer, head) for rank, worker in zip(old_ranks, old.workers) if rank not in lost
               for layer in worker.layers for head in worker.kv_heads}
    everything = {(layer, head) for layer in range(old.shape.num_layers) for head in range(old.shape.num_kv_heads)}
    assert set(lost_kv(old, with_lost)) == everything - holders
    world = max([*old_ranks, new.topology.num_workers]) + 1
    pool = survivors + [rank for rank in range(world) if rank not in old_ranks]  # survivors, then standbys
    if len(pool) < new.topology.num_workers:
        return
    new_ranks = data.draw(st.permutations(pool[: new.topology.num_workers]))
    if holders != everything:
        with pytest.raises(KVLostError):
            plan_kv_migration(old, with_lost, new, new_ranks)
        return
    plan = plan_kv_migration(old, with_lost, new, new_ranks)
    assert plan.has_lost_sources and all(t.src_rank not in lost for t in plan.transfers)
    new_caches, _ = execute(plan, start_caches(plan))
    assert_lands_on_new_owners(plan, new_caches)


def test_losing_a_tp4_worker_keeps_every_kv_head_through_its_replica() -> None:
    shape = make_shape(num_layers=3, num_heads=4, num_kv_heads=2)  # tp4: each KV head on 2 workers
    plan = plan_kv_migration(layout("tp4pp1", shape), [0, LOST, 1, 2], layout("tp1pp3", shape), [0, 1, 2])
    assert {t.src_rank for t in plan.transfers if 0 in t.kv_heads} == {0}  # head 0's other holder is gone
    assert lost_kv(layout("tp2pp2", shape), [0, LOST, 1, 2]) == [(0, 1), (1, 1)]  # stage 0's head 1: no replica


def test_invalid_inputs_are_refused() -> None:
    shape = make_shape()
    tp2 = layout("tp2pp1", shape)
    with pytest.raises(ValueError, match="unique"):
        plan_kv_migration(tp2, [0, 0], tp2, [0, 1])
    with pytest.raises(ValueError, match="needs 2 ranks, got 3"):
        plan_kv_migration(tp2, [0, 1], tp2, [0, 1, 2])
    with pytest.raises(ValueError, match=">= 0 or LOST"):
        plan_kv_migration(tp2, [0, -2], tp2, [0, 1])
    with pytest.raises(ValueError, match=">= 0, got"):  # a new layout has no lost workers
        plan_kv_migration(tp2, [0, 1], tp2, [0, LOST])
    with pytest.raises(KVLostError, match="lived only on lost workers"):  # tp2 over 4 KV heads: no replica
        plan_kv_migration(tp2, [0, LOST], layout("tp1pp1", shape), [0])
    with pytest.raises(ValueError, match="different models"):
        plan_kv_migration(tp2, [0, 1], layout("tp2pp1", make_shape(num_layers=5)), [0, 1])


# --- expert-parallel layouts ----------------------------------------------------------------------------------------

def make_moe_shape(num_layers: int = 4) -> ModelShape:
    return ModelShape(num_layers=num_layers, num_heads=8, num_kv_heads=4, head_dim=HEAD_DIM, hidden_size=64,
                      intermediate_size=840, vocab_size=100, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, moe_layers=tuple(range(num_layers)))


def test_expert_parallel_to_tensor_parallel_takes_every_pool() -> None:
    """ep2: each rank holds all heads of its own requests (pool = its dp_rank); tp2 splits the heads of one pool."""
    shape = make_moe_shape()
    plan = plan_kv_migration(layout("ep2pp1", shape), [0, 1], layout("tp2pp1", shape), [0, 1])
    assert [(t.layer, (t.kv_heads.start, t.kv_heads.stop), t.src_rank, t.dst_rank, t.src_head_offset,
             t.dst_head_offset, t.src_pool, t.dst_pool) for t in plan.for_layer(0)] == [
        (0, (0, 2), 0, 0, 0, 0, 0, 0), (0, (0, 2), 1, 0, 0, 0, 1, 0),
        (0, (2, 4), 0, 1, 2, 0, 0, 0), (0, (2, 4), 1, 1, 2, 0, 1, 0)]
    assert plan.renumbers_blocks and not any(plan.is_identity_for(rank, layer) for rank in (0, 1) for layer in range(4))
    assert [plan.old_pool(rank) for rank in (0, 1)] == [0, 1] and [plan.new_pool(rank) for rank in (0, 1)] == [0, 0]
    # back: each ep rank takes every head of pool 0 into its own pool, from the two tp ranks' halves
    back = plan_kv_migration(layout("tp2pp1", shape), [0, 1], layout("ep2pp1", shape), [0, 1])
    assert [(t.src_rank, t.dst_rank, t.src_pool, t.dst_pool, t.kv_heads) for t in back.for_layer(0)] == [
        (0, 0, 0, 0, range(0, 2)), (1, 0, 0, 0, range(2, 4)), (0, 1, 0, 1, range(0, 2)), (1, 1, 0, 1, range(2, 4))]


def test_bytes_moved_counts_each_pool_pairs_blocks() -> None:
    shape = make_moe_shape()
    plan = plan_kv_migration(layout("ep2pp1", shape), [0, 1], layout("tp2pp1", shape), [0, 1])
    # per layer: rank 1 sends pool 1's heads 0-1 to rank 0, rank 0 sends pool 0's heads 2-3 to rank 1
    moved = plan.bytes_moved(0, 1, 1, 1, blocks_per_pools={(0, 0): 3, (1, 0): 5})
    assert moved == {(1, 0): 4 * 2 * 2 * 5, (0, 1): 4 * 2 * 2 * 3}
    assert plan.bytes_moved(0, 1, 1, 1, blocks_per_pools={}) == {(1, 0): 0, (0, 1): 0}


def test_the_same_expert_parallel_layout_on_other_ranks_renumbers() -> None:
    """Rank 1 now runs dp rank 0's requests: every pool moves, and no layer is kept as is."""
    ep2 = layout("ep2pp1", make_moe_shape())
    swapped = plan_kv_migration(ep2, [0, 1], ep2, [1, 0])
    assert swapped.renumbers_blocks and not any(swapped.is_identity_for(r, layer) for r in (0, 1) for layer in range(4))
    assert {(t.src_rank, t.dst_rank, t.src_pool, t.dst_pool) for t in swapped.for_layer(0)} == {
        (0, 1, 0, 0), (1, 1, 1, 0), (0, 0, 0, 1), (1, 0, 1, 1)}
    redundant = plan_kv_migration(ep2, [0, 1], place(Topology(ep=2), make_moe_shape(), num_redundant_experts=2),
                                  [0, 1])
    assert redundant.renumbers_blocks
    same = plan_kv_migration(ep2, [0, 1], ep2, [0, 1])  # nothing changes: every layer stays in place
    assert not same.renumbers_blocks
    assert all(same.is_identity_for(rank, layer) for rank in (0, 1) for layer in range(4))


# --- random migrations to, from and between expert-parallel layouts ---------------------------------------------

@st.composite
def moe_migrations(draw: st.DrawFn) -> tuple[Placement, list[int], Placement, list[int]]:
    """Random MoE shape, TP/EP × PP layouts (at least one EP most of the time), partitions and rank assignments."""
    num_kv_heads = draw(st.sampled_from([1, 2, 4]))
    num_layers = draw(st.integers(1, 12))
    shape = ModelShape(num_layers=num_layers, num_heads=num_kv_heads * draw(st.sampled_from([1, 2])),
                       num_kv_heads=num_kv_heads, head_dim=HEAD_DIM, hidden_size=64, intermediate_size=840,
                       vocab_size=100, num_experts=draw(st.sampled_from([4, 8])), num_experts_per_tok=2,
                       moe_intermediate_size=32, moe_layers=tuple(range(num_layers)))
    redundant = draw(st.sampled_from([0, 4]))
    world = draw(st.integers(2, 8))
    candidates = candidate_topologies(shape, world, redundant)
    ep = [t for t in candidates if t.is_expert_parallel]
    old_topology = draw(st.sampled_from(ep if ep and draw(st.booleans()) else candidates))
    new_topology = draw(st.sampled_from(ep if ep and not old_topology.is_expert_parallel else candidates))
    old = place(old_topology, shape, draw(partitions(old_topology, num_layers)), redundant)
    new = place(new_topology, shape, draw(partitions(new_topology, num_layers)), redundant)
    order = draw(st.permutations(range(world)))
    old_ranks = list(order[: old_topology.num_workers])
    new_ranks = list(draw(st.permutations(range(world)))[: new_topology.num_workers])
    return old, old_ranks, new, new_ranks


def holders(placement: Placement, ranks: list[int]) -> set[tuple[int, int, int, int]]:
    """(layer, KV head, pool, rank) of every slice a layout holds."""
    return {(layer, head, kv_pool(placement, worker), rank) for rank, worker in zip(ranks, placement.workers)
            if rank != LOST for layer in worker.layers for head in worker.kv_heads}


@given(moe_migrations())
@settings(max_examples=200, deadline=None)
def test_every_pool_of_every_slice_reaches_each_new_holder_once(migration) -> None:
    old, old_ranks, new, new_ranks = migration
    plan = plan_kv_migration(old, old_ranks, new, new_ranks)
    old_held, new_held = holders(old, old_ranks), holders(new, new_ranks)
    covered: Counter[tuple[int, int, int, int]] = Counter()  # (layer, head, old pool, dst)
    for t in plan.transfers:
        src_heads, dst_heads = plan.old_local_kv_heads(t.src_rank), plan.new_local_kv_heads(t.dst_rank)
        for i, head in enumerate(t.kv_heads):
            assert (t.layer, head, t.src_pool, t.src_rank) in old_held, "the source holds it in that pool"
            assert (t.layer, head, t.dst_pool, t.dst_rank) in new_held, "the destination holds it in its pool"
            assert src_heads[t.src_head_offset + i] == head == dst_heads[t.dst_head_offset + i]
            covered[t.layer, head, t.src_pool, t.dst_rank] += 1
    pools = range(old.topology.ep if old.topology.is_expert_parallel else 1)
    expected = {(layer, head, pool, dst) for layer, head, _, dst in new_held for pool in pools}
    assert set(covered) == expected and set(covered.values()) == {1}
    assert plan.old_pool(old_ranks[-1]) == (old.workers[-1].dp_rank if old.topology.is_expert_parallel else 0)
    assert plan.new_pool(new_ranks[-1]) == (new.workers[-1].dp_rank if new.topology.is_expert_parallel else 0)
    renumbered = old != new or tuple(old_ranks) != tuple(new_ranks)
    if old.topology.is_expert_parallel or new.topology.is_expert_parallel:
        assert plan.renumbers_blocks == renumbered
        assert not renumbered or not any(plan.is_identity_for(rank, layer) for rank in plan.ranks()
                                         for layer in range(old.shape.num_layers))
    for rank in plan.ranks():  # every layer reallocated, one at a time: still within one layer tensor
        assert plan.peak_extra_bytes(rank, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM, 1) <= max(
            one_layer(plan, rank), one_layer(plan, rank, new_layout=False))


def pool_labels(layer: int, heads: range, pool: int, num_blocks: int) -> np.ndarray:
    """A layer tensor of one pool whose every element names its origin (the pool included)."""
    kv, block, slot, head, dim = np.meshgrid(np.arange(2), np.arange(num_blocks), np.arange(BLOCK_SIZE),
                                             np.array(list(heads), dtype=np.int64), np.arange(HEAD_DIM), indexing="ij")
    return (((((pool * 2 + kv) * 100 + layer) * 100 + head) * num_blocks + block) * BLOCK_SIZE + slot) * HEAD_DIM + dim


@st.composite
def block_maps(draw: st.DrawFn, old_pools: int, new_pools: int, num_blocks: int
               ) -> dict[tuple[int, int], tuple[list[int], list[int]]]:
    """Random used blocks in each old pool, each moved to a random new pool at a random free id."""
    free = {pool: list(draw(st.permutations(range(num_blocks)))) for pool in range(new_pools)}
    maps: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for src_pool in range(old_pools):
        for block in draw(st.lists(st.integers(0, num_blocks - 1), unique=True, max_size=num_blocks)):
            dst_pool = draw(st.integers(0, new_pools - 1))
            if free[dst_pool]:
                src, dst = maps.setdefault((src_pool, dst_pool), ([], []))
                src.append(block)
                dst.append(free[dst_pool].pop())
    return maps


def execute_with_maps(plan: KVMigrationPlan, caches: dict[int, dict[int, np.ndarray]], maps, num_blocks: int
                      ) -> dict[int, dict[int, np.ndarray]]:
    """Run every transfer with its pool pair's blocks into fresh (-1 filled) new tensors."""
    new = {rank: {layer: np.full_like(pool_labels(layer, plan.new_local_kv_heads(rank), 0, num_blocks), -1)
                  for layer in plan.new_local_layers(rank)} for rank in plan.new_ranks}
    for t in plan.transfers:
        src_ids, dst_ids = maps.get((t.src_pool, t.dst_pool), ([], []))
        src_slots = slice(t.src_head_offset, t.src_head_offset + t.num_kv_heads)
        dst_slots = slice(t.dst_head_offset, t.dst_head_offset + t.num_kv_heads)
        new[t.dst_rank][t.layer][:, dst_ids, :, dst_slots] = caches[t.src_rank][t.layer][:, src_ids, :, src_slots]
    return new


@given(moe_migrations(), st.data())
@settings(max_examples=120, deadline=None)
def test_block_maps_land_every_block_and_reversed_maps_restore_it(migration, data) -> None:
    old, old_ranks, new, new_ranks = migration
    num_blocks = 6
    there, back = plan_kv_migration(old, old_ranks, new, new_ranks), plan_kv_migration(new, new_ranks, old, old_ranks)
    maps = data.draw(block_maps(num_kv_pools(old), num_kv_pools(new), num_blocks))
    start = {rank: {layer: pool_labels(layer, there.old_local_kv_heads(rank), there.old_pool(rank), num_blocks)
                    for layer in there.old_local_layers(rank)} for rank in old_ranks}
    middle = execute_with_maps(there, start, maps, num_blocks)
    for rank in new_ranks:
        for layer, tensor in middle[rank].items():
            written = np.zeros(num_blocks, dtype=bool)
            for (src_pool, dst_pool), (src_ids, dst_ids) in maps.items():
                if dst_pool == there.new_pool(rank):
                    want = pool_labels(layer, there.new_local_kv_heads(rank), src_pool, num_blocks)
                    np.testing.assert_array_equal(tensor[:, dst_ids], want[:, src_ids])
                    written[dst_ids] = True
            assert (tensor[:, ~written] == -1).all(), "only mapped blocks are written"
    reverse = {(dst_pool, src_pool): (dst_ids, src_ids) for (src_pool, dst_pool), (src_ids, dst_ids) in maps.items()}
    end = execute_with_maps(back, middle, reverse, num_blocks)
    for rank in old_ranks:
        for layer in start[rank]:
            used = sorted(block for (src_pool, _), (src_ids, _) in maps.items() if src_pool == back.new_pool(rank)
                          for block in src_ids)
            np.testing.assert_array_equal(end[rank][layer][:, used], start[rank][layer][:, used])


@given(moe_migrations(), st.dictionaries(st.tuples(st.integers(0, 3), st.integers(0, 3)), st.integers(0, 9)))
@settings(max_examples=60, deadline=None)
def test_bytes_moved_per_pool_pair(migration, blocks_per_pools) -> None:
    plan = plan_kv_migration(*migration)
    expected: Counter[tuple[int, int]] = Counter()
    for t in plan.transfers:
        if not t.is_local:
            expected[t.src_rank, t.dst_rank] += t.num_kv_heads * blocks_per_pools.get(t.pools, 0) * 16 * HEAD_DIM * 2
    assert plan.bytes_moved(99, 16, HEAD_DIM, 1, blocks_per_pools=blocks_per_pools) == dict(expected)


def test_moe_tensor_parallel_switches_are_planned_as_dense_ones() -> None:
    shape = make_moe_shape()
    plan = plan_kv_migration(layout("tp2pp2", shape), [0, 1, 2, 3], layout("tp4pp1", shape), [0, 1, 2, 3])
    new_caches, _ = execute(plan, start_caches(plan))
    assert_lands_on_new_owners(plan, new_caches)


def test_a_lost_expert_parallel_rank_loses_its_requests_kv() -> None:
    """Each EP rank holds all heads of its own requests: the others hold other requests, not replicas."""
    ep2pp2 = layout("ep2pp2", make_moe_shape())
    assert lost_kv(ep2pp2, [0, 1, LOST, 3]) == [(layer, head) for layer in (2, 3) for head in range(4)]
    assert lost_kv(ep2pp2, [0, 1, 2, 3]) == []
