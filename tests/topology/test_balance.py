"""Layers per pipeline stage by measured speed: exact against brute force, even for equal speeds, never starving a
stage, and monotone in speed."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.topology.balance import balanced_partition, slowest_stage_s
from services.topology.placement import layer_partition

speeds = st.lists(st.floats(min_value=0.01, max_value=10.0, allow_nan=False), min_size=1, max_size=5)


def _compositions(total: int, parts: int):
    """Every way to write total as `parts` positive integers."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


@settings(max_examples=300, deadline=None)
@given(per_layer=speeds, extra=st.integers(0, 9), head=st.floats(0.0, 20.0))
def test_the_greedy_split_is_optimal(per_layer, extra, head):
    num_layers = len(per_layer) + extra
    fixed = [0.0] * (len(per_layer) - 1) + [head]
    split = balanced_partition(per_layer, num_layers, fixed)
    assert sum(split) == num_layers and min(split) >= 1
    best = min(slowest_stage_s(c, per_layer, fixed) for c in _compositions(num_layers, len(per_layer)))
    assert slowest_stage_s(split, per_layer, fixed) == pytest.approx(best)


@settings(max_examples=200, deadline=None)
@given(stages=st.integers(1, 6), extra=st.integers(0, 30))
def test_equal_speeds_give_an_even_split(stages, extra):
    split = balanced_partition([1.0] * stages, stages + extra)
    assert max(split) - min(split) <= 1
    even = [len(r) for r in layer_partition(stages + extra, stages)]
    assert slowest_stage_s(split, [1.0] * stages) == slowest_stage_s(even, [1.0] * stages)


@settings(max_examples=200, deadline=None)
@given(per_layer=speeds, extra=st.integers(0, 20))
def test_a_faster_stage_never_gets_fewer_layers(per_layer, extra):
    split = balanced_partition(per_layer, len(per_layer) + extra)
    for (a, sa), (b, sb) in itertools.combinations(zip(split, per_layer), 2):
        if sa < sb:
            assert a >= b
        elif sb < sa:
            assert b >= a


def test_the_head_of_the_last_stage_moves_layers_off_it():
    assert balanced_partition([1.0] * 4, 30) == (8, 8, 7, 7)          # the even split's sizes
    assert balanced_partition([1.0] * 4, 30, [0, 0, 0, 4.0]) == (9, 9, 8, 4)
    assert balanced_partition([3.0, 1.0], 3) == (1, 2)                # a 3x slower worker


def test_impossible_splits_are_refused():
    with pytest.raises(ValueError):
        balanced_partition([1.0, 1.0, 1.0], 2)
    with pytest.raises(ValueError):
        balanced_partition([1.0, -1.0], 4)
