"""Configuration of one worker process."""

from __future__ import annotations

from dataclasses import dataclass

from services.contracts.numerics import check_compute

from services.rpc.tls import TLSConfig


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything a worker needs to join the world and load its shard."""

    rank: int                          # rank in the torch.distributed world = position in the worker list
    world_size: int
    store_host: str                    # torch.distributed TCPStore (the launcher hosts it)
    store_port: int
    weightstore_address: str           # host:port of the WeightStore gRPC service
    topology: str                      # live topology at start, e.g. "tp2pp2"
    layer_partition: tuple[int, ...] | None = None  # explicit layers per stage (heterogeneous devices)
    device: str = "cpu"                # "cpu" or "cuda"
    gpu: int | None = None             # CUDA ordinal among the visible GPUs (launcher's placement); None: rank % count
    # Several ranks on one GPU (development, tests): tensor collectives over gloo (NCCL refuses two ranks on a
    # device), point-to-point staged through host memory. Production keeps one rank per GPU and NCCL.
    gpu_sharing: bool = False
    enforce_eager: bool = False        # --device cuda: never replay decode steps as CUDA graphs (debugging)
    # "auto": float32 on CPU, the checkpoint's dtype on a GPU; or "float32" / "bfloat16" / "float16".
    dtype: str = "auto"
    numerics: str = "fast"             # "fast" or "invariant" (services/model/numerics.py)
    kernels: str = "torch"             # "torch" or "triton": a layer's norms, rotary, attention (model/kernels.py)
    kv_cache_bytes: int = 64 << 20     # KV cache budget; the block count follows from it
    block_size: int = 16               # tokens per KV block
    host: str = "127.0.0.1"            # gRPC bind address
    port: int = 0                      # 0: pick a free port and report it
    step_port: int = 0                 # the step socket (steps from the router): 0 picks a free port
    collective_timeout_s: float = 60.0 # every collective / point-to-point op fails after this
    parent_pid: int | None = None      # exit when this process is gone (no orphans)
    num_threads: int | None = None     # torch intra-op threads; None: usable cores // active workers
    # Topologies whose process groups are built at start (the MPU state space); None: every valid one.
    # A switch to any other topology builds its groups first (the slow path, reported by the switch).
    candidate_topologies: tuple[str, ...] | None = None
    token: str | None = None           # control-plane token every RPC of this worker requires (None: open)
    faults: str = ""                   # fault-injection rules for tests (services/worker/faults.py); "" = off
    # Start outside any world (a replacement for a lost worker): the controller's AddWorker regroups it in. Its
    # rank then only picks the device; world_size is the stack's full size (the candidates are planned for it).
    join: bool = False
    num_redundant_experts: int = 0     # MoE, EP layouts: extra physical expert slots per layer (EPLB replicas)
    eplb_window: int = 1000            # MoE: steps of expert load kept for EPLB (its sliding window)
    tls: TLSConfig | None = None       # mutual TLS on its gRPC server, step socket and weight store channel

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of size {self.world_size}")
        if self.block_size < 1 or self.kv_cache_bytes < 1:
            raise ValueError("block_size and kv_cache_bytes must be positive")
        check_compute(self.dtype, self.numerics, self.kernels)
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', not {self.device!r}")
        if self.device != "cuda" and (self.gpu is not None or self.gpu_sharing):
            raise ValueError("gpu and gpu_sharing need device 'cuda'")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, not {self.num_threads}")
        if self.eplb_window < 1:
            raise ValueError(f"eplb_window must be >= 1, not {self.eplb_window}")
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, not {self.num_redundant_experts}")
        if self.gpu is not None and self.gpu < 0:
            raise ValueError(f"gpu must be a CUDA ordinal >= 0, not {self.gpu}")
