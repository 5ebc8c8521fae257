"""Fuzzing fixtures: a real model with a 32-position context (so every accepted case finishes in milliseconds), the
transformers oracle on it, an event loop on a thread that owns the engines and servers while the (sync) fuzzers
call them, the HTTP app on uvicorn, and the Router + Controller gRPC services over token-protected workers."""

from __future__ import annotations

import os

import asyncio
import json
import socket
import threading
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import requests
import uvicorn
from hypothesis import HealthCheck, settings

from services.controller.server import start_controller_grpc
from services.controller.state import ControllerConfig, ControllerState
from services.launch.cluster import ClusterConfig, LocalCluster
from services.model.tokenizer import write_tokenizer_files
from services.router.api.app import ApiConfig, create_app
from services.router.engine import Engine
from services.router.grpc_server import start_router_grpc
from services.router.main import RouterConfig, build_engine
from services.rpc.auth import auth_metadata
from services.rpc.reconfig.v1 import controller_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2_grpc
from tests.conftest import hf_greedy, make_checkpoint, wait_until

T = TypeVar("T")
FUZZ_CONTEXT = 32                  # max_position_embeddings of the fuzz model: a request costs <= 32 steps
ORACLE_PROMPT = [1, 72, 101, 108, 108, 111]  # bos + "Hello"
ORACLE_MAX_TOKENS = 8
MODEL = "llama-fuzz"               # the HTTP app's model id
MAX_REQUEST_BYTES = 1 << 20        # the HTTP app's body limit
API_KEY = "fuzz-api-key"           # the HTTP app's key (/v1/* needs it); the target's session sends it
TOKEN = "fuzz-control-token"       # the gRPC stack's control-plane token (workers, router admin, controller)
TOPOLOGY = "tp2pp1"                # the gRPC stack's layout at start: 2 workers
# derandomize in CI: the same cases every run (a fuzzer must not make a submission fail at random); set
# RECONFIG_FUZZ_RANDOM=1 to explore new cases locally.
FUZZ_SETTINGS = settings(deadline=None, database=None, print_blob=True,
                         derandomize=not os.environ.get("RECONFIG_FUZZ_RANDOM"),
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                                HealthCheck.data_too_large])


class LoopThread:
    """An asyncio loop on its own thread: engines and servers live there while the fuzzers (sync) call them."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        """Run `coroutine` on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="package")
def fuzz_checkpoint(tmp_path_factory) -> Path:
    """A Llama-style checkpoint whose context is FUZZ_CONTEXT positions (config and tokenizer agree)."""
    directory = make_checkpoint(tmp_path_factory.mktemp("fuzz") / "llama-fuzz", "llama", seed=7)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = FUZZ_CONTEXT
    config_path.write_text(json.dumps(config, indent=2))
    write_tokenizer_files(directory, FUZZ_CONTEXT)
    return directory


@pytest.fixture(scope="package")
def oracle_tokens(fuzz_checkpoint) -> list[int]:
    """Greedy tokens transformers generates for ORACLE_PROMPT on the fuzz checkpoint."""
    tokens, _ = hf_greedy(fuzz_checkpoint, [ORACLE_PROMPT], ORACLE_MAX_TOKENS)
    return tokens[0]


@pytest.fixture(scope="module")
def loop_thread():
    """One loop thread per test module."""
    loop = LoopThread()
    yield loop
    loop.close()


# ---- HTTP ------------------------------------------------------------------------------------------------------------
@dataclass
class HttpTarget:
    """The served app: its engine (owned by `loop`), its loopback URL and its OpenAPI document."""

    engine: Engine
    loop: LoopThread
    base_url: str
    schema: dict
    session: requests.Session          # sends the API key


@pytest.fixture(scope="module")
def http_target(fuzz_checkpoint, loop_thread):
    """One worker, a real Engine and the HTTP app (with an API key) on uvicorn at 127.0.0.1:<free port>."""
    config = ClusterConfig(model=str(fuzz_checkpoint), num_workers=1, topology="tp1pp1", kv_cache_bytes=1 << 20,
                           block_size=4)
    with LocalCluster(config) as cluster:
        engine = loop_thread.run(build_engine(RouterConfig(
            worker_addresses=tuple(cluster.worker_addresses), model_dir=str(fuzz_checkpoint), model_name=MODEL,
            max_waiting=64)))
        assert engine.max_model_len == FUZZ_CONTEXT
        app = create_app(engine, ApiConfig(model_name=MODEL, max_request_bytes=MAX_REQUEST_BYTES, api_key=API_KEY))
        # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets whose proto says TCP (else every
        # response waits ~40 ms for a delayed ACK).
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        listener.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
        serving = asyncio.run_coroutine_threadsafe(server.serve(sockets=[listener]), loop_thread.loop)
        wait_until(lambda: server.started or serving.done(), what="uvicorn to start")
        assert not serving.done(), f"uvicorn did not start: {serving.exception()!r}"
        session = requests.Session()
        session.headers["Authorization"] = f"Bearer {API_KEY}"
        try:
            yield HttpTarget(engine, loop_thread, f"http://127.0.0.1:{listener.getsockname()[1]}", app.openapi(),
                             session)
        finally:
            session.close()
            server.should_exit = True
            serving.result(10)
            loop_thread.run(engine.stop())
            listener.close()


# ---- gRPC ------------------------------------------------------------------------------------------------------------
@dataclass
class GrpcStack:
    """Workers, the engine behind the Router service, and a Controller with a Reconfigurer; all on `loop`."""

    loop: LoopThread
    engine: Engine
    state: ControllerState
    router: router_pb2_grpc.RouterStub
    controller: controller_pb2_grpc.ControllerStub
    workers: list[worker_pb2_grpc.WorkerStub]
    channels: dict[str, grpc.aio.Channel]   # "router" / "controller" / "worker0".. → channel (raw calls)
    capacity: int                          # the router's KV blocks at start

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        return self.loop.run(coroutine, timeout_s)


@pytest.fixture(scope="module")
def grpc_stack(fuzz_checkpoint, loop_thread):
    """Two workers (token-protected) in TOPOLOGY, the Router service and the Controller service on port 0."""
    config = ClusterConfig(model=str(fuzz_checkpoint), num_workers=2, topology=TOPOLOGY, kv_cache_bytes=1 << 20,
                           block_size=4, token=TOKEN)
    with LocalCluster(config) as cluster:
        async def start() -> tuple[GrpcStack, tuple[grpc.aio.Server, ...]]:
            engine = await build_engine(RouterConfig(worker_addresses=tuple(cluster.worker_addresses),
                                                     model_dir=str(fuzz_checkpoint), model_name="fuzz", token=TOKEN,
                                                     max_waiting=64))
            router_server, router_port = await start_router_grpc(engine, "127.0.0.1", 0, TOKEN)
            state = ControllerState(ControllerConfig(
                token=TOKEN, worker_addresses=tuple(cluster.worker_addresses), topology=TOPOLOGY,
                router_grpc_address=f"127.0.0.1:{router_port}", model_dir=str(fuzz_checkpoint), port=0,
                rpc_timeout_s=5.0, switch_rpc_timeout_s=30.0))
            await state.open()
            controller_server, controller_port = await start_controller_grpc(state, "127.0.0.1", 0, TOKEN)
            channels = {"router": grpc.aio.insecure_channel(f"127.0.0.1:{router_port}"),
                        "controller": grpc.aio.insecure_channel(f"127.0.0.1:{controller_port}")}
            for rank, address in enumerate(cluster.worker_addresses):
                channels[f"worker{rank}"] = grpc.aio.insecure_channel(address)
            workers = [worker_pb2_grpc.WorkerStub(channels[f"worker{rank}"])
                       for rank in range(len(cluster.worker_addresses))]
            stack = GrpcStack(loop_thread, engine, state, router_pb2_grpc.RouterStub(channels["router"]),
                              controller_pb2_grpc.ControllerStub(channels["controller"]), workers, channels,
                              engine.stats().num_kv_blocks_total)
            return stack, (router_server, controller_server)

        async def stop(stack: GrpcStack, servers: tuple[grpc.aio.Server, ...]) -> None:
            for channel in stack.channels.values():
                await channel.close()
            for server in servers:
                await server.stop(0)
            await stack.state.close()
            await stack.engine.stop()

        stack, servers = loop_thread.run(start())
        try:
            yield stack
        finally:
            loop_thread.run(stop(stack, servers))


async def outcome(call: Awaitable | Callable[[], Awaitable]) -> tuple[object, grpc.aio.AioRpcError | None]:
    """(response, None) or (None, the status error). Pass a function that starts the call when calling from
    another thread: a grpc.aio call must be created on the loop that runs it."""
    try:
        return await (call() if callable(call) else call), None
    except grpc.aio.AioRpcError as error:
        return None, error


def admin(**kwargs) -> dict:
    """Call arguments of a control-plane RPC: the token and a timeout."""
    return dict(metadata=auth_metadata(TOKEN), timeout=10, **kwargs)


async def generate_all(stack: GrpcStack, requests_: list[router_pb2.GenerateRequest], cancel_after: list[int]):
    """Run the Generate calls concurrently; call i is cancelled after cancel_after[i] responses (-1: never).
    Returns (responses, None | the status error | "cancelled") per call."""

    async def one(request: router_pb2.GenerateRequest, cancel_at: int):
        call = stack.router.Generate(request, timeout=30)
        responses = []
        try:
            async for response in call:
                responses.append(response)
                if len(responses) == cancel_at:
                    call.cancel()
                    return responses, "cancelled"
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.CANCELLED and cancel_at >= 0:
                return responses, "cancelled"
            return responses, error
        return responses, None

    return await asyncio.gather(*(one(r, c) for r, c in zip(requests_, cancel_after, strict=True)))


async def raw_call(stack: GrpcStack, channel: str, method: str, is_stream: bool, payload: bytes, metadata):
    """Send `payload` as the serialized request of `method`; (number of responses, None or the status error)."""
    if is_stream:
        call = stack.channels[channel].unary_stream(method)(payload, metadata=metadata, timeout=10)
        count = 0
        try:
            async for _ in call:
                count += 1
        except grpc.aio.AioRpcError as error:
            return count, error
        return count, None
    _, error = await outcome(stack.channels[channel].unary_unary(method)(payload, metadata=metadata, timeout=10))
    return 1, error
