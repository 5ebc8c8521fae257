"""Three real instances (each: weight store, workers, engine, router gRPC) for the front router's tests:
two of one layout (tp1pp1, one worker each) and one of another (tp2pp1... tp1pp2 over two workers); the requests
that live moves carry, and their reference tokens."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import pytest_asyncio

from services.front.engine import FrontEngine, FrontSettings
from services.front.instances import Instance
from services.launch.cluster import ClusterConfig, LocalCluster
from services.model.tokenizer import Tokenizer
from services.router.engine import Engine
from services.router.grpc_server import start_router_grpc
from services.router.contracts import GenerationRequest
from services.router.main import RouterConfig, build_engine
from tests.conftest import make_checkpoint

TOKEN = "front-test-token"
LAYOUTS = (("tp1pp1", 1), ("tp1pp1", 1), ("tp1pp2", 2))  # (topology, workers) of instances a, b, c


@pytest.fixture(scope="module")
def front_checkpoint(tmp_path_factory):
    """Llama style, 3 layers (uneven pipeline splits), 4 query / 2 KV heads."""
    return make_checkpoint(tmp_path_factory.mktemp("front") / "llama-front", "llama", seed=7)


@contextlib.contextmanager
def start_clusters(checkpoint, layouts=LAYOUTS, faults: tuple[str, ...] = ("", "", ""), kv_cache_bytes=1 << 20,
                   device: str = "cpu"):
    """A LocalCluster per instance; the first one's weight store serves them all (as `reconfig up --instances`).
    device="cuda": every instance's workers on GPU 0 (tests/gpu)."""
    with contextlib.ExitStack() as stack:
        clusters: list[LocalCluster] = []
        for (topology, workers), fault in zip(layouts, faults):
            gpu = dict(device="cuda", gpus=(0,), gpu_sharing=workers > 1, collective_timeout_s=30) \
                if device == "cuda" else {}
            clusters.append(stack.enter_context(LocalCluster(ClusterConfig(
                model=str(checkpoint), num_workers=workers, topology=topology, kv_cache_bytes=kv_cache_bytes,
                block_size=4, candidate_topologies=(topology,), num_threads=1, faults=fault,
                weightstore_address=clusters[0].weightstore_address if clusters else "", **gpu))))
        yield clusters


@pytest.fixture(scope="module")
def front_clusters(front_checkpoint):
    with start_clusters(front_checkpoint) as clusters:
        yield clusters


@dataclass
class Instances:
    engines: list[Engine]
    instances: list[Instance]
    model_dir: str
    servers: list = None


@contextlib.asynccontextmanager
async def open_instances(clusters: list[LocalCluster]):
    """An engine and router gRPC over each cluster, and the front's view of them (named a, b, c)."""
    engines, servers, instances = [], [], []
    try:
        for name, cluster in zip("abc", clusters):
            engine = await build_engine(RouterConfig(worker_addresses=tuple(cluster.worker_addresses),
                                                     model_dir=str(cluster.model_dir), model_name="front"))
            engines.append(engine)
            server, port = await start_router_grpc(engine, "127.0.0.1", 0, TOKEN)
            servers.append(server)
            instances.append(Instance(name, f"127.0.0.1:{port}", TOKEN))
        yield Instances(engines, instances, str(clusters[0].model_dir), servers)
    finally:
        for server in servers:
            await server.stop(0)
        for engine in engines:
            await engine.stop()


@pytest_asyncio.fixture
async def instances(front_clusters):
    async with open_instances(front_clusters) as opened:
        yield opened


@contextlib.asynccontextmanager
async def open_front(opened: Instances, **settings):
    front = FrontEngine(opened.instances, Tokenizer.from_dir(opened.model_dir), "front", FrontSettings(**settings))
    await front.start()
    try:
        yield front
    finally:
        await front.stop()


# Requests for live moves: greedy, with no stop token, so every run of one gives the same max_tokens tokens.
PROMPTS = [[5, 9, 2, 7, 1], list(range(3, 16)), [(7 * i) % 97 + 3 for i in range(30)], list(range(40, 87))]
MAX_TOKENS = 160  # far past the last move: a move never races the end of its request


def greedy_request(request_id: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> GenerationRequest:
    return GenerationRequest(request_id, tuple(prompt), max_tokens)  # greedy, no stop token: all max_tokens


async def reference_tokens(engine, prompt: list[int], request_id: str, max_tokens: int = MAX_TOKENS) -> list[int]:
    """The tokens of an unmoved run, straight on an instance's engine."""
    request = greedy_request(request_id, prompt, max_tokens)
    return [t for delta in [d async for d in engine.generate(request)] for t in delta.token_ids]


async def run_with_moves(front, request: GenerationRequest, hops: list[tuple], reprefill: bool = False):
    """Stream the request through the front; after hops[i][0] tokens, move it to hops[i][1] (and wait)."""
    tokens, results = [], []
    async for delta in front.generate(request):
        tokens.extend(delta.token_ids)
        while hops and len(tokens) >= hops[0][0]:
            _, target = hops.pop(0)
            results.append(await front.move(request.request_id, target, reprefill))
    return tokens, results
