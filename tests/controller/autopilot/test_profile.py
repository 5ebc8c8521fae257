"""Profiles: the step model fitted from samples, crossovers and bands, persistence, and the workers' measured
speed turned into layers per stage."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import poisson

from services.controller.autopilot.profile import (
    DecodeSample,
    LayoutModel,
    PrefillSample,
    Profile,
    SwitchSample,
    WorkerSpeed,
    balanced_split,
    crossover,
    fit_layout,
    poisson_quantile,
    worker_speeds,
)


def test_the_fit_recovers_the_step_model():
    a, b, g = 0.030, 0.002, 1e-5
    decode = [DecodeSample("tp1pp4", n, c, a + n * (b + c * g)) for n in (1, 4, 12) for c in (40, 170)]
    prefill = [PrefillSample("tp1pp4", t, 0.01 + t * 2e-4) for t in (32, 160, 1920)]
    model = fit_layout("tp1pp4", decode, prefill, kv_blocks=341, block_size=16, num_workers=4)
    assert (model.step_s, model.per_request_s, model.per_position_s) == pytest.approx((a, b, g), rel=1e-6)
    assert (model.prefill_base_s, model.prefill_per_token_s) == pytest.approx((0.01, 2e-4), rel=1e-6)
    assert model.max_requests(170) == 341 // 11


def test_costs_are_never_negative():
    noisy = [DecodeSample("x", 1, 100, 0.05), DecodeSample("x", 8, 100, 0.04)]  # slower alone: noise
    model = fit_layout("x", noisy, [], 10, 16, 1)
    assert min(model.step_s, model.per_request_s, model.per_position_s) >= 0


@settings(max_examples=300, deadline=None)
@given(mean=st.floats(min_value=0.0, max_value=3000.0), q=st.floats(min_value=0.01, max_value=0.999))
def test_poisson_quantile_is_scipys(mean, q):
    assert poisson_quantile(mean, q) == int(poisson.ppf(q, mean))


@settings(max_examples=200, deadline=None)
@given(rate=st.floats(min_value=0.01, max_value=20.0), prompt=st.floats(min_value=1, max_value=2000),
       output=st.floats(min_value=2, max_value=500))
def test_a_layout_settles_where_littles_law_holds(rate, prompt, output):
    model = LayoutModel("tp1pp2", 0.03, 0.01, 1e-5, 0.02, 3e-4, 4096, 16, 2)
    load, tpot = model.settle(rate, prompt, output)
    busy = rate * model.prefill(prompt)
    if busy >= 1:   # the prefills alone take all of the stack's time
        assert math.isinf(load) and math.isinf(tpot)
    elif math.isfinite(load):
        assert tpot == pytest.approx(model.effective_tpot(load, prompt + output / 2) / (1 - busy), rel=1e-9)
        assert load == pytest.approx(rate * (model.prefill(prompt) + (output - 1) * tpot), rel=1e-4)
    else:           # decode cannot keep up: the layout's token rate at its KV's limit is below the demand
        held = max(1, model.max_requests(prompt + output / 2))
        assert rate * (output - 1) >= 0.99 * held / model.tpot(held, prompt + output / 2) * (1 - busy)


def test_crossover_bands_and_persistence(tmp_path):
    fast = LayoutModel("tp1pp1", 0.010, 0.010, 0.0, 0.0, 1e-4, 4096, 16, 1)
    wide = LayoutModel("tp1pp4", 0.040, 0.002, 0.0, 0.0, 1e-4, 4096, 16, 4)
    assert crossover(fast, wide, 100) == pytest.approx(3.75)
    assert crossover(wide, fast, 100) is None
    profile = Profile("m", "box", {"tp1pp1": fast, "tp1pp4": wide},
                      {("tp1pp1", "tp1pp4"): SwitchSample("tp1pp1", "tp1pp4", 0.05, 2.0)},
                      num_layers=30, worker_speeds=(WorkerSpeed(0, 1e-3), WorkerSpeed(1, 1e-3, 2.0)),
                      partitions={"tp1pp4": (8, 8, 8, 6)},
                      split_trials=(("tp1pp4", (8, 8, 8, 6), 1.0, 0.8, True),))
    assert [(b.layout, b.low, b.high) for b in profile.bands(100, 10)] == [("tp1pp1", 1, 4), ("tp1pp4", 4, 11)]
    assert profile.switch_cost("tp1pp4", "tp1pp1").downtime_s == 0.05   # never measured: the slowest known
    path = tmp_path / "p.json"
    profile.save(path)
    assert Profile.load(path) == profile


def test_worker_speeds_come_from_the_finest_pipeline():
    rows = {
        # layout: (rank, layers, forward s, head s, steps)
        "tp1pp2": [(0, 15, 3.0, 0.0, 100), (1, 15, 3.0, 1.6, 100)],
        "tp1pp4": [(0, 8, 0.8, 0.0, 100), (1, 8, 2.4, 0.0, 100), (2, 7, 0.7, 0.0, 100), (3, 7, 0.7, 0.8, 100)],
    }
    speeds = {w.rank: w for w in worker_speeds(rows)}
    assert speeds[1].layer_s == pytest.approx(3e-3)     # from tp1pp4: rank 1 is 3x slower there
    assert speeds[0].layer_s == pytest.approx(1e-3)
    assert speeds[3].head_ratio == pytest.approx(8.0)   # 0.8 s of head per 100 steps at 1 ms per layer
    assert speeds[1].head_ratio == pytest.approx(8.0)   # against its own layer cost in tp1pp2 (2 ms)


def test_layers_follow_measured_speed():
    even = [WorkerSpeed(r, 1e-3) for r in range(4)]
    assert balanced_split(even, 30, "tp1pp4") is None            # nothing to gain over the even split
    heavy_head = [WorkerSpeed(r, 1e-3, 8.0 if r == 3 else 0.0) for r in range(4)]
    assert balanced_split(heavy_head, 30, "tp1pp4") == (10, 10, 9, 1)
    slow_rank = [WorkerSpeed(0, 1e-3), WorkerSpeed(1, 3e-3), WorkerSpeed(2, 1e-3), WorkerSpeed(3, 1e-3)]
    split = balanced_split(slow_rank, 30, "tp1pp4")
    assert split is not None and split[1] == min(split) and sum(split) == 30
    # A stage of two TP ranks runs at its slower rank's pace: tp2pp2 puts ranks 0-1 in stage 0.
    assert balanced_split(slow_rank, 30, "tp2pp2") == (7, 23)
    assert balanced_split(slow_rank, 30, "tp4pp1") is None       # one stage: nothing to split
    assert balanced_split(slow_rank[:2], 30, "tp1pp4") is None   # a worker never measured


def test_only_a_split_the_calibration_verified_is_used():
    profile = Profile("m", "box", {}, num_layers=30, partitions={"tp1pp4": (9, 9, 8, 4)})
    assert profile.layer_partition("tp1pp4") == (9, 9, 8, 4) and profile.layer_partition("tp1pp2") is None
