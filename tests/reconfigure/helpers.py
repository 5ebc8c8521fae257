"""Helpers the reconfigure tests share: the KV bytes read straight out of the workers' shared-memory pools (nothing
is asked of the workers but where their pools are), the controller's loops run in the background, the wait for a
recovery, and reconfigctl's own output lines."""

from __future__ import annotations

import asyncio
import contextlib
import re

import torch

from services.controller.status import OperationState
from services.rpc.reconfig.v1 import worker_pb2
from services.weightstore.shm import ShmSegment

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[")  # structlog's console lines share stdout


async def kv_layer_views(stubs, head_dim: int):
    """Every active worker's KV layer tensors, read out of its shared-memory pool: yields (info, layer, view
    [2, blocks, block_size, local KV heads, head_dim]); a view is valid until the next one is yielded."""
    for stub in stubs:
        info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
        if info.num_kv_blocks == 0:
            continue  # standby
        pools = await stub.PrepareSwitch(worker_pb2.PrepareSwitchRequest(topology=info.topology), timeout=10)
        num_heads = info.kv_head_end - info.kv_head_start
        for layer, name in pools.kv_segments.items():
            segment = ShmSegment.attach(name, readonly=True, copy_on_write=True)
            try:
                flat = torch.frombuffer(segment.buffer, dtype=torch.float32)
                cache = flat[: 2 * info.num_kv_blocks * info.block_size * num_heads * head_dim]
                yield info, layer, cache.view(2, info.num_kv_blocks, info.block_size, num_heads, head_dim)
            finally:
                segment.close()


async def snapshot_kv(stubs, used: list[int], head_dim: int) -> dict[tuple[int, int], torch.Tensor]:
    """(layer, global KV head) -> K/V of the used blocks [2, used, block_size, head_dim], from every owner."""
    used_t = torch.tensor(used)
    snapshot: dict[tuple[int, int], torch.Tensor] = {}
    async for info, layer, cache in kv_layer_views(stubs, head_dim):
        for i, head in enumerate(range(info.kv_head_start, info.kv_head_end)):
            data = cache[:, used_t, :, i].clone()
            if (layer, head) in snapshot:  # a replica must hold the same bytes
                assert torch.equal(snapshot[(layer, head)], data), (layer, head, info.rank)
            snapshot[(layer, head)] = data
    return snapshot


def same_kv(after: dict, before: dict) -> bool:
    """Whether two snapshots hold the same (layer, KV head) keys with the same bytes."""
    return after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


@contextlib.asynccontextmanager
async def background(*coroutines):
    """Run `coroutines` (the controller's loops) as tasks while the block runs; cancel them after it."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def wait_for_recovery(state, timeout_s: float = 60.0, lost: bool = True):
    """The first finished recover operation that found a member gone (lost=False: the first one), recorded from
    now on (or the last one recorded). A recovery may run first for a stall the router reported before the kill
    took effect (every member answered and regrouped), or one may follow: neither is the recovery under test, and
    the state keeps only the last operation, so every one recorded is looked at."""
    found = asyncio.get_running_loop().create_future()
    record = state.record_operation

    def check(operation):
        if (operation is not None and operation.kind == "recover" and operation.state is not OperationState.RUNNING
                and (operation.lost_workers or not lost) and not found.done()):
            found.set_result(operation)

    def hook(operation):
        record(operation)
        check(operation)

    check(state.last_operation)
    state.record_operation = hook
    try:
        return await asyncio.wait_for(asyncio.shield(found), timeout_s)
    finally:
        state.record_operation = record


def reconfigctl_lines(text: str) -> list[str]:
    """reconfigctl's lines, without the in-process services' log lines."""
    return [line for line in text.splitlines() if not LOG_LINE.match(line)]
