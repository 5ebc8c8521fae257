"""The autopilot's arrival forecast vs the last value and the running mean, on the Azure trace and a synthetic week.

(a) Real trace, rolling origin: from 10 minutes in, at every bucket, forecast the next `--horizon-s` seconds from
    the history so far; MAE (requests/s) and sMAPE per horizon, for 10 s and 30 s buckets. The trace is one hour
    (2023-11-16 18:15-19:14): it holds no daily cycle, so this measures the short-horizon ("trend") path only.
(b) SYNTHETIC, not the trace: the seasonal path needs two days of history, which no public hour-long trace has, and
    cutting the hour into "compressed days" would invent a cycle. Instead: four days of minute buckets, a daily
    cosine whose mean is the trace's mean rate (peak/trough 4:1, peak at 14:00), with negative-binomial noise whose
    minute-to-minute dispersion matches the trace's; fit on three days, forecast the fourth. Also times that fit
    (4,320 points).

Prints the tables; writes bench/results/forecast.json and bench/results/forecast.png (actual vs forecast).

    .venv/bin/python bench/forecast.py [--trace PATH] [--bucket-s 10 30] [--horizon-s 300] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.controller.autopilot.forecast import (  # noqa: E402
    ForecastConfig, bucket_arrivals, forecast_rate, peak_ahead,
)
from services.simulator.trace import load_trace  # noqa: E402

DEFAULT_TRACE = REPO / ".." / "shared" / "traces" / "azure_llm_2023_conv.csv"
METHODS = ("forecast", "naive", "running mean")
REPORT_HORIZONS_S = (60.0, 120.0, 180.0, 300.0)  # and one bucket ahead
DAY_MINUTES, PEAK_MINUTE, AMPLITUDE = 1440, 14 * 60, 0.6  # (1 + 0.6) / (1 - 0.6) = 4:1 peak to trough


def _smape(predicted: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """Symmetric absolute percentage error per point, in [0, 2]; 0 where both are 0."""
    total = np.abs(predicted) + np.abs(actual)
    return np.divide(2 * np.abs(predicted - actual), total, out=np.zeros_like(total), where=total > 0)


def rolling_origin(counts: np.ndarray, config: ForecastConfig, horizon: int, warmup: int) -> dict:
    """Forecast `horizon` buckets from every origin after `warmup`; rates per method, shape [origins, horizon]."""
    bucket_s, origins = config.bucket_s, range(warmup, len(counts))
    predicted = {method: np.full((len(origins), horizon), np.nan) for method in METHODS}
    actual = np.full((len(origins), horizon), np.nan)
    models, fit_s = Counter(), []
    for row, origin in enumerate(origins):
        history, ahead = counts[:origin], counts[origin:origin + horizon] / bucket_s
        started = time.perf_counter()
        forecast = forecast_rate(history, config, horizon)
        fit_s.append(time.perf_counter() - started)
        models[forecast.model] += 1
        predicted["forecast"][row] = forecast.rates_per_s
        predicted["naive"][row] = history[-1] / bucket_s
        predicted["running mean"][row] = history.mean() / bucket_s
        actual[row, :len(ahead)] = ahead
    return {"predicted": predicted, "actual": actual, "models": dict(models),
            "fit_ms_median": 1000 * float(np.median(fit_s))}


def _errors(predicted: np.ndarray, actual: np.ndarray, steps: list[int]) -> dict:
    """MAE (requests/s) and sMAPE (%) at each step ahead (1-based), over the origins that see that step."""
    out = {}
    for step in steps:
        seen = ~np.isnan(actual[:, step - 1])
        out[step] = {"mae": float(np.abs(predicted[seen, step - 1] - actual[seen, step - 1]).mean()),
                     "smape_pct": 100 * float(_smape(predicted[seen, step - 1], actual[seen, step - 1]).mean())}
    return out


def evaluate_trace(arrival_s: np.ndarray, bucket_s: float, horizon_s: float, warmup_s: float) -> dict:
    config = ForecastConfig(bucket_s=bucket_s)
    counts = bucket_arrivals(arrival_s, bucket_s)
    horizon = max(round(horizon_s / bucket_s), 1)
    run = rolling_origin(counts, config, horizon, warmup=round(warmup_s / bucket_s))
    steps = sorted({1, *(round(s / bucket_s) for s in REPORT_HORIZONS_S if bucket_s <= s <= horizon_s)})
    errors = {method: _errors(run["predicted"][method], run["actual"], steps) for method in METHODS}
    return {"bucket_s": bucket_s, "num_buckets": len(counts), "num_origins": len(run["actual"]),
            "models": run["models"], "fit_ms_median": run["fit_ms_median"], "steps": steps,
            "errors": errors, "run": run, "counts": counts}


def _print_trace_table(result: dict) -> None:
    bucket_s = result["bucket_s"]
    print(f"\n(a) Azure conv trace, {bucket_s:g} s buckets: {result['num_buckets']} buckets, "
          f"{result['num_origins']} origins, models used {result['models']}, "
          f"median fit {result['fit_ms_median']:.1f} ms")
    print(f"{'ahead':>7}  " + "  ".join(f"{m + ' MAE':>17} {'sMAPE':>6}" for m in METHODS))
    for step in result["steps"]:
        cells = [result["errors"][m][step] for m in METHODS]
        print(f"{step * bucket_s:6g}s  " + "  ".join(f"{c['mae']:17.2f} {c['smape_pct']:5.1f}%" for c in cells))


def synthetic_days(mean_rate: float, dispersion: float, seed: int, num_days: int = 4) -> tuple[np.ndarray, ...]:
    """Expected and drawn arrivals per minute over `num_days` days; variance = dispersion * mean."""
    minute = np.arange(num_days * DAY_MINUTES)
    expected = 60 * mean_rate * (1 + AMPLITUDE * np.cos(2 * np.pi * (minute - PEAK_MINUTE) / DAY_MINUTES))
    rng = np.random.default_rng(seed)
    if dispersion <= 1:
        return expected, rng.poisson(expected).astype(float)
    success = 1 / dispersion  # negative binomial: mean n(1-p)/p, variance mean/p
    return expected, rng.negative_binomial(expected * success / (1 - success), success).astype(float)


def evaluate_synthetic(mean_rate: float, dispersion: float, seed: int) -> dict:
    config = ForecastConfig(bucket_s=60.0, season_buckets=DAY_MINUTES)
    expected, drawn = synthetic_days(mean_rate, dispersion, seed)
    history, day = drawn[:3 * DAY_MINUTES], slice(3 * DAY_MINUTES, 4 * DAY_MINUTES)
    fit_s = []
    for _ in range(5):
        started = time.perf_counter()
        forecast = forecast_rate(history, config, DAY_MINUTES)
        fit_s.append(time.perf_counter() - started)
    truth, realized = expected[day] / 60, drawn[day] / 60
    predicted = {"forecast": forecast.rates_per_s, "naive": np.full(DAY_MINUTES, history[-1] / 60),
                 "running mean": np.full(DAY_MINUTES, history.mean() / 60),
                 "same minute yesterday": history[-DAY_MINUTES:] / 60}
    hourly = forecast.rates_per_s.reshape(24, 60).mean(axis=1)
    return {
        "synthetic": True, "mean_rate": mean_rate, "dispersion": dispersion, "model": forecast.model,
        "fit_s_median_4320_points": float(np.median(fit_s)),
        "errors": {name: {"mae_vs_expected": float(np.abs(rates - truth).mean()),
                          "mae_vs_drawn": float(np.abs(rates - realized).mean()),
                          "smape_pct_vs_drawn": 100 * float(_smape(rates, realized).mean())}
                   for name, rates in predicted.items()},
        "peak_hour_predicted": int(np.argmax(hourly)), "peak_hour_true": PEAK_MINUTE // 60,
        "peak_hourly_rate_predicted": float(hourly.max()),
        "peak_hourly_rate_true": float(truth.reshape(24, 60).mean(axis=1).max()),
        "peak_ahead_next_10min_at_midnight": peak_ahead(forecast, 600.0),
        "plot": {"truth": truth, "realized": realized, "forecast": forecast.rates_per_s},
    }


def _print_synthetic(result: dict) -> None:
    print(f"\n(b) SYNTHETIC diurnal series (not the trace): 3 days of minute buckets, mean {result['mean_rate']:.2f} "
          f"req/s as the trace, dispersion {result['dispersion']:.2f} as its minutes; forecast day 4 "
          f"with model {result['model']!r}, fit on 4,320 points in {result['fit_s_median_4320_points']:.3f} s")
    print(f"{'method':>22} {'MAE vs expected':>16} {'MAE vs drawn':>13} {'sMAPE vs drawn':>15}")
    for name, cell in result["errors"].items():
        print(f"{name:>22} {cell['mae_vs_expected']:16.3f} {cell['mae_vs_drawn']:13.3f} "
              f"{cell['smape_pct_vs_drawn']:14.1f}%")
    print(f"peak hour predicted {result['peak_hour_predicted']}:00 (true {result['peak_hour_true']}:00), "
          f"peak hourly rate {result['peak_hourly_rate_predicted']:.2f} req/s "
          f"(true {result['peak_hourly_rate_true']:.2f})")


def _plot(trace: dict, synthetic: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (real, fake) = plt.subplots(1, 2, figsize=(13, 4.5))
    run, bucket_s = trace["run"], trace["bucket_s"]
    warmup = trace["num_buckets"] - trace["num_origins"]
    minutes = np.arange(trace["num_buckets"]) * bucket_s / 60
    real.plot(minutes, trace["counts"] / bucket_s, color="0.6", lw=1, label="actual")
    real.plot(minutes[warmup:], run["predicted"]["forecast"][:, 0], lw=1.2, label="forecast, 1 bucket ahead")
    real.plot(minutes[warmup:], run["predicted"]["naive"][:, 0], lw=0.8, ls=":", label="naive, 1 bucket ahead")
    origin = trace["num_origins"] // 2  # one origin's whole horizon
    horizon = run["predicted"]["forecast"].shape[1]
    real.plot(minutes[warmup + origin] + np.arange(horizon) * bucket_s / 60,
              run["predicted"]["forecast"][origin], lw=2.5, color="C3", label="forecast from one origin")
    real.set(xlabel="minutes into the trace", ylabel="requests/s",
             title=f"(a) Azure conv trace, {bucket_s:g} s buckets, rolling origin")
    hours = np.arange(DAY_MINUTES) / 60
    fake.plot(hours, synthetic["plot"]["realized"], color="0.75", lw=0.6, label="drawn")
    fake.plot(hours, synthetic["plot"]["truth"], color="k", lw=1, label="expected")
    fake.plot(hours, synthetic["plot"]["forecast"], color="C3", lw=1.2, label="seasonal forecast")
    fake.set(xlabel="hour of day 4", ylabel="requests/s", title="(b) SYNTHETIC diurnal series, day 4")
    for axes in (real, fake):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _strip(result: dict) -> dict:
    return {key: value for key, value in result.items() if key not in ("run", "counts", "plot")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--bucket-s", type=float, nargs="+", default=[10.0, 30.0])
    parser.add_argument("--horizon-s", type=float, default=300.0, help="how far ahead each origin forecasts")
    parser.add_argument("--warmup-s", type=float, default=600.0, help="history before the first origin")
    parser.add_argument("--seed", type=int, default=0, help="of the synthetic series")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    started = time.perf_counter()
    arrival_s = load_trace(args.trace).arrival_s
    traces = [evaluate_trace(arrival_s, bucket_s, args.horizon_s, args.warmup_s) for bucket_s in args.bucket_s]
    for result in traces:
        _print_trace_table(result)
    minutes = bucket_arrivals(arrival_s, 60.0)
    mean_rate = len(arrival_s) / arrival_s[-1]
    dispersion = float(np.diff(minutes).var() / 2 / minutes.mean())  # differences: a slow level drift cancels
    synthetic = evaluate_synthetic(mean_rate, dispersion, args.seed)
    _print_synthetic(synthetic)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"trace": str(args.trace.resolve()), "horizon_s": args.horizon_s, "warmup_s": args.warmup_s,
               "rolling_origin": [_strip(result) for result in traces],
               "synthetic_diurnal": _strip(synthetic), "wall_s": time.perf_counter() - started}
    (args.out / "forecast.json").write_text(json.dumps(payload, indent=2))
    _plot(traces[-1], synthetic, args.out / "forecast.png")
    print(f"\nwrote {args.out / 'forecast.json'} and {args.out / 'forecast.png'} in {payload['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
