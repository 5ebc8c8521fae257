"""What the autopilot's policy sees at one tick: the router's load and lengths, and the TPOT it measured."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Observation:
    """What the router reports at one tick."""

    t: float                          # seconds on the caller's clock
    running: int                      # requests holding KV (prefilling or decoding)
    waiting: int                      # admitted, waiting for blocks or a batch slot
    kv_used_blocks: int               # blocks in use (the fullest pool in EP layouts)
    context: float                    # mean tokens a running request attends over (prompt + half its output)
    arrival_rate: float = 0.0         # requests/s over the router's window
    prompt_tokens: float = 0.0        # mean prompt of the requests admitted in the window
    output_tokens: float = 0.0        # mean output of the requests finished in the window (0: none finished yet)
    prompt_tokens_std: float = 0.0    # their spreads (population standard deviations)
    output_tokens_std: float = 0.0
    arrival_dispersion: float = 1.0   # variance / mean of the arrival counts (1: at random; more: clustered)
    ttft_p99_s: float = 0.0
    tpot_mean_s: float = 0.0
    forecast_load: float | None = None  # requests in flight predicted by the time a switch started now would end
    # Seconds per token each running request got since `measured_since_s` (the previous tick), from the router's
    # count of generated tokens (0: not measured).
    measured_tpot_s: float = 0.0
    measured_since_s: float = -math.inf

    @property
    def load(self) -> int:
        return self.running + self.waiting


@dataclass(frozen=True, slots=True)
class TokenCount:
    """The router's count of generated tokens at one tick, and the requests running then."""

    t: float
    generated: int
    running: int


def measured_tpot(previous: TokenCount | None, now: TokenCount) -> tuple[float, float]:
    """(Seconds per token each running request got between two ticks, when the first was): the tokens generated
    meanwhile shared among the requests running (their mean over the two ticks). (0, ...) when nothing ran or the
    count went back (a restarted router)."""
    if previous is None:
        return 0.0, -math.inf
    made, running = now.generated - previous.generated, (previous.running + now.running) / 2
    if made <= 0 or running < 1 or now.t <= previous.t:
        return 0.0, previous.t
    return running * (now.t - previous.t) / made, previous.t
