"""The engine's side of a layout switch, driven by the controller's admin RPCs (services.router.grpc_server):
Freeze with its lease, the KV pre-copy rounds while serving, Rebind (a new KV capacity or number of pools, the new
layout's workers), Resume, and the switch's report. The step loop only asks it whether the router is held.

The scheduler's side of the same switch (its requests' blocks in the new pools) is services.router.kv_layout; the
workers' (staging, the KV migration itself) is the controller's to drive (docs/switching.md).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Protocol

import structlog

from services.router.contracts import SwitchReport, SwitchTotals
from services.router.dp_blocks import BlockMaps, plan_placements
from services.router.driver import Driver
from services.router.precopy import KVPrecopy, PoolPrecopy, PrecopyRound

if TYPE_CHECKING:
    from services.router.scheduler import Scheduler


class _Pulls(Protocol):
    async def wait_no_pulls(self) -> None: ...


class SwitchHost(Protocol):
    """What SwitchOps uses of the engine that owns it (services.router.engine.Engine)."""

    scheduler: Scheduler
    driver: Driver
    instance_moves: _Pulls  # services.router.instance_moves.InstanceMoves

    @property
    def has_steps_in_flight(self) -> bool: ...
    async def wait_idle(self, timeout_s: float) -> None: ...
    def bind_driver(self, driver: Driver) -> None: ...
    def cancel_expert_commit(self) -> None: ...
    def resume(self) -> None: ...

log = structlog.get_logger(__name__)


class SwitchOps:
    """Freeze (lease), pre-copy, rebind and record_switch for one engine; `engine.freeze()` etc. delegate here."""

    def __init__(self, engine: SwitchHost) -> None:
        self.engine = engine
        self.num_freezes = 0  # a switch (even rolled back) may give the workers new pools: moves out copy again
        self.switches = SwitchTotals()  # layout switches the controller reported (record_switch)
        self.precopy: KVPrecopy | PoolPrecopy | None = None  # the switch's KV pre-copy (precopy_blocks)
        # The controller's Freeze, apart from the scheduler's frozen flag, which a stall sets too: a stall
        # that times out must not unfreeze a router the controller holds.
        self.is_held = False
        self._frozen_at = 0.0  # monotonic: the controller's freeze began
        self._held_at: float | None = None  # ... and a request first waited for it (None: not yet)
        self._lease_timer: asyncio.TimerHandle | None = None
        self.closing: set[asyncio.Future] = set()  # replaced drivers whose streams are ending (_swap_driver)

    # ---- freeze and resume -----------------------------------------------------------------------------------------
    async def freeze(self, timeout_s: float, lease_s: float) -> float:
        """Stop scheduling new steps and wait until the in-flight ones are done. Admission stays open.

        Returns how long the freeze drained before any request waited for it: until the first step in flight came
        back (its requests get no next step), or 0 when a request was ready to run at once. The steps in flight
        deliver their tokens meanwhile: that part of the freeze is no downtime.

        lease_s > 0: unless resume() or another freeze() comes within lease_s, the engine resumes by itself, so
        a controller that dies mid-operation cannot leave the router frozen.
        """
        engine = self.engine
        if not self.is_held:  # a renewal of the lease keeps the first freeze's times
            self._frozen_at = time.monotonic()
            waits = not engine.has_steps_in_flight or engine.scheduler.has_unscheduled()
            self._held_at = self._frozen_at if waits else None
        self.is_held = True
        self.num_freezes += 1
        engine.scheduler.freeze()
        engine.cancel_expert_commit()  # EPLB's commit step will not go out: that rebalance aborts
        self.cancel_lease()
        if lease_s > 0:
            self._lease_timer = asyncio.get_running_loop().call_later(lease_s, self._lease_expired, lease_s)
        await engine.wait_idle(timeout_s)
        await asyncio.wait_for(engine.instance_moves.wait_no_pulls(), timeout_s)  # no worker writes a block it moves
        if self._held_at is None:  # idle: every step came back (the loop notes the first)
            self._held_at = time.monotonic()
        return self._held_at - self._frozen_at

    def step_returned(self) -> None:
        """A step came back: frozen, its requests get no next one, so a request waits from now."""
        if self.is_held and self._held_at is None:
            self._held_at = time.monotonic()

    def release(self) -> None:
        """The controller's hold ends (Resume, or its lease ran out)."""
        self.cancel_lease()
        self.is_held = False

    def _lease_expired(self, lease_s: float) -> None:
        self._lease_timer = None
        log.warning("engine.freeze_lease_expired", lease_s=lease_s)
        self.engine.resume()

    def cancel_lease(self) -> None:
        if self._lease_timer is not None:
            self._lease_timer.cancel()
            self._lease_timer = None

    # ---- rebind ----------------------------------------------------------------------------------------------------
    async def rebind(self, num_kv_blocks: int, worker_addresses: tuple[str, ...] | None, drop_kv: bool,
                     dp_size: int, worker_infos: list | None, precopy_operation_id: str) -> BlockMaps | None:
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
        engine, kv_layout = self.engine, self.engine.scheduler.kv_layout
        if worker_addresses is not None:
            if engine.has_steps_in_flight:
                raise RuntimeError("rebind with steps in flight: freeze first")
            await self._swap_driver(worker_addresses, worker_infos)
            kv_layout.commit_partition()
        maps = None
        blocks = engine.scheduler.block_manager
        if dp_size and kv_layout.restore_partition() and dp_size == engine.scheduler.block_manager.num_ranks:
            log.info("engine.pools_restored", num_ranks=dp_size)
            kv_layout.rebind(num_kv_blocks)
        elif dp_size and (dp_size > 1 or blocks.num_ranks > 1):
            precopy = self._end_precopy(precopy_operation_id, PoolPrecopy)
            reserved = precopy.reservations(engine.scheduler.running, blocks) if precopy is not None else None
            maps, preempted = kv_layout.repartition(dp_size, num_kv_blocks, reserved)
            log.info("engine.pools_repartitioned", num_ranks=dp_size, num_blocks=num_kv_blocks,
                     moved=sum(len(src) for src, _ in maps.values()), preempted=len(preempted))
        else:
            kv_layout.rebind(num_kv_blocks)
        if drop_kv:
            preempted = kv_layout.preempt_all()
            log.info("engine.kv_dropped", num_preempted=len(preempted))
        return maps

    async def _swap_driver(self, worker_addresses: tuple[str, ...], infos: list | None = None) -> None:
        """A driver of the new layout's workers; the streams of workers that stay active carry on (no reconnect),
        and the old driver's other streams end in the background, off the cutover's path."""
        engine = self.engine
        driver = Driver(list(worker_addresses), engine.driver.step_timeout_s, engine.driver.token)
        try:
            # First: an unreachable address leaves the old driver in place.
            await driver.connect(previous=engine.driver, infos=infos)
            if not engine.scheduler.is_frozen:  # the freeze's lease ran out while connecting
                raise RuntimeError("the router was resumed during the rebind: freeze first")
        except BaseException:
            await driver.close(keep=engine.driver.streams)
            raise
        old = engine.driver
        engine.bind_driver(driver)
        closing = asyncio.ensure_future(self._close_driver(old, keep=driver.streams))
        self.closing.add(closing)
        closing.add_done_callback(self.closing.discard)

    @staticmethod
    async def _close_driver(driver: Driver, keep) -> None:
        try:
            await driver.close(keep=keep)
        except Exception as exc:  # noqa: BLE001 (the old streams may be broken: a worker died)
            log.warning("engine.old_driver_close_failed", error=str(exc))

    def plan_rebind(self, num_kv_blocks: int, dp_size: int = 1) -> list[tuple[str, int, int, int]]:
        """What rebind(num_kv_blocks, dp_size=dp_size) would do to the running requests now, changing nothing
        (dp.plan_placements)."""
        scheduler = self.engine.scheduler
        return plan_placements(scheduler.block_manager, scheduler.running, num_kv_blocks, dp_size)

    # ---- KV pre-copy -----------------------------------------------------------------------------------------------
    def precopy_blocks(self, operation_id: str, num_kv_blocks: int, num_kv_pools: int = 1) -> PrecopyRound:
        """A KV pre-copy round of switch `operation_id` (serving goes on) into a target of `num_kv_pools` pools of
        `num_kv_blocks` blocks: the full blocks of running requests not handed out before in this operation, and
        their partly filled ones to warm, as block maps. One pool on both sides: blocks keep their ids (those at or
        above the target's capacity are left to the freeze); else each request gets a pool of the target and ids
        there, reserved until the freeze (PoolPrecopy). A new operation id starts afresh."""
        scheduler = self.engine.scheduler
        blocks = scheduler.block_manager
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
            maps, warm = precopy.next_round(scheduler.running, blocks)
        else:
            ids = precopy.next_round(scheduler.running, blocks.block_size)
            warm_ids = precopy.warm(scheduler.running, blocks.block_size)
            maps = {(0, 0): (ids, list(ids))} if ids else {}
            warm = {(0, 0): (warm_ids, list(warm_ids))} if warm_ids else {}
        return PrecopyRound(maps, warm, precopy.num_copied, blocks.num_used)

    def kv_to_move(self, precopy_operation_id: str = "") -> list[int]:
        """Frozen, one KV pool: the used block ids a switch's KV migration must copy now: all of them, or with the
        operation whose rounds pre-copied the rest, only the delta. The pre-copy record ends here."""
        scheduler = self.engine.scheduler
        used = scheduler.block_manager.used_block_ids()
        precopy = self._end_precopy(precopy_operation_id, KVPrecopy)
        return used if precopy is None else precopy.delta(scheduler.running, used)

    def _end_precopy(self, operation_id: str, kind: type) -> KVPrecopy | PoolPrecopy | None:
        """The record of the pre-copy `operation_id` ("": none ran), which ends here (also when it is not found:
        ValueError, the switch gives up on it)."""
        precopy, self.precopy = self.precopy, None
        if not operation_id:
            return None
        if not isinstance(precopy, kind) or precopy.operation_id != operation_id:
            raise ValueError(f"no KV pre-copy of operation {operation_id!r} ran here")
        return precopy

    # ---- the report ------------------------------------------------------------------------------------------------
    def record_switch(self, report: SwitchReport) -> None:
        """Count a finished layout switch (the controller sends it on the Resume that ends the switch)."""
        self.switches = self.switches.add(report)
        log.info("engine.switch_recorded", operation_id=report.operation_id, state=report.state,
                 topology=f"{report.from_topology}->{report.to_topology}", downtime_s=report.downtime_seconds)

