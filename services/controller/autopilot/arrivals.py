"""The arrival history the forecast learns from: the router's admitted-request counter, read every tick, turned
into counts per bucket of wall-clock time (a router restart, which resets the counter, counts as no arrivals)."""

from __future__ import annotations

import math

import numpy as np

from services.controller.autopilot.forecast import ForecastConfig, forecast_rate, peak_ahead

HISTORY_BUCKETS = 3 * 1440  # three days of minutes
FORECAST_BUCKETS = 60       # how far each fit looks ahead


class ArrivalHistory:
    def __init__(self, config: ForecastConfig | None = None, max_buckets: int = HISTORY_BUCKETS) -> None:
        self.config = config or ForecastConfig()
        self.max_buckets = max_buckets
        self.counts: list[float] = []
        self.first_bucket: int | None = None   # index (unix_s // bucket_s) of counts[0]
        self._last_total: int | None = None
        self._cached: tuple[tuple[int, int], object] | None = None  # ((first bucket, length), forecast)

    def record(self, unix_s: float, total_requests: int) -> None:
        """The router's admitted-requests counter at this moment."""
        bucket = int(unix_s // self.config.bucket_s)
        arrived = 0 if self._last_total is None or total_requests < self._last_total \
            else total_requests - self._last_total
        self._last_total = total_requests
        if self.first_bucket is None:
            self.first_bucket = bucket
        index = bucket - self.first_bucket
        if index >= len(self.counts):
            self.counts.extend([0.0] * (index + 1 - len(self.counts)))
        self.counts[index] += arrived
        if len(self.counts) > self.max_buckets:
            drop = len(self.counts) - self.max_buckets
            del self.counts[:drop]
            self.first_bucket += drop

    def peak_rate_within(self, seconds: float) -> float | None:
        """The highest arrival rate (req/s) forecast over the next `seconds`, from the complete buckets; None while
        the history is shorter than the forecast needs."""
        complete = self.counts[:-1]  # the current bucket is still filling
        if len(complete) < self.config.min_history_buckets:
            return None
        key = (self.first_bucket, len(complete))
        horizon = max(FORECAST_BUCKETS, math.ceil(seconds / self.config.bucket_s))
        if self._cached is None or self._cached[0] != key or len(self._cached[1].rates_per_s) < horizon:
            # Refitted once per completed bucket, not every tick.
            self._cached = (key, forecast_rate(np.asarray(complete, dtype=float), self.config, horizon))
        return peak_ahead(self._cached[1], seconds)
