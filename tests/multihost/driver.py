"""The client side of a multi-host scenario, run on one of the namespace hosts (their addresses exist only there):
`python -m tests.multihost.driver RESULT.json < scenario.json` writes one JSON object.

The scenario: the router's and the controller's gRPC addresses, the token, TLS files, and phases. Each phase
starts its requests (greedy, token ids in and out over Router.Generate), waits until every one has produced a
token, then runs its actions in order while they stream, and collects every request's tokens:
- {"reconfigure": "tp4pp1"}: a switch (its OperationStatus in the output);
- {"kill_worker_on": "10.77.0.2"}: kill -9 of the highest-ranked worker at that address, then wait for the
  controller's recovery;
- {"kill_host": "<netns>"}: kill -9 of every process in that host's network namespace, then wait for the recovery.
A scenario with "instances" instead moves requests between instances (see `moves`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from google.protobuf.json_format import MessageToDict

from services.rpc.auth import auth_metadata
from services.rpc.reconfig.v1 import controller_pb2, controller_pb2_grpc, router_pb2, router_pb2_grpc
from services.rpc.tls import TLSConfig, aio_channel
from tests.conftest import until

_RECOVERY_TIMEOUT_S = 120.0


class Scenario:
    def __init__(self, spec: dict) -> None:
        tls = TLSConfig(**spec["tls"]) if spec.get("tls") else None
        self.metadata = auth_metadata(spec["token"])
        self.router = router_pb2_grpc.RouterStub(aio_channel(spec["router"], tls, carries_token=True))
        self.controller = controller_pb2_grpc.ControllerStub(aio_channel(spec["controller"], tls, carries_token=True))

    async def generate(self, request_id: str, prompt: list[int], max_tokens: int, started: asyncio.Event) -> dict:
        tokens, finish, error = [], "", ""
        call = self.router.Generate(router_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True),
            metadata=self.metadata)
        async for response in call:
            tokens += response.token_ids
            if tokens:
                started.set()
            finish, error = response.finish_reason or finish, response.error or error
        started.set()
        return {"tokens": tokens, "finish_reason": finish, "error": error}

    async def status(self) -> controller_pb2.StackStatus:
        return await self.controller.GetStatus(controller_pb2.GetStatusRequest(), timeout=30, metadata=self.metadata)

    async def recovered(self, before: str) -> dict:
        """The first recover operation after `before` (an operation id) once it has ended."""
        async def ended():
            operation = (await self.status()).last_operation
            return operation if (operation.kind == "recover" and operation.operation_id != before
                                 and operation.state != controller_pb2.OPERATION_STATE_RUNNING) else None

        operation = await until(ended, _RECOVERY_TIMEOUT_S, what="the controller's recovery", interval_s=0.1)
        return MessageToDict(operation, preserving_proto_field_name=True)

    async def act(self, action: dict) -> dict:
        if "reconfigure" in action:
            started = time.perf_counter()
            operation = await self.controller.Reconfigure(
                controller_pb2.ReconfigureRequest(topology=action["reconfigure"]), timeout=120, metadata=self.metadata)
            return {"action": action, "seconds": time.perf_counter() - started,
                    "operation": MessageToDict(operation, preserving_proto_field_name=True)}
        before = (await self.status()).last_operation.operation_id
        if "kill_worker_on" in action:
            workers = [w for w in (await self.status()).workers if w.address.startswith(action["kill_worker_on"] + ":")]
            victim = max(workers, key=lambda w: w.rank)
            os.kill(victim.pid, signal.SIGKILL)
            killed = [victim.pid]
        elif "kill_host" in action:
            listed = subprocess.run(["ip", "netns", "pids", action["kill_host"]], capture_output=True, text=True)
            killed = [int(pid) for pid in listed.stdout.split()]
            for pid in killed:
                os.kill(pid, signal.SIGKILL)
        else:
            raise ValueError(f"unknown action {action}")
        return {"action": action, "killed": killed, "operation": await self.recovered(before)}

    async def phase(self, phase: dict) -> dict:
        events = [asyncio.Event() for _ in phase["prompts"]]
        tasks = [asyncio.ensure_future(self.generate(f"{phase['name']}-{i}", prompt, max_tokens, event))
                 for i, (prompt, max_tokens, event) in enumerate(zip(phase["prompts"], phase["max_tokens"], events))]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in events)), 120)
        actions = []
        for action in phase["actions"]:
            actions.append(await self.act(action))
            actions[-1]["in_flight"] = sum(1 for task in tasks if not task.done())
        outputs = await asyncio.wait_for(asyncio.gather(*tasks), 300)
        status = await self.status()
        return {"name": phase["name"], "actions": actions, "outputs": outputs, "topology": status.topology,
                "workers": [w.address for w in status.workers]}


async def moves(spec: dict) -> dict:
    """Requests through an in-process front router (the front's own code) over the instances' routers, each moved
    after the given numbers of its tokens to the other instance, by KV or (`reprefill`) by re-prefill."""
    from services.front.engine import FrontEngine, FrontSettings
    from services.front.instances import Instance
    from services.model.tokenizer import Tokenizer
    from services.router.contracts import GenerationRequest

    tls = TLSConfig(**spec["tls"]) if spec.get("tls") else None
    instances = [Instance(f"i{n}", address, spec["token"], tls=tls) for n, address in enumerate(spec["instances"])]
    front = FrontEngine(instances, Tokenizer.from_dir(spec["model_dir"]), "front", FrontSettings(migrate=False))
    await front.start()
    outputs = []
    try:
        for i, (prompt, max_tokens) in enumerate(zip(spec["prompts"], spec["max_tokens"])):
            request = GenerationRequest(f"move-{i}", tuple(prompt), max_tokens)
            hops, tokens, results = list(spec["hops"]), [], []
            async for delta in front.generate(request):
                tokens.extend(delta.token_ids)
                while hops and len(tokens) >= hops[0]:
                    hops.pop(0)
                    here = next(instance for instance in instances if any(
                        route.request.request_id == request.request_id for route in front.requests_on(instance)))
                    target = next(instance for instance in instances if instance is not here)
                    result = await front.move(request.request_id, target, spec.get("reprefill", False))
                    results.append({f.name: getattr(result, f.name) for f in dataclasses.fields(result)
                                    if f.name != "call"} | {"from": here.address, "to": target.address})
            outputs.append({"tokens": tokens, "moves": results})
    finally:
        await front.stop()
    return {"outputs": outputs}


async def run(spec: dict) -> dict:
    if "instances" in spec:
        return await moves(spec)
    scenario = Scenario(spec)
    return {"phases": [await scenario.phase(phase) for phase in spec["phases"]]}


if __name__ == "__main__":  # the result goes to the file named first (stdout carries the services' logs)
    Path(sys.argv[1]).write_text(json.dumps(asyncio.run(run(json.load(sys.stdin)))))
