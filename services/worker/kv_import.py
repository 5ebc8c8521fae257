"""KV import on one worker: copy a request's KV blocks out of another instance's workers into this worker's live
pool (live request migration between instances, MELL).

The source instance may run another layout: the 2D plan (layers x KV heads) from the source's placement to this
instance's says which source worker holds each slice this worker needs; the source's worker ranks are put past
this world's (`SOURCE_RANK_BASE + active index`) so that no transfer reads as local. Blocks change ids (the
source's ids -> the ones this router reserved); the copy reads the source pools where they are, in shared memory
(CPU) or through their CUDA IPC handles (GPU; one host, either way): one copy per run of blocks, nothing on the
source's steps, and it writes only the reserved blocks, which no step uses yet. A source on another host sends its
slices over torch.distributed instead (ExportKV beside its steps, services/worker/kv_remote.py).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import torch

from services.model.spec import ModelShape
from services.rpc.errors import describe_error
from services.rpc.tls import TLSConfig
from services.runtime.host import peers_share_memory
from services.topology import Placement, Topology, place, plan_kv_migration
from services.worker.channel import CudaIpcChannel, ShmChannel
from services.worker.kv_cache import KVCache
from services.worker.kv_migration import MigrationStats, fill_layer, pool_blocks
from services.worker.kv_remote import RemoteKVChannel

SOURCE_RANK_BASE = 1 << 20  # source worker i is rank SOURCE_RANK_BASE + i in the import plan


class ImportRefused(RuntimeError):
    """The import cannot run here (another host, KV not in shared memory): FAILED_PRECONDITION."""


@dataclass(frozen=True, slots=True)
class KVSourceSpec:
    """Another instance's KV, as its router describes it (worker_pb2.KVSource)."""

    topology: Topology
    layer_partition: tuple[int, ...] | None
    pools: dict[int, dict[int, str]]  # source active index -> layer -> shared-memory segment (CPU)
    block_size: int
    hostname: str
    cuda_ipc: dict[int, dict[int, bytes]] = field(default_factory=dict)  # index -> layer -> IPC handle (GPU)
    shm_domains: dict[int, str] = field(default_factory=dict)  # index -> its shared memory ("": not said)
    addresses: dict[int, str] = field(default_factory=dict)  # index -> its worker's gRPC address (ExportKV)

    @classmethod
    def from_pb(cls, pb) -> KVSourceSpec:
        return cls(Topology.parse(pb.topology), tuple(pb.layer_partition) or None,
                   {index: dict(pool.kv_segments) for index, pool in pb.pools.items()}, pb.block_size, pb.hostname,
                   {index: dict(pool.kv_cuda_ipc) for index, pool in pb.pools.items() if pool.kv_cuda_ipc},
                   {index: pool.shm_domain for index, pool in pb.pools.items()},
                   {index: pool.address for index, pool in pb.pools.items() if pool.address})

    def readable_here(self, device: torch.device) -> bool:
        """Whether this worker can read the source's pools where they are: every one in its shared memory (CPU),
        or on its host (GPU: CUDA IPC)."""
        if device.type == "cpu" and any(self.shm_domains.values()):
            return peers_share_memory(list(self.shm_domains.values()))
        return self.hostname == socket.gethostname()

    def channel(self, plan, cache: KVCache):
        """How this worker reads the source's pools: shared memory between CPU pools, CUDA IPC between GPU ones
        (ImportRefused for a mix, or a GPU source that exported no handles)."""
        ranks = range(self.topology.num_workers)
        if cache.device.type == "cpu":
            if self.cuda_ipc or not all(any(self.pools.get(i, {}).values()) for i in ranks):
                raise ImportRefused("the source's KV is not in shared memory (a GPU pool) and this worker's is: "
                                    "an import between them needs the distributed channel")
            return ShmChannel({SOURCE_RANK_BASE + i: pool for i, pool in self.pools.items()}, plan,
                              cache.block_size, cache.head_dim, cache.dtype)
        if sorted(self.cuda_ipc) != list(ranks):
            raise ImportRefused("the source exported no CUDA IPC handles of its KV (a CPU pool, or an older "
                                "worker): an import onto this GPU worker needs them")
        return CudaIpcChannel({SOURCE_RANK_BASE + i: pool for i, pool in self.cuda_ipc.items()}, plan,
                              cache.block_size, cache.head_dim, cache.dtype, cache.device)


@dataclass(frozen=True, slots=True)
class RemoteReader:
    """How this worker reaches source workers on other hosts (ExportKV over its gRPC link, a gloo pair group)."""

    bind_host: str
    token: str | None = None
    tls: TLSConfig | None = None
    timeout_s: float = 60.0


def import_kv(source: KVSourceSpec, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
              shape: ModelShape, live: Placement, rank: int, cache: KVCache, num_redundant_experts: int = 0,
              remote: RemoteReader | None = None) -> MigrationStats:
    """Copy `src_block_ids` of the source's pools into `dst_block_ids` of this rank's live `cache` (every local
    layer and KV head, re-cut from the source layout): read where the pools are on this host, else received from
    the source's workers over torch.distributed (`remote`; services/worker/kv_remote.py). ValueError on a bad
    request, ImportRefused where the pools can be reached neither way."""
    started = time.perf_counter()
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(f"{len(src_block_ids)} source block ids but {len(dst_block_ids)} target ones")
    if source.block_size != cache.block_size:
        raise ValueError(f"the source's blocks hold {source.block_size} tokens, this worker's {cache.block_size}")
    here = source.readable_here(cache.device)
    if not here and (remote is None or len(source.addresses) < source.topology.num_workers):
        raise ImportRefused(f"the source's KV is on another host ({source.hostname!r}) and its workers' addresses "
                            "are not known here: shared memory and CUDA IPC handles are read only on one host")
    if len(set(src_block_ids)) != len(src_block_ids):
        raise ValueError("source block ids must be distinct")
    if bad := [b for b in dst_block_ids if not 0 <= b < cache.num_blocks]:
        raise ValueError(f"target block ids {bad[:4]} are outside this pool of {cache.num_blocks} blocks")
    source_placement = place(source.topology, shape, source.layer_partition, num_redundant_experts)
    source_ranks = [SOURCE_RANK_BASE + i for i in range(source.topology.num_workers)]
    if missing := [i for i in range(source.topology.num_workers) if i not in source.pools]:
        raise ValueError(f"the source lists no KV pool for its workers {missing}")
    plan = plan_kv_migration(source_placement, source_ranks, live, list(range(live.topology.num_workers)))
    stats = MigrationStats()
    if src_block_ids:
        if here:
            channel = source.channel(plan, cache)
        else:  # the source sends its slices packed in ascending source id: pool_blocks' order
            addresses = {SOURCE_RANK_BASE + i: address for i, address in source.addresses.items()}
            try:
                channel = RemoteKVChannel(plan, rank, addresses, sorted(src_block_ids), cache, remote.bind_host,
                                          remote.token, remote.tls, remote.timeout_s)
            except (RuntimeError, grpc.RpcError) as exc:
                raise ImportRefused(f"no group with the source's workers: {describe_error(exc)}") from exc
        maps = pool_blocks({(0, 0): (list(src_block_ids), list(dst_block_ids))})
        try:
            for layer in plan.new_local_layers(rank):
                transfers = [t for t in plan.for_layer(layer) if t.dst_rank == rank]
                received = channel.exchange(layer, [], transfers)
                fill_layer(cache.layer(layer), transfers, rank, None, received, maps, layer, stats)
            if not here:
                channel.finish()
        except (RuntimeError, grpc.RpcError) as exc:
            if here:
                raise
            # The reserved blocks hold nothing a step reads yet: the move goes on by re-prefill (the front's
            # fallback for FAILED_PRECONDITION), or not at all.
            raise ImportRefused(f"the source's workers could not send their KV: {describe_error(exc)}") from exc
        finally:
            channel.close()
    stats.seconds = time.perf_counter() - started
    return stats

