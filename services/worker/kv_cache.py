"""The worker-side paged KV cache: one tensor per local layer, sized from a memory budget.

On CPU every layer lives in its own POSIX shared-memory segment, so a peer worker can copy a layer's blocks
straight out of it during a live reconfiguration (one memcpy, no staging, no RPC). On a GPU a worker of another
instance on the same host reads a layer through its CUDA IPC handle instead (live request migration).
"""

from __future__ import annotations

import itertools
import os

import structlog
import torch

from services.weightstore.shm import ShmSegment, cleanup_stale_segments, segment_name
from services.worker.cuda_ipc import IpcUnavailable, export_handle

log = structlog.get_logger(__name__)

KV_SEGMENT_PREFIX = "reconfig-kv-"
_serial = itertools.count()


def cleanup_stale_kv_segments() -> list[str]:
    """Remove KV segments of workers that died without cleaning up (kill -9)."""
    return cleanup_stale_segments(prefix=KV_SEGMENT_PREFIX)


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype) -> int:
    """Bytes one block id costs on a worker: K and V of every local layer and KV head."""
    return 2 * block_size * num_kv_heads * head_dim * dtype.itemsize * max(num_layers, 1)


def num_blocks_for_budget(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                          budget_bytes: int) -> int:
    """How many blocks fit in the budget when every local layer holds them."""
    return budget_bytes // kv_bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype)


class KVLayer:
    """One layer's cache tensor [2, num_blocks, block_size, kv_heads, head_dim], shared-memory backed on CPU."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.segment: ShmSegment | None = None
        self._ipc_handle = b""  # a GPU layer's CUDA IPC handle, taken when first asked for
        if device.type == "cpu":
            num_bytes = max(1, int(torch.Size(shape).numel()) * dtype.itemsize)
            self.segment = ShmSegment.create(segment_name(os.getpid(), next(_serial), KV_SEGMENT_PREFIX), num_bytes)
            self.tensor = torch.frombuffer(self.segment.buffer, dtype=dtype, count=torch.Size(shape).numel())
            self.tensor = self.tensor.view(shape)  # zero-filled: a new segment reads as zeros
        else:
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def segment_name(self) -> str:
        return self.segment.name if self.segment is not None else ""

    @property
    def cuda_ipc_handle(self) -> bytes:
        """A GPU layer's CUDA IPC handle (cuda_ipc.py), for a worker of another instance on this host; b"" on CPU."""
        if not self._ipc_handle and self.tensor is not None and self.tensor.device.type == "cuda":
            self._ipc_handle = export_handle(self.tensor)
        return self._ipc_handle

    def free(self) -> None:
        """Release the storage (the tensor must not be used afterwards)."""
        self.tensor = None
        self._ipc_handle = b""
        if self.segment is not None:
            self.segment.unlink()
            self.segment.close()
            self.segment = None


class KVCache:
    """KV blocks of this worker's layers and KV heads. Block ids are global (the scheduler owns them)."""

    def __init__(self, layers: range, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, budget_bytes: int | None = None, num_blocks: int | None = None,
                 allocate: bool = True) -> None:
        self.layer_ids = layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.bytes_per_block = kv_bytes_per_block(len(layers), num_kv_heads, head_dim, block_size, dtype)
        if num_blocks is None:
            num_blocks = (budget_bytes or 0) // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"KV budget of {budget_bytes} bytes is below one block ({self.bytes_per_block} bytes)")
        self.num_blocks = num_blocks
        # allocate=False: a migration target, filled layer by layer with set_layer().
        self._layers: dict[int, KVLayer] = {layer: self.new_layer() for layer in layers} if allocate else {}

    def new_layer(self) -> KVLayer:
        """Allocate a zeroed layer tensor of this cache's shape (a migration fills it, then swaps it in)."""
        shape = (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return KVLayer(shape, self.dtype, self.device)

    @property
    def layers(self) -> list[torch.Tensor]:
        """Per-layer tensors in layer order (what the model reads and writes)."""
        return [self._layers[layer].tensor for layer in self.layer_ids]

    def layer(self, layer: int) -> KVLayer:
        return self._layers[layer]

    def has_layer(self, layer: int) -> bool:
        return layer in self._layers

    def set_layer(self, layer: int, kv_layer: KVLayer) -> None:
        self._layers[layer] = kv_layer

    def pop_layer(self, layer: int) -> KVLayer:
        return self._layers.pop(layer)

    def segment_names(self) -> dict[int, str]:
        """Global layer id -> shared-memory segment name (for peers mapping this cache)."""
        return {layer: kv.segment_name for layer, kv in self._layers.items()}

    def cuda_ipc_handles(self) -> dict[int, bytes]:
        """Global layer id -> CUDA IPC handle of a GPU cache ({} on CPU), for another instance's workers."""
        if self.device.type != "cuda":
            return {}
        try:
            return {layer: kv.cuda_ipc_handle for layer, kv in self._layers.items() if kv.tensor is not None}
        except IpcUnavailable as exc:  # the importer refuses, and the move goes by re-prefill
            log.warning("worker.kv_not_exportable", error=str(exc))
            return {}

    @property
    def num_bytes(self) -> int:
        """Bytes allocated now (during a migration some layers are already gone or not yet there)."""
        return sum(kv.tensor.numel() * kv.tensor.element_size() for kv in list(self._layers.values())
                   if kv.tensor is not None)

    def close(self) -> None:
        """Unlink every segment (on worker exit)."""
        for kv in self._layers.values():
            kv.free()
        self._layers.clear()
