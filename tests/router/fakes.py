"""The router tests' fake workers and what goes with them.

PagedWorkers plays the workers: a paged KV store indexed by the global block ids of each step. A step writes its
tokens into the slots its block table names, and a sampling step reads the whole prefix back from the cache and
"samples" a deterministic function of it (next_token). So a wrong block table, a block shared by two live
sequences, or a preempted sequence that does not re-prefill its whole prefix changes the generated tokens.
Around it: schedulers, sequences and random workloads to run through it, an Engine over a stand-in driver, and the
checks that every request ended with the tokens it should have and that the blocks add up.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from hypothesis import strategies as st

from services.contracts.step import PENDING_TOKEN
from services.contracts.step_rows import RowEncoder
from services.router.async_scheduler import scheduler_for
from services.router.block_manager import BlockManager, num_blocks_for
from services.router.config import SchedulerConfig
from services.router.contracts import GenerationRequest
from services.router.engine import Engine
from services.router.scheduler import ScheduledBatch, Scheduler
from services.router.sequence import Sequence, SequenceStatus

VOCAB = 97


def next_token(prefix: list[int]) -> int:
    """The fake model: a deterministic function of the whole prefix."""
    return (31 * sum(prefix) + 7 * len(prefix) + 3 * prefix[-1]) % VOCAB


def expected_output(prompt: list[int], max_tokens: int, stop_token_ids=frozenset()) -> list[int]:
    tokens, output = list(prompt), []
    while len(output) < max_tokens:
        output.append(next_token(tokens))
        tokens.append(output[-1])
        if output[-1] in stop_token_ids:
            break
    return output


def prompt_of(index: int, length: int) -> list[int]:
    return [(index * 7 + i * 13 + 1) % VOCAB for i in range(length)]


class PagedWorkers:
    """Executes steps against a paged KV store of token ids, the way workers use the global block ids."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.cache: dict[int, list[int | None]] = {}
        self.sampled: dict[str, tuple[int, int]] = {}  # the previous step's (position, token) by request, as a worker

    def _key(self, step, block_id: int):
        """Where a block of `step` lives in the store: its global id."""
        return block_id

    def _check(self, step, end: int) -> None:
        assert len(step.block_table) == num_blocks_for(end, self.block_size)
        assert all(0 <= b < self.block_manager.num_total for b in step.block_table)

    def run(self, batch: ScheduledBatch) -> dict[str, int]:
        size, sampled = self.block_size, {}
        for item in batch.items:
            step, seq = item.step, item.seq
            end = step.start_position + len(step.token_ids)
            self._check(step, end)
            token_ids = step.token_ids
            if token_ids == (PENDING_TOKEN,):  # a step ahead: the token this "worker" sampled there last step
                assert self.sampled[step.request_id][0] == step.start_position
                token_ids = (self.sampled[step.request_id][1],)
            for offset, token in enumerate(token_ids):
                position = step.start_position + offset
                block = self.cache.setdefault(self._key(step, step.block_table[position // size]), [None] * size)
                block[position % size] = token
            if step.sample:
                prefix = [self.cache[self._key(step, step.block_table[p // size])][p % size] for p in range(end)]
                # (A step ahead of one whose request ended meanwhile feeds that step's token, which the request did
                # not keep: the step is computed and discarded.)
                assert prefix == seq.all_token_ids or (seq.is_finished and prefix[:-1] == seq.all_token_ids), (
                    f"{seq.request_id}: cached prefix differs from its tokens")
                sampled[step.request_id] = next_token(prefix)
        if batch.items:
            self.sampled = {item.step.request_id: (item.step.start_position + len(item.step.token_ids),
                                                   sampled[item.step.request_id])
                            for item in batch.items if item.step.request_id in sampled}
        return sampled


def make_scheduler(num_blocks=64, block_size=4, max_model_len=256, **config) -> Scheduler:
    clock = iter(range(1, 10**9))
    return scheduler_for(SchedulerConfig(max_model_len=max_model_len, **config), BlockManager(num_blocks, block_size),
                         clock=lambda: float(next(clock)))


def seq_of(request_id: str, prompt: list[int], max_tokens: int, stop_token_ids=frozenset()) -> Sequence:
    return Sequence.from_request(GenerationRequest(request_id, tuple(prompt), max_tokens,
                                                   stop_token_ids=frozenset(stop_token_ids)))


def run_step(scheduler: Scheduler, workers: PagedWorkers):
    batch = scheduler.schedule()
    assert batch is not None
    return batch, scheduler.on_batch_done(batch, workers.run(batch))


def drain(scheduler: Scheduler, workers: PagedWorkers, max_steps=10_000) -> None:
    for _ in range(max_steps):
        if not scheduler.has_unfinished:
            return
        run_step(scheduler, workers)
    raise AssertionError("requests did not finish")


@st.composite
def workloads(draw):
    block_size = draw(st.integers(1, 6))
    requests = draw(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 30), st.integers(1, 12)),
                             min_size=1, max_size=14))
    largest = max(num_blocks_for(p + m - 1, block_size) for _, p, m in requests)
    chunked = draw(st.booleans())
    config = dict(
        max_model_len=64,
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=draw(st.integers(1, 40)) if chunked else 64,
        num_inflight_batches=draw(st.integers(1, 3)),
        enable_chunked_prefill=chunked,
        spread_decodes=draw(st.booleans()),
    )
    num_blocks = draw(st.integers(largest, largest * 3))
    stop_token_ids = frozenset(draw(st.sets(st.integers(0, VOCAB - 1), max_size=2)))
    aborts = draw(st.lists(st.tuples(st.integers(0, 60), st.integers(0, len(requests) - 1)), max_size=3))
    return block_size, num_blocks, config, requests, stop_token_ids, aborts


@st.composite
def contended_workloads(draw):
    """A few requests arriving together at a cache that holds the largest of them and little more, with
    several micro-batches in flight: where a preemption policy can livelock."""
    block_size = draw(st.integers(1, 6))
    requests = draw(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(1, 12)),
                             min_size=2, max_size=4))
    largest = max(num_blocks_for(p + m - 1, block_size) for _, p, m in requests)
    config = dict(
        max_model_len=64,
        max_num_seqs=draw(st.integers(2, 4)),
        max_num_batched_tokens=draw(st.integers(1, 8)),
        num_inflight_batches=draw(st.integers(2, 3)),
        spread_decodes=draw(st.booleans()),
    )
    return block_size, largest + draw(st.integers(0, 1)), config, requests, frozenset(), []


def running(request_id: str, block_ids: list[int], num_computed_tokens: int, num_preemptions: int = 0) -> Sequence:
    """A RUNNING sequence holding `block_ids`, `num_computed_tokens` of its tokens cached by finished steps."""
    return Sequence(request_id=request_id, prompt_token_ids=list(range(3, 3 + max(num_computed_tokens, 1))),
                    max_tokens=4, num_computed_tokens=num_computed_tokens, block_ids=list(block_ids),
                    status=SequenceStatus.RUNNING, num_preemptions=num_preemptions)


def engine_over_fake_workers(num_blocks: int, block_size: int, dp_size: int = 1, **config) -> Engine:
    """An Engine whose driver is a stand-in (nothing is sent to workers; the tests drive its scheduler)."""
    info = SimpleNamespace(topology="tp1pp1" if dp_size == 1 else f"ep{dp_size}pp1", num_kv_blocks=num_blocks)
    driver = SimpleNamespace(infos=[info] * dp_size, num_kv_blocks=num_blocks, block_size=block_size,
                             dp_size=dp_size, rows=RowEncoder())
    max_model_len = config.pop("max_model_len", 64)
    return Engine(driver, tokenizer=None, model_name="m", max_model_len=max_model_len,
                  scheduler_config=SchedulerConfig(max_model_len=max_model_len, **config))


def check_every_request_done(scheduler, seqs, aborted, stop_token_ids) -> None:
    """Every request finished: the aborted ones as aborted, the others with exactly the expected tokens, each
    prefilled once more than it was preempted."""
    assert scheduler.num_preemptions == sum(s.num_preemptions for s in seqs)
    for i, seq in enumerate(seqs):
        assert seq.is_finished
        if i in aborted:
            assert seq.status is SequenceStatus.FINISHED_ABORTED
            continue
        assert seq.output_token_ids == expected_output(seq.prompt_token_ids, seq.max_tokens, stop_token_ids)
        assert seq.num_prefills == seq.num_preemptions + 1


def check_blocks(scheduler: Scheduler, inflight: deque[ScheduledBatch]) -> None:
    """The blocks add up: none owned twice, each holder's as many as its cached tokens (and those of its steps in
    flight) need, none held by a waiting sequence."""
    manager = scheduler.block_manager
    steps_of: dict[str, list] = {}  # the steps in flight of each request, oldest first
    for batch in inflight:
        for item in batch.items:
            steps_of.setdefault(item.seq.request_id, []).append(item.step)
    holders = {s.request_id: s for s in scheduler.running}
    holders.update({item.seq.request_id: item.seq for batch in inflight for item in batch.items})
    owned = [b for s in holders.values() for b in s.block_ids]
    assert len(owned) == len(set(owned)), "a block is owned by two sequences"
    assert manager.num_used == len(owned) and manager.num_free + manager.num_used == manager.num_total
    for seq in holders.values():
        if seq.is_finished:  # ended while in flight: it keeps its blocks until its last step in flight returns
            continue
        cached = seq.num_computed_tokens
        for step in steps_of.get(seq.request_id, []):  # each continuing the one before (not a step ahead of a
            if step.start_position != cached:          # failed one: it comes back stale)
                break
            cached = step.start_position + len(step.token_ids)
        assert len(seq.block_ids) == num_blocks_for(cached, manager.block_size)
    for seq in scheduler.waiting:
        assert seq.block_ids == [] and seq.num_computed_tokens == 0
