"""ParallelState: two groups per rank set, host staging for point-to-point on gloo, regroup and leave."""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import wait

import pytest
import torch
import torch.distributed as dist

from services.topology import Topology
from services.worker.parallel import device_backend, needs_host_staging


@pytest.mark.parametrize("device,gpu_sharing,backend", [
    ("cpu", False, "gloo"), ("cuda", False, "nccl"), ("cuda", True, "gloo"),
])
def test_device_backend(device, gpu_sharing, backend):
    assert device_backend(device, gpu_sharing) == backend


@pytest.mark.parametrize("device,backend,staged", [
    ("cpu", "gloo", False),      # CPU workers: gloo carries host tensors
    ("cuda", "nccl", False),     # one rank per GPU: NCCL carries device tensors
    ("cuda", "gloo", True),      # shared GPU: gloo's send/recv take host tensors only
])
def test_point_to_point_stages_device_tensors_on_gloo_only(device, backend, staged):
    assert needs_host_staging(torch.device(device), backend) is staged


def _rank_main(rank: int, port: int, conn) -> None:
    """One rank: every ParallelState operation, with host staging forced (what a CUDA tensor on gloo takes)."""
    import services.worker.parallel as parallel

    parallel.needs_host_staging = lambda device, backend: True
    state = parallel.ParallelState(rank, 2, "127.0.0.1", port, "gloo", timeout_s=30)
    state.build_groups([Topology(2, 1)])
    peer, out = 1 - rank, {}
    out["descs"] = (state.world.cpu.group_desc, state.world.device is dist.group.WORLD,
                    [(p.cpu.group_desc, p.device.group_desc) for p in state._groups.values()])
    out["agree"] = (state.agree(True), state.agree(rank == 0))
    out["gathered"] = state.all_gather_object({"rank": rank})
    if rank == 0:
        state.send(torch.arange(12.0).view(3, 4).t(), dst=1)  # not contiguous
    else:
        out["received"] = state.recv((4, 3), torch.float32, torch.device("cpu"), src=0).tolist()
    theirs = torch.empty(2, 3)
    state.exchange([(torch.full((2, 3), float(rank)), peer)], [(theirs, peer)], tag=7)
    out["exchanged"] = theirs.tolist()
    tp = state.tp_group(Topology(2, 1), 0)
    out["tp_sum"] = tp.all_reduce(torch.full((2,), rank + 1.0)).tolist()
    old = state.world
    state.regroup(1, peer, 2, [Topology(2, 1)])  # a new generation, ranks swapped
    out["regrouped"] = (state.world.cpu is not old.cpu, tp.device_group is None and tp.cpu_group is None,
                        state.agree(True), len(state._groups))
    state.leave()
    out["left"] = (state.world is None, state._groups == {}, state.broken)
    conn.send(out)


@pytest.mark.multiprocess
def test_groups_staging_regroup_and_leave():
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("forkserver")
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    processes = [ctx.Process(target=_rank_main, args=(rank, store.port, pipes[rank][1])) for rank in range(2)]
    for process in processes:
        process.start()
    try:
        results = [receiver.recv() if receiver in wait([receiver, process.sentinel], 60) else None
                   for (receiver, _), process in zip(pipes, processes)]  # a rank that died fails at once
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    assert None not in results, [p.exitcode for p in processes]
    for rank, out in enumerate(results):
        assert out["descs"] == ("cpu/world", True, [("cpu/tp0-1", "device/tp0-1")])
        assert out["agree"] == (True, False)
        assert out["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert out["exchanged"] == torch.full((2, 3), float(1 - rank)).tolist()
        assert out["tp_sum"] == [3.0, 3.0]
        assert out["regrouped"] == (True, True, True, 1)
        assert out["left"] == (True, True, True)
    assert results[1]["received"] == torch.arange(12.0).view(3, 4).t().tolist()
