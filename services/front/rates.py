"""The front router's counters, and the rates it measures to choose how a request moves (MELL, section V):
carry its KV over the link, or re-prefill it on the target."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.placement import Move
from services.placement.move_choice import MoveBudgets, choose_move_modes


@dataclass(slots=True)
class FrontTotals:
    # moved; failed (it goes on at its source); finished (it ended first); dropped (the policy's move was not
    # started: the request was moving already, or too many moves were under way; deferred:
    # the adaptive choice found no room in the window's link or prefill budget)
    moves: dict[str, int] = field(default_factory=lambda: {"moved": 0, "failed": 0, "finished": 0, "dropped": 0,
                                                           "deferred": 0})
    # dropped moves by why: moving (a move of it is under way), busy (max_concurrent_moves under way), no_room (no
    # instance to bind its target slot to), disabled (migrate off)
    drops: dict[str, int] = field(default_factory=dict)
    kv_bytes_moved: int = 0
    move_downtime_s: float = 0.0
    replaced: int = 0                  # requests placed again after their instance died
    instance_seconds: float = 0.0      # integral of instances in use over time
    seconds: float = 0.0
    reprefilled: int = 0               # moves made by re-prefill (the measured rates chose it)
    waited_for_room: int = 0           # moves that waited for moves out of their target to commit first
    # Measured (exponential averages): KV bytes/s of moves, KV bytes per token, prompt tokens/s to first token.
    link_bytes_per_s: float = 0.0
    kv_bytes_per_token: float = 0.0
    prefill_tokens_per_s: float = 0.0


def average(old: float, sample: float, weight: float = 0.2) -> float:
    return sample if old <= 0 else (1 - weight) * old + weight * sample


def choose_modes(migrations: Sequence[Move], totals: FrontTotals, window_s: float) -> dict[str, bool | None]:
    """The adaptive choice over a tick's moves from the measured link and prefill rates: request id -> True
    (re-prefill), False (move the KV) or None (wait: neither budget of the window has room). Until both rates
    are measured every move carries its KV ({})."""
    if not (migrations and totals.link_bytes_per_s > 0 and totals.prefill_tokens_per_s > 0
            and totals.kv_bytes_per_token >= 1):
        return {}
    budgets = MoveBudgets.from_profile(window_s, totals.link_bytes_per_s, totals.prefill_tokens_per_s,
                                            round(totals.kv_bytes_per_token))
    plan = choose_move_modes(migrations, budgets)
    return {**{m.request_id: False for m in plan.kv_transfers}, **{m.request_id: True for m in plan.reprefills},
            **{m.request_id: None for m in plan.deferred}}
