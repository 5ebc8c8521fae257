"""`reconfig up --nodes N --node-rank R` with R > 0: a follower host of an instance (services/launch/nodes.py). It
runs this host's weight store and workers, registers them with the leader, and supervises them until the leader
stops (or its store stops answering), Ctrl-C or SIGTERM. A lost worker here is the leader's controller's to
recover from; this launcher starts a joining replacement, as the leader's does for its own."""

from __future__ import annotations

import signal
import sys
import time

from services.launch.cluster import ClusterConfig, ClusterError, LocalCluster
from services.launch.session import StopRequested, raise_stop


def up_node(config, cluster_config: ClusterConfig) -> int:
    """Serve this node until its instance is over: 0 when the leader stopped or on Ctrl-C/SIGTERM, 1 when a process
    could not start or this node's weight store died. `config`: an UpConfig with node_rank > 0; `cluster_config`:
    this node's processes."""
    started = time.perf_counter()
    layout = cluster_config.layout
    cluster = LocalCluster(cluster_config)
    previous = {sig: signal.signal(sig, raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        cluster.start()
        print(f"reconfig node {layout.node_rank} of {layout.nodes} is up in {time.perf_counter() - started:.1f}s: "
              f"{len(cluster.worker_addresses)} {config.device} workers (ranks {layout.ranks.start}-"
              f"{layout.ranks.stop - 1}) at {', '.join(cluster.worker_addresses)}, in the instance led from "
              f"{config.dist_addr}\nCtrl-C stops this node's processes.", flush=True)
        code = _supervise(config, cluster)
    except StopRequested as stop_signal:
        print(f"reconfig up: {stop_signal} received; stopping this node", file=sys.stderr, flush=True)
    except ClusterError as exc:
        print(f"reconfig up: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the cleanup
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"reconfig up: node {layout.node_rank} stopped" + (f" (exit code {code})" if code else ""),
          file=sys.stderr, flush=True)
    return code


def _supervise(config, cluster: LocalCluster) -> int:
    while True:
        gone = cluster.leader_gone()
        if gone:
            print(f"reconfig up: {gone}; stopping this node", file=sys.stderr, flush=True)
            return 0
        for lost in cluster.reap_dead_workers():
            print(f"reconfig up: {lost} exited; the leader's controller moves the stack onto the other workers",
                  file=sys.stderr, flush=True)
            if config.replace_lost_workers:
                address = cluster.start_joiner()
                print(f"reconfig up: a replacement worker is ready at {address}; bring it in with "
                      f"`reconfigctl add-worker {address} --topology {config.topology}` on the leader",
                      file=sys.stderr, flush=True)
        dead = cluster.dead_processes()
        if dead:
            print(f"reconfig up: {', '.join(dead)} exited; stopping this node", file=sys.stderr, flush=True)
            return 1
        time.sleep(0.25)  # not synchronisation: the supervision's polling interval
