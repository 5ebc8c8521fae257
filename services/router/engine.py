"""The router's engine: the step loop (schedule → workers → postprocess) and per-request output streams.

A failed step (a worker died or errored) does not fail its requests when recovery_timeout_s > 0: the engine
*stalls* (no new step; admission stays open) and hands the batch back to the scheduler unadvanced, waiting for
the controller to recover the workers and resume it. If nobody does within recovery_timeout_s, every unfinished
request ends with an error, so nothing waits forever.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import structlog

from services.launch.driver import Driver, StepError
from services.model.tokenizer import Tokenizer
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
from services.router.dp import BlockMaps, DataParallelBlocks, plan_placements
from services.router.expert_balance import EplbSettings, ExpertBalancer
from services.router.load_window import LoadWindow, RequestTimer
from services.router.migration import InstanceMigrations
from services.router.output import OutputStream, RequestStream
from services.router.precopy import KVPrecopy, PoolPrecopy, PrecopyRound
from services.router.scheduler import ScheduledBatch, Scheduler
from services.router.sequence import Sequence, SequenceStatus
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
        self.driver = driver
        self.vocab_size = vocab_size  # the model's (may differ from the tokenizer's); ids past it would fail a step
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.context_note = ""  # why max_model_len is below the model's own limit (the KV cache), for errors
        self.topology = Topology.parse(driver.infos[0].topology)
        config = scheduler_config or SchedulerConfig(max_model_len=max_model_len)
        # EP layouts: one KV pool per data-parallel attention rank; a rebind keeps the DP size.
        blocks = DataParallelBlocks(driver.dp_size, driver.num_kv_blocks, driver.block_size)
        self.scheduler = Scheduler(config, blocks)
        self.num_inflight_batches = max(config.num_inflight_batches, self.topology.pp)
        self._streams: dict[str, OutputStream] = {}  # admitted requests, by id: where their tokens go
        self._inflight: list[_InFlight] = []
        self._wakeup = _Doorbell()
        self._idle = asyncio.Event()  # set when nothing is in flight (Freeze waits on it)
        self._idle.set()
        self._no_streams = asyncio.Event()  # set when no admitted request is left (drain waits on it)
        self._no_streams.set()
        self.is_draining = False  # shutting down: admitted requests finish, new ones are refused
        self.draining_listeners: list[Callable[[], None]] = []  # told when draining begins (the API servers)
        self._task: asyncio.Task | None = None
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_freezes = 0  # a switch (even rolled back) may give the workers new pools: moves out copy again
        self.num_step_errors = 0
        self.num_full_prefills = 0  # prefills from position 0: once per request unless it was preempted
        self.switches = SwitchTotals()  # layout switches the controller reported (record_switch)
        self.recovery_timeout_s = recovery_timeout_s  # 0: a failed step fails its requests at once (no stall)
        self.stalled = ""  # the first error of the current stall; "" while steps can run
        self._stalled_at = 0.0
        self._stall_timer: asyncio.TimerHandle | None = None
        self._lease_timer: asyncio.TimerHandle | None = None
        self._closing: set[asyncio.Future] = set()  # replaced drivers whose streams are ending (_swap_driver)
        self._frozen_at = 0.0  # monotonic: the controller's freeze began
        self._held_at: float | None = None  # ... and a request first waited for it (None: not yet)
        # The controller's Freeze, apart from the scheduler's frozen flag, which a stall sets too: a stall
        # that times out must not unfreeze a router the controller holds.
        self._is_held = False
        self.num_steps = 0  # steps completed (EPLB's step_interval counts them)
        self._expert_commit: tuple[int, asyncio.Future] | None = None  # EPLB: (epoch, done) for the next step
        self.experts = ExpertBalancer(self, eplb)  # MoE: EPLB's trigger, status and commit
        self.precopy: KVPrecopy | PoolPrecopy | None = None  # the switch's KV pre-copy (precopy_blocks)
        self.load = LoadWindow()  # arrivals and latencies of the last minute (RouterStats.window: the autopilot)
        self.migrations = InstanceMigrations(self)  # requests moving to or from other instances (MELL)
        self._step_waiters: list[asyncio.Future] = []  # wait_step's, resolved when the next step returns

    # ---- lifecycle -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-loop")
        self.experts.start()

    async def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Finish the steps in flight (workers must see whole steps), then stop the loop and the streams."""
        self.scheduler.freeze()
        self._cancel_lease()
        self._clear_stall()  # its timer must not fire into a stopped engine
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
        for stream in list(self._streams.values()):
            stream.finish("abort", SHUTDOWN_ABORT)
        await self.driver.close()
        if self._closing:  # replaced drivers still ending their streams
            await asyncio.gather(*self._closing, return_exceptions=True)

    async def drain(self, grace_s: float) -> int:
        """Refuse new requests (EngineDrainingError) and give the admitted ones up to `grace_s` to finish, so that a
        router going down answers what it accepted; returns how many were still unfinished (stop() aborts them)."""
        self.is_draining = True
        for listener in self.draining_listeners:
            listener()
        if self._streams:
            waiter = asyncio.ensure_future(self._no_streams.wait())
            await asyncio.wait([waiter], timeout=grace_s)  # not wait_for: it can swallow a cancellation on 3.11
            waiter.cancel()
        if self._streams:
            log.warning("engine.drain_timeout", unfinished=len(self._streams), grace_s=grace_s)
        return len(self._streams)

    @property
    def is_ready(self) -> bool:
        return self._task is not None and not self._task.done() and not self.is_draining

    # ---- front-end API ---------------------------------------------------------------------------------------
    def open_stream(self, request: GenerationRequest, stream: OutputStream,
                    migrated: tuple[list[int], int] | None = None) -> None:
        """Admit the request (QueueFullError / RequestError / EngineDrainingError raise here); `stream` gets its
        tokens from now on, until close_stream. migrated: (tokens it generated, tokens cached) of a request moving in
        from another instance (InstanceMigrations.admit): with its KV reserved and filled here it continues with no
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
            seq = self.migrations.admit(request, list(migrated[0]), migrated[1])
            stream.push((), seq)  # no tokens: the first delta says it runs here
        stream.timer = RequestTimer(time.monotonic())
        self._streams[request.request_id] = stream
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
        if self._streams.get(request_id) is stream:  # not a later stream of the same id (moved back)
            del self._streams[request_id]
            self.driver.rows.forget(request_id)  # the workers drop its row with the next step
        if not self._streams:
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
            stalled=self.stalled,
            extra={"num_step_errors": float(self.num_step_errors),
                   "num_full_prefills": float(self.num_full_prefills),
                   "num_inflight_batches": float(len(self._inflight))},
            window=self.load.snapshot(time.monotonic(), self.scheduler.mean_context_tokens()),
            worker_time=self.driver.worker_times(),
            block_size=blocks.block_size,
            max_model_len=self.max_model_len,
        )

    def switch_totals(self) -> SwitchTotals:
        """Layout switches the controller reported since start."""
        return self.switches

    # ---- admin (controller) ----------------------------------------------------------------------------------
    async def freeze(self, timeout_s: float = 60.0, lease_s: float = 0.0) -> float:
        """Stop scheduling new steps and wait until the in-flight ones are done. Admission stays open.

        Returns how long the freeze drained before any request waited for it: until the first step in flight came
        back (its requests get no next step), or 0 when a request was ready to run at once. The steps in flight
        deliver their tokens meanwhile: that part of the freeze is no downtime.

        lease_s > 0: unless resume() or another freeze() comes within lease_s, the engine resumes by itself, so
        a controller that dies mid-operation cannot leave the router frozen.
        """
        _check_seconds("lease_s", lease_s)
        if not self._is_held:  # a renewal of the lease keeps the first freeze's times
            self._frozen_at = time.monotonic()
            self._held_at = self._frozen_at if not self._inflight or self.scheduler.has_unscheduled() else None
        self._is_held = True
        self.num_freezes += 1
        self.scheduler.freeze()
        if self._expert_commit is not None:  # EPLB's commit step will not go out: that rebalance aborts
            epoch, done = self._expert_commit
            self._expert_commit = None
            done.set_exception(StepError(f"the router was frozen before the step committing expert map {epoch}"))
        self._cancel_lease()
        if lease_s > 0:
            self._lease_timer = asyncio.get_running_loop().call_later(lease_s, self._lease_expired, lease_s)
        await asyncio.wait_for(self._idle.wait(), timeout_s)
        await asyncio.wait_for(self.migrations.wait_no_pulls(), timeout_s)  # no worker writes a block it moves
        if self._held_at is None:  # idle: every step came back (the loop notes the first)
            self._held_at = time.monotonic()
        return self._held_at - self._frozen_at

    async def rebind(self, num_kv_blocks: int, worker_addresses: tuple[str, ...] | None = None,
                     drop_kv: bool = False, dp_size: int = 0, worker_infos: list | None = None,
                     precopy_operation_id: str = "") -> BlockMaps | None:
        """Frozen only. Take a new KV capacity (the newest requests are preempted if live blocks exceed it) and,
        with worker_addresses, stream steps to the active workers of the new layout (_swap_driver). drop_kv: the
        workers lost the KV of the running requests, so every one of them is preempted (re-prefilled later).

        dp_size (0: unchanged) is the target's number of KV pools: when it or the current one is above 1 (an
        expert-parallel layout), every running request gets a pool of the target and ids there, and the block maps
        the workers' migration follows are returned. Rebinding back to the old width before any step restores the
        old pools exactly (a rolled-back switch); taking the new workers (worker_addresses) commits the new ones.
        worker_infos: the workers' infos in the new layout, when the caller has them (not asked again).
        precopy_operation_id: the switch whose rounds pre-copied into the target's pools (PoolPrecopy): every
        request keeps the pool and ids reserved for it, and the maps hold only what the rounds did not copy. (With
        one pool on both sides, kv_to_move gives the delta.)"""
        if worker_addresses is not None:
            if self._inflight:
                raise RuntimeError("rebind with steps in flight: freeze first")
            await self._swap_driver(worker_addresses, worker_infos)
            self.scheduler.commit_partition()
        maps = None
        blocks = self.scheduler.block_manager
        if dp_size and self.scheduler.restore_partition() and dp_size == self.scheduler.block_manager.num_ranks:
            log.info("engine.pools_restored", num_ranks=dp_size)
            self.scheduler.rebind(num_kv_blocks)
        elif dp_size and (dp_size > 1 or blocks.num_ranks > 1):
            precopy = self._end_precopy(precopy_operation_id, PoolPrecopy)
            reserved = precopy.reservations(self.scheduler.running, blocks) if precopy is not None else None
            maps, preempted = self.scheduler.repartition(dp_size, num_kv_blocks, reserved)
            log.info("engine.pools_repartitioned", num_ranks=dp_size, num_blocks=num_kv_blocks,
                     moved=sum(len(src) for src, _ in maps.values()), preempted=len(preempted))
        else:
            self.scheduler.rebind(num_kv_blocks)
        if drop_kv:
            preempted = self.scheduler.preempt_all()
            log.info("engine.kv_dropped", num_preempted=len(preempted))
        return maps

    async def _swap_driver(self, worker_addresses: tuple[str, ...], infos: list | None = None) -> None:
        """A driver of the new layout's workers; the streams of workers that stay active carry on (no reconnect),
        and the old driver's other streams end in the background, off the cutover's path."""
        driver = Driver(list(worker_addresses), self.driver.step_timeout_s, self.driver.token)
        try:
            # First: an unreachable address leaves the old driver in place.
            await driver.connect(previous=self.driver, infos=infos)
            if not self.scheduler.is_frozen:  # the freeze's lease ran out while connecting
                raise RuntimeError("the router was resumed during the rebind: freeze first")
        except BaseException:
            await driver.close(keep=self.driver.streams)
            raise
        old, self.driver = self.driver, driver
        closing = asyncio.ensure_future(self._close_driver(old, keep=driver.streams))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)
        self.topology = Topology.parse(self.driver.infos[0].topology)
        self.num_inflight_batches = max(self.scheduler.config.num_inflight_batches, self.topology.pp)

    @staticmethod
    async def _close_driver(driver: Driver, keep) -> None:
        try:
            await driver.close(keep=keep)
        except Exception as exc:  # noqa: BLE001 (the old streams may be broken: a worker died)
            log.warning("engine.old_driver_close_failed", error=str(exc))

    def used_block_ids(self) -> list[int]:
        return self.scheduler.block_manager.used_block_ids()

    def precopy_blocks(self, operation_id: str, num_kv_blocks: int, num_kv_pools: int = 1) -> PrecopyRound:
        """A KV pre-copy round of switch `operation_id` (serving goes on) into a target of `num_kv_pools` pools of
        `num_kv_blocks` blocks: the full blocks of running requests not handed out before in this operation, and
        their partly filled ones to warm, as block maps. One pool on both sides: blocks keep their ids (those at or
        above the target's capacity are left to the freeze); else each request gets a pool of the target and ids
        there, reserved until the freeze (PoolPrecopy). A new operation id starts afresh."""
        blocks = self.scheduler.block_manager
        if num_kv_blocks < 1 or num_kv_pools < 1:
            raise ValueError(f"need num_kv_blocks >= 1 and num_kv_pools >= 1, got {num_kv_blocks}, {num_kv_pools}")
        precopy = self.precopy
        if precopy is None or precopy.operation_id != operation_id:
            if blocks.num_ranks == 1 and num_kv_pools == 1:
                precopy = KVPrecopy(operation_id, num_kv_blocks)
            else:
                precopy = PoolPrecopy(operation_id, num_kv_pools, num_kv_blocks, blocks.block_size,
                                      same_pools=num_kv_pools == blocks.num_ranks)
            self.precopy = precopy
        if isinstance(precopy, PoolPrecopy):
            if (precopy.target.num_ranks, precopy.num_kv_blocks) != (num_kv_pools, num_kv_blocks):
                raise ValueError(f"operation {operation_id!r} pre-copies into {precopy.target.num_ranks} pools of "
                                 f"{precopy.num_kv_blocks} blocks, not {num_kv_pools} of {num_kv_blocks}")
            maps, warm = precopy.next_round(self.scheduler.running, blocks)
        else:
            ids = precopy.next_round(self.scheduler.running, blocks.block_size)
            warm_ids = precopy.warm(self.scheduler.running, blocks.block_size)
            maps = {(0, 0): (ids, list(ids))} if ids else {}
            warm = {(0, 0): (warm_ids, list(warm_ids))} if warm_ids else {}
        return PrecopyRound(maps, warm, precopy.num_copied, blocks.num_used)

    def plan_rebind(self, num_kv_blocks: int, dp_size: int = 1) -> list[tuple[str, int, int, int]]:
        """What rebind(num_kv_blocks, dp_size=dp_size) would do to the running requests now, changing nothing
        (dp.plan_placements)."""
        return plan_placements(self.scheduler.block_manager, self.scheduler.running, num_kv_blocks, dp_size)

    def _end_precopy(self, operation_id: str, kind: type) -> KVPrecopy | PoolPrecopy | None:
        """The record of the pre-copy `operation_id` ("": none ran), which ends here (also when it is not found:
        ValueError, the switch gives up on it)."""
        precopy, self.precopy = self.precopy, None
        if not operation_id:
            return None
        if not isinstance(precopy, kind) or precopy.operation_id != operation_id:
            raise ValueError(f"no KV pre-copy of operation {operation_id!r} ran here")
        return precopy

    def kv_to_move(self, precopy_operation_id: str = "") -> list[int]:
        """Frozen, one KV pool: the used block ids a switch's KV migration must copy now: all of them, or with the
        operation whose rounds pre-copied the rest, only the delta. The pre-copy record ends here."""
        used = self.used_block_ids()
        precopy = self._end_precopy(precopy_operation_id, KVPrecopy)
        return used if precopy is None else precopy.delta(self.scheduler.running, used)

    def record_switch(self, report: SwitchReport) -> None:
        """Count a finished layout switch (the controller sends it on the Resume that ends the switch)."""
        self.switches = self.switches.add(report)
        log.info("engine.switch_recorded", operation_id=report.operation_id, state=report.state,
                 topology=f"{report.from_topology}->{report.to_topology}", downtime_s=report.downtime_seconds)

    def resume(self) -> None:
        """End the controller's freeze and any stall (the controller recovered the workers): schedule again."""
        self._cancel_lease()
        self._is_held = False
        self.driver.rows.reset()  # a switch, a rollback or a recovery may have left the workers any rows
        if self.stalled:
            log.info("engine.recovered", error=self.stalled, stalled_s=round(time.monotonic() - self._stalled_at, 3))
            self._clear_stall()
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
        if (stream := self._streams.get(request_id)) is not None:
            stream.finish(reason)

    def _lease_expired(self, lease_s: float) -> None:
        self._lease_timer = None
        log.warning("engine.freeze_lease_expired", lease_s=lease_s)
        self.resume()

    def _cancel_lease(self) -> None:
        if self._lease_timer is not None:
            self._lease_timer.cancel()
            self._lease_timer = None

    # ---- the step loop ---------------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            await self._fill_pipeline()
            if not self._inflight:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self._wakeup.clear()
            await self._wakeup.wait(or_done=self._inflight[0].future)
            # Batches complete in submission order (every worker runs steps in order): drain the done prefix.
            while self._inflight and self._inflight[0].future.done():
                inflight = self._inflight.pop(0)
                try:
                    self._complete(inflight)
                except Exception as exc:  # a defect: its requests end with an error, the loop and the others live on
                    log.exception("engine.apply_failed", batch_id=inflight.batch.batch_id if inflight.batch else None)
                    self._end_with_error(inflight.batch, f"internal error applying a step: {_describe(exc)}")
                if self._step_waiters:
                    waiters, self._step_waiters = self._step_waiters, []
                    for waiter in waiters:
                        waiter.set_result(None)
                if self._is_held and self._held_at is None:  # frozen: this step's requests get no next one
                    self._held_at = time.monotonic()

    def commit_expert_map(self, epoch: int) -> asyncio.Future:
        """EPLB: the next step carries `epoch`, so every worker installs the staged expert map before it (a step
        with no sequences goes out if nothing else would). The future resolves when that step has returned."""
        if self._expert_commit is not None:
            raise RuntimeError(f"expert map {self._expert_commit[0]} is still waiting for its step")
        done = asyncio.get_running_loop().create_future()
        self._expert_commit = (epoch, done)
        self._wakeup.set()
        return done

    @property
    def steps_ahead(self) -> bool:
        """Whether decodes go out a step ahead (SchedulerConfig.async_scheduling): only in a single-stage layout
        (tp, not a pipeline, not EP), whose ranks all sample and feed their own tokens; a pipeline or an EP layout
        waits for each step's tokens. With several TP ranks, only greedy and seeded requests go ahead."""
        return (self.scheduler.config.async_scheduling and self.topology.pp == 1
                and not self.topology.is_expert_parallel)

    async def _fill_pipeline(self) -> None:
        ahead = self.steps_ahead
        while len(self._inflight) < self.num_inflight_batches + ahead:
            batch = self.scheduler.schedule(self.num_inflight_batches, ahead=ahead,
                                            ahead_random=self.topology.num_workers == 1)
            commit, epoch = self._expert_commit, 0
            if batch is None and (commit is None or self.scheduler.is_frozen):
                return
            if commit is not None:
                self._expert_commit, epoch = None, commit[0]
            self._idle.clear()
            steps = [item.step for item in batch.items] if batch is not None else []
            if batch is not None:
                self.num_full_prefills += batch.num_full_prefills
            try:
                future = await self.driver.submit(steps, commit_expert_map=epoch)
            except Exception as exc:  # noqa: BLE001 (a broken stream can fail the write: the loop lives on)
                if commit is not None:
                    commit[1].set_exception(StepError(f"cannot send the expert map's step: {_describe(exc)}"))
                if batch is not None:
                    self._on_step_failed(batch, f"cannot send step {batch.batch_id} to the workers: "
                                                f"{_describe(exc)}")
                continue
            self._inflight.append(_InFlight(batch, future, commit[1] if commit is not None else None))

    def _complete(self, inflight: _InFlight) -> None:
        try:
            output = inflight.future.result()
        except (Exception, asyncio.CancelledError) as exc:  # StepError, or anything else: never end the loop
            if inflight.expert_commit is not None and not inflight.expert_commit.done():
                inflight.expert_commit.set_exception(StepError(_describe(exc)))
            if inflight.batch is not None:
                self._on_step_failed(inflight.batch, _describe(exc))
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
        streams, num_tokens = self._streams, 0
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

    # ---- failed steps ----------------------------------------------------------------------------------------
    def _on_step_failed(self, batch: ScheduledBatch, error: str) -> None:
        """A step failed (a worker died or errored): stall until the controller recovers the workers, or, with no
        recovery timeout, end the batch's requests with an error at once."""
        self.num_step_errors += 1
        self.driver.rows.reset()  # the steps after it may have reached some workers and not others
        log.warning("engine.step_failed", error=error, requests=len(batch.items))
        if self.recovery_timeout_s <= 0:
            self._fail_batch(batch, error)
            return
        self.scheduler.on_batch_failed(batch)  # unadvanced: the same positions run again after the recovery
        self.scheduler.freeze()
        if self.stalled:  # a later batch of the same failure: the first error and its timer stand
            return
        self.stalled, self._stalled_at = error, time.monotonic()
        log.error("engine.stalled", error=error, recovery_timeout_s=self.recovery_timeout_s)
        self._stall_timer = asyncio.get_running_loop().call_later(self.recovery_timeout_s, self._recovery_expired)

    def _recovery_expired(self) -> None:
        """Nobody recovered the workers in time: end every unfinished request with an error, then let new
        requests try again (if the workers are still broken, they stall again)."""
        error = (f"the workers failed ({self.stalled}) and were not recovered within "
                 f"{self.recovery_timeout_s:g} s")
        log.error("engine.recovery_timeout", error=self.stalled, recovery_timeout_s=self.recovery_timeout_s,
                  requests=len(self._streams))
        for request_id, stream in list(self._streams.items()):
            self.scheduler.abort(request_id)  # in flight: marked now, freed when its step returns
            stream.finish("error", error=error)
        self._clear_stall()
        if not self._is_held:
            self.scheduler.unfreeze()
        self._wakeup.set()

    def _clear_stall(self) -> None:
        self.stalled = ""
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _end_with_error(self, batch: ScheduledBatch | None, error: str) -> None:
        for item in batch.items if batch is not None else ():
            self.scheduler.abort(item.seq.request_id)
            if (stream := self._streams.get(item.seq.request_id)) is not None:
                stream.finish("error", error=error)

    def _fail_batch(self, batch: ScheduledBatch, error: str) -> None:
        """Without recovery: the batch's requests end with an explicit error instead of hanging."""
        for item in batch.items:
            self.scheduler.abort(item.seq.request_id)  # in flight: marked now, freed by on_batch_done
        self.scheduler.on_batch_done(batch, {})
        for item in batch.items:
            stream = self._streams.get(item.seq.request_id)
            if stream is not None:
                stream.finish("error", error=error)


class _Doorbell:
    """The step loop's wakeup: set() by whoever gives it work; the loop waits for it, or for it or a step, on one
    plain future (an asyncio.Event waited beside a step costs a task per loop turn, and its cancellation a turn
    more: tens of microseconds a step)."""

    __slots__ = ("_set", "_waiter")

    def __init__(self) -> None:
        self._set = False
        self._waiter: asyncio.Future | None = None

    def set(self) -> None:
        self._set = True
        self._ring()

    def clear(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    async def wait(self, or_done: asyncio.Future | None = None) -> None:
        """Until set() is called, or `or_done` completes."""
        if self._set or (or_done is not None and or_done.done()):
            return
        self._waiter = asyncio.get_running_loop().create_future()
        if or_done is not None:
            or_done.add_done_callback(self._ring)
        try:
            await self._waiter
        finally:
            self._waiter = None
            if or_done is not None:
                or_done.remove_done_callback(self._ring)

    def _ring(self, _: object = None) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, StepError) else f"{type(exc).__name__}: {exc}"


def _check_seconds(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
