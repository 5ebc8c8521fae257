"""The router's sliding window of recent load (what the autopilot reads): rates, length means and spreads,
latency quantiles, the window's edge, and the gRPC round trip."""

from __future__ import annotations

import math
import statistics

import pytest

from services.router.wire import window_from_pb, window_to_pb
from services.router.load_window import LoadWindow


def test_the_window_counts_arrivals_lengths_and_latencies():
    window = LoadWindow(window_s=10.0)
    prompts, outputs = [10, 30, 200, 40], [5, 50, 20]
    for t, prompt in enumerate(prompts):
        window.admitted(float(t), prompt)
    for t, output in zip((4.0, 5.0, 6.0), outputs):
        window.finished(t, ttft_s=t / 10, tpot_s=0.05, output_tokens=output)
    window.finished(6.5, ttft_s=None, tpot_s=None, output_tokens=0)  # aborted before a token: no sample
    snap = window.snapshot(7.0, mean_context_tokens=123.0)
    assert snap.arrival_rate == pytest.approx(len(prompts) / 10.0)
    assert snap.mean_prompt_tokens == pytest.approx(statistics.mean(prompts))
    assert snap.prompt_tokens_std == pytest.approx(statistics.pstdev(prompts))
    assert snap.mean_output_tokens == pytest.approx(statistics.mean(outputs))
    assert snap.output_tokens_std == pytest.approx(statistics.pstdev(outputs))
    assert (snap.num_finished, snap.num_requests, snap.mean_context_tokens) == (3, 4, 123.0)
    assert (snap.ttft_p50_s, snap.ttft_p99_s, snap.tpot_mean_s) == pytest.approx((0.5, 0.6, 0.05))
    assert window_from_pb(window_to_pb(snap)) == snap


def test_what_left_the_window_is_forgotten_and_one_value_has_no_spread():
    window = LoadWindow(window_s=10.0)
    window.admitted(0.0, 500)
    window.admitted(9.0, 20)
    window.finished(9.0, ttft_s=0.1, tpot_s=None, output_tokens=1)
    snap = window.snapshot(15.0)
    assert snap.mean_prompt_tokens == 20 and snap.prompt_tokens_std == 0.0 and snap.output_tokens_std == 0.0
    assert snap.num_requests == 2 and math.isclose(snap.arrival_rate, 0.1)
    assert snap.tpot_mean_s == 0.0  # one token: no TPOT sample
    empty = window.snapshot(100.0)
    assert (empty.arrival_rate, empty.mean_prompt_tokens, empty.prompt_tokens_std, empty.num_finished) == (0, 0, 0, 0)


def test_the_arrivals_dispersion_is_one_at_random_more_in_clusters_less_when_even():
    """Counts in 2 s bins over the window: variance / mean."""
    even, clustered = LoadWindow(window_s=60.0), LoadWindow(window_s=60.0)
    for k in range(30):
        even.admitted(1.0 + 2.0 * k, 10)  # one per bin
    for k in range(10):
        clustered.admitted(40.1 + 0.1 * k, 10)  # ten in one bin of thirty
    assert even.snapshot(60.0).arrival_dispersion == 0.0
    mean = 10 / 30
    assert clustered.snapshot(60.0).arrival_dispersion == pytest.approx((100 / 30 - mean ** 2) / mean)
    assert LoadWindow().snapshot(5.0).arrival_dispersion == 1.0  # nothing came: no evidence of clusters
    random = LoadWindow(window_s=600.0)
    import numpy as np

    for t in np.cumsum(np.random.default_rng(0).exponential(1.0, 2000)):
        if t < 600.0:
            random.admitted(float(t), 10)
    assert random.snapshot(600.0).arrival_dispersion == pytest.approx(1.0, abs=0.15)
    assert window_from_pb(window_to_pb(clustered.snapshot(60.0))).arrival_dispersion == pytest.approx(
        clustered.snapshot(60.0).arrival_dispersion)
