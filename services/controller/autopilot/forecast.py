"""Arrival-rate forecast for the autopilot: how many requests per second the next buckets will bring.

A layout switch takes time; one started when a peak arrives lands inside it. The policy asks
`peak_ahead(forecast_rate(history, config, horizon), switch_s)` and switches *before* the peak when the answer is
above what the current layout serves.

The model is Holt-Winters exponential smoothing (statsmodels `ExponentialSmoothing`): point forecasts from a
handful of smoothing parameters, fast enough to refit every bucket (ETSModel adds likelihoods and intervals the
policy does not use; STL needs the same two seasons and adds a second model). Which one depends on history length:

- "seasonal": at least two full seasons (by default two days of minutes, "time of day"): additive seasonal with an
  additive damped trend. Additive, not multiplicative, because arrival counts reach zero (quiet nights, fine
  buckets) and a multiplicative season is undefined there; the damped trend keeps a day's drift from compounding
  over a long horizon. Initial seasonal indices come from the data (`legacy-heuristic`), not from the optimizer:
  estimating 1,440 initial values is ~10x slower and no more accurate on Poisson counts. Each index rests on few
  samples (3 days: 3 per bucket), so single buckets are noisy: the max over a window overshoots by ~5-15%.
- "trend": less than two seasons, at least `min_history_buckets`: Holt's level with an additive damped trend.
- "mean": less history than that, a constant series, or a fit that fails: the mean of what there is.

Rates are clipped to >= 0. The function never raises on odd counts (empty, all zeros, NaN, negative): statsmodels'
convergence warnings are silenced for the fit only, and a failed or non-finite fit falls back to the next simpler
model. History is capped at `max_history_seasons` seasons, which bounds a fit (3 days of minute buckets,
4,320 points) at ~0.05 s.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MODELS = ("seasonal", "trend", "mean")  # from the richest to the fallback of last resort


@dataclass(frozen=True, slots=True)
class ForecastConfig:
    """Bucket width, season length and the history each model needs."""

    bucket_s: float = 60.0
    season_buckets: int = 1440  # one day of minute buckets: time-of-day seasonality
    min_history_buckets: int = 12  # below it a trend fit is noise: forecast the mean
    max_history_seasons: int = 3  # older history is dropped: bounds fit time, seasons drift anyway
    damped_trend: bool = True  # an undamped trend on noisy counts extrapolates without bound

    def __post_init__(self) -> None:
        if not self.bucket_s > 0:
            raise ValueError("bucket_s must be > 0")
        if self.season_buckets < 2:
            raise ValueError("season_buckets must be >= 2")
        if self.min_history_buckets < 4:
            raise ValueError("min_history_buckets must be >= 4: a damped trend fits 5 parameters")
        if self.max_history_seasons < 2:
            raise ValueError("max_history_seasons must be >= 2: the seasonal model needs two seasons")

    @property
    def max_history_buckets(self) -> int:
        return self.max_history_seasons * self.season_buckets


@dataclass(frozen=True, slots=True)
class Forecast:
    """Predicted arrival rate for each of the next buckets, and the model that produced it."""

    model: str  # one of MODELS
    rates_per_s: np.ndarray  # [horizon_buckets] requests/s, finite, >= 0
    bucket_s: float

    @property
    def horizon_s(self) -> float:
        return len(self.rates_per_s) * self.bucket_s


def bucket_arrivals(arrival_s: Sequence[float] | np.ndarray, bucket_s: float,
                    end_s: float | None = None) -> np.ndarray:
    """Arrivals per whole bucket: entry i counts arrival times in [i * bucket_s, (i + 1) * bucket_s).

    Times are seconds on a clock that starts at 0 (as `Workload.arrival_s`), not from the first timestamp, so
    buckets line up with the caller's clock and with time of day when 0 is midnight. Only whole buckets before
    `end_s` (default: the last arrival) are returned: a trailing partial bucket would read as a drop in rate.
    Negative, non-finite and later times are ignored.
    """
    if not bucket_s > 0:
        raise ValueError("bucket_s must be > 0")
    times = np.asarray(arrival_s, dtype=np.float64).ravel()
    times = times[np.isfinite(times) & (times >= 0)]
    if end_s is None:
        end_s = float(times.max()) if len(times) else 0.0
    num_buckets = max(math.floor(end_s / bucket_s + 1e-9), 0)  # 1e-9: 0.3 / 0.1 is 2.9999999999999996
    index = np.floor(times / bucket_s).astype(np.int64)
    index = index[index < num_buckets]
    return np.bincount(index, minlength=num_buckets).astype(np.float64)


def forecast_rate(counts: Sequence[float] | np.ndarray, config: ForecastConfig = ForecastConfig(),
                  horizon_buckets: int = 1) -> Forecast:
    """Forecast the arrival rate (requests/s) for the `horizon_buckets` buckets after `counts`.

    `counts` are arrivals per bucket of `config.bucket_s`, oldest first, as `bucket_arrivals` returns them.
    """
    history = np.asarray(counts, dtype=np.float64).ravel()
    history = np.clip(np.nan_to_num(history, nan=0.0, posinf=0.0, neginf=0.0), 0.0, None)
    history = history[-config.max_history_buckets:]
    horizon = max(int(horizon_buckets), 0)
    for model in _fitted_models(history, config, horizon):
        predicted = _fit(model, history, config, horizon)
        if predicted is not None:
            return _forecast(model, predicted, config)
    return _forecast("mean", np.full(horizon, history.mean() if len(history) else 0.0), config)


def peak_ahead(forecast: Forecast, within_s: float) -> float:
    """The highest predicted rate (requests/s) in the next `within_s` seconds.

    A bucket that starts inside the window counts whole: a peak that begins before a switch finishes is one the
    switch lands in. At least one bucket is read; past the horizon, the whole forecast.
    """
    rates = forecast.rates_per_s
    if len(rates) == 0:
        return 0.0
    num_buckets = min(max(math.ceil(within_s / forecast.bucket_s - 1e-9), 1), len(rates))
    return float(rates[:num_buckets].max())


def _fitted_models(history: np.ndarray, config: ForecastConfig, horizon: int) -> tuple[str, ...]:
    """The models to fit, richest first; each later one is the fallback of the one before, then the mean."""
    if horizon == 0 or len(history) < config.min_history_buckets or np.ptp(history) == 0:
        return ()  # a constant series has nothing to fit, and statsmodels divides by its zero variance
    if len(history) >= 2 * config.season_buckets:
        return ("seasonal", "trend")
    return ("trend",)


def _fit(model: str, history: np.ndarray, config: ForecastConfig, horizon: int) -> np.ndarray | None:
    """Counts per bucket for the next `horizon` buckets, or None if the fit failed or is not finite."""
    # Imported here: a stack that never forecasts (the GPU image has no statsmodels) does not need it.
    from statsmodels.tsa.holtwinters import ExponentialSmoothing

    options = dict(seasonal="add", seasonal_periods=config.season_buckets,
                   initialization_method="legacy-heuristic") if model == "seasonal" else \
        dict(initialization_method="estimated")
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")  # ConvergenceWarning, and divide-by-zero in the AIC of a perfect fit
            fitted = ExponentialSmoothing(history, trend="add", damped_trend=config.damped_trend,
                                          **options).fit(use_brute=False)  # brute start: 8x slower, no better
            predicted = np.asarray(fitted.forecast(horizon), dtype=np.float64)
    except (ValueError, ArithmeticError, np.linalg.LinAlgError):
        return None
    return predicted if predicted.shape == (horizon,) and np.all(np.isfinite(predicted)) else None


def _forecast(model: str, counts: np.ndarray, config: ForecastConfig) -> Forecast:
    return Forecast(model, np.clip(counts, 0.0, None) / config.bucket_s, config.bucket_s)
