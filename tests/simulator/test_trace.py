"""Workloads: the trace CSV parser and seeded Poisson arrivals."""

from __future__ import annotations

import numpy as np
import pytest

from services.simulator.trace import load_trace, poisson_workload

CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 23:59:59.5000000,374,44
2023-11-16 23:59:58.2500000,10,0
2023-11-17 00:00:01.1234567,879,55
"""


def test_trace_rows_become_sorted_relative_arrivals(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(CSV)
    workload = load_trace(path)
    assert len(workload) == 3
    # Sorted by time, relative to the first, across midnight, seven fraction digits kept.
    np.testing.assert_allclose(workload.arrival_s, [0.0, 1.25, 2.8734567])
    assert workload.prompt_tokens.tolist() == [10, 374, 879]
    assert workload.output_tokens.tolist() == [1, 44, 55]  # zero generated tokens counts as one


def test_time_scale_and_max_requests(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(CSV)
    half = load_trace(path, time_scale=0.5, max_requests=2)
    np.testing.assert_allclose(half.arrival_s, [0.0, 0.625])


def test_a_bad_header_or_row_is_an_error(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("time,prompt,output\n1,2,3\n")
    with pytest.raises(ValueError, match="header"):
        load_trace(path)
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,many,3\n")
    with pytest.raises(ValueError, match="bad.csv:2"):
        load_trace(path)


def test_the_shared_azure_trace_parses():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces" / "azure_llm_2023_conv.csv"
    if not path.exists():
        pytest.skip("shared Azure trace not present")
    workload = load_trace(path, max_requests=1000)
    assert len(workload) == 1000 and workload.arrival_s[0] == 0.0
    assert 300 < workload.prompt_tokens.mean() < 3000


@pytest.mark.parametrize("distribution", ["lognormal", "exponential"])
def test_poisson_workloads_are_seeded_and_have_the_asked_means(distribution):
    first = poisson_workload(4.0, 20_000, 1000, 200, distribution, seed=7)
    again = poisson_workload(4.0, 20_000, 1000, 200, distribution, seed=7)
    other = poisson_workload(4.0, 20_000, 1000, 200, distribution, seed=8)
    np.testing.assert_array_equal(first.arrival_s, again.arrival_s)
    np.testing.assert_array_equal(first.prompt_tokens, again.prompt_tokens)
    assert not np.array_equal(first.prompt_tokens, other.prompt_tokens)
    assert first.arrival_s[-1] / len(first) == pytest.approx(0.25, rel=0.05)  # 4 per second
    assert first.prompt_tokens.mean() == pytest.approx(1000, rel=0.06)
    assert first.output_tokens.mean() == pytest.approx(200, rel=0.06)
    assert first.output_tokens.min() >= 1
