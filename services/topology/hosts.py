"""Host-aware placement, as the engines place a layout on several machines: a stage's TP (or EP) group inside one
host where it can be, pipeline stages across hosts. Ranks are host-major (every worker of a host next to the others),
so the contiguous rank sets of a stage stay on one host whenever a host holds a multiple of the stage size."""

from __future__ import annotations

from collections.abc import Sequence

from services.topology.topology import groups_across_hosts

__all__ = ["groups_across_hosts", "host_major_order"]


def host_major_order(hosts: Sequence[str]) -> list[int]:
    """Indices of `hosts` (each worker's host, in rank order) grouped host by host, the hosts in order of first
    appearance and each host's workers in their order: the ranks a re-formed world gives them."""
    first_seen = {host: index for index, host in reversed(list(enumerate(hosts)))}
    return sorted(range(len(hosts)), key=lambda index: (first_seen[hosts[index]], index))
