"""Async scheduling: the scheduler layer that sends a decode's next step before the step sampling its input returns.

The engine builds an AsyncScheduler instead of a Scheduler when SchedulerConfig.async_scheduling is on, and asks it
for steps ahead (`schedule(ahead=True)`) in single-stage layouts, whose workers all sample and keep their tokens. A
decoding sequence whose one step in flight samples can then be scheduled again before that step returns, one
position further, its input token PENDING_TOKEN: the workers feed the token they sampled for the request in their
previous step. The router's work for the next step (scheduling, the wire, the clients' streams) then overlaps the
workers' compute of this one. Only where that token is all the step needs of the history (no penalties, logprobs or
min_tokens to count, max_tokens not reached by the step in flight), and, with several samplers (TP ranks), where
every one draws the same token (greedy or seeded); a step ahead of one that ends the request (a stop token) is
computed and discarded (the base's on_batch_done: its position is not the cache's).

The layer overrides the base's hooks: `_ahead_of` (which requests may go ahead in this schedule: those of the newest
step in flight, none after a failed step until nothing is in flight) and `_ahead_item` (the step ahead itself), and
on_batch_failed (a failure stops steps ahead). Everything else is the base's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from services.contracts.step import PENDING_TOKEN, SequenceStep
from services.router.batch import ScheduledBatch, ScheduledItem
from services.router.block_manager import BlockManager
from services.router.config import SchedulerConfig
from services.router.dp_blocks import DataParallelBlocks
from services.router.scheduler import Scheduler
from services.router.sequence import Sequence, SequenceStatus

_PENDING = (PENDING_TOKEN,)
_NO_REQUESTS: frozenset[str] = frozenset()


class AsyncScheduler(Scheduler):
    """A Scheduler whose decodes may go out a step ahead of the step sampling their input."""

    def __init__(self, config: SchedulerConfig, block_manager: DataParallelBlocks | BlockManager,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config, block_manager, clock)
        # After a failed step, none ahead until nothing is in flight: a step ahead of a failed (or refused) one is
        # refused in turn, and one ahead of that too, for as long as steps ahead keep going out.
        self._ahead_after_failure = False

    def _ahead_of(self, ahead: bool) -> Collection[str]:
        """Ahead of the newest step in flight only: the workers feed the tokens their previous step sampled."""
        if self._ahead_after_failure and not self._inflight:
            self._ahead_after_failure = False
        if not ahead or not self._inflight or self._ahead_after_failure:
            return _NO_REQUESTS
        return {item.seq.request_id for item in next(reversed(self._inflight.values())).items}

    def _ahead_item(self, seq: Sequence, random: bool) -> ScheduledItem | None:
        """The decode after `seq`'s one step in flight (the newest), its input PENDING_TOKEN, where that step
        samples and the token is all the next one needs; None otherwise, or when the blocks for it are not free (no
        preemption for a step ahead: the sequence waits for its step as without one). The scheduler's hottest path
        in a steady decode (one call per request per step): cheap tests first."""
        inflight = self._inflight_items.get(id(seq))
        if inflight is None or len(inflight) != 1:
            return None
        previous = inflight[0].step
        num_generated = len(seq.output_token_ids)
        if (not previous.sample or not seq.decodes_plainly or num_generated + 2 > seq.max_tokens
                or num_generated + 1 < seq.min_tokens or seq.status is not SequenceStatus.RUNNING
                or not (random or seq.sampling.draws_alike) or seq.request_id in self.moves.parking):
            return None
        start = previous.start_position + len(previous.token_ids)  # the position of the token it samples
        if not self.block_manager.append_slots(seq, start + 1 - seq.num_computed_tokens):
            return None
        self.num_ahead_items += 1
        return ScheduledItem(seq, SequenceStep(seq.request_id, _PENDING, start, seq.block_table(), seq.sampling,
                                               True, False, num_generated + 1, dp_rank=previous.dp_rank))

    def on_batch_failed(self, batch: ScheduledBatch) -> None:
        """As the base's; and no step goes ahead until nothing is in flight (the workers refuse those after it)."""
        super().on_batch_failed(batch)
        self._ahead_after_failure = True


def scheduler_for(config: SchedulerConfig, block_manager: DataParallelBlocks | BlockManager,
                  clock: Callable[[], float] = time.monotonic) -> Scheduler:
    """The scheduler `config` asks for, chosen once: this layer with async_scheduling on, else the base."""
    cls = AsyncScheduler if config.async_scheduling else Scheduler
    return cls(config, block_manager, clock)
