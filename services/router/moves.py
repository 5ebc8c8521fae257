"""The scheduler's side of live request moves between instances (MELL): sequences that hold KV blocks but are
not scheduled, moving out (parked: stopped, until the move commits or aborts) or in (blocks reserved, until adopt).
services.router.instance_moves.InstanceMoves drives these for the front router; the Scheduler owns one
(`scheduler.moves`) and skips what it parks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from services.router.batch import ScheduledBatch
from services.router.block_manager import num_blocks_for
from services.router.contracts import QueueFullError, RequestError
from services.router.dp_blocks import DataParallelBlocks
from services.router.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from collections import deque

    from services.router.config import SchedulerConfig


class MovesHost(Protocol):
    """What RequestMoves reads and changes of the scheduler that owns it (services.router.scheduler.Scheduler)."""

    config: SchedulerConfig
    block_manager: DataParallelBlocks
    waiting: deque[Sequence]
    running: list[Sequence]

    def get(self, request_id: str) -> Sequence | None: ...
    def in_flight(self, seq: Sequence) -> bool: ...
    def drop_kv(self, seq: Sequence) -> None: ...
    def insert_running(self, seq: Sequence) -> None: ...
    def check_fits(self, seq: Sequence) -> None: ...
    def register(self, seq: Sequence) -> None: ...
    def finish(self, request_id: str, status: SequenceStatus = SequenceStatus.FINISHED_STOPPED) -> bool: ...


class RequestMoves:
    """Parked and reserved sequences of one scheduler: park/unpark a request moving out, reserve/adopt one moving
    in, and cancel_all when a layout change ends every move."""

    def __init__(self, scheduler: MovesHost) -> None:
        self.scheduler = scheduler
        self.parked: dict[str, Sequence] = {}  # moving out (stopped) or in (reserved), by request_id
        self.moving_in: set[str] = set()
        self.parking: set[str] = set()  # to park when their step in flight returns (not scheduled meanwhile)

    # ---- moving out ------------------------------------------------------------------------------------------------
    def park(self, request_id: str) -> bool:
        """Stop scheduling a sequence that moves out: a decoding one keeps its KV blocks, now when it is between
        steps (True), else once its step in flight returns (False; it is not scheduled meanwhile, and a step that
        finishes it leaves it finished, not parked). One in the waiting queue (not started yet, or preempted back
        to it) has no KV and parks at once: it moves by re-prefill (or, never started, is simply placed there). One
        prefilling (its prompt, or its prompt and outputs again after a preemption) parks the same way, between its
        chunks or once its step in flight returns, without the part of its KV computed so far unless that step
        completed the prefill. KeyError: unknown; ValueError: parked already."""
        scheduler = self.scheduler
        seq = scheduler.get(request_id)
        if seq is None:
            raise KeyError(request_id)
        if request_id in self.parked or request_id in self.parking:
            raise ValueError(f"{request_id} is moving already")
        if seq.status is SequenceStatus.WAITING and not seq.num_computed_tokens:
            scheduler.waiting.remove(seq)
            self.parked[request_id] = seq
            return True
        if seq.status is not SequenceStatus.RUNNING:
            raise ValueError(f"{request_id} is {seq.status.value}")
        if scheduler.in_flight(seq):
            self.parking.add(request_id)
            return False
        self._park_running(seq)
        return True

    def _park_running(self, seq: Sequence) -> None:
        """Park a running sequence between its steps: decoding, with its KV; prefilling, without (as when it is
        preempted: it moves by re-prefill, or prefills here again once unparked)."""
        self.scheduler.running.remove(seq)
        if seq.is_prefill:
            self.scheduler.drop_kv(seq)
        self.parked[seq.request_id] = seq

    def unpark(self, request_id: str) -> Sequence:
        """A move out that did not happen: schedule the parked sequence again, in its place."""
        if request_id in self.moving_in or request_id not in self.parked:
            raise KeyError(request_id)
        seq = self.parked.pop(request_id)
        if seq.status is SequenceStatus.WAITING:  # preempted: back to the front of the queue, as it was
            self.scheduler.waiting.appendleft(seq)
        else:
            self.scheduler.insert_running(seq)
        return seq

    def cancel_park(self, request_id: str) -> None:
        """Forget a park() still waiting for its step (it is scheduled again)."""
        self.parking.discard(request_id)

    def park_requested(self, batch: ScheduledBatch) -> None:
        """A step returned: park its sequences that asked to be (unless the step finished them)."""
        for item in batch.items:
            seq = item.seq
            if seq.request_id in self.parking and not self.scheduler.in_flight(seq):
                self.parking.discard(seq.request_id)
                if not seq.is_finished:
                    self._park_running(seq)

    # ---- moving in -------------------------------------------------------------------------------------------------
    def is_moving_in(self, request_id: str) -> bool:
        """Whether blocks are reserved for this request moving in (not adopted yet)."""
        return request_id in self.moving_in

    def reserve(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Blocks for the KV of the first `num_tokens` tokens of a sequence moving in, parked until adopt(); a
        second call for the same id grows the reservation (the request decoded on meanwhile). Returns its block
        ids. RequestError if it can never run here; QueueFullError when the blocks are not free now."""
        scheduler = self.scheduler
        blocks = scheduler.block_manager
        if seq.request_id in self.moving_in:
            seq = self.parked[seq.request_id]
        elif scheduler.get(seq.request_id) is not None:
            raise RequestError(f"request id {seq.request_id!r} is already in use")
        if blocks.num_ranks > 1:
            raise RequestError("moving a request in needs one KV pool: this layout is expert parallel")
        scheduler.check_fits(seq)  # as add() would: an instance that could never run it says so, not "full"
        if not 0 < num_tokens < seq.num_prompt_tokens + seq.max_tokens:
            raise RequestError(f"{num_tokens} tokens cannot be the KV of a request of {seq.num_prompt_tokens} "
                               f"prompt tokens and max_tokens {seq.max_tokens}")
        seq.num_computed_tokens = max(seq.num_computed_tokens, num_tokens)
        if not blocks.append_slots(seq, 0):
            raise QueueFullError(f"{blocks.num_blocks_needed(seq, 0)} more KV blocks are needed, "
                                 f"{blocks.num_free} are free", retry_after_s=scheduler.config.retry_after_s)
        if seq.request_id not in self.moving_in:
            seq.status = SequenceStatus.RUNNING
            scheduler.register(seq)
            self.parked[seq.request_id] = seq
            self.moving_in.add(seq.request_id)
        return list(seq.block_ids)

    def adopt(self, request_id: str, output_token_ids: list[int], num_computed_tokens: int) -> Sequence:
        """A reserved sequence whose KV has arrived: it runs here from its next token on (no prefill).
        KeyError: nothing reserved under this id; RequestError: the state does not fit the reservation."""
        if request_id not in self.moving_in:
            raise KeyError(request_id)
        seq = self.parked[request_id]
        blocks = self.scheduler.block_manager
        num_tokens = seq.num_prompt_tokens + len(output_token_ids)
        if not (num_computed_tokens == num_tokens - 1 and 0 < len(output_token_ids) <= seq.max_tokens
                and num_blocks_for(num_computed_tokens, blocks.block_size) <= len(seq.block_ids)):
            raise RequestError(f"{request_id}: {num_computed_tokens} cached tokens and {len(output_token_ids)} "
                               f"generated do not fit its {seq.num_prompt_tokens} prompt tokens and "
                               f"{len(seq.block_ids)} reserved blocks")
        seq.output_token_ids = list(output_token_ids)
        seq.num_computed_tokens = num_computed_tokens
        blocks.truncate(seq, num_computed_tokens)  # a reservation larger than the KV that came
        seq.num_prefills = 1
        self.moving_in.discard(request_id)
        del self.parked[request_id]
        self.scheduler.insert_running(seq)
        return seq

    # ---- both ------------------------------------------------------------------------------------------------------
    def cancel_all(self) -> None:
        """A layout change (rebind, repartition, lost KV) ends every move in progress: sequences moving out run
        here again, reservations for ones moving in are given back (their migration fails and they stay put)."""
        self.parking.clear()
        for request_id in list(self.parked):
            if request_id in self.moving_in:
                self.scheduler.finish(request_id, SequenceStatus.FINISHED_ABORTED)
            else:
                self.unpark(request_id)

    def forget(self, request_id: str) -> bool:
        """The request finished: drop it if parked (True; it is in neither queue then)."""
        if self.parked.pop(request_id, None) is None:
            return False
        self.moving_in.discard(request_id)
        return True
