"""ControllerState and the Controller service against the package's real workers and router."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from services.controller import (
    ControllerConfig,
    ControllerState,
    OperationState,
    OperationStatus,
    StackState,
    StackStatus,
    WorkerState,
    start_controller_grpc,
)
from services.router.grpc_server import start_router_grpc
from services.rpc.auth import auth_metadata
from services.rpc.reconfig.v1 import controller_pb2, controller_pb2_grpc, router_pb2, router_pb2_grpc
from tests.controller.conftest import MODEL, TOPOLOGY, closed_port, controller_config, frozen_router

pytestmark = pytest.mark.multiprocess


@pytest.fixture
async def make_state():
    states = []

    async def make(config: ControllerConfig) -> ControllerState:
        state = ControllerState(config)
        await state.open()
        states.append(state)
        return state

    yield make
    for state in states:
        await state.close()


async def test_serving_stack(stack, make_state):
    state = await make_state(controller_config(stack))
    assert state.status.state is StackState.STARTING
    status = await state.refresh()
    assert (status.state, status.reason, status.topology, status.model) == (StackState.SERVING, "", TOPOLOGY, MODEL)
    workers = status.workers
    assert [w.state for w in workers] == [WorkerState.ACTIVE, WorkerState.ACTIVE, WorkerState.STANDBY]
    assert [w.pid for w in workers] == stack.cluster.worker_pids
    assert [w.address for w in workers] == stack.worker_addresses
    assert [(w.tp_rank, w.layer_start, w.layer_end) for w in workers] == [(0, 0, 3), (1, 0, 3), (0, 0, 0)]
    assert [(w.kv_head_start, w.kv_head_end) for w in workers[:2]] == [(0, 1), (1, 2)]  # 2 KV heads over TP2
    infos = stack.worker_infos()
    assert [(w.num_kv_blocks_total, w.param_bytes, w.kv_cache_bytes) for w in workers] == [
        (i.num_kv_blocks, i.param_bytes, i.kv_cache_bytes) for i in infos]
    assert workers[0].param_bytes > 0 and workers[2].param_bytes == 0
    assert status.router_address == stack.router_address
    assert (status.router.num_running, status.router.num_waiting, status.router.is_frozen) == (0, 0, False)
    assert status.router.num_kv_blocks_total == workers[0].num_kv_blocks_total > 0
    assert StackStatus.from_pb(status.to_pb()) == status


async def test_a_frozen_router_holding_requests(stack, make_state):
    state = await make_state(controller_config(stack))
    async with frozen_router(stack, num_running=1, num_waiting=1) as router:
        status = await state.refresh()
    assert (status.state, status.reason) == (StackState.FROZEN, "the router is frozen: no step is scheduled")
    assert (status.router.num_running, status.router.num_waiting, status.router.is_frozen) == (1, 1, True)
    # Block ids are global: each active worker holds the router's used blocks; a standby holds none.
    used = status.router.num_kv_blocks_used
    assert used == router.num_kv_blocks_used >= 3  # 10 prompt tokens + generated ones in blocks of 4
    assert [w.num_kv_blocks_used for w in status.workers] == [used, used, 0]
    assert (await state.refresh()).state is StackState.SERVING  # resumed and idle again


async def test_problems_degrade_the_stack(stack, make_state):
    worker0, worker1, worker2 = stack.worker_addresses
    dead = f"127.0.0.1:{closed_port()}"
    state = await make_state(controller_config(stack, worker_addresses=(worker0, worker2, dead)))
    status = await state.refresh()
    assert status.state is StackState.DEGRADED
    unreachable = status.workers[2]
    assert unreachable.state is WorkerState.UNREACHABLE and unreachable.error.startswith("unreachable: UNAVAILABLE")
    assert status.workers[1].error == "reports rank 2"
    assert f"worker 2 ({dead}) unreachable" in status.reason
    assert f"worker 1 ({worker2}) reports rank 2" in status.reason
    assert status.workers[0].error == "" and status.router is not None

    # The stack runs tp2pp1: a controller that believes in tp1pp2 finds every process at odds with it.
    state = await make_state(controller_config(stack, topology="tp1pp2"))
    status = await state.refresh()
    assert status.state is StackState.DEGRADED
    assert [w.error for w in status.workers] == ["runs tp2pp1, the live topology is tp1pp2"] * 3
    assert "router schedules for tp2pp1, the live topology is tp1pp2" in status.reason


async def test_a_worker_that_does_not_answer(stack, make_state):
    """A stopped process (SIGSTOP on the standby, which no step needs) keeps its port but answers nothing."""
    state = await make_state(controller_config(stack, rpc_timeout_s=0.3))
    standby_pid = stack.cluster.worker_pids[2]
    os.kill(standby_pid, signal.SIGSTOP)
    try:
        status = await state.refresh()
        assert state.lost_members() == []  # one missed heartbeat is not a lost worker (heartbeat_misses=2)
        await state.refresh()
        assert state.lost_members() == [stack.worker_addresses[2]]  # hung: the recovery would leave it out
    finally:
        os.kill(standby_pid, signal.SIGCONT)
    assert status.state is StackState.DEGRADED
    assert [w.state for w in status.workers] == [WorkerState.ACTIVE, WorkerState.ACTIVE, WorkerState.UNREACHABLE]
    assert status.workers[2].error.startswith("unreachable: DEADLINE_EXCEEDED")
    assert status.reason.startswith(f"worker 2 ({stack.worker_addresses[2]}) unreachable: DEADLINE_EXCEEDED")
    status = await state.refresh()
    assert status.state is StackState.SERVING and status.workers[2].state is WorkerState.STANDBY
    assert state.lost_members() == []  # one answer resets the count


async def test_router_problems(stack, make_state):
    wrong_token = await make_state(controller_config(stack, token="not-the-router-token"))
    status = await wrong_token.refresh()
    assert status.state is StackState.DEGRADED and status.router is None
    assert status.reason.startswith(f"router {stack.router_address} unreachable: UNAUTHENTICATED")

    # A router gRPC server over the same engine answers, then stops: the controller sees it gone.
    server, port = stack.loop.run(start_router_grpc(stack.engine, "127.0.0.1", 0, stack.token))
    address = f"127.0.0.1:{port}"
    state = await make_state(controller_config(stack, router_grpc_address=address))
    try:
        assert (await state.refresh()).state is StackState.SERVING
    finally:
        stack.loop.run(server.stop(None))
    status = await state.refresh()
    assert status.state is StackState.DEGRADED and status.router is None
    assert status.reason.startswith(f"router {address} unreachable: UNAVAILABLE")

    no_router = await make_state(controller_config(stack, router_grpc_address=None))
    status = await no_router.refresh()
    assert status.state is StackState.SERVING and status.router is None and status.router_address == ""
    assert [w.num_kv_blocks_used for w in status.workers] == [0, 0, 0]


async def test_versions_change_only_with_the_status(stack, make_state):
    state = await make_state(controller_config(stack))
    first = await state.refresh()
    version = state.version
    again = await state.refresh()
    assert state.version == version and again.updated_at >= first.updated_at
    started = time.monotonic()
    assert (await state.wait_for_change(version, 0.2)).same_as(first)
    assert time.monotonic() - started >= 0.19
    waiter = asyncio.ensure_future(state.wait_for_change(version, 10))
    await asyncio.sleep(0)
    assert not waiter.done()
    async with frozen_router(stack):
        await state.refresh()
        changed = await asyncio.wait_for(waiter, 2)
        assert changed.router.is_frozen and changed.state is StackState.FROZEN and state.version == version + 1
        operation = OperationStatus("op-1", "reconfigure", OperationState.SUCCEEDED, started_at=10.0, ended_at=10.5,
                                    phase_seconds={"QUIESCING": 0.1, "MIGRATING": 0.3})
        state.record_operation(operation)
        assert state.version == version + 2 and state.status.last_operation == operation
        assert (await state.refresh()).last_operation == operation  # a refresh keeps it
        assert state.version == version + 2


async def test_concurrent_refreshes_share_one_round(stack, make_state):
    state = await make_state(controller_config(stack))
    results = await asyncio.gather(*(state.refresh() for _ in range(5)))
    # One round of RPCs builds one snapshot: every caller gets that very object.
    assert all(r is results[0] for r in results) and results[0].state is StackState.SERVING
    later = await state.refresh()
    assert later is not results[0] and later.updated_at > results[0].updated_at


async def test_a_refresh_begun_before_the_router_resumed_publishes_nothing(stack, make_state):
    """A recovery resumes a stalled router: a refresh that asked the router before must not publish its answer
    (the stall would be seen again and recovered twice), nor be shared by a refresh asked for after."""
    state = await make_state(controller_config(stack))
    await state.refresh()
    probe, asked, go = state.probe, asyncio.Event(), asyncio.Event()

    async def held_probe(address):
        asked.set()
        await go.wait()
        return await probe(address)

    state.probe = held_probe
    stale = asyncio.ensure_future(state.refresh())
    await asked.wait()
    state.probe = probe
    state.router_resumed()
    fresh = await asyncio.wait_for(state.refresh(), 10)  # not the held round: a round of its own, published
    assert state.status is fresh and not stale.done()
    version = state.version
    go.set()
    assert await stale is fresh and state.status is fresh and state.version == version


async def test_controller_service(stack):
    state = ControllerState(controller_config(stack, refresh_interval_s=0.05))
    await state.open()
    server, port = await start_controller_grpc(state, "127.0.0.1", 0, stack.token)
    refresher = asyncio.create_task(state.run())
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    router_channel = grpc.aio.insecure_channel(stack.router_address)
    stub, router = controller_pb2_grpc.ControllerStub(channel), router_pb2_grpc.RouterStub(router_channel)
    metadata = auth_metadata(stack.token)
    try:
        for bad in (None, auth_metadata("wrong")):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.GetStatus(controller_pb2.GetStatusRequest(), metadata=bad, timeout=5)
            assert error.value.code() is grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for _ in stub.WatchStatus(controller_pb2.WatchStatusRequest(), metadata=bad, timeout=5):
                    pass
            assert error.value.code() is grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.AddWorker(controller_pb2.AddWorkerRequest(address="127.0.0.1:1"), metadata=bad, timeout=5)
            assert error.value.code() is grpc.StatusCode.UNAUTHENTICATED
        status = await stub.GetStatus(controller_pb2.GetStatusRequest(), metadata=metadata, timeout=5)
        assert status.state == controller_pb2.STACK_STATE_SERVING and len(status.workers) == 3
        assert [w.pid for w in status.workers] == stack.cluster.worker_pids

        # Without changes, WatchStatus sends at the requested interval.
        call = stub.WatchStatus(controller_pb2.WatchStatusRequest(interval_seconds=0.3), metadata=metadata)
        started = time.monotonic()
        beats = [await call.read() for _ in range(3)]
        assert time.monotonic() - started >= 0.55
        assert {b.state for b in beats} == {controller_pb2.STACK_STATE_SERVING}
        call.cancel()

        # With a long interval, a change arrives as soon as the refresh loop sees it.
        call = stub.WatchStatus(controller_pb2.WatchStatusRequest(interval_seconds=30), metadata=metadata)
        assert (await call.read()).state == controller_pb2.STACK_STATE_SERVING
        try:
            await router.Freeze(router_pb2.FreezeRequest(timeout_seconds=5), metadata=metadata, timeout=10)
            frozen = await asyncio.wait_for(call.read(), 5)
            assert frozen.state == controller_pb2.STACK_STATE_FROZEN and frozen.router.is_frozen
        finally:
            await router.Resume(router_pb2.ResumeRequest(), metadata=metadata, timeout=5)
        resumed = await asyncio.wait_for(call.read(), 5)
        assert resumed.state == controller_pb2.STACK_STATE_SERVING and not resumed.router.is_frozen
        call.cancel()
    finally:
        refresher.cancel()
        await channel.close()
        await router_channel.close()
        await server.stop(None)
        await state.close()


async def test_a_restarted_controller_takes_the_members_from_its_state_file(stack, make_state, tmp_path):
    """After a recovery the world is not the start-up list: a restarted controller reads it from the state file,
    reports DEGRADED for the worker lost, and counts missed heartbeats per member."""
    import json

    state_file = tmp_path / "controller-state.json"
    members, lost = stack.worker_addresses[:2], stack.worker_addresses[2]
    state_file.write_text(json.dumps({"topology": TOPOLOGY, "layer_partition": [], "worker_addresses": members,
                                      "generation": 3, "lost_workers": [lost], "last_operation": None}))
    state = await make_state(controller_config(stack, state_file=str(state_file)))
    await state.recover()
    assert (state.worker_addresses, state.generation, state.lost_workers) == (members, 3, [lost])
    status = state.status
    assert [w.address for w in status.workers] == members and status.lost_workers == (lost,)
    assert status.state is StackState.DEGRADED
    assert status.reason == (f"lost {lost}; serving on 2 of 3 workers "
                             "(start a replacement and `reconfigctl add-worker ADDRESS`)")
    assert state.lost_members() == []  # both members answer their heartbeats
    saved = json.loads(state_file.read_text())
    assert saved["worker_addresses"] == members and oct(os.stat(state_file).st_mode & 0o777) == "0o600"
