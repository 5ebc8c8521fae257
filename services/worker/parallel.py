"""The worker's torch.distributed state: one world, the process groups of every candidate topology (the MPU state
space), TP collectives and the PP hand-off of hidden states."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from services.model.layers import SingleRankGroup, TPGroup
from services.topology import Topology


class DistTPGroup:
    """A TP group backed by a torch.distributed process group."""

    def __init__(self, group: dist.ProcessGroup, ranks: tuple[int, ...], rank: int) -> None:
        self.group = group
        self.ranks = ranks
        self.size = len(ranks)
        self.rank = ranks.index(rank)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=-1)


class ParallelState:
    """Membership of this worker in the world and in every candidate topology's groups."""

    def __init__(self, rank: int, world_size: int, store_host: str, store_port: int, backend: str,
                 timeout_s: float) -> None:
        if store_host in ("127.0.0.1", "localhost") and backend == "gloo":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: do not guess an interface
        self.timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(store_host, store_port, world_size, is_master=False, timeout=self.timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=self.timeout)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self.candidates: list[Topology] = []

    def build_groups(self, candidates: list[Topology]) -> None:
        """Create the TP groups of every candidate. Collective: every rank calls it with the same list."""
        for topology in candidates:
            for ranks in self.tp_group_ranks(topology):
                if len(ranks) > 1 and ranks not in self._groups:
                    self._groups[ranks] = dist.new_group(list(ranks), timeout=self.timeout, backend=self.backend)
            self.candidates.append(topology)

    @staticmethod
    def tp_group_ranks(topology: Topology) -> list[tuple[int, ...]]:
        """World ranks of each stage's TP group; the active workers are ranks 0..tp*pp-1 in stage-major order."""
        return [tuple(range(s * topology.tp, (s + 1) * topology.tp)) for s in range(topology.pp)]

    def tp_group(self, topology: Topology, pp_rank: int) -> TPGroup:
        """The TP group of this worker's stage (a single-rank group when tp == 1)."""
        ranks = self.tp_group_ranks(topology)[pp_rank]
        if len(ranks) == 1:
            return SingleRankGroup()
        if ranks not in self._groups:
            raise RuntimeError(f"no process group for {topology} stage {pp_rank}: not a candidate topology")
        return DistTPGroup(self._groups[ranks], ranks, self.rank)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """PP hand-off to the next stage (blocking)."""
        dist.send(tensor.contiguous(), dst=dst)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int) -> torch.Tensor:
        """PP hand-off from the previous stage (blocking)."""
        buffer = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buffer, src=src)
        return buffer

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
