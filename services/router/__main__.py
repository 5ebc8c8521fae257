"""`python -m services.router`: the router as its own process (compose, multi-host)."""

from __future__ import annotations

import argparse

from services.router.main import RouterConfig, serve_router
from services.rpc.tls import TLSError, add_tls_arguments, from_args
from services.runtime.process import run_service


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags."""
    parser = argparse.ArgumentParser(prog="python -m services.router", description=__doc__)
    parser.add_argument("--workers", required=True, help="comma-separated worker gRPC addresses, rank order")
    parser.add_argument("--model", required=True, help="checkpoint directory (tokenizer, config.json)")
    parser.add_argument("--model-name", default="", help="served model id [directory name]")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=50052)
    parser.add_argument("--token-file", help="control-plane token protecting the admin RPCs")
    parser.add_argument("--api-key", help="require this bearer key on /v1/*")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-waiting", type=int, default=1024)
    parser.add_argument("--recovery-timeout-s", type=float, default=60.0,
                        help="after a worker fails a step, wait this long for the controller to recover the "
                             "workers before failing the requests [60]")
    parser.add_argument("--spread-decodes", action="store_true",
                        help="PP layouts: spread the running decodes over the pipeline's micro-batches [off]")
    parser.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                        help="single-stage layouts: wait for each step's tokens before sending the next [send each "
                             "decode's next step ahead, the workers feeding the token they sampled]")
    parser.add_argument("--eplb", action="store_true",
                        help="MoE, EP layouts: rebalance the experts every --eplb-step-interval steps [off]")
    parser.add_argument("--eplb-step-interval", type=positive_int, default=3000,
                        help="steps between automatic EPLB rebalances [3000]")
    add_tls_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The RouterConfig the flags describe (reads the token file)."""
    token = None
    if args.token_file:
        from services.rpc.auth import read_token_file

        token = read_token_file(args.token_file)
    return RouterConfig(
        worker_addresses=tuple(a for a in args.workers.split(",") if a), model_dir=args.model,
        model_name=args.model_name, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
        token=token, api_key=args.api_key, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_waiting=args.max_waiting,
        recovery_timeout_s=args.recovery_timeout_s, eplb=args.eplb, eplb_step_interval=args.eplb_step_interval,
        spread_decodes=args.spread_decodes, async_scheduling=args.async_scheduling, tls=from_args(args),
    )


def main() -> None:
    parser = build_parser()
    try:
        config = config_from_args(parser.parse_args())
    except TLSError as exc:
        parser.error(str(exc))
    run_service("router", serve_router(config), None)


if __name__ == "__main__":
    main()
