"""bench/divergence.py: where two runs of the same requests part, and the model's margin there (what bench/gpu.py
reports instead of stopping when async and waiting scheduling disagree)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.conftest import hf_greedy, make_checkpoint

# Loaded from its file: bench/ on sys.path would shadow packages named like its scripts (evaluate, load, ...).
_SPEC = importlib.util.spec_from_file_location("bench_divergence",
                                               Path(__file__).resolve().parents[2] / "bench" / "divergence.py")
_divergence = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_divergence)
divergence, first_token_margins = _divergence.divergence, _divergence.first_token_margins


def test_divergence_counts_sequences_and_first_positions():
    a = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1]]
    b = [[1, 2, 3], [4, 0, 6], [0, 8, 9], [1, 1, 1]]
    report = divergence(a, b)
    assert report["sequences_differing"] == 3 and report["first_positions"] == {1: 1, 2: 0, 3: 2}
    assert (report["earliest"], report["median"]) == (0, 1)
    assert divergence(a, a)["sequences_differing"] == 0 and divergence(a, a)["earliest"] is None
    with pytest.raises(ValueError):
        divergence(a, b[:2])


def test_margins_at_the_first_differing_token_follow_the_oracle(tmp_path):
    model = make_checkpoint(tmp_path / "llama", "llama", seed=3)
    prompts = [[5, 9, 13, 2], [7, 7, 1]]
    greedy, _ = hf_greedy(model, prompts, 4)
    other = [list(greedy[0]), [*greedy[1][:2], (greedy[1][2] + 1) % 100, greedy[1][3]]]
    report = divergence(greedy, other)
    (row,) = first_token_margins(model, prompts, greedy, other, report["first_positions"], device="cpu",
                                 dtypes=("float32",))
    assert (row["sequence"], row["position"]) == (1, 2)
    assert row["tokens"] == (greedy[1][2], other[1][2]) and row["argmax_float32"] == greedy[1][2]
    assert row["margin_float32"] >= 0
