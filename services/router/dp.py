"""KV block accounting for data-parallel attention: one pool of block ids per DP rank, one interface for all.

In an expert-parallel layout (ep{E}pp{P}) each of the E ranks of a stage runs attention for its own requests over
its own KV cache, so a block id names a slot in one rank's pool only. A request is bound to a rank when it first
gets blocks (the rank with the fewest blocks in use that can take it: new load goes where the KV is emptiest) and
keeps it while it holds blocks; once freed (finished, preempted) it may land elsewhere on its next prefill. With
one rank this is exactly the single BlockManager, which is why the Scheduler knows only this class.

Pure bookkeeping, no tensors.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Mapping
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass

from services.router.block_manager import BlockManager
from services.router.sequence import Sequence

BlockMaps = dict[tuple[int, int], tuple[list[int], list[int]]]  # (old pool, new pool) -> (old ids, new ids)


class DataParallelBlocks:
    """E independent KV pools of `num_blocks` ids each; a sequence's block ids are ids of its rank's pool."""

    def __init__(self, num_ranks: int, num_blocks: int, block_size: int) -> None:
        if num_ranks < 1:
            raise ValueError(f"need num_ranks >= 1, got {num_ranks}")
        self.block_size = block_size
        self._pools = tuple(BlockManager(num_blocks, block_size) for _ in range(num_ranks))
        self._rank: dict[str, int] = {}  # request_id -> DP rank, only while the sequence holds blocks

    @classmethod
    def of(cls, pool: BlockManager) -> DataParallelBlocks:
        """One rank over an existing, unused pool (what a Scheduler given a plain BlockManager schedules on)."""
        if pool.num_used:
            raise ValueError(f"the pool has {pool.num_used} blocks in use; wrap it before allocating")
        blocks = cls(1, pool.num_total, pool.block_size)
        blocks._pools = (pool,)
        return blocks

    # ---- sizes -----------------------------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return len(self._pools)

    @property
    def num_blocks_per_rank(self) -> int:
        """One rank's capacity: the most a single request can ever hold, and what Rebind sets."""
        return self._pools[0].num_total

    @property
    def num_total(self) -> int:
        """Blocks over all ranks."""
        return sum(pool.num_total for pool in self._pools)

    @property
    def num_used(self) -> int:
        return sum(pool.num_used for pool in self._pools)

    @property
    def num_free(self) -> int:
        return sum(pool.num_free for pool in self._pools)

    @property
    def usage(self) -> float:
        """Fraction of all ranks' blocks in use."""
        return self.num_used / self.num_total

    def per_rank_used(self) -> tuple[int, ...]:
        """Blocks in use on each rank, by rank."""
        return tuple(pool.num_used for pool in self._pools)

    # ---- which rank --------------------------------------------------------------------------------------------
    def rank_of(self, seq: Sequence) -> int | None:
        """The DP rank holding seq's blocks; None while it holds none (it may go to any rank then)."""
        return self._rank.get(seq.request_id)

    def _rank_for(self, seq: Sequence, num_blocks: int, excluded_ranks: Collection[int | None] = ()) -> int | None:
        """Where seq would get `num_blocks` more blocks: its own rank, or for a sequence holding none the rank with
        the fewest blocks in use that has them free (ties: lowest rank); None when there is no such rank."""
        if (rank := self.rank_of(seq)) is not None:
            fits = rank not in excluded_ranks and self._pools[rank].can_allocate(num_blocks)
            return rank if fits else None
        candidates = [r for r, pool in enumerate(self._pools)
                      if r not in excluded_ranks and pool.can_allocate(num_blocks)]
        return min(candidates, key=lambda r: (self._pools[r].num_used, r), default=None)

    # ---- the BlockManager interface the Scheduler uses, per sequence ---------------------------------------------
    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` lacks to cache its computed tokens plus `num_new_tokens` more (the same on every rank)."""
        return self._pools[0].num_blocks_needed(seq, num_new_tokens)

    def can_allocate(self, num_blocks: int, seq: Sequence, excluded_ranks: Collection[int | None] = ()) -> bool:
        """Whether some rank not in `excluded_ranks` would give seq `num_blocks` blocks (its own, if it has one)."""
        return self._rank_for(seq, num_blocks, excluded_ranks) is not None

    def allocate(self, seq: Sequence, num_new_tokens: int | None = None,
                 excluded_ranks: Collection[int | None] = ()) -> None:
        """Bind a sequence holding no blocks to a rank (as can_allocate chose it) and give it its next step's blocks."""
        if seq.block_ids:
            raise ValueError(f"{seq.request_id} already holds {len(seq.block_ids)} blocks")
        num_new_tokens = seq.num_uncomputed_tokens if num_new_tokens is None else num_new_tokens
        needed = self.num_blocks_needed(seq, num_new_tokens)
        rank = self._rank_for(seq, needed, excluded_ranks)
        if rank is None:
            raise RuntimeError(f"{seq.request_id} needs {needed} blocks, no rank has them free "
                               f"(free per rank: {[pool.num_free for pool in self._pools]})")
        self._pools[rank].allocate(seq, num_new_tokens)
        self._bind(seq, rank)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq.block_ids in its rank's pool (a sequence holding none is bound as allocate does); False (no
        change) if short."""
        rank = self._rank_for(seq, self.num_blocks_needed(seq, num_new_tokens))
        if rank is None:
            return False
        appended = self._pools[rank].append_slots(seq, num_new_tokens)
        self._bind(seq, rank)
        return appended

    def free(self, seq: Sequence) -> None:
        """Return all of seq's blocks to its rank's pool; it is bound to no rank afterwards."""
        self.truncate(seq, 0)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Return seq's blocks past those holding its first `num_tokens` tokens (unbound when none is left)."""
        rank = self.rank_of(seq)
        if rank is None:
            if seq.block_ids:
                raise RuntimeError(f"{seq.request_id} holds blocks {seq.block_ids} of no rank")
            return
        self._pools[rank].truncate(seq, num_tokens)
        self._bind(seq, rank)

    def release(self, request_id: str, block_ids: list[int]) -> None:
        """Return a request's blocks when only its id and ids are known (it ended while these pools were set
        aside by a switch that then rolled back)."""
        rank = self._rank.pop(request_id, None)
        if rank is None:
            return
        pool = self._pools[rank]
        for block_id in block_ids:
            if pool.owner(block_id) == request_id:
                pool.release(block_id)

    def _bind(self, seq: Sequence, rank: int) -> None:
        if seq.block_ids:
            self._rank[seq.request_id] = rank
        else:
            self._rank.pop(seq.request_id, None)

    # ---- Rebind and migration ----------------------------------------------------------------------------------
    def resize(self, num_blocks: int) -> set[str]:
        """Rebind every rank to `num_blocks` (the DP size stays), all or nothing.

        Returns the request_ids holding blocks >= num_blocks in some rank (nothing changed then): preempt one and
        call again. An empty set means every rank has the new size.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        blocking = {pool.owner(block_id) for pool in self._pools for block_id in pool.used_block_ids()
                    if block_id >= num_blocks}
        if blocking:
            return blocking
        for pool in self._pools:
            pool.resize(num_blocks)  # nothing past num_blocks is used: cannot be refused
        return set()

    def owner(self, block_id: int, dp_rank: int = 0) -> str | None:
        """The request_id holding `block_id` of rank `dp_rank`'s pool, None when it is free."""
        return self._pools[dp_rank].owner(block_id)

    def used_block_ids(self) -> list[int]:
        """Block ids in use, ascending (what a KV migration between layouts of one pool moves as they are).

        One rank only: with several, an id names a block of one rank's pool, and a switch renumbers them
        (`repartition`'s block maps); this raises then unless no block is in use (a recovery that dropped the KV).
        """
        if self.num_ranks == 1 or self.num_used == 0:
            return self._pools[0].used_block_ids()
        raise RuntimeError(f"{self.num_used} KV blocks are in use over {self.num_ranks} data-parallel ranks: "
                           "their ids are per rank (a switch moves them with block maps)")

    def used_block_ids_per_rank(self) -> tuple[list[int], ...]:
        """Block ids in use, ascending, of each rank's pool."""
        return tuple(pool.used_block_ids() for pool in self._pools)


@dataclass(frozen=True, slots=True)
class Repartition:
    """Pools of another data-parallel width, and where every request's blocks go (a TP <-> EP switch)."""

    blocks: DataParallelBlocks
    block_tables: dict[str, list[int]]  # request_id -> its new block ids (in its new pool), token order kept
    block_maps: BlockMaps               # what the workers copy, pool pair by pool pair
    unplaced: tuple[str, ...]           # requests no new pool could hold: the caller preempts them


def repartition(blocks: DataParallelBlocks, tables: Mapping[str, Sequence_[int]], num_ranks: int,
                num_blocks: int) -> Repartition:
    """New pools (num_ranks of num_blocks ids) for the requests holding blocks now (tables: request_id -> block
    ids, in token order; blocks gives each one's current pool). Requests are assigned longest first onto the least
    loaded rank (assign_requests: Moebius' TP -> EP rule; to one pool, everyone goes to it), and take the lowest
    free ids there; a request its rank cannot hold goes to the least used rank that can, else it is unplaced.
    Pure: `blocks` is not changed."""
    new = DataParallelBlocks(num_ranks, num_blocks, blocks.block_size)
    counts = {rid: len(ids) for rid, ids in tables.items() if ids}
    assignment = assign_requests(counts, num_ranks)
    block_tables: dict[str, list[int]] = {}
    maps: BlockMaps = {}
    unplaced = []
    for request_id in sorted(counts, key=lambda rid: (-counts[rid], rid)):
        ranks = [assignment[request_id]] + sorted((r for r in range(num_ranks) if r != assignment[request_id]),
                                                  key=lambda r: (new._pools[r].num_used, r))
        rank = next((r for r in ranks if new._pools[r].can_allocate(counts[request_id])), None)
        old_rank = blocks._rank.get(request_id)
        if rank is None or old_rank is None:
            unplaced.append(request_id)
            continue
        taken = new._pools[rank].take(request_id, counts[request_id])
        new._rank[request_id] = rank
        block_tables[request_id] = taken
        src, dst = maps.setdefault((old_rank, rank), ([], []))
        src.extend(tables[request_id])
        dst.extend(taken)
    return Repartition(new, block_tables, maps, tuple(unplaced))


def assign_requests(block_counts: Mapping[str, int], num_ranks: int) -> dict[str, int]:
    """request_id -> DP rank for rebalancing: longest first onto the least loaded rank (ties: lowest rank).

    Greedy LPT: the fullest rank ends within the largest request of the optimum (and within 4/3 of it), which is
    what matters when requests have to be re-prefilled or moved to even out the KV. Requests are taken by block
    count, then id, so the answer depends on the contents of `block_counts` only, not on its order.
    """
    if num_ranks < 1:
        raise ValueError(f"need num_ranks >= 1, got {num_ranks}")
    if negative := sorted(rid for rid, count in block_counts.items() if count < 0):
        raise ValueError(f"negative block counts for {negative}")
    loads = [(0, rank) for rank in range(num_ranks)]  # min-heap of (blocks assigned, rank)
    assignment: dict[str, int] = {}
    for request_id in sorted(block_counts, key=lambda rid: (-block_counts[rid], rid)):
        load, rank = heapq.heappop(loads)
        assignment[request_id] = rank
        heapq.heappush(loads, (load + block_counts[request_id], rank))
    return assignment
