"""The scheduler's side of a layout switch: the running requests' KV in a new capacity per pool (rebind), in a new
number of pools (repartition, to or from an expert-parallel layout, undone by restore_partition until
commit_partition), or in none (preempt_all: the workers lost their KV). Each needs a frozen scheduler with nothing in
flight, and ends every instance move in progress. The Scheduler owns one (`scheduler.kv_layout`); the engine's side
of the switch (services.router.switch_ops) calls it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from services.router.dp_blocks import BlockMaps, DataParallelBlocks, Reserved, repartition
from services.router.sequence import Sequence

if TYPE_CHECKING:
    from services.router.moves import RequestMoves


class LayoutHost(Protocol):
    """What KVLayout reads and changes of the scheduler that owns it (services.router.scheduler.Scheduler)."""

    block_manager: DataParallelBlocks
    moves: RequestMoves
    running: list[Sequence]
    num_switch_preemptions: int

    @property
    def is_frozen(self) -> bool: ...
    @property
    def num_inflight_batches(self) -> int: ...
    def unfinished(self) -> Iterable[Sequence]: ...
    def max_blocks(self, seq: Sequence) -> int: ...
    def get(self, request_id: str) -> Sequence | None: ...
    def preempt(self, seq: Sequence) -> None: ...
    def newest_running(self, newer_than: Sequence | None = None, among: set[str] | None = None,
                       rank: int | None = None) -> Sequence | None: ...


class KVLayout:
    """Rebind, repartition (with its undo) and preempt_all over one scheduler's requests and pools."""

    def __init__(self, scheduler: LayoutHost) -> None:
        self.scheduler = scheduler
        # Set between repartition() and its commit or restore: the old pools and the moved requests' old ids.
        self._old_partition: tuple[DataParallelBlocks, dict[str, list[int]]] | None = None

    def rebind(self, num_blocks: int) -> list[Sequence]:
        """Take a new KV capacity per DP rank (REBINDING); preempts, newest first, the owners of ids past it in any
        rank. Returns them."""
        scheduler = self.scheduler
        if not scheduler.is_frozen or scheduler.num_inflight_batches:
            raise RuntimeError("rebind needs a frozen scheduler with nothing in flight")
        scheduler.moves.cancel_all()
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        too_large = [s.request_id for s in scheduler.unfinished() if scheduler.max_blocks(s) > num_blocks]
        if too_large:
            raise ValueError(f"{len(too_large)} requests (e.g. {too_large[0]!r}) need more than {num_blocks} blocks")
        preempted = []
        while owners := scheduler.block_manager.resize(num_blocks):  # every DP rank takes the new size
            victim = scheduler.newest_running(among=owners)
            scheduler.preempt(victim)
            scheduler.num_switch_preemptions += 1
            preempted.append(victim)
        return preempted

    def repartition(self, num_ranks: int, num_blocks: int,
                    reserved: Reserved | None = None) -> tuple[BlockMaps, list[Sequence]]:
        """Frozen only: move to `num_ranks` KV pools of `num_blocks` ids (a switch to or from an expert-parallel
        layout; dp.repartition says who goes where, keeping what a pre-copy `reserved`). Returns the block maps the
        workers' KV migration follows (identity per pool when the width stays and nothing was pre-copied; after a
        pre-copy only what it did not copy), and the requests preempted because no new pool could hold them.
        The old pools are kept until commit_partition() (the switch succeeded) or restore_partition() (it rolled
        back: every request gets its old pool and ids again)."""
        scheduler = self.scheduler
        if not scheduler.is_frozen or scheduler.num_inflight_batches:
            raise RuntimeError("repartition needs a frozen scheduler with nothing in flight")
        scheduler.moves.cancel_all()
        if num_blocks < 1 or num_ranks < 1:
            raise ValueError(f"need num_ranks >= 1 and num_blocks >= 1, got {num_ranks} and {num_blocks}")
        too_large = [s.request_id for s in scheduler.unfinished() if scheduler.max_blocks(s) > num_blocks]
        if too_large:
            raise ValueError(f"{len(too_large)} requests (e.g. {too_large[0]!r}) need more than {num_blocks} blocks")
        old = scheduler.block_manager
        if num_ranks == old.num_ranks and reserved is None:
            preempted = self.rebind(num_blocks)
            maps = {(rank, rank): (list(ids), list(ids))
                    for rank, ids in enumerate(scheduler.block_manager.used_block_ids_per_rank()) if ids}
            return maps, preempted
        tables = {s.request_id: list(s.block_ids) for s in scheduler.running if s.block_ids}
        plan = repartition(old, tables, num_ranks, num_blocks, reserved)
        preempted = []
        for request_id in plan.unplaced:  # free in the old pools, as a preemption does
            seq = scheduler.get(request_id)
            scheduler.preempt(seq)
            scheduler.num_switch_preemptions += 1
            preempted.append(seq)
        self._old_partition = (old, {rid: ids for rid, ids in tables.items() if rid in plan.block_tables})
        scheduler.block_manager = plan.blocks
        for request_id, ids in plan.block_tables.items():
            seq = scheduler.get(request_id)
            seq.block_ids[:] = ids
            seq.blocks_rewritten()
        return plan.block_maps, preempted

    def restore_partition(self) -> bool:
        """Undo repartition() (frozen, before any step): the old pools and every moved request's old block ids.
        False when there is nothing to undo."""
        scheduler = self.scheduler
        if self._old_partition is None:
            return False
        old, tables = self._old_partition
        self._old_partition = None
        scheduler.block_manager = old
        for request_id, ids in tables.items():
            seq = scheduler.get(request_id)
            if seq is not None and seq.block_ids:
                seq.block_ids[:] = ids
                seq.blocks_rewritten()
            else:  # it ended (aborted) while the switch ran: its old blocks go back to its old pool
                old.release(request_id, ids)
        return True

    def commit_partition(self) -> None:
        """The switch that repartitioned succeeded: forget the old pools."""
        self._old_partition = None

    def preempt_all(self) -> list[Sequence]:
        """Preempt every running sequence by recompute (the workers lost their KV); returns them, oldest first.

        They go to the front of the waiting queue in admission order, ahead of the requests never scheduled.
        """
        scheduler = self.scheduler
        if not scheduler.is_frozen or scheduler.num_inflight_batches:
            raise RuntimeError("preempt_all needs a frozen scheduler with nothing in flight")
        scheduler.moves.cancel_all()
        newest_first = scheduler.running[::-1]
        for seq in newest_first:  # each goes to the front: the oldest ends up first
            scheduler.preempt(seq)
        return newest_first[::-1]
