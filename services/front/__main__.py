"""`python -m services.front`: the front router as its own process (multi-host: the instances' routers are
addresses like any other)."""

from __future__ import annotations

import argparse

from services.front.server import FrontConfig, serve_front
from services.placement import POLICY_NAMES
from services.rpc.tls import TLSError, add_tls_arguments, from_args
from services.runtime.process import run_service


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.front", description=__doc__)
    parser.add_argument("--instances", required=True,
                        help="comma-separated gRPC addresses of the instances' routers (named i0, i1, ...)")
    parser.add_argument("--model", required=True, help="checkpoint directory (tokenizer) the instances serve")
    parser.add_argument("--model-name", default="", help="served model id [directory name]")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=50053, help="the Front gRPC (reconfigctl instances)")
    parser.add_argument("--token-file", help="the instances' control-plane token (moves need it)")
    parser.add_argument("--api-key", help="require this bearer key on /v1/*")
    parser.add_argument("--policy", choices=POLICY_NAMES, default="mell")
    parser.add_argument("--no-migrate", dest="migrate", action="store_false",
                        help="place requests only; never move one")
    add_tls_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> FrontConfig:
    token = None
    if args.token_file:
        from services.rpc.auth import read_token_file

        token = read_token_file(args.token_file)
    return FrontConfig(
        instance_addresses=tuple(a for a in args.instances.split(",") if a), model_dir=args.model,
        model_name=args.model_name, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
        token=token, api_key=args.api_key, policy=args.policy, migrate=args.migrate, tls=from_args(args))


def main() -> None:
    parser = build_parser()
    try:
        config = config_from_args(parser.parse_args())
    except TLSError as exc:
        parser.error(str(exc))
    run_service("front", serve_front(config), None)


if __name__ == "__main__":
    main()
