"""Continuous batching: which sequences feed which tokens in the next step, and what a finished step changed.

Each schedule() builds one micro-batch from the sequences not in flight: decodes of running sequences first,
then the rest of running chunked prefills (each pass oldest first), then new prefills from the waiting queue
(FCFS), within the token budget, max_num_seqs and the free KV blocks. With pipeline parallelism up to
num_inflight_batches (= pp) disjoint micro-batches are in flight; with `spread_decodes` the running decodes are
spread over them (at most ceil(running / pp) in each), so that every stage works on its share while the others work
on theirs, instead of one micro-batch of every decode passing the stages one at a time while they idle. With
data-parallel attention (EP layouts) each DP rank has its own KV pool (services.router.dp_blocks): a request is bound to
one while it holds blocks, and everything below about blocks holds per rank (a victim frees blocks only for
sequences of its own rank).

When a running sequence cannot get a block, it preempts by recompute the newest running sequence that is
newer than itself and not in flight, taking it out of this micro-batch if it was put there: the victim's
blocks are freed and it re-prefills its whole prefix later, ahead of every other waiting request. A sequence
never preempts an older one, nor itself: with no such victim left it waits for a later step (older sequences,
or newer ones in flight, hold the blocks it lacks; it can preempt the latter once their step has returned),
and no new prefill is admitted in a step where a running sequence lacked blocks. So the oldest running
sequence is never preempted, and newer sequences keep blocks from it only while they are in flight: it always
progresses, and so, one after the other, does every request. (A sequence that preempted itself while the others
were in flight let two sequences that cannot share the cache preempt each other forever.)

Steps ahead (async scheduling) are a layer over this one: services.router.async_scheduler.AsyncScheduler overrides
the hooks `_ahead_of` and `_ahead_item` (which decodes go out before their step in flight returns) and
on_batch_failed; this scheduler waits for every step. Its bookkeeping still holds several items in flight per
sequence, oldest first, for the layer's sake.

A step the workers failed is taken back unadvanced (on_batch_failed). A layout switch's changes to the KV
(rebind, repartition, preempt_all) are `kv_layout` (services.router.kv_layout), instance moves' parking and
reservations `moves` (services.router.moves): collaborators over these queues. The scheduler never touches tensors.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping

from services.contracts.step import SequenceOutput
from services.router.batch import ScheduledBatch, ScheduledItem, SequenceUpdate, step_for
from services.router.block_manager import BlockManager, num_blocks_for
from services.router.config import SchedulerConfig
from services.router.contracts import QueueFullError, RequestError
from services.router.dp_blocks import DataParallelBlocks
from services.router.kv_layout import KVLayout
from services.router.moves import RequestMoves
from services.router.sequence import Sequence, SequenceStatus

__all__ = ["ScheduledBatch", "ScheduledItem", "Scheduler", "SequenceUpdate"]

_NO_REQUESTS: frozenset[str] = frozenset()


class Scheduler:
    """Owns the waiting and running queues; builds micro-batches and applies their results."""

    def __init__(self, config: SchedulerConfig, block_manager: DataParallelBlocks | BlockManager,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        if isinstance(block_manager, BlockManager):  # one pool: the layouts without data-parallel attention
            block_manager = DataParallelBlocks.of(block_manager)
        self.block_manager = block_manager
        self.clock = clock
        self.waiting: deque[Sequence] = deque()   # FCFS; preempted sequences go to the front
        self.running: list[Sequence] = []         # hold KV blocks, oldest (by add()) first
        self.num_preemptions = 0                  # all preemptions by recompute
        self.num_switch_preemptions = 0           # those forced by a Rebind to fewer blocks
        self.num_ahead_items = 0  # sequence steps scheduled ahead (AsyncScheduler), over the scheduler's life
        self._sequences: dict[str, Sequence] = {}  # unfinished sequences by request_id
        self._admission_index: dict[str, int] = {}  # add() order: larger = newer, preempted first
        self._admission_counter = itertools.count()
        self._batch_counter = itertools.count()
        self._inflight: dict[int, ScheduledBatch] = {}
        # Sequences in flight, by id(seq) (not request_id: a new request may reuse the id of one that ended with a
        # step still in flight): their items in flight, oldest first (two: a step ahead follows one).
        self._inflight_items: dict[int, list[ScheduledItem]] = {}
        self._is_frozen = False
        self.kv_layout = KVLayout(self)  # a layout switch's rebind / repartition / preempt_all
        self.moves = RequestMoves(self)  # live migration between instances: parked and reserved sequences

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; RequestError if it can never run, QueueFullError past max_waiting."""
        self.check_fits(seq)
        if seq.request_id in self._sequences:
            raise RequestError(f"request id {seq.request_id!r} is already in use")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_ids:
            raise ValueError(f"{seq.request_id} is not a fresh sequence")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"{len(self.waiting)} requests are waiting (max_waiting)",
                                 retry_after_s=self.config.retry_after_s)
        self.register(seq)
        self.waiting.append(seq)

    def register(self, seq: Sequence) -> None:
        """Make `seq` one of the unfinished sequences, the newest (add(), or a reservation moving in)."""
        self._sequences[seq.request_id] = seq
        self._admission_index[seq.request_id] = next(self._admission_counter)

    def check_fits(self, seq: Sequence) -> None:
        """RequestError unless the sequence can ever run here: a prompt, max_tokens >= 0, its whole context within
        max_model_len, and its most KV within one pool."""
        num_prompt, max_model_len = seq.num_prompt_tokens, self.config.max_model_len
        if num_prompt == 0:
            raise RequestError("the prompt is empty")
        if seq.max_tokens < 0:
            raise RequestError(f"max_tokens must be >= 0, got {seq.max_tokens}")
        if num_prompt + seq.max_tokens > max_model_len:
            raise RequestError(
                f"the prompt ({num_prompt} tokens) plus max_tokens ({seq.max_tokens}) is "
                f"{num_prompt + seq.max_tokens} tokens, more than the context of {max_model_len} tokens"
            )
        if (needed := self.max_blocks(seq)) > (capacity := self.block_manager.num_blocks_per_rank):
            cache = "the cache has" if self.block_manager.num_ranks == 1 else "each data-parallel rank's cache has"
            raise RequestError(f"the request needs {needed} KV blocks, {cache} {capacity}")

    def schedule(self, num_micro_batches: int = 1, ahead: bool = False,
                 ahead_random: bool = True) -> ScheduledBatch | None:
        """The next micro-batch from the sequences not in flight; None when frozen or nothing can run.

        The caller keeps up to `num_micro_batches` (the live pp, which a reconfiguration changes) in flight; with
        config.spread_decodes each takes at most ceil(running / num_micro_batches) decodes. ahead: the layout lets
        decodes go out before the step sampling their input returns (workers that run the steps in order and keep
        what they sampled: a single-stage layout); ahead_random: also requests sampled without a seed (one worker
        samples). Only the async layer (AsyncScheduler) acts on them: this scheduler waits for every step.
        """
        if self._is_frozen:
            return None
        items: dict[str, ScheduledItem] = {}  # by request_id, in the order scheduled
        budget, short_ranks = self._schedule_running(items, num_micro_batches, self._ahead_of(ahead), ahead_random)
        # New prefills, FCFS, only into ranks where every running sequence got its blocks (they are short otherwise).
        if None not in short_ranks and budget > 0:
            self._schedule_waiting(items, budget, short_ranks)
        if not items:
            return None
        num_full_prefills = 0
        for item in items.values():
            self._inflight_items.setdefault(id(item.seq), []).append(item)
            if item.step.start_position == 0:
                num_full_prefills += 1
        batch = ScheduledBatch(next(self._batch_counter), tuple(items.values()), num_full_prefills)
        self._inflight[batch.batch_id] = batch
        return batch

    def _schedule_running(self, items: dict[str, ScheduledItem], num_micro_batches: int, ahead_of: Collection[str],
                          ahead_random: bool) -> tuple[int, set[int | None]]:
        """Decodes first (one token each), then the next chunks of running prefills; each pass oldest first.
        Returns the token budget left and the DP ranks where a running sequence lacked blocks (None: it had none)."""
        budget = self.config.max_num_batched_tokens
        shares = num_micro_batches if self.config.spread_decodes else 1
        decodes_left = -(-len(self.running) // max(1, shares))
        decoded: set[str] = set()
        short_ranks: set[int | None] = set()
        parking = self.moves.parking
        for decodes in (True, False):
            if not decodes and len(decoded) == len(self.running):
                break  # every running sequence went as a decode (a steady decode): no prefill chunk is left
            for seq in list(self.running):
                if budget == 0:
                    break
                if (decodes and seq.request_id in ahead_of and decodes_left > 0
                        and (item := self._ahead_item(seq, ahead_random)) is not None):
                    items[seq.request_id] = item
                    budget -= 1
                    decodes_left -= 1
                    decoded.add(seq.request_id)
                    continue
                # A sequence scheduled as a decode still is one in the second pass: it is never fed twice.
                if (seq.status is not SequenceStatus.RUNNING or self.in_flight(seq)
                        or seq.is_prefill == decodes or seq.request_id in parking):
                    continue
                if decodes and decodes_left == 0:
                    break  # the rest go in the next micro-batch
                num_new_tokens = min(seq.num_uncomputed_tokens, budget)
                if not self.config.enable_chunked_prefill and num_new_tokens < seq.num_uncomputed_tokens:
                    continue
                while not self.block_manager.append_slots(seq, num_new_tokens):
                    short_ranks.add(rank := self.block_manager.rank_of(seq))
                    victim = self.newest_running(newer_than=seq, rank=rank)
                    if victim is None:
                        break  # seq waits: older sequences, or newer ones in flight, hold the blocks it lacks
                    self.preempt(victim)
                    if (dropped := items.pop(victim.request_id, None)) is not None:
                        budget += len(dropped.step.token_ids)
                        decodes_left += victim.request_id in decoded
                else:
                    items[seq.request_id] = self._item(seq, num_new_tokens)
                    budget -= num_new_tokens
                    if decodes:
                        decodes_left -= 1
                        decoded.add(seq.request_id)
        return budget, short_ranks

    def _schedule_waiting(self, items: dict[str, ScheduledItem], budget: int, short_ranks: set[int | None]) -> None:
        """Start waiting sequences, FCFS, within `budget` tokens, max_num_seqs and the blocks of ranks not short."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self.block_manager.holds(seq.request_id):
                break  # an ended request of the same id holds blocks until its step returns (bound by id: one at a time)
            num_new_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self.config.enable_chunked_prefill and num_new_tokens < seq.num_uncomputed_tokens:
                break
            needed = self.block_manager.num_blocks_needed(seq, num_new_tokens)
            if not self.block_manager.can_allocate(needed, seq, excluded_ranks=short_ranks):
                break
            self.block_manager.allocate(seq, num_new_tokens, excluded_ranks=short_ranks)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_prefills += 1
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = self.clock()
            self.insert_running(seq)  # a preempted sequence goes back to its place
            items[seq.request_id] = self._item(seq, num_new_tokens)
            budget -= num_new_tokens

    # ---- the async layer's hooks (AsyncScheduler): the base never schedules a step ahead ---------------------------
    def _ahead_of(self, ahead: bool) -> Collection[str]:
        """The requests whose next decode may go out ahead of their step in flight in this schedule(): none."""
        return _NO_REQUESTS

    def _ahead_item(self, seq: Sequence, random: bool) -> ScheduledItem | None:
        """The decode of `seq` after its step in flight, fed the token that step samples: none here."""
        return None

    def in_flight(self, seq: Sequence) -> bool:
        """Whether a step in flight feeds `seq`."""
        return id(seq) in self._inflight_items

    def _returned(self, item: ScheduledItem) -> list[ScheduledItem]:
        """`item`'s step returned (or failed); the request's items still in flight, oldest first."""
        key = id(item.seq)
        items = self._inflight_items[key]
        if items[0] is item:  # steps return in order: the oldest (with steps ahead, one follows it)
            if len(items) == 1:
                del self._inflight_items[key]
                return []
            del items[0]
            return items
        left = self._inflight_items[key] = [other for other in items if other is not item]
        return left

    def on_batch_done(self, batch: ScheduledBatch, sampled: Mapping[str, int],
                      outputs: Mapping[str, SequenceOutput] | None = None) -> list[SequenceUpdate]:
        """Apply a finished step: advance the caches, append sampled tokens, finish and free what is done.

        `sampled` maps request_id -> token for the items whose step sampled; `outputs` request_id -> the workers'
        output where it carries logprobs. Sequences aborted or finished while in flight are freed here and get no
        update. A prompt-only request (max_tokens 0) finishes with its prefill.
        """
        outputs = outputs or {}
        if self._inflight.pop(batch.batch_id, None) is None:
            raise ValueError(f"batch {batch.batch_id} is not in flight")
        now, updates = self.clock(), []
        inflight_items, running = self._inflight_items, SequenceStatus.RUNNING
        for item in batch.items:
            seq, step = item.seq, item.step
            key = id(seq)
            items = inflight_items[key]
            if items[0] is not item:  # an older step of it still in flight (a failed step taken back): rare
                still_inflight = bool(self._returned(item))
            elif len(items) == 1:  # its only step in flight (waiting for each step): inline
                del inflight_items[key]
                still_inflight = False
            else:  # a step ahead follows it (async scheduling's steady decode): inline
                del items[0]
                still_inflight = True
            if seq.status is not running and seq.status.is_finished:
                if not still_inflight:
                    self.block_manager.free(seq)
                continue
            if step.start_position != seq.num_computed_tokens:
                # A step ahead of one that failed: it fed a position the cache does not hold. Taken back as
                # failed (the worker refuses a pending token it did not sample, so this is defensive).
                if not still_inflight:
                    self.block_manager.truncate(seq, seq.num_computed_tokens)
                continue
            seq.num_computed_tokens += len(step.token_ids)
            output = outputs.get(seq.request_id) if outputs else None
            if step.prompt_logprob_token_ids and output is not None:
                # Slice assignment: a chunk re-run after a preemption or a failed step rewrites its own positions.
                end = step.start_position + len(output.prompt_logprobs)
                seq.prompt_logprobs[step.start_position:end] = output.prompt_logprobs
            if not step.sample:
                is_done = seq.max_tokens == 0 and seq.num_computed_tokens >= seq.num_prompt_tokens
                if is_done:
                    self._finish(seq, SequenceStatus.FINISHED_LENGTH)
                updates.append(SequenceUpdate(seq, (), is_done))
                continue
            token_id = sampled.get(seq.request_id)
            if token_id is None:
                raise ValueError(f"no sampled token for {seq.request_id} in batch {batch.batch_id}")
            generated = seq.output_token_ids
            generated.append(token_id)
            if seq.first_token_time is None:
                seq.first_token_time = now
            finished = True
            if token_id in seq.stop_token_ids:
                self._finish(seq, SequenceStatus.FINISHED_STOPPED)
            elif len(generated) >= seq.max_tokens:
                self._finish(seq, SequenceStatus.FINISHED_LENGTH)
            else:
                finished = False
            logprobs = (output.logprob,) if output is not None and output.logprob is not None else ()
            updates.append(SequenceUpdate(seq, (token_id,), finished, logprobs))
        if self.moves.parking:
            self.moves.park_requested(batch)
        return updates

    def on_batch_failed(self, batch: ScheduledBatch) -> None:
        """Take back a step the workers did not finish: its sequences advance nothing and can be scheduled again.

        Re-running the same positions is safe: workers overwrite the KV slots a step rewrites. The blocks the
        step added are returned (a sequence holds blocks for its cached tokens only); sequences aborted or
        finished while in flight are freed, as in on_batch_done.
        """
        if self._inflight.pop(batch.batch_id, None) is None:
            raise ValueError(f"batch {batch.batch_id} is not in flight")
        for item in batch.items:
            seq = item.seq
            still_inflight = self._returned(item)
            if not seq.is_finished:
                # A step ahead failed while the one before it is still in flight: that one keeps the KV it writes
                # (it ends where this one starts). Any other step gives back all but the cached tokens; one ahead
                # of it that is still in flight comes back stale (on_batch_done).
                before = any(other.step.start_position < item.step.start_position for other in still_inflight)
                self.block_manager.truncate(seq, item.step.start_position if before else seq.num_computed_tokens)
            elif not still_inflight:
                self.block_manager.truncate(seq, 0)
        self.moves.park_requested(batch)

    def abort(self, request_id: str) -> bool:
        """Abort a request in any state (its blocks are freed now, or when its in-flight step returns)."""
        return self.finish(request_id, SequenceStatus.FINISHED_ABORTED)

    def finish(self, request_id: str, status: SequenceStatus = SequenceStatus.FINISHED_STOPPED) -> bool:
        """End a request the engine decided is done (a stop string); False when the id is unknown or finished."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        seq = self._sequences.get(request_id)
        if seq is None:
            return False
        self._finish(seq, status)
        return True

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        if not self.moves.forget(seq.request_id):
            if seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq)
            else:
                self.running.remove(seq)
        seq.status = status
        seq.finished_time = self.clock()
        del self._sequences[seq.request_id]
        del self._admission_index[seq.request_id]
        if not self.in_flight(seq):
            self.block_manager.free(seq)

    def _age(self, seq: Sequence) -> int:
        return self._admission_index[seq.request_id]  # add() order: larger = newer

    def insert_running(self, seq: Sequence) -> None:
        """Put `seq` back among the running sequences, in its place by age."""
        bisect.insort(self.running, seq, key=self._age)

    def newest_running(self, newer_than: Sequence | None = None, among: set[str] | None = None,
                       rank: int | None = None) -> Sequence | None:
        """The newest running sequence not in flight (newer than `newer_than`, owning one of `among`, not bound to a
        DP rank other than `rank`: its blocks would be of no use there); None if none."""
        oldest = -1 if newer_than is None else self._age(newer_than)
        for seq in reversed(self.running):  # newest first
            if self._age(seq) <= oldest:
                return None
            if (not self.in_flight(seq) and (among is None or seq.request_id in among)
                    and (rank is None or self.block_manager.rank_of(seq) in (None, rank))):
                return seq
        return None

    def preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: drop seq's KV and queue it first; it later re-prefills prompt + outputs."""
        self.running.remove(seq)
        self.drop_kv(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def drop_kv(self, seq: Sequence) -> None:
        """Free a sequence's KV blocks: it waits again, to prefill its prompt and outputs (here or elsewhere)."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING

    def freeze(self) -> None:
        """Stop building steps (QUIESCING); admission stays open and in-flight steps still complete."""
        self._is_frozen = True

    def unfreeze(self) -> None:
        self._is_frozen = False

    @property
    def is_frozen(self) -> bool:
        return self._is_frozen

    def has_unscheduled(self) -> bool:
        """Whether a request waits outside every step in flight (a running one between steps, or a waiting one)."""
        return bool(self.waiting) or any(not self.in_flight(seq) for seq in self.running)

    def unfinished(self) -> Iterable[Sequence]:
        """Every unfinished sequence (waiting, running, parked or reserved)."""
        return self._sequences.values()

    def max_blocks(self, seq: Sequence) -> int:
        # The KV a sequence ever holds: every token but the last one sampled (the whole prompt when none is).
        num_tokens = max(seq.num_prompt_tokens, seq.num_prompt_tokens + seq.max_tokens - 1)
        return num_blocks_for(num_tokens, self.block_manager.block_size)

    def _item(self, seq: Sequence, num_new_tokens: int) -> ScheduledItem:
        if (dp_rank := self.block_manager.rank_of(seq)) is None:
            raise RuntimeError(f"{seq.request_id} is scheduled without KV blocks")
        return ScheduledItem(seq, step_for(seq, num_new_tokens, dp_rank))

    def get(self, request_id: str) -> Sequence | None:
        """The unfinished sequence with this id, or None."""
        return self._sequences.get(request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def mean_context_tokens(self) -> float:
        """Mean tokens a running request attends over now (prompt and output so far); 0 with none running."""
        return sum(seq.num_tokens for seq in self.running) / len(self.running) if self.running else 0.0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_inflight_batches(self) -> int:
        return len(self._inflight)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._sequences) or bool(self._inflight)
