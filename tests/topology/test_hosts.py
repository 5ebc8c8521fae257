"""Host-aware placement: host-major ranks, stage groups across hosts, and the degraded layout that avoids them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.topology import (
    ModelShape,
    Topology,
    candidate_topologies,
    degraded_topology,
    groups_across_hosts,
    host_major_order,
)

hosts_lists = st.lists(st.sampled_from("abcd"), min_size=1, max_size=12)


@given(hosts_lists)
def test_host_major_order_is_a_stable_permutation_that_groups_each_host(hosts):
    order = host_major_order(hosts)
    assert sorted(order) == list(range(len(hosts)))
    ordered = [hosts[i] for i in order]
    changes = sum(1 for a, b in zip(ordered, ordered[1:]) if a != b)
    assert changes == len(set(hosts)) - 1  # each host's workers side by side
    for host in set(hosts):  # in their own order
        mine = [i for i in order if hosts[i] == host]
        assert mine == sorted(mine)
    assert host_major_order(ordered) == list(range(len(hosts)))  # already host-major: nothing moves


@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 4))
def test_no_stage_group_crosses_hosts_when_each_host_holds_whole_groups(tp, groups_per_host, pp):
    topology = Topology(tp=tp, pp=pp)
    per_host = tp * groups_per_host
    hosts = [f"h{rank // per_host}" for rank in range(tp * pp)]
    assert groups_across_hosts(topology, hosts) == 0
    if tp > 1 and tp * pp >= per_host:  # a host boundary one rank early falls inside a group
        shifted = [f"h{(rank + 1) // per_host}" for rank in range(tp * pp)]
        assert groups_across_hosts(topology, shifted) >= 1


def test_a_degraded_layout_keeps_tp_inside_a_host():
    shape = ModelShape(num_layers=4, num_heads=8, num_kv_heads=2, head_dim=8, hidden_size=64, intermediate_size=128,
                       vocab_size=256)
    current = Topology.parse("tp2pp2")
    two = candidate_topologies(shape, 2)
    assert Topology.parse("tp2pp1") in two and Topology.parse("tp1pp2") in two
    # One worker left on each host: tp2 would all-reduce across them; pp2 only hands off.
    assert str(degraded_topology(current, shape, 2, hosts=["a", "b"])) == "tp1pp2"
    # Both on one host: the nearest tp, as before.
    assert str(degraded_topology(current, shape, 2, hosts=["a", "a"])) == "tp2pp1"
    assert str(degraded_topology(current, shape, 2)) == "tp2pp1"
