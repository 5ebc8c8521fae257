"""Workloads for the simulator: the Azure LLM trace CSV, or seeded Poisson arrivals."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import numpy as np

TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests as columns, sorted by arrival: seconds from the first arrival, prompt and output tokens."""

    arrival_s: np.ndarray  # [N] float64, non-decreasing, starts at 0
    prompt_tokens: np.ndarray  # [N] int64, >= 1
    output_tokens: np.ndarray  # [N] int64, >= 1
    source: str

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if len(self.prompt_tokens) != n or len(self.output_tokens) != n:
            raise ValueError("workload columns differ in length")
        if n and (np.any(np.diff(self.arrival_s) < 0) or self.prompt_tokens.min() < 1
                  or self.output_tokens.min() < 1):
            raise ValueError("arrivals must be sorted and token counts >= 1")

    def __len__(self) -> int:
        return len(self.arrival_s)


def _day_and_seconds(timestamp: str) -> tuple[int, float]:
    """'2023-11-16 18:15:46.6805900' -> (day ordinal, 65746.68059); any number of fraction digits."""
    day, _, clock = timestamp.strip().partition(" ")
    hours, minutes, seconds = clock.split(":")
    return date.fromisoformat(day).toordinal(), int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def load_trace(path: str | Path, time_scale: float = 1.0, max_requests: int | None = None) -> Workload:
    """Read a `TIMESTAMP,ContextTokens,GeneratedTokens` CSV; inter-arrival gaps are multiplied by `time_scale`."""
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    arrivals, prompts, outputs = [], [], []
    first_day = None
    with open(path, newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None or tuple(column.strip() for column in header[:3]) != TRACE_COLUMNS:
            raise ValueError(f"{path}: expected header {','.join(TRACE_COLUMNS)}, got {header}")
        for line, row in enumerate(reader, start=2):
            if not row:
                continue
            if max_requests is not None and len(arrivals) >= max_requests:
                break
            try:
                day, seconds = _day_and_seconds(row[0])
                prompt, output = int(row[1]), int(row[2])
            except (ValueError, IndexError) as error:
                raise ValueError(f"{path}:{line}: bad row {row}: {error}") from None
            first_day = day if first_day is None else first_day
            arrivals.append((day - first_day) * 86400.0 + seconds)  # small numbers keep the fractions exact
            prompts.append(max(prompt, 1))
            outputs.append(max(output, 1))
    arrival = np.asarray(arrivals, dtype=np.float64)
    order = np.argsort(arrival, kind="stable")
    arrival = (arrival[order] - (arrival[order][0] if len(arrival) else 0.0)) * time_scale
    return Workload(arrival, np.asarray(prompts, np.int64)[order], np.asarray(outputs, np.int64)[order],
                    f"{Path(path).name} x{time_scale:g}")


def _lengths(rng: np.random.Generator, mean: float, count: int, distribution: str, sigma: float) -> np.ndarray:
    if mean < 1:
        raise ValueError("mean lengths must be >= 1")
    if distribution == "lognormal":
        values = rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma, count)  # its mean is `mean`
    elif distribution == "exponential":
        values = rng.exponential(mean, count)
    else:
        raise ValueError(f"unknown length distribution {distribution!r}")
    return np.maximum(np.rint(values), 1).astype(np.int64)


def poisson_workload(rate: float, num_requests: int, prompt_mean: float, output_mean: float,
                     distribution: str = "lognormal", sigma: float = 1.0, seed: int = 0) -> Workload:
    """Poisson arrivals at `rate` per second with random prompt/output lengths; same seed, same workload."""
    if rate <= 0 or num_requests < 1:
        raise ValueError("need rate > 0 and num_requests >= 1")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, num_requests)
    gaps[0] = 0.0
    return Workload(np.cumsum(gaps), _lengths(rng, prompt_mean, num_requests, distribution, sigma),
                    _lengths(rng, output_mean, num_requests, distribution, sigma),
                    f"poisson {rate:g}/s {distribution}")
