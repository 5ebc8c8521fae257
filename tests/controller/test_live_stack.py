"""The stack's own controller (serve_controller) over real worker processes and the real router engine:
GetStatus and WatchStatus as an operator's client sees them."""

from __future__ import annotations

import grpc
import pytest

from services.rpc.auth import auth_metadata
from services.rpc.reconfig.v1 import controller_pb2, controller_pb2_grpc, router_pb2, router_pb2_grpc
from tests.conftest import wait_until
from tests.controller.conftest import MODEL, PROMPT, TOPOLOGY, Stack

pytestmark = pytest.mark.multiprocess

STACK_STATE = controller_pb2.StackState
WORKER_STATE = controller_pb2.WorkerState


def _status(stack: Stack) -> controller_pb2.StackStatus:
    with grpc.insecure_channel(stack.controller_address) as channel:
        return controller_pb2_grpc.ControllerStub(channel).GetStatus(
            controller_pb2.GetStatusRequest(), metadata=auth_metadata(stack.token), timeout=10)


def test_get_status_reports_the_worker_table(stack):
    status = _status(stack)
    assert status.state == STACK_STATE.STACK_STATE_SERVING, status.reason
    assert (status.topology, status.model, status.router_address) == (TOPOLOGY, MODEL, stack.router_address)
    workers = status.workers
    assert [w.pid for w in workers] == stack.cluster.worker_pids
    assert [w.address for w in workers] == stack.cluster.worker_addresses
    assert [w.state for w in workers] == [WORKER_STATE.WORKER_STATE_ACTIVE] * 2 + [WORKER_STATE.WORKER_STATE_STANDBY]
    assert [(w.tp_rank, w.layer_start, w.layer_end) for w in workers[:2]] == [(0, 0, 3), (1, 0, 3)]
    assert [(w.kv_head_start, w.kv_head_end) for w in workers[:2]] == [(0, 1), (1, 2)]  # 2 KV heads over TP2
    assert all(w.device == "cpu" for w in workers)
    assert workers[0].param_bytes > 0 and workers[0].param_bytes == workers[1].param_bytes
    assert (workers[2].param_bytes, workers[2].num_kv_blocks_total, workers[2].layer_end) == (0, 0, 0)
    assert status.router.num_kv_blocks_total == min(w.num_kv_blocks_total for w in workers[:2]) > 0
    assert (status.router.num_running, status.router.num_waiting, status.router.is_frozen) == (0, 0, False)
    assert not status.HasField("last_operation")


def test_status_follows_requests_and_freezes(stack):
    metadata = auth_metadata(stack.token)
    with grpc.insecure_channel(stack.router_address) as router_channel, \
            grpc.insecure_channel(stack.controller_address) as controller_channel:
        router = router_pb2_grpc.RouterStub(router_channel)
        watch = controller_pb2_grpc.ControllerStub(controller_channel).WatchStatus(
            controller_pb2.WatchStatusRequest(interval_seconds=30), metadata=metadata, timeout=60)
        assert next(watch).state == STACK_STATE.STACK_STATE_SERVING
        generation = router.Generate(router_pb2.GenerateRequest(
            prompt_token_ids=PROMPT, max_tokens=200, ignore_eos=True), timeout=60)
        try:
            assert len(next(generation).token_ids) == 1
            router.Freeze(router_pb2.FreezeRequest(timeout_seconds=10), metadata=metadata, timeout=15)
            # The watcher hears of the freeze (and the running request) without waiting for its 30 s interval.
            frozen = next(s for s in watch if s.state == STACK_STATE.STACK_STATE_FROZEN)
            assert frozen.router.num_running == 1 and frozen.router.is_frozen
            used = frozen.router.num_kv_blocks_used
            assert used >= 3  # 10 prompt tokens + generated ones in blocks of 4
            assert [w.num_kv_blocks_used for w in frozen.workers] == [used, used, 0]
        finally:
            watch.cancel()
            generation.cancel()  # the client goes away: its blocks are freed
            router.Resume(router_pb2.ResumeRequest(), metadata=metadata, timeout=10)

    def freed() -> controller_pb2.StackStatus | None:
        status = _status(stack)
        return status if (status.router.num_running, status.router.num_kv_blocks_used) == (0, 0) else None

    status = wait_until(freed, timeout_s=20, what="the router to free the cancelled request's blocks", interval_s=0.1)
    assert status.state == STACK_STATE.STACK_STATE_SERVING
    assert (status.router.num_running, status.router.num_kv_blocks_used) == (0, 0)
    assert [w.num_kv_blocks_used for w in status.workers] == [0, 0, 0]
