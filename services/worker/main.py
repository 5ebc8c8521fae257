"""Worker process entry: join the world, map the weight store, load this worker's shard, serve steps."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from multiprocessing.connection import Connection

import structlog
import torch

from services.rpc.reconfig.v1 import worker_pb2
from services.launch.process import run_service
from services.model.layers import ShardLoader
from services.model.llama import ShardedCausalLM
from services.model.spec import ModelSpec
from services.topology import Topology, candidate_topologies, place
from services.weightstore.client import MappedCheckpoint, fetch_manifest
from services.worker.config import WorkerConfig
from services.worker.kv_cache import KVCache, cleanup_stale_kv_segments
from services.worker.model_runner import ModelRunner
from services.worker.parallel import ParallelState
from services.worker.server import WorkerServicer, start_server

log = structlog.get_logger(__name__)


def _device(config: WorkerConfig) -> torch.device:
    if config.device == "cuda":
        return torch.device("cuda", config.rank % torch.cuda.device_count())
    return torch.device("cpu")


def _compute_dtype(spec: ModelSpec, device: torch.device) -> torch.dtype:
    """float32 on CPU (fast and exact enough); the checkpoint's own dtype on GPU."""
    if device.type == "cpu":
        return torch.float32
    return getattr(torch, spec.torch_dtype, torch.bfloat16)


def build_runner(config: WorkerConfig, spec: ModelSpec, topology: Topology, checkpoint: MappedCheckpoint,
                 names: set[str], parallel: ParallelState | None) -> ModelRunner | None:
    """Load this worker's shard and allocate its KV cache; None when the worker is on standby."""
    if config.rank >= topology.num_workers:
        return None
    placement = place(topology, spec.shape, config.layer_partition)
    wp = placement.workers[config.rank]
    device = _device(config)
    dtype = _compute_dtype(spec, device)
    group = parallel.tp_group(topology, wp.pp_rank) if parallel else None
    loader = ShardLoader(checkpoint.tensor, names, dtype, device)
    model = ShardedCausalLM(spec, wp, loader, group)
    kv_cache = KVCache(wp.layers, len(wp.kv_heads), spec.head_dim, config.block_size, dtype, device,
                       config.kv_cache_bytes)
    return ModelRunner(model, kv_cache, placement, wp, parallel, device)


def _info(config: WorkerConfig, topology: Topology, runner: ModelRunner | None,
          parallel: ParallelState) -> worker_pb2.WorkerInfo:
    info = worker_pb2.WorkerInfo(
        rank=config.rank, world_size=config.world_size, pid=os.getpid(), topology=str(topology),
        device=str(_device(config)), candidate_topologies=[str(t) for t in parallel.candidates],
    )
    if runner is not None:
        wp, kv = runner.wp, runner.kv_cache
        info.pp_rank, info.tp_rank = wp.pp_rank, wp.tp_rank
        info.layer_start, info.layer_end = wp.layers.start, wp.layers.stop
        info.kv_head_start, info.kv_head_end = wp.kv_heads.start, wp.kv_heads.stop
        info.num_kv_blocks, info.block_size, info.kv_cache_bytes = kv.num_blocks, kv.block_size, kv.num_bytes
        info.param_bytes = runner.model.parameter_bytes()
    return info


async def serve_worker(config: WorkerConfig, ready: Connection | None = None) -> None:
    """Run one worker until Shutdown, SIGTERM or SIGINT."""
    started = time.perf_counter()
    cleanup_stale_kv_segments()
    manifest = await fetch_manifest(config.weightstore_address)
    spec = ModelSpec.from_config(json.loads(manifest.config_json))
    topology = Topology.parse(config.topology)
    backend = "nccl" if config.device == "cuda" else "gloo"
    parallel = await asyncio.to_thread(
        ParallelState, config.rank, config.world_size, config.store_host, config.store_port, backend,
        config.collective_timeout_s,
    )
    candidates = candidate_topologies(spec.shape, config.world_size)
    if topology not in candidates:
        candidates.append(topology)
    await asyncio.to_thread(parallel.build_groups, candidates)
    # Map the store's segments only while copying our slices: unmapped, they add nothing to our resident memory.
    with MappedCheckpoint(manifest) as checkpoint:
        runner = await asyncio.to_thread(
            build_runner, config, spec, topology, checkpoint, set(manifest.tensors), parallel
        )
    servicer = WorkerServicer(runner, _info(config, topology, runner, parallel), config.rank)
    server, port = await start_server(servicer, config.host, config.port)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, servicer.stopped.set)
    log.info("worker.ready", rank=config.rank, port=port, topology=str(topology),
             param_bytes=servicer.info.param_bytes, kv_blocks=servicer.info.num_kv_blocks,
             seconds=round(time.perf_counter() - started, 3))
    if ready is not None:
        ready.send({"rank": config.rank, "port": port, "pid": os.getpid()})
    try:
        await servicer.stopped.wait()
    finally:
        await server.stop(grace=1.0)
        servicer.model_thread.shutdown(wait=True, cancel_futures=True)
        if runner is not None:
            runner.kv_cache.close()
        parallel.close()
        log.info("worker.stopped", rank=config.rank)


def run_worker(config: WorkerConfig, ready: Connection | None = None) -> None:
    """Process target: configure the process, then serve."""
    torch.set_num_threads(config.num_threads)
    run_service("worker", serve_worker(config, ready), ready, config.parent_pid)
