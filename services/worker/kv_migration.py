"""Executes this worker's part of a KV migration plan.

Layer by layer, in the plan's order: allocate the new layer tensor, fill every (layer, KV head range) it receives —
from its own old tensor, or through the KV channel from a peer (the shared-memory channel reads straight out of the
peer's pool) — for the used blocks only; then a world barrier (every receiver of the layer is done reading), then
free the old layer. A layer whose slice does not change is kept as it is. The extra memory stays near one layer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.topology import KVMigrationPlan
from services.worker.channel import KVChannel
from services.worker.kv_cache import KVCache, KVLayer


@dataclass(slots=True)
class MigrationStats:
    """What one worker's migration did."""

    bytes_received: int = 0     # from peers
    bytes_local: int = 0        # copied inside this worker (head offsets changed)
    layers_kept: int = 0        # layer tensors kept as they were (no copy)
    peak_extra_bytes: int = 0   # a new layer tensor alive next to the old ones, at most
    seconds: float = 0.0


def migrate_kv(plan: KVMigrationPlan, rank: int, old_cache: KVCache | None, new_cache: KVCache | None,
               used_block_ids: list[int], channel: KVChannel, barrier: Callable[[], None]) -> MigrationStats:
    """Move this rank's KV to the new layout. Collective: every rank of the world calls it with the same plan."""
    started = time.perf_counter()
    stats = MigrationStats()
    used = torch.tensor(sorted(used_block_ids), dtype=torch.int64)
    same_blocks = old_cache is not None and new_cache is not None and old_cache.num_blocks == new_cache.num_blocks
    for layer in plan.layers():
        transfers = plan.for_layer(layer)
        outgoing = []
        if channel.needs_outgoing:
            outgoing = [(t, _slice(old_cache.layer(layer).tensor, used, t.src_head_offset, t.num_kv_heads))
                        for t in transfers if t.src_rank == rank and not t.is_local]
        incoming = [t for t in transfers if t.dst_rank == rank and not t.is_local]
        fresh: KVLayer | None = None
        if new_cache is not None and layer in plan.new_local_layers(rank):
            if same_blocks and plan.is_identity_for(rank, layer):
                new_cache.set_layer(layer, old_cache.pop_layer(layer))  # nothing changes for this layer
                stats.layers_kept += 1
            else:
                fresh = new_cache.new_layer()
                stats.peak_extra_bytes = max(stats.peak_extra_bytes,
                                             fresh.tensor.numel() * fresh.tensor.element_size())
        received = channel.exchange(layer, outgoing, incoming)
        if fresh is not None:
            for t in transfers:
                if t.dst_rank != rank:
                    continue
                block = (_slice(old_cache.layer(layer).tensor, used, t.src_head_offset, t.num_kv_heads)
                         if t.is_local else received[t])
                fresh.tensor[:, used, :, t.dst_head_offset:t.dst_head_offset + t.num_kv_heads] = block
                nbytes = block.numel() * block.element_size()
                if t.is_local:
                    stats.bytes_local += nbytes
                else:
                    stats.bytes_received += nbytes
        barrier()  # every receiver of this layer has read it: old storage may go
        if fresh is not None:
            new_cache.set_layer(layer, fresh)
        if old_cache is not None and old_cache.has_layer(layer):
            old_cache.pop_layer(layer).free()
    channel.close()
    stats.seconds = time.perf_counter() - started
    return stats


def _slice(cache: torch.Tensor, used: torch.Tensor, head_offset: int, num_heads: int) -> torch.Tensor:
    """K/V of the used blocks and a head range: [2, used, block_size, heads, D] (a copy: advanced indexing)."""
    return cache[:, used, :, head_offset:head_offset + num_heads]
