"""The arrival forecast: the model chosen by history, a daily peak found ahead, no surprises on odd input."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.controller.autopilot.forecast import (
    MODELS, Forecast, ForecastConfig, bucket_arrivals, forecast_rate, peak_ahead,
)

# A compressed "day": 144 buckets of 10 minutes.
DAY = ForecastConfig(bucket_s=600.0, season_buckets=144)
MEAN_COUNT, AMPLITUDE, PEAK_BUCKET = 60.0, 45.0, 100  # arrivals per bucket; the daily peak at 16:40


def _daily_counts(num_days: int) -> np.ndarray:
    """Expected arrivals per bucket: a sinusoid over the day, highest at PEAK_BUCKET."""
    phase = 2 * np.pi * (np.arange(num_days * DAY.season_buckets) - PEAK_BUCKET) / DAY.season_buckets
    return MEAN_COUNT + AMPLITUDE * np.cos(phase)


def _hourly(rates: np.ndarray) -> np.ndarray:
    return rates.reshape(-1, 6).mean(axis=1)  # [24] mean rate per hour of the day


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seasonal_model_finds_tomorrows_peak_and_beats_the_last_value(seed):
    expected = _daily_counts(4)  # three days of history, the fourth to predict
    history = np.random.default_rng(seed).poisson(expected[:3 * 144]).astype(float)
    truth = expected[3 * 144:] / DAY.bucket_s

    forecast = forecast_rate(history, DAY, horizon_buckets=144)

    assert forecast.model == "seasonal"
    assert forecast.rates_per_s.shape == (144,)
    # The peak hour within one hour, its mean rate within 10% (single buckets carry the noise of 3 samples).
    predicted_hours, true_hours = _hourly(forecast.rates_per_s), _hourly(truth)
    assert abs(int(np.argmax(predicted_hours)) - int(np.argmax(true_hours))) <= 1
    assert predicted_hours.max() == pytest.approx(true_hours.max(), rel=0.1)
    mae = np.abs(forecast.rates_per_s - truth).mean()
    naive_mae = np.abs(history[-1] / DAY.bucket_s - truth).mean()
    assert mae < naive_mae / 3


def test_short_history_falls_back_to_trend_then_mean():
    rng = np.random.default_rng(0)
    assert forecast_rate(rng.poisson(30, 5), DAY, 10).model == "mean"
    assert forecast_rate(rng.poisson(30, 40), DAY, 10).model == "trend"  # under two seasons
    assert forecast_rate([], DAY, 3).rates_per_s.tolist() == [0.0, 0.0, 0.0]
    assert forecast_rate([12.0], ForecastConfig(bucket_s=60.0), 2).rates_per_s.tolist() == [0.2, 0.2]


def test_trend_follows_a_ramp():
    ramp = np.arange(10.0, 70.0, 2.0)  # 30 buckets, +2 arrivals per bucket
    forecast = forecast_rate(ramp, ForecastConfig(bucket_s=1.0), 5)
    assert forecast.model == "trend"
    assert forecast.rates_per_s[0] > ramp[-1]
    assert np.all(np.diff(forecast.rates_per_s) > 0)


@pytest.mark.parametrize("num_buckets", [1, 20, 400])
def test_constant_series_forecast_the_constant(num_buckets):
    config = ForecastConfig(bucket_s=60.0, season_buckets=144)
    assert forecast_rate(np.zeros(num_buckets), config, 4).rates_per_s.tolist() == [0.0] * 4
    constant = forecast_rate(np.full(num_buckets, 30.0), config, 4)
    assert constant.rates_per_s.tolist() == pytest.approx([0.5] * 4)


def test_bad_values_are_read_as_no_arrivals_and_warnings_stay_local():
    filters = list(warnings.filters)
    forecast = forecast_rate([np.nan, -3.0, np.inf, 0.0] * 10 + [4.0], DAY, 6)
    assert np.all(np.isfinite(forecast.rates_per_s)) and np.all(forecast.rates_per_s >= 0)
    assert warnings.filters == filters


def test_peak_ahead_reads_the_buckets_a_switch_would_overlap():
    forecast = Forecast("mean", np.array([1.0, 5.0, 2.0, 9.0]), bucket_s=10.0)
    assert peak_ahead(forecast, 0.0) == 1.0  # the current bucket is always read
    assert peak_ahead(forecast, 10.0) == 1.0
    assert peak_ahead(forecast, 10.5) == 5.0  # a bucket that starts inside the window counts whole
    assert peak_ahead(forecast, 30.0) == 5.0
    assert peak_ahead(forecast, 30.1) == 9.0
    assert peak_ahead(forecast, 1e6) == 9.0  # past the horizon: all of it
    assert peak_ahead(Forecast("mean", np.zeros(0), 10.0), 60.0) == 0.0


def test_bucket_arrivals_counts_whole_buckets_on_a_clock_from_zero():
    arrivals = [-1.0, 0.0, 0.5, 1.0, 2.9, 3.2, np.nan]
    assert bucket_arrivals(arrivals, 1.0).tolist() == [2.0, 1.0, 1.0]  # [3, 3.2) is partial: dropped
    assert bucket_arrivals(arrivals, 1.0, end_s=5.0).tolist() == [2.0, 1.0, 1.0, 1.0, 0.0]
    assert bucket_arrivals([5.0], 2.0, end_s=6.0).tolist() == [0.0, 0.0, 1.0]  # starts at 0, not at 5
    assert bucket_arrivals([], 1.0).tolist() == []
    with pytest.raises(ValueError):
        bucket_arrivals([1.0], 0.0)


counts = st.one_of(
    st.lists(st.integers(0, 10**6).map(float), max_size=120),
    st.lists(st.floats(0.0, 1e9, allow_nan=False), max_size=120),
)


@settings(max_examples=60, deadline=None)
@given(counts, st.integers(0, 48), st.sampled_from([1.0, 10.0, 60.0]))
def test_forecast_is_finite_non_negative_and_as_long_as_asked(history, horizon, bucket_s):
    config = ForecastConfig(bucket_s=bucket_s, season_buckets=24)  # 48 buckets reach the seasonal model
    forecast = forecast_rate(history, config, horizon)
    assert forecast.model in MODELS
    assert forecast.rates_per_s.shape == (horizon,)
    assert np.all(np.isfinite(forecast.rates_per_s)) and np.all(forecast.rates_per_s >= 0)
