"""One layout as a switching candidate against the live one (the policy's rules, before cooldown, dwell, KV and
cost): which way it lies from the live layout on the profile's TPOT lines, the load that triggers it, whether that
load is reached now, and its TPOT at that load."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.controller.autopilot.observation import Observation
from services.controller.autopilot.profile import LayoutModel, crossover, crossunder


@dataclass(frozen=True, slots=True)
class Candidate:
    layout: str
    direction: str          # "up", "down", "always" (for TPOT), "capacity" (the live layout's KV holds fewer requests
    #                         than are in flight) or "kv" (it is short of the blocks or of what the arrivals keep)
    threshold: float        # the load that triggers it (inf: never)
    wanted: bool
    tpot_s: float


def candidate(live: LayoutModel, other: LayoutModel, obs: Observation, mean_load: float, up_load: float,
              hysteresis: float, margin: float) -> Candidate:
    """`other` by the TPOT lines: "up" above the crossover (at `up_load`), "down" below hysteresis times the
    crossunder (at `mean_load`), or "always" when it is better by `margin` at every load."""
    def faster(load: float) -> bool:  # by the margin, at the load that triggers it (loads count from one request)
        return other.tpot(load, obs.context) <= (1 - margin) * live.effective_tpot(load, obs.context)

    up = crossover(live, other, obs.context, margin)       # other is better by the margin above it
    if up is not None:
        return Candidate(other.layout, "up", up, up_load >= up and up_load > 0 and faster(up_load),
                         other.tpot(up_load, obs.context))
    down = crossunder(live, other, obs.context, margin)    # other is better by the margin below it
    if down is not None:
        low = hysteresis * down
        return Candidate(other.layout, "down", low, mean_load < low and faster(mean_load),
                         other.tpot(mean_load, obs.context))
    better = faster(1)
    return Candidate(other.layout, "always", 0.0 if better else math.inf, better, other.tpot(mean_load, obs.context))


def for_capacity(live: LayoutModel, other: LayoutModel, obs: Observation, up_load: float) -> Candidate | None:
    """When the live layout cannot hold the requests in flight (they wait for KV), a layout that can is wanted
    whatever the TPOT lines say: waiting is worse than a slower token."""
    if live.max_requests(obs.context) >= obs.load or other.max_requests(obs.context) < obs.load:
        return None
    return Candidate(other.layout, "capacity", float(live.max_requests(obs.context)), True,
                     other.tpot(up_load, obs.context))
