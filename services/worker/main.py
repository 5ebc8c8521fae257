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

from services.model.spec import ModelSpec
from services.runtime.process import run_service
from services.topology import Topology
from services.weightstore.client import fetch_manifest
from services.worker.config import WorkerConfig
from services.worker.cuda_ipc import preload_cuda_ipc
from services.worker.faults import FAULTS
from services.worker.kv_cache import cleanup_stale_kv_segments
from services.worker.parallel import ParallelState, device_backend
from services.worker.server import WorkerServicer, start_server
from services.worker.shard import WorkerShard, worker_device
from services.worker.shm_exchange import cleanup_stale_exchange_segments
from services.worker.step_server import start_step_server

log = structlog.get_logger(__name__)


async def serve_worker(config: WorkerConfig, ready: Connection | None = None) -> None:
    """Run one worker until Shutdown, SIGTERM or SIGINT."""
    started = time.perf_counter()
    cleanup_stale_kv_segments()
    cleanup_stale_exchange_segments()
    if config.faults:
        FAULTS.configure(config.faults)
    manifest = await fetch_manifest(config.weightstore_address, tls=config.tls)
    spec = ModelSpec.from_config(json.loads(manifest.config_json))
    topology = Topology.parse(config.topology)
    backend = device_backend(config.device, config.gpu_sharing)
    if config.device == "cuda":  # before any group: NCCL binds each rank to the current device
        torch.cuda.set_device(worker_device(config))
        preload_cuda_ipc()  # not on a live move's first pull
    parallel = await asyncio.to_thread(
        ParallelState, config.rank, config.world_size, config.store_host, config.store_port, backend,
        config.collective_timeout_s, config.join, config.host,
    )
    # Map the store's segments only while copying our slices: unmapped, they add nothing to our resident memory.
    # A joining worker holds nothing and is in no world until the controller regroups it in (AddWorker).
    shard = await asyncio.to_thread(WorkerShard, config, spec, manifest, parallel)
    if not config.join:
        await asyncio.to_thread(parallel.build_groups, shard.candidates(topology))
        await asyncio.to_thread(shard.load)
    servicer = WorkerServicer(shard)
    await asyncio.get_running_loop().run_in_executor(servicer.model_thread, shard.prepare_steps)
    server, port = await start_server(servicer, config.host, config.port, config.token, config.tls)
    step_server, shard.step_port = await start_step_server(servicer, config.host, config.step_port, config.token,
                                                           config.tls)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, servicer.stopped.set)
    log.info("worker.ready", rank=config.rank, port=port, step_port=shard.step_port, topology=str(topology), join=config.join,
             param_bytes=shard.info().param_bytes, kv_blocks=shard.info().num_kv_blocks,
             num_threads=shard.num_threads, numerics=shard.numerics.mode, gemm=shard.numerics.gemm,
             kernels=shard.kernels.name,
             seconds=round(time.perf_counter() - started, 3))
    if ready is not None:
        ready.send({"rank": config.rank, "port": port, "pid": os.getpid()})
    try:
        await servicer.stopped.wait()
    finally:
        step_server.close()
        await server.stop(grace=1.0)
        servicer.model_thread.shutdown(wait=True, cancel_futures=True)
        servicer.readback_thread.shutdown(wait=True, cancel_futures=True)
        shard.close()
        parallel.close()
        log.info("worker.stopped", rank=config.rank)


def run_worker(config: WorkerConfig, ready: Connection | None = None) -> None:
    """Process target: configure the process, then serve. Loading runs on one thread unless told otherwise;
    steps get their share of the cores on the model thread (WorkerShard.prepare_steps)."""
    torch.set_num_threads(config.num_threads or 1)
    run_service("worker", serve_worker(config, ready), ready, config.parent_pid)
