"""Adaptive migration choice: budgets respected, every migration decided once, greedy order."""

from __future__ import annotations

from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from services.placement import Move
from services.placement.move_choice import MoveBudgets, choose_move_modes

INSTANCES = ["instance-0", "instance-1", "instance-2"]


@st.composite
def migrations(draw):
    count = draw(st.integers(0, 25))
    result = []
    for index in range(count):
        source, destination = draw(st.permutations(INSTANCES))[:2]
        result.append(Move(f"r{index}", draw(st.integers(1, 4000)), source, destination, "repair", index))
    return result


@settings(max_examples=80, deadline=None)
@given(moves=migrations(), link=st.integers(0, 40_000), prefill=st.integers(0, 6000),
       slow_link=st.integers(0, 10_000))
def test_budgets_are_respected_and_each_migration_is_decided_once(moves, link, prefill, slow_link):
    budgets = MoveBudgets(kv_bytes_per_token=4, link_bytes=link, prefill_tokens=prefill,
                               link_overrides={("instance-0", "instance-1"): slow_link},
                               prefill_overrides={"instance-2": prefill // 2})
    plan = choose_move_modes(moves, budgets)
    decided = plan.kv_transfers + plan.reprefills + plan.deferred
    assert sorted(m.request_id for m in decided) == sorted(m.request_id for m in moves)
    sent = defaultdict(int)
    for migration in plan.kv_transfers:
        sent[migration.source, migration.destination] += migration.kv_tokens * 4
    assert all(total <= budgets.link_budget(*link_id) for link_id, total in sent.items())
    recomputed = defaultdict(int)
    for migration in plan.reprefills:
        recomputed[migration.destination] += migration.kv_tokens
    assert all(total <= budgets.prefill_budget(instance) for instance, total in recomputed.items())
    assert plan.transferred_bytes == sum(sent.values())
    assert plan.reprefill_tokens == sum(recomputed.values())
    # Greedy, largest first: a deferred migration fit neither bin after those decided before it.
    def before(m: Move, other: Move) -> bool:
        return (-m.kv_tokens, m.request_id) < (-other.kv_tokens, other.request_id)

    for migration in plan.deferred:
        link_id = (migration.source, migration.destination)
        used_link = sum(m.kv_tokens * 4 for m in plan.kv_transfers
                        if before(m, migration) and (m.source, m.destination) == link_id)
        used_prefill = sum(m.kv_tokens for m in plan.reprefills
                           if before(m, migration) and m.destination == migration.destination)
        assert migration.kv_tokens * 4 > budgets.link_budget(*link_id) - used_link
        assert migration.kv_tokens > budgets.prefill_budget(migration.destination) - used_prefill


def _move(request_id: str, tokens: int, destination: str = "instance-1") -> Move:
    return Move(request_id, tokens, "instance-0", destination, "consolidate", 0)


def test_ample_link_moves_kv_and_a_cut_link_re_prefills():
    moves = [_move("a", 1000), _move("b", 100)]
    fast = choose_move_modes(moves, MoveBudgets(kv_bytes_per_token=10, link_bytes=10**9,
                                                          prefill_tokens=5000))
    assert [m.request_id for m in fast.kv_transfers] == ["a", "b"] and fast.deferred == ()
    cut = choose_move_modes(moves, MoveBudgets(kv_bytes_per_token=10, link_bytes=0,
                                                         prefill_tokens=5000))
    assert [m.request_id for m in cut.reprefills] == ["a", "b"] and cut.transferred_bytes == 0


def test_the_two_bins_share_the_work_when_neither_holds_it_all():
    # Each bin holds 1,000 tokens, 1,800 need both: a takes the link (a tie keeps compute free), b does
    # not fit what the link has left so re-prefills, and c takes the smaller share: 100 of 200, not 100 of 100.
    moves = [_move("c", 100), _move("b", 800), _move("a", 900)]
    plan = choose_move_modes(moves, MoveBudgets(kv_bytes_per_token=1, link_bytes=1000,
                                                          prefill_tokens=1000))
    assert plan.deferred == ()
    assert [m.request_id for m in plan.kv_transfers] == ["a"]
    assert [m.request_id for m in plan.reprefills] == ["b", "c"]


def test_what_fits_no_bin_waits_for_the_next_interval():
    plan = choose_move_modes([_move("a", 5000), _move("b", 10)],
                                  MoveBudgets(kv_bytes_per_token=1, link_bytes=100, prefill_tokens=100))
    assert [m.request_id for m in plan.deferred] == ["a"]
    assert [m.request_id for m in plan.kv_transfers + plan.reprefills] == ["b"]


def test_budgets_from_a_profile():
    budgets = MoveBudgets.from_profile(interval_s=0.5, link_bytes_per_s=2e9, prefill_tokens_per_s=8000,
                                            kv_bytes_per_token=1000, prefill_share=0.25)
    assert budgets.link_budget("instance-0", "instance-1") == 10**9
    assert budgets.prefill_budget("instance-1") == 1000
