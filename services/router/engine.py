"""The router's engine: the step loop (schedule → execute on the workers → process the result) and the requests'
output streams.

Beside the loop, collaborators the engine owns: the scheduler (AsyncScheduler with async scheduling on), the switch
operations the controller drives (`switch_ops`: freeze, pre-copy, rebind), a failed step's stall (`failures`),
instance moves (`instance_moves`) and EPLB (`experts`). A failed step (a worker died or errored) stalls the engine
until the controller recovers the workers, or fails its requests (services.router.step_failures).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import structlog

from services.model.tokenizer import Tokenizer
from services.router.async_scheduler import scheduler_for
from services.router.batch import ScheduledBatch
from services.router.config import SchedulerConfig
from services.router.contracts import (
    EngineDrainingError,
    EngineStats,
    GenerationDelta,
    GenerationRequest,
    RequestError,
    SwitchReport,
    SwitchTotals,
)
from services.router.doorbell import Doorbell
from services.router.dp_blocks import BlockMaps, DataParallelBlocks
from services.router.driver import Driver, StepError
from services.router.expert_balance import EplbSettings, ExpertBalancer
from services.router.instance_moves import InstanceMoves
from services.router.load_window import LoadWindow, RequestTimer
from services.router.output import OutputStream, RequestStream
from services.router.precopy import PrecopyRound
from services.router.sequence import Sequence, SequenceStatus
from services.router.step_failures import StepFailures
from services.router.switch_ops import SwitchOps
from services.topology import Topology

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _InFlight:
    batch: ScheduledBatch | None  # None: a step with no sequences, sent only to commit an expert map
    future: asyncio.Future
    expert_commit: asyncio.Future | None = None  # resolved when this step (carrying an EPLB commit) returns


# Why a request still running when the engine stops ends: its client may retry elsewhere.
SHUTDOWN_ABORT = "the server is shutting down and this request did not finish within its grace period; retry it"


class Engine:
    """Owns the scheduler and the driver; front ends call generate() and read deltas."""

    def __init__(self, driver: Driver, tokenizer: Tokenizer, model_name: str, max_model_len: int,
                 scheduler_config: SchedulerConfig | None = None, vocab_size: int | None = None,
                 recovery_timeout_s: float = 0.0, eplb: EplbSettings | None = None) -> None:
        _check_seconds("recovery_timeout_s", recovery_timeout_s)
        self.vocab_size = vocab_size  # the model's (may differ from the tokenizer's); ids past it would fail a step
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.context_note = ""  # why max_model_len is below the model's own limit (the KV cache), for errors
        config = scheduler_config or SchedulerConfig(max_model_len=max_model_len)
        # EP layouts: one KV pool per data-parallel attention rank; a rebind keeps the DP size.
        blocks = DataParallelBlocks(driver.dp_size, driver.num_kv_blocks, driver.block_size)
        self.scheduler = scheduler_for(config, blocks)  # AsyncScheduler with async scheduling on
        self.bind_driver(driver)
        self.streams: dict[str, OutputStream] = {}  # admitted requests, by id: where their tokens go
        self._inflight: list[_InFlight] = []
        self._wakeup = Doorbell()
        self._idle = asyncio.Event()  # set when nothing is in flight (Freeze waits on it)
        self._idle.set()
        self._no_streams = asyncio.Event()  # set when no admitted request is left (drain waits on it)
        self._no_streams.set()
        self.is_draining = False  # shutting down: admitted requests finish, new ones are refused
        self.draining_listeners: list[Callable[[], None]] = []  # told when draining begins (the API servers)
        self._task: asyncio.Task | None = None
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_full_prefills = 0  # prefills from position 0: once per request unless it was preempted
        self.num_steps = 0  # steps completed (EPLB's step_interval counts them)
        self._expert_commit: tuple[int, asyncio.Future] | None = None  # EPLB: (epoch, done) for the next step
        self._step_waiters: list[asyncio.Future] = []  # wait_step's, resolved when the next step returns
        self.switch_ops = SwitchOps(self)  # the controller's freeze, pre-copy and rebind
        self.failures = StepFailures(self, recovery_timeout_s)  # a failed step's stall
        self.experts = ExpertBalancer(self, eplb)  # MoE: EPLB's trigger, status and commit
        self.load = LoadWindow()  # arrivals and latencies of the last minute (RouterStats.window: the autopilot)
        self.instance_moves = InstanceMoves(self)  # requests moving to or from other instances (MELL)

    def bind_driver(self, driver: Driver) -> None:
        """Step through `driver` from now on (at start, and a rebind to a new layout's workers)."""
        self.driver = driver
        self.topology = Topology.parse(driver.infos[0].topology)
        self.num_inflight_batches = max(self.scheduler.config.num_inflight_batches, self.topology.pp)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-loop")
        self.experts.start()

    async def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Finish the steps in flight (workers must see whole steps), then stop the loop and the streams."""
        self.scheduler.freeze()
        self.switch_ops.cancel_lease()
        self.failures.clear()  # its timer must not fire into a stopped engine
        await self.experts.stop()
        try:
            await asyncio.wait_for(self._idle.wait(), drain_timeout_s)
        except asyncio.TimeoutError:
            log.warning("engine.stop_drain_timeout", inflight=len(self._inflight))
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for stream in list(self.streams.values()):
            stream.finish("abort", SHUTDOWN_ABORT)
        await self.driver.close()
        if self.switch_ops.closing:  # replaced drivers still ending their streams
            await asyncio.gather(*self.switch_ops.closing, return_exceptions=True)

    async def drain(self, grace_s: float) -> int:
        """Refuse new requests (EngineDrainingError) and give the admitted ones up to `grace_s` to finish, so that a
        router going down answers what it accepted; returns how many were still unfinished (stop() aborts them)."""
        self.is_draining = True
        for listener in self.draining_listeners:
            listener()
        if self.streams:
            waiter = asyncio.ensure_future(self._no_streams.wait())
            await asyncio.wait([waiter], timeout=grace_s)  # not wait_for: it can swallow a cancellation on 3.11
            waiter.cancel()
        if self.streams:
            log.warning("engine.drain_timeout", unfinished=len(self.streams), grace_s=grace_s)
        return len(self.streams)

    @property
    def is_ready(self) -> bool:
        return self._task is not None and not self._task.done() and not self.is_draining

    # ---- front-end API ---------------------------------------------------------------------------------------
    def open_stream(self, request: GenerationRequest, stream: OutputStream,
                    migrated: tuple[list[int], int] | None = None) -> None:
        """Admit the request (QueueFullError / RequestError / EngineDrainingError raise here); `stream` gets its
        tokens from now on, until close_stream. migrated: (tokens it generated, tokens cached) of a request moving in
        from another instance (InstanceMoves.admit): with its KV reserved and filled here it continues with no
        prefill, with 0 cached it re-prefills what it had; a first delta with no tokens says it runs here."""
        if self.is_draining:
            raise EngineDrainingError("the server is shutting down and takes no new requests; retry on another "
                                      "replica or after it restarts")
        if self.vocab_size is not None:
            bad = next((t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise RequestError(f"token id {bad} is outside the model's vocabulary [0, {self.vocab_size})")
        if migrated is None:
            self.scheduler.add(Sequence.from_request(request))
            self.num_prompt_tokens += len(request.prompt_token_ids)
        else:
            seq = self.instance_moves.admit(request, list(migrated[0]), migrated[1])
            stream.push((), seq)  # no tokens: the first delta says it runs here
        stream.timer = RequestTimer(time.monotonic())
        self.streams[request.request_id] = stream
        self._no_streams.clear()
        self.load.admitted(stream.timer.start, len(request.prompt_token_ids))
        self._wakeup.set()

    def close_stream(self, request_id: str, stream: OutputStream) -> None:
        """`stream`'s consumer is done with it: its request finished, or the consumer went away (then the request is
        aborted and its blocks freed)."""
        timer = stream.timer
        self.load.finished(time.monotonic(), timer.ttft_s, timer.tpot_s, timer.tokens)
        if not stream.finished:
            self.scheduler.abort(request_id)
            stream.finish("abort")
            self._wakeup.set()
        if self.streams.get(request_id) is stream:  # not a later stream of the same id (moved back)
            del self.streams[request_id]
            self.driver.rows.forget(request_id)  # the workers drop its row with the next step
        if not self.streams:
            self._no_streams.set()

    async def generate(self, request: GenerationRequest,
                       migrated: tuple[list[int], int] | None = None) -> AsyncIterator[GenerationDelta]:
        """Admit the request (open_stream) and stream its deltas, detokenized here (the gRPC Generate, the
        in-process API, tests and benches; API server processes detokenize their own: services.router.gateway)."""
        stream = RequestStream(request, self.tokenizer)
        self.open_stream(request, stream, migrated)
        try:
            while True:
                delta = await stream.get()
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            self.close_stream(request.request_id, stream)

    def stats(self) -> EngineStats:
        blocks = self.scheduler.block_manager
        used_per_rank = blocks.per_rank_used()
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks_total=blocks.num_blocks_per_rank,
            num_kv_blocks_used=max(used_per_rank),
            num_kv_blocks_used_per_dp_rank=used_per_rank if blocks.num_ranks > 1 else (),
            num_preemptions=self.scheduler.num_preemptions,
            num_decodes_ahead=self.scheduler.num_ahead_items,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            topology=str(self.topology),
            is_frozen=self.scheduler.is_frozen,
            stalled=self.failures.stalled,
            extra={"num_step_errors": float(self.failures.num_step_errors),
                   "num_full_prefills": float(self.num_full_prefills),
                   "num_inflight_batches": float(len(self._inflight))},
            window=self.load.snapshot(time.monotonic(), self.scheduler.mean_context_tokens()),
            worker_time=self.driver.worker_times(),
            block_size=blocks.block_size,
            max_model_len=self.max_model_len,
        )

    @property
    def stalled(self) -> str:
        """The first error of the current stall; "" while steps can run."""
        return self.failures.stalled

    @property
    def has_steps_in_flight(self) -> bool:
        return bool(self._inflight)

    async def wait_idle(self, timeout_s: float) -> None:
        """Until no step is in flight (asyncio.TimeoutError past timeout_s)."""
        await asyncio.wait_for(self._idle.wait(), timeout_s)

    # ---- admin (controller): the switch operations live in switch_ops ------------------------------------------
    async def freeze(self, timeout_s: float = 60.0, lease_s: float = 0.0) -> float:
        """The controller's Freeze: stop scheduling, wait for the steps in flight (SwitchOps.freeze)."""
        _check_seconds("lease_s", lease_s)
        return await self.switch_ops.freeze(timeout_s, lease_s)

    async def rebind(self, num_kv_blocks: int, worker_addresses: tuple[str, ...] | None = None,
                     drop_kv: bool = False, dp_size: int = 0, worker_infos: list | None = None,
                     precopy_operation_id: str = "") -> BlockMaps | None:
        """Frozen only: a new KV capacity or number of pools, maybe new workers (SwitchOps.rebind)."""
        return await self.switch_ops.rebind(num_kv_blocks, worker_addresses, drop_kv, dp_size, worker_infos,
                                            precopy_operation_id)

    def plan_rebind(self, num_kv_blocks: int, dp_size: int = 1) -> list[tuple[str, int, int, int]]:
        """What rebind would do to the running requests now, changing nothing (SwitchOps.plan_rebind)."""
        return self.switch_ops.plan_rebind(num_kv_blocks, dp_size)

    def precopy_blocks(self, operation_id: str, num_kv_blocks: int, num_kv_pools: int = 1) -> PrecopyRound:
        """A KV pre-copy round of switch `operation_id` while serving (SwitchOps.precopy_blocks)."""
        return self.switch_ops.precopy_blocks(operation_id, num_kv_blocks, num_kv_pools)

    def kv_to_move(self, precopy_operation_id: str = "") -> list[int]:
        """Frozen, one KV pool: the used block ids a switch's KV migration copies now (SwitchOps.kv_to_move)."""
        return self.switch_ops.kv_to_move(precopy_operation_id)

    def used_block_ids(self) -> list[int]:
        return self.scheduler.block_manager.used_block_ids()

    def record_switch(self, report: SwitchReport) -> None:
        """Count a finished layout switch (the controller sends it on the Resume that ends the switch)."""
        self.switch_ops.record_switch(report)

    def switch_totals(self) -> SwitchTotals:
        """Layout switches the controller reported since start."""
        return self.switch_ops.switches

    def resume(self) -> None:
        """End the controller's freeze and any stall (the controller recovered the workers): schedule again."""
        self.switch_ops.release()
        self.driver.rows.reset()  # a switch, a rollback or a recovery may have left the workers any rows
        self.failures.recovered()
        self.scheduler.unfreeze()
        self._wakeup.set()

    def wake(self) -> None:
        """Schedule again now (a request came back into the running set)."""
        self._wakeup.set()

    async def wait_step(self, timeout_s: float) -> None:
        """Until the next step returns, or timeout_s (no error)."""
        waiter = asyncio.get_running_loop().create_future()
        self._step_waiters.append(waiter)
        try:
            await asyncio.wait([waiter], timeout=timeout_s)
        finally:
            if not waiter.done():
                self._step_waiters.remove(waiter)

    def end_stream(self, request_id: str, reason: str) -> None:
        """End a request's stream with `reason` and no tokens (the scheduler has let the request go)."""
        if (stream := self.streams.get(request_id)) is not None:
            stream.finish(reason)

    def commit_expert_map(self, epoch: int) -> asyncio.Future:
        """EPLB: the next step carries `epoch`, so every worker installs the staged expert map before it (a step
        with no sequences goes out if nothing else would). The future resolves when that step has returned."""
        if self._expert_commit is not None:
            raise RuntimeError(f"expert map {self._expert_commit[0]} is still waiting for its step")
        done = asyncio.get_running_loop().create_future()
        self._expert_commit = (epoch, done)
        self._wakeup.set()
        return done

    def cancel_expert_commit(self) -> None:
        """A freeze: EPLB's commit step will not go out, so that rebalance aborts."""
        if self._expert_commit is not None:
            epoch, done = self._expert_commit
            self._expert_commit = None
            done.set_exception(StepError(f"the router was frozen before the step committing expert map {epoch}"))

    @property
    def steps_ahead(self) -> bool:
        """Whether decodes go out a step ahead (SchedulerConfig.async_scheduling, an AsyncScheduler): only in a
        single-stage layout (tp, not a pipeline, not EP), whose ranks all sample and feed their own tokens; a
        pipeline or an EP layout waits for each step's tokens. With several TP ranks, only greedy and seeded
        requests go ahead."""
        return (self.scheduler.config.async_scheduling and self.topology.pp == 1
                and not self.topology.is_expert_parallel)

    # ---- the step loop: schedule → execute → process -------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            while (step := self._schedule()) is not None:
                await self._execute(*step)
            if not self._inflight:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self._wakeup.clear()
            await self._wakeup.wait(or_done=self._inflight[0].future)
            # Steps complete in submission order (every worker runs steps in order): process the done prefix.
            while self._inflight and self._inflight[0].future.done():
                self._process(self._inflight.pop(0))

    def _schedule(self) -> tuple[ScheduledBatch | None, tuple[int, asyncio.Future] | None] | None:
        """The next step to send: a micro-batch and/or EPLB's pending commit; None while the pipeline is full
        (the live pp, one more with steps ahead) or nothing can go (frozen, or no work)."""
        ahead = self.steps_ahead
        if len(self._inflight) >= self.num_inflight_batches + ahead:
            return None
        batch = self.scheduler.schedule(self.num_inflight_batches, ahead=ahead,
                                        ahead_random=self.topology.num_workers == 1)
        commit = self._expert_commit
        if batch is None and (commit is None or self.scheduler.is_frozen):
            return None
        self._expert_commit = None
        return batch, commit

    async def _execute(self, batch: ScheduledBatch | None, commit: tuple[int, asyncio.Future] | None) -> None:
        """Send a step to the workers (with no batch: only EPLB's commit); in flight until its future resolves."""
        self._idle.clear()
        steps = [item.step for item in batch.items] if batch is not None else []
        if batch is not None:
            self.num_full_prefills += batch.num_full_prefills
        try:
            future = await self.driver.submit(steps, commit_expert_map=commit[0] if commit is not None else 0)
        except Exception as exc:  # noqa: BLE001 (a broken stream can fail the write: the loop lives on)
            if commit is not None:
                commit[1].set_exception(StepError(f"cannot send the expert map's step: {_describe(exc)}"))
            if batch is not None:
                self.failures.on_step_failed(batch, f"cannot send step {batch.batch_id} to the workers: "
                                                    f"{_describe(exc)}")
            return
        self._inflight.append(_InFlight(batch, future, commit[1] if commit is not None else None))

    def _process(self, inflight: _InFlight) -> None:
        """A step returned (or failed): apply it, push its tokens, wake whoever waits for a step."""
        try:
            self._apply(inflight)
        except Exception as exc:  # a defect: its requests end with an error, the loop and the others live on
            log.exception("engine.apply_failed", batch_id=inflight.batch.batch_id if inflight.batch else None)
            self.failures.end_with_error(inflight.batch, f"internal error applying a step: {_describe(exc)}")
        if self._step_waiters:
            waiters, self._step_waiters = self._step_waiters, []
            for waiter in waiters:
                waiter.set_result(None)
        self.switch_ops.step_returned()  # frozen: this step's requests get no next one

    def _apply(self, inflight: _InFlight) -> None:
        """A returned step's result: the scheduler advances its requests, their streams get the new tokens."""
        try:
            output = inflight.future.result()
        except (Exception, asyncio.CancelledError) as exc:  # StepError, or anything else: never end the loop
            if inflight.expert_commit is not None and not inflight.expert_commit.done():
                inflight.expert_commit.set_exception(StepError(_describe(exc)))
            if inflight.batch is not None:
                self.failures.on_step_failed(inflight.batch, _describe(exc))
            return
        self.num_steps += 1
        if inflight.expert_commit is not None and not inflight.expert_commit.done():
            inflight.expert_commit.set_result(None)
        if inflight.batch is None:
            return
        sampled = output.sampled([item.seq.request_id for item in inflight.batch.items])
        with_logprobs = {o.request_id: o for o in output.outputs if o.logprob is not None or o.prompt_logprobs}
        now = time.monotonic()
        updates = self.scheduler.on_batch_done(inflight.batch, sampled, with_logprobs)
        streams, num_tokens = self.streams, 0
        for update in updates:
            num_tokens += (count := len(update.new_token_ids))
            stream = streams.get(update.seq.request_id)
            if stream is None:
                continue
            stream.timer.tokens_out(now, count)
            stopped = stream.push(update.new_token_ids, update.seq, update.logprobs)
            if stopped and not update.finished:  # a stop string: the scheduler has not finished it yet
                self.scheduler.finish(update.seq.request_id, SequenceStatus.FINISHED_STOPPED)
        self.num_generation_tokens += num_tokens


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, StepError) else f"{type(exc).__name__}: {exc}"


def _check_seconds(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
