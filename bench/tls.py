"""What mutual TLS costs a round trip: a gRPC unary call and the step socket's frames, each in plaintext and over
TLS (services/rpc/tls.py, certificates from `reconfig certs` in a temporary directory), side by side in one run.

    python bench/tls.py [--messages 5000] [--request-bytes 1117] [--result-bytes 261]

An echo server in a child process answers each message with --result-bytes; this process sends --request-bytes
messages one at a time (by default a decode step of 64 requests and its result, as bench/step_transport.py) and
counts its own CPU time (user + system) and the wall time per round trip; the connection (and its handshake) is made
before the clock starts. Prints a table, writes JSON and a plot (bench/results/ by default).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from report import apply_defaults, paired_bars, write_report  # noqa: E402

from services.rpc.certs import write_dev_certs  # noqa: E402
from services.rpc.tls import TLSConfig  # noqa: E402

DEFAULTS = dict(messages=5000, request_bytes=1117, result_bytes=261)
_METHOD = "/bench.Echo/Call"
_WARM_UP = 200


def _cpu() -> float:
    times = os.times()
    return times.user + times.system


async def _grpc_server(result: bytes, tls: TLSConfig | None, ports: mp.Queue) -> None:
    import grpc

    from services.rpc.server import listen, new_server

    async def call(request, context):
        return result

    server = new_server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "bench.Echo", {"Call": grpc.unary_unary_rpc_method_handler(call)}),))
    ports.put(listen(server, "127.0.0.1", 0, "bench echo", tls))
    await server.start()
    await server.wait_for_termination()


async def _frame_server(result: bytes, tls: TLSConfig | None, ports: mp.Queue) -> None:
    from services.rpc.frames import FrameProtocol

    class Echo(FrameProtocol):
        def frame_received(self, payload: bytes) -> None:
            self.send(result)

    ssl = tls.server_ssl_context() if tls else None
    server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0, ssl=ssl)
    ports.put(server.sockets[0].getsockname()[1])
    await server.serve_forever()


def _serve(link: str, result_bytes: int, tls: TLSConfig | None, ports: mp.Queue) -> None:
    import uvloop

    server = _grpc_server if link == "grpc unary" else _frame_server
    uvloop.run(server(b"r" * result_bytes, tls, ports))


async def _grpc_client(port: int, tls: TLSConfig | None, request: bytes, count: int) -> tuple[float, float]:
    from services.rpc.tls import aio_channel

    async with aio_channel(f"127.0.0.1:{port}", tls) as channel:
        call = channel.unary_unary(_METHOD)
        for _ in range(_WARM_UP):
            await call(request)
        started, wall = _cpu(), time.perf_counter()
        for _ in range(count):
            await call(request)
        return _cpu() - started, time.perf_counter() - wall


async def _frame_client(port: int, tls: TLSConfig | None, request: bytes, count: int) -> tuple[float, float]:
    from services.rpc.frames import FrameProtocol

    class Client(FrameProtocol):
        def __init__(self) -> None:
            super().__init__()
            self.answer: asyncio.Future | None = None

        def frame_received(self, payload: bytes) -> None:
            self.answer.set_result(payload)

    loop = asyncio.get_running_loop()
    ssl = {"ssl": tls.client_ssl_context(), "server_hostname": "127.0.0.1"} if tls else {}
    transport, client = await loop.create_connection(Client, "127.0.0.1", port, **ssl)

    async def round_trip() -> None:
        client.answer = loop.create_future()
        client.send(request)
        await client.answer

    for _ in range(_WARM_UP):
        await round_trip()
    started, wall = _cpu(), time.perf_counter()
    for _ in range(count):
        await round_trip()
    spent, wall = _cpu() - started, time.perf_counter() - wall
    transport.close()
    return spent, wall


def measure(link: str, tls: TLSConfig | None, args: argparse.Namespace) -> dict:
    import uvloop

    context = mp.get_context("spawn")
    ports: mp.Queue = context.Queue()
    server = context.Process(target=_serve, args=(link, args.result_bytes, tls, ports), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        client = _grpc_client if link == "grpc unary" else _frame_client
        spent, wall = uvloop.run(client(port, tls, b"q" * args.request_bytes, args.messages))
    finally:
        server.kill()
    return dict(link=link, transport="tls" if tls else "plaintext",
                cpu_us_per_round_trip=round(1e6 * spent / args.messages, 1),
                wall_us_per_round_trip=round(1e6 * wall / args.messages, 1))


def plot(rows: list[dict], path: Path, title: str) -> None:
    paired_bars(path, title, [f"{r['link']}\n{r['transport']}" for r in rows],
                ("client CPU us / round trip", [r["cpu_us_per_round_trip"] for r in rows]),
                ("wall us / round trip", [r["wall_us_per_round_trip"] for r in rows]), "microseconds")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int)
    parser.add_argument("--request-bytes", type=int)
    parser.add_argument("--result-bytes", type=int)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "tls.json")
    args = parser.parse_args(argv)
    apply_defaults(args, DEFAULTS)
    with tempfile.TemporaryDirectory(prefix="reconfig-bench-tls-") as directory:
        files = write_dev_certs(["bench"], directory)[0]
        tls = TLSConfig(str(files.cert), str(files.key), str(files.ca))
        rows = [measure(link, config, args) for link in ("grpc unary", "step socket") for config in (None, tls)]
    ratios = {}
    lines = ["| link | transport | client CPU us / round trip | wall us / round trip |", "|---|---|---|---|"]
    for plain, secure in (rows[0:2], rows[2:4]):
        for row in (plain, secure):
            lines.append(f"| {row['link']} | {row['transport']} | {row['cpu_us_per_round_trip']:.1f} | "
                         f"{row['wall_us_per_round_trip']:.1f} |")
        key = plain["link"].replace(" ", "_")
        ratios[f"{key}_tls_over_plaintext_cpu"] = round(secure["cpu_us_per_round_trip"]
                                                        / plain["cpu_us_per_round_trip"], 2)
        ratios[f"{key}_tls_over_plaintext_wall"] = round(secure["wall_us_per_round_trip"]
                                                         / plain["wall_us_per_round_trip"], 2)
    lines += ["", *(f"{name}: {value:.2f}x" for name, value in ratios.items())]
    title = (f"mutual TLS vs plaintext, one message in flight: {args.request_bytes} B out, {args.result_bytes} B "
             f"back, {args.messages} round trips ({os.cpu_count()} cores)")
    write_report(args, title, "\n".join(lines), rows, plot, **ratios)


if __name__ == "__main__":
    main()
