"""Small host-to-device copies that do not wait for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory and synchronises the stream: the host waits for
every kernel queued before it (the previous step's graph) to finish. Staged through pinned memory, the copy is
queued behind them instead; the caching host allocator keeps the pinned block until the copy has run.
"""

from __future__ import annotations

import torch


def staged(values, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`values` (a list of numbers, or a host tensor) as a host tensor to copy to `device` with non_blocking=True:
    in pinned memory when the device is a GPU."""
    host = torch.as_tensor(values, dtype=dtype)
    return host.pin_memory() if device.type == "cuda" else host


def to_device(values, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`values` (a list of numbers, or a host tensor) as a tensor on `device`, without a host synchronisation."""
    return staged(values, device, dtype).to(device, non_blocking=True)
