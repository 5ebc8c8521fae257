"""WorkerShard: the one owner of what a worker holds (topology, model shard, KV cache). A switch of its layout
(ApplySwitch) runs in services/worker/switch.py, over what the shard holds and builds."""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import structlog
import torch

from services.model import cpu_kernels
from services.model.expert_reshard import ALONGSIDE, ExpertSwitch
from services.model.kernels import choose as choose_kernels
from services.model.layers import ShardLoader, SingleRankGroup
from services.model.llama import ShardedCausalLM
from services.model.numerics import (
    FAST,
    INVARIANT_WORKERS,
    Numerics,
    choose_row_multiple,
    invariant_numerics,
    invariant_threads,
)
from services.model.spec import ModelSpec
from services.rpc.reconfig.v1 import worker_pb2
from services.runtime.host import shm_domain
from services.topology import Placement, Topology, candidate_topologies, place
from services.topology.eplb import initial_expert_maps
from services.weightstore.client import MappedCheckpoint
from services.weightstore.manifest import Manifest
from services.worker.config import WorkerConfig
from services.worker.kv_cache import KVCache, num_blocks_for_budget
from services.worker.kv_import import KVSourceSpec, RemoteReader, import_kv
from services.worker.kv_remote import export_kv
from services.worker.pacing import UNPACED, Pacer
from services.worker.cuda_ipc import preload_cuda_ipc
from services.worker.expert_balance import ExpertBalancer
from services.worker.decode_graphs import WARM_BATCHES
from services.worker.model_runner import ModelRunner
from services.worker.parallel import ParallelState
from services.worker.staging import Staging, lower_thread_priority
from services.worker.threads import set_threads, threads_per_worker, usable_cores

log = structlog.get_logger(__name__)


def worker_device(config: WorkerConfig) -> torch.device:
    """This worker's device: its assigned GPU (the launcher's placement), else rank % visible GPUs; CPU runs never
    touch CUDA."""
    if config.device == "cuda":
        index = config.gpu if config.gpu is not None else config.rank % torch.cuda.device_count()
        return torch.device("cuda", index)
    return torch.device("cpu")


def _compute_dtype(config: WorkerConfig, spec: ModelSpec, device: torch.device) -> torch.dtype:
    """The configured dtype; "auto": float32 on CPU (fast and exact enough), the checkpoint's own on a GPU."""
    if config.dtype != "auto":
        return getattr(torch, config.dtype)
    if device.type == "cpu":
        return torch.float32
    return getattr(torch, spec.torch_dtype, torch.bfloat16)


def shard_numerics(config: WorkerConfig, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> Numerics:
    """The stack's numerics. Invariant: row-parallel reductions cut for every TP degree the model allows on
    INVARIANT_WORKERS workers or this world's, whichever is more (so a switch between any two layouts changes no
    bit, and stacks of up to INVARIANT_WORKERS workers agree with each other), GEMM rows padded as this device's
    BLAS needs (on the CPU, the ordered GEMM and attention: services/model/cpu_kernels.py)."""
    if config.numerics == "fast":
        return FAST
    num_workers = max(config.world_size, INVARIANT_WORKERS)
    tp_sizes = {t.tp for t in candidate_topologies(spec.shape, num_workers) if not t.is_expert_parallel}
    if device.type == "cpu":
        cpu_kernels.load()  # built (or found in the cache) now: a machine without a C compiler fails at start
    return invariant_numerics(spec.shape.num_heads, spec.shape.intermediate_size, sorted(tp_sizes),
                              None if device.type == "cpu" else choose_row_multiple(device, dtype),
                              spec.shape.moe_intermediate_size)


class WorkerShard:
    """Holds this worker's topology, model shard and KV cache; called from the model thread only."""

    def __init__(self, config: WorkerConfig, spec: ModelSpec, manifest: Manifest, parallel: ParallelState) -> None:
        self.config = config
        self.spec = spec
        self.manifest = manifest
        self.parallel = parallel
        self.step_port = 0  # the step socket's port, once it listens (WorkerInfo.step_port)
        self.device = worker_device(config)
        self.dtype = _compute_dtype(config, spec, self.device)
        self.numerics = shard_numerics(config, spec, self.device, self.dtype)
        # --enforce-eager runs every fused path eagerly too: the debugging baseline
        self.kernels = choose_kernels("torch" if config.enforce_eager else config.kernels, self.device)
        self.topology = Topology.parse(config.topology)
        self.layer_partition = config.layer_partition
        self.runner: ModelRunner | None = None
        self.is_waking = False  # a standby worker joining the layout (during ApplySwitch)
        self.is_switching = False  # an ApplySwitch is running
        self.needs_apply = False  # regrouped: the runner's groups are gone until the next ApplySwitch
        self.kv_intact = True  # false while (or after being cut off while) KV moves between layouts
        self.new_cache: KVCache | None = None  # the target's cache while a switch fills it
        self.num_threads = 0  # torch threads of the model thread (prepare_steps)
        self.balancer = ExpertBalancer(config.eplb_window)  # MoE: expert load window, EPLB's staged map
        self.staging = Staging(self)  # the target's shard (and KV pool) built beside the steps, until its ApplySwitch
        # Frees a replaced KV pool (and unmaps the peers' pools a pre-copy read) after the switch has answered, at
        # a low priority: the router's first steps in the new layout come first.
        self.freeing = ThreadPoolExecutor(1, "kv-free", initializer=lower_thread_priority)

    def load(self) -> None:
        """Load this worker's shard of the start layout (its groups must be built)."""
        with MappedCheckpoint(self.manifest) as checkpoint:
            self.runner = self.build(self.topology, self.layer_partition, checkpoint, None, None)
        self.bind_balancer()

    def bind_balancer(self) -> None:
        """Point EPLB at the live runner's sparse layers and its stage's group (a fresh window)."""
        runner = self.runner
        group = None
        if runner is not None and self.parallel is not None and runner.wp.ep_size > 1:
            group = self.parallel.tp_group(self.topology, runner.wp.pp_rank)
        self.balancer.bind(runner, group)

    def prepare_steps(self) -> None:
        """On the model thread, at start and after every switch: give it this worker's share of the cores in the
        live layout (worker/threads.py), and pack the new weights there (MKL's packed GEMM runs at full speed
        only on the thread that packed)."""
        num_threads = self.config.num_threads or threads_per_worker(
            usable_cores(), self.topology.num_workers, is_active=self.runner is not None)
        if self.numerics.is_invariant:
            num_threads = invariant_threads(num_threads)
        set_threads(num_threads)
        if num_threads != self.num_threads:
            log.info("worker.threads", rank=self.rank, topology=str(self.topology), num_threads=num_threads,
                     previous=self.num_threads)
        self.num_threads = num_threads
        if self.runner is not None:
            self.runner.model.pack_weights()
            if self.runner.graphs is not None:  # the new layout's decode graphs, before it serves
                started = time.perf_counter()
                captured = self.runner.graphs.warm(WARM_BATCHES)
                log.info("worker.decode_graphs_warm", rank=self.rank, topology=str(self.topology), graphs=captured,
                         seconds=round(time.perf_counter() - started, 4))
            elif self.runner.graphs_refused and self.device.type == "cuda":
                log.info("worker.decode_graphs_off", rank=self.rank, topology=str(self.topology),
                         reason=self.runner.graphs_refused)

    @property
    def rank(self) -> int:
        """Rank in the current world (it changes when the world is re-formed; -1 outside any)."""
        return self.parallel.rank if self.parallel is not None else self.config.rank

    @property
    def world_size(self) -> int:
        return self.parallel.world_size if self.parallel is not None else self.config.world_size

    # ---- building ------------------------------------------------------------------------------------------------
    def placement(self, topology: Topology, partition) -> Placement:
        return place(topology, self.spec.shape, partition, self.config.num_redundant_experts)

    def num_kv_blocks_in(self, topology: Topology, partition) -> int:
        """This worker's KV capacity in `topology` (0 on standby)."""
        if not 0 <= self.rank < topology.num_workers:
            return 0
        wp = self.placement(topology, partition).workers[self.rank]
        return num_blocks_for_budget(len(wp.layers), len(wp.kv_heads), self.spec.head_dim, self.config.block_size,
                                     self.dtype, self.config.kv_cache_bytes)

    def build(self, topology: Topology, partition, checkpoint: MappedCheckpoint, previous: ModelRunner | None,
              kv_cache: KVCache | None, model: ShardedCausalLM | None = None,
              experts: ExpertSwitch = ALONGSIDE) -> ModelRunner | None:
        """The runner of `topology` on this rank (None on standby): its shard (`model` when staged, else built now
        from `previous` and the checkpoint, its experts as `experts` says) over `kv_cache` (None: a new one of the
        configured budget)."""
        if not 0 <= self.rank < topology.num_workers:
            return None
        placement = self.placement(topology, partition)
        wp = placement.workers[self.rank]
        if model is None:
            model = self.build_model(topology, partition, checkpoint, previous, experts)
        if kv_cache is None:
            kv_cache = KVCache(wp.layers, len(wp.kv_heads), self.spec.head_dim, self.config.block_size, self.dtype,
                               self.device, self.config.kv_cache_bytes)
        return ModelRunner(model, kv_cache, placement, wp, self.parallel, self.device,
                           cuda_graphs=self.device.type == "cuda" and not self.config.enforce_eager
                           and not self.numerics.is_invariant)  # invariant: eager (padded graph batches)

    def build_model(self, topology: Topology, partition, checkpoint: MappedCheckpoint, previous: ModelRunner | None,
                    experts: ExpertSwitch = ALONGSIDE, pacer: Pacer = UNPACED) -> ShardedCausalLM:
        """This rank's shard of `topology`, sharing what `previous` holds of it. experts: whether experts may change
        view by all-to-all with the stage's peers (a collective: never while steps run, i.e. not when staging) and
        whether `previous` lets go of them layer by layer (in the freeze). pacer: each tensor copy is a piece of
        its duty cycle (staging)."""
        placement = self.placement(topology, partition)
        wp = placement.workers[self.rank]
        # The stage's group: tensor-parallel collectives, or in an EP layout the experts' all-to-all (attention
        # is whole on each rank, data-parallel).
        stage_group = self.parallel.tp_group(topology, wp.pp_rank) if self.parallel else None
        group, ep_group = (SingleRankGroup(), stage_group) if topology.is_expert_parallel else (stage_group, None)
        expert_maps = initial_expert_maps(self.spec.shape, placement) if self.spec.shape.is_moe else None
        return ShardedCausalLM(self.spec, wp, self._loader(checkpoint, pacer), group,
                               previous.model if previous else None, ep_group=ep_group, expert_maps=expert_maps,
                               expert_switch=experts, numerics=self.numerics, kernels=self.kernels)

    def _loader(self, checkpoint: MappedCheckpoint, pacer: Pacer = UNPACED) -> ShardLoader:
        return ShardLoader(checkpoint.tensor, set(self.manifest.tensors), self.dtype, self.device, pacer.piece)

    def restore_experts(self, old: ModelRunner | None) -> None:
        """After a switch that did not happen: the experts an in-place build took from the live shard, back from
        the weight store (the same bytes), so that the old layout serves again."""
        if old is None or not any(block.released for block in old.model.moe_blocks().values()):
            return
        started = time.perf_counter()
        with MappedCheckpoint(self.manifest) as checkpoint:
            layers = old.model.restore_experts(self._loader(checkpoint))
        log.warning("worker.experts_restored", rank=self.rank, layers=layers,
                    seconds=round(time.perf_counter() - started, 4))

    # ---- switching -----------------------------------------------------------------------------------------------
    def import_kv(self, request: worker_pb2.ImportKVRequest) -> worker_pb2.ImportKVResponse:
        """Copy another instance's KV blocks into this worker's live pool, at ids its router reserved (the model
        thread, between steps: a switch cannot swap the pool underneath). Standby: nothing to fill."""
        if self.runner is None:
            return worker_pb2.ImportKVResponse()
        remote = RemoteReader(self.config.host, self.config.token, self.config.tls, self.config.collective_timeout_s)
        stats = import_kv(KVSourceSpec.from_pb(request.source), request.src_block_ids, request.dst_block_ids,
                          self.spec.shape, self.runner.placement, self.rank, self.runner.kv_cache,
                          self.config.num_redundant_experts, remote)
        return worker_pb2.ImportKVResponse(kv_bytes_received=stats.bytes_received, seconds=stats.seconds)

    def export_kv(self, request: worker_pb2.ExportKVRequest) -> worker_pb2.ExportKVResponse:
        """Send slices of this worker's live KV to another instance's worker on another host (beside the steps:
        the blocks of a request being moved do not change). ValueError: none held here."""
        if self.runner is None:
            raise ValueError(f"rank {self.rank} is on standby: it holds no KV")
        return export_kv(self.runner.kv_cache, request)

    def prepare_switch(self, request: worker_pb2.PrepareSwitchRequest) -> worker_pb2.PrepareSwitchResponse:
        topology = Topology.parse(request.topology)
        partition = tuple(request.layer_partition) or None
        segments = self.runner.kv_cache.segment_names() if self.runner else {}
        ipc = self.runner.kv_cache.cuda_ipc_handles() if self.runner and request.export_cuda_ipc else {}
        # It reads peers' GPU pools (CuPy is there) and its own pool, if any, exported its handles.
        can_ipc = self.device.type == "cuda" and preload_cuda_ipc() and (self.runner is None or bool(ipc))
        return worker_pb2.PrepareSwitchResponse(
            num_kv_blocks=self.num_kv_blocks_in(topology, partition), kv_segments=segments, kv_cuda_ipc=ipc,
            hostname=socket.gethostname(), cuda_ipc=can_ipc, shm_domain=shm_domain(),
            is_candidate=topology in self.parallel.candidates, block_size=self.config.block_size,
            kv_dtype_bytes=self.dtype.itemsize, num_kv_blocks_now=self.runner.kv_cache.num_blocks if self.runner else 0,
        )

    def leave_world(self, failure: BaseException) -> None:
        """After `failure`, which may involve a peer: leave the world at once, so that peers blocked on this worker
        fail now instead of at their collective timeout. Only a Regroup makes the worker usable again."""
        if self.parallel.in_world and self.world_size > 1:
            log.warning("worker.left_world", rank=self.rank, generation=self.parallel.generation,
                        exc_info=failure)
            # The failure's frames (a collective's) hold its process group: gloo would keep the sockets open.
            failure.__traceback__ = None
            self.parallel.leave()

    def regroup(self, request: worker_pb2.RegroupRequest) -> worker_pb2.RegroupResponse:
        """Leave the current world and join a new generation (see ParallelState.regroup); keeps the shard and the
        KV cache, adopts the live layout the controller names (a joining worker has none)."""
        topology = Topology.parse(request.topology)
        partition = tuple(request.layer_partition) or None
        previous = self.rank
        self.staging.drop()  # built over the old world's groups
        self.parallel.regroup(request.generation, request.rank, request.world_size, self.candidates(topology))
        if self.runner is None:  # a standby or joining worker holds nothing; it plans with the others' layout
            self.topology, self.layer_partition = topology, partition
        self.needs_apply = True
        log.info("worker.regrouped", operation_id=request.operation_id, generation=request.generation,
                 previous_rank=previous, rank=request.rank, world_size=request.world_size, kv_intact=self.kv_intact)
        return worker_pb2.RegroupResponse(previous_rank=previous, kv_intact=self.kv_intact, info=self.info())

    def candidates(self, live: Topology) -> list[Topology]:
        """The topologies whose groups a new world builds: the configured ones (or every valid one), and the live one."""
        if self.config.candidate_topologies is not None:
            candidates = [Topology.parse(t) for t in self.config.candidate_topologies]
        else:
            candidates = candidate_topologies(self.spec.shape, self.config.world_size,
                                              self.config.num_redundant_experts)
        return candidates + ([live] if live not in candidates else [])

    def agree(self, ok: bool) -> bool:
        """True when every rank of the world says ok (on the world's CPU group; also the per-layer barrier)."""
        return self.parallel.agree(ok)

    def timed_build(self, *args) -> tuple[ModelRunner | None, float]:
        started = time.perf_counter()
        return self.build(*args), time.perf_counter() - started


    # ---- reporting -----------------------------------------------------------------------------------------------
    def info(self) -> worker_pb2.WorkerInfo:
        info = worker_pb2.WorkerInfo(
            rank=self.rank, world_size=self.world_size, pid=os.getpid(), topology=str(self.topology),
            device=str(self.device), candidate_topologies=[str(t) for t in self.parallel.candidates],
            state=self._state(), generation=self.parallel.generation, num_threads=self.num_threads,
            step_port=self.step_port, numerics=self.numerics.mode, dtype=str(self.dtype).removeprefix("torch."),
            gemm=self.numerics.gemm, kernels=self.kernels.name,
        )
        if self.runner is not None:
            wp, kv = self.runner.wp, self.runner.kv_cache
            info.pp_rank, info.tp_rank = wp.pp_rank, wp.tp_rank
            info.layer_start, info.layer_end = wp.layers.start, wp.layers.stop
            info.kv_head_start, info.kv_head_end = wp.kv_heads.start, wp.kv_heads.stop
            info.num_kv_blocks, info.block_size, info.kv_cache_bytes = kv.num_blocks, kv.block_size, kv.num_bytes
            info.param_bytes = self.runner.model.parameter_bytes()
            info.ep_rank, info.ep_size = wp.ep_rank, wp.ep_size
            info.expert_slot_start, info.expert_slot_end = wp.expert_slots.start, wp.expert_slots.stop
        return info

    def _state(self) -> str:
        if self.is_waking:
            return "WAKING"
        if self.is_switching:
            return "SWITCHING"
        if self.parallel.broken:
            return "BROKEN"
        if not self.parallel.in_world:
            return "JOINING"
        if self.needs_apply:
            return "REGROUPED"
        return "ACTIVE" if self.runner is not None else "STANDBY"

    def close(self) -> None:
        self.freeing.shutdown(wait=True)
        self.staging.drop()
        if self.runner is not None:
            self.runner.kv_cache.close()
