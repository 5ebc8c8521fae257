"""`python -m services.controller`: a controller process over the package's real workers and router; SIGTERM
stops it."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import grpc
import pytest

from services.rpc.auth import auth_metadata
from services.rpc.reconfig.v1 import controller_pb2, controller_pb2_grpc
from tests.conftest import until
from tests.controller.conftest import MODEL, TOPOLOGY


async def _run(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.controller", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "RECONFIG_LOG_LEVEL": "WARNING"})


@pytest.mark.multiprocess
async def test_controller_process_serves_until_sigterm(stack, tmp_path):
    port_file = tmp_path / "controller.port"
    process = await _run("--workers", ",".join(stack.worker_addresses), "--topology", TOPOLOGY, "--token-file",
                         stack.token_file, "--router-grpc", stack.router_address, "--model", MODEL, "--port", "0",
                         "--port-file", str(port_file), "--interval", "0.2")
    try:
        await until(lambda: port_file.exists() or process.returncode is not None,
                    what="the controller to write its port file (or exit)", interval_s=0.05)
        assert port_file.exists(), (await process.stderr.read()).decode()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{int(port_file.read_text())}") as channel:
            status = await controller_pb2_grpc.ControllerStub(channel).GetStatus(
                controller_pb2.GetStatusRequest(), metadata=auth_metadata(stack.token), timeout=10)
        assert status.state == controller_pb2.STACK_STATE_SERVING, status.reason
        assert (status.model, status.topology, status.router_address) == (MODEL, TOPOLOGY, stack.router_address)
        assert [w.address for w in status.workers] == stack.worker_addresses
        assert [w.pid for w in status.workers] == stack.cluster.worker_pids
        assert status.router.num_kv_blocks_total == status.workers[0].num_kv_blocks_total > 0
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 15) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_bad_flags_exit_2(tmp_path):
    process = await _run("--workers", "127.0.0.1:1", "--topology", "tp1pp1", "--token-file", str(tmp_path / "none"))
    _, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 2 and b"No such file" in stderr
    process = await _run("--workers", "nohostport", "--topology", "tp1pp1", "--token-file", str(tmp_path / "none"))
    _, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 2 and b"expected host:port" in stderr
