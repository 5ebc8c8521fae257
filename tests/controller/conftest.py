"""One real stack for the controller's tests: three worker processes (TP2 and a standby), the real Engine behind the
Router gRPC service, and a controller serving them; started once for the package."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from services.controller import ControllerConfig, serve_controller
from services.launch.cluster import ClusterConfig, LocalCluster
from services.router.engine import Engine
from services.router.grpc_server import start_router_grpc
from services.router.main import RouterConfig, build_engine
from services.rpc.auth import auth_metadata, generate_token, write_token_file
from services.rpc.reconfig.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.conftest import make_checkpoint, until

# Two active workers in TP2 and one standby: the table shows both states and the split of KV heads.
NUM_WORKERS, TOPOLOGY, MODEL = 3, "tp2pp1", "llama"
PROMPT = tuple(range(3, 13))  # 10 tokens: 3 blocks of 4 once a token is generated


class LoopThread:
    """An event loop on its own thread: the router and the controller serve there while tests block or run
    their own loops."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="stack-loop", daemon=True)
        self.thread.start()

    def run(self, coroutine, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class Stack:
    """The package's stack: worker processes, the router (engine + gRPC) and a controller on a loop thread."""

    cluster: LocalCluster
    engine: Engine
    loop: LoopThread
    router_address: str
    controller_address: str
    token: str
    token_file: str

    @property
    def worker_addresses(self) -> list[str]:
        return self.cluster.worker_addresses

    def worker_infos(self) -> list[worker_pb2.WorkerInfo]:
        """GetInfo straight from each worker (what the controller's table must agree with)."""
        infos = []
        for address in self.worker_addresses:
            with grpc.insecure_channel(address) as channel:
                infos.append(worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=10))
        return infos


@pytest.fixture(scope="package")
def stack(tmp_path_factory):
    """Started once for tests/controller; every test leaves the router idle and unfrozen."""
    model_dir = make_checkpoint(tmp_path_factory.mktemp("ckpt") / MODEL, "llama", seed=5)
    token = generate_token()
    token_file = tmp_path_factory.mktemp("run") / "token"
    write_token_file(token_file, token)
    config = ClusterConfig(model=str(model_dir), num_workers=NUM_WORKERS, topology=TOPOLOGY,
                           kv_cache_bytes=1 << 20, block_size=4)
    loop = LoopThread()
    with LocalCluster(config) as cluster:
        async def start():
            engine = await build_engine(RouterConfig(worker_addresses=tuple(cluster.worker_addresses),
                                                     model_dir=str(model_dir)))
            router_server, router_port = await start_router_grpc(engine, "127.0.0.1", 0, token)
            ready = asyncio.get_running_loop().create_future()
            controller = asyncio.create_task(serve_controller(
                ControllerConfig(token=token, worker_addresses=tuple(cluster.worker_addresses), topology=TOPOLOGY,
                                 router_grpc_address=f"127.0.0.1:{router_port}", model=MODEL, port=0,
                                 refresh_interval_s=0.2),
                on_ready=ready.set_result, handle_signals=False,
            ))
            return engine, router_server, router_port, controller, await asyncio.wait_for(ready, 30)

        engine, router_server, router_port, controller, controller_port = loop.run(start())

        async def stop():
            controller.cancel()
            await asyncio.gather(controller, return_exceptions=True)
            await router_server.stop(None)
            await engine.stop()

        try:
            yield Stack(cluster, engine, loop, f"127.0.0.1:{router_port}", f"127.0.0.1:{controller_port}", token,
                        str(token_file))
        finally:
            loop.run(stop())
            loop.close()


_CLOSED_SOCKETS: list[socket.socket] = []  # bound, never listening: refused, and nobody else can take the port


def closed_port() -> int:
    """A port nobody listens on, held bound (not listening) until the tests end so no other server can take it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    _CLOSED_SOCKETS.append(sock)
    return sock.getsockname()[1]


def controller_config(stack: Stack, **overrides) -> ControllerConfig:
    """A ControllerConfig for the stack (fast refresh, short deadlines); `overrides` replace fields."""
    values = dict(token=stack.token, worker_addresses=tuple(stack.worker_addresses), topology=TOPOLOGY,
                  router_grpc_address=stack.router_address, model=MODEL, port=0, refresh_interval_s=0.1,
                  rpc_timeout_s=1.0)
    return ControllerConfig(**{**values, **overrides})


@contextlib.asynccontextmanager
async def frozen_router(stack: Stack, num_running: int = 0, num_waiting: int = 0) -> AsyncIterator[
        router_pb2.RouterStats]:
    """Freeze the real router holding `num_running` started requests and `num_waiting` queued ones; yields its
    stats. On exit the requests are cancelled, the router resumes, and it is idle again."""
    metadata = auth_metadata(stack.token)
    async with grpc.aio.insecure_channel(stack.router_address) as channel:
        router = router_pb2_grpc.RouterStub(channel)

        async def stats() -> router_pb2.RouterStats:
            return await router.Stats(router_pb2.StatsRequest(), metadata=metadata, timeout=5)

        request = router_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=200, ignore_eos=True)
        calls = [router.Generate(request, timeout=60) for _ in range(num_running)]
        try:
            for call in calls:
                assert len((await call.read()).token_ids) == 1
            await router.Freeze(router_pb2.FreezeRequest(timeout_seconds=10), metadata=metadata, timeout=15)
            calls += [router.Generate(request, timeout=60) for _ in range(num_waiting)]
            await until(lambda: _stats_match(stats, num_running, num_waiting))
            yield await stats()
        finally:
            for call in calls:
                call.cancel()
            await router.Resume(router_pb2.ResumeRequest(), metadata=metadata, timeout=5)
            await until(lambda: _stats_match(stats, 0, 0))


async def _stats_match(stats, num_running: int, num_waiting: int) -> bool:
    current = await stats()
    is_idle = num_running == 0 and num_waiting == 0
    return ((current.num_running, current.num_waiting) == (num_running, num_waiting)
            and (current.num_kv_blocks_used == 0 or not is_idle))
