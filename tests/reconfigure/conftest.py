"""A live stack for switching: 4 real workers, a real Engine + router gRPC, and the controller's transaction."""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass

import pytest
import pytest_asyncio

from services.controller.server import start_controller_grpc
from services.controller.state import ControllerConfig, ControllerState
from services.controller.status import OperationState
from services.controller.transaction import Reconfigurer
from services.launch.cluster import ClusterConfig, LocalCluster
from services.model.spec import ModelSpec
from services.router.engine import Engine
from services.router.grpc_server import start_router_grpc
from services.router.contracts import GenerationRequest
from services.router.main import RouterConfig, build_engine
from services.rpc.auth import write_token_file
from tests.conftest import make_checkpoint, until

TOKEN = "switch-test-token"


@pytest.fixture(scope="module")
def switch_checkpoint(tmp_path_factory):
    """Llama style, 3 layers (uneven splits), 4 query / 2 KV heads (tp4 replicates KV)."""
    return make_checkpoint(tmp_path_factory.mktemp("switch") / "llama-switch", "llama", seed=5)


@pytest.fixture(scope="module")
def switch_cluster(switch_checkpoint):
    config = ClusterConfig(model=str(switch_checkpoint), num_workers=4, topology="tp2pp2",
                           kv_cache_bytes=1 << 20, block_size=4)
    with LocalCluster(config) as cluster:
        yield cluster


@dataclass
class LiveStack:
    engine: Engine
    state: ControllerState
    reconfigurer: Reconfigurer
    cluster: LocalCluster


@contextlib.asynccontextmanager
async def open_live_stack(cluster: LocalCluster, leave_in: str | None = "tp2pp2", refresh_interval_s: float = 1.0):
    """Engine + router gRPC + controller state + Reconfigurer over `cluster`; leaves it in `leave_in`."""
    engine = await build_engine(RouterConfig(worker_addresses=tuple(cluster.worker_addresses),
                                             model_dir=str(cluster.model_dir), model_name="switch"))
    server, port = await start_router_grpc(engine, "127.0.0.1", 0, TOKEN)
    state = ControllerState(ControllerConfig(
        token=TOKEN, worker_addresses=tuple(cluster.worker_addresses), topology=str(engine.topology),
        router_grpc_address=f"127.0.0.1:{port}", model_dir=str(cluster.model_dir),
        refresh_interval_s=refresh_interval_s,
    ))
    await state.open()
    reconfigurer = Reconfigurer(state, ModelSpec.from_dir(cluster.model_dir), None, state.router_stub, TOKEN)
    try:
        yield LiveStack(engine, state, reconfigurer, cluster)
        if leave_in is not None and str(state.topology) != leave_in:
            await reconfigurer.reconfigure(leave_in)
    finally:
        await state.close()
        await server.stop(0)
        await engine.stop()


@pytest_asyncio.fixture
async def live_stack(switch_cluster):
    """Fresh engine and controller over the module's workers; the test must leave them in tp2pp2."""
    async with open_live_stack(switch_cluster) as stack:
        yield stack


@dataclass
class ControllerEndpoint:
    """A Controller gRPC server over the live stack's state, and how reconfigctl finds it."""

    address: str
    token_file: str

    def flags(self) -> tuple[str, ...]:
        """reconfigctl's flags that point at this controller."""
        return "--controller", self.address, "--token-file", self.token_file


@pytest_asyncio.fixture
async def controller(live_stack, tmp_path):
    """The Controller service (Reconfigure, Plan, GetStatus, WatchStatus) in process over `live_stack`."""
    token_file = tmp_path / "token"
    write_token_file(token_file, TOKEN)
    server, port = await start_controller_grpc(live_stack.state, "127.0.0.1", 0, TOKEN)
    yield ControllerEndpoint(f"127.0.0.1:{port}", str(token_file))
    await server.stop(0)


async def generated_tokens(engine: Engine, request) -> list[int]:
    """Every token a request produced, once it has finished."""
    return [t for delta in [d async for d in engine.generate(request)] for t in delta.token_ids]


def _random_requests(tag: str, count: int, max_tokens: int | None = None) -> list[GenerationRequest]:
    rng = random.Random(39)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(1, 40))] for _ in range(count)]
    return [GenerationRequest(f"{tag}-{i}", tuple(p), min(rng.randrange(100, 140), max_tokens or 1 << 30))
            for i, p in enumerate(prompts)]


async def serve_alone_together_and_switched(stack: LiveStack, count: int, chain: list[str], alone_tokens: int):
    """`count` greedy requests (random prompts of 1-39 tokens, 100-139 new tokens) served one at a time (only their
    first `alone_tokens` tokens: greedy, so a prefix of the whole), then together, then together again through live
    switches to each layout of `chain`: the three runs' tokens. The last switch is staged (the default: steps run
    while the target's shards are built), the others in place (inside the freeze, where no step runs): both
    strategies carry the requests, and every switch starts while they are in flight however fast the steps run
    (three staged switches on a quiet machine outlasted requests of 100 tokens; so did one staged switch before
    two in place, 2 runs in 5 on 2026-12-04)."""
    engine = stack.engine
    alone = [await generated_tokens(engine, r) for r in _random_requests("alone", count, alone_tokens)]
    together = await asyncio.gather(*(generated_tokens(engine, r) for r in _random_requests("together", count)))
    tasks = [asyncio.ensure_future(generated_tokens(engine, r)) for r in _random_requests("switched", count)]
    await until(lambda: engine.stats().num_running == count, what="every request running before a switch",
                timeout_s=120)
    for i, target in enumerate(chain):
        assert any(not t.done() for t in tasks), "a switch with nothing in flight proves nothing"
        operation = await stack.reconfigurer.reconfigure(target, strategy="" if i == len(chain) - 1 else "in-place")
        assert operation.state is OperationState.SUCCEEDED, operation.error
    return alone, together, await asyncio.gather(*tasks)
