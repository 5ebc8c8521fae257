"""STAGING, the phase of a switch that runs while the router serves: every worker builds its shard of the target
beside its steps, so the freeze only moves KV and swaps. Here: the call to the workers, and whether a switch may
stage under the staging budget (each worker holds its staged slices beside its live shard until the freeze)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from services.model.spec import ModelSpec
from services.rpc.reconfig.v1 import worker_pb2, worker_pb2_grpc
from services.topology import Topology, WeightFlags, place, plan_weight_reload
from services.topology.weight_plan import WeightReload

MIB = 1 << 20


async def stage_workers(workers: list[worker_pb2_grpc.WorkerStub], topology: Topology,
                        layer_partition: tuple[int, ...] | None, operation_id: str, timeout: float,
                        metadata: tuple = ()) -> list[worker_pb2.StageSwitchResponse]:
    """STAGING on every worker at once (the router serving): each builds its shard of the target. Returns once every
    worker has answered, also when one fails (then raises its error): no staging outlives its operation."""
    request = worker_pb2.StageSwitchRequest(operation_id=operation_id, topology=str(topology),
                                            layer_partition=layer_partition or ())
    replies = await asyncio.gather(*(w.StageSwitch(request, timeout=timeout, metadata=metadata) for w in workers),
                                   return_exceptions=True)
    if errors := [r for r in replies if isinstance(r, BaseException)]:
        raise errors[0]
    return list(replies)


def planned_reloads(spec: ModelSpec, live: Topology, live_partition, target: Topology,
                    target_partition) -> dict[int, WeightReload]:
    """The pure weight plan of a switch from the live layout to the target (ranks 0..n-1 on both sides)."""
    old, new = place(live, spec.shape, live_partition), place(target, spec.shape, target_partition)
    return plan_weight_reload(old, range(live.num_workers), new, range(target.num_workers), WeightFlags.of(spec))


def staging_needs(reloads: Mapping[int, WeightReload], target: Topology, dtype_bytes: int) -> dict[int, int]:
    """Rank -> bytes its staged shard of the target holds beside the live one: the slices it loads (the ones it
    keeps are shared); ranks on standby in the target stage nothing."""
    return {rank: reload.load_bytes(dtype_bytes) for rank, reload in reloads.items() if rank < target.num_workers}


def staging_verdict(needs: dict[int, int], budget_bytes: int | None) -> str:
    """"" when every worker's staging need fits the budget (None: no budget), else why not, naming the worst."""
    if budget_bytes is None or not needs:
        return ""
    rank = max(needs, key=lambda r: (needs[r], -r))
    if needs[rank] <= budget_bytes:
        return ""
    return (f"worker {rank} would stage {needs[rank] / MIB:.1f} MiB beside its live shard, over the staging budget "
            f"of {budget_bytes / MIB:.1f} MiB")
