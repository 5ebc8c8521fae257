"""An instance over several hosts (nodes), as SGLang's `--nnodes/--node-rank/--dist-init-addr` spans them.

Node 0, the leader, runs the router, the controller and the workers' torch.distributed TCPStore (on --dist-addr)
beside its own weight store and workers; every other node runs a weight store of its own (it loads the checkpoint
itself and serves its host's workers from its own shared memory) and its workers, which join the leader's world.
Node r holds ranks r*w .. r*w+w-1 (w workers a node): contiguous, so a stage's TP group stays inside a host while
tp <= w, and PP crosses hosts, as the engines place them.

The nodes meet in the TCPStore: each follower, once its workers serve, writes a NodeRecord (its workers' addresses
and the digest of its weight store's manifest) under `reconfig/nodes/<r>`; the leader waits for all of them, checks
that every store holds the same bytes, and hands the whole worker list to the router and the controller. When the
leader stops it writes `reconfig/leader-stopped`, and the followers stop their processes (as they do when the store
stops answering: the leader is gone).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import timedelta

from services.runtime.host import address_host

_NODE_KEY = "reconfig/nodes/{}"
_STOP_KEY = "reconfig/leader-stopped"


@dataclass(frozen=True, slots=True)
class NodeLayout:
    """Which node this is, how many there are, and where the leader's store listens."""

    nodes: int = 1
    node_rank: int = 0
    workers_per_node: int = 1
    dist_addr: str = ""  # "host:port" of the leader's TCPStore ("" with one node: any free port on this host)

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.workers_per_node < 1:
            raise ValueError(f"nodes and workers must be >= 1, not {self.nodes} and {self.workers_per_node}")
        if not 0 <= self.node_rank < self.nodes:
            raise ValueError(f"node_rank must be in 0..{self.nodes - 1}, not {self.node_rank}")
        if self.nodes > 1:
            host, _, port = self.dist_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) <= 65535:
                raise ValueError(f"--nodes {self.nodes} needs --dist-addr HOST:PORT (the leader's address and a "
                                 f"free port for the workers' store), not {self.dist_addr!r}")

    @property
    def multi(self) -> bool:
        return self.nodes > 1

    @property
    def leader(self) -> bool:
        return self.node_rank == 0

    @property
    def world_size(self) -> int:
        return self.nodes * self.workers_per_node

    @property
    def ranks(self) -> range:
        """This node's world ranks."""
        first = self.node_rank * self.workers_per_node
        return range(first, first + self.workers_per_node)

    @property
    def dist_host(self) -> str:
        return address_host(self.dist_addr)

    @property
    def dist_port(self) -> int:
        return int(self.dist_addr.rpartition(":")[2])


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """What a follower tells the leader once its workers serve."""

    node_rank: int
    hostname: str
    worker_addresses: tuple[str, ...]  # by rank
    manifest_digest: str  # Manifest.content_digest() of its weight store
    launcher_pid: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeRecord:
        data = json.loads(text)
        return cls(**{**data, "worker_addresses": tuple(data["worker_addresses"])})


class NodeMismatch(RuntimeError):
    """A node cannot join this instance (other weights, another worker count)."""


def register(store, record: NodeRecord) -> None:
    """A follower's record, for the leader (`store`: a TCPStore client of the leader's); returns once the
    leader can see it."""
    _set_visibly(store, _NODE_KEY.format(record.node_rank), record.to_json())


def _set_visibly(store, key: str, value: str) -> None:
    """Set `key` and return once every client of the store can read it. A TCPStore client's set is not
    acknowledged; its connection is served in order, so a read behind it returns only after the set is applied."""
    store.set(key, value)
    store.get(key)


def wait_for_nodes(store, layout: NodeLayout, timeout_s: float) -> list[NodeRecord]:
    """Every follower's record, by node rank, once all are there (DistStoreError after timeout_s, naming none:
    the caller says which are missing)."""
    keys = [_NODE_KEY.format(r) for r in range(1, layout.nodes)]
    store.wait(keys, timedelta(seconds=timeout_s))
    return [NodeRecord.from_json(store.get(key)) for key in keys]


def missing_nodes(store, layout: NodeLayout) -> list[int]:
    """The followers that have not registered yet."""
    return [r for r in range(1, layout.nodes) if not store.check([_NODE_KEY.format(r)])]


def check_records(records: list[NodeRecord], layout: NodeLayout, digest: str) -> None:
    """NodeMismatch unless every follower runs its share of the ranks on the leader's weights."""
    for record in records:
        if record.manifest_digest != digest:
            raise NodeMismatch(f"node {record.node_rank} ({record.hostname}) serves other weights than the leader "
                               "(its weight store's manifest differs): start every node on the same checkpoint")
        if len(record.worker_addresses) != layout.workers_per_node:
            raise NodeMismatch(f"node {record.node_rank} ({record.hostname}) runs {len(record.worker_addresses)} "
                               f"workers, the leader {layout.workers_per_node}: give every node the same --workers")


def announce_stop(store) -> None:
    """The leader is stopping: the followers stop their processes (returns once they can see it)."""
    _set_visibly(store, _STOP_KEY, "1")


def leader_gone(store) -> str:
    """Why this follower's instance is over ("" while the leader serves)."""
    try:
        return "the leader stopped" if store.check([_STOP_KEY]) else ""
    except Exception as exc:  # a broken connection: the leader's launcher (which holds the store) is gone
        return f"the leader's store stopped answering ({type(exc).__name__}: {exc})"
