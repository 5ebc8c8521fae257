"""`python -m services.controller --workers A,B,... --topology tpXppY --token-file F`: run the controller."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from services.controller.server import serve_controller
from services.controller.state import ControllerConfig
from services.rpc.auth import read_token_file
from services.rpc.tls import add_tls_arguments, from_args
from services.runtime.process import run_service


def _addresses(text: str) -> tuple[str, ...]:
    addresses = tuple(a.strip() for a in text.split(",") if a.strip())
    if not addresses or any(":" not in a for a in addresses):
        raise argparse.ArgumentTypeError(f"expected host:port[,host:port...], got {text!r}")
    return addresses


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags."""
    parser = argparse.ArgumentParser(prog="python -m services.controller", description=__doc__)
    parser.add_argument("--workers", type=_addresses, required=True, help="worker gRPC addresses, by rank")
    parser.add_argument("--topology", required=True, help="live topology at start, e.g. tp2pp2")
    parser.add_argument("--token-file", type=Path, required=True, help="file holding the control-plane token")
    parser.add_argument("--router-grpc", default=None, help="router gRPC address (host:port)")
    parser.add_argument("--model", default="", help="served model name (display only)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    parser.add_argument("--port", type=int, default=50051, help="port to listen on (0: any free port)")
    parser.add_argument("--port-file", type=Path, help="write the bound port here once ready")
    parser.add_argument("--interval", type=float, default=1.0, help="refresh interval in seconds")
    parser.add_argument("--rpc-timeout", type=float, default=2.0, help="deadline of each worker/router call (s)")
    parser.add_argument("--model-dir", default="",
                        help="checkpoint directory (the router's --model): without it the controller cannot switch")
    parser.add_argument("--state-file", default="", help="where the live layout survives a controller restart")
    parser.add_argument("--autopilot", choices=("off", "advise", "auto"), default="off",
                        help="switch layouts by measured load (advise: only say what it would do) [off]")
    parser.add_argument("--intents", default="", help="SLO intents file (TOML/JSON) the autopilot follows")
    parser.add_argument("--autopilot-policy", default="", metavar="K=V,...",
                        help="policy settings (cooldown_s, min_dwell_s, window, hysteresis, horizon_s, ...)")
    parser.add_argument("--profile", default="", help="layout profile file [cached per model and machine]")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve the controller's /metrics (the autopilot's) on this port (0: any free port)")
    add_tls_arguments(parser)
    return parser


def write_port_file(path: Path, port: int) -> None:
    """Write `port` atomically: readers see no file or the whole number."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as file:
        file.write(f"{port}\n")
    os.replace(temporary, path)


def main(argv: list[str] | None = None) -> int:
    """Run the controller until SIGTERM/SIGINT; exit 2 on bad flags, 1 when it cannot start."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = ControllerConfig(
            token=read_token_file(args.token_file), worker_addresses=args.workers, topology=args.topology,
            router_grpc_address=args.router_grpc, model=args.model, host=args.host, port=args.port,
            refresh_interval_s=args.interval, rpc_timeout_s=args.rpc_timeout, model_dir=args.model_dir,
            state_file=args.state_file, autopilot=args.autopilot, intents_file=args.intents,
            autopilot_policy=args.autopilot_policy, profile_file=args.profile, metrics_port=args.metrics_port,
            tls=from_args(args),
        )
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    on_ready = (lambda port: write_port_file(args.port_file, port)) if args.port_file else None
    try:
        run_service("controller", serve_controller(config, on_ready), None)
    except SystemExit as exc:  # run_service logged the failure
        return int(exc.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
