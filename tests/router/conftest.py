"""Router fixtures: a real worker cluster per module and a real Engine over it per test."""

from __future__ import annotations

import pytest
import pytest_asyncio

from services.launch.cluster import ClusterConfig, LocalCluster
from services.router.main import RouterConfig, build_engine
from tests.conftest import make_checkpoint


@pytest.fixture(scope="module")
def serving_checkpoint(tmp_path_factory):
    """A Llama-style checkpoint with the byte-level tokenizer (vocab 160)."""
    return make_checkpoint(tmp_path_factory.mktemp("serving") / "llama-serving", "llama", seed=11)


@pytest.fixture(scope="module")
def serving_cluster(serving_checkpoint):
    """Two worker processes in TP1PP2 (so the engine keeps two micro-batches in flight)."""
    config = ClusterConfig(model=str(serving_checkpoint), num_workers=2, topology="tp1pp2",
                           kv_cache_bytes=1 << 20, block_size=4)
    with LocalCluster(config) as cluster:
        yield cluster


@pytest_asyncio.fixture
async def serving_engine(serving_cluster):
    """A started Engine (real workers) bound to this test's event loop."""
    engine = await build_engine(RouterConfig(worker_addresses=tuple(serving_cluster.worker_addresses),
                                             model_dir=str(serving_cluster.model_dir), model_name="llama-serving",
                                             max_waiting=64))
    yield engine
    await engine.stop()
