"""An all-to-all of large host buffers among the workers of one host, through shared memory.

The experts' TP <-> EP reshard moves a layer of expert weights per rank in one all-to-all; over gloo those bytes
cross loopback TCP at 0.07-0.09 GB/s per worker (bench/moe_switch.py, 4 workers on 2 cores). Here each rank packs
its send buffer straight into a shared-memory segment of its own (`send_buffer`), the ranks trade the segments'
names (one small collective on the group's CPU group: it returns once every rank has packed), each copies its part
out of every peer's segment into its receive buffer, and a barrier lets the segments go: each byte is copied once
more than the pack, and never through a socket.
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.distributed as dist

from services.runtime.host import shm_domain
from services.weightstore.shm import ShmSegment, cleanup_stale_segments, segment_name

SEGMENT_PREFIX = "reconfig-a2a-"
_serial = itertools.count()


def cleanup_stale_exchange_segments() -> list[str]:
    """Remove segments of workers that died mid-exchange (kill -9)."""
    return cleanup_stale_segments(prefix=SEGMENT_PREFIX)


def on_one_host(cpu_group: dist.ProcessGroup) -> bool:
    """Whether every rank of the group sees this host's shared memory (a collective of the group: every rank calls
    it)."""
    hosts: list[object] = [None] * dist.get_world_size(cpu_group)
    dist.all_gather_object(hosts, shm_domain(), group=cpu_group)
    return len(set(hosts)) == 1


class ShmAllToAll:
    """All-to-alls of host tensors among the ranks of `cpu_group` (one host); one at a time, every rank calling."""

    def __init__(self, cpu_group: dist.ProcessGroup, rank: int) -> None:
        self.cpu_group = cpu_group
        self.rank = rank  # in the group
        self._segment: ShmSegment | None = None  # this rank's send buffer until its exchange ends
        self._ready = False  # a send buffer was handed out for the next all_to_all

    def send_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D buffer of `numel` elements in a new segment (none when it is empty: this rank sends nothing):
        pack into it, then pass it to `all_to_all`."""
        self._release()
        self._ready = True
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        self._segment = ShmSegment.create(segment_name(os.getpid(), next(_serial), SEGMENT_PREFIX),
                                          numel * dtype.itemsize)
        return torch.frombuffer(self._segment.buffer, dtype=dtype, count=numel)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                   input_splits: list[int]) -> torch.Tensor:
        """As `all_to_all_single`: `input` (this rank's `send_buffer`) holds each peer's part in rank order,
        `input_splits` long; `output` receives each peer's part for this rank, `output_splits` long."""
        if not self._ready:
            raise RuntimeError("all_to_all needs the send buffer of this exchange (send_buffer)")
        size = len(input_splits)
        peers: list[object] = [None] * size
        name = self._segment.name if self._segment is not None else ""
        dist.all_gather_object(peers, (name, list(input_splits)), group=self.cpu_group)
        try:
            offset = 0
            for peer, (name, splits) in enumerate(peers):
                count = output_splits[peer]
                start = sum(splits[:self.rank])
                if splits[self.rank] != count:
                    raise ValueError(f"rank {peer} sends {splits[self.rank]} elements here, {count} expected")
                if count:
                    source = input if peer == self.rank else None
                    segment = None
                    if source is None:
                        segment = ShmSegment.attach(name, readonly=True, copy_on_write=True)
                        source = torch.frombuffer(segment.buffer, dtype=output.dtype,
                                                  count=segment.size // output.element_size())
                    output[offset:offset + count].copy_(source[start:start + count])
                    del source
                    if segment is not None:
                        segment.close()
                offset += count
        finally:
            dist.barrier(group=self.cpu_group)  # every peer has read this rank's segment
            self._release()
        return output

    def discard(self) -> None:
        """Give up the send buffer without an exchange (every rank of the group does: a failed pack)."""
        self._release()

    def _release(self) -> None:
        """Unlink this rank's segment; it unmaps once the last tensor over it (the caller's send buffer) is gone
        (closing it under a live view would leave the view pointing at unmapped memory)."""
        self._ready = False
        if self._segment is not None:
            self._segment.unlink()
            self._segment = None
