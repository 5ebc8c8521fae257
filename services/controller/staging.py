"""The phases of a switch that run while the router serves. STAGING: every worker builds its shard of the target
beside its steps; PRECOPY: the KV of running requests is copied into the target's pools in rounds. The freeze then
only copies the KV delta and swaps. Here: the calls to the workers and the router, whether a switch may stage under
the staging budget (each worker holds its staged slices and pool beside its live ones until the freeze), and
whether it may pre-copy."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog

from services.model.spec import ModelSpec
from services.router.driver import peer_pool
from services.rpc.reconfig.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.topology import Topology, WeightFlags, place, plan_weight_reload
from services.topology.weight_plan import WeightReload

MIB = 1 << 20
log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class SwitchTarget:
    """A validated target layout."""

    topology: Topology
    layer_partition: tuple[int, ...] | None = None


async def stage_workers(workers: list[worker_pb2_grpc.WorkerStub], topology: Topology,
                        layer_partition: tuple[int, ...] | None, operation_id: str, timeout: float,
                        metadata: tuple = (), duty: float = 1.0) -> list[worker_pb2.StageSwitchResponse]:
    """STAGING on every worker at once (the router serving): each builds its shard of the target. Returns once every
    worker has answered, also when one fails (then raises its error): no staging outlives its operation."""
    request = worker_pb2.StageSwitchRequest(operation_id=operation_id, topology=str(topology),
                                            layer_partition=layer_partition or (), duty=duty)
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


def staging_needs(reloads: Mapping[int, WeightReload], target: Topology, dtype_bytes: int,
                  kv_pools: Mapping[int, int] | None = None) -> dict[int, int]:
    """Rank -> bytes its staged shard of the target holds beside the live one: the slices it loads (the ones it
    keeps are shared), plus its staged KV pool when the KV is pre-copied (`kv_pools`, see staged_pool_bytes);
    ranks on standby in the target stage nothing."""
    kv_pools = kv_pools or {}
    return {rank: reload.load_bytes(dtype_bytes) + kv_pools.get(rank, 0) for rank, reload in reloads.items()
            if rank < target.num_workers}


def staged_pool_bytes(spec: ModelSpec, target: SwitchTarget, capacity: int, block_size: int,
                      dtype_bytes: int) -> dict[int, int]:
    """Rank -> bytes of the KV pool it pre-copies into (the target's capacity over its layers and KV heads; an
    upper bound: layers it keeps as they are need none)."""
    placement = place(target.topology, spec.shape, target.layer_partition)
    return {rank: 2 * capacity * block_size * len(w.kv_heads) * spec.head_dim * dtype_bytes * len(w.layers)
            for rank, w in enumerate(placement.workers)}


def staging_verdict(needs: dict[int, int], budget_bytes: int | None) -> str:
    """"" when every worker's staging need fits the budget (None: no budget), else why not, naming the worst."""
    if budget_bytes is None or not needs:
        return ""
    rank = max(needs, key=lambda r: (needs[r], -r))
    if needs[rank] <= budget_bytes:
        return ""
    return (f"worker {rank} would stage {needs[rank] / MIB:.1f} MiB beside its live shard, over the staging budget "
            f"of {budget_bytes / MIB:.1f} MiB")


# Pre-copy rounds (Llumnix): the first copies every full block, each next one the blocks filled meanwhile, until a
# round is this small or the rounds run out; the freeze copies what is left (the delta).
PRECOPY_MAX_ROUNDS = 4
PRECOPY_STOP_BLOCKS = 8


@dataclass(frozen=True, slots=True)
class Precopy:
    """What the pre-copy rounds leave to the freeze: the pools and capacity they copied against."""

    prepared: list[worker_pb2.PrepareSwitchResponse]
    capacity: int
    rounds: int
    bytes_copied: int


def precopy_refusal(target: Topology, staged: list[bool]) -> str:
    """Why this switch may not pre-copy its KV ("" when it may): every rank active in the target must hold a
    staged shard (the pool goes with it)."""
    missing = [rank for rank in range(target.num_workers) if rank >= len(staged) or not staged[rank]]
    if missing:
        return f"worker {missing[0]} staged no shard of the target"
    return ""


async def precopy_kv(workers: list[worker_pb2_grpc.WorkerStub], router: router_pb2_grpc.RouterStub,
                     target: SwitchTarget, operation_id: str, timeout: Callable[[], float],
                     metadata: tuple = (), duty: float = 1.0) -> Precopy | str:
    """PRECOPY, while the router serves: rounds of (the router's full blocks not copied yet -> every active worker
    of the target copies them into its staged pool). Returns what the freeze needs, or why no worker can pre-copy
    here (a str: nothing is left to undo but the staged pools)."""
    prepared, capacity = await prepare_workers(workers, target, timeout(), metadata)
    peers = peer_pools(prepared)
    receivers = workers[: target.topology.num_workers]
    rounds = copied_bytes = 0
    while rounds < PRECOPY_MAX_ROUNDS:
        blocks = await router.PreCopyBlocks(
            router_pb2.PreCopyBlocksRequest(operation_id=operation_id, num_kv_blocks=capacity,
                                            dp_size=target.topology.num_kv_pools),
            timeout=timeout(), metadata=metadata)
        request = worker_pb2.PreCopyKVRequest(operation_id=operation_id, num_kv_blocks=capacity,
                                              block_maps=blocks.block_maps, warm_block_maps=blocks.warm_block_maps,
                                              peers=peers, duty=duty)
        replies = await asyncio.gather(*(w.PreCopyKV(request, timeout=timeout(), metadata=metadata)
                                         for w in receivers), return_exceptions=True)
        if errors := [r for r in replies if isinstance(r, BaseException)]:
            raise errors[0]
        if not all(r.supported for r in replies):
            return ("a worker cannot read its peers' KV pools directly (several hosts, or GPUs without CUDA IPC): it "
                    "moves in the freeze")
        rounds += 1
        round_bytes = sum(r.kv_bytes_received + r.kv_bytes_local for r in replies)
        copied_bytes += round_bytes
        num_blocks = sum(len(m.src_block_ids) for m in blocks.block_maps)
        log.info("controller.precopy_round", operation_id=operation_id, round=rounds, blocks=num_blocks,
                 warm_blocks=sum(len(m.src_block_ids) for m in blocks.warm_block_maps), used=blocks.num_used,
                 bytes=round_bytes, seconds=round(max(r.seconds for r in replies), 4))
        if rounds > 1 and num_blocks <= PRECOPY_STOP_BLOCKS:
            break
    return Precopy(prepared, capacity, rounds, copied_bytes)


async def prepare_workers(workers: list[worker_pb2_grpc.WorkerStub], target: SwitchTarget, timeout: float,
                          metadata: tuple = ()) -> tuple[list[worker_pb2.PrepareSwitchResponse], int]:
    """PREPARING_WORKERS: every worker's pool and target capacity; the capacity is the smallest active one."""
    request = worker_pb2.PrepareSwitchRequest(topology=str(target.topology),
                                              layer_partition=target.layer_partition or (), export_cuda_ipc=True)
    prepared = list(await asyncio.gather(*(w.PrepareSwitch(request, timeout=timeout, metadata=metadata)
                                           for w in workers)))
    return prepared, min(p.num_kv_blocks for p in prepared if p.num_kv_blocks > 0)


def peer_pools(prepared: list[worker_pb2.PrepareSwitchResponse]) -> dict[int, worker_pb2.PeerPool]:
    """Each worker's KV pool as its peers read it (by world rank: the order of `prepared`)."""
    return {rank: peer_pool(p) for rank, p in enumerate(prepared)}
