"""The shared interface: baselines as defined, validation, the registry, and batching with coalescing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.placement import KVSchedulerConfig, Request, SchedulerError, make_policy
from tests.placement.streams import apply_operation, operation_streams, placements, replay


def _loads(policy) -> dict[str, int]:
    return {instance_id: state.kv_tokens for instance_id, state in policy.instances().items()}


def _three_instances(name: str):
    """Instances holding 90, 60 and 45 of 100 tokens (no two of them fit together)."""
    policy = make_policy(name, KVSchedulerConfig(capacity=100))
    for request_id, tokens in (("a", 90), ("b", 60), ("c", 45)):
        policy.allocate(request_id, tokens)
    assert _loads(policy) == {"instance-0": 90, "instance-1": 60, "instance-2": 45}
    return policy


def test_best_fit_picks_the_fullest_instance_that_fits():
    policy = _three_instances("bf")
    assert policy.allocate("d", 10) == "instance-0"  # 90 + 10 fits exactly
    assert policy.allocate("e", 35) == "instance-1"  # fits 60 and 45: the fuller
    assert policy.allocate("f", 60) == "instance-3"  # fits nowhere: a new instance
    assert policy.drain_migrations() == []


def test_worst_fit_picks_the_emptiest_instance_that_fits():
    policy = _three_instances("wf")
    assert policy.allocate("d", 10) == "instance-2"  # 45 is the emptiest
    assert policy.allocate("e", 35) == "instance-2"  # 55 is still below 60
    assert policy.allocate("f", 41) == "instance-3"
    assert policy.drain_migrations() == []


@pytest.mark.parametrize("name", ["bf", "wf", "lb", "mell"])
def test_growth_past_capacity_moves_one_request_off(name):
    policy = make_policy(name, KVSchedulerConfig(capacity=100))
    policy.allocate("a", 50)
    policy.allocate("b", 50)
    assert len(policy.instances()) == 1
    policy.update("a", 60)
    [migration] = policy.drain_migrations()
    assert (migration.request_id, migration.reason, migration.kv_tokens) == ("b", "overflow", 50)
    assert sorted(_loads(policy).values()) == [50, 60]


def test_load_balancing_migrates_from_most_to_least_loaded_past_the_threshold():
    policy = make_policy("lb", KVSchedulerConfig(capacity=100, balance_threshold=0.2))
    for request_id, tokens in (("a", 50), ("b", 60), ("c", 10), ("d", 10), ("e", 10)):
        policy.allocate(request_id, tokens)
    assert _loads(policy) == {"instance-0": 70, "instance-1": 70}  # least loaded first: balanced
    assert policy.drain_migrations() == []
    policy.depart("e")  # 70 vs 60: within the threshold
    assert policy.drain_migrations() == []
    policy.depart("b")  # instance-1 empties and is released
    policy.allocate("f", 25)  # instance-0 at 95
    policy.allocate("g", 6)  # fits nowhere: a new instance at 6
    [migration] = policy.drain_migrations()  # 95 vs 6: gap 89 > 20, the request closing it most moves
    assert (migration.reason, migration.source, migration.destination) == ("balance", "instance-0", "instance-1")
    loads = _loads(policy)
    assert max(loads.values()) - min(loads.values()) < 89


def test_requests_are_validated():
    policy = make_policy("mell", KVSchedulerConfig(capacity=100))
    with pytest.raises(SchedulerError):
        policy.allocate("big", 101)
    with pytest.raises(SchedulerError):
        policy.allocate("empty", 0)
    policy.allocate("a", 10)
    with pytest.raises(SchedulerError):
        policy.allocate("a", 10)
    with pytest.raises(SchedulerError):
        policy.update("nobody", 10)
    with pytest.raises(SchedulerError):
        policy.depart("nobody")
    with pytest.raises(ValueError):
        make_policy("first-fit", KVSchedulerConfig(capacity=100))
    with pytest.raises(ValueError):
        KVSchedulerConfig(capacity=100, max_migrations_per_op=0)


def test_max_instances_is_enforced():
    policy = make_policy("bf", KVSchedulerConfig(capacity=100, max_instances=1))
    policy.allocate("a", 60)
    with pytest.raises(SchedulerError):
        policy.allocate("b", 60)


def test_growth_without_room_under_the_cap_is_applied_one_by_one():
    """grow: a tick's growth as one step; when one growth has no instance under the cap, the others still count."""
    policy = make_policy("bf", KVSchedulerConfig(capacity=100, max_instances=1))
    policy.allocate("a", 50)
    policy.allocate("b", 40)
    assert policy.grow([Request("b", 44)]) == [] and _loads(policy) == {"instance-0": 94}
    with pytest.raises(SchedulerError):
        policy.step((), [Request("a", 70), Request("b", 48)], ())
    assert policy.grow([Request("a", 70), Request("b", 48)]) == []
    assert policy.cluster.members == {0: {"a": 70, "b": 48}}  # a stays where it is, its instance over capacity


def test_a_batched_step_runs_departs_before_allocates():
    policy = make_policy("bf", KVSchedulerConfig(capacity=100))
    policy.allocate("a", 60)
    policy.allocate("c", 40)
    result = policy.step(departs=["a"], updates=[Request("c", 45)], allocates=[Request("b", 50)])
    assert [(p.request_id, p.instance_id) for p in result.placements] == [("b", "instance-0")]
    assert result.migrations == () and _loads(policy) == {"instance-0": 95}


@settings(max_examples=40, deadline=None)
@given(stream=operation_streams(), name=st.sampled_from(["mell", "bf", "lb"]), chunk=st.integers(2, 30))
def test_draining_once_per_batch_never_moves_more_than_draining_per_operation(stream, name, chunk):
    capacity, ops = stream
    batched = make_policy(name, KVSchedulerConfig(capacity=capacity))
    unbatched = make_policy(name, KVSchedulerConfig(capacity=capacity))
    live_batched: dict[str, int] = {}
    live_unbatched: dict[str, int] = {}
    for start in range(0, len(ops), chunk):
        known = placements(batched.instances())  # where the router last knew each request to be
        per_operation = 0
        for serial in range(start, min(start + chunk, len(ops))):
            apply_operation(batched, live_batched, ops[serial], serial)
            apply_operation(unbatched, live_unbatched, ops[serial], serial)
            per_operation += len(unbatched.drain_migrations())
            for request_id in set(live_batched) - set(known):  # placed in this batch: allocate said where
                known[request_id] = placements(batched.instances()).get(request_id)
        coalesced = batched.drain_migrations()
        assert len(coalesced) <= per_operation
        assert len({m.request_id for m in coalesced}) == len(coalesced)  # at most one move per request
        final = placements(batched.instances())
        assert replay({r: i for r, i in known.items() if r in final}, coalesced) == final


def _bounce(policy, drain_each: bool) -> list:
    """b leaves instance-0 on an overflow, then comes back on another; the moves drained on the way."""
    drained = []
    steps = [("allocate", "a", 60), ("allocate", "e", 10), ("allocate", "b", 30), ("update", "a", 85),
             ("allocate", "c", 65), ("update", "a", 40), ("update", "c", 75)]
    for operation, request_id, tokens in steps:
        getattr(policy, operation)(request_id, tokens)
        if drain_each:
            drained += policy.drain_migrations()
    return drained + policy.drain_migrations()


def test_a_move_and_its_return_cancel_out_when_drained_together():
    per_operation = _bounce(make_policy("bf", KVSchedulerConfig(capacity=100)), drain_each=True)
    assert [(m.request_id, m.source, m.destination) for m in per_operation] == [
        ("b", "instance-0", "instance-1"), ("b", "instance-1", "instance-0")]
    assert _bounce(make_policy("bf", KVSchedulerConfig(capacity=100)), drain_each=False) == []


def test_a_chain_of_moves_becomes_one_move():
    policy = make_policy("bf", KVSchedulerConfig(capacity=100))
    policy.allocate("a", 50)
    policy.allocate("b", 50)
    policy.update("a", 60)  # b: instance-0 -> instance-1
    policy.allocate("c", 50)  # best fit: next to b
    policy.update("c", 55)  # b: instance-1 -> instance-2
    [migration] = policy.drain_migrations()
    assert (migration.request_id, migration.source, migration.destination) == ("b", "instance-0", "instance-2")


@pytest.mark.parametrize("name", ["mell", "bf", "wf", "lb"])
def test_pin_records_a_move_that_did_not_happen_and_one_made_outside(name):
    """A migration the caller could not carry out is pinned back onto its source (reopened if the move released
    it), with no migration logged; an operator's move onto a new instance is pinned there; the policy goes on."""
    policy = make_policy(name, KVSchedulerConfig(capacity=100))
    policy.allocate("a", 30)
    source = policy.allocate("b", 30)
    policy.update("b", 95)  # b outgrows its instance: the policy moves a request off it
    moves = policy.drain_migrations()
    for move in moves:  # none happened: both are still where they were
        assert policy.pin(move.request_id, move.source) == move.source
    assert all(policy.cluster.location[r] == policy.cluster.location["a"] for r in "ab") or not moves
    assert policy.drain_migrations() == []
    moved_to = policy.pin("a", None)  # an operator moved it to an instance of its own
    assert moved_to != source and policy.instances()[moved_to].requests == {"a": 30}
    assert policy.drain_migrations() == []
    policy.update("a", 40)
    policy.depart("a")
    policy.depart("b")
    assert policy.instances() == {}
    with pytest.raises(SchedulerError):
        policy.pin("a", source)
