"""KV channels: how one layer's KV slices travel between workers during a migration.

Every rank calls `exchange` once per layer with what it sends and what it receives (a collective step):
- `ShmChannel` (CPU, one host: one /dev/shm, services/runtime/host.py): KV pools live in shared memory; a receiver maps the sender's pool and reads the
  blocks straight out of it by block id (one copy, no staging, no RPC). Sends are no-ops.
- `CudaIpcChannel` (GPU, one host): the same reads out of a peer's GPU pool opened through its CUDA IPC handle
  (a switch's KV between the GPU workers of one host; live request migration between instances).
- `DistChannel` (torch.distributed): point-to-point send/recv of the sliced blocks over the world's device group —
  gloo between CPU hosts, NCCL between GPUs on one node or many (the multi-node path). A transfer carries the
  blocks of its (src_pool, dst_pool) block map, packed in the map's order.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from services.runtime.host import peers_share_memory
from services.topology import KVMigrationPlan, KVTransfer
from services.weightstore.shm import ShmSegment
from services.worker.cuda_ipc import OpenedHandle
from services.worker.parallel import ParallelState


class KVChannel(Protocol):
    """Moves the used blocks of (layer, KV head range) slices from old owners to new owners."""

    needs_outgoing: bool  # whether senders must hand their slices to exchange()

    def exchange(self, layer: int, outgoing: list[tuple[KVTransfer, torch.Tensor]],
                 incoming: list[KVTransfer]) -> dict[KVTransfer, Source]:
        """Send each outgoing slice ([2, used, block_size, heads, D], already cut) to its dst; return where each
        incoming transfer's data can be read. Called by every rank for every layer, in the same order."""
        ...

    def settle(self) -> None:
        """Return once every copy out of a peer's memory queued so far is done (before the world agrees that a
        layer is read, which lets its senders free it)."""
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


class _PeerPoolChannel:
    """Receivers copy straight out of the senders' pools, each mapped by the receiver for one layer. Sends are
    no-ops. Subclasses say how a peer's pool of a layer is mapped (`_attach`: a flat tensor and its closer).
    keep_open: every mapping stays until close() (a staged switch's pre-copy rounds and its cutover read the same
    pools: the pages the rounds touched are mapped already when the freeze copies the delta); else a layer's
    mappings are closed at the next layer."""

    needs_outgoing = False  # peers read the pools themselves

    def __init__(self, plan: KVMigrationPlan, block_size: int, head_dim: int, dtype: torch.dtype,
                 keep_open: bool = False) -> None:
        self.plan = plan
        self.block_size, self.head_dim, self.dtype = block_size, head_dim, dtype
        self.keep_open = keep_open
        self._open: dict[tuple[int, int], tuple[torch.Tensor, object]] = {}  # (rank, layer) -> pool, its closer

    def exchange(self, layer, outgoing, incoming):
        """Map each sender's pool for this layer: the caller copies straight out of it (no staging copy)."""
        if not self.keep_open:
            self.close()
        received = {}
        for transfer in incoming:
            key = (transfer.src_rank, layer)
            if key not in self._open:
                self._open[key] = self._attach(transfer.src_rank, layer)
            pool = self._view(self._open[key][0], transfer.src_rank)
            received[transfer] = Source(pool, transfer.src_head_offset, by_block_id=True)
        return received

    def _attach(self, rank: int, layer: int) -> tuple[torch.Tensor, object]:
        raise NotImplementedError

    def _view(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        num_heads = len(self.plan.old_local_kv_heads(rank))
        per_block = 2 * self.block_size * num_heads * self.head_dim
        count = flat.numel()
        return flat[:count - count % per_block].view(2, -1, self.block_size, num_heads, self.head_dim)

    def settle(self) -> None:
        pass  # CPU copies are done when they return

    def close(self) -> None:
        for _, mapping in self._open.values():
            mapping.close()
        self._open.clear()


class ShmChannel(_PeerPoolChannel):
    """CPU, one host: the senders' pools are shared-memory segments (PrepareSwitch's kv_segments)."""

    def __init__(self, pools: dict[int, dict[int, str]], plan: KVMigrationPlan, block_size: int, head_dim: int,
                 dtype: torch.dtype, keep_open: bool = False) -> None:
        super().__init__(plan, block_size, head_dim, dtype, keep_open)
        self.pools = pools  # rank -> layer -> segment name

    def _attach(self, rank: int, layer: int) -> tuple[torch.Tensor, ShmSegment]:
        name = self.pools.get(rank, {}).get(layer)
        if not name:
            raise RuntimeError(f"rank {rank} reported no KV segment for layer {layer}")
        segment = ShmSegment.attach(name, readonly=True, copy_on_write=True)  # reads never touch the peer
        count = segment.size // self.dtype.itemsize
        return torch.frombuffer(segment.buffer, dtype=self.dtype, count=count), segment


class CudaIpcChannel(_PeerPoolChannel):
    """GPU, one host: the senders' pools (other processes': peers in a switch, another instance's workers in a
    move) are opened through their CUDA IPC handles (PrepareSwitch's kv_cuda_ipc) and read on this device."""

    def __init__(self, handles: dict[int, dict[int, bytes]], plan: KVMigrationPlan, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, keep_open: bool = False) -> None:
        super().__init__(plan, block_size, head_dim, dtype, keep_open)
        self.handles, self.device = handles, device  # rank -> layer -> IPC handle

    def _attach(self, rank: int, layer: int) -> tuple[torch.Tensor, OpenedHandle]:
        handle = self.handles.get(rank, {}).get(layer)
        if not handle:
            raise RuntimeError(f"rank {rank} reported no CUDA IPC handle for layer {layer}")
        opened = OpenedHandle(handle, self.dtype, self.device)
        return opened.tensor, opened

    def settle(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()  # the copies read the peers' memory until they end


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

    def settle(self) -> None:
        pass  # the received slices are this rank's own buffers

    def close(self) -> None:
        pass


def channel_kind(peers: Mapping, world_size: int, device: torch.device, kv_channel: str = "") -> str:
    """`kv_channel` when given, else: on CPU shm where every worker of the world (`peers`: PeerPool messages by rank,
    PrepareSwitch's) sees this worker's shared memory, ipc where every one is a GPU worker on this host that reads
    and exports CUDA IPC, dist otherwise (workers on several hosts: the KV crosses over the world's device group).
    Every rank decides alike: from the same peers."""
    if kv_channel:
        return kv_channel
    if device.type == "cpu":
        return "shm" if peers_share_memory([p.shm_domain for p in peers.values()]) else "dist"
    here = socket.gethostname()
    ipc = len(peers) == world_size and all(p.cuda_ipc and p.hostname == here for p in peers.values())
    return "ipc" if ipc else "dist"


def peer_channel(kind: str, peers: Mapping, plan: KVMigrationPlan, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, keep_open: bool = False) -> ShmChannel | CudaIpcChannel:
    """Reads straight out of the peers' pools (PeerPool messages by rank): their shared-memory segments (shm) or
    their GPU layers' CUDA IPC handles (ipc)."""
    if kind == "shm":
        pools = {r: dict(pool.kv_segments) for r, pool in peers.items()}
        return ShmChannel(pools, plan, block_size, head_dim, dtype, keep_open)
    if kind == "ipc":
        handles = {r: dict(pool.kv_cuda_ipc) for r, pool in peers.items()}
        return CudaIpcChannel(handles, plan, block_size, head_dim, dtype, device, keep_open)
    raise ValueError(f"no peer channel of kind {kind!r} (shm or ipc)")
