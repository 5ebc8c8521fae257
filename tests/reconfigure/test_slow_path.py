"""A target outside the MPU state space builds its process groups during the switch (slow path, reported)."""

from __future__ import annotations

import asyncio

import pytest

from services.controller.transaction import SwitchTarget, apply_workers, prepare_workers
from services.launch.cluster import ClusterConfig, LocalCluster
from services.router.contracts import GenerationRequest
from services.router.main import RouterConfig, build_engine
from services.rpc.reconfig.v1 import worker_pb2
from services.topology import Topology
from tests.conftest import hf_greedy, until
from tests.reconfigure.conftest import generated_tokens, open_live_stack

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def narrow_cluster(switch_checkpoint):
    """Groups built at start for tp2pp2 only."""
    config = ClusterConfig(model=str(switch_checkpoint), num_workers=4, topology="tp2pp2", kv_cache_bytes=1 << 20,
                           block_size=4, candidate_topologies=("tp2pp2",))
    with LocalCluster(config) as cluster:
        yield cluster


async def _switch(stubs, topology: str, used: list[int]):
    target = SwitchTarget(Topology.parse(topology))
    prepared, capacity = await prepare_workers(stubs, target, 60)
    return prepared, await apply_workers(stubs, target, prepared, capacity, used, f"slow-{topology}", 60)


async def test_non_candidate_target_builds_groups_and_keeps_requests_exact(narrow_cluster, switch_checkpoint):
    import grpc

    from services.rpc.reconfig.v1 import worker_pb2_grpc

    engine = await build_engine(RouterConfig(worker_addresses=tuple(narrow_cluster.worker_addresses),
                                             model_dir=str(narrow_cluster.model_dir)))
    channels = [grpc.aio.insecure_channel(a) for a in narrow_cluster.worker_addresses]
    stubs = [worker_pb2_grpc.WorkerStub(c) for c in channels]
    try:
        prompts = [[5, 9, 14, 3 + i] * 3 for i in range(4)]
        tasks = [asyncio.ensure_future(generated_tokens(engine, GenerationRequest(f"s{i}", tuple(p), 24)))
                 for i, p in enumerate(prompts)]
        await until(lambda: engine.stats().num_generation_tokens >= 8, timeout_s=120, what="8 tokens generated")
        await engine.freeze()
        used = engine.used_block_ids()
        prepared, results = await _switch(stubs, "tp4pp1", used)
        assert not any(p.is_candidate for p in prepared)
        assert all(r.built_groups for r in results)  # the slow path, reported by every worker
        _, results = await _switch(stubs, "tp2pp1", used)  # shrink: ranks 2 and 3 go to standby
        states = [(await s.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)).state for s in stubs]
        assert states == ["ACTIVE", "ACTIVE", "STANDBY", "STANDBY"]
        _, results = await _switch(stubs, "tp2pp2", used)  # a candidate again: groups exist
        assert not any(r.built_groups for r in results)
        engine.resume()
        expected, _ = hf_greedy(switch_checkpoint, prompts, 24)
        assert await asyncio.gather(*tasks) == expected
    finally:
        await engine.stop()
        for channel in channels:
            await channel.close()


async def test_the_operation_reports_the_slow_path(narrow_cluster):
    from services.controller.cli import _operation_line
    from services.controller.status import OperationState

    async with open_live_stack(narrow_cluster) as stack:
        operation = await stack.reconfigurer.reconfigure("tp1pp2")  # not a candidate of this cluster
        assert operation.state is OperationState.SUCCEEDED and operation.built_groups
        assert "slow path" in _operation_line(operation)
        back = await stack.reconfigurer.reconfigure("tp2pp2")  # a candidate: the fast path
        assert back.state is OperationState.SUCCEEDED and not back.built_groups
