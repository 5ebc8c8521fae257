"""Random operation streams for the scheduler's property tests, and a driver that checks each step."""

from __future__ import annotations

from hypothesis import strategies as st

from services.placement import InstanceState, Move
from services.placement.policy import BasePolicy


@st.composite
def operation_streams(draw, max_ops: int = 120):
    """(capacity, ops): ("alloc", tokens) | ("grow", pick, tokens) | ("shrink", pick, tokens) | ("depart", pick).

    `pick` chooses among live requests by index modulo their number; growth is at most C/8 a step.
    """
    capacity = draw(st.sampled_from([64, 100, 240, 1000, 4096]))
    size = st.one_of(
        st.integers(1, capacity // 8),  # tiny
        st.integers(1, capacity // 2),  # up to M
        st.integers(1, capacity),  # any class
    )
    op = st.one_of(
        st.tuples(st.just("alloc"), size),
        st.tuples(st.just("grow"), st.integers(0, 10_000), st.integers(1, max(1, capacity // 8))),
        st.tuples(st.just("shrink"), st.integers(0, 10_000), st.integers(1, capacity)),
        st.tuples(st.just("depart"), st.integers(0, 10_000)),
    )
    return capacity, draw(st.lists(op, min_size=1, max_size=max_ops))


def apply_operation(policy: BasePolicy, live: dict[str, int], op: tuple, serial: int) -> None:
    """Run one op of a stream on `policy`, keeping `live` (request -> tokens) in step."""
    capacity = policy.config.capacity
    if op[0] == "alloc" or not live:
        tokens = op[1] if op[0] == "alloc" else 1
        request_id = f"q{serial}"
        policy.allocate(request_id, tokens)
        live[request_id] = tokens
        return
    request_id = sorted(live)[op[1] % len(live)]
    if op[0] in ("grow", "shrink"):
        change = op[2] if op[0] == "grow" else -op[2]
        live[request_id] = min(capacity, max(1, live[request_id] + change))
        policy.update(request_id, live[request_id])
    else:
        del live[request_id]
        policy.depart(request_id)


def placements(instances: dict[str, InstanceState]) -> dict[str, str]:
    """request id -> instance id."""
    return {request_id: instance_id for instance_id, state in instances.items() for request_id in state.requests}


def replay(before: dict[str, str], migrations: list[Move]) -> dict[str, str]:
    """Where requests are after applying migrations to a placement (each source must match)."""
    after = dict(before)
    for migration in migrations:
        assert after.get(migration.request_id) == migration.source, migration
        after[migration.request_id] = migration.destination
    return after
