"""End to end: `reconfig up --instances 2` (two instances of different layouts behind the front router) serves the
official openai client with transformers' tokens, `reconfigctl instances` lists and drains, SIGTERM stops all."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from services.rpc.reconfig.v1 import front_pb2
from tests.conftest import hf_greedy, make_checkpoint, process_running, wait_until
from tests.up_stack import launch_up, openai_client, stop_up, tokenizer_of, wait_for_exit

pytestmark = pytest.mark.multiprocess
NUM_TOKENS = 16
STREAM_TOKENS = 120


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("instances") / "llama-instances", "llama", seed=11)


@pytest.fixture(scope="module")
def stack(checkpoint, tmp_path_factory):
    # Rank 0's steps 30x slower than this tiny model's (some 0.1 s a token): a stream is still running when the test
    # has drained its instance (reconfigctl starts a Python process). Rank 0 only: a TP peer's measured step
    # includes its wait for rank 0, so slowing both would compound.
    process, info, env = launch_up(
        ["--model", str(checkpoint), "--instances", "2", "--workers", "2", "--instance-topologies", "tp1pp2,tp2pp1",
         "--http-port", "0", "--front-grpc-port", "0", "--kv-cache-mb", "4", "--block-size", "4"],
        tmp_path_factory.mktemp("run"), {"RECONFIG_FAULTS": "forward:rank=0:slow=30"})
    yield process, info, env
    stop_up(process)


def _front_stub(info):
    import grpc

    from services.rpc.reconfig.v1 import front_pb2_grpc

    return front_pb2_grpc.FrontStub(grpc.insecure_channel(info["front_grpc_address"]))


def _metadata(info):
    from services.rpc.auth import auth_metadata, read_token_file

    return auth_metadata(read_token_file(info["token_file"]))


def _reconfigctl(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.ctl", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def test_front_serves_transformers_tokens_and_drains_live(stack, checkpoint):
    _, info, env = stack
    assert [i["topology"] for i in info["instances"]] == ["tp1pp2", "tp2pp1"]
    client = openai_client(info)
    model = client.models.list().data[0].id
    prompt = [1, 17, 40, 2, 99, 64, 5]
    expected, _ = hf_greedy(checkpoint, [prompt], NUM_TOKENS)
    response = client.completions.create(model=model, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert response.choices[0].text == tokenizer_of(checkpoint).decode(expected[0])
    listed = json.loads(_reconfigctl(env, "instances", "--json").stdout)
    assert [i["name"] for i in listed["instances"]] == ["i0", "i1"] and listed["policy"] == "mell"
    # A stream in flight while its instance is drained: it moves live to the other layout and ends the same.
    expected, _ = hf_greedy(checkpoint, [prompt], STREAM_TOKENS)
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=STREAM_TOKENS, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    busy = next(i.name for i in _front_stub(info).ListInstances(front_pb2.ListInstancesRequest(), timeout=10,
                                                                 metadata=_metadata(info)).instances
                if i.state == "in_use")
    drained = _reconfigctl(env, "instances", "drain", busy)
    assert drained.returncode == 0 and "moved 1 requests" in drained.stdout, (drained.stdout, drained.stderr)
    text += "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == tokenizer_of(checkpoint).decode(expected[0])
    states = {i["name"]: i.get("state", "") for i in json.loads(_reconfigctl(env, "instances", "--json").stdout)
              ["instances"]}
    assert states[busy] == "drained"
    refused = _reconfigctl(env, "instances", "drain", "i9")
    assert refused.returncode == 2 and "NOT_FOUND" in refused.stderr
    assert _reconfigctl(env, "instances", "undrain", busy).returncode == 0


def test_an_instance_started_at_runtime_serves_and_stops(stack, checkpoint):
    """`reconfigctl instances start` launches a third instance (its own workers, router, controller) on standby;
    with the other two drained it serves a request with transformers' tokens; `stop` refuses it while it is in
    service and the first instance always (the weight store), then stops it: its processes are gone."""
    _, info, env = stack
    started = _reconfigctl(env, "instances", "start", "--timeout", "120")  # the first instance's layout
    assert started.returncode == 0 and started.stdout.startswith("i2: standby (tp1pp2"), (started.stdout,
                                                                                           started.stderr)
    [path] = Path(env["RECONFIG_RUN_DIR"]).glob("stacks/*/stack.json")
    stack_file = json.loads(path.read_text())
    launched = {name[len("i2-"):]: pid for name, pid in stack_file["pids"].items() if name.startswith("i2-")}
    assert {"router", "controller"} <= set(launched) and len(launched) >= 4, launched  # + its 2 workers
    pids = list(launched.values())
    assert all(process_running(pid) for pid in pids)
    for name in ("i0", "i1"):
        assert _reconfigctl(env, "instances", "drain", name).returncode == 0
    try:
        prompt = [3, 9, 27, 81, 5]
        expected, _ = hf_greedy(checkpoint, [prompt], NUM_TOKENS)
        client = openai_client(info)
        chunks = iter(client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                                max_tokens=NUM_TOKENS, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True}))
        text = next(chunks).choices[0].text  # it runs: on i2, the only instance in service
        listed = {i.name: i for i in _front_stub(info).ListInstances(front_pb2.ListInstancesRequest(), timeout=10,
                                                                     metadata=_metadata(info)).instances}
        assert listed["i2"].state == "in_use" and listed["i2"].num_requests == 1
        text += "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        assert text == tokenizer_of(checkpoint).decode(expected[0])
    finally:
        for name in ("i0", "i1"):
            assert _reconfigctl(env, "instances", "undrain", name).returncode == 0
    refused = _reconfigctl(env, "instances", "stop", "i2")
    assert refused.returncode == 2 and "FAILED_PRECONDITION" in refused.stderr
    assert _reconfigctl(env, "instances", "drain", "i2").returncode == 0
    kept = _reconfigctl(env, "instances", "stop", "i0")
    assert kept.returncode == 2 and "weight store" in kept.stderr
    stopped = _reconfigctl(env, "instances", "stop", "i2")
    assert stopped.returncode == 0, stopped.stderr
    assert [i["name"] for i in json.loads(_reconfigctl(env, "instances", "--json").stdout)["instances"]] == ["i0", "i1"]
    wait_for_exit(pids, what="i2's processes to exit after its stop")


def test_sigterm_stops_every_instance(stack):
    process, info, _ = stack
    pids = list(info["pids"].values())
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0
    wait_for_exit([pid for pid in pids if pid != process.pid], what="the launcher's children to exit (no orphan)")


def test_the_front_starts_an_instance_while_requests_wait_and_stops_it_once_idle(checkpoint, tmp_path):
    """`reconfig up --instances 1 --max-instances 2`: more long prompts than one instance's KV holds wait at the
    front; the front starts a second instance (its own processes) for them, every request ends with transformers'
    tokens, and the new instance, once idle on standby, is stopped again."""
    from concurrent.futures import ThreadPoolExecutor

    process, info, env = launch_up(
        ["--model", str(checkpoint), "--instances", "1", "--max-instances", "2", "--workers", "1", "--topology",
         "tp1pp1", "--http-port", "0", "--front-grpc-port", "0", "--kv-cache-mb", "1", "--block-size", "4",
         "--scale-up-after-s", "0.2", "--standby-stop-s", "1"],
        tmp_path / "run", {"RECONFIG_FAULTS": "forward:rank=0:slow=30"})
    try:
        stub, metadata = _front_stub(info), _metadata(info)

        def served() -> list[str]:
            return [i.name for i in stub.ListInstances(front_pb2.ListInstancesRequest(), timeout=10,
                                                       metadata=metadata).instances]

        capacity = stub.ListInstances(front_pb2.ListInstancesRequest(), timeout=10,
                                      metadata=metadata).instances[0].capacity_tokens
        prompt = [(13 * i) % 250 + 5 for i in range(200)]
        count = capacity // 204 + 2  # two more than fit at once (200 prompt tokens + the next one, in blocks of 4)
        expected, _ = hf_greedy(checkpoint, [prompt], NUM_TOKENS)
        client = openai_client(info)
        model = client.models.list().data[0].id

        def complete(_: int) -> str:
            return client.completions.create(model=model, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        with ThreadPoolExecutor(count) as pool:
            texts = pool.map(complete, range(count))
            wait_until(lambda: "i1" in served(), 120, what="an instance started while requests waited",
                       interval_s=0.05)
            texts = list(texts)
        assert texts == [tokenizer_of(checkpoint).decode(expected[0])] * count
        def scaled() -> dict[str, float]:
            metrics = httpx.get(f"{info['router_http_address']}/metrics", timeout=10).text
            return {action: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("reconfig:front_instances_autoscaled_total")
                    for action in ("start", "stop") if f'action="{action}"' in line}

        wait_until(lambda: scaled() == {"start": 1.0, "stop": 1.0}, 60,  # counted once its processes stopped
                   what="the idle instance stopped (one start and one stop counted)", interval_s=0.05)
        assert served() == ["i0"]
    finally:
        stop_up(process)
