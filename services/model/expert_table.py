"""Where a sparse layer's local experts lie, for kernels that read them in place (services/model/triton_moe.py):
one device tensor of element offsets per weight, from the first slot's tensor. The experts stay where
SparseMoeBlock holds them (a tensor pair per slot, shared with a previous shard, replaced by an in-place switch's
rollback); a graph captured over the table reads it when it replays, so new tensors are written into the table in
place (`refresh`) instead of capturing again."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ExpertTable:
    """Where each local slot's (gate_up [2I, hidden], down [hidden, I]) lie: their element offsets [slots] int64
    from `anchor`, a one-element tensor of their dtype on their device that the table owns (it holds no weight
    alive: an in-place switch can let the experts go). Tensors not contiguous, of another dtype, device or shape
    than slot 0's cannot be read this way: `build` says None."""

    anchor: torch.Tensor
    gate_up_offsets: torch.Tensor
    down_offsets: torch.Tensor
    intermediate: int
    hidden: int

    @classmethod
    def build(cls, experts: Sequence[tuple[torch.Tensor, ...]]) -> ExpertTable | None:
        if not experts:
            return None
        gate_up, down = experts[0]
        hidden, intermediate = down.shape
        device = gate_up.device
        table = cls(torch.zeros(1, dtype=gate_up.dtype, device=device),
                    torch.zeros(len(experts), dtype=torch.int64, device=device),
                    torch.zeros(len(experts), dtype=torch.int64, device=device), intermediate, hidden)
        return table if table.refresh(experts) else None

    def refresh(self, experts: Sequence[tuple[torch.Tensor, ...]]) -> bool:
        """Write the offsets of `experts` (the same slots; new tensors, maybe) into the table in place; False (the
        table unchanged) where one of them cannot be read through it."""
        shapes = ((2 * self.intermediate, self.hidden), (self.hidden, self.intermediate))
        size, base = self.anchor.element_size(), self.anchor.data_ptr()
        if len(experts) != self.num_slots:
            return False
        offsets: list[list[int]] = [[], []]
        for weights in experts:
            for column, tensor, shape in zip(offsets, weights, shapes, strict=True):
                delta = tensor.data_ptr() - base
                if (tensor.shape != shape or tensor.dtype != self.anchor.dtype or tensor.device != self.anchor.device
                        or not tensor.is_contiguous() or delta % size):
                    return False
                column.append(delta // size)
        self.gate_up_offsets.copy_(torch.tensor(offsets[0], dtype=torch.int64))
        self.down_offsets.copy_(torch.tensor(offsets[1], dtype=torch.int64))
        return True

    @property
    def num_slots(self) -> int:
        return self.gate_up_offsets.shape[0]
