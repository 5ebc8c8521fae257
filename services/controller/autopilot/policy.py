"""The switching policy: a pure function from (profile, what the policy remembers, what the router sees now) to keep
or switch, with the reason.

Moebius switches TP→EP as soon as the requests in flight reach T_h and back once their mean over W steps falls below
T_l = 0.8·T_h, after a cooldown, if the target's KV holds them. Here the thresholds are measured, not set: between
the live layout A and a candidate B, the profile's crossover n* is T_h — the load above which the layout that scales
better has a TPOT at least `min_gain` (10 %) lower: the profile is a fit of noisy samples, and two layouts within a
few per cent of each other are not worth a switch — and for a layout better at low load, hysteresis times the load
below which it is that much better is T_l. The rules, in order:
- a target must hold the KV blocks in use now (plus headroom) and the requests in flight, and the KV the arrivals
  would keep in flight there (`kv_demand`: at the arrival rate now each request stays its prefill plus its output
  at the target's TPOT; requests that arrive at random and stay independently are in flight Poisson(rate x stay)
  many at a time, each holding its length, so the KV in flight is a compound Poisson sum whose `kv_quantile` (p99)
  the target must hold, from the mean and spread of the lengths, and wider when the arrivals come in clusters
  (the router's index of dispersion of their counts)), at the highest arrival rate of the last
  `horizon_s` (the horizon a switch's gain is counted over: a burst that just ended is what the target must be able
  to take again within it; bench/autopilot.py's switch into tp1pp1 as a burst died down, with a cluster of arrivals
  15 s later, is why). A pool sized to the load of the moment fills at the next cluster of arrivals (they queue
  for KV, and their TTFT shows it): never switch into a shortage, now or at the next cluster;
- toward the layout that is better at higher load ("up"): as soon as the load now, or the forecast load by the time
  a switch would finish, reaches T_h; only the cooldown since the last switch applies;
- toward the layout that is better at lower load ("down"): when the mean load over the window falls below T_l, and
  only after the minimum dwell in the live layout as well as the cooldown (asymmetric: a surge is met at once, a
  lull must last);
- a layout better at every load is taken when the cooldown and dwell allow;
- when the live layout's KV cannot hold the requests in flight (they queue), any layout that can is wanted;
- when the live layout's KV is short (by the first rule: it does not hold the blocks in use plus headroom, or the
  KV the arrivals would keep in flight at the horizon's highest rate), a layout that is not short is wanted (the
  lowest TPOT of them), after the cooldown but without the dwell: requests that queue for KV miss their TTFT,
  whatever the TPOT. The same check on both sides, so a layout left for a shortage is not gone back to while it
  lasts;
- and only when the gain over the horizon (the share of each request's time saved, times the horizon) exceeds what
  the switch costs each request in flight (its measured freeze, plus the slower serving while staging).
Rollout mode is Moebius's: T_l = T_h and a window of one.

With a TPOT target (the SLO intent's window, `tpot_target_s`), a faster token is worth a switch only while the
live layout's TPOT threatens the target (above `slo_guard` of it at the load that triggers the switch): once every
request meets it, a switch for TPOT gains no attainment and can lose some (bench/autopilot.py's auto left a roomy
layout mid-burst for one 20 % faster at a fifth of the target, and its smaller KV queued the next cluster of long
prompts). Switches for KV still apply.

The profile is measured once, on a quiet stack; serving is not that stack (prefills between the decodes, a busier
machine), and the layouts do not drift alike. So the policy also learns while serving (`learn`): each tick compares
the TPOT the live layout delivered since the last tick (the router's token count) with what its profile line
predicts for the requests running, and keeps a per-layout correction (a moving geometric mean of measured ÷
predicted). Every TPOT above is the profile's times its layout's correction; a layout not served since has the
geometric mean of the corrections learned so far (the machine is that much slower than calibrated), so one slow
layout is left for one the profile ranks better, and a layout that disappoints there is not gone back to. Such an
assumed layout must promise `explore_gain` (10 %) more than `min_gain`: its number is a guess until it has served.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, replace

from services.controller.autopilot.candidates import Candidate, candidate, for_capacity
from services.controller.autopilot.demand import kv_shortage
from services.controller.autopilot.observation import Observation
from services.controller.autopilot.profile import LayoutModel, Profile

STAGING_SLOWDOWN = 0.1  # serving is about this much slower while the target stages beside it (the blog's bound)


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    hysteresis: float = 0.8     # T_l = hysteresis·T_h
    window: int = 8             # observations averaged for a "down" switch (W)
    cooldown_s: float = 5.0     # between two switches
    min_dwell_s: float = 30.0   # in a layout before a "down" switch
    horizon_s: float = 60.0     # how long the gain of a switch is counted
    kv_headroom: float = 0.1    # a target holds the blocks in use plus this share
    kv_quantile: float = 0.99   # and this quantile of the KV the arrivals keep in flight there (0: not checked)
    min_gain: float = 0.1       # a target's predicted TPOT must be at least this share lower (the profile is noisy)
    rollout: bool = False       # Moebius's rollout mode: T_l = T_h, W = 1
    learn: float = 0.2          # weight of each tick's measured/predicted TPOT in a layout's correction (0: none)
    explore_gain: float = 0.1   # more gain a layout not served yet must promise, once others' corrections are known
    settle_s: float = 2.0       # a measurement must start this long after a switch (the cutover, the first steps)
    slo_guard: float = 0.8      # with a TPOT target: a switch for TPOT only once the live TPOT passes this share of it

    def __post_init__(self) -> None:
        if not 0 < self.hysteresis <= 1:
            raise ValueError("hysteresis must be in (0, 1]")
        if self.window < 1 or self.cooldown_s < 0 or self.min_dwell_s < 0 or self.horizon_s <= 0:
            raise ValueError("window >= 1, cooldown_s >= 0, min_dwell_s >= 0 and horizon_s > 0")
        if self.kv_headroom < 0 or not 0 <= self.min_gain < 1 or not 0 <= self.kv_quantile < 1:
            raise ValueError("kv_headroom must be >= 0, min_gain and kv_quantile in [0, 1)")
        if not 0 <= self.learn <= 1 or self.settle_s < 0 or not 0 <= self.min_gain + self.explore_gain < 1:
            raise ValueError("learn must be in [0, 1], settle_s >= 0 and min_gain + explore_gain in [0, 1)")
        if not 0 < self.slo_guard <= 1:
            raise ValueError("slo_guard must be in (0, 1]")

    @property
    def effective_window(self) -> int:
        return 1 if self.rollout else self.window

    @property
    def effective_hysteresis(self) -> float:
        return 1.0 if self.rollout else self.hysteresis


def parse_policy(text: str) -> PolicyConfig:
    """`"cooldown_s=5,min_dwell_s=30,rollout=true"` -> PolicyConfig (ValueError naming a bad key or value)."""
    fields = {f.name: f.type for f in dataclasses.fields(PolicyConfig)}
    values: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            raise ValueError(f"autopilot policy: {item!r} is not KEY=VALUE with KEY one of {', '.join(fields)}")
        raw = raw.strip()
        try:
            if fields[key] == "bool":
                if raw.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(raw)
                values[key] = raw.lower() in ("true", "1")
            else:
                values[key] = int(raw) if fields[key] == "int" else float(raw)
        except ValueError:
            raise ValueError(f"autopilot policy: {key}={raw!r} is not a {fields[key]}") from None
    return PolicyConfig(**values)


@dataclass(frozen=True, slots=True)
class PolicyState:
    """What the policy remembers between ticks (the loop owns it; `observe` and `switched` return new ones)."""

    layout: str
    entered_s: float                  # when the live layout was entered (dwell)
    partition: tuple[int, ...] | None = None  # its layers per stage (None: the even split)
    last_switch_s: float = -math.inf  # when the last switch ended (cooldown)
    loads: tuple[int, ...] = ()       # the last `window` loads, newest last
    arrivals: tuple[tuple[float, float], ...] = ()  # (t, arrival rate) of the ticks of the last horizon_s
    corrections: tuple[tuple[str, float], ...] = ()  # per layout served: measured TPOT / the profile's (learned)

    def peak_arrival_rate(self) -> float:
        """The highest arrival rate of the remembered ticks (0: none)."""
        return max((rate for _, rate in self.arrivals), default=0.0)

    def correction(self, layout: str) -> float:
        """The learned factor of `layout`; for one not served yet, the geometric mean of those learned (1: none)."""
        learned = dict(self.corrections)
        if layout in learned:
            return learned[layout]
        return math.exp(sum(map(math.log, learned.values())) / len(learned)) if learned else 1.0


@dataclass(frozen=True, slots=True)
class Decision:
    action: str                       # "keep" or "switch"
    target: str                       # the layout to switch to (the live one for "keep")
    reason: str
    predicted_tpot_s: dict[str, float] = field(default_factory=dict)  # per candidate, at the signal load
    thresholds: dict[str, float] = field(default_factory=dict)        # per candidate: the load that triggers it
    layer_partition: tuple[int, ...] | None = None  # of the target: layers per stage by measured speed

    @property
    def switches(self) -> bool:
        return self.action == "switch"


def observe(state: PolicyState, obs: Observation, config: PolicyConfig) -> PolicyState:
    """Remember this tick's load (the window of the "down" rule) and arrival rate (the KV check's, over the
    horizon)."""
    arrivals = tuple(a for a in state.arrivals if a[0] >= obs.t - config.horizon_s) + ((obs.t, obs.arrival_rate),)
    return replace(state, loads=(state.loads + (obs.load,))[-config.effective_window:], arrivals=arrivals)


def switched(state: PolicyState, target: str, now: float, partition: tuple[int, ...] | None = None) -> PolicyState:
    """The live layout changed (by the policy or an operator): dwell and cooldown start now; what was learned stays."""
    return PolicyState(layout=target, entered_s=now, partition=partition, last_switch_s=now, loads=state.loads,
                       arrivals=state.arrivals, corrections=state.corrections)


LEARN_CLAMP = (0.2, 5.0)  # one tick's measured / predicted is taken within these bounds (a stall, a burst of prefills)


def learn(state: PolicyState, obs: Observation, profile: Profile, config: PolicyConfig) -> PolicyState:
    """Fold this tick's measured TPOT of the live layout into its correction (unchanged when nothing was measured,
    the measurement began before the live layout settled, or the layout is not in the profile)."""
    model = profile.layouts.get(state.layout)
    if (config.learn <= 0 or model is None or obs.measured_tpot_s <= 0 or obs.running < 1
            or obs.measured_since_s < state.entered_s + config.settle_s):
        return state
    predicted = model.tpot(obs.running, obs.context)
    if predicted <= 0:
        return state
    ratio = min(max(obs.measured_tpot_s / predicted, LEARN_CLAMP[0]), LEARN_CLAMP[1])
    learned = dict(state.corrections)
    old = learned.get(state.layout, state.correction(state.layout))
    learned[state.layout] = math.exp((1 - config.learn) * math.log(old) + config.learn * math.log(ratio))
    return replace(state, corrections=tuple(sorted(learned.items())))


def corrected(profile: Profile, state: PolicyState) -> Profile:
    """The profile with each layout's TPOT line times its correction (the profile itself when nothing is learned)."""
    if not state.corrections:
        return profile
    layouts = {}
    for name, model in profile.layouts.items():
        factor = state.correction(name)
        layouts[name] = replace(model, step_s=model.step_s * factor, per_request_s=model.per_request_s * factor,
                                per_position_s=model.per_position_s * factor)
    return replace(profile, layouts=layouts)


@dataclass(frozen=True, slots=True)
class _Reading:
    """What `decide` reads off one tick, once: the corrected profile, the live layout, the loads a switch is
    triggered by and judged at, and the KV the live load needs."""

    profile: Profile                  # corrected: the TPOT lines times what serving taught
    state: PolicyState
    obs: Observation
    config: PolicyConfig
    tpot_target_s: float | None
    live: LayoutModel
    names: list[str]                  # the layouts the intent allows (all of the profile's without one)
    mean_load: float                  # over the window: what a "down" switch is triggered by
    up_load: float                    # the load now or the forecast one, the higher: what an "up" switch is
    need_blocks: int                  # the blocks in use plus headroom
    peak_rate: float                  # the KV check's arrival rate: the horizon's highest
    learned: dict[str, float]         # the corrections learned so far, per layout served
    guard_s: float                    # with a TPOT target: a switch for TPOT only above this live TPOT (0: any)
    since_switch: float               # seconds since the last switch ended (cooldown)

    @property
    def live_name(self) -> str:
        return self.state.layout

    def margin(self, name: str) -> float:
        """How much faster `name` must be: a layout whose correction is assumed, not measured, must promise more."""
        return self.config.min_gain + (self.config.explore_gain if self.learned and name not in self.learned else 0.0)

    def signal(self, direction: str) -> float:
        """The load a switch that way is triggered by and judged at."""
        return self.mean_load if direction in ("down", "always") else self.up_load

    def shortage(self, model: LayoutModel) -> str | None:
        """Why `model`'s KV is short (None: it is not), at the horizon's highest arrival rate."""
        return kv_shortage(model, self.obs, self.need_blocks, self.peak_rate, self.config.kv_quantile,
                           self.config.horizon_s)


@dataclass(frozen=True, slots=True)
class _Survey:
    """Every allowed layout weighed against the live one."""

    live_short: str | None            # why the live layout's KV is short (None: it is not)
    tpots: dict[str, float]           # per layout, at the signal load (the live one at the load now)
    thresholds: dict[str, float]      # per candidate: the load that triggers it
    wanted: list[Candidate]           # wanted and not short of KV
    short: list[str]                  # wanted, but short of KV: why
    met: list[str]                    # faster, but the live layout meets the TPOT target


def decide(profile: Profile, state: PolicyState, obs: Observation, config: PolicyConfig,
           allowed: tuple[str, ...] | None = None, tpot_target_s: float | None = None) -> Decision:
    """Keep the live layout or switch to the best wanted candidate, and say why. `state` must already hold `obs`
    (call `observe`, and `learn`, first); TPOTs are the profile's times what serving taught (`corrected`).
    `allowed` and `tpot_target_s`: the layouts the intent's active window allows and its TPOT target."""
    profile = corrected(profile, state)
    if state.layout not in profile.layouts:
        return Decision("keep", state.layout, f"the live layout {state.layout} is not in the profile: calibrate it")
    reading = _read(profile, state, obs, config, allowed, tpot_target_s)
    survey = _survey(reading)
    if allowed is not None and reading.live_name not in reading.names:  # the intent rules the live layout out
        return _leave_for_intent(reading, survey)
    if not survey.wanted:
        return _keep_or_resplit(reading, survey, _why_none_wanted(reading, survey))
    best = min(survey.wanted, key=lambda c: (c.tpot_s, profile.layouts[c.layout].num_workers, c.layout))
    if (held := _hold(reading, survey, best)) is not None:
        return held
    return _weigh(reading, survey, best)


def _read(profile: Profile, state: PolicyState, obs: Observation, config: PolicyConfig,
          allowed: tuple[str, ...] | None, tpot_target_s: float | None) -> _Reading:
    """The measured state the rules read: the loads, the KV needed, the horizon's peak arrival rate."""
    loads = state.loads or (obs.load,)
    return _Reading(
        profile=profile, state=state, obs=obs, config=config, tpot_target_s=tpot_target_s,
        live=profile.layouts[state.layout],
        names=[n for n in (allowed if allowed is not None else tuple(profile.layouts)) if n in profile.layouts],
        mean_load=sum(loads) / len(loads),
        up_load=max(float(obs.load), obs.forecast_load or 0.0),
        need_blocks=math.ceil(obs.kv_used_blocks * (1 + config.kv_headroom)),
        peak_rate=max(obs.arrival_rate, state.peak_arrival_rate()),
        learned=dict(state.corrections),
        guard_s=config.slo_guard * tpot_target_s if tpot_target_s else 0.0,  # 0: no target, every gain counts
        since_switch=obs.t - state.last_switch_s,
    )


def _survey(r: _Reading) -> _Survey:
    """Each allowed layout as a candidate: its TPOT and trigger load; wanted, short of KV, or faster than a live
    layout that already meets the TPOT target. While the live layout is short of KV every other one is wanted."""
    obs, live = r.obs, r.live
    live_short = r.shortage(live)
    tpots = {r.live_name: live.effective_tpot(obs.load, obs.context)}
    thresholds: dict[str, float] = {}
    wanted: list[Candidate] = []
    short: list[str] = []
    met: list[str] = []
    for name in r.names:
        if name == r.live_name:
            continue
        other = r.profile.layouts[name]
        cand = for_capacity(live, other, obs, r.up_load) or \
            candidate(live, other, obs, r.mean_load, r.up_load, r.config.effective_hysteresis, r.margin(name))
        tpots[name], thresholds[name] = cand.tpot_s, cand.threshold
        if live_short is not None and cand.direction != "capacity":
            cand = Candidate(name, "kv", 0.0, True, other.tpot(r.up_load, obs.context))
        elif cand.wanted and cand.direction != "capacity" and \
                live.effective_tpot(r.signal(cand.direction), obs.context) <= r.guard_s:
            met.append(name)
            continue
        if not cand.wanted:
            continue
        if (why := r.shortage(other)) is not None:
            short.append(why)
            continue
        wanted.append(cand)
    return _Survey(live_short, tpots, thresholds, wanted, short, met)


def _keep(r: _Reading, s: _Survey, reason: str) -> Decision:
    return Decision("keep", r.live_name, reason, s.tpots, s.thresholds)


def _keep_or_resplit(r: _Reading, s: _Survey, reason: str) -> Decision:
    """Keep the layout, unless the calibration measured a faster split of its layers than the live one."""
    split = r.profile.layer_partition(r.live_name)
    if split is None or split == r.state.partition or r.since_switch < r.config.cooldown_s \
            or r.obs.t - r.state.entered_s < r.config.min_dwell_s:
        return _keep(r, s, reason)
    return Decision("switch", r.live_name, f"{reason}; split {r.live_name}'s layers by the workers' measured speed: "
                    f"{'/'.join(map(str, split))} per stage", s.tpots, s.thresholds, split)


def _leave_for_intent(r: _Reading, s: _Survey) -> Decision:
    """The intent rules the live layout out: leave it for the allowed layout with the lowest TPOT that holds the
    KV, after the cooldown."""
    fits = [n for n in r.names if r.shortage(r.profile.layouts[n]) is None]
    if not fits:
        return _keep(r, s, f"the live layout {r.live_name} is outside the intent, but no allowed layout holds the "
                           f"{r.need_blocks} KV blocks and {r.obs.load} requests in flight")
    if r.since_switch < r.config.cooldown_s:
        return _keep(r, s, f"the live layout is outside the intent; the cooldown has "
                           f"{r.config.cooldown_s - r.since_switch:.1f} s left")
    target = min(fits, key=lambda n: (s.tpots.get(n, math.inf), r.profile.layouts[n].num_workers, n))
    return Decision("switch", target, f"the live layout {r.live_name} is outside the intent's layouts "
                    f"({', '.join(r.names)}); {target} has the lowest TPOT of them at load {r.obs.load}",
                    s.tpots, s.thresholds, r.profile.layer_partition(target))


def _why_none_wanted(r: _Reading, s: _Survey) -> str:
    """Why no candidate is wanted: none is better, the better ones are short of KV, or the live TPOT meets the
    target (and the live layout's own shortage first)."""
    why = "no candidate is better at this load"
    if s.met:
        why = (f"{', '.join(s.met)} would be faster, but {r.live_name}'s TPOT "
               f"{r.live.effective_tpot(r.up_load, r.obs.context) * 1e3:.1f} ms meets the target "
               f"{r.tpot_target_s * 1e3:.0f} ms (a switch for TPOT above {r.guard_s * 1e3:.0f} ms)")
    if s.short:
        why = ("the layouts that hold the KV are short too: " if s.live_short is not None else
               "the better layouts are short of KV: ") + "; ".join(s.short) + ("; " + why if s.met else "")
    if s.live_short is not None:
        why = f"the live layout is short of KV: {s.live_short}; {why}"
    return f"load {r.obs.load} (mean {r.mean_load:.1f}): {why}"


def _hold(r: _Reading, s: _Survey, best: Candidate) -> Decision | None:
    """Keep while the cooldown runs, and (toward lower load or a layout better at every load) while the live layout
    has not dwelt long enough: a surge is met at once, a lull must last. None: neither holds."""
    if r.since_switch < r.config.cooldown_s:
        return _keep(r, s, f"{best.layout} is better, but the cooldown has "
                           f"{r.config.cooldown_s - r.since_switch:.1f} s left")
    dwell = r.obs.t - r.state.entered_s
    if best.direction in ("down", "always") and dwell < r.config.min_dwell_s:
        return _keep(r, s, f"{best.layout} is better at the mean load {r.mean_load:.1f}, but {r.live_name} must "
                           f"dwell {r.config.min_dwell_s - dwell:.1f} s more")
    return None


def _weigh(r: _Reading, s: _Survey, best: Candidate) -> Decision:
    """Switch to `best` when the gain over the horizon exceeds what the switch costs each request in flight (a
    switch out of a KV shortage has no gain to weigh), and say why."""
    live_tpot = r.live.effective_tpot(r.signal(best.direction), r.obs.context)
    gain_s = r.config.horizon_s * max(0.0, 1.0 - best.tpot_s / live_tpot) if live_tpot > 0 else 0.0
    cost = r.profile.switch_cost(r.live_name, best.layout)
    cost_s = cost.downtime_s + STAGING_SLOWDOWN * cost.staging_s
    if best.direction == "kv":  # what queueing for KV costs is not in the TPOT lines: no gain to weigh
        return Decision("switch", best.layout, f"the live layout is short of KV: {s.live_short}; {best.layout} "
                        f"holds it (TPOT {live_tpot * 1e3:.1f} -> {best.tpot_s * 1e3:.1f} ms)", s.tpots, s.thresholds,
                        r.profile.layer_partition(best.layout))
    if gain_s <= cost_s:
        return _keep_or_resplit(r, s, f"{best.layout} saves {gain_s:.2f} s per request over "
                                      f"{r.config.horizon_s:.0f} s, less than the switch costs ({cost_s:.2f} s)")
    return Decision("switch", best.layout,
                    f"{_trigger(r, best)}: TPOT {live_tpot * 1e3:.1f} -> {best.tpot_s * 1e3:.1f} ms"
                    f"{_factors(r, best)}, gain {gain_s:.2f} s > cost {cost_s:.2f} s", s.tpots, s.thresholds,
                    r.profile.layer_partition(best.layout))


def _trigger(r: _Reading, best: Candidate) -> str:
    """What triggered the switch to `best`, in words."""
    trigger = {"up": f"load {r.up_load:.0f} >= T_h {best.threshold:.1f}",
               "down": f"mean load {r.mean_load:.1f} < T_l {best.threshold:.1f}",
               "always": "better at every load",
               "capacity": f"{r.live_name}'s KV holds {best.threshold:.0f} requests, {r.obs.load} in flight",
               }[best.direction]
    forecast = r.obs.forecast_load
    if forecast is not None and best.direction == "up" and forecast > r.obs.load:
        trigger += f" (forecast {forecast:.0f} in flight by the time the switch ends)"
    return trigger


def _factors(r: _Reading, best: Candidate) -> str:
    """The learned corrections behind the TPOTs compared ("" when nothing is learned yet)."""
    if not r.learned:
        return ""
    assumed = "" if best.layout in r.learned else f" assumed, so {r.margin(best.layout):.0%} faster needed"
    return (f" (measured/profiled: {r.live_name} x{r.state.correction(r.live_name):.2f}, {best.layout} "
            f"x{r.state.correction(best.layout):.2f}{assumed})")
