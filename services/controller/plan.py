"""Plan: what a Reconfigure to a target would move, from the pure plans and the workers' capacities."""

from __future__ import annotations


from services.controller.transaction import Reconfigurer, prepare_workers
from services.rpc.reconfig.v1 import controller_pb2, router_pb2
from services.topology import WeightFlags, place, plan_kv_migration, plan_weight_reload


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
    moved = kv_plan.bytes_moved(used, block_size, spec.head_dim, dtype_bytes)
    rows, fits = [], used <= capacity
    for rank in range(world):
        local = sum(t.nbytes(used, block_size, spec.head_dim, dtype_bytes)
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
        ))
    return controller_pb2.PlanResponse(
        from_topology=str(state.topology), to_topology=str(target.topology), workers=rows, num_used_blocks=used,
        num_kv_blocks_after=capacity, fits=fits, is_candidate=all(p.is_candidate for p in prepared),
    )
