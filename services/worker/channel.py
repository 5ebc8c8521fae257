"""KV channels: how one layer's KV slices travel between workers during a migration.

Every rank calls `exchange` once per layer with what it sends and what it receives (a collective step):
- `ShmChannel` (CPU, one host): KV pools live in shared memory; a receiver maps the sender's pool and reads the
  blocks straight out of it by block id (one copy, no staging, no RPC). Sends are no-ops.
- `DistChannel` (torch.distributed): point-to-point send/recv of the sliced blocks over the world's device group —
  gloo between CPU hosts, NCCL between GPUs on one node or many (the multi-node path). A transfer carries the
  blocks of its (src_pool, dst_pool) block map, packed in the map's order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from services.topology import KVMigrationPlan, KVTransfer
from services.weightstore.shm import ShmSegment
from services.worker.parallel import ParallelState


class KVChannel(Protocol):
    """Moves the used blocks of (layer, KV head range) slices from old owners to new owners."""

    needs_outgoing: bool  # whether senders must hand their slices to exchange()

    def exchange(self, layer: int, outgoing: list[tuple[KVTransfer, torch.Tensor]],
                 incoming: list[KVTransfer]) -> dict[KVTransfer, Source]:
        """Send each outgoing slice ([2, used, block_size, heads, D], already cut) to its dst; return where each
        incoming transfer's data can be read. Called by every rank for every layer, in the same order."""
        ...

    def close(self) -> None:
        ...


@dataclass(frozen=True, slots=True)
class Source:
    """Where a received slice can be read: `tensor[:, index, :, head_offset:head_offset + heads]`, where index is
    the block id itself (`by_block_id`, a peer's whole pool) or the block's position among the blocks its pool
    pair moves (a packed buffer, sorted by source id)."""

    tensor: torch.Tensor
    head_offset: int
    by_block_id: bool


class ShmChannel:
    """Receivers copy straight out of the senders' shared-memory pools."""

    needs_outgoing = False  # peers read the pools themselves

    def __init__(self, pools: dict[int, dict[int, str]], plan: KVMigrationPlan, block_size: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        self.pools = pools  # rank -> layer -> segment name (PrepareSwitch)
        self.plan = plan
        self.block_size, self.head_dim, self.dtype = block_size, head_dim, dtype
        self._open: dict[int, ShmSegment] = {}  # this layer's peer pools, closed at the next layer

    def exchange(self, layer, outgoing, incoming):
        """Map each sender's pool for this layer: the caller copies straight out of it (no staging copy)."""
        self.close()
        received = {}
        for transfer in incoming:
            if transfer.src_rank not in self._open:
                self._open[transfer.src_rank] = self._attach(transfer.src_rank, layer)
            pool = self._view(self._open[transfer.src_rank], transfer.src_rank)
            received[transfer] = Source(pool, transfer.src_head_offset, by_block_id=True)
        return received

    def _attach(self, rank: int, layer: int) -> ShmSegment:
        name = self.pools.get(rank, {}).get(layer)
        if not name:
            raise RuntimeError(f"rank {rank} reported no KV segment for layer {layer}")
        return ShmSegment.attach(name, readonly=True, copy_on_write=True)  # reads never touch the peer

    def _view(self, segment: ShmSegment, rank: int) -> torch.Tensor:
        num_heads = len(self.plan.old_local_kv_heads(rank))
        per_block = 2 * self.block_size * num_heads * self.head_dim
        count = segment.size // self.dtype.itemsize
        flat = torch.frombuffer(segment.buffer, dtype=self.dtype, count=count - count % per_block)
        return flat.view(2, -1, self.block_size, num_heads, self.head_dim)

    def close(self) -> None:
        for segment in self._open.values():
            segment.close()
        self._open.clear()


class DistChannel:
    """torch.distributed point-to-point over the world's device group: gloo on CPU, NCCL across GPUs, gloo staged
    through host memory on a shared GPU (tag = layer keeps layers apart)."""

    needs_outgoing = True

    def __init__(self, parallel: ParallelState, block_counts: Mapping[tuple[int, int], int], block_size: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.parallel = parallel
        self.block_counts = dict(block_counts)  # (src_pool, dst_pool) -> blocks its map moves (see block_counts)
        self.block_size, self.head_dim, self.dtype, self.device = block_size, head_dim, dtype, device

    def exchange(self, layer, outgoing, incoming):
        received = {}
        for transfer in incoming:
            blocks = self.block_counts.get(transfer.pools, 0)
            buffer = torch.empty((2, blocks, self.block_size, transfer.num_kv_heads, self.head_dim),
                                 dtype=self.dtype, device=self.device)
            received[transfer] = Source(buffer, 0, by_block_id=False)
        self.parallel.exchange([(data, transfer.dst_rank) for transfer, data in outgoing],
                               [(received[transfer].tensor, transfer.src_rank) for transfer in incoming], tag=layer)
        return received

    def close(self) -> None:
        pass
