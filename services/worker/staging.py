"""STAGING and PRECOPY on one worker, beside the steps (the stage thread, at a low OS priority): the target
layout's shard built from the live one and the weight store; then, round by round, the target's KV pool filled from
the live pools, and with the pool the target's runner (on a GPU its decode graphs captured over the pool). What is
staged serves one switch: its ApplySwitch takes it once (`take`); anything else drops it with its pool. Nothing
live changes here."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import structlog

from services.model.expert_reshard import FROM_STORE
from services.model.llama import ShardedCausalLM
from services.rpc.reconfig.v1 import worker_pb2
from services.topology import Placement, Topology, plan_kv_migration
from services.weightstore.client import MappedCheckpoint
from services.worker.channel import channel_kind, peer_channel
from services.worker.decode_graphs import WARM_BATCHES
from services.worker.faults import FAULTS
from services.worker.kv_cache import KVCache
from services.worker.kv_migration import block_maps_from_proto, merge_block_maps
from services.worker.kv_precopy import StagedKV
from services.worker.model_runner import ModelRunner
from services.worker.pacing import Pacer

if TYPE_CHECKING:
    import torch

    from services.model.expert_reshard import ExpertSwitch
    from services.model.spec import ModelSpec
    from services.weightstore.manifest import Manifest
    from services.worker.config import WorkerConfig
    from services.worker.parallel import ParallelState

log = structlog.get_logger(__name__)


class LiveShard(Protocol):
    """What staging uses of the worker's shard (services.worker.shard.WorkerShard, which owns its Staging): the live
    layout and world, and how the shard builds a layout's model and runner. Declared here so that the shard's module
    is the one that imports: staging sits below it."""

    config: WorkerConfig
    spec: ModelSpec
    manifest: Manifest
    parallel: ParallelState
    device: torch.device
    dtype: torch.dtype
    topology: Topology
    layer_partition: tuple[int, ...] | None
    runner: ModelRunner | None

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def placement(self, topology: Topology, partition) -> Placement: ...

    def build(self, topology: Topology, partition, checkpoint: MappedCheckpoint, previous: ModelRunner | None,
              kv_cache: KVCache | None, model: ShardedCausalLM | None = ...,
              experts: ExpertSwitch = ...) -> ModelRunner | None: ...

    def build_model(self, topology: Topology, partition, checkpoint: MappedCheckpoint, previous: ModelRunner | None,
                    experts: ExpertSwitch = ..., pacer: Pacer = ...) -> ShardedCausalLM: ...


@dataclass(slots=True)
class StagedShard:
    """A target layout's shard built while serving (StageSwitch), for the ApplySwitch of that target."""

    operation_id: str                  # the switch it was staged for: only that one's ApplySwitch takes it
    topology: Topology
    partition: tuple[int, ...] | None
    generation: int                    # the world it was built in (its groups)
    live: ModelRunner | None           # the runner it shares tensors with: it must still be the live one
    model: ShardedCausalLM
    kv: StagedKV | None = None         # the target's KV pool while KV is pre-copied into it (PreCopyKV)
    runner: ModelRunner | None = None  # the target's runner over that pool (its decode graphs captured on a GPU)
    staged_graphs: int = 0             # how many of them

    def is_for(self, operation_id: str, live: ModelRunner | None, generation: int) -> bool:
        """Staged for this operation, over this live runner, in this world."""
        return (self.operation_id, self.generation) == (operation_id, generation) and self.live is live

    def free_pool(self) -> None:
        """Free the staged KV pool and the runner over it (nothing pre-copied into it will be used)."""
        self.runner, self.staged_graphs = None, 0
        if self.kv is not None:
            self.kv.close()
            self.kv = None


def lower_thread_priority(niceness: int = 19) -> None:
    """Give the calling thread (Linux: a task of its own) the lowest scheduling priority: background work such as
    staging yields its cores to the steps (nice 19 measured a few points of TPOT better than 10 while staging on 2
    busy cores; SCHED_IDLE no better). Best effort: where it cannot be done nothing changes."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError):
        pass


def pack_on_own_thread(model: ShardedCausalLM, pacer: Pacer) -> None:
    """Pack the model's weights for MKL (Linear.pack) on a thread of its own that has ended when this returns. MKL
    computes a packed weight with part of the cores for as long as the thread that packed it lives, and the stage
    thread lives as long as the worker: packed there, the layers a switch brought in decoded at 1.4-1.5 of 2 cores
    for the rest of the layout's life (1.9 fresh; bench/after_switch.py). Packed on a thread that ends, they
    compute at full speed on the model thread, and the packing stays out of the freeze."""
    with ThreadPoolExecutor(1, "stage-pack", initializer=lower_thread_priority) as pool:
        packed = pool.submit(model.pack_weights, pacer.piece)
    packed.result()  # the pool's thread has ended (shutdown joined it); a failure is raised here


class Staging:
    """The one owner of what a worker has staged (one switch's shard, pool and runner at a time). StageSwitch and
    PreCopyKV run on the stage thread; `take` and `drop` on the model thread (ApplySwitch, Regroup)."""

    def __init__(self, shard: LiveShard) -> None:
        self.shard = shard
        self._staged: StagedShard | None = None

    def stage_switch(self, request: worker_pb2.StageSwitchRequest) -> worker_pb2.StageSwitchResponse:
        """STAGING: build this rank's shard of the target from the live one and the weight store, and keep it for
        the ApplySwitch of that target. Nothing live changes; the build runs at a low OS priority so that the steps
        keep their cores, and rests as its duty says."""
        self.drop()  # a previous staging is obsolete
        if not request.topology:  # the controller gave up on the switch it staged for
            return worker_pb2.StageSwitchResponse(staged=False)
        shard = self.shard
        target = Topology.parse(request.topology)
        partition = tuple(request.layer_partition) or None
        live, rank = shard.runner, shard.rank
        if not (shard.parallel.in_world and 0 <= rank < target.num_workers and target in shard.parallel.candidates):
            return worker_pb2.StageSwitchResponse(staged=False)  # standby there, or groups to build: apply builds
        lower_thread_priority()
        started = time.perf_counter()
        pacer = Pacer.of_request(request.duty)
        with MappedCheckpoint(shard.manifest) as checkpoint:
            model = shard.build_model(target, partition, checkpoint, live, FROM_STORE, pacer=pacer)
        # MKL's layout (CPU) now, not in the freeze (packing is idempotent: kept parts are)
        pack_on_own_thread(model, pacer)
        seconds = time.perf_counter() - started
        shared = set(model.parameter_tensors()) & set(live.model.parameter_tensors()) if live else set()
        tensors = model.parameter_tensors()
        reused = sum(t.numel() * t.element_size() for i, t in tensors.items() if i in shared)
        loaded = sum(t.numel() * t.element_size() for t in tensors.values()) - reused
        self._staged = StagedShard(request.operation_id, target, partition, shard.parallel.generation, live, model)
        log.info("worker.staged", operation_id=request.operation_id, topology=str(target), rank=rank,
                 seconds=round(seconds, 4), rested_s=round(pacer.rested_s, 4), weights_loaded=loaded,
                 weights_reused=reused)
        return worker_pb2.StageSwitchResponse(staged=True, seconds=seconds, weight_bytes_loaded=loaded,
                                              weight_bytes_reused=reused, rested_seconds=pacer.rested_s)

    def drop(self) -> None:
        """Forget what was staged, freeing its KV pool."""
        staged, self._staged = self._staged, None
        if staged is not None:
            staged.free_pool()

    def take(self, operation_id: str, target: Topology, partition, old: ModelRunner | None) -> StagedShard | None:
        """What was staged for this switch (its operation, built on the live runner, in this world), once; None
        otherwise (a staged pool of another switch is freed)."""
        staged, self._staged = self._staged, None
        if staged is None:
            return None
        if not (staged.is_for(operation_id, old, self.shard.parallel.generation)
                and (staged.topology, staged.partition) == (target, partition)):
            staged.free_pool()
            return None
        return staged

    def precopy_kv(self, request: worker_pb2.PreCopyKVRequest) -> worker_pb2.PreCopyKVResponse:
        """A KV pre-copy round: copy full blocks from the live pools into the staged pool of the target (allocated
        at the first round, with the target's runner over it: on a GPU its decode graphs are captured then).
        ValueError: nothing is staged for the operation on this live runner. supported=False: the peers' pools
        cannot be read directly here (several hosts): the KV moves in the freeze."""
        shard, staged = self.shard, self._staged
        rank = shard.rank
        if staged is None or not staged.is_for(request.operation_id, shard.runner, shard.parallel.generation):
            raise ValueError(f"rank {rank} has no shard staged for operation {request.operation_id!r}")
        kind = channel_kind(request.peers, shard.world_size, shard.device)
        if kind not in ("shm", "ipc"):
            return worker_pb2.PreCopyKVResponse(supported=False)
        live = shard.runner.kv_cache if shard.runner else None
        if staged.kv is None:
            plan = plan_kv_migration(shard.placement(shard.topology, shard.layer_partition),
                                     active_ranks(shard.topology), shard.placement(staged.topology, staged.partition),
                                     active_ranks(staged.topology))
            wp = plan.new.workers[rank]
            block_size = shard.config.block_size
            target = KVCache(wp.layers, len(wp.kv_heads), shard.spec.head_dim, block_size, shard.dtype, shard.device,
                             num_blocks=request.num_kv_blocks, allocate=False)
            channel = peer_channel(kind, request.peers, plan, block_size, shard.spec.head_dim, shard.dtype,
                                   shard.device, keep_open=True)
            staged.kv = StagedKV.allocate(plan, rank, live, target, channel)
            staged.runner, staged.staged_graphs = self._runner(staged, live)
        if staged.kv.cache.num_blocks != request.num_kv_blocks:
            raise ValueError(f"the staged pool holds {staged.kv.cache.num_blocks} blocks, not {request.num_kv_blocks}")
        blocks = merge_block_maps(block_maps_from_proto(request.block_maps),
                                  block_maps_from_proto(request.warm_block_maps))
        stats = staged.kv.copy(live, blocks, fault=lambda layer: FAULTS.check("precopy", rank=rank, layer=layer),
                               pacer=Pacer.of_request(request.duty))
        return worker_pb2.PreCopyKVResponse(
            supported=True, kv_bytes_received=stats.bytes_received, kv_bytes_local=stats.bytes_local,
            seconds=stats.seconds, staged_pool_bytes=staged.kv.num_bytes)

    def _runner(self, staged: StagedShard, live: KVCache | None) -> tuple[ModelRunner | None, int]:
        """The target's runner over the staged pool, and how many decode graphs it captured: on a GPU, over the KV
        tensors the pool will hold after the cutover, when the step holds no collective (a stage of one rank; a TP
        all-reduce would run beside the live layout's: those graphs are captured in the freeze, every rank at once).
        Capturing here took 40-140 ms out of an H100's cutover. A capture that fails is left to the freeze."""
        runner = self.shard.build(staged.topology, staged.partition, None, self.shard.runner, staged.kv.cache,
                                  staged.model)
        if runner is None or runner.graphs is None or staged.topology.stage_size > 1:
            return runner, 0
        started = time.perf_counter()
        try:
            captured = runner.graphs.warm(WARM_BATCHES, layers=staged.kv.future_layers(live))
        except Exception:  # the graphs are only ahead of time: the freeze captures them as before
            log.warning("worker.decode_graphs_staging_failed", rank=self.shard.rank, topology=str(staged.topology),
                        exc_info=True)
            runner.graphs.clear()
            return runner, 0
        log.info("worker.decode_graphs_staged", rank=self.shard.rank, topology=str(staged.topology), graphs=captured,
                 seconds=round(time.perf_counter() - started, 4))
        return runner, captured


def active_ranks(topology: Topology) -> list[int]:
    """World ranks of the active workers: the first tp*pp ranks, stage-major (the rest are on standby)."""
    return list(range(topology.num_workers))


def check_precopied(precopied: StagedKV | None, rank: int, target: Topology,
                    request: worker_pb2.ApplySwitchRequest) -> None:
    """ValueError unless a switch whose KV was pre-copied finds this rank's staged pool of the target (a rank on
    standby there receives nothing)."""
    if request.drop_kv:
        raise ValueError("a switch cannot both drop the KV and use a pre-copy of it")
    if rank >= target.num_workers:
        return
    if precopied is None:
        raise ValueError(f"rank {rank} holds no pre-copied KV pool for operation {request.operation_id!r}")
    if precopied.cache.num_blocks != request.num_kv_blocks:
        raise ValueError(f"rank {rank}'s pre-copied pool holds {precopied.cache.num_blocks} blocks, the switch "
                         f"wants {request.num_kv_blocks}")
