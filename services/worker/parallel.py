"""The worker's torch.distributed state: one world, the process groups of every candidate topology (the MPU state
space), TP collectives, the PP hand-off of hidden states and the world's agreements.

Every rank set has two groups, as vLLM's GroupCoordinator keeps them: a CPU group (gloo) for flags, agreements,
barriers and metadata, and a device group for tensors on the device (NCCL across GPUs; gloo on CPU and for ranks
that share one GPU). A host tensor on an NCCL group fails at run time ("No backend type associated with device
type cpu"), so each call names the group of its kind; none uses the default group implicitly.
"""

from __future__ import annotations

import gc
import os
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from services.model.layers import SingleRankGroup, TPGroup
from services.runtime.host import interface_of
from services.topology import Topology
from services.worker.shm_exchange import ShmAllToAll, on_one_host

CPU_BACKEND = "gloo"  # flags, agreements, barriers, metadata: host tensors on every machine


def device_backend(device: str, gpu_sharing: bool) -> str:
    """Backend of the tensor collectives: NCCL across GPUs; gloo on CPU, and for ranks that share a GPU (NCCL
    refuses two ranks on one device: 'Duplicate GPU detected')."""
    return "nccl" if device == "cuda" and not gpu_sharing else "gloo"


def needs_host_staging(device: torch.device, backend: str) -> bool:
    """Whether a point-to-point op of a tensor on `device` over `backend` goes through host memory: gloo's
    send/recv take host tensors only (its all-reduce and all-gather take CUDA tensors and stage them itself)."""
    return backend == "gloo" and device.type != "cpu"


@dataclass(slots=True)
class GroupPair:
    """The two process groups of one rank set."""

    cpu: dist.ProcessGroup
    device: dist.ProcessGroup


class DistTPGroup:
    """A TP group backed by torch.distributed: tensors on its device group; its CPU group for metadata."""

    def __init__(self, groups: GroupPair, ranks: tuple[int, ...], rank: int) -> None:
        self.device_group: dist.ProcessGroup | None = groups.device
        self.cpu_group: dist.ProcessGroup | None = groups.cpu
        self.ranks = ranks
        self.size = len(ranks)
        self.rank = ranks.index(rank)
        self._bulk: ShmAllToAll | bool | None = None  # None: not asked yet; False: none here

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=_live(self.device_group))
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor, group=_live(self.device_group))
        return torch.cat(parts, dim=-1)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                   input_splits: list[int]) -> torch.Tensor:
        """EP dispatch / combine: variable row counts per peer, one all_to_all_single on the device group."""
        dist.all_to_all_single(output, input.contiguous(), output_splits, input_splits,
                               group=_live(self.device_group))
        return output

    def bulk_exchange(self) -> ShmAllToAll | None:
        """An all-to-all of large host buffers through shared memory (services/worker/shm_exchange.py) when the
        group's tensors live on the host (gloo) and every rank is on this host; None otherwise (NCCL moves device
        buffers itself). The first call is a collective of the group: every rank asks at the same point."""
        if self._bulk is None:
            cpu = _live(self.cpu_group)
            on_host = dist.get_backend(_live(self.device_group)) == "gloo"
            self._bulk = ShmAllToAll(cpu, self.rank) if on_host and on_one_host(cpu) else False
        return self._bulk or None

    def drop(self) -> None:
        """Forget both groups (the worker left its world)."""
        self.device_group = self.cpu_group = None


def _live(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if group is None:  # never fall back to the default group (group=None means the whole world)
        raise RuntimeError("this worker left its world: the group is gone until the next regroup")
    return group


def gloo_interface(store_host: str, bind_host: str) -> str | None:
    """The interface gloo's sockets should use: loopback for a world on loopback; else the one holding the address
    the worker serves on (its peers on other hosts reach it there); None: gloo's own guess, from the host name
    (which resolves to loopback, or not at all, on many machines: set GLOO_SOCKET_IFNAME then)."""
    if store_host in ("127.0.0.1", "localhost"):
        return "lo"
    return interface_of(bind_host) if bind_host else None


class ParallelState:
    """Membership of this worker in the world and in every candidate topology's groups.

    The world can be re-formed (regroup): after a worker is lost, the survivors leave the broken world and join a
    new one of the next generation, renumbered; a replacement joins the same way. Each generation rendezvouses
    under its own prefix of the launcher's TCPStore, so keys of an older world never mix in.
    """

    def __init__(self, rank: int, world_size: int, store_host: str, store_port: int, backend: str,
                 timeout_s: float, join: bool = False, bind_host: str = "") -> None:
        """Join the first world (generation 0) as `rank`, with `backend` for the device groups (see
        device_backend); with `join`, only connect to the store (a worker started to replace a lost one waits
        outside any world for its regroup). `bind_host`: the address this worker serves on, whose interface
        gloo then uses (see gloo_interface)."""
        interface = gloo_interface(store_host, bind_host)
        if interface:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        self.timeout = timedelta(seconds=timeout_s)
        self.backend = backend
        self._store = dist.TCPStore(store_host, store_port, world_size, is_master=False, timeout=self.timeout)
        self._groups: dict[tuple[int, ...], GroupPair] = {}
        self.world: GroupPair | None = None
        self.candidates: list[Topology] = []
        self.generation = 0
        self.broken = False  # left the world after a failure: only a regroup makes it usable again
        self._handles: weakref.WeakSet[DistTPGroup] = weakref.WeakSet()  # groups handed to models
        self.rank, self.world_size = (-1, 0) if join else (rank, world_size)
        if not join:
            self._join_world(self._store, rank, world_size)

    @property
    def in_world(self) -> bool:
        """In a usable world (not joining, not left after a failure)."""
        return self.rank >= 0 and not self.broken

    def _join_world(self, store: dist.Store, rank: int, world_size: int) -> None:
        """The default group is the world's device group; the world's CPU group is a gloo group beside it."""
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=world_size, timeout=self.timeout)
        cpu = dist.new_group(timeout=self.timeout, backend=CPU_BACKEND, group_desc="cpu/world")
        self.world = GroupPair(cpu=cpu, device=dist.group.WORLD)

    def leave(self) -> None:
        """Leave the world now, after a failure (a peer died, a collective broke): every process group is dropped
        so that its sockets close, and peers blocked on this worker fail at once instead of at their timeout.
        The rank is kept (it says which slice this worker held) until the regroup."""
        for handle in list(self._handles):
            handle.drop()  # the models' references: gloo closes a pair only when nothing holds its group
        self._groups.clear()
        self.world = None
        self.close()
        gc.collect()
        self.broken = True

    def regroup(self, generation: int, rank: int, world_size: int, candidates: list[Topology]) -> None:
        """Leave the current world (it may be broken: a member died) and join generation `generation` as `rank`
        of `world_size`, then build the candidates' groups (both kinds). Collective over the new world's members."""
        if generation <= self.generation:
            raise ValueError(f"generation {generation} is not newer than this worker's {self.generation}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a world of size {world_size}")
        self.leave()
        self.candidates = []
        self._join_world(dist.PrefixStore(f"reconfig/generation-{generation}/", self._store), rank, world_size)
        self.rank, self.world_size, self.generation, self.broken = rank, world_size, generation, False
        self.build_groups([t for t in candidates if t.num_workers <= world_size])

    def build_groups(self, candidates: list[Topology]) -> None:
        """Create the TP groups (a CPU and a device group each) of every candidate. Collective: every rank calls
        it with the same list, so every rank creates the same groups in the same order."""
        for topology in candidates:
            for ranks in self.tp_group_ranks(topology):
                if len(ranks) > 1 and ranks not in self._groups:
                    name = "tp" + "-".join(map(str, ranks))
                    self._groups[ranks] = GroupPair(
                        cpu=dist.new_group(list(ranks), self.timeout, CPU_BACKEND, group_desc=f"cpu/{name}"),
                        device=dist.new_group(list(ranks), self.timeout, self.backend, group_desc=f"device/{name}"),
                    )
            self.candidates.append(topology)

    @staticmethod
    def tp_group_ranks(topology: Topology) -> list[tuple[int, ...]]:
        """World ranks of each stage's group (TP, or EP: the same rank sets serve both); the active workers are
        ranks 0..stage_size*pp-1 in stage-major order."""
        size = topology.stage_size
        return [tuple(range(s * size, (s + 1) * size)) for s in range(topology.pp)]

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

    # ---- the world's CPU group: flags, agreements, metadata ------------------------------------------------------
    def agree(self, ok: bool) -> bool:
        """True when every rank of the world says ok (an all-reduce MIN; also the per-layer barrier)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._world().cpu)
        return bool(flag.item())

    def all_gather_object(self, value: object) -> list[object]:
        """Every rank's `value`, in rank order (picklable metadata, never tensors)."""
        gathered: list[object] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self._world().cpu)
        return gathered

    # ---- the world's device group: tensors ----------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """PP hand-off to the next stage (blocking)."""
        dist.send(self._host(tensor, copy=True), dst=dst, group=self._world().device)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int) -> torch.Tensor:
        """PP hand-off from the previous stage (blocking)."""
        buffer = torch.empty(shape, dtype=dtype, device=device)
        host = self._host(buffer, copy=False)
        dist.recv(host, src=src, group=self._world().device)
        return buffer.copy_(host) if host is not buffer else buffer

    def exchange(self, sends: list[tuple[torch.Tensor, int]], receives: list[tuple[torch.Tensor, int]],
                 tag: int) -> None:
        """Batched point-to-point over the world's device group (KV moves): send each (tensor, dst rank), fill
        each (buffer, src rank) in place. Device tensors on a gloo device group go through host memory."""
        group = self._world().device
        staged = [(buffer, self._host(buffer, copy=False)) for buffer, _ in receives]
        ops = [dist.P2POp(dist.isend, self._host(tensor, copy=True), dst, group, tag) for tensor, dst in sends]
        ops += [dist.P2POp(dist.irecv, host, src, group, tag) for (_, host), (_, src) in zip(staged, receives)]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for buffer, host in staged:
            if host is not buffer:
                buffer.copy_(host)

    def _world(self) -> GroupPair:
        if self.world is None:
            raise RuntimeError("this worker is in no world: its groups are gone until the next regroup")
        return self.world

    def _host(self, tensor: torch.Tensor, copy: bool) -> torch.Tensor:
        """`tensor` itself (contiguous), or a host tensor standing in for it where the device group cannot carry
        it (see needs_host_staging): holding its data when sending (`copy`), empty when receiving into it."""
        if not needs_host_staging(tensor.device, self.backend):
            return tensor.contiguous()
        host = torch.empty(tensor.shape, dtype=tensor.dtype)  # contiguous, whatever the layout of `tensor`
        return host.copy_(tensor) if copy else host

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
