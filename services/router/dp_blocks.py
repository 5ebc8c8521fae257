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
from collections.abc import Collection, Iterable, Mapping
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
    def holds(self, request_id: str) -> bool:
        """Whether a sequence of this id holds (or has reserved) blocks here: a finished one whose step is still in
        flight does until the step returns."""
        return request_id in self._rank

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
        if (seq.block_ids and seq.num_computed_tokens + num_new_tokens <= len(seq.block_ids) * self.block_size
                and seq.request_id in self._rank):
            return True  # bound, and its blocks cover the step already (most decode steps): nothing to take
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

    def reserve(self, request_id: str, rank: int, num_blocks: int) -> list[int]:
        """Up to `num_blocks` free ids of rank's pool (lowest first; fewer when fewer are free) for a request that
        holds blocks of no other rank here: a KV pre-copy reserving a request's blocks in the target's pools."""
        if self._rank.get(request_id, rank) != rank:
            raise ValueError(f"{request_id} holds blocks of rank {self._rank[request_id]}, not {rank}")
        pool = self._pools[rank]
        taken = pool.take(request_id, max(0, min(num_blocks, pool.num_free))) or []
        if taken:
            self._rank[request_id] = rank
        return taken

    def give_back(self, request_id: str, block_ids: Sequence_[int]) -> None:
        """Return some of a request's reserved ids; it stays bound to its rank (release() ends the reservation)."""
        rank = self._rank.get(request_id)
        if rank is None:
            return
        for block_id in block_ids:
            if self._pools[rank].owner(block_id) == request_id:
                self._pools[rank].release(block_id)

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


@dataclass(frozen=True, slots=True)
class Reserved:
    """What a KV pre-copy reserved in the target's pools while serving (PoolPrecopy.reserved): the pools, holding
    the requests' reserved ids, and per request its pool, its ids by position in its block table and how many
    leading positions hold KV copied already (the freeze copies only the others)."""

    blocks: DataParallelBlocks
    requests: Mapping[str, tuple[int, list[int], int]]  # request_id -> (rank, ids by position, positions copied)


def repartition(blocks: DataParallelBlocks, tables: Mapping[str, Sequence_[int]], num_ranks: int,
                num_blocks: int, reserved: Reserved | None = None) -> Repartition:
    """New pools (num_ranks of num_blocks ids) for the requests holding blocks now (tables: request_id -> block
    ids, in token order; blocks gives each one's current pool). Requests are assigned longest first onto the least
    loaded rank (assign_requests: Moebius' TP -> EP rule; to one pool, everyone goes to it), and take the lowest
    free ids there; a request its rank cannot hold goes to the least used rank that can, else it is unplaced.

    reserved: a pre-copy's reservations in the new pools. A request with one keeps its rank and reserved ids (it
    takes more there for the blocks it got since) and its copied positions are left out of the maps; one its rank
    cannot hold any more gives its reservation up and is placed as above, whole. Pure: `blocks` is not changed
    (`reserved.blocks` is taken over)."""
    if reserved is None:
        new, presets = DataParallelBlocks(num_ranks, num_blocks, blocks.block_size), {}
    else:
        new, presets = reserved.blocks, reserved.requests
        if (new.num_ranks, new.num_blocks_per_rank) != (num_ranks, num_blocks):
            raise ValueError(f"the pre-copy reserved {new.num_ranks} pools of {new.num_blocks_per_rank} blocks, the "
                             f"switch wants {num_ranks} of {num_blocks}")
    counts = {rid: len(ids) for rid, ids in tables.items() if ids}
    block_tables: dict[str, list[int]] = {}
    maps: BlockMaps = {}
    unplaced = []

    def place(request_id: str, rank: int, ids: list[int], num_copied: int) -> None:
        block_tables[request_id] = ids
        src, dst = maps.setdefault((blocks._rank[request_id], rank), ([], []))
        src.extend(tables[request_id][num_copied:])
        dst.extend(ids[num_copied:])

    for request_id in sorted(presets, key=lambda rid: (-len(presets[rid][1]), rid)):
        rank, ids, num_copied = presets[request_id]
        if request_id not in counts or request_id not in blocks._rank:
            new.release(request_id, ids)
            continue
        need = counts[request_id]
        new.give_back(request_id, ids[need:])  # positions its table no longer reaches (a failed step's slots)
        ids = ids[:need] + new.reserve(request_id, rank, need - len(ids[:need]))
        if len(ids) < need:  # its rank is full: it goes wherever it fits, moved whole
            new.release(request_id, ids)
            continue
        place(request_id, rank, ids, min(num_copied, need))
    rest = {rid: count for rid, count in counts.items() if rid not in block_tables and count <= num_blocks}
    unplaced += sorted((rid for rid in counts if rid not in block_tables and rid not in rest),
                       key=lambda rid: (-counts[rid], rid))  # larger than any pool: no load to balance
    assignment = assign_requests(rest, num_ranks, loads=new.per_rank_used())
    for request_id in sorted(rest, key=lambda rid: (-counts[rid], rid)):
        ranks = [assignment[request_id]] + sorted((r for r in range(num_ranks) if r != assignment[request_id]),
                                                  key=lambda r: (new._pools[r].num_used, r))
        rank = next((r for r in ranks if new._pools[r].can_allocate(counts[request_id])), None)
        if rank is None or request_id not in blocks._rank:
            unplaced.append(request_id)
            continue
        place(request_id, rank, new.reserve(request_id, rank, counts[request_id]), 0)
    maps = {pair: ids for pair, ids in maps.items() if ids[0]}
    return Repartition(new, block_tables, maps, tuple(unplaced))


def plan_placements(blocks: DataParallelBlocks, running: Iterable[Sequence], num_blocks: int,
                    num_ranks: int) -> list[tuple[str, int, int, int]]:
    """Where a rebind to `num_ranks` pools of `num_blocks` ids would put the requests of `running` holding blocks:
    (request_id, rank now, rank after or -1 when it would be preempted, blocks), longest first. To or from several
    pools as repartition places them; one pool on both sides keeps ids, and the holders of ids past the capacity
    are preempted. Pure."""
    if num_blocks < 1 or num_ranks < 1:
        raise ValueError(f"need num_kv_blocks >= 1 and dp_size >= 1, got {num_blocks}, {num_ranks}")
    holders = sorted((s for s in running if s.block_ids), key=lambda s: (-len(s.block_ids), s.request_id))
    if num_ranks != blocks.num_ranks or num_ranks > 1:
        plan = repartition(blocks, {s.request_id: s.block_ids for s in holders}, num_ranks, num_blocks)
        after = {rid: plan.blocks._rank[rid] for rid in plan.block_tables}
    else:
        after = {s.request_id: 0 for s in holders if max(s.block_ids) < num_blocks}
    return [(s.request_id, blocks.rank_of(s), after.get(s.request_id, -1), len(s.block_ids)) for s in holders]


def assign_requests(block_counts: Mapping[str, int], num_ranks: int,
                    loads: Sequence_[int] = ()) -> dict[str, int]:
    """request_id -> DP rank for rebalancing: longest first onto the least loaded rank (ties: lowest rank); `loads`:
    blocks each rank holds already (none by default).

    Greedy LPT: the fullest rank ends within the largest request of the optimum (and within 4/3 of it), which is
    what matters when requests have to be re-prefilled or moved to even out the KV. Requests are taken by block
    count, then id, so the answer depends on the contents of `block_counts` only, not on its order.
    """
    if num_ranks < 1:
        raise ValueError(f"need num_ranks >= 1, got {num_ranks}")
    if negative := sorted(rid for rid, count in block_counts.items() if count < 0):
        raise ValueError(f"negative block counts for {negative}")
    heap = [(loads[rank] if loads else 0, rank) for rank in range(num_ranks)]  # min-heap of (blocks, rank)
    heapq.heapify(heap)
    assignment: dict[str, int] = {}
    for request_id in sorted(block_counts, key=lambda rid: (-block_counts[rid], rid)):
        load, rank = heapq.heappop(heap)
        assignment[request_id] = rank
        heapq.heappush(heap, (load + block_counts[request_id], rank))
    return assignment
