"""`reconfigctl instances [list | drain NAME | undrain NAME | add ADDRESS | remove NAME | start [--topology T] |
stop NAME]`: the front router's instances (`reconfig up --instances N`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from services.controller.client import EXIT_OK, EXIT_REFUSED, CommandFailed, Unreachable, find_stack, tls_from_args
from services.rpc.auth import InsecureTokenError, auth_metadata, read_token_file
from services.rpc.reconfig.v1 import front_pb2, front_pb2_grpc
from services.rpc.tls import add_tls_arguments, sync_channel

_REFUSED = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.UNIMPLEMENTED)


def add_parser(commands: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--front", default=os.environ.get("RECONFIG_FRONT"),
                        help="the front router's gRPC host:port (default: $RECONFIG_FRONT, else the stack file)")
    common.add_argument("--token-file", type=Path, default=os.environ.get("RECONFIG_TOKEN_FILE"),
                        help="control-plane token file (default: $RECONFIG_TOKEN_FILE, else the stack file)")
    common.add_argument("--stack", default=argparse.SUPPRESS, metavar="NAME|PORT",
                        help="the stack, by name or port, when several run (default: $RECONFIG_STACK)")
    add_tls_arguments(common, from_environment=True)
    common.add_argument("--timeout", type=float, default=60.0, help="seconds to wait [60]")
    common.add_argument("--json", action="store_true", help="print the reply as JSON")
    instances = commands.add_parser("instances", parents=[common],
                                    help="the instances behind the front router (reconfig up --instances N)")
    sub = instances.add_subparsers(dest="instances_command")
    sub.add_parser("list", parents=[common], help="every instance: layout, state, requests, KV (the default)")
    for name, text in (("drain", "move an instance's requests live onto a standby one and take it out of service"),
                       ("undrain", "put a drained instance back in service"),
                       ("remove", "stop serving a drained instance that holds no request"),
                       ("stop", "stop serving a drained instance that holds no request, and stop its processes "
                                "(reconfig up --instances)")):
        command = sub.add_parser(name, parents=[common], help=text)
        command.add_argument("name", help="the instance (i0, i1, ...)")
    add = sub.add_parser("add", parents=[common], help="serve another instance (its router's gRPC address)")
    add.add_argument("address", help="host:port of the instance's router gRPC")
    start = sub.add_parser("start", parents=[common], help="start another instance on this host and serve it, on "
                                                         "standby (reconfig up --instances)")
    start.add_argument("--topology", default="", help="its layout, e.g. tp1pp2 [the first instance's]")


def _target(args: argparse.Namespace) -> tuple[str, str]:
    front, token_file = args.front, args.token_file
    if front is None or token_file is None:
        stack = find_stack(args.stack)
        if not stack.front_grpc_address and front is None:
            raise Unreachable(f"stack {stack.name!r} has one instance and no front router (start one with "
                              "`reconfig up --instances N`)")
        front, token_file = front or stack.front_grpc_address, token_file or Path(stack.token_file)
    try:
        return front, read_token_file(token_file)
    except (OSError, ValueError) as exc:
        raise Unreachable(f"cannot read the control-plane token: {exc}") from None


def _channel(address: str, tls) -> grpc.Channel:
    try:
        return sync_channel(address, tls, carries_token=True)
    except InsecureTokenError as exc:
        raise CommandFailed(str(exc), EXIT_REFUSED) from None


def format_instances(reply: front_pb2.ListInstancesResponse) -> str:
    lines = [f"{'NAME':<6} {'STATE':<8} {'LAYOUT':<8} {'REQUESTS':>8} {'KV TOKENS':>16}  {'SLOT':<12} ROUTER"]
    for i in reply.instances:
        kv = f"{i.kv_tokens}/{i.capacity_tokens}"
        lines.append(f"{i.name:<6} {i.state:<8} {i.topology:<8} {i.num_requests:>8} {kv:>16}  {i.slot or '-':<12} "
                     f"{i.address}")
    moves = ", ".join(f"{k} {v}" for k, v in sorted(reply.moves.items()))
    lines.append(f"policy {reply.policy}; time-average instances in use {reply.time_average_instances:.2f}; "
                 f"moves: {moves}; KV moved {reply.kv_bytes_moved / 2**20:.1f} MiB; "
                 f"re-placed after a lost instance: {reply.num_replaced}")
    return "\n".join(lines)


def _status_line(reply: front_pb2.InstanceStatus) -> str:
    return f"{reply.name}: {reply.state} ({reply.topology}, {reply.capacity_tokens} KV tokens) at {reply.address}"


def instances_command(args: argparse.Namespace) -> int:
    try:
        address, token = _target(args)
        with _channel(address, tls_from_args(args)) as channel:
            stub = front_pb2_grpc.FrontStub(channel)
            metadata = auth_metadata(token)
            command = args.instances_command or "list"
            if command == "list":
                reply = stub.ListInstances(front_pb2.ListInstancesRequest(), timeout=args.timeout, metadata=metadata)
                text = format_instances(reply)
            elif command == "add":
                reply = stub.AddInstance(front_pb2.AddInstanceRequest(address=args.address), timeout=args.timeout,
                                         metadata=metadata)
                text = _status_line(reply)
            elif command == "start":
                reply = stub.StartInstance(front_pb2.StartInstanceRequest(topology=args.topology),
                                           timeout=args.timeout, metadata=metadata)
                text = _status_line(reply)
            elif command == "stop":
                reply = stub.StopInstance(front_pb2.StopInstanceRequest(name=args.name), timeout=args.timeout,
                                          metadata=metadata)
                text = f"{args.name}: stopped"
            elif command == "remove":
                reply = stub.RemoveInstance(front_pb2.RemoveInstanceRequest(name=args.name), timeout=args.timeout,
                                            metadata=metadata)
                text = f"{args.name}: removed"
            else:
                reply = stub.DrainInstance(front_pb2.DrainInstanceRequest(name=args.name, drain=command == "drain"),
                                           timeout=args.timeout, metadata=metadata)
                text = (f"{reply.instance.name}: {reply.instance.state}; moved {reply.num_moved} requests, "
                        f"{reply.num_failed} could not move (they finish there)")
    except grpc.RpcError as exc:
        code = exc.code()
        if code in _REFUSED:
            print(f"reconfigctl instances: refused ({code.name}): {exc.details()}", file=sys.stderr)
            return EXIT_REFUSED
        print(f"reconfigctl instances: cannot reach the front router: {code.name}: {exc.details()}", file=sys.stderr)
        return 1
    except CommandFailed as exc:
        print(f"reconfigctl instances: {exc}", file=sys.stderr)
        return exc.exit_code
    print(json.dumps(MessageToDict(reply, preserving_proto_field_name=True), indent=2) if args.json else text)
    return EXIT_OK
