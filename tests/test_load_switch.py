"""Load: 200 concurrent streaming clients while 20 back-to-back switches run, two of them injected to fail.

0 lost, 0 hung, every output equal to the oracle. Loopback only; bounded in requests (at most 40 per client, sent
until the switches are done: the cap is far above what the switches need on a fast machine, so that on a slow or busy
one the load still lasts through the last switch) and in time.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys

import grpc
import pytest

from services.rpc.auth import auth_metadata, read_token_file
from services.rpc.reconfig.v1 import controller_pb2, controller_pb2_grpc
from tests.conftest import hf_greedy, make_checkpoint, wait_for_stack_file
from tests.up_stack import wait_ready

pytestmark = pytest.mark.multiprocess
NUM_CLIENTS, MAX_REQUESTS_PER_CLIENT, NUM_SWITCHES = 200, 40, 20
CYCLE = ["tp4pp1", "tp2pp1", "tp1pp3", "tp2pp2"]
# Rank 3 refuses its first ApplySwitch; rank 0 fails the first time it migrates layer 2: two switches roll back.
FAULTS = "apply:rank=3:action=raise:once=1;migrate:rank=0:layer=2:action=raise:once=1"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model = make_checkpoint(tmp_path_factory.mktemp("load") / "llama-load", "llama", seed=9)
    run_dir = tmp_path_factory.mktemp("run")
    env = {**os.environ, "RECONFIG_RUN_DIR": str(run_dir), "RECONFIG_FAULTS": FAULTS}
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--model", str(model), "--workers", "4", "--topology", "tp2pp2",
         "--http-port", "0", "--grpc-port", "0", "--controller-port", "0", "--controller-metrics-port", "0", "--kv-cache-mb", "8", "--block-size", "4"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    info = json.loads(wait_for_stack_file(process, run_dir).read_text())
    wait_ready(info["router_http_address"], timeout_s=120)
    yield model, info
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0


async def _stream(client, url: str, prompt: list[int], max_tokens: int) -> str:
    body = {"model": "llama-load", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    text = []
    async with client.stream("POST", url, json=body, timeout=120) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text.append(chunk["choices"][0]["text"])
    return "".join(text)


async def _switches(info) -> list[controller_pb2.OperationStatus]:
    metadata = auth_metadata(read_token_file(info["token_file"]))
    operations, live = [], "tp2pp2"
    async with grpc.aio.insecure_channel(info["controller_address"]) as channel:
        stub = controller_pb2_grpc.ControllerStub(channel)
        for i in range(NUM_SWITCHES):
            target = CYCLE[i % len(CYCLE)]
            target = CYCLE[(i + 1) % len(CYCLE)] if target == live else target
            operation = await stub.Reconfigure(controller_pb2.ReconfigureRequest(topology=target), timeout=120,
                                               metadata=metadata)
            operations.append(operation)
            if operation.state == controller_pb2.OPERATION_STATE_SUCCEEDED:
                live = target
    return operations


def test_200_streaming_clients_through_20_switches(stack):
    import httpx

    from services.model.tokenizer import Tokenizer

    model, info = stack
    rng = random.Random(3)
    pool = [[rng.randrange(3, 256) for _ in range(rng.randrange(1, 24))] for _ in range(40)]
    jobs = [[(rng.randrange(len(pool)), rng.randrange(4, 17)) for _ in range(MAX_REQUESTS_PER_CLIENT)]
            for _ in range(NUM_CLIENTS)]
    expected_tokens, _ = hf_greedy(model, pool, 16)
    tokenizer = Tokenizer.from_dir(model)
    url = info["router_http_address"] + "/v1/completions"

    started, finished, switching = [], [], asyncio.Event()

    async def client_loop(client, my_jobs):
        done = []
        for p, n in my_jobs:  # keep the load on until the switches are over (at most MAX_REQUESTS_PER_CLIENT)
            if switching.is_set() and done:
                break
            started.append(p)
            done.append((p, n, await _stream(client, url, pool[p], n)))
            finished.append(p)
        return done

    async def run():
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 16, max_keepalive_connections=NUM_CLIENTS)
        async with httpx.AsyncClient(limits=limits) as client:
            clients = asyncio.gather(*(client_loop(client, j) for j in jobs))
            operations = await _switches(info)
            in_flight_at_end = len(started) - len(finished)
            switching.set()
            return await asyncio.wait_for(clients, 300), operations, in_flight_at_end

    results, operations, in_flight_at_end = asyncio.run(run())
    # The switches ran under load: when the last one ended, requests were still streaming.
    assert in_flight_at_end > 0
    outputs = [r for per_client in results for r in per_client]
    assert len(outputs) == len(started) >= NUM_CLIENTS  # every request sent came back: none lost, none hung
    wrong = [(p, n) for p, n, text in outputs if text != tokenizer.decode(expected_tokens[p][:n])]
    assert not wrong, f"{len(wrong)} outputs differ from the oracle"
    states = [op.state for op in operations]
    assert states.count(controller_pb2.OPERATION_STATE_ROLLED_BACK) == 2
    assert states.count(controller_pb2.OPERATION_STATE_SUCCEEDED) == NUM_SWITCHES - 2
