"""What the engine does when a step fails (a worker died or errored).

A failed step does not fail its requests when recovery_timeout_s > 0: the engine *stalls* (no new step; admission
stays open) and hands the batch back to the scheduler unadvanced, waiting for the controller to recover the workers
and resume it. If nobody does within recovery_timeout_s, every unfinished request ends with an error, so nothing
waits forever. With no recovery timeout, the failed step's requests end with an error at once.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Protocol

import structlog

from services.router.batch import ScheduledBatch

if TYPE_CHECKING:
    from services.router.driver import Driver
    from services.router.output import OutputStream
    from services.router.scheduler import Scheduler


class _Hold(Protocol):
    is_held: bool  # the controller holds the freeze


class FailureHost(Protocol):
    """What StepFailures uses of the engine that owns it (services.router.engine.Engine)."""

    scheduler: Scheduler
    driver: Driver
    streams: dict[str, OutputStream]
    switch_ops: _Hold  # services.router.switch_ops.SwitchOps

    def wake(self) -> None: ...

log = structlog.get_logger(__name__)


class StepFailures:
    """The engine's stall: its first error, its timer, and the requests a failure ends."""

    def __init__(self, engine: FailureHost, recovery_timeout_s: float) -> None:
        self.engine = engine
        self.recovery_timeout_s = recovery_timeout_s  # 0: a failed step fails its requests at once (no stall)
        self.stalled = ""  # the first error of the current stall; "" while steps can run
        self.num_step_errors = 0
        self._stalled_at = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def on_step_failed(self, batch: ScheduledBatch, error: str) -> None:
        """A step failed: stall until the controller recovers the workers, or, with no recovery timeout, end the
        batch's requests with an error at once."""
        engine = self.engine
        self.num_step_errors += 1
        engine.driver.rows.reset()  # the steps after it may have reached some workers and not others
        log.warning("engine.step_failed", error=error, requests=len(batch.items))
        if self.recovery_timeout_s <= 0:
            self._fail_batch(batch, error)
            return
        engine.scheduler.on_batch_failed(batch)  # unadvanced: the same positions run again after the recovery
        engine.scheduler.freeze()
        if self.stalled:  # a later batch of the same failure: the first error and its timer stand
            return
        self.stalled, self._stalled_at = error, time.monotonic()
        log.error("engine.stalled", error=error, recovery_timeout_s=self.recovery_timeout_s)
        self._timer = asyncio.get_running_loop().call_later(self.recovery_timeout_s, self._recovery_expired)

    def recovered(self) -> None:
        """The controller recovered the workers (a Resume): the stall, if any, ends."""
        if self.stalled:
            log.info("engine.recovered", error=self.stalled, stalled_s=round(time.monotonic() - self._stalled_at, 3))
            self.clear()

    def clear(self) -> None:
        self.stalled = ""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _recovery_expired(self) -> None:
        """Nobody recovered the workers in time: end every unfinished request with an error, then let new
        requests try again (if the workers are still broken, they stall again)."""
        engine = self.engine
        error = (f"the workers failed ({self.stalled}) and were not recovered within "
                 f"{self.recovery_timeout_s:g} s")
        log.error("engine.recovery_timeout", error=self.stalled, recovery_timeout_s=self.recovery_timeout_s,
                  requests=len(engine.streams))
        for request_id, stream in list(engine.streams.items()):
            engine.scheduler.abort(request_id)  # in flight: marked now, freed when its step returns
            stream.finish("error", error=error)
        self.clear()
        if not engine.switch_ops.is_held:
            engine.scheduler.unfreeze()
        engine.wake()

    def end_with_error(self, batch: ScheduledBatch | None, error: str) -> None:
        """A defect applying a step: its requests end with `error` (the loop and the others live on)."""
        engine = self.engine
        for item in batch.items if batch is not None else ():
            engine.scheduler.abort(item.seq.request_id)
            if (stream := engine.streams.get(item.seq.request_id)) is not None:
                stream.finish("error", error=error)

    def _fail_batch(self, batch: ScheduledBatch, error: str) -> None:
        """Without recovery: the batch's requests end with an explicit error instead of hanging."""
        engine = self.engine
        for item in batch.items:
            engine.scheduler.abort(item.seq.request_id)  # in flight: marked now, freed by on_batch_done
        engine.scheduler.on_batch_done(batch, {})
        for item in batch.items:
            stream = engine.streams.get(item.seq.request_id)
            if stream is not None:
                stream.finish("error", error=error)
