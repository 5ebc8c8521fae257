"""Buckets (the API's own histogram, observed per streamed token) counts as prometheus_client's Histogram does."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from services.router.api.metrics import ITL_BUCKETS, Buckets

values = st.floats(0, 20, allow_nan=False)


@given(st.lists(st.tuples(values, st.integers(1, 5)), max_size=30))
def test_the_same_series_as_prometheus_clients_histogram(observations):
    ours = Buckets("x_seconds", "x", ITL_BUCKETS, "m")
    theirs = Histogram("x_seconds", "x", ["model_name"], buckets=ITL_BUCKETS, registry=CollectorRegistry())
    series = theirs.labels("m")
    for value, times in observations:
        ours.observe(value, times)
        for _ in range(times):
            series.observe(value)
    [mine] = ours.collect()
    [reference] = theirs.collect()
    expected = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in reference.samples
                if not s.name.endswith("_created")}
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in mine.samples}
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value)
