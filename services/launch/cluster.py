"""LocalCluster: a weightstore and N worker processes on this machine (tests, benchmarks, `reconfig up`)."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path

import structlog
import torch.distributed as dist

from services.launch.nodes import (
    NodeLayout,
    NodeMismatch,
    NodeRecord,
    announce_stop,
    check_records,
    leader_gone,
    missing_nodes,
    register,
    wait_for_nodes,
)
from services.model.presets import resolve_model
from services.model.spec import ModelSpec
from services.rpc.tls import TLSConfig
from services.topology import Topology, assign_gpus, validate
from services.weightstore.client import fetch_manifest
from services.weightstore.shm import cleanup_stale_segments
from services.worker.config import WorkerConfig
from services.worker.kv_cache import cleanup_stale_kv_segments
from services.worker.shm_exchange import cleanup_stale_exchange_segments

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """What to start: model, worker count, initial topology, KV budget."""

    model: str = "tiny-llama"            # preset name or checkpoint directory
    num_workers: int = 1
    topology: str = "tp1pp1"
    layer_partition: tuple[int, ...] | None = None
    device: str = "cpu"
    gpus: int | tuple[int, ...] | None = None  # --device cuda: a count or CUDA ordinals (None: every visible GPU)
    gpu_sharing: bool = False            # several workers per GPU (gloo collectives; development and tests)
    enforce_eager: bool = False          # --device cuda: no CUDA graphs for decode steps
    dtype: str = "auto"                  # the workers' compute dtype (WorkerConfig.dtype)
    numerics: str = "fast"               # fast or invariant (services/model/numerics.py)
    kernels: str = "torch"               # torch or triton (services/model/kernels.py)
    kv_cache_bytes: int = 64 << 20       # per worker
    block_size: int = 16
    host: str = "127.0.0.1"
    start_timeout_s: float = 120.0
    collective_timeout_s: float = 60.0
    num_threads: int | None = None       # torch threads per worker (None: cores // active workers)
    candidate_topologies: tuple[str, ...] | None = None  # groups built at start (None: every valid topology)
    token: str | None = None             # control-plane token the workers require (None: no auth, tests)
    faults: str = ""                     # fault-injection rules for the workers (tests only)
    num_redundant_experts: int = 0       # MoE: extra expert slots per layer in EP layouts (EPLB replicas)
    eplb_window: int = 1000              # MoE: steps of expert load each worker keeps (EPLB's sliding window)
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the children
    weightstore_address: str = ""        # a running weight store to share (another instance's); "": start one
    tls: TLSConfig | None = None         # mutual TLS on the weight store's and the workers' links (None: plaintext)
    nodes: int = 1                       # hosts the instance spans (services/launch/nodes.py); num_workers is each's
    node_rank: int = 0                   # 0: the leader, which hosts the workers' TCPStore on dist_addr
    dist_addr: str = ""                  # "host:port" of the leader's TCPStore, with nodes > 1

    @property
    def layout(self) -> NodeLayout:
        return NodeLayout(self.nodes, self.node_rank, self.num_workers, self.dist_addr)


def _run_weightstore(model_dir: str, host: str, tls: TLSConfig | None, ready: Connection) -> None:
    """Process target of the weight store."""
    import asyncio

    from services.logs import configure_logging
    from services.weightstore.server import serve

    configure_logging("weightstore")
    asyncio.run(serve(Path(model_dir), host, 0, on_ready=lambda port: ready.send({"port": port}), tls=tls))


def _with_env(env: dict[str, str], target, *args) -> None:
    """Process target wrapper: the cluster's extra environment first. Children fork from a forkserver started by the
    first cluster of this process, whose environment later clusters' `env` would otherwise never reach."""
    os.environ.update(env)
    target(*args)


def _run_worker(config: WorkerConfig, ready: Connection) -> None:
    from services.worker.main import run_worker

    run_worker(config, ready)


def _gpu_placement(config: ClusterConfig) -> tuple[int, ...]:
    """The GPU of each rank with --device cuda (DevicePlacementError says why not and what to change); () on CPU,
    which never touches CUDA."""
    if config.device != "cuda":
        if config.gpus is not None or config.gpu_sharing:
            raise ValueError("--gpus and --gpu-sharing need --device cuda")
        return ()
    import torch

    return assign_gpus(config.num_workers, torch.cuda.device_count(), config.gpus, config.gpu_sharing)


_TIER_STORE, _TIER_WORKER, _TIER_SERVICE = 0, 1, 2  # start order; stop goes in reverse


class ClusterError(RuntimeError):
    """A process of the cluster failed to start or died."""


class LocalCluster:
    """Starts and stops the weightstore and workers; knows their addresses and pids."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.gpus = _gpu_placement(config)  # before anything starts: NCCL would refuse it only at the first step
        self.model_dir = resolve_model(config.model)
        self.spec = ModelSpec.from_dir(self.model_dir)
        self.topology = Topology.parse(config.topology)
        self.layout = config.layout
        validate(self.topology, self.spec.shape, self.layout.world_size, config.layer_partition,
                 config.num_redundant_experts)
        self.weightstore_address = ""
        self.worker_addresses: list[str] = []
        self._processes: list[tuple[str, int, mp.process.BaseProcess]] = []  # (name, tier, process)
        self._store: dist.TCPStore | None = None  # hosted here (the leader), or a client of the leader's
        self._num_joiners = 0
        self.nodes: list[NodeRecord] = []  # the leader: every follower's record, by node rank

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def worker_pids(self) -> list[int]:
        """Pids of the workers, in start order (the first num_workers by rank, then joiners)."""
        return [p.pid for _, tier, p in self._processes if tier == _TIER_WORKER]

    @property
    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, _, p in self._processes}

    def start(self) -> None:
        """Start every process and wait until all are ready (or raise ClusterError naming the one that failed)."""
        started = time.perf_counter()
        cfg = self.config
        os.environ.update(cfg.env)
        ctx = mp.get_context("forkserver")
        # Children fork from a server that already imported torch and our code: ~50 ms each instead of ~2 s.
        ctx.set_forkserver_preload(["services.worker.main", "services.weightstore.server"])
        try:
            if cfg.weightstore_address:  # one copy of the weights in shared memory for every instance
                self.weightstore_address = cfg.weightstore_address
            else:
                ws = self._spawn(ctx, "weightstore", _run_weightstore, str(self.model_dir), cfg.host,
                                 cfg.tls, tier=_TIER_STORE)
                self.weightstore_address = f"{cfg.host}:{self._wait_ready([ws])[0]['port']}"
            self._store = self._open_store()
            workers = [
                self._spawn(ctx, f"worker-{rank}", _run_worker, self._worker_config(rank), tier=_TIER_WORKER)
                for rank in self.layout.ranks
            ]
            ready = sorted(self._wait_ready(workers), key=lambda r: r["rank"])
            self.worker_addresses = [f"{cfg.host}:{r['port']}" for r in ready]
            if self.layout.multi:
                self._meet_nodes()
        except BaseException:
            self.stop()
            raise
        log.info("cluster.ready", workers=len(self.worker_addresses), topology=cfg.topology,
                 node=self.layout.node_rank, nodes=self.layout.nodes, seconds=round(time.perf_counter() - started, 2))

    def _open_store(self) -> dist.TCPStore:
        """The workers' TCPStore: hosted here on one node (any free port) and on the leader (on --dist-addr's
        port); a client of the leader's on a follower."""
        layout, timeout = self.layout, timedelta(seconds=self.config.start_timeout_s)
        if not layout.multi:
            return dist.TCPStore(self.config.host, 0, layout.world_size, is_master=True, wait_for_workers=False)
        if layout.leader:
            return dist.TCPStore(layout.dist_host, layout.dist_port, is_master=True, timeout=timeout,
                                 wait_for_workers=False)
        return dist.TCPStore(layout.dist_host, layout.dist_port, is_master=False, timeout=timeout)

    def _meet_nodes(self) -> None:
        """A follower registers its workers with the leader; the leader waits for every follower, checks they hold
        its weights, and lists their workers after its own (ClusterError names what went wrong)."""
        layout, cfg = self.layout, self.config
        digest = asyncio.run(fetch_manifest(self.weightstore_address, tls=cfg.tls)).content_digest()
        if not layout.leader:
            register(self._store, NodeRecord(layout.node_rank, socket.gethostname(), tuple(self.worker_addresses),
                                             digest, os.getpid()))
            return
        try:
            self.nodes = wait_for_nodes(self._store, layout, cfg.start_timeout_s)
            check_records(self.nodes, layout, digest)
        except NodeMismatch as exc:
            raise ClusterError(str(exc)) from None
        except dist.DistStoreError:
            raise ClusterError(f"timed out after {cfg.start_timeout_s:.0f}s waiting for node(s) "
                               f"{', '.join(map(str, missing_nodes(self._store, layout)))} to register") from None
        self.worker_addresses += [a for record in self.nodes for a in record.worker_addresses]

    def leader_gone(self) -> str:
        """A follower: why its instance is over ("" while the leader serves)."""
        return leader_gone(self._store) if self._store is not None else "not started"

    def start_joiner(self) -> str:
        """Start a worker in join mode (in no world: a replacement for a lost one) and return its address;
        the controller's AddWorker brings it in."""
        if self._store is None:
            raise ClusterError("the cluster is not running")
        self._num_joiners += 1
        first = self.layout.ranks.start  # the rank only picks a device (this node's)
        rank = first + (self.config.num_workers + self._num_joiners - 1) % self.config.num_workers
        config = dataclasses.replace(self._worker_config(rank), join=True)
        spawned = self._spawn(mp.get_context("forkserver"), f"worker-join-{self._num_joiners}", _run_worker, config,
                              tier=_TIER_WORKER)
        address = f"{self.config.host}:{self._wait_ready([spawned])[0]['port']}"
        log.info("cluster.joiner_ready", address=address, pid=spawned[2].pid)
        return address

    def _worker_config(self, rank: int) -> WorkerConfig:
        cfg = self.config
        return WorkerConfig(
            rank=rank, world_size=self.layout.world_size, store_port=self._store.port,
            store_host=self.layout.dist_host if self.layout.multi else cfg.host,
            weightstore_address=self.weightstore_address, topology=cfg.topology,
            layer_partition=cfg.layer_partition, device=cfg.device, kv_cache_bytes=cfg.kv_cache_bytes,
            gpu=self.gpus[rank - self.layout.ranks.start] if self.gpus else None, gpu_sharing=cfg.gpu_sharing,
            enforce_eager=cfg.enforce_eager, dtype=cfg.dtype, numerics=cfg.numerics, kernels=cfg.kernels,
            block_size=cfg.block_size,
            host=cfg.host, collective_timeout_s=cfg.collective_timeout_s,
            parent_pid=os.getpid(), num_threads=cfg.num_threads, candidate_topologies=cfg.candidate_topologies,
            token=cfg.token, faults=cfg.faults, num_redundant_experts=cfg.num_redundant_experts,
            eplb_window=cfg.eplb_window, tls=cfg.tls,
        )

    def _spawn(self, ctx, name: str, target, *args, tier: int) -> tuple[str, Connection, mp.process.BaseProcess]:
        receiver, sender = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_with_env, args=(dict(self.config.env), target, *args, sender),
                              name=f"reconfig-{name}", daemon=False)
        process.start()
        sender.close()
        self._processes.append((name, tier, process))
        return name, receiver, process

    def spawn_service(self, name: str, target, *args) -> dict:
        """Start another service process (router, controller) after the workers; returns its ready message.
        `target(*args, ready_connection)` must send one dict (or {"error": ...}) once it serves."""
        ctx = mp.get_context("forkserver")
        try:
            return self._wait_ready([self._spawn(ctx, name, target, *args, tier=_TIER_SERVICE)])[0]
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, spawned: list[tuple[str, Connection, mp.process.BaseProcess]]) -> list[dict]:
        """Collect one ready message per process; a death or an error message fails fast with its name."""
        deadline = time.monotonic() + self.config.start_timeout_s
        waiting = {conn: (name, proc) for name, conn, proc in spawned}
        messages = []
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ClusterError(f"timed out after {self.config.start_timeout_s:.0f}s waiting for "
                                   f"{', '.join(n for n, _ in waiting.values())}")
            sentinels = {proc.sentinel: conn for conn, (_, proc) in waiting.items()}
            for ready in wait([*waiting, *sentinels], timeout=remaining):
                conn = sentinels.get(ready, ready)
                if conn not in waiting:
                    continue
                name, proc = waiting.pop(conn)
                try:
                    message = conn.recv()
                except EOFError:
                    proc.join(1)
                    raise ClusterError(f"{name} (pid {proc.pid}) exited with code {proc.exitcode} before ready")
                if "error" in message:
                    raise ClusterError(f"{name} (pid {proc.pid}) failed to start: {message['error']}")
                messages.append(message)
        return messages

    def dead_processes(self) -> list[str]:
        """Names (with exit codes) of processes that have exited."""
        return [f"{name} (pid {p.pid}, exit code {p.exitcode})" for name, _, p in self._processes if not p.is_alive()]

    def reap_dead_service(self, name: str) -> str | None:
        """Forget the service process `name` if it has exited (to start it again); returns it with its exit code."""
        dead = next((p for n, tier, p in self._processes if n == name and not p.is_alive()), None)
        if dead is None:
            return None
        self._processes = [entry for entry in self._processes if entry[2] is not dead]
        return f"{name} (pid {dead.pid}, exit code {dead.exitcode})"

    def reap_dead_workers(self) -> list[str]:
        """Forget the workers that have exited (the controller moves the stack onto the others) and unlink the
        shared memory they left; returns their names with exit codes."""
        dead = [(name, p) for name, tier, p in self._processes if tier == _TIER_WORKER and not p.is_alive()]
        if not dead:
            return []
        self._processes = [entry for entry in self._processes if entry[2] not in {p for _, p in dead}]
        cleanup_stale_segments()  # a killed worker could not unlink its KV pool: remove what has a dead owner
        cleanup_stale_kv_segments()
        cleanup_stale_exchange_segments()
        return [f"{name} (pid {p.pid}, exit code {p.exitcode})" for name, p in dead]

    def stop_services(self, names: tuple[str, ...], timeout_s: float = 10.0) -> None:
        """SIGTERM the named service processes and wait for them (SIGKILL past the timeout); forget them."""
        group = [p for n, _, p in self._processes if n in names]
        _terminate(group, timeout_s)
        self._processes = [entry for entry in self._processes if entry[2] not in group]

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM tier by tier, newest first (services, workers, then the weightstore, which unlinks its
        segments); SIGKILL whatever lingers past the timeout."""
        if self._store is not None and self.layout.multi and self.layout.leader:
            try:
                announce_stop(self._store)  # the followers stop their workers too
            except Exception:
                log.warning("cluster.stop_announce_failed", exc_info=True)
        for tier in sorted({tier for _, tier, _ in self._processes}, reverse=True):
            _terminate([p for _, t, p in self._processes if t == tier], timeout_s)
        self._processes.clear()
        self._store = None
        # A child killed with SIGKILL could not unlink its segments: remove whatever has a dead owner.
        cleanup_stale_segments()
        cleanup_stale_kv_segments()
        cleanup_stale_exchange_segments()


def _terminate(group: list[mp.process.BaseProcess], timeout_s: float) -> None:
    """SIGTERM every process of the group, wait up to timeout_s for all, SIGKILL what lingers."""
    for process in group:
        if process.is_alive():
            # Not os.kill: a forkserver child is reaped by the forkserver, and may be gone between the check and the
            # signal (ProcessLookupError, seen once in CI after a test's own kill -9); terminate() allows for that.
            process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in group:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            log.warning("cluster.kill", pid=process.pid)
            process.kill()
            process.join(5)
