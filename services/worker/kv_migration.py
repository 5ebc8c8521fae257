"""Executes this worker's part of a KV migration plan over the shared-memory channel.

Layer by layer: allocate the new layer tensor, copy every (layer, KV head range) it receives — from its own old
tensor, or straight out of a peer's shared-memory pool (one copy, no staging, no RPC) — for the used blocks
only; then a world barrier (every receiver of the layer is done reading), then free the old layer. The extra
memory at any time is about one layer's KV.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.topology import KVMigrationPlan
from services.weightstore.shm import ShmSegment
from services.worker.kv_cache import KVCache, KVLayer


@dataclass(slots=True)
class MigrationStats:
    """What one worker's migration did."""

    bytes_received: int = 0     # copied out of peers' pools
    bytes_local: int = 0        # copied inside this worker (head offsets changed)
    layers_kept: int = 0        # layer tensors kept as they were (no copy)
    peak_extra_bytes: int = 0   # new layer tensors alive next to old ones, at most
    seconds: float = 0.0


class _PeerPools:
    """Read-only maps of peers' KV layer segments, opened on first use and closed per layer."""

    def __init__(self, pools: dict[int, dict[int, str]], plan: KVMigrationPlan, cache_shape: tuple[int, int],
                 dtype: torch.dtype) -> None:
        self.pools = pools
        self.plan = plan
        self.block_size, self.head_dim = cache_shape
        self.dtype = dtype
        self._open: list[ShmSegment] = []

    def tensor(self, rank: int, layer: int) -> torch.Tensor:
        name = self.pools.get(rank, {}).get(layer)
        if not name:
            raise RuntimeError(f"rank {rank} reported no KV segment for layer {layer}")
        segment = ShmSegment.attach(name, readonly=True, copy_on_write=True)  # reads never touch the peer
        self._open.append(segment)
        num_heads = len(self.plan.old_local_kv_heads(rank))
        per_block = 2 * self.block_size * num_heads * self.head_dim
        count = segment.size // self.dtype.itemsize
        flat = torch.frombuffer(segment.buffer, dtype=self.dtype, count=count - count % per_block)
        return flat.view(2, -1, self.block_size, num_heads, self.head_dim)

    def close(self) -> None:
        for segment in self._open:
            segment.close()
        self._open.clear()


def migrate_kv(plan: KVMigrationPlan, rank: int, old_cache: KVCache | None, new_cache: KVCache | None,
               used_block_ids: list[int], peer_pools: dict[int, dict[int, str]],
               barrier: Callable[[], None]) -> MigrationStats:
    """Move this rank's KV to the new layout. Collective: every rank of the world calls it with the same plan."""
    started = time.perf_counter()
    stats = MigrationStats()
    reference = new_cache or old_cache
    used = torch.tensor(sorted(used_block_ids), dtype=torch.int64)
    peers = _PeerPools(peer_pools, plan, (reference.block_size, reference.head_dim), reference.dtype) \
        if reference is not None else None
    same_blocks = old_cache is not None and new_cache is not None and old_cache.num_blocks == new_cache.num_blocks
    for layer in plan.layers():
        fresh: KVLayer | None = None
        if new_cache is not None and layer in plan.new_local_layers(rank):
            if same_blocks and plan.is_identity_for(rank, layer):
                new_cache.set_layer(layer, old_cache.pop_layer(layer))  # nothing changes for this layer
                stats.layers_kept += 1
            else:
                fresh = new_cache.new_layer()
                stats.peak_extra_bytes = max(stats.peak_extra_bytes, fresh.tensor.numel() * fresh.tensor.element_size())
                for transfer in plan.for_layer(layer):
                    if transfer.dst_rank == rank:
                        nbytes = _copy(transfer, fresh.tensor, old_cache, peers, layer, used)
                        if transfer.is_local:
                            stats.bytes_local += nbytes
                        else:
                            stats.bytes_received += nbytes
        barrier()  # every receiver of this layer has read it: old storage may go
        if peers is not None:
            peers.close()
        if fresh is not None:
            new_cache.set_layer(layer, fresh)
        if old_cache is not None and layer in old_cache.layer_ids and old_cache.has_layer(layer):
            old_cache.pop_layer(layer).free()
    stats.seconds = time.perf_counter() - started
    return stats


def _copy(transfer, dst: torch.Tensor, old_cache: KVCache | None, peers: _PeerPools | None, layer: int,
          used: torch.Tensor) -> int:
    """Copy one transfer's heads for the used blocks into dst; returns bytes copied."""
    if transfer.is_local:
        src = old_cache.layer(layer).tensor
    else:
        src = peers.tensor(transfer.src_rank, layer)
    heads = transfer.num_kv_heads
    s0, d0 = transfer.src_head_offset, transfer.dst_head_offset
    block = src[:, used, :, s0:s0 + heads]  # [2, used, block_size, heads, D]
    dst[:, used, :, d0:d0 + heads] = block
    return block.numel() * block.element_size()
