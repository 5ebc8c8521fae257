"""`reconfigctl`: the operator's command line for the controller (`reconfigctl status [--json]`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.controller.status import OperationStatus, StackStatus, WorkerState, WorkerStatus
from services.launch.stackfile import StackFile, StackNotFoundError
from services.rpc.auth import auth_metadata, read_token_file
from services.rpc.reconfig.v1 import controller_pb2, controller_pb2_grpc

EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE = 0, 1, 2


class Unreachable(RuntimeError):
    """The stack cannot be found or reached (exit 1)."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where the controller is and the token it wants."""

    controller_address: str
    token: str


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags."""
    parser = argparse.ArgumentParser(prog="reconfigctl", description="Inspect and steer a running reconfig stack.")
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="topology, workers, requests and the last operation")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.add_argument("--controller", default=os.environ.get("RECONFIG_CONTROLLER"),
                        help="controller address host:port (default: $RECONFIG_CONTROLLER, else the stack file)")
    status.add_argument("--token-file", type=Path, default=os.environ.get("RECONFIG_TOKEN_FILE"),
                        help="control-plane token file (default: $RECONFIG_TOKEN_FILE, else the stack file)")
    status.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the controller")
    return parser


def resolve_target(controller: str | None, token_file: Path | None) -> Target:
    """Flags first; what they leave open comes from the stack file written by `reconfig up`."""
    if controller is None or token_file is None:
        try:
            stack = StackFile.load()
        except StackNotFoundError as exc:
            raise Unreachable(f"{exc} (or pass --controller and --token-file)") from None
        controller = controller or stack.controller_address
        token_file = token_file or Path(stack.token_file)
    try:
        return Target(controller, read_token_file(token_file))
    except (OSError, ValueError) as exc:
        raise Unreachable(f"cannot read the control-plane token: {exc}") from None


def fetch_status(target: Target, timeout_s: float) -> StackStatus:
    """GetStatus from the controller; Unreachable with a readable reason on failure."""
    with grpc.insecure_channel(target.controller_address) as channel:
        stub = controller_pb2_grpc.ControllerStub(channel)
        try:
            pb = stub.GetStatus(controller_pb2.GetStatusRequest(), timeout=timeout_s,
                                metadata=auth_metadata(target.token))
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.UNAUTHENTICATED:
                raise Unreachable(f"the controller at {target.controller_address} refused the token: "
                                  f"{exc.details()}") from None
            raise Unreachable(f"cannot reach the controller at {target.controller_address}: "
                              f"{exc.code().name}: {exc.details()}") from None
    return StackStatus.from_pb(pb)


def _layers(worker: WorkerStatus) -> str:
    return f"{worker.layer_start}-{worker.layer_end - 1}" if worker.state is WorkerState.ACTIVE else "-"


def _kv_heads(worker: WorkerStatus) -> str:
    if worker.state is not WorkerState.ACTIVE:
        return "-"
    return f"{worker.kv_head_start}-{worker.kv_head_end - 1}"


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"


def _when(unix_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_s))


def _operation_line(op: OperationStatus | None) -> str:
    if op is None:
        return "last operation: none"
    line = f"last operation: {op.kind} {op.operation_id} {op.state.name}"
    if op.from_topology or op.to_topology:
        line += f" ({op.from_topology} -> {op.to_topology})"
    line += f", started {_when(op.started_at)}"
    if op.ended_at:
        line += f", took {op.ended_at - op.started_at:.3f} s"
    if op.phase_seconds:
        line += "; " + ", ".join(f"{phase} {seconds:.3f} s" for phase, seconds in op.phase_seconds.items())
    if op.error:
        line += f"; error: {op.error}"
    return line


def format_table(status: StackStatus) -> str:
    """The human view of a status: header, one row per worker, requests and the last operation."""
    lines = [f"topology: {status.topology}    state: {status.state.name}    model: {status.model or '-'}"]
    if status.reason:
        lines.append(f"reason: {status.reason}")
    header = ("RANK", "PID", "STATE", "DEVICE", "STAGE", "TP", "LAYERS", "KV HEADS", "KV BLOCKS", "PARAMS",
              "ADDRESS")
    rows = [header]
    for w in status.workers:
        reachable = w.state is not WorkerState.UNREACHABLE
        rows.append((
            str(w.rank), str(w.pid) if reachable else "-", w.state.name, w.device or "-",
            str(w.pp_rank) if w.state is WorkerState.ACTIVE else "-",
            str(w.tp_rank) if w.state is WorkerState.ACTIVE else "-",
            _layers(w), _kv_heads(w),
            f"{w.num_kv_blocks_used}/{w.num_kv_blocks_total}" if reachable else "-",
            _mib(w.param_bytes) if reachable else "-", w.address,
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines.append("")
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.append("")
    router = status.router
    if router is None:
        where = status.router_address or "none"
        lines.append(f"requests: unknown (router {where} did not answer)" if status.router_address
                     else "requests: unknown (no router)")
    else:
        usage = router.num_kv_blocks_used / router.num_kv_blocks_total if router.num_kv_blocks_total else 0.0
        lines.append(f"requests: {router.num_running} running, {router.num_waiting} waiting    "
                     f"KV cache: {router.num_kv_blocks_used}/{router.num_kv_blocks_total} blocks ({usage:.1%})    "
                     f"preemptions: {router.num_preemptions}")
    lines.append(_operation_line(status.last_operation))
    return "\n".join(lines)


def _status_command(args: argparse.Namespace) -> int:
    target = resolve_target(args.controller, args.token_file)
    status = fetch_status(target, args.timeout)
    if args.json:
        print(json.dumps(status.to_json(), indent=2))
    else:
        print(format_table(status))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Entry of the `reconfigctl` console script: 0 ok, 1 stack unreachable, 2 usage."""
    args = build_parser().parse_args(argv)  # exits 2 on a usage error
    try:
        return _status_command(args)
    except Unreachable as exc:
        print(f"reconfigctl {args.command}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE


if __name__ == "__main__":
    sys.exit(main())
