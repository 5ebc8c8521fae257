"""Accounting of global KV block ids: the same id means the same tokens' KV on every worker.

Pure bookkeeping (no tensors). A sequence owns `block_ids` covering exactly the tokens cached on the workers
plus those fed in its scheduled step: ceil(tokens / block_size) blocks. Free ids are handed out lowest first,
so live blocks stay packed at the bottom and a shrink (Rebind after a reconfiguration) usually needs no
preemption.
"""

from __future__ import annotations

import heapq

from services.router.sequence import Sequence


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Owns the global KV block ids: allocate, append, free, and resize to a new capacity."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self._num_total = num_blocks
        self._free: list[int] = list(range(num_blocks))  # min-heap of free ids
        self._owner: dict[int, str] = {}                  # used block id -> request_id

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (the KV cache usage metric)."""
        return self.num_used / self._num_total

    def used_block_ids(self) -> list[int]:
        """Block ids in use, ascending (what a KV migration must move)."""
        return sorted(self._owner)

    def owner(self, block_id: int) -> str | None:
        """The request_id holding `block_id`, None when it is free."""
        return self._owner.get(block_id)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` lacks to cache its computed tokens plus `num_new_tokens` more."""
        covered = num_blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, covered - len(seq.block_ids))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int | None = None) -> None:
        """Give a sequence holding no blocks the blocks for its next step (default: all its uncomputed tokens)."""
        if seq.block_ids:
            raise ValueError(f"{seq.request_id} already holds {len(seq.block_ids)} blocks")
        num_new_tokens = seq.num_uncomputed_tokens if num_new_tokens is None else num_new_tokens
        if not self.append_slots(seq, num_new_tokens):
            raise RuntimeError(f"{seq.request_id} needs {self.num_blocks_needed(seq, num_new_tokens)} blocks, "
                               f"{self.num_free} free")

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq.block_ids to cover its tokens after a step feeding `num_new_tokens`; False (no change) if short."""
        needed = self.num_blocks_needed(seq, num_new_tokens)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            block_id = heapq.heappop(self._free)
            self._owner[block_id] = seq.request_id
            seq.block_ids.append(block_id)
        return True

    def take(self, request_id: str, num_blocks: int) -> list[int] | None:
        """`num_blocks` free ids (lowest first) for request_id, or None (nothing taken) when fewer are free: a
        request moving in from another pool (a switch between data-parallel widths)."""
        if num_blocks > len(self._free):
            return None
        taken = [heapq.heappop(self._free) for _ in range(num_blocks)]
        for block_id in taken:
            self._owner[block_id] = request_id
        return taken

    def release(self, block_id: int) -> None:
        """Return one used block (DataParallelBlocks.release)."""
        del self._owner[block_id]
        heapq.heappush(self._free, block_id)

    def free(self, seq: Sequence) -> None:
        """Return all of seq's blocks; seq.block_ids becomes empty."""
        self.truncate(seq, 0)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Return seq's blocks past those holding its first `num_tokens` tokens (a failed step's new slots)."""
        keep = num_blocks_for(num_tokens, self.block_size)
        for block_id in seq.block_ids[keep:]:
            if self._owner.get(block_id) != seq.request_id:
                raise RuntimeError(f"block {block_id} is not owned by {seq.request_id}")
            del self._owner[block_id]
            heapq.heappush(self._free, block_id)
        del seq.block_ids[keep:]
        seq.blocks_rewritten()  # the next blocks may take the same count with other ids

    def resize(self, num_blocks: int) -> list[int]:
        """Rebind to `num_blocks`: grow, or shrink when every id >= num_blocks is free.

        Returns the used ids >= num_blocks that block a shrink (sorted; nothing changed then): their owners must
        be preempted before the shrink can happen. An empty list means the new size is in effect.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if num_blocks >= self._num_total:
            for block_id in range(self._num_total, num_blocks):
                heapq.heappush(self._free, block_id)
        else:
            blocking = sorted(b for b in self._owner if b >= num_blocks)
            if blocking:
                return blocking
            self._free = [b for b in self._free if b < num_blocks]
            heapq.heapify(self._free)
        self._num_total = num_blocks
        return []
