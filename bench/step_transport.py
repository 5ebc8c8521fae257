"""The step link's transport alone: a grpc.aio bidirectional stream (how steps went before) against the step
socket's frames (services/rpc/frames.py), side by side in one run.

    python bench/step_transport.py [--messages 5000] [--request-bytes 1117] [--result-bytes 261]

An echo server in a child process answers each message with a result of --result-bytes; this process sends
--request-bytes messages (by default the delta form's decode step of 64 requests and its result: bench/wire_sizes.py)
one at a time, as a router does with one step in flight, and counts its own CPU time (user + system) per round trip.
Prints a table, writes JSON and a plot (bench/results/ by default).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from report import apply_defaults, paired_bars, write_report  # noqa: E402

DEFAULTS = dict(messages=5000, request_bytes=1117, result_bytes=261)
_METHOD = "/bench.Steps/Execute"


def _cpu() -> float:
    times = os.times()
    return times.user + times.system


async def _grpc_server(result: bytes, ports: mp.Queue) -> None:
    import grpc

    async def execute(requests, context):
        async for _ in requests:
            yield result

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "bench.Steps", {"Execute": grpc.stream_stream_rpc_method_handler(execute)}),))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    await server.wait_for_termination()


async def _frame_server(result: bytes, ports: mp.Queue) -> None:
    from services.rpc.frames import FrameProtocol

    class Echo(FrameProtocol):
        def frame_received(self, payload: bytes) -> None:
            self.send(result)

    server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0)
    ports.put(server.sockets[0].getsockname()[1])
    await server.serve_forever()


def _serve(kind: str, result_bytes: int, ports: mp.Queue) -> None:
    import uvloop

    server = _grpc_server if kind == "grpc" else _frame_server
    uvloop.run(server(b"r" * result_bytes, ports))


async def _grpc_client(port: int, request: bytes, count: int) -> float:
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(_METHOD)()
        for _ in range(200):  # warm-up
            await call.write(request)
            await call.read()
        started = _cpu()
        for _ in range(count):
            await call.write(request)
            await call.read()
        spent = _cpu() - started
        await call.done_writing()
    return spent


async def _frame_client(port: int, request: bytes, count: int) -> float:
    from services.rpc.frames import FrameProtocol

    class Client(FrameProtocol):
        def __init__(self) -> None:
            super().__init__()
            self.answer: asyncio.Future | None = None

        def frame_received(self, payload: bytes) -> None:
            self.answer.set_result(payload)

    loop = asyncio.get_running_loop()
    transport, client = await loop.create_connection(Client, "127.0.0.1", port)

    async def round_trip() -> None:
        client.answer = loop.create_future()
        client.send(request)
        await client.answer

    for _ in range(200):
        await round_trip()
    started = _cpu()
    for _ in range(count):
        await round_trip()
    spent = _cpu() - started
    transport.close()
    return spent


def measure(kind: str, args: argparse.Namespace) -> dict:
    import uvloop

    ports: mp.Queue = mp.get_context("spawn").Queue()
    server = mp.get_context("spawn").Process(target=_serve, args=(kind, args.result_bytes, ports), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=30)
        client = _grpc_client if kind == "grpc" else _frame_client
        started = time.perf_counter()
        spent = uvloop.run(client(port, b"q" * args.request_bytes, args.messages))
        wall = time.perf_counter() - started
    finally:
        server.kill()
    return dict(transport=kind, cpu_us_per_round_trip=round(1e6 * spent / args.messages, 1),
                wall_us_per_round_trip=round(1e6 * wall / args.messages, 1))


def plot(rows: list[dict], path: Path, title: str) -> None:
    paired_bars(path, title, [r["transport"] for r in rows],
                ("client CPU us / round trip", [r["cpu_us_per_round_trip"] for r in rows]),
                ("wall us / round trip", [r["wall_us_per_round_trip"] for r in rows]), "microseconds")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int)
    parser.add_argument("--request-bytes", type=int)
    parser.add_argument("--result-bytes", type=int)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "step_transport.json")
    args = parser.parse_args(argv)
    apply_defaults(args, DEFAULTS)
    rows = [measure(kind, args) for kind in ("grpc", "frames")]
    ratio = rows[0]["cpu_us_per_round_trip"] / rows[1]["cpu_us_per_round_trip"]
    table = "\n".join(["| transport | client CPU us / round trip | wall us / round trip |", "|---|---|---|",
                       *(f"| {r['transport']} | {r['cpu_us_per_round_trip']:.1f} | {r['wall_us_per_round_trip']:.1f} |"
                         for r in rows), "", f"gRPC / frames, client CPU: {ratio:.2f}x"])
    title = (f"one step in flight: {args.request_bytes} B out, {args.result_bytes} B back, {args.messages} round "
             f"trips ({os.cpu_count()} cores)")
    write_report(args, title, table, rows, plot, grpc_over_frames_cpu=round(ratio, 2))


if __name__ == "__main__":
    main()
