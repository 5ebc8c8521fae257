"""The nodes of an instance over several hosts meet in the leader's TCPStore (services/launch/nodes.py): records,
their checks, the leader's stop, and the flags that say which node this is."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from services.launch.nodes import (
    NodeLayout,
    NodeMismatch,
    NodeRecord,
    announce_stop,
    check_records,
    leader_gone,
    missing_nodes,
    register,
    wait_for_nodes,
)
from services.launch.up_config import UpConfig


def test_a_layout_gives_each_node_its_ranks():
    layout = NodeLayout(nodes=3, node_rank=1, workers_per_node=2, dist_addr="10.0.0.1:29600")
    assert layout.world_size == 6 and list(layout.ranks) == [2, 3] and not layout.leader
    assert (layout.dist_host, layout.dist_port) == ("10.0.0.1", 29600)
    assert list(NodeLayout().ranks) == [0] and not NodeLayout().multi


@pytest.mark.parametrize("kwargs, message", [
    (dict(nodes=2, node_rank=2, dist_addr="h:1"), "node_rank must be in 0..1"),
    (dict(nodes=2, dist_addr=""), "needs --dist-addr HOST:PORT"),
    (dict(nodes=2, dist_addr="h:99999"), "needs --dist-addr"),
    (dict(nodes=0), "must be >= 1"),
])
def test_bad_node_flags_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NodeLayout(**kwargs)


def test_up_refuses_nodes_without_a_shared_token_or_a_reachable_host(tmp_path):
    with pytest.raises(ValueError, match="--nodes needs --token-file"):
        UpConfig(nodes=2, dist_addr="10.0.0.1:29600", host="10.0.0.1")
    token = tmp_path / "token"
    with pytest.raises(ValueError, match="--host set to this host's address"):
        UpConfig(nodes=2, dist_addr="10.0.0.1:29600", token_file=str(token))
    with pytest.raises(ValueError, match="does not combine with --instances"):
        UpConfig(nodes=2, dist_addr="10.0.0.1:29600", token_file=str(token), host="10.0.0.1", instances=2)


def _record(node: int, digest: str = "d", workers: int = 2) -> NodeRecord:
    return NodeRecord(node, f"host{node}", tuple(f"10.0.0.{node + 1}:{5000 + i}" for i in range(workers)), digest, 1)


def test_the_leader_waits_for_every_follower_and_checks_their_weights():
    layout = NodeLayout(nodes=3, node_rank=0, workers_per_node=2, dist_addr="127.0.0.1:1")
    leader = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    follower = dist.TCPStore("127.0.0.1", leader.port, is_master=False, timeout=timedelta(seconds=10))
    register(follower, _record(2))
    assert missing_nodes(leader, layout) == [1]
    with pytest.raises(dist.DistStoreError):
        wait_for_nodes(leader, layout, timeout_s=0.2)
    register(follower, _record(1))
    records = wait_for_nodes(leader, layout, timeout_s=10)
    assert [r.node_rank for r in records] == [1, 2] and records[0] == _record(1)  # a JSON round trip
    check_records(records, layout, "d")
    with pytest.raises(NodeMismatch, match="node 1 .* serves other weights"):
        check_records(records, layout, "other")
    with pytest.raises(NodeMismatch, match="runs 3 workers, the leader 2"):
        check_records([_record(1, workers=3)], layout, "d")


def test_a_follower_sees_the_leader_stop_or_go():
    leader = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    follower = dist.TCPStore("127.0.0.1", leader.port, is_master=False, timeout=timedelta(seconds=2))
    assert leader_gone(follower) == ""
    announce_stop(leader)
    assert leader_gone(follower) == "the leader stopped"
    other = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    orphan = dist.TCPStore("127.0.0.1", other.port, is_master=False, timeout=timedelta(seconds=2))
    del other  # the leader's launcher, which holds the store, is gone
    assert leader_gone(orphan).startswith("the leader's store stopped answering")
