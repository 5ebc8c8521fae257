"""The worker-side paged KV cache: one tensor per local layer, sized from a memory budget."""

from __future__ import annotations

import torch


class KVCache:
    """KV blocks of this worker's layers and KV heads. Block ids are global (the scheduler owns them)."""

    def __init__(self, layers: range, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, budget_bytes: int) -> None:
        self.layer_ids = layers
        self.block_size = block_size
        self.bytes_per_block = 2 * block_size * num_kv_heads * head_dim * dtype.itemsize * max(len(layers), 1)
        self.num_blocks = budget_bytes // self.bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(
                f"KV budget of {budget_bytes} bytes is below one block ({self.bytes_per_block} bytes)"
            )
        # One tensor per layer, [2 (K, V), num_blocks, block_size, kv_heads, head_dim]: a migration can move and
        # free a layer at a time.
        self.layers: list[torch.Tensor] = [
            torch.zeros(2, self.num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
            for _ in layers
        ]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)
