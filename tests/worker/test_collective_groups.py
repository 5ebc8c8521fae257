"""Every collective runs on the group of its kind (issue 18): flags, agreements and metadata on the CPU group (gloo),
tensors on the device group (NCCL across GPUs). On a GPU a host tensor on an NCCL group fails at run time; on CPU
every group is gloo, so the workers record which group each call used and who asked for it, through a switch
that rolls back over the torch.distributed KV channel, a switch that succeeds, and steps in both layouts."""

from __future__ import annotations

import asyncio
import functools

import grpc
import pytest
import torch

from services.controller.status import OperationState
from services.controller.transaction import SwitchTarget, apply_workers, prepare_workers
from services.launch import cluster as cluster_module
from services.launch.cluster import ClusterConfig, LocalCluster
from services.model.spec import ModelSpec
from services.router.contracts import GenerationRequest
from services.topology import Topology, place, plan_kv_migration
from tests.conftest import hf_greedy, make_checkpoint
from tests.reconfigure.conftest import open_live_stack
from tests.worker.collective_recorder import POINT_TO_POINT, read_records, run_recorded_worker

pytestmark = pytest.mark.multiprocess

# Who asks for a collective -> the group kind it must use. A caller not listed fails the test: classify it.
CPU_CALLERS = {"services.worker.shard:WorkerShard.agree", "services.worker.switch:_rollback"}
DEVICE_CALLERS = ("services.model.", "services.worker.model_runner:", "services.worker.channel:DistChannel.")
MUST_SEE = {  # what the scenario exercises: agreements, rollback metadata, PP hand-off, TP, KV over the channel
    ("all_reduce", "services.worker.shard:WorkerShard.agree"),
    ("all_gather_object", "services.worker.switch:_rollback"),
    ("send", "services.worker.model_runner:ModelRunner._run_eager"),
    ("recv", "services.worker.model_runner:ModelRunner._run_eager"),
    ("batch_isend_irecv", "services.worker.channel:DistChannel.exchange"),
}
START, TARGET = "tp1pp2", "tp2pp1"
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda-shared", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="needs CUDA")])]


def expected_kind(caller: str) -> str | None:
    if caller in CPU_CALLERS:
        return "cpu"
    if caller.startswith(DEVICE_CALLERS):
        return "device"
    return None


def allowed_devices(kind: str, backend: str, api: str, device: str) -> set[str]:
    """Host tensors on the CPU group; the worker's device on the device group, except point-to-point on a gloo
    device group (a shared GPU), which carries host copies."""
    if kind == "cpu" or (backend == "gloo" and api in POINT_TO_POINT):
        return {"cpu"}
    return {device}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("groups") / "llama-groups", "llama", seed=5)


@pytest.fixture(params=DEVICES)
def recorded_cluster(request, checkpoint, tmp_path, monkeypatch):
    """Two workers in tp1pp2 that record their collectives; rank 1 fails migrating the second layer once."""
    records = tmp_path / "collectives"
    records.mkdir()
    monkeypatch.setattr(cluster_module, "_run_worker", functools.partial(run_recorded_worker, str(records)))
    shape = ModelSpec.from_dir(checkpoint).shape
    layer = plan_kv_migration(place(Topology.parse(START), shape), range(2), place(Topology.parse(TARGET), shape),
                              range(2)).layers()[1]
    device = request.param
    config = ClusterConfig(model=str(checkpoint), num_workers=2, topology=START, kv_cache_bytes=1 << 20,
                           block_size=4, device=device, gpu_sharing=device == "cuda",
                           faults=f"migrate:rank=1:layer={layer}:once=1")
    with LocalCluster(config) as cluster:
        yield cluster, records, device


async def _generate(engine, request: GenerationRequest, started: asyncio.Event) -> list[int]:
    """Every token of `request`; sets `started` once it has a few (its KV spans several blocks)."""
    tokens: list[int] = []
    async for delta in engine.generate(request):
        tokens += delta.token_ids
        if len(tokens) >= 4:
            started.set()
    return tokens


async def test_flags_on_the_cpu_group_and_tensors_on_the_device_group(recorded_cluster, checkpoint):
    cluster, records, device = recorded_cluster
    prompts = [[9, 4 * i + 3, 77, 12, 200 - i] * 2 for i in range(4)]
    async with open_live_stack(cluster, leave_in=None) as stack:
        engine, stubs = stack.engine, stack.state.worker_stubs
        started = [asyncio.Event() for _ in prompts]
        tasks = [asyncio.ensure_future(_generate(engine, GenerationRequest(f"g{i}", tuple(p), 24), started[i]))
                 for i, p in enumerate(prompts)]
        await asyncio.gather(*(event.wait() for event in started))
        await engine.freeze()
        target = SwitchTarget(Topology.parse(TARGET))
        prepared, capacity = await prepare_workers(stubs, target, 60)
        with pytest.raises(grpc.aio.AioRpcError) as failed:  # KV over torch.distributed, then moved back
            await apply_workers(stubs, target, prepared, capacity, engine.used_block_ids(), "groups-dist", 60, "dist")
        assert failed.value.code() is grpc.StatusCode.ABORTED and "rolled back" in failed.value.details()
        engine.resume()
        operation = await stack.reconfigurer.reconfigure(TARGET)  # the fault fired once: now it switches
        assert operation.state is OperationState.SUCCEEDED, operation.error
        expected, _ = hf_greedy(checkpoint, prompts, 24)
        assert await asyncio.gather(*tasks) == expected  # the rollback kept every KV byte the requests needed
        # Those may all have finished while the switch staged (it is paced): one more request runs in the target
        # layout, so that its tensor-parallel collectives are among the records below.
        after = [3, 14, 15, 92, 65]
        expected_after, _ = hf_greedy(checkpoint, [after], 8)
        served = await _generate(engine, GenerationRequest("after", tuple(after), 8), asyncio.Event())
        assert served == expected_after[0]
    calls = read_records(records)
    wrong = [c for c in calls if c["kind"] != expected_kind(c["caller"])]
    assert not wrong, f"collectives on the wrong group (or an unclassified caller): {wrong}"
    misplaced = [c for c in calls if not set(c["devices"]) <= allowed_devices(c["kind"], c["backend"], c["api"],
                                                                              device)]
    assert not misplaced, f"tensors on a device their group cannot carry: {misplaced}"
    assert MUST_SEE <= {(c["api"], c["caller"]) for c in calls}
    assert any(c["caller"].startswith("services.model.") and c["api"] == "all_reduce" for c in calls)  # TP
