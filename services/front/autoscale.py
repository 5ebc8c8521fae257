"""The front router starts and stops instances by itself (MELL's scaling, `reconfig up --instances N
--max-instances M`): an instance MELL empties goes to standby, and one that stays there `stop_after_s` is stopped
(its processes end; at least `min_instances` stay); when requests wait at the front for room `start_after_s` and no
standby instance is left, another is started (up to `max_instances`). One start or stop at a time.

`decide` is the pure decision; `Autoscaler` feeds it from the engine every `interval_s` and carries it out through
the launcher (services/front/launcher.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import grpc
import structlog

from services.front.launcher import LaunchError, Launches

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class AutoscaleSettings:
    max_instances: int = 0         # 0: the front never starts or stops an instance by itself
    min_instances: int = 1
    start_after_s: float = 2.0     # requests waited for room this long, no standby instance left: start one
    stop_after_s: float = 60.0     # an instance on standby this long (above min_instances): stop it
    interval_s: float = 0.5

    def __post_init__(self) -> None:
        if self.max_instances < 0 or self.min_instances < 1:
            raise ValueError(f"max_instances must be >= 0 and min_instances >= 1, not {self.max_instances} and "
                             f"{self.min_instances}")
        if self.max_instances and self.max_instances < self.min_instances:
            raise ValueError(f"max_instances {self.max_instances} is below min_instances {self.min_instances}")
        if self.start_after_s < 0 or self.stop_after_s < 0 or self.interval_s <= 0:
            raise ValueError("start_after_s and stop_after_s must be >= 0, interval_s > 0")

    @property
    def enabled(self) -> bool:
        return self.max_instances > 0


@dataclass(frozen=True, slots=True)
class ScaleView:
    """What the decision sees."""

    now: float
    num_instances: int                   # served now (in service or not)
    waiting_since: float | None          # requests have waited at the front for room since then (None: none wait)
    standby_since: dict[str, float]      # instance on standby -> since when
    stoppable: frozenset[str]            # those whose processes may be stopped


def decide(view: ScaleView, settings: AutoscaleSettings) -> tuple[str, str] | None:
    """("start", "") / ("stop", name) / None (keep)."""
    if not settings.enabled:
        return None
    if view.waiting_since is not None:
        if (not view.standby_since and view.num_instances < settings.max_instances
                and view.now - view.waiting_since >= settings.start_after_s):
            return "start", ""
        return None  # never stop while requests wait
    if view.num_instances <= settings.min_instances:
        return None
    idle = [(since, name) for name, since in view.standby_since.items()
            if name in view.stoppable and view.now - since >= settings.stop_after_s]
    return ("stop", min(idle)[1]) if idle else None  # the one idle longest


class Autoscaler:
    """Feeds `decide` from the front engine and carries its decisions out (a failure is logged; it tries again
    at the next tick whose view still asks for it)."""

    def __init__(self, engine, launches: Launches, settings: AutoscaleSettings, clock=time.monotonic) -> None:
        self.engine, self.launches, self.settings, self.clock = engine, launches, settings, clock
        self._waiting_since: float | None = None
        self._standby_since: dict[str, float] = {}
        self._task: asyncio.Task | None = None
        self.started = self.stopped = 0

    def view(self) -> ScaleView:
        now = self.clock()
        if self.engine.num_waiting == 0:
            self._waiting_since = None
        elif self._waiting_since is None:
            self._waiting_since = now
        standby = {i.name for i in self.engine.slots.standby()}
        self._standby_since = {name: self._standby_since.get(name, now) for name in standby}
        stoppable = frozenset(name for name in standby if name not in self.launches.keep)
        return ScaleView(now, len(self.engine.instances), self._waiting_since, dict(self._standby_since), stoppable)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="front-autoscale")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while not self.engine.is_draining:  # shutting down: no instance starts or stops any more
            await asyncio.sleep(self.settings.interval_s)  # the decision's pace, not a synchronization
            decision = decide(self.view(), self.settings)
            if decision is not None:
                await self.act(*decision)

    async def act(self, action: str, name: str) -> None:
        from services.front.instance_admin import MoveRefused

        try:
            if action == "start":
                instance = await self.launches.start()
                self.started += 1
                log.info("front.autoscale_started", instance=instance.name, instances=len(self.engine.instances))
            else:
                await self.engine.drain_instance(name)  # on standby: nothing runs there, nothing moves
                await self.launches.stop(name)
                self._standby_since.pop(name, None)
                self.stopped += 1
                log.info("front.autoscale_stopped", instance=name, instances=len(self.engine.instances))
        except (LaunchError, MoveRefused, KeyError, ValueError, grpc.aio.AioRpcError) as exc:
            log.warning("front.autoscale_failed", action=action, instance=name or None, error=str(exc))
            if action == "stop":
                with contextlib.suppress(KeyError):
                    await self.engine.drain_instance(name, drain=False)  # still served: back in service
