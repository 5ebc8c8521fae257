"""The forecast's history: the router's admitted-requests counter turned into counts per bucket."""

from __future__ import annotations

import pytest

from services.controller.autopilot.arrivals import ArrivalHistory
from services.controller.autopilot.forecast import ForecastConfig


def test_counter_differences_land_in_their_buckets():
    history = ArrivalHistory(ForecastConfig(bucket_s=10.0))
    history.record(100.0, 5)      # the first read only sets the baseline
    history.record(104.0, 9)
    history.record(112.0, 12)
    history.record(135.0, 20)     # an idle bucket in between stays zero
    assert history.counts == [4.0, 3.0, 0.0, 8.0]


def test_a_router_restart_counts_as_no_arrivals():
    history = ArrivalHistory(ForecastConfig(bucket_s=10.0))
    history.record(0.0, 100)
    history.record(5.0, 3)        # the counter went back: a new router
    history.record(8.0, 7)
    assert history.counts == [4.0]


def test_history_is_capped():
    history = ArrivalHistory(ForecastConfig(bucket_s=1.0), max_buckets=5)
    for t in range(20):
        history.record(float(t), t)
    assert len(history.counts) == 5 and history.first_bucket == 15


def test_peak_rate_needs_history_then_follows_it():
    config = ForecastConfig(bucket_s=10.0, min_history_buckets=12)
    history = ArrivalHistory(config)
    total = 0
    history.record(0.0, total)
    assert history.peak_rate_within(60.0) is None
    for bucket in range(1, 40):   # 20 arrivals per 10 s bucket: 2 req/s
        total += 20
        history.record(bucket * 10.0, total)
    assert history.peak_rate_within(60.0) == pytest.approx(2.0, rel=0.1)
    assert history.peak_rate_within(60.0) == history.peak_rate_within(60.0)  # cached between buckets
