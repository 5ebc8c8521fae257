"""The router's recent load: arrivals, lengths and the latencies requests saw over a sliding window, for the
controller's autopilot (RouterStats.window) — what /metrics' histograms cannot give: a p99 of the last minute."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

DEFAULT_WINDOW_S = 60.0
DISPERSION_BIN_S = 2.0  # arrivals are counted in bins this long for their index of dispersion


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """The last `window_s` seconds (all zero when nothing happened in them)."""

    window_s: float = DEFAULT_WINDOW_S
    arrival_rate: float = 0.0          # requests admitted per second
    mean_prompt_tokens: float = 0.0    # of those admitted
    mean_output_tokens: float = 0.0    # of those finished
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    tpot_mean_s: float = 0.0           # per finished request with two tokens or more, then averaged
    tpot_p99_s: float = 0.0
    num_finished: int = 0
    mean_context_tokens: float = 0.0   # of the requests running now: prompt + generated so far
    num_requests: int = 0              # admitted since start (the forecast's history, by difference)
    prompt_tokens_std: float = 0.0     # the spread of the prompts admitted (population standard deviation)
    output_tokens_std: float = 0.0     # and of the outputs finished
    # Variance / mean of the arrivals counted in DISPERSION_BIN_S bins over the window: 1 for arrivals at random
    # (Poisson), more when they come in clusters (the Azure conversation trace's burst: 1.3), 1 when none came.
    arrival_dispersion: float = 1.0


def _quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (0 for none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def dispersion(times: list[float], start: float, end: float, bin_s: float = DISPERSION_BIN_S) -> float:
    """Index of dispersion (variance / mean) of the counts of `times` in the bins of [start, end) (1.0 when there
    are fewer than two bins or no arrival)."""
    num_bins = int((end - start) // bin_s)
    if num_bins < 2 or not times:
        return 1.0
    counts = [0] * num_bins
    for t in times:
        index = int((t - start) // bin_s)
        if 0 <= index < num_bins:
            counts[index] += 1
    mean = sum(counts) / num_bins
    return _pvariance(counts) / mean if mean > 0 else 1.0


def _pvariance(values: list[float]) -> float:
    """Population variance in floats, two passes (statistics.pvariance is exact, in fractions: milliseconds for a
    window's samples, on the engine's loop)."""
    mean = sum(values) / len(values)
    return sum((v - mean) * (v - mean) for v in values) / len(values)


def _std(values: list[float]) -> float:
    """Population standard deviation (0 for fewer than two values)."""
    return math.sqrt(_pvariance(values)) if len(values) > 1 else 0.0


class LoadWindow:
    """Owned by the engine (one event loop: no locks). `admitted` when a request enters, `finished` when it ends."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self.num_requests = 0
        self._arrivals: deque[tuple[float, int]] = deque()                  # (t, prompt tokens)
        self._finished: deque[tuple[float, float, float, int]] = deque()   # (t, ttft, tpot (nan: one token), tokens)

    def admitted(self, now: float, prompt_tokens: int) -> None:
        self.num_requests += 1
        self._arrivals.append((now, prompt_tokens))
        self._trim(now)

    def finished(self, now: float, ttft_s: float | None, tpot_s: float | None, output_tokens: int) -> None:
        """A request ended; ttft None: it produced no token (aborted or failed before): not a latency sample."""
        if ttft_s is not None:
            self._finished.append((now, ttft_s, math.nan if tpot_s is None else tpot_s, output_tokens))
        self._trim(now)

    def _trim(self, now: float) -> None:
        for queue in (self._arrivals, self._finished):
            while queue and queue[0][0] < now - self.window_s:
                queue.popleft()

    def snapshot(self, now: float, mean_context_tokens: float = 0.0) -> LoadSnapshot:
        self._trim(now)
        ttfts = [f[1] for f in self._finished]
        tpots = [f[2] for f in self._finished if not math.isnan(f[2])]
        return LoadSnapshot(
            window_s=self.window_s,
            arrival_rate=len(self._arrivals) / self.window_s,
            mean_prompt_tokens=sum(a[1] for a in self._arrivals) / len(self._arrivals) if self._arrivals else 0.0,
            mean_output_tokens=sum(f[3] for f in self._finished) / len(self._finished) if self._finished else 0.0,
            ttft_p50_s=_quantile(ttfts, 0.5), ttft_p99_s=_quantile(ttfts, 0.99),
            tpot_mean_s=sum(tpots) / len(tpots) if tpots else 0.0, tpot_p99_s=_quantile(tpots, 0.99),
            num_finished=len(self._finished), mean_context_tokens=mean_context_tokens,
            num_requests=self.num_requests,
            prompt_tokens_std=_std([a[1] for a in self._arrivals]),
            output_tokens_std=_std([f[3] for f in self._finished]),
            arrival_dispersion=dispersion([a[0] for a in self._arrivals], now - self.window_s, now),
        )


class RequestTimer:
    """One request's latencies as its deltas stream out."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.first: float | None = None
        self.last = start
        self.tokens = 0

    def tokens_out(self, now: float, count: int) -> None:
        if count <= 0:
            return
        if self.first is None:
            self.first = now
        self.last, self.tokens = now, self.tokens + count

    @property
    def ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first (None with fewer than two)."""
        if self.first is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)
