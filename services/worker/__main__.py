"""`python -m services.worker --rank R --world-size N --store-host H --store-port P --weightstore ADDR ...`:
one worker process outside the local launcher (containers, other hosts)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from services.contracts.numerics import DTYPES, KERNELS, MODES
from services.rpc.auth import read_token_file
from services.rpc.tls import add_tls_arguments, from_args
from services.topology import Topology, TopologyError
from services.worker.config import WorkerConfig


def _partition(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layers per stage like 2,2, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags."""
    parser = argparse.ArgumentParser(prog="python -m services.worker", description=__doc__)
    parser.add_argument("--rank", type=int, required=True, help="rank in the world (= position in the worker list)")
    parser.add_argument("--world-size", type=int, required=True, help="number of workers")
    parser.add_argument("--store-host", required=True, help="host of the torch.distributed TCPStore")
    parser.add_argument("--store-port", type=int, required=True, help="port of the TCPStore")
    parser.add_argument("--store-master", action="store_true",
                        help="host the TCPStore in this process (exactly one worker, usually rank 0)")
    parser.add_argument("--weightstore", required=True, help="WeightStore gRPC address (host:port)")
    parser.add_argument("--topology", required=True, help="live topology at start, e.g. tp2pp2")
    parser.add_argument("--layer-partition", type=_partition, default=None, help="explicit layers per stage")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--gpu", type=int, default=None,
                        help="CUDA ordinal among the visible GPUs for --device cuda (default: rank %% GPU count)")
    parser.add_argument("--gpu-sharing", action="store_true",
                        help="this rank shares its GPU with others (development): gloo instead of NCCL")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="--device cuda: run every step eagerly (no CUDA graphs for decode steps)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="weights, activations and KV cache (auto: float32 on CPU, the checkpoint's on a GPU)")
    parser.add_argument("--numerics", choices=MODES, default="fast",
                        help="invariant: no bit of a result depends on the batch or the layout (slower)")
    parser.add_argument("--kernels", choices=KERNELS, default="torch",
                        help="triton: fused norms, rotary + KV write, decode attention and SwiGLU (for CUDA; "
                             "--enforce-eager turns them off)")
    parser.add_argument("--kv-cache-mb", type=int, default=64, help="KV cache budget (MiB)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--host", default="127.0.0.1", help="gRPC bind address (default: loopback)")
    parser.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    parser.add_argument("--step-port", type=int, default=0,
                        help="TCP port of the step socket, on the same host (0: any free port; GetInfo reports it)")
    parser.add_argument("--port-file", type=Path, help="write the bound gRPC port here once ready")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch intra-op threads (default: usable cores // active workers, 1 on standby)")
    parser.add_argument("--collective-timeout", type=float, default=60.0, help="seconds before a collective fails")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    parser.add_argument("--join", action="store_true",
                        help="start in no world, as a replacement for a lost worker (`reconfigctl add-worker` "
                             "brings it in); --rank then only picks the device")
    parser.add_argument("--num-redundant-experts", type=int, default=0,
                        help="MoE: extra physical expert slots per layer in EP layouts (EPLB replicas)")
    parser.add_argument("--eplb-window", type=int, default=1000,
                        help="MoE: steps of per-expert load kept for EPLB (sliding window)")
    parser.add_argument("--token-file", type=Path, default=None,
                        help="control-plane token every RPC of this worker then requires (mode 0600 file)")
    add_tls_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """Validated WorkerConfig; ValueError on inconsistent flags."""
    Topology.parse(args.topology)
    if args.kv_cache_mb < 1:
        raise ValueError(f"--kv-cache-mb must be >= 1, got {args.kv_cache_mb}")
    return WorkerConfig(
        rank=args.rank, world_size=args.world_size, store_host=args.store_host, store_port=args.store_port,
        weightstore_address=args.weightstore, topology=args.topology, layer_partition=args.layer_partition,
        device=args.device, gpu=args.gpu, gpu_sharing=args.gpu_sharing,
        enforce_eager=args.enforce_eager, dtype=args.dtype, numerics=args.numerics, kernels=args.kernels,
        kv_cache_bytes=args.kv_cache_mb << 20,
        block_size=args.block_size,
        host=args.host, port=args.port, step_port=args.step_port, collective_timeout_s=args.collective_timeout,
        parent_pid=args.parent_pid, num_threads=args.num_threads,
        token=read_token_file(args.token_file) if args.token_file else None, join=args.join,
        num_redundant_experts=args.num_redundant_experts, eplb_window=args.eplb_window, tls=from_args(args),
    )


class PortFileReporter:
    """Stands in for the launcher's pipe: writes the bound port to a file once the worker is ready."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def send(self, message: dict) -> None:
        """Called by the worker once with {"port": ...} when ready, or {"error": ...}."""
        if self.path is None or "port" not in message:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        with os.fdopen(fd, "w") as file:
            file.write(f"{message['port']}\n")
        os.replace(temporary, self.path)  # readers see no file or the whole number


def host_store(config: WorkerConfig):
    """The torch.distributed TCPStore of the world, served from this process (the worker joins it as a client).
    The world cannot be re-formed once this worker is gone: prefer the weight store's --store-port."""
    from services.runtime.store import host_tcp_store

    return host_tcp_store(config.store_port, config.collective_timeout_s)


def main(argv: list[str] | None = None) -> int:
    """Run one worker until Shutdown or SIGTERM/SIGINT; exit 2 on bad flags, 1 when it fails."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except (TopologyError, ValueError) as exc:
        parser.error(str(exc))
    from services.worker.main import run_worker

    store = host_store(config) if args.store_master else None  # must live as long as the world
    try:
        run_worker(config, PortFileReporter(args.port_file))
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
