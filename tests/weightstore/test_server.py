"""The gRPC service against a real grpc.aio server, and the store process's lifecycle."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from services.rpc.reconfig.v1 import weightstore_pb2, weightstore_pb2_grpc
from services.weightstore.client import MappedCheckpoint, fetch_manifest
from services.weightstore.server import WeightStoreServicer, serve
from services.weightstore.store import WeightStore
from tests.conftest import wait_until

from . import make_checkpoint, no_leftover_segments, segments_of  # noqa: F401

pytestmark = pytest.mark.usefixtures("no_leftover_segments")

REPO_ROOT = Path(__file__).resolve().parents[2]


async def health(address: str) -> weightstore_pb2.HealthResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await weightstore_pb2_grpc.WeightStoreStub(channel).Health(weightstore_pb2.HealthRequest(), timeout=5)


async def test_serve_answers_manifest_and_health_then_cleans_up(tmp_path):
    originals = make_checkpoint(tmp_path)
    bound = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(tmp_path, port=0, on_ready=bound.set_result))
    port = await asyncio.wait_for(bound, 30)
    address = f"127.0.0.1:{port}"

    manifest = await fetch_manifest(address, timeout=5)
    reply = await health(address)
    assert reply.ready and reply.pid == os.getpid()
    with MappedCheckpoint(manifest) as mapped:
        for name, original in originals.items():
            assert torch.equal(mapped.tensor(name), original), name
    assert {segment.name for segment in manifest.segments} == set(segments_of(os.getpid()))

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert segments_of(os.getpid()) == []


async def test_servicer_returns_the_stores_manifest(tmp_path):
    make_checkpoint(tmp_path)
    with WeightStore.load(tmp_path) as store:
        server = grpc.aio.server()
        weightstore_pb2_grpc.add_WeightStoreServicer_to_server(WeightStoreServicer(store), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            assert await fetch_manifest(f"127.0.0.1:{port}") == store.manifest
        finally:
            await server.stop(None)


async def test_loading_store_is_live_but_not_ready():
    server = grpc.aio.server()
    weightstore_pb2_grpc.add_WeightStoreServicer_to_server(WeightStoreServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        reply = await health(f"127.0.0.1:{port}")
        assert not reply.ready and reply.pid == os.getpid()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await fetch_manifest(f"127.0.0.1:{port}", timeout=0.5)  # retries UNAVAILABLE, then gives up
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


def start_store(model_dir: Path, port_file: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "services.weightstore", "--model", str(model_dir), "--port-file", str(port_file)],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )


def wait_for_port(process: subprocess.Popen, port_file: Path, timeout: float = 60.0) -> int:
    try:
        wait_until(lambda: port_file.exists() or process.poll() is not None, timeout,
                   what="the store to write its port file (or exit)", interval_s=0.05)
    except AssertionError:
        process.kill()
        raise
    if not port_file.exists():
        raise AssertionError(f"store exited with {process.returncode}: {process.stdout.read().decode()}")
    return int(port_file.read_text())


@pytest.mark.multiprocess
async def test_store_process_lifecycle(tmp_path):
    model_dir = tmp_path / "model"
    originals = make_checkpoint(model_dir)
    processes = []
    try:
        # 1. SIGTERM: graceful exit, status 0, its segments gone.
        first = start_store(model_dir, tmp_path / "first.port")
        processes.append(first)
        port = await asyncio.to_thread(wait_for_port, first, tmp_path / "first.port")
        manifest = await fetch_manifest(f"127.0.0.1:{port}")
        assert len(segments_of(first.pid)) == 2
        with MappedCheckpoint(manifest) as mapped:
            name = "model.layers.0.self_attn.q_proj.weight"
            assert torch.equal(mapped.tensor(name), originals[name])
        first.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(first.wait, 30) == 0
        assert segments_of(first.pid) == []

        # 2. SIGKILL leaves segments behind; the next store removes them before it is ready.
        second = start_store(model_dir, tmp_path / "second.port")
        processes.append(second)
        await asyncio.to_thread(wait_for_port, second, tmp_path / "second.port")
        second.kill()
        await asyncio.to_thread(second.wait, 30)
        assert len(segments_of(second.pid)) == 2
        third = start_store(model_dir, tmp_path / "third.port")
        processes.append(third)
        port = await asyncio.to_thread(wait_for_port, third, tmp_path / "third.port")
        assert segments_of(second.pid) == []
        assert (await health(f"127.0.0.1:{port}")).pid == third.pid
        third.send_signal(signal.SIGINT)
        assert await asyncio.to_thread(third.wait, 30) == 0
        assert segments_of(third.pid) == []
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
            process.stdout.close()


@pytest.mark.multiprocess
def test_store_process_refuses_pickle_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.pt").write_bytes(b"pickle")
    result = subprocess.run(
        [sys.executable, "-m", "services.weightstore", "--model", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "safetensors" in result.stdout + result.stderr
