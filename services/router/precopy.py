"""KV pre-copy bookkeeping of one switch (Llumnix-style rounds): which KV blocks the workers have copied into
the target layout while serving, and which ones the freeze must still copy (the delta).

A block is *full* once every one of its slots holds KV a finished step wrote (num_computed_tokens counts only
finished steps). A full block never changes while its request holds it: decode appends to the last block, and a
failed or re-run step only rewrites positions past num_computed_tokens. It stops being valid when its request
ends or is preempted (the id may be handed to someone else, or to the same request's re-prefill): a record is
kept per request and per preemption count, and checked against the request's block table at the cutover.

Two kinds of switch: between layouts of one KV pool blocks keep their ids (KVPrecopy); to, from or between
expert-parallel layouts (a pool per DP rank) every request gets a pool of the target and ids there (PoolPrecopy
reserves them at the first round that sees the request, and the freeze's repartition keeps them).
Pure bookkeeping: no tensors, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from services.router.dp_blocks import BlockMaps, DataParallelBlocks, Reserved
from services.router.sequence import Sequence


class PrecopyRound(NamedTuple):
    """One round's answer: the full blocks to copy and the partly filled ones to warm (copied, never recorded),
    as block maps ((live pool, target pool) -> (live ids, target ids)), the blocks handed out in the operation so
    far and the blocks in use now."""

    block_maps: BlockMaps
    warm_block_maps: BlockMaps
    num_copied: int
    num_used: int


@dataclass(slots=True)
class KVPrecopy:
    """The blocks handed out for copying in one operation, per request (request_id -> (preemptions then, ids)):
    a switch between layouts of one KV pool, where blocks keep their ids."""

    operation_id: str
    num_kv_blocks: int  # the target's capacity: ids at or above it are never pre-copied
    copied: dict[str, tuple[int, set[int]]] = field(default_factory=dict)
    num_rounds: int = 0
    num_copied: int = 0  # blocks handed out in this operation, every round (a re-copied id counts again)

    def next_round(self, running: Iterable[Sequence], block_size: int) -> list[int]:
        """The full blocks of `running` not handed out yet (below the target capacity), ascending; recorded as
        copied (the operation aborts if the workers fail to copy them)."""
        self.num_rounds += 1
        new: list[int] = []
        for seq in running:
            preemptions, ids = self.copied.get(seq.request_id, (seq.num_preemptions, set()))
            if preemptions != seq.num_preemptions:  # re-prefilled since: what it had is gone
                ids = set()
            for block in full_blocks(seq, block_size):
                if block < self.num_kv_blocks and block not in ids:
                    ids.add(block)
                    new.append(block)
            if ids:
                self.copied[seq.request_id] = (seq.num_preemptions, ids)
        self.num_copied += len(new)
        return sorted(new)

    def warm(self, running: Iterable[Sequence], block_size: int) -> list[int]:
        """The partly filled blocks of `running` below the target capacity, ascending: a round copies them as they
        are, so that the freeze, which copies them again (they are never recorded), finds their pages mapped."""
        return sorted(b for seq in running for b in partial_blocks(seq, block_size) if b < self.num_kv_blocks)

    def delta(self, holders: Iterable[Sequence], used_block_ids: Iterable[int]) -> list[int]:
        """Of the used blocks, those the freeze must copy: every one not pre-copied for the request that holds it
        now (the same request, not preempted since), ascending."""
        valid: set[int] = set()
        for seq in holders:
            record = self.copied.get(seq.request_id)
            if record is not None and record[0] == seq.num_preemptions:
                valid.update(record[1] & set(seq.block_ids))
        return sorted(set(used_block_ids) - valid)


def full_blocks(seq: Sequence, block_size: int) -> list[int]:
    """The ids of seq's blocks whose every slot a finished step wrote."""
    return seq.block_ids[: seq.num_computed_tokens // block_size]


def partial_blocks(seq: Sequence, block_size: int) -> list[int]:
    """The ids of seq's other blocks: partly written, or reserved for a step in flight."""
    return seq.block_ids[seq.num_computed_tokens // block_size:]


@dataclass(slots=True)
class Reservation:
    """One request's blocks in the target's pools, as the rounds reserved them."""

    num_preemptions: int
    src_pool: int
    dst_pool: int
    dst_ids: list[int] = field(default_factory=list)  # target ids, by position in its block table
    copied: list[int] = field(default_factory=list)   # live ids of positions [0, len(copied)): copied when full

    def holds(self, seq: Sequence, src_pool: int | None) -> bool:
        """Whether what was copied for it is still its KV: the same life (no preemption since), in the same pool."""
        return (seq.num_preemptions == self.num_preemptions and src_pool == self.src_pool
                and seq.block_ids[: len(self.copied)] == self.copied)


class PoolPrecopy:
    """The pre-copy of a switch that changes KV pools (to, from or between expert-parallel layouts): a request
    seen by a round gets a pool of the target (longest first onto the pool with the fewest reserved blocks, as the
    freeze's repartition would place it; with as many pools on both sides, its own) and ids there for every block
    it holds, reserved until the freeze; each round copies its full blocks not copied yet to their reserved ids."""

    def __init__(self, operation_id: str, num_pools: int, num_kv_blocks: int, block_size: int,
                 same_pools: bool) -> None:
        self.operation_id = operation_id
        self.target = DataParallelBlocks(num_pools, num_kv_blocks, block_size)
        self.same_pools = same_pools  # as many pools on both sides: a request keeps its pool's number
        self.reserved: dict[str, Reservation] = {}
        self.num_rounds = 0
        self.num_copied = 0

    @property
    def num_kv_blocks(self) -> int:
        return self.target.num_blocks_per_rank

    def next_round(self, running: Iterable[Sequence], live: DataParallelBlocks) -> tuple[BlockMaps, BlockMaps]:
        """The full blocks of `running` not handed out yet, and their partly filled ones (to warm), as block maps
        to their reserved ids; reserves ids for blocks new since (as many as the target pool has free)."""
        self.num_rounds += 1
        holders = self._holders(running, live)
        block_size = self.target.block_size
        for seq in sorted(holders.values(), key=lambda s: (-len(s.block_ids), s.request_id)):
            held = self.reserved.get(seq.request_id)
            if held is None:
                src = live.rank_of(seq)
                dst = src if self.same_pools else self._emptiest(len(seq.block_ids))
                held = self.reserved[seq.request_id] = Reservation(seq.num_preemptions, src, dst)
            held.dst_ids += self.target.reserve(seq.request_id, held.dst_pool, len(seq.block_ids) - len(held.dst_ids))
        copy: BlockMaps = {}
        warm: BlockMaps = {}
        for request_id, seq in holders.items():
            held = self.reserved[request_id]
            num_full = seq.num_computed_tokens // block_size
            src, dst = copy.setdefault((held.src_pool, held.dst_pool), ([], []))
            for position in range(len(held.copied), min(num_full, len(held.dst_ids))):
                src.append(seq.block_ids[position])
                dst.append(held.dst_ids[position])
                held.copied.append(seq.block_ids[position])
                self.num_copied += 1
            src, dst = warm.setdefault((held.src_pool, held.dst_pool), ([], []))
            for position in range(num_full, min(len(seq.block_ids), len(held.dst_ids))):
                src.append(seq.block_ids[position])
                dst.append(held.dst_ids[position])
        return _nonempty(copy), _nonempty(warm)

    def reservations(self, running: Iterable[Sequence], live: DataParallelBlocks) -> Reserved:
        """Frozen: the target's pools with what the rounds reserved for the requests still holding it, for the
        freeze's repartition (which takes the pools over). Reservations no longer held are given back first."""
        holders = self._holders(running, live)
        requests = {rid: (held.dst_pool, list(held.dst_ids), len(held.copied)) for rid, held in self.reserved.items()
                    if rid in holders}
        return Reserved(self.target, requests)

    def _holders(self, running: Iterable[Sequence], live: DataParallelBlocks) -> dict[str, Sequence]:
        """The running requests holding blocks; the reservations of everyone else, and of a request whose copies
        are no longer its KV (preempted, moved to another pool), are given back."""
        holders = {seq.request_id: seq for seq in running if seq.block_ids}
        for request_id, held in list(self.reserved.items()):
            seq = holders.get(request_id)
            if seq is None or not held.holds(seq, live.rank_of(seq)):
                self.target.release(request_id, held.dst_ids)
                del self.reserved[request_id]
        return holders

    def _emptiest(self, num_blocks: int) -> int:
        """The target pool with the fewest reserved blocks that has `num_blocks` free (else the one with the most
        free; ties: the lowest)."""
        used = self.target.per_rank_used()
        fits = [rank for rank, n in enumerate(used) if self.num_kv_blocks - n >= num_blocks]
        return min(fits or range(len(used)), key=lambda rank: (used[rank], rank))


def _nonempty(maps: BlockMaps) -> BlockMaps:
    return {pair: ids for pair, ids in maps.items() if ids[0]}
