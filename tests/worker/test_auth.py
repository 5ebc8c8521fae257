"""A worker started with the control-plane token refuses every RPC without it (steps and switches included)."""

from __future__ import annotations

import asyncio
import struct

import grpc
import pytest

from services.launch.cluster import ClusterConfig, LocalCluster
from services.router.driver import Driver
from services.launch.generate import generate
from services.rpc.auth import auth_metadata
from services.rpc.frames import frame
from services.rpc.reconfig.v1 import worker_pb2, worker_pb2_grpc
from tests.conftest import hf_greedy, make_checkpoint

pytestmark = pytest.mark.multiprocess
TOKEN = "worker-auth-token"


def test_worker_rpcs_need_the_token(tmp_path):
    model = make_checkpoint(tmp_path / "llama-auth", "llama", seed=8)
    config = ClusterConfig(model=str(model), num_workers=1, topology="tp1pp1", kv_cache_bytes=1 << 20,
                           block_size=4, token=TOKEN)
    with LocalCluster(config) as cluster:
        address = cluster.worker_addresses[0]

        async def probe() -> list[grpc.StatusCode]:
            codes = []
            async with grpc.aio.insecure_channel(address) as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                calls = [
                    lambda md: stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5, metadata=md),
                    lambda md: stub.PrepareSwitch(worker_pb2.PrepareSwitchRequest(topology="tp1pp1"), timeout=5,
                                                  metadata=md),
                    lambda md: stub.ApplySwitch(worker_pb2.ApplySwitchRequest(topology="tp1pp1"), timeout=5,
                                                metadata=md),
                    lambda md: stub.Regroup(worker_pb2.RegroupRequest(generation=1, rank=0, world_size=1,
                                                                      topology="tp1pp1"), timeout=5, metadata=md),
                    lambda md: stub.Shutdown(worker_pb2.ShutdownRequest(), timeout=5, metadata=md),
                ]
                for call in calls:
                    for metadata in ((), auth_metadata("wrong")):
                        try:
                            await call(metadata)
                            codes.append(grpc.StatusCode.OK)
                        except grpc.aio.AioRpcError as exc:
                            codes.append(exc.code())
                info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5, metadata=auth_metadata(TOKEN))
                assert info.state == "ACTIVE"
            for greeting in (b"", b"wrong"):  # the step socket: a refusal in words, then the connection closes
                reader, writer = await asyncio.open_connection(address.rpartition(":")[0], info.step_port)
                writer.write(frame(greeting))
                (length,) = struct.unpack("<I", await reader.readexactly(4))
                assert b"token" in await reader.readexactly(length)
                assert await reader.read() == b""
                writer.close()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async with Driver([address]) as driver:  # no token: not even the step stream opens
                    await generate(driver, [[1, 2, 3]], 2)
            codes.append(refused.value.code())
            async with Driver([address], token=TOKEN) as driver:
                results = await generate(driver, [[1, 5, 9]], 6)
            assert [r.token_ids for r in results] == hf_greedy(model, [[1, 5, 9]], 6)[0]
            return codes

        codes = asyncio.run(probe())
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * len(codes)
