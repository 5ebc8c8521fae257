"""Continuous batching: which sequences feed which tokens in the next step, and what a finished step changed.

Each schedule() builds one micro-batch from the sequences not in flight: decodes of running sequences first,
then the rest of running chunked prefills (each pass oldest first), then new prefills from the waiting queue
(FCFS), within the token budget, max_num_seqs and the free KV blocks. With pipeline parallelism up to
num_inflight_batches (= pp) disjoint micro-batches are in flight; with `spread_decodes` the running decodes are
spread over them (at most ceil(running / pp) in each), so that every stage works on its share while the others work
on theirs, instead of one micro-batch of every decode passing the stages one at a time while they idle. With
data-parallel attention (EP layouts) each DP rank has its own KV pool (services.router.dp): a request is bound to
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

Ahead steps (async scheduling, `schedule(ahead=True)`: the engine asks for them in single-stage layouts, whose
workers all sample and keep their tokens): a decoding sequence whose one step in flight samples can be scheduled
again before that step returns, one position further, its input token PENDING_TOKEN: the workers feed the token
they sampled for the request in their previous step. The router's work for the next step (scheduling, the wire,
the clients' streams) then overlaps the workers' compute of this one. Only where that token is all the step needs
of the history (no penalties, logprobs or min_tokens to count, max_tokens not reached by the step in flight), and,
with several samplers (TP ranks), where every one draws the same token (greedy or seeded); a step ahead of one that
ends the request (a stop token) is computed and discarded.

A step the workers failed is taken back unadvanced (on_batch_failed); when the workers lost their KV,
preempt_all sends every running sequence back to re-prefill. The scheduler never touches tensors.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from services.router.block_manager import BlockManager, num_blocks_for
from services.router.config import SchedulerConfig
from services.router.contracts import QueueFullError, RequestError
from services.router.dp import BlockMaps, DataParallelBlocks, Reserved, repartition
from services.router.sequence import Sequence, SequenceStatus
from services.worker.step import PENDING_TOKEN, SequenceOutput, SequenceStep, TokenLogprob

_PENDING = (PENDING_TOKEN,)


@dataclass(slots=True)  # not frozen, as the step path's records (services.worker.step)
class ScheduledItem:
    """One sequence's share of a micro-batch: the sequence and the step sent to the workers for it."""

    seq: Sequence
    step: SequenceStep


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """A micro-batch: what one step feeds; batch_id doubles as the workers' step_id."""

    batch_id: int
    items: tuple[ScheduledItem, ...]
    num_full_prefills: int = 0  # items feeding a request from position 0 (counted as it is built, not per step)

    @property
    def steps(self) -> tuple[SequenceStep, ...]:
        return tuple(item.step for item in self.items)

    @property
    def num_tokens(self) -> int:
        return sum(len(item.step.token_ids) for item in self.items)


@dataclass(slots=True)  # not frozen, as the step path's records (services.worker.step)
class SequenceUpdate:
    """What a finished step did to one sequence: its new tokens, and whether it is done (seq.status says why)."""

    seq: Sequence
    new_token_ids: tuple[int, ...]
    finished: bool
    logprobs: tuple[TokenLogprob, ...] = ()  # of new_token_ids, when the request asked for them


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
        self._sequences: dict[str, Sequence] = {}  # unfinished sequences by request_id
        self._admission_index: dict[str, int] = {}  # add() order: larger = newer, preempted first
        self._admission_counter = itertools.count()
        self._batch_counter = itertools.count()
        self._inflight: dict[int, ScheduledBatch] = {}
        # Sequences in flight, by id(seq) (not request_id: a new request may reuse the id of one that ended with a
        # step still in flight): their items in flight, oldest first (two: a step ahead follows one).
        self._inflight_items: dict[int, list[ScheduledItem]] = {}
        self.num_ahead_items = 0  # sequence steps scheduled ahead (PENDING_TOKEN inputs), over the scheduler's life
        # After a failed step, none ahead until nothing is in flight: a step ahead of a failed (or refused) one is
        # refused in turn, and one ahead of that too, for as long as steps ahead keep going out.
        self._ahead_after_failure = False
        self._is_frozen = False
        # Set between repartition() and its commit or restore: the old pools and the moved requests' old ids.
        self._old_partition: tuple[DataParallelBlocks, dict[str, list[int]]] | None = None
        # Live migration between instances: sequences that hold KV blocks but are not scheduled, moving out
        # (stopped, until the move commits or aborts) or in (blocks reserved, until adopt).
        self.parked: dict[str, Sequence] = {}
        self._moving_in: set[str] = set()
        self._parking: set[str] = set()  # to park when their step in flight returns (not scheduled meanwhile)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; RequestError if it can never run, QueueFullError past max_waiting."""
        self._check_fits(seq)
        if seq.request_id in self._sequences:
            raise RequestError(f"request id {seq.request_id!r} is already in use")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_ids:
            raise ValueError(f"{seq.request_id} is not a fresh sequence")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"{len(self.waiting)} requests are waiting (max_waiting)",
                                 retry_after_s=self.config.retry_after_s)
        self._sequences[seq.request_id] = seq
        self._admission_index[seq.request_id] = next(self._admission_counter)
        self.waiting.append(seq)

    def _check_fits(self, seq: Sequence) -> None:
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
        if (needed := self._max_blocks(seq)) > (capacity := self.block_manager.num_blocks_per_rank):
            cache = "the cache has" if self.block_manager.num_ranks == 1 else "each data-parallel rank's cache has"
            raise RequestError(f"the request needs {needed} KV blocks, {cache} {capacity}")

    def schedule(self, num_micro_batches: int = 1, ahead: bool = False,
                 ahead_random: bool = True) -> ScheduledBatch | None:
        """The next micro-batch from the sequences not in flight; None when frozen or nothing can run.

        The caller keeps up to `num_micro_batches` (the live pp, which a reconfiguration changes) in flight; with
        config.spread_decodes each takes at most ceil(running / num_micro_batches) decodes. ahead: also the next
        decode of sequences whose step in flight samples (module docstring), for a caller whose workers run the
        steps in order, each after the previous one, and keep what they sampled (a single-stage layout);
        ahead_random: also of requests sampled without a seed (only where one worker samples: several TP ranks
        would each draw another token).
        """
        if self._is_frozen:
            return None
        budget = self.config.max_num_batched_tokens
        shares = num_micro_batches if self.config.spread_decodes else 1
        decodes_left = -(-len(self.running) // max(1, shares))
        decoded: set[str] = set()
        items: dict[str, ScheduledItem] = {}  # by request_id, in the order scheduled
        if self._ahead_after_failure and not self._inflight:
            self._ahead_after_failure = False
        # Ahead of the newest step in flight only: the workers feed the tokens their previous step sampled.
        newest = {item.seq.request_id for item in next(reversed(self._inflight.values())).items} if (
            ahead and self._inflight and not self._ahead_after_failure) else set()
        short_ranks: set[int | None] = set()  # DP ranks where a running sequence lacked blocks (None: it had none)
        # Decodes first (one token each), then the next chunks of running prefills; each pass oldest first.
        for decodes in (True, False):
            if not decodes and len(decoded) == len(self.running):
                break  # every running sequence went as a decode (a steady decode): no prefill chunk is left
            for seq in list(self.running):
                if budget == 0:
                    break
                if (decodes and seq.request_id in newest and decodes_left > 0
                        and (item := self._ahead_item(seq, ahead_random)) is not None):
                    items[seq.request_id] = item
                    budget -= 1
                    decodes_left -= 1
                    decoded.add(seq.request_id)
                    continue
                # A sequence scheduled as a decode still is one in the second pass: it is never fed twice.
                if (seq.status is not SequenceStatus.RUNNING or self._in_flight(seq)
                        or seq.is_prefill == decodes or seq.request_id in self._parking):
                    continue
                if decodes and decodes_left == 0:
                    break  # the rest go in the next micro-batch
                num_new_tokens = min(seq.num_uncomputed_tokens, budget)
                if not self.config.enable_chunked_prefill and num_new_tokens < seq.num_uncomputed_tokens:
                    continue
                while not self.block_manager.append_slots(seq, num_new_tokens):
                    short_ranks.add(rank := self.block_manager.rank_of(seq))
                    victim = self._newest_running(newer_than=seq, rank=rank)
                    if victim is None:
                        break  # seq waits: older sequences, or newer ones in flight, hold the blocks it lacks
                    self._preempt(victim)
                    if (dropped := items.pop(victim.request_id, None)) is not None:
                        budget += len(dropped.step.token_ids)
                        decodes_left += victim.request_id in decoded
                else:
                    items[seq.request_id] = self._item(seq, num_new_tokens)
                    budget -= num_new_tokens
                    if decodes:
                        decodes_left -= 1
                        decoded.add(seq.request_id)
        # New prefills, FCFS, only into ranks where every running sequence got its blocks (they are short otherwise).
        while (None not in short_ranks and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
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
            bisect.insort(self.running, seq, key=self._age)  # a preempted sequence goes back to its place
            items[seq.request_id] = self._item(seq, num_new_tokens)
            budget -= num_new_tokens
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

    def _in_flight(self, seq: Sequence) -> bool:
        return id(seq) in self._inflight_items

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
                or not (random or seq.sampling.draws_alike) or seq.request_id in self._parking):
            return None
        start = previous.start_position + len(previous.token_ids)  # the position of the token it samples
        if not self.block_manager.append_slots(seq, start + 1 - seq.num_computed_tokens):
            return None
        self.num_ahead_items += 1
        return ScheduledItem(seq, SequenceStep(seq.request_id, _PENDING, start, seq.block_table(), seq.sampling,
                                               True, False, num_generated + 1, dp_rank=previous.dp_rank))

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
            if len(items) == 1 and items[0] is item:  # its only step in flight (the most common case): inline
                del inflight_items[key]
                still_inflight = False
            else:
                still_inflight = bool(self._returned(item))
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
        if self._parking:
            self._park_requested(batch)
        return updates

    def on_batch_failed(self, batch: ScheduledBatch) -> None:
        """Take back a step the workers did not finish: its sequences advance nothing and can be scheduled again.

        Re-running the same positions is safe: workers overwrite the KV slots a step rewrites. The blocks the
        step added are returned (a sequence holds blocks for its cached tokens only); sequences aborted or
        finished while in flight are freed, as in on_batch_done.
        """
        if self._inflight.pop(batch.batch_id, None) is None:
            raise ValueError(f"batch {batch.batch_id} is not in flight")
        self._ahead_after_failure = True
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
        self._park_requested(batch)

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
        if self.parked.pop(seq.request_id, None) is not None:
            self._moving_in.discard(seq.request_id)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        seq.status = status
        seq.finished_time = self.clock()
        del self._sequences[seq.request_id]
        del self._admission_index[seq.request_id]
        if not self._in_flight(seq):
            self.block_manager.free(seq)

    def _age(self, seq: Sequence) -> int:
        return self._admission_index[seq.request_id]  # add() order: larger = newer

    def _newest_running(self, newer_than: Sequence | None = None, among: set[str] | None = None,
                        rank: int | None = None) -> Sequence | None:
        """The newest running sequence not in flight (newer than `newer_than`, owning one of `among`, not bound to a
        DP rank other than `rank`: its blocks would be of no use there); None if none."""
        oldest = -1 if newer_than is None else self._age(newer_than)
        for seq in reversed(self.running):  # newest first
            if self._age(seq) <= oldest:
                return None
            if (not self._in_flight(seq) and (among is None or seq.request_id in among)
                    and (rank is None or self.block_manager.rank_of(seq) in (None, rank))):
                return seq
        return None

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: drop seq's KV and queue it first; it later re-prefills prompt + outputs."""
        self.running.remove(seq)
        self._drop_kv(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

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
        return bool(self.waiting) or any(not self._in_flight(seq) for seq in self.running)

    def rebind(self, num_blocks: int) -> list[Sequence]:
        """Take a new KV capacity per DP rank (REBINDING); preempts, newest first, the owners of ids past it in any
        rank. Returns them."""
        if not self._is_frozen or self._inflight:
            raise RuntimeError("rebind needs a frozen scheduler with nothing in flight")
        self.cancel_moves()
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        too_large = [s.request_id for s in self._sequences.values() if self._max_blocks(s) > num_blocks]
        if too_large:
            raise ValueError(f"{len(too_large)} requests (e.g. {too_large[0]!r}) need more than {num_blocks} blocks")
        preempted = []
        while owners := self.block_manager.resize(num_blocks):  # every DP rank takes the new size
            victim = self._newest_running(among=owners)
            self._preempt(victim)
            self.num_switch_preemptions += 1
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
        if not self._is_frozen or self._inflight:
            raise RuntimeError("repartition needs a frozen scheduler with nothing in flight")
        self.cancel_moves()
        if num_blocks < 1 or num_ranks < 1:
            raise ValueError(f"need num_ranks >= 1 and num_blocks >= 1, got {num_ranks} and {num_blocks}")
        too_large = [s.request_id for s in self._sequences.values() if self._max_blocks(s) > num_blocks]
        if too_large:
            raise ValueError(f"{len(too_large)} requests (e.g. {too_large[0]!r}) need more than {num_blocks} blocks")
        old = self.block_manager
        if num_ranks == old.num_ranks and reserved is None:
            preempted = self.rebind(num_blocks)
            maps = {(rank, rank): (list(ids), list(ids))
                    for rank, ids in enumerate(self.block_manager.used_block_ids_per_rank()) if ids}
            return maps, preempted
        tables = {s.request_id: list(s.block_ids) for s in self.running if s.block_ids}
        plan = repartition(old, tables, num_ranks, num_blocks, reserved)
        preempted = []
        for request_id in plan.unplaced:  # free in the old pools, as a preemption does
            seq = self._sequences[request_id]
            self._preempt(seq)
            self.num_switch_preemptions += 1
            preempted.append(seq)
        self._old_partition = (old, {rid: ids for rid, ids in tables.items() if rid in plan.block_tables})
        self.block_manager = plan.blocks
        for request_id, ids in plan.block_tables.items():
            seq = self._sequences[request_id]
            seq.block_ids[:] = ids
            seq.blocks_rewritten()
        return plan.block_maps, preempted

    def restore_partition(self) -> bool:
        """Undo repartition() (frozen, before any step): the old pools and every moved request's old block ids.
        False when there is nothing to undo."""
        if self._old_partition is None:
            return False
        old, tables = self._old_partition
        self._old_partition = None
        self.block_manager = old
        for request_id, ids in tables.items():
            seq = self._sequences.get(request_id)
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
        if not self._is_frozen or self._inflight:
            raise RuntimeError("preempt_all needs a frozen scheduler with nothing in flight")
        self.cancel_moves()
        newest_first = self.running[::-1]
        for seq in newest_first:  # each goes to the front: the oldest ends up first
            self._preempt(seq)
        return newest_first[::-1]

    # ---- live migration between instances (services.router.migration drives these) ------------------------------
    def park(self, request_id: str) -> bool:
        """Stop scheduling a sequence that moves out: a decoding one keeps its KV blocks, now when it is between
        steps (True), else once its step in flight returns (False; it is not scheduled meanwhile, and a step that
        finishes it leaves it finished, not parked). One in the waiting queue (not started yet, or preempted back
        to it) has no KV and parks at once: it moves by re-prefill (or, never started, is simply placed there). One
        prefilling (its prompt, or its prompt and outputs again after a preemption) parks the same way, between its
        chunks or once its step in flight returns, without the part of its KV computed so far unless that step
        completed the prefill. KeyError: unknown; ValueError: parked already."""
        seq = self._sequences[request_id]
        if request_id in self.parked or request_id in self._parking:
            raise ValueError(f"{request_id} is moving already")
        if seq.status is SequenceStatus.WAITING and not seq.num_computed_tokens:
            self.waiting.remove(seq)
            self.parked[request_id] = seq
            return True
        if seq.status is not SequenceStatus.RUNNING:
            raise ValueError(f"{request_id} is {seq.status.value}")
        if self._in_flight(seq):
            self._parking.add(request_id)
            return False
        self._park_running(seq)
        return True

    def _park_running(self, seq: Sequence) -> None:
        """Park a running sequence between its steps: decoding, with its KV; prefilling, without (as when it is
        preempted: it moves by re-prefill, or prefills here again once unparked)."""
        self.running.remove(seq)
        if seq.is_prefill:
            self._drop_kv(seq)
        self.parked[seq.request_id] = seq

    def _drop_kv(self, seq: Sequence) -> None:
        """Free a sequence's KV blocks: it waits again, to prefill its prompt and outputs (here or elsewhere)."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING

    def unpark(self, request_id: str) -> Sequence:
        """A move out that did not happen: schedule the parked sequence again, in its place."""
        if request_id in self._moving_in or request_id not in self.parked:
            raise KeyError(request_id)
        seq = self.parked.pop(request_id)
        if seq.status is SequenceStatus.WAITING:  # preempted: back to the front of the queue, as it was
            self.waiting.appendleft(seq)
        else:
            bisect.insort(self.running, seq, key=self._age)
        return seq

    def cancel_park(self, request_id: str) -> None:
        """Forget a park() still waiting for its step (it is scheduled again)."""
        self._parking.discard(request_id)

    def is_moving_in(self, request_id: str) -> bool:
        """Whether blocks are reserved for this request moving in (not adopted yet)."""
        return request_id in self._moving_in

    def _park_requested(self, batch: ScheduledBatch) -> None:
        """A step returned: park its sequences that asked to be (unless the step finished them)."""
        for item in batch.items:
            seq = item.seq
            if seq.request_id in self._parking and not self._in_flight(seq):
                self._parking.discard(seq.request_id)
                if not seq.is_finished:
                    self._park_running(seq)

    def reserve(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Blocks for the KV of the first `num_tokens` tokens of a sequence moving in, parked until adopt(); a
        second call for the same id grows the reservation (the request decoded on meanwhile). Returns its block
        ids. RequestError if it can never run here; QueueFullError when the blocks are not free now."""
        if seq.request_id in self._moving_in:
            seq = self.parked[seq.request_id]
        elif seq.request_id in self._sequences:
            raise RequestError(f"request id {seq.request_id!r} is already in use")
        if self.block_manager.num_ranks > 1:
            raise RequestError("moving a request in needs one KV pool: this layout is expert parallel")
        self._check_fits(seq)  # as add() would: an instance that could never run it says so, not "full"
        if not 0 < num_tokens < seq.num_prompt_tokens + seq.max_tokens:
            raise RequestError(f"{num_tokens} tokens cannot be the KV of a request of {seq.num_prompt_tokens} "
                               f"prompt tokens and max_tokens {seq.max_tokens}")
        seq.num_computed_tokens = max(seq.num_computed_tokens, num_tokens)
        if not self.block_manager.append_slots(seq, 0):
            raise QueueFullError(f"{self.block_manager.num_blocks_needed(seq, 0)} more KV blocks are needed, "
                                 f"{self.block_manager.num_free} are free", retry_after_s=self.config.retry_after_s)
        if seq.request_id not in self._moving_in:
            seq.status = SequenceStatus.RUNNING
            self._sequences[seq.request_id] = seq
            self._admission_index[seq.request_id] = next(self._admission_counter)
            self.parked[seq.request_id] = seq
            self._moving_in.add(seq.request_id)
        return list(seq.block_ids)

    def adopt(self, request_id: str, output_token_ids: list[int], num_computed_tokens: int) -> Sequence:
        """A reserved sequence whose KV has arrived: it runs here from its next token on (no prefill).
        KeyError: nothing reserved under this id; RequestError: the state does not fit the reservation."""
        if request_id not in self._moving_in:
            raise KeyError(request_id)
        seq = self.parked[request_id]
        num_tokens = seq.num_prompt_tokens + len(output_token_ids)
        if not (num_computed_tokens == num_tokens - 1 and 0 < len(output_token_ids) <= seq.max_tokens
                and num_blocks_for(num_computed_tokens, self.block_manager.block_size) <= len(seq.block_ids)):
            raise RequestError(f"{request_id}: {num_computed_tokens} cached tokens and {len(output_token_ids)} "
                               f"generated do not fit its {seq.num_prompt_tokens} prompt tokens and "
                               f"{len(seq.block_ids)} reserved blocks")
        seq.output_token_ids = list(output_token_ids)
        seq.num_computed_tokens = num_computed_tokens
        self.block_manager.truncate(seq, num_computed_tokens)  # a reservation larger than the KV that came
        seq.num_prefills = 1
        self._moving_in.discard(request_id)
        del self.parked[request_id]
        bisect.insort(self.running, seq, key=self._age)
        return seq

    def cancel_moves(self) -> None:
        """A layout change (rebind, repartition, lost KV) ends every move in progress: sequences moving out run
        here again, reservations for ones moving in are given back (their migration fails and they stay put)."""
        self._parking.clear()
        for request_id in list(self.parked):
            if request_id in self._moving_in:
                self._finish(self.parked[request_id], SequenceStatus.FINISHED_ABORTED)
            else:
                self.unpark(request_id)

    def _max_blocks(self, seq: Sequence) -> int:
        # The KV a sequence ever holds: every token but the last one sampled (the whole prompt when none is).
        num_tokens = max(seq.num_prompt_tokens, seq.num_prompt_tokens + seq.max_tokens - 1)
        return num_blocks_for(num_tokens, self.block_manager.block_size)

    def _item(self, seq: Sequence, num_new_tokens: int) -> ScheduledItem:
        start = seq.num_computed_tokens
        if (dp_rank := self.block_manager.rank_of(seq)) is None:
            raise RuntimeError(f"{seq.request_id} is scheduled without KV blocks")
        sample = start + num_new_tokens == seq.num_tokens and seq.max_tokens > 0
        step = SequenceStep(
            request_id=seq.request_id,
            token_ids=tuple(seq.token_ids_at(start, num_new_tokens)),
            start_position=start,
            block_table=seq.block_table(),
            sampling=seq.sampling,
            sample=sample,
            num_generated=len(seq.output_token_ids),
            dp_rank=dp_rank,
            **_sampling_context(seq, start, num_new_tokens, sample),
        )
        return ScheduledItem(seq, step)

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


def _sampling_context(seq: Sequence, start: int, num_new_tokens: int, sample: bool) -> dict:
    """What the last stage needs of the request's history for this step, only where its options use it: the
    router owns that history, so it stays right across preemptions and layout switches."""
    context: dict = {}
    if sample and seq.sampling.has_output_penalties:
        context["output_token_counts"] = tuple(sorted(Counter(seq.output_token_ids).items()))
        if seq.sampling.repetition_penalty != 1:
            context["distinct_prompt_token_ids"] = tuple(sorted(set(seq.prompt_token_ids)))
    if sample and len(seq.output_token_ids) < seq.min_tokens:
        context["suppressed_token_ids"] = tuple(sorted(seq.stop_token_ids))
    last_target = min(start + num_new_tokens, seq.num_prompt_tokens - 1)  # the last prompt position to score
    if seq.wants_prompt_logprobs and not seq.has_prompt_logprobs and last_target > start:
        context["prompt_logprob_token_ids"] = tuple(seq.prompt_token_ids[start + 1:last_target + 1])
    return context
