"""The KV the arrivals would keep in flight in a layout: a compound Poisson quantile from the router's arrival
rate, the lengths' mean and spread, and how clustered the arrivals come; and the policy's KV check of a layout
(`kv_shortage`: does it hold the blocks in use, the requests in flight and that quantile)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from services.controller.autopilot.observation import Observation
from services.controller.autopilot.profile import LayoutModel, poisson_quantile


@dataclass(frozen=True, slots=True)
class KVDemand:
    """The KV the arrivals would keep in flight in one layout: `tokens` at the policy's quantile, from `requests`
    requests in flight on average, each staying `stay_s` and holding `request_tokens` (mean) when it ends."""

    tokens: int
    requests: float
    stay_s: float
    request_tokens: float


def kv_demand(model: LayoutModel, obs: Observation, quantile: float) -> KVDemand | None:
    """The KV tokens the arrivals would keep in flight in `model`'s layout, at `quantile` (None when not measured:
    no arrivals, nothing finished yet, or `quantile` 0). At the arrival rate now each request stays its prefill
    plus its output at the layout's TPOT for the load now, so requests that arrive at random and stay independently
    are in flight Poisson(m = rate x stay) many at a time, each holding its prompt and output (and half a block
    unfilled, on average). The KV they hold is a compound Poisson sum: mean m·E[L], variance m·E[L²]; its quantile
    is taken as D times the Poisson quantile of mean m·E[L]/D, D = E[L²]/E[L] (the same mean and variance).
    Arrivals that come in clusters (the router's index of dispersion I of their counts, above 1) make the count in
    flight vary I times as much: the variance is then m·(E[L²] + (I - 1)·E[L]²), and D grows to match. With
    lengths as spread as the Azure conversation trace's (prompt std ~ its mean) D is about twice the mean length:
    the mean length alone understates the tail, and a pool that holds the mean request count fills at the next
    cluster of long prompts. Two moments fit the tail within 10% once several requests are in flight
    (tests/controller/autopilot/test_policy.py simulates it); with one or two a single long request makes the tail
    and this understates it (by 10-30% there)."""
    if quantile <= 0 or obs.arrival_rate <= 0 or obs.output_tokens <= 0:
        return None
    stay = model.prefill(obs.prompt_tokens) + max(obs.output_tokens - 1, 0.0) * model.effective_tpot(
        max(obs.load, 1), obs.context)
    requests = obs.arrival_rate * stay
    length = obs.prompt_tokens + obs.output_tokens + model.block_size / 2
    second_moment = obs.prompt_tokens_std ** 2 + obs.output_tokens_std ** 2 + length ** 2
    clustering = max(obs.arrival_dispersion, 1.0) - 1.0  # an underdispersed window is taken as random
    dispersion = (second_moment + clustering * length ** 2) / length
    tokens = math.ceil(dispersion * poisson_quantile(requests * length / dispersion, quantile))
    return KVDemand(tokens, requests, stay, length - model.block_size / 2)


def kv_shortage(model: LayoutModel, obs: Observation, need_blocks: int, peak_rate: float, quantile: float,
                horizon_s: float) -> str | None:
    """Why `model`'s KV is short, or None when it holds `need_blocks` (the blocks in use plus headroom), every
    request in flight, and the KV the arrivals would keep in flight there at `peak_rate` (the highest arrival rate
    of the last `horizon_s`)."""
    if not model.holds(need_blocks) or model.max_requests(obs.context) < obs.load:
        return (f"{model.layout} (KV holds {model.kv_blocks * model.kv_pools} blocks and "
                f"{model.max_requests(obs.context)} requests; {need_blocks} blocks and {obs.load} requests needed)")
    demand = kv_demand(model, replace(obs, arrival_rate=peak_rate), quantile)
    kv_tokens = model.kv_blocks * model.kv_pools * model.block_size
    if demand is None or kv_tokens >= demand.tokens:
        return None
    rate = f"{peak_rate:.2f} arrivals/s"
    if peak_rate > obs.arrival_rate:
        rate += f" (the highest of the last {horizon_s:.0f} s)"
    if obs.arrival_dispersion > 1:
        rate += f", clustered x{obs.arrival_dispersion:.2f},"
    return (f"{model.layout} (KV holds {kv_tokens} tokens; {rate} staying "
            f"{demand.stay_s:.1f} s keep {demand.requests:.1f} requests of {demand.request_tokens:.0f} "
            f"tokens in flight, {demand.tokens} tokens at p{quantile * 100:g})")
