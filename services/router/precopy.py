"""KV pre-copy bookkeeping of one switch (Llumnix-style rounds): which KV blocks the workers have copied into
the target layout while serving, and which ones the freeze must still copy (the delta).

A block is *full* once every one of its slots holds KV a finished step wrote (num_computed_tokens counts only
finished steps). A full block never changes while its request holds it: decode appends to the last block, and a
failed or re-run step only rewrites positions past num_computed_tokens. It stops being valid when its request
ends or is preempted (the id may be handed to someone else, or to the same request's re-prefill): a record is
kept per request and per preemption count, and checked against the request's block table at the cutover.
Pure bookkeeping: no tensors, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from services.router.sequence import Sequence


class PrecopyUnsupported(RuntimeError):
    """This layout cannot pre-copy KV (several KV pools: the switch renumbers blocks)."""


class PrecopyRound(NamedTuple):
    """One round's answer: the full blocks to copy, the partly filled ones to warm (copied, never recorded), the
    blocks handed out in the operation so far and the blocks in use now."""

    block_ids: list[int]
    warm_block_ids: list[int]
    num_copied: int
    num_used: int


@dataclass(slots=True)
class KVPrecopy:
    """The blocks handed out for copying in one operation, per request (request_id -> (preemptions then, ids))."""

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
