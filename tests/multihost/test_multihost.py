"""One instance over two hosts (Linux namespaces: tests/multihost/hosts.py), with mutual TLS: a tp2pp2 whose stages
sit on two hosts serves 16 streams equal to transformers through switches that move KV between the hosts (tp2pp2 ->
tp4pp1 -> tp1pp4 -> tp2pp2); then kill -9 of a worker on the remote host, and the loss of that whole host, lose no
request."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from services.rpc.auth import generate_token, write_token_file
from services.rpc.certs import write_dev_certs
from tests.conftest import hf_greedy, make_checkpoint, wait_for_stack_file
from tests.multihost.hosts import NamespaceHosts, unavailable

_WHY = unavailable()
pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(bool(_WHY), reason=_WHY or "namespaces available")]

ROOT = Path(__file__).resolve().parents[2]
DIST_PORT = 29600
CHAIN = ["tp4pp1", "tp1pp4", "tp2pp2"]


def _up(hosts: NamespaceHosts, node: int, checkpoint: Path, certs, token_file: Path, env: dict, log: Path):
    host = hosts[node]
    files = certs[node]
    argv = [sys.executable, "-m", "services.cli", "up", "--model", str(checkpoint), "--workers", "2",
            "--topology", "tp2pp2", "--nodes", "2", "--node-rank", str(node),
            "--dist-addr", f"{hosts[0].address}:{DIST_PORT}", "--host", host.address, "--token-file", str(token_file),
            "--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca),
            "--kv-cache-mb", "2", "--block-size", "4", "--api-servers", "0", "--name", "multihost",
            "--no-replace-lost-workers"]
    return host.popen(argv, env=env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _requests(seed: int, count: int = 16):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(2, 24))] for _ in range(count)]
    return prompts, [rng.randrange(150, 200) for _ in prompts]


def test_an_instance_across_two_hosts_switches_and_survives_their_loss(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "llama-4l", "llama", seed=5, num_hidden_layers=4)
    with NamespaceHosts(2) as hosts:
        certs = write_dev_certs([h.address for h in hosts.hosts], tmp_path / "certs")
        token_file = tmp_path / "token"
        write_token_file(token_file, generate_token())
        env = {**os.environ, "RECONFIG_RUN_DIR": str(tmp_path / "run")}
        logs = [tmp_path / "leader.log", tmp_path / "follower.log"]
        leader = _up(hosts, 0, checkpoint, certs, token_file, env, logs[0])
        follower = _up(hosts, 1, checkpoint, certs, token_file, env, logs[1])
        try:
            wait_for_stack_file(leader, tmp_path / "run")
            phases = [("switches", _requests(1), [{"reconfigure": t} for t in CHAIN]),
                      ("remote-worker-lost", _requests(2), [{"kill_worker_on": hosts[1].address}]),
                      ("host-lost", _requests(3), [{"kill_host": hosts[1].netns}])]
            spec = {"router": f"{hosts[0].address}:50052", "controller": f"{hosts[0].address}:50051",
                    "token": token_file.read_text().strip(),
                    "tls": {"cert": str(certs[0].cert), "key": str(certs[0].key), "ca": str(certs[0].ca)},
                    "phases": [{"name": name, "prompts": prompts, "max_tokens": lengths, "actions": actions}
                               for name, (prompts, lengths), actions in phases]}
            out = tmp_path / "driven.json"
            driven = hosts[0].run([sys.executable, "-m", "tests.multihost.driver", str(out)], input=json.dumps(spec),
                                  capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
            assert driven.returncode == 0, driven.stderr[-4000:]
            result = {phase["name"]: phase for phase in json.loads(out.read_text())["phases"]}
        finally:
            if leader.poll() is None:
                leader.terminate()
            leader_code = leader.wait(60)
            follower.wait(60)  # killed with its host
        for (name, (prompts, lengths), _), phase in zip(phases, result.values()):
            expected, _ = hf_greedy(checkpoint, prompts, max(lengths))
            for i, output in enumerate(phase["outputs"]):
                assert output["finish_reason"] == "length", (name, i, output)
                assert output["tokens"] == expected[i][:lengths[i]], f"{name}: request {i}"
        switches = result["switches"]["actions"]
        assert [a["operation"]["state"] for a in switches] == ["OPERATION_STATE_SUCCEEDED"] * len(CHAIN), switches
        assert all(a["in_flight"] > 0 for a in switches), "a switch with nothing in flight proves nothing"
        # tp2pp2 -> tp4pp1: the second stage's KV (on the remote host) is split over all four workers.
        assert int(switches[0]["operation"]["kv_bytes_moved"]) > 0
        lost_one = result["remote-worker-lost"]
        assert lost_one["actions"][0]["operation"]["state"] == "OPERATION_STATE_SUCCEEDED", lost_one
        assert len(lost_one["workers"]) == 3
        lost_host = result["host-lost"]
        assert lost_host["actions"][0]["operation"]["state"] == "OPERATION_STATE_SUCCEEDED", lost_host
        assert all(a.startswith(hosts[0].address + ":") for a in lost_host["workers"]), lost_host["workers"]
    assert leader_code == 0, logs[0].read_text()[-4000:]


def _up_instance(host, name: str, checkpoint: Path, files, token_file: Path, env: dict, log: Path):
    argv = [sys.executable, "-m", "services.cli", "up", "--model", str(checkpoint), "--workers", "2",
            "--topology", "tp2pp1", "--host", host.address, "--token-file", str(token_file),
            "--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca),
            "--kv-cache-mb", "2", "--block-size", "4", "--api-servers", "0", "--name", name]
    return host.popen(argv, env=env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)


def test_a_request_moves_between_instances_on_two_hosts_with_its_kv(tmp_path):
    """Two instances, one per host: requests move there and back mid-generation with their KV copied over
    torch.distributed (no re-prefill), exactly; the same moves by re-prefill, for comparison."""
    checkpoint = make_checkpoint(tmp_path / "llama-4l", "llama", seed=5, num_hidden_layers=4)
    with NamespaceHosts(2) as hosts:
        certs = write_dev_certs([h.address for h in hosts.hosts], tmp_path / "certs")
        token_file = tmp_path / "token"
        write_token_file(token_file, generate_token())
        # Each host keeps its own run directory (its stacks' registry), as two machines would.
        envs = [{**os.environ, "RECONFIG_RUN_DIR": str(tmp_path / f"run-{name}")} for name in "ab"]
        env = envs[0]
        logs = [tmp_path / "a.log", tmp_path / "b.log"]
        stacks = [_up_instance(hosts[i], name, checkpoint, certs[i], token_file, envs[i], logs[i])
                  for i, name in enumerate("ab")]
        try:
            for name, stack in zip("ab", stacks):
                wait_for_stack_file(stack, tmp_path / f"run-{name}", name=name)
            prompts, lengths = _requests(4, count=4)
            spec = {"instances": [f"{h.address}:50052" for h in hosts.hosts], "model_dir": str(checkpoint),
                    "token": token_file.read_text().strip(),
                    "tls": {"cert": str(certs[0].cert), "key": str(certs[0].key), "ca": str(certs[0].ca)},
                    "prompts": prompts, "max_tokens": lengths, "hops": [8, 40]}
            driven = {}
            for mode in ("kv", "reprefill"):
                out = tmp_path / f"moves-{mode}.json"
                ran = hosts[0].run([sys.executable, "-m", "tests.multihost.driver", str(out)],
                                   input=json.dumps({**spec, "reprefill": mode == "reprefill"}), capture_output=True,
                                   text=True, cwd=ROOT, env=env, timeout=600)
                assert ran.returncode == 0, ran.stderr[-4000:]
                driven[mode] = json.loads(out.read_text())["outputs"]
        finally:
            for stack in stacks:
                stack.terminate()
            codes = [stack.wait(60) for stack in stacks]
    expected, _ = hf_greedy(checkpoint, prompts, max(lengths))
    for mode, outputs in driven.items():
        for i, output in enumerate(outputs):
            assert output["tokens"] == expected[i][:lengths[i]], f"{mode}: request {i}"
            moves = output["moves"]
            assert [m["moved"] for m in moves] == [True, True], moves
            assert {(m["from"], m["to"]) for m in moves} == {(f"{a.address}:50052", f"{b.address}:50052")
                                                             for a, b in (hosts.hosts, hosts.hosts[::-1])}
            if mode == "kv":  # carried: no re-prefill, the KV's bytes crossed between the hosts
                assert not any(m["reprefilled"] or m["kv_unreachable"] for m in moves), moves
                assert all(m["kv_bytes_precopied"] + m["kv_bytes_delta"] > 0 for m in moves), moves
            else:
                assert all(m["reprefilled"] for m in moves), moves
    assert codes == [0, 0], [log.read_text()[-3000:] for log in logs]
