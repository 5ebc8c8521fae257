"""The workers' torch.distributed TCPStore, hosted by a process that outlives any worker.

Every generation of the workers' world rendezvouses in it (a regroup after a lost worker uses a fresh prefix), so
it must not live in a worker: `reconfig up` hosts it in the launcher, the containers in the weight store.
"""

from __future__ import annotations

from datetime import timedelta


def host_tcp_store(port: int, timeout_s: float = 60.0, host: str = "0.0.0.0"):
    """Serve a TCPStore on host:port from this process (keep the returned object alive as long as the world)."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
