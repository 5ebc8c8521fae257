"""MELL's guarantees on random streams, and its repair, consolidation and overflow moves on small cases."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.placement import (
    KVSchedulerConfig, SizeClass, deficient_instances, invariant_violations, make_policy, size_class,
)
from tests.placement.streams import apply_operation, operation_streams, placements, replay


def test_size_classes_at_their_boundaries():
    capacity = 240
    assert size_class(30, capacity) == SizeClass.TINY  # C/8
    assert size_class(31, capacity) == SizeClass.T
    assert size_class(60, capacity) == SizeClass.T  # C/4
    assert size_class(61, capacity) == SizeClass.S
    assert size_class(80, capacity) == SizeClass.S  # C/3
    assert size_class(81, capacity) == SizeClass.M
    assert size_class(120, capacity) == SizeClass.M  # C/2
    assert size_class(121, capacity) == SizeClass.L


@settings(max_examples=60, deadline=None)
@given(stream=operation_streams(), max_deficient=st.sampled_from([1, 2]))
def test_guarantees_hold_after_every_operation(stream, max_deficient):
    capacity, ops = stream
    policy = make_policy("mell", KVSchedulerConfig(capacity=capacity, max_deficient_per_category=max_deficient))
    live: dict[str, int] = {}
    for serial, op in enumerate(ops):
        before = placements(policy.instances())
        apply_operation(policy, live, op, serial)
        instances = policy.instances()
        # G1 (capacity) and G3 (at most K deficient instances per category), checked from scratch.
        assert invariant_violations(instances, max_deficient) == []
        assert policy.cluster.op_items <= 10  # G2: item moves of this operation
        assert sum(state.kv_tokens for state in instances.values()) == sum(live.values())
        # The drained moves take the old placement to the new one for every request that stayed.
        after = placements(instances)
        moved = replay({r: i for r, i in before.items() if r in after}, policy.drain_migrations())
        assert {r: i for r, i in after.items() if r in before} == moved
        # What the policy tracks incrementally equals a recomputation.
        tracked = {size: set(ids) for size, ids in policy.deficient().items()}
        assert tracked == {size: set(ids) for size, ids in deficient_instances(instances).items()}
    assert policy.max_operation_items <= 10


@settings(max_examples=40, deadline=None)
@given(stream=operation_streams(), budget=st.integers(1, 4), jump=st.integers(1, 4096))
def test_capacity_and_move_budget_hold_for_any_growth_and_budget(stream, budget, jump):
    capacity, ops = stream
    policy = make_policy("mell", KVSchedulerConfig(capacity=capacity, max_migrations_per_op=budget))
    live: dict[str, int] = {}
    for serial, op in enumerate(ops):
        if op[0] == "grow":
            op = ("grow", op[1], jump)  # growth far beyond C/8: G3 is not promised, G1 and G2 are
        apply_operation(policy, live, op, serial)
        assert all(state.kv_tokens <= capacity for state in policy.instances().values())
        assert policy.cluster.op_items <= budget


def _config(**overrides) -> KVSchedulerConfig:
    return KVSchedulerConfig(**{"capacity": 800, "growth_headroom": 0.0, **overrides})


def test_two_deficient_t_instances_are_merged_when_only_one_may_be():
    policy = make_policy("mell", _config(max_deficient_per_category=1, consolidation_max_load=0.0))
    for name in "abcdefgh":
        policy.allocate(name, 200)  # best fit: a-d fill instance-0, e-h instance-1
    assert {s.kv_tokens for s in policy.instances().values()} == {800}
    policy.drain_migrations()
    for name in "abef":
        policy.depart(name)  # both instances at 400 <= 3/4 C: two deficient T-instances
    migrations = policy.drain_migrations()
    assert [m.reason for m in migrations] == ["repair", "repair"]
    assert [state.kv_tokens for state in policy.instances().values()] == [800]


def test_a_second_deficient_instance_is_allowed_with_two_exceptions():
    policy = make_policy("mell", _config(max_deficient_per_category=2, consolidation_max_load=0.0))
    for name in "abcdefgh":
        policy.allocate(name, 200)
    for name in "abef":
        policy.depart(name)
    policy.drain_migrations()
    assert sorted(state.kv_tokens for state in policy.instances().values()) == [400, 400]


def test_the_lightest_instance_is_drained_when_the_others_have_room():
    def run(slack: float) -> list:
        policy = make_policy("mell", KVSchedulerConfig(capacity=1000, consolidation_slack=slack))
        for name in ("x", "y", "z", "w", "v"):
            policy.allocate(name, 300)  # x, y, z on instance-0 (900); w, v on instance-1 (600)
        policy.depart("x")
        policy.depart("y")  # instance-0 holds 300 and fits into instance-1 (900 <= C - C/16)
        return policy.drain_migrations(), policy.num_instances

    migrations, num_instances = run(slack=0.0)
    assert [(m.request_id, m.reason, m.source, m.destination) for m in migrations] == [
        ("z", "consolidate", "instance-0", "instance-1")]
    assert num_instances == 1
    # With a quarter instance of slack required, leaving 100 tokens free in all is not enough.
    assert run(slack=0.25) == ([], 2)


def test_overflow_moves_one_item_and_leaves_the_growth_headroom():
    policy = make_policy("mell", KVSchedulerConfig(capacity=1000, growth_headroom=1 / 10))
    for name, tokens in (("a", 400), ("b", 300), ("c", 150), ("d", 50)):
        policy.allocate(name, tokens)
    assert policy.num_instances == 1
    policy.update("a", 520)  # 1020 tokens: over by 20; moving 120+ also restores the 100-token headroom
    [migration] = policy.drain_migrations()
    assert (migration.request_id, migration.reason) == ("c", "overflow")
    assert sorted(state.kv_tokens for state in policy.instances().values()) == [150, 870]
