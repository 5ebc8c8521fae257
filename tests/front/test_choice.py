"""The front's adaptive choice between moving a request's KV and re-prefilling it, from measured rates."""

from __future__ import annotations

from services.front.engine import FrontEngine, FrontSettings
from services.front.instances import Instance
from services.placement import Move


def _front(link_bytes_per_s: float, prefill_tokens_per_s: float, adaptive: bool = True) -> FrontEngine:
    front = FrontEngine([Instance("a", "unused:1")], None, "m", FrontSettings(adaptive=adaptive))
    front.totals.link_bytes_per_s, front.totals.prefill_tokens_per_s = link_bytes_per_s, prefill_tokens_per_s
    front.totals.kv_bytes_per_token = 1000.0
    return front


def _moves(*sizes: int) -> list[Move]:
    return [Move(f"r{i}", tokens, "instance-0", "instance-1", "overflow", i) for i, tokens in enumerate(sizes)]


def test_a_slow_link_re_prefills_a_fast_one_moves_kv_and_no_room_waits():
    assert _front(1e9, 1e3)._choose_modes(_moves(300)) == {"r0": False}       # 0.3 ms of link, 0.3 s of prefill
    assert _front(1e5, 1e5)._choose_modes(_moves(300)) == {"r0": True}        # 3 s of link, 3 ms of prefill
    assert _front(1e5, 100.0)._choose_modes(_moves(300)) == {"r0": None}      # neither fits the 1 s window
    chosen = _front(4e5, 1600.0)._choose_modes(_moves(300, 300))  # one fits each budget (prefill: a quarter)
    assert sorted(chosen.values()) == [False, True]


def test_before_both_rates_are_measured_every_move_carries_its_kv():
    assert _front(0.0, 1e5)._choose_modes(_moves(300)) == {}
    assert _front(1e5, 0.0)._choose_modes(_moves(300)) == {}
    assert _front(1e5, 1e5, adaptive=False)._choose_modes(_moves(300)) == {}
