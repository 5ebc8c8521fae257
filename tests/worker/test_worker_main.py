"""`python -m services.worker`: workers started by hand (as in containers) join a world whose store rank 0 hosts."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from services.rpc.reconfig.v1 import worker_pb2, worker_pb2_grpc
from tests.conftest import make_checkpoint, wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_file(path: Path, processes: list[subprocess.Popen], timeout_s: float = 120.0) -> int:
    def written() -> bool:
        if path.exists():
            return True
        for process in processes:
            if process.poll() is not None:
                raise AssertionError(f"{process.args} exited with {process.returncode}: {process.stderr.read()}")
        return False

    wait_until(written, timeout_s, what=str(path), interval_s=0.1)
    return int(path.read_text())


def _worker_args(rank: int, store_port: int, weightstore: str, port_file: Path) -> list[str]:
    return [sys.executable, "-m", "services.worker", "--rank", str(rank), "--world-size", "2",
            "--store-host", "127.0.0.1", "--store-port", str(store_port), "--weightstore", weightstore,
            "--topology", "tp1pp2", "--kv-cache-mb", "1", "--block-size", "4", "--port-file", str(port_file)]


async def _infos_then_shutdown(addresses: list[str]) -> list[worker_pb2.WorkerInfo]:
    infos = []
    for address in addresses:
        async with grpc.aio.insecure_channel(address) as channel:
            infos.append(await worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=10))
    for address in addresses:
        async with grpc.aio.insecure_channel(address) as channel:
            await worker_pb2_grpc.WorkerStub(channel).Shutdown(worker_pb2.ShutdownRequest(), timeout=10)
    return infos


@pytest.mark.multiprocess
def test_two_workers_from_the_command_line(tmp_path):
    model_dir = make_checkpoint(tmp_path / "llama", "llama", seed=2)
    env = {**os.environ, "RECONFIG_LOG_LEVEL": "WARNING"}
    processes: list[subprocess.Popen] = []

    def start(args: list[str]) -> subprocess.Popen:
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        processes.append(process)
        return process

    # The weight store also hosts the workers' TCPStore, as in the compose stack (it outlives any worker).
    store_port = _free_port()
    weightstore = start([sys.executable, "-m", "services.weightstore", "--model", str(model_dir),
                         "--port-file", str(tmp_path / "ws.port"), "--store-port", str(store_port)])
    try:
        weightstore_address = f"127.0.0.1:{_wait_for_file(tmp_path / 'ws.port', processes)}"
        workers = [start(_worker_args(rank, store_port, weightstore_address, tmp_path / f"w{rank}.port"))
                   for rank in (1, 0)]
        joiner = start([*_worker_args(0, store_port, weightstore_address, tmp_path / "join.port"), "--join"])
        ports = [_wait_for_file(tmp_path / f"{name}.port", processes) for name in ("w0", "w1", "join")]
        infos = asyncio.run(_infos_then_shutdown([f"127.0.0.1:{port}" for port in ports]))
        assert [(i.rank, i.world_size, i.topology, i.pp_rank) for i in infos[:2]] == [(0, 2, "tp1pp2", 0),
                                                                                     (1, 2, "tp1pp2", 1)]
        assert [(i.layer_start, i.layer_end) for i in infos[:2]] == [(0, 2), (2, 3)]
        assert [i.pid for i in infos] == [workers[1].pid, workers[0].pid, joiner.pid]
        assert (infos[2].state, infos[2].rank, infos[2].num_kv_blocks) == ("JOINING", -1, 0)  # in no world yet
        for worker in [*workers, joiner]:
            assert worker.wait(30) == 0, worker.stderr.read()
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    assert weightstore.returncode == 0


@pytest.mark.parametrize("extra,message", [
    (["--topology", "tp2pp0"], "invalid topology"),
    (["--rank", "3"], "rank 3 outside world of size 2"),
    (["--kv-cache-mb", "0"], "--kv-cache-mb must be >= 1"),
])
def test_bad_flags_exit_2_before_starting(extra, message):
    args = ["--rank", "0", "--world-size", "2", "--store-host", "h", "--store-port", "1", "--weightstore", "h:2",
            "--topology", "tp1pp2"]
    result = subprocess.run([sys.executable, "-m", "services.worker", *args, *extra], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr
