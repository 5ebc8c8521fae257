"""`python -m services.weightstore --model DIR`: load a checkpoint into shared memory and serve it."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

import structlog

from services.rpc.tls import TLSError, add_tls_arguments, from_args
from services.weightstore.server import serve
from services.weightstore.store import CheckpointError

log = structlog.get_logger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(prog="python -m services.weightstore", description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any free port)")
    parser.add_argument("--port-file", type=Path, help="write the bound port here once ready")
    parser.add_argument("--store-port", type=int, default=0,
                        help="also host the workers' torch.distributed TCPStore on this port (0: do not); the "
                             "store must outlive any worker for the world to be re-formed after one is lost")
    add_tls_arguments(parser)
    args = parser.parse_args(argv)
    try:
        args.tls = from_args(args)
    except TLSError as exc:
        parser.error(str(exc))
    return args


def write_port_file(path: Path, port: int) -> None:
    """Write `port` to `path` atomically: readers see no file or the whole number."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(f"{port}\n")
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def main(argv: list[str] | None = None) -> int:
    """Run the weightstore until SIGTERM/SIGINT; returns the exit status."""
    args = parse_args(argv)
    on_ready = (lambda port: write_port_file(args.port_file, port)) if args.port_file else None
    store = None
    if args.store_port:
        from services.runtime.store import host_tcp_store

        store = host_tcp_store(args.store_port)  # lives as long as this process
        log.info("weightstore.tcp_store", port=args.store_port)
    coroutine = serve(args.model, host=args.host, port=args.port, on_ready=on_ready, tls=args.tls)
    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(coroutine)
        else:
            uvloop.run(coroutine)
    except CheckpointError as error:
        log.error("weightstore.checkpoint_error", error=str(error))
        return 2
    except (OSError, RuntimeError) as error:
        log.error("weightstore.failed", error=str(error))
        return 1
    finally:
        del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
