"""The worker's torch.distributed state: one world, the process groups of every candidate topology (the MPU state
space), TP collectives and the PP hand-off of hidden states."""

from __future__ import annotations

import gc
import os
import weakref
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
        dist.all_reduce(tensor, group=self._live())
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor, group=self._live())
        return torch.cat(parts, dim=-1)

    def _live(self) -> dist.ProcessGroup:
        if self.group is None:  # never fall back to the default group (group=None means the whole world)
            raise RuntimeError("this worker left its world: the group is gone until the next regroup")
        return self.group


class ParallelState:
    """Membership of this worker in the world and in every candidate topology's groups.

    The world can be re-formed (regroup): after a worker is lost, the survivors leave the broken world and join a
    new one of the next generation, renumbered; a replacement joins the same way. Each generation rendezvouses
    under its own prefix of the launcher's TCPStore, so keys of an older world never mix in.
    """

    def __init__(self, rank: int, world_size: int, store_host: str, store_port: int, backend: str,
                 timeout_s: float, join: bool = False) -> None:
        """Join the first world (generation 0) as `rank`; with `join`, only connect to the store (a worker
        started to replace a lost one waits outside any world for its regroup)."""
        if store_host in ("127.0.0.1", "localhost") and backend == "gloo":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: do not guess an interface
        self.timeout = timedelta(seconds=timeout_s)
        self.backend = backend
        self._store = dist.TCPStore(store_host, store_port, world_size, is_master=False, timeout=self.timeout)
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self.candidates: list[Topology] = []
        self.generation = 0
        self.broken = False  # left the world after a failure: only a regroup makes it usable again
        self._handles: weakref.WeakSet[DistTPGroup] = weakref.WeakSet()  # groups handed to models
        self.rank, self.world_size = (-1, 0) if join else (rank, world_size)
        if not join:
            dist.init_process_group(backend, store=self._store, rank=rank, world_size=world_size, timeout=self.timeout)

    @property
    def in_world(self) -> bool:
        """In a usable world (not joining, not left after a failure)."""
        return self.rank >= 0 and not self.broken

    def leave(self) -> None:
        """Leave the world now, after a failure (a peer died, a collective broke): every process group is dropped
        so that its sockets close, and peers blocked on this worker fail at once instead of at their timeout.
        The rank is kept (it says which slice this worker held) until the regroup."""
        for handle in list(self._handles):
            handle.group = None  # the models' references: gloo closes a pair only when nothing holds its group
        self._groups.clear()
        self.close()
        gc.collect()
        self.broken = True

    def regroup(self, generation: int, rank: int, world_size: int, candidates: list[Topology]) -> None:
        """Leave the current world (it may be broken: a member died) and join generation `generation` as `rank`
        of `world_size`, then build the candidates' groups. Collective over the new world's members."""
        if generation <= self.generation:
            raise ValueError(f"generation {generation} is not newer than this worker's {self.generation}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a world of size {world_size}")
        self.leave()
        self.candidates = []
        store = dist.PrefixStore(f"reconfig/generation-{generation}/", self._store)
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=world_size, timeout=self.timeout)
        self.rank, self.world_size, self.generation, self.broken = rank, world_size, generation, False
        self.build_groups([t for t in candidates if t.num_workers <= world_size])

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
        handle = DistTPGroup(self._groups[ranks], ranks, self.rank)
        self._handles.add(handle)
        return handle

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
