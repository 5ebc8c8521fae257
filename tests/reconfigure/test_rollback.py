"""A switch that fails rolls back: the old layout serves again with every KV byte intact and exact outputs."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.controller.status import OperationState
from services.launch.cluster import ClusterConfig, LocalCluster
from services.model.spec import ModelSpec
from services.router.contracts import GenerationRequest
from services.topology import Topology, place, plan_kv_migration
from tests.conftest import hf_greedy, until
from tests.reconfigure.conftest import generated_tokens, open_live_stack
from tests.reconfigure.helpers import same_kv, snapshot_kv

pytestmark = pytest.mark.multiprocess


def _second_layer(model_dir) -> int:
    """The second layer tp2pp2 -> tp4pp1 migrates: failing there leaves one layer to move back."""
    shape = ModelSpec.from_dir(model_dir).shape
    old, new = place(Topology(2, 2), shape), place(Topology(4, 1), shape)
    return plan_kv_migration(old, range(4), new, range(4)).layers()[1]


@pytest.fixture(scope="module")
def faulty_cluster(switch_checkpoint):
    """Rank 1 refuses its first ApplySwitch; rank 2 fails migrating a layer of its second one."""
    faults = (f"apply:rank=1:action=raise:once=1;migrate:rank=2:layer={_second_layer(switch_checkpoint)}:once=1;"
              "rpc:method=PrepareSwitch:rank=0:topology=tp1pp2:delay=3")
    config = ClusterConfig(model=str(switch_checkpoint), num_workers=4, topology="tp2pp2", kv_cache_bytes=1 << 20,
                           block_size=4, faults=faults)
    with LocalCluster(config) as cluster:
        yield cluster


async def test_failed_switches_roll_back_with_kv_intact(faulty_cluster, switch_checkpoint):
    head_dim = ModelSpec.from_dir(switch_checkpoint).head_dim
    async with open_live_stack(faulty_cluster) as stack:
        engine, stubs = stack.engine, stack.state.worker_stubs
        prompts = [[11, 3 * i + 2, 70, 9, 250 - i] * 2 for i in range(6)]
        tasks = [asyncio.ensure_future(generated_tokens(engine, GenerationRequest(f"f{i}", tuple(p), 40)))
                 for i, p in enumerate(prompts)]
        await until(lambda: engine.stats().num_generation_tokens >= 12, timeout_s=120, what="12 tokens generated")
        for expected_error in ("refused before any KV moved", "rolled back (layers ["):
            await engine.freeze()  # hold the requests still to snapshot their KV
            used, filled = engine.used_block_ids(), _filled_slots(engine)
            before = await snapshot_kv(stubs, used, head_dim)
            engine.resume()
            operation = await stack.reconfigurer.reconfigure("tp4pp1")
            assert operation.state is OperationState.ROLLED_BACK, operation
            assert expected_error in operation.error and "ROLLING_BACK" in operation.phase_seconds
            assert str(stack.state.topology) == "tp2pp2" and str(engine.topology) == "tp2pp2"
            await engine.freeze()
            after = await snapshot_kv(stubs, used, head_dim)
            engine.resume()
            # Decoding went on around the switch; every slot that held KV before holds the same bytes now.
            mask = torch.tensor([[(b, o) in filled for o in range(4)] for b in used])
            assert same_kv({k: v[:, mask] for k, v in after.items()}, {k: v[:, mask] for k, v in before.items()})
        operation = await stack.reconfigurer.reconfigure("tp4pp1")  # the faults fired once: now it works
        assert operation.state is OperationState.SUCCEEDED, operation.error
        expected, _ = hf_greedy(switch_checkpoint, prompts, 40)
        assert await asyncio.gather(*tasks) == expected
        assert engine.stats().num_preemptions == 0


def _filled_slots(engine) -> set[tuple[int, int]]:
    """(block id, offset) of every token whose KV is cached now."""
    size = engine.scheduler.block_manager.block_size
    return {(seq.block_ids[pos // size], pos % size) for seq in engine.scheduler.running
            for pos in range(seq.num_computed_tokens)}


async def test_a_deadline_before_the_commit_point_restores_and_resumes(faulty_cluster, switch_checkpoint):
    async with open_live_stack(faulty_cluster) as stack:
        engine = stack.engine
        task = asyncio.ensure_future(generated_tokens(engine, GenerationRequest("d", (5, 6, 7, 8), 30)))
        await until(lambda: engine.stats().num_generation_tokens >= 3, timeout_s=120, what="3 tokens generated")
        operation = await stack.reconfigurer.reconfigure("tp1pp2", deadline_s=1.0)  # rank 0 prepares for 3 s
        assert operation.state is OperationState.ROLLED_BACK
        assert operation.error.startswith("DEADLINE_EXCEEDED")
        assert str(stack.state.topology) == "tp2pp2" and not engine.stats().is_frozen  # serving again
        expected, _ = hf_greedy(switch_checkpoint, [[5, 6, 7, 8]], 30)
        assert await task == expected[0]
