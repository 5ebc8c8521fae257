"""`reconfigctl autopilot status|set MODE` and `reconfigctl calibrate`: the autopilot's commands."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from services.controller.autopilot import MODES

if TYPE_CHECKING:  # the commands import what they call: `reconfigctl --help` stays quick
    from services.controller.client import Target
    from services.rpc.reconfig.v1 import controller_pb2


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N,N,..., got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_parsers(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    autopilot = commands.add_parser("autopilot", help="the autopilot: what it would do and why, or set its mode")
    sub = autopilot.add_subparsers(dest="autopilot_command", required=True)
    status = sub.add_parser("status", parents=[common], help="mode, profile, thresholds and the last decision")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.add_argument("--plot", metavar="FILE.png", help="also plot the profile (needs matplotlib)")
    mode = sub.add_parser("set", parents=[common], help="set the mode: off, advise (report only) or auto (switch)")
    mode.add_argument("mode", choices=MODES)
    mode.add_argument("--json", action="store_true", help="print the status as JSON")
    calibrate = commands.add_parser(
        "calibrate", parents=[common],
        help="measure each layout on the live stack (switching through them) and give the profile to the autopilot")
    calibrate.add_argument("--layouts", default="", metavar="L,L,...",
                           help="layouts to measure (default: the live one and every layout the workers can run)")
    calibrate.add_argument("--batch-sizes", type=_ints, default=(), metavar="N,N,...",
                           help="requests kept in flight, one measurement each [1,4,12]")
    calibrate.add_argument("--prompt-tokens", type=_ints, default=(), metavar="N,N,...",
                           help="prompt lengths measured [32,160]")
    calibrate.add_argument("--output-tokens", type=int, default=0, metavar="N",
                           help="tokens each measuring request generates [16]")
    calibrate.add_argument("--json", action="store_true", help="print the resulting status as JSON")
    calibrate.add_argument("--plot", metavar="FILE.png", help="also plot the profile (needs matplotlib)")


def _print(pb: controller_pb2.AutopilotStatus, args: argparse.Namespace, text: str) -> None:
    from google.protobuf.json_format import MessageToDict

    from services.controller.autopilot.view import plot_profile
    from services.controller.client import CommandFailed

    print(json.dumps(MessageToDict(pb, preserving_proto_field_name=True), indent=2) if args.json else text)
    if getattr(args, "plot", None):
        if not pb.layouts:
            raise CommandFailed("no profile to plot yet: run `reconfigctl calibrate`")
        try:
            plot_profile(pb, args.plot)
        except ImportError:
            raise CommandFailed("--plot needs matplotlib (pip install matplotlib)") from None
        print(f"profile plotted to {args.plot}", file=sys.stderr)


def autopilot_command(args: argparse.Namespace, target: Target) -> int:
    import grpc

    from services.controller.autopilot.view import format_status
    from services.controller.client import EXIT_OK, rpc_failure
    from services.rpc.auth import auth_metadata
    from services.rpc.reconfig.v1 import controller_pb2, controller_pb2_grpc

    with target.channel() as channel:
        stub = controller_pb2_grpc.ControllerStub(channel)
        try:
            if args.autopilot_command == "set":
                pb = stub.SetAutopilot(controller_pb2.SetAutopilotRequest(mode=args.mode),
                                                 timeout=args.timeout or 10.0, metadata=auth_metadata(target.token))
            else:
                pb = stub.GetAutopilot(controller_pb2.GetAutopilotRequest(),
                                                 timeout=args.timeout or 10.0, metadata=auth_metadata(target.token))
        except grpc.RpcError as exc:
            raise rpc_failure(exc, target) from None
    _print(pb, args, format_status(pb))
    return EXIT_OK


def calibrate_command(args: argparse.Namespace, target: Target) -> int:
    import grpc

    from services.controller.autopilot.view import format_profile
    from services.controller.client import EXIT_OK, CommandFailed, rpc_failure
    from services.rpc.auth import auth_metadata
    from services.rpc.reconfig.v1 import controller_pb2, controller_pb2_grpc

    request = controller_pb2.CalibrateRequest(
        layouts=[t.strip() for t in args.layouts.split(",") if t.strip()], batch_sizes=args.batch_sizes,
        prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens)
    final = None
    with target.channel() as channel:
        try:
            for progress in controller_pb2_grpc.ControllerStub(channel).Calibrate(request, timeout=args.timeout,
                                                     metadata=auth_metadata(target.token)):
                if progress.HasField("status"):
                    final = progress.status
                elif not args.json:
                    print(f"[{progress.done:4.0%}] {progress.message}", file=sys.stderr, flush=True)
        except grpc.RpcError as exc:
            raise rpc_failure(exc, target) from None
    if final is None:
        raise CommandFailed("the calibration ended without a result")
    _print(final, args, format_profile(final))
    return EXIT_OK
