"""The autopilot's loop: every tick, read the router's load, feed the policy, and in `auto` call the same Reconfigure
an operator would; in `advise` only say what it would do. One owner of the policy's memory (this object).

Modes: `off` (no ticks), `advise` (decide, log, publish the decision and the `reconfig:autopilot_*` metrics,
`reconfigctl autopilot status`), `auto` (and switch). Without a profile it can only wait for `calibrate`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import structlog

from services.controller.autopilot import MODES
from services.controller.autopilot.arrivals import ArrivalHistory
from services.controller.autopilot.calibrate import CalibrationPlan, Progress, calibrate, router_stats
from services.controller.autopilot.intents import Demand, select_layouts
from services.controller.autopilot.observation import Observation, TokenCount, measured_tpot
from services.controller.autopilot.policy import (
    Decision,
    PolicyConfig,
    PolicyState,
    corrected,
    decide,
    learn,
    observe,
    switched,
)
from services.controller.autopilot.profile import Profile
from services.controller.status import OperationState
from services.router.contracts import EngineStats
from services.router.load_window import LoadSnapshot
from services.topology import Topology, candidate_topologies

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class AutopilotConfig:
    mode: str = "off"
    interval_s: float = 1.0
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    profile_path: str = ""            # where the profile is cached (empty: none is read or written)
    switch_deadline_s: float = 0.0    # of the switches it starts (0: the controller's default)

    def __post_init__(self) -> None:
        check_mode(self.mode)
        if self.interval_s <= 0:
            raise ValueError("interval_s must be positive")


def default_layouts(reconfigurer) -> tuple[str, ...]:
    """What a calibration measures by default: the live layout first, then every layout the workers can run (those
    leaving workers in standby too: the "cost" priority of an intent wants them)."""
    live = reconfigurer.state.topology
    others = [str(t) for t in candidate_topologies(reconfigurer.spec.shape, len(reconfigurer.workers)) if t != live]
    return (str(live), *others)


def calibration_plan(request, reconfigurer) -> CalibrationPlan:
    """A CalibrateRequest with the defaults filled in (ValueError / TopologyError on a bad one)."""
    layouts = tuple(request.layouts) or default_layouts(reconfigurer)
    for layout in layouts:
        reconfigurer.target(layout)
    given = {"batch_sizes": tuple(request.batch_sizes), "prompt_tokens": tuple(request.prompt_tokens),
             "output_tokens": request.output_tokens}
    return CalibrationPlan(layouts=layouts, **{name: value for name, value in given.items() if value})


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"autopilot mode {mode!r} is not one of {', '.join(MODES)}")
    return mode


@dataclass(frozen=True, slots=True)
class IntentBounds:
    """What the intent window in force lets the policy do this tick (no intents: everything)."""

    window: str = ""                             # its name
    allowed: tuple[str, ...] | None = None       # the layouts the policy may choose among (None: any)
    rejected: dict[str, str] = field(default_factory=dict)  # why it rules the others out
    tpot_target_s: float | None = None           # its TPOT target (None: none)


@dataclass(frozen=True, slots=True)
class Tick:
    """One decision and what it was made from."""

    at_unix_s: float
    observation: Observation
    decision: Decision
    intent_window: str = ""
    allowed: tuple[str, ...] | None = None
    rejected: dict[str, str] = field(default_factory=dict)
    operation_id: str = ""            # the switch it started (auto)
    outcome: str = ""                 # how that switch ended


class Autopilot:
    """Owns the policy state, the profile, the intents and the arrival history."""

    def __init__(self, reconfigurer, config: AutopilotConfig, profile: Profile | None = None,
                 intents=None, model: str = "", machine: str = "", clock=time.monotonic) -> None:
        self.reconfigurer = reconfigurer
        self.config = config
        self.model, self.machine = model, machine  # what the profile is for
        self.mode = config.mode
        self.profile = profile
        self.intents = intents
        self.clock = clock
        self.history = ArrivalHistory()
        self.state: PolicyState | None = None
        self.last: Tick | None = None
        self._tokens: TokenCount | None = None  # the router's token count at the last tick
        self.num_switches = 0
        self.error = ""                    # why the last tick could not decide
        self.calibrating: str = ""         # what a calibration under way is doing
        self._wake = asyncio.Event()
        self.metrics = None                # AutopilotMetrics, when the controller exports them

    # ---- control ---------------------------------------------------------------------------------------------
    def set_mode(self, mode: str) -> None:
        self.mode = check_mode(mode)
        log.info("autopilot.mode", mode=mode)
        self._wake.set()

    def set_profile(self, profile: Profile) -> None:
        self.profile = profile
        if self.config.profile_path:
            profile.save(Path(self.config.profile_path))
        self._wake.set()

    async def calibrate(self, plan: CalibrationPlan, progress: Progress | None = None) -> Profile:
        """Measure and adopt a new profile (the loop does not act meanwhile: the stack is busy being measured)."""
        def report(what: str, done: float) -> None:
            self.calibrating = f"{what} ({done:.0%})"
            if progress is not None:
                progress(what, done)

        report("starting", 0.0)
        try:
            profile = await calibrate(self.reconfigurer, plan, self.model, self.machine, report)
        finally:
            self.calibrating = ""
        self.set_profile(profile)
        self.state = None  # the calibration switched layouts: dwell and cooldown start over
        return profile

    async def run(self) -> None:
        """Tick until cancelled (an error in one tick is logged and reported, never ends the loop)."""
        while True:
            if self.mode != "off" and not self.calibrating:
                try:
                    await self.tick()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 (the loop must outlive a bad tick)
                    self.error = f"{type(exc).__name__}: {exc}"
                    log.warning("autopilot.tick_failed", error=self.error)
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.interval_s)

    # ---- one tick --------------------------------------------------------------------------------------------
    def observation(self, stats: EngineStats, now: float, measured: tuple[float, float]) -> Observation:
        """What the policy sees this tick; `measured`: measured_tpot's (TPOT, since)."""
        window = stats.window
        context = window.mean_context_tokens or (window.mean_prompt_tokens + window.mean_output_tokens / 2)
        return Observation(
            t=now, running=stats.num_running, waiting=stats.num_waiting, kv_used_blocks=stats.num_kv_blocks_used,
            context=context, arrival_rate=window.arrival_rate, prompt_tokens=window.mean_prompt_tokens,
            output_tokens=window.mean_output_tokens, prompt_tokens_std=window.prompt_tokens_std,
            output_tokens_std=window.output_tokens_std, arrival_dispersion=window.arrival_dispersion,
            ttft_p99_s=window.ttft_p99_s,
            tpot_mean_s=window.tpot_mean_s, forecast_load=self.forecast_load(window),
            measured_tpot_s=measured[0], measured_since_s=measured[1],
        )

    @property
    def live(self) -> Topology:
        return self.reconfigurer.state.topology

    def forecast_load(self, window: LoadSnapshot) -> float | None:
        """Requests in flight predicted by the time a switch started now would end (Little's law on the forecast
        arrival rate), or None without enough history or a profile."""
        if self.profile is None:
            return None
        slowest = max((s.staging_s + s.downtime_s for s in self.profile.switches.values()), default=0.0)
        rate = self.history.peak_rate_within(slowest + self.config.interval_s)
        if rate is None:
            return None
        per_request_s = window.ttft_p50_s + max(window.mean_output_tokens - 1, 0.0) * window.tpot_mean_s
        return rate * per_request_s if per_request_s > 0 else None

    async def tick(self) -> Tick | None:
        """Read, decide, and (auto) act; None when it cannot decide now (frozen router, an operation running)."""
        now = self.clock()
        self.error = ""
        stats = await router_stats(self.reconfigurer)
        self.history.record(time.time(), stats.window.num_requests)
        # Every tick, even one that cannot decide, so that no measurement spans a freeze.
        tokens, self._tokens = self._tokens, TokenCount(now, stats.num_generation_tokens, stats.num_running)
        measured = measured_tpot(tokens, self._tokens)
        if self.profile is None:
            self.error = "no profile: run `reconfigctl calibrate`"
            return None
        if stats.is_frozen or self.reconfigurer.running is not None:
            return None  # an operation is under way: its outcome shows in the next tick
        live = str(self.live)
        partition = self.reconfigurer.state.layer_partition
        if self.state is None or Topology.parse(self.state.layout) != self.live or self.state.partition != partition:
            # First tick, or an operator (or a recovery) changed the layout: its dwell starts now.
            self.state = PolicyState(layout=live, entered_s=now, partition=partition,
                                     last_switch_s=now if self.state else -math.inf,
                                     corrections=self.state.corrections if self.state else ())
        obs = self.observation(stats, now, measured)
        self.state = learn(observe(self.state, obs, self.config.policy), obs, self.profile, self.config.policy)
        bounds = self.intent_bounds(obs, live)
        decision = decide(self.profile, self.state, obs, self.config.policy, bounds.allowed, bounds.tpot_target_s)
        tick = Tick(time.time(), obs, decision, bounds.window, bounds.allowed, bounds.rejected)
        if decision.switches:
            log.info("autopilot.decision", mode=self.mode, live=live, target=decision.target, reason=decision.reason,
                     load=obs.load)
            if self.mode == "auto":
                tick = await self._switch(tick)
        self.last = tick
        if self.metrics is not None:
            self.metrics.observe(tick)
        return tick

    def intent_bounds(self, obs: Observation, live: str) -> IntentBounds:
        """The intent window now, the layouts it allows at this load, why it rules the others out, and its TPOT
        target."""
        if self.intents is None:
            return IntentBounds()
        demand = Demand(load=float(max(obs.load, obs.forecast_load or 0.0)), context=obs.context,
                        prompt_tokens=obs.prompt_tokens, arrival_rate=obs.arrival_rate)
        profile = corrected(self.profile, self.state) if self.state is not None else self.profile  # as decide sees it
        selection = select_layouts(self.intents, profile, datetime.now(), demand, live)
        # Latency and throughput: the policy picks by TPOT among the layouts that meet the window; cost: the
        # cheapest that meets it (or misses least) is the only one allowed. When none meets it (latency,
        # throughput), the policy's own rules choose among the intent's layouts within the switch budget: moving
        # to the one that misses least by a few per cent of predicted TPOT gains nothing, and the switch costs.
        if selection.priority == "cost":
            allowed = selection.allowed[:1]
        else:
            allowed = selection.allowed if selection.is_met else selection.within_budget
        return IntentBounds(selection.window, tuple(allowed), dict(selection.rejected), selection.tpot_target_s)

    async def _switch(self, tick: Tick) -> Tick:
        target = tick.decision.target
        operation_id = f"autopilot-{uuid.uuid4().hex[:10]}"
        try:
            op = await self.reconfigurer.reconfigure(target, operation_id=operation_id,
                                                     deadline_s=self.config.switch_deadline_s,
                                                     layer_partition=tick.decision.layer_partition or ())
            outcome = op.state.name if op.state is OperationState.SUCCEEDED else f"{op.state.name}: {op.error}"
        except Exception as exc:  # noqa: BLE001 (OperationBusy, a refused target: reported, the loop goes on)
            outcome = f"not started: {exc}"
        now = self.clock()
        if Topology.parse(target) == self.live and self.reconfigurer.state.layer_partition == \
                (tick.decision.layer_partition or None):
            self.num_switches += 1
        # A failed switch also starts the cooldown.
        self.state = switched(self.state, str(self.live), now, self.reconfigurer.state.layer_partition)
        log.info("autopilot.switched", operation_id=operation_id, target=target, outcome=outcome)
        return dataclasses.replace(tick, operation_id=operation_id, outcome=outcome)
