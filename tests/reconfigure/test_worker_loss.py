"""Losing a worker (kill -9) while serving and at every stage of a switch: the stack re-forms its world on the
survivors, returns to serving (DEGRADED, without the dead worker), and every request in flight finishes with the
oracle's tokens. A replacement started in join mode is then added back and the stack returns to full strength.

Each case starts its own 4-worker cluster: a killed worker cannot be brought back into the module's cluster.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal

import pytest

from services.controller.recovery import Recoverer
from services.controller.status import OperationState, StackState
from services.launch.cluster import ClusterConfig, LocalCluster
from services.router.contracts import GenerationRequest
from tests.conftest import hf_greedy, process_running, until
from tests.reconfigure.conftest import generated_tokens, open_live_stack
from tests.reconfigure.helpers import background, same_kv, snapshot_kv, wait_for_recovery

pytestmark = pytest.mark.multiprocess

NUM_REQUESTS, MAX_TOKENS = 16, 32


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    start: str                 # layout the cluster starts in
    victim: int                # world rank killed
    stage: str = ""            # transaction phase at whose start the victim is killed ("": while serving)
    fault: str = ""            # or: a fault rule that makes the victim crash itself at a precise point
    switch_to: str = "tp4pp1"  # the switch that runs (when stage or fault is set)
    kv_kept: bool = False      # whether the running requests' KV survives (replicas on survivors)
    replace: bool = False      # then add a replacement worker and switch back to full strength
    strategy: str = ""         # the switch's strategy ("": staged, with the KV pre-copy)


CASES = [
    Case("serving", "tp2pp2", victim=1, replace=True),
    Case("STAGING", "tp2pp2", victim=2, stage="STAGING"),  # while serving, before any freeze
    # A KV pre-copy round (serving, after STAGING): the victim dies as it copies its first layer.
    Case("PRECOPY", "tp2pp2", victim=1, fault="precopy:rank=1:action=crash"),
    Case("DRAINING", "tp2pp2", victim=3, stage="DRAINING"),  # the freeze has begun (its wait ends as QUIESCING)
    # In place: a staged switch asks the workers before its pre-copy, so its PREPARING_WORKERS calls none of them.
    Case("PREPARING_WORKERS", "tp2pp2", victim=0, stage="PREPARING_WORKERS", strategy="in-place"),
    Case("APPLYING_TOPOLOGY", "tp2pp2", victim=2, stage="APPLYING_TOPOLOGY"),
    Case("MIGRATING layer 1", "tp2pp2", victim=1, fault="migrate:rank=1:layer=1:action=crash"),
    # Past the commit point the live layout is tp4pp1, whose KV heads live on two workers each.
    Case("REBINDING", "tp2pp2", victim=1, stage="REBINDING", kv_kept=True),
    Case("serving, KV replicated", "tp4pp1", victim=2, kv_kept=True),
    # tp1pp3 on 4 workers: the standby (rank 3) takes the lost stage's place; the layout stays.
    Case("serving, a standby steps in", "tp1pp3", victim=1),
]


@pytest.fixture(scope="module")
def oracle(switch_checkpoint):
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(4, 24))] for _ in range(NUM_REQUESTS)]
    expected, _ = hf_greedy(switch_checkpoint, prompts, MAX_TOKENS)
    return prompts, expected


def start_cluster(checkpoint, case: Case) -> LocalCluster:
    return LocalCluster(ClusterConfig(model=str(checkpoint), num_workers=4, topology=case.start,
                                      kv_cache_bytes=1 << 20, block_size=4, collective_timeout_s=20,
                                      faults=case.fault))


def kill_at_stage(state, stage: str, pid: int) -> None:
    """kill -9 `pid` as the running reconfigure operation enters `stage`."""
    record = state.record_operation

    def hook(operation):
        record(operation)
        if operation.kind == "reconfigure" and operation.phase == stage and process_running(pid):
            os.kill(pid, signal.SIGKILL)

    state.record_operation = hook


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_killed_worker_stack_recovers_and_every_request_completes(case, switch_checkpoint, oracle):
    prompts, expected = oracle
    with start_cluster(switch_checkpoint, case) as cluster:
        victim = cluster.worker_addresses[case.victim]
        async with open_live_stack(cluster, leave_in=None, refresh_interval_s=0.2) as stack:
            engine, state = stack.engine, stack.state
            recoverer = Recoverer(stack.reconfigurer)
            tasks = [asyncio.ensure_future(generated_tokens(engine, GenerationRequest(f"r{i}", tuple(p), MAX_TOKENS)))
                     for i, p in enumerate(prompts)]
            async with background(state.run(), recoverer.watch()):
                await until(lambda: engine.num_generation_tokens >= NUM_REQUESTS * 3,  # every request well under way
                            timeout_s=120, what="every request under way")
                prefills_before, switched = engine.num_full_prefills, None
                if case.stage:
                    kill_at_stage(state, case.stage, cluster.worker_pids[case.victim])
                if case.stage or case.fault:
                    switched = await stack.reconfigurer.reconfigure(case.switch_to, strategy=case.strategy)
                    assert switched.state is not OperationState.SUCCEEDED or case.stage == "REBINDING"
                else:
                    os.kill(cluster.worker_pids[case.victim], signal.SIGKILL)
                recovered = await wait_for_recovery(state)
                outputs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
                status = await state.refresh()
                topology, members = str(state.topology), list(state.worker_addresses)
                reprefilled = engine.num_full_prefills - prefills_before
                if case.replace:
                    await replace_and_check(cluster, stack, recoverer, prompts, expected)
        assert recovered.state is OperationState.SUCCEEDED, recovered.error
        assert recovered.lost_workers == (victim,)
        for i, tokens in enumerate(outputs):
            assert tokens == expected[i], f"request {i}"
        assert topology == "tp1pp3" and victim not in members and len(members) == 3
        assert status.state is StackState.DEGRADED and victim in status.reason
        assert status.lost_workers == (victim,) and not status.router.stalled
        assert recovered.kv_dropped is not case.kv_kept
        if case.kv_kept:
            assert reprefilled == 0  # every KV head had a replica on a survivor: it migrated
        else:
            assert reprefilled == NUM_REQUESTS  # every running request lost part of its KV: each re-prefilled once
        print(f"\nROW | {case.name} | kill rank {case.victim} | switch {switched.state.name if switched else '-'} | "
              f"recover {recovered.state.name} -> {topology} | kv {'kept' if case.kv_kept else 'dropped'} | "
              f"re-prefilled {reprefilled} | {NUM_REQUESTS}/{NUM_REQUESTS} exact |")


async def replace_and_check(cluster, stack, recoverer, prompts, expected) -> None:
    """A replacement joins, the stack switches back to tp2pp2 on 4 workers, and serves exact tokens."""
    joiner = cluster.start_joiner()
    added = await recoverer.add_worker(joiner, topology="tp2pp2")
    assert added.state is OperationState.SUCCEEDED, added.error
    assert stack.state.worker_addresses[-1] == joiner and str(stack.state.topology) == "tp2pp2"
    outputs = await asyncio.gather(*(generated_tokens(stack.engine, GenerationRequest(f"after{i}", tuple(p), 8))
                                     for i, p in enumerate(prompts[:4])))
    assert outputs == [e[:8] for e in expected[:4]]
    status = await stack.state.refresh()
    assert status.state is StackState.SERVING and not status.lost_workers, status.reason
    assert [w.state.name for w in status.workers] == ["ACTIVE"] * 4


async def test_kv_of_a_lost_worker_comes_byte_identical_from_its_replicas(switch_checkpoint, oracle):
    """The mechanics under a recovery, step by step: tp4pp1 (each KV head on two workers) loses rank 1; the three
    survivors regroup into a new world, and torch.distributed (the NCCL path on GPUs) moves the KV into tp1pp3.
    Every used byte of every (layer, KV head) equals what the four workers held; the requests then finish exactly,
    with no prefill again."""
    from services.controller.transaction import SwitchTarget, apply_workers, prepare_workers
    from services.model.spec import ModelSpec
    from services.rpc.reconfig.v1 import worker_pb2
    from services.topology import LOST, Topology

    prompts, expected = oracle
    head_dim = ModelSpec.from_dir(switch_checkpoint).head_dim
    with start_cluster(switch_checkpoint, Case("bytes", "tp4pp1", victim=1)) as cluster:
        async with open_live_stack(cluster, leave_in=None) as stack:
            engine, stubs = stack.engine, stack.state.worker_stubs
            tasks = [asyncio.ensure_future(generated_tokens(engine, GenerationRequest(f"b{i}", tuple(p), MAX_TOKENS)))
                     for i, p in enumerate(prompts)]
            await until(lambda: engine.num_generation_tokens >= NUM_REQUESTS * 3, timeout_s=120,
                        what="every request under way")
            await engine.freeze()
            used, prefills = engine.used_block_ids(), engine.num_full_prefills
            before = await snapshot_kv(stubs, used, head_dim)
            os.kill(cluster.worker_pids[1], signal.SIGKILL)
            survivors = [stubs[0], stubs[2], stubs[3]]
            regrouped = await asyncio.gather(*(stub.Regroup(worker_pb2.RegroupRequest(
                generation=1, rank=rank, world_size=3, topology="tp4pp1"), timeout=60)
                for rank, stub in enumerate(survivors)))
            assert [r.previous_rank for r in regrouped] == [0, 2, 3] and all(r.kv_intact for r in regrouped)
            assert {r.info.state for r in regrouped} == {"REGROUPED"}
            target = SwitchTarget(Topology.parse("tp1pp3"))
            prepared, capacity = await prepare_workers(survivors, target, 60)
            results = await apply_workers(survivors, target, prepared, capacity, used, "lost-1", 60, "dist",
                                          old_ranks=[0, LOST, 1, 2])
            assert sum(r.kv_bytes_received for r in results) > 0
            assert same_kv(await snapshot_kv(survivors, used, head_dim), before)
            addresses = [cluster.worker_addresses[i] for i in (0, 2, 3)]
            await engine.rebind(capacity, tuple(addresses))
            engine.resume()
            assert await asyncio.wait_for(asyncio.gather(*tasks), 60) == expected
            assert engine.num_full_prefills == prefills
