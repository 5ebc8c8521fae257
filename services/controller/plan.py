"""Plan: what a Reconfigure to a target would move, from the pure plans and the workers' capacities."""

from __future__ import annotations


from services.controller.staging import staged_pool_bytes, staging_needs, staging_verdict
from services.controller.transaction import Reconfigurer, prepare_workers
from services.model.expert_reshard import can_reshard, expert_peak_extra_bytes
from services.model.spec import ModelSpec
from services.rpc.reconfig.v1 import controller_pb2, router_pb2
from services.topology import Placement, WeightFlags, place, plan_kv_migration, plan_weight_reload
from services.topology.eplb import initial_expert_maps
from services.topology.migration_plan import num_kv_pools


def pool_pair_blocks(placements) -> dict[tuple[int, int], int]:
    """(old pool, new pool) -> blocks a switch would move, from the router's placement of the running requests
    (PlanRebind; the preempted ones move nothing)."""
    pairs: dict[tuple[int, int], int] = {}
    for p in placements:
        if p.dst_pool >= 0:
            pairs[p.src_pool, p.dst_pool] = pairs.get((p.src_pool, p.dst_pool), 0) + p.num_blocks
    return pairs


def pool_plans(placements, num_pools: int) -> list[controller_pb2.PoolPlan]:
    """Per KV pool of the target: the running requests it would hold and their blocks."""
    pools = [controller_pb2.PoolPlan(pool=pool) for pool in range(num_pools)]
    for p in placements:
        if p.dst_pool >= 0:
            pools[p.dst_pool].num_requests += 1
            pools[p.dst_pool].num_blocks += p.num_blocks
    return pools


def reshardable_expert_bytes(old: Placement, new: Placement, rank: int, spec: ModelSpec, dtype_bytes: int) -> int:
    """Expert bytes `rank` holds in the new layout that can come from its stage's peers by all-to-all (the TP <->
    EP view change of one width) instead of the weight store."""
    if rank >= min(len(old.workers), len(new.workers)) or not spec.shape.is_moe:
        return 0
    before, after = old.workers[rank], new.workers[rank]
    if not can_reshard(before, after):
        return 0
    layers = [layer for layer in after.layers if layer in spec.moe_layers]
    if after.ep_size > 1:
        elements = len(after.expert_slots) * spec.moe_intermediate_size
    else:
        elements = spec.num_experts * len(after.expert_intermediate)
    return len(layers) * elements * 3 * spec.hidden_size * dtype_bytes


def in_place_expert_peak(old: Placement, new: Placement, rank: int, spec: ModelSpec, dtype_bytes: int) -> int:
    """Expert bytes `rank` holds at once beyond the larger of its old and new experts while an in-place switch
    builds its shard (each sparse layer's old experts go as its new ones arrive), at the maps a fresh load has
    (EPLB may have changed the live ones: the same counts but for which expert a spare slot copies)."""
    if rank >= min(len(old.workers), len(new.workers)) or not spec.shape.is_moe:
        return 0
    return expert_peak_extra_bytes(old.workers[rank], new.workers[rank], initial_expert_maps(spec.shape, old),
                                   initial_expert_maps(spec.shape, new), spec.hidden_size, dtype_bytes)


async def plan_switch(reconfigurer: Reconfigurer, topology: str, layer_partition=()) -> controller_pb2.PlanResponse:
    """What a switch would move, from the pure plans and the workers' capacities; changes nothing."""
    target = reconfigurer.target(topology, layer_partition)
    state, timeout = reconfigurer.state, reconfigurer.rpc_timeout_s
    prepared, capacity = await prepare_workers(reconfigurer.workers, target, timeout, reconfigurer.metadata)
    stats = await reconfigurer.router.Stats(router_pb2.StatsRequest(), timeout=timeout,
                                            metadata=reconfigurer.metadata)
    spec, world = reconfigurer.spec, len(reconfigurer.workers)
    old = place(state.topology, spec.shape, state.layer_partition)
    new = place(target.topology, spec.shape, target.layer_partition)
    old_ranks, new_ranks = list(range(state.topology.num_workers)), list(range(target.topology.num_workers))
    kv_plan = plan_kv_migration(old, old_ranks, new, new_ranks)
    weights = plan_weight_reload(old, old_ranks, new, new_ranks, WeightFlags.of(spec))
    dtype_bytes, block_size = prepared[0].kv_dtype_bytes, prepared[0].block_size
    used = stats.num_kv_blocks_used
    placed = await reconfigurer.router.PlanRebind(
        router_pb2.PlanRebindRequest(num_kv_blocks=capacity, dp_size=num_kv_pools(new)), timeout=timeout,
        metadata=reconfigurer.metadata)
    placements = list(placed.placements)
    preempted = sum(1 for p in placements if p.dst_pool < 0)
    pools = pool_pair_blocks(placements)
    moved = kv_plan.bytes_moved(used, block_size, spec.head_dim, dtype_bytes,
                                blocks_per_pools=pools if kv_plan.renumbers_blocks else None)
    rows, fits = [], used <= capacity and not preempted
    for rank in range(world):
        local = sum(t.nbytes(pools.get(t.pools, 0) if kv_plan.renumbers_blocks else used, block_size, spec.head_dim,
                             dtype_bytes)
                    for t in kv_plan.receives_of(rank) if t.is_local)
        reload = weights.get(rank)
        # The old layout has each worker's current blocks; the new one the capacity every active worker shares.
        peak = kv_plan.peak_extra_bytes(rank, prepared[rank].num_kv_blocks_now, block_size, spec.head_dim,
                                        dtype_bytes, new_num_blocks=capacity)
        rows.append(controller_pb2.WorkerPlan(
            rank=rank, state_before="ACTIVE" if rank in old_ranks else "STANDBY",
            state_after="ACTIVE" if rank in new_ranks else "STANDBY",
            kv_bytes_in=sum(b for (src, dst), b in moved.items() if dst == rank), kv_bytes_local=local,
            weight_bytes_load=reload.load_bytes(dtype_bytes) if reload else 0,
            weight_bytes_keep=reload.keep_bytes(dtype_bytes) if reload else 0,
            peak_extra_bytes=peak, num_kv_blocks_after=capacity if rank in new_ranks else 0,
            weight_bytes_reshard=reshardable_expert_bytes(old, new, rank, spec, dtype_bytes),
            expert_peak_extra_bytes=in_place_expert_peak(old, new, rank, spec, dtype_bytes),
        ))
    staging_note = "" if reconfigurer.staging else "staging is off: every switch runs in place"
    if not staging_note:
        pools = staged_pool_bytes(spec, target, capacity, block_size, dtype_bytes) \
            if reconfigurer.kv_precopy else {}
        staging_note = staging_verdict(staging_needs(weights, target.topology, dtype_bytes, pools),
                                       reconfigurer.staging_budget_bytes)
    return controller_pb2.PlanResponse(
        from_topology=str(state.topology), to_topology=str(target.topology), workers=rows, num_used_blocks=used,
        num_kv_blocks_after=capacity, fits=fits, is_candidate=all(p.is_candidate for p in prepared),
        stages=not staging_note, staging_note=staging_note, num_requests_preempted=preempted,
        placements=placements, pools=pool_plans(placements, num_kv_pools(new)),
    )
