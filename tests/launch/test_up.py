"""`reconfig up` supervision: a dying child is named, the stack stops, nothing is left behind; config errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from services.launch.up_config import UpConfig
from services.weightstore.shm import list_segments
from services.worker.kv_cache import KV_SEGMENT_PREFIX
from tests.conftest import make_checkpoint, process_running, wait_for_stack_file, wait_until
from tests.launch.helpers import free_ports, reconfigctl, run_dir_env


ANY_PORTS = ("--http-port", "0", "--grpc-port", "0", "--controller-port", "0", "--controller-metrics-port", "0")


def _launch(tmp_path, *flags: str) -> subprocess.Popen:
    """`reconfig up FLAGS` on a small checkpoint, with tmp_path/run as its run directory."""
    model = tmp_path / "llama-up"
    if not model.exists():
        make_checkpoint(model, "llama", seed=2)
    return subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--model", str(model), "--kv-cache-mb", "2",
                             *flags], env=run_dir_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _start_up(tmp_path, *flags: str):
    """`reconfig up` on a small checkpoint, on any free ports; returns the process, its environment and the stack
    file's content."""
    process = _launch(tmp_path, *ANY_PORTS, *flags)
    return process, run_dir_env(tmp_path), wait_for_stack_file(process, tmp_path / "run")


@pytest.mark.multiprocess
def test_a_killed_worker_is_recovered_replaced_and_added_back(tmp_path):
    process, env, stack_file = _start_up(tmp_path, "--workers", "2", "--topology", "tp1pp2")
    try:
        # A killed controller is started again; the new one finds the stack as it was (and does the recovery).
        first_controller = json.loads(stack_file.read_text())["pids"]["controller"]
        os.kill(first_controller, signal.SIGKILL)
        wait_until(lambda: json.loads(stack_file.read_text())["pids"]["controller"] != first_controller, 60,
                   what="a new controller", interval_s=0.2)
        restarted = json.loads(wait_until(lambda: reconfigctl(env, "status", "--json").stdout, 30, what="its status",
                                          interval_s=0.2))
        assert restarted["topology"] == "tp1pp2" and restarted["state"] == "SERVING", restarted["reason"]
        pids = json.loads(stack_file.read_text())["pids"]
        victim = pids["worker-1"]
        kv_segments = [s for s in list_segments(KV_SEGMENT_PREFIX) if f"-{victim}-" in s]
        assert kv_segments  # the worker's KV pool lives in shared memory
        os.kill(victim, signal.SIGKILL)
        # The launcher starts a joining worker; the controller moves the stack onto the survivor meanwhile.
        replacement = wait_until(lambda: json.loads(stack_file.read_text()).get("replacements"), 60,
                                 what="a replacement", interval_s=0.2)[0]

        def degraded():
            status = json.loads(reconfigctl(env, "status", "--json").stdout or "{}")
            return status if status.get("topology") == "tp1pp1" and status.get("lost_workers") else None

        status = wait_until(degraded, 60, what="the recovery onto the survivor", interval_s=0.2)
        assert status["state"] == "DEGRADED" and len(status["workers"]) == 1
        assert status["last_operation"]["kind"] == "recover" and status["last_operation"]["state"] == "SUCCEEDED"
        assert not [s for s in kv_segments if s in list_segments(KV_SEGMENT_PREFIX)]  # the dead worker's KV pool
        added = reconfigctl(env, "add-worker", replacement, "--topology", "tp1pp2")
        assert added.returncode == 0, added.stderr
        assert "SUCCEEDED" in added.stdout
        status = json.loads(reconfigctl(env, "status", "--json").stdout)
        assert status["topology"] == "tp1pp2" and status["state"] == "SERVING", status["reason"]
        assert [w["state"] for w in status["workers"]] == ["ACTIVE", "ACTIVE"]
        assert status["workers"][1]["address"] == replacement and not status["lost_workers"]
        refused = reconfigctl(env, "add-worker", replacement)
        assert refused.returncode == 2 and "already a member" in refused.stderr
        pids = json.loads(stack_file.read_text())["pids"]
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, process.stderr.read()[-3000:]
    stderr = process.stderr.read()
    assert f"controller (pid {first_controller}, exit code -9) exited; starting it again" in stderr
    assert f"worker-1 (pid {victim}, exit code -9) exited; the controller moves the stack onto the other" in stderr
    assert f"reconfigctl add-worker {replacement}" in stderr
    alive = [pid for name, pid in pids.items() if name != "launcher" and process_running(pid)]
    assert not alive, f"left running: {alive}"
    assert not stack_file.exists()


@pytest.mark.multiprocess
def test_a_killed_service_stops_the_stack_and_is_named(tmp_path):
    process, env, stack_file = _start_up(tmp_path, "--workers", "1", "--topology", "tp1pp1")
    pids = json.loads(stack_file.read_text())["pids"]
    os.kill(pids["router"], signal.SIGKILL)
    assert process.wait(60) == 1
    stderr = process.stderr.read()
    assert f"router (pid {pids['router']}, exit code -9) exited; stopping the stack" in stderr
    alive = [pid for name, pid in pids.items() if name != "launcher" and process_running(pid)]
    assert not alive, f"left running: {alive}"
    assert not stack_file.exists()


@pytest.mark.multiprocess
def test_a_second_stack_is_refused_on_the_first_ones_ports_and_stacks_on_other_ports_each_keep_their_control(
        tmp_path):
    """The bug of issue 42: a second `reconfig up` on a running stack's ports started workers, failed on the router
    port and deleted the first stack's token on its way out. Now it is refused before it loads anything (its model
    does not even exist), the first stack keeps its control plane, and stacks on other ports are each reached by
    name or port."""
    http, grpc_port, controller, metrics = free_ports(4)
    ports = ("--http-port", str(http), "--grpc-port", str(grpc_port), "--controller-port", str(controller),
             "--controller-metrics-port", str(metrics))
    first = _launch(tmp_path, *ports, "--name", "first", "--workers", "2", "--topology", "tp1pp2")
    second = None
    try:
        first_file = wait_for_stack_file(first, tmp_path / "run", name="first")
        token_file = json.loads(first_file.read_text())["token_file"]
        env = run_dir_env(tmp_path)
        for flags in (ports, ("--name", "first", *ANY_PORTS)):
            refused = subprocess.run([sys.executable, "-m", "services.cli", "up", "--model", "/nonexistent/model",
                                      *flags], env=env, capture_output=True, text=True, timeout=120)
            assert refused.returncode == 2, refused.stderr
            assert f"a stack is running: launcher pid {first.pid}, http :{http} (stack 'first'" in refused.stderr
            assert "stop it or choose other ports" in refused.stderr
            assert "nonexistent" not in refused.stderr  # refused before it looked for its model
        assert sorted(p.name for p in (tmp_path / "run" / "stacks").iterdir() if p.is_dir()) == ["first"]
        assert os.path.exists(token_file)
        status = reconfigctl(env, "status")
        assert status.returncode == 0 and status.stdout.startswith("stack 'first', controller"), status.stderr
        assert "layouts this model allows on 2 workers: tp1pp1, tp1pp2, tp2pp1" in status.stdout
        switched = reconfigctl(env, "reconfigure", "tp2pp1")
        assert switched.returncode == 0 and "SUCCEEDED" in switched.stdout, switched.stderr

        second = _launch(tmp_path, *ANY_PORTS, "--name", "second", "--workers", "1", "--topology", "tp1pp1")
        wait_for_stack_file(second, tmp_path / "run", name="second")
        ambiguous = reconfigctl(env, "status")
        assert ambiguous.returncode == 1 and "2 stacks are running: first (" in ambiguous.stderr
        assert "choose one with --stack NAME|PORT" in ambiguous.stderr
        for selector, topology in (("first", "tp2pp1"), (str(http), "tp2pp1"), ("second", "tp1pp1")):
            chosen = reconfigctl(env, "--stack", selector, "status", "--json")
            assert chosen.returncode == 0, chosen.stderr
            assert json.loads(chosen.stdout)["topology"] == topology
        assert reconfigctl({**env, "RECONFIG_STACK": "second"}, "reconfigure", "tp1pp1").returncode == 0
        listed = json.loads(reconfigctl(env, "stacks", "--json").stdout)
        assert [(s["name"], s["launcher_pid"], s["state"]) for s in listed] == [("first", first.pid, "up"),
                                                                                ("second", second.pid, "up")]
    finally:
        for process in filter(None, (second, first)):
            process.send_signal(signal.SIGTERM)
            assert process.wait(60) == 0
    assert "reconfig up: stack 'first' stopped" in first.stderr.read()
    assert not [p for p in (tmp_path / "run" / "stacks").iterdir() if p.is_dir()]


def test_config_file_and_flags(tmp_path):
    config = tmp_path / "stack.toml"
    config.write_text('workers = 2\ntopology = "tp2pp1"\nhttp_port = 9000\n')
    loaded = UpConfig.load(config, {"http_port": 9100, "model": None})
    assert (loaded.workers, loaded.topology, loaded.http_port, loaded.model) == (2, "tp2pp1", 9100, "smollm2-135m")
    assert (UpConfig().model, UpConfig().topology, UpConfig().workers) == ("smollm2-135m", "tp1pp4", 4)
    config.write_text("wrokers = 2\n")
    with pytest.raises(ValueError, match="unknown setting\\(s\\) wrokers"):
        UpConfig.load(config, {})
    with pytest.raises(ValueError, match="workers must be >= 1"):
        UpConfig.load(None, {"workers": 0})
    assert UpConfig.load(None, {"staging_duty": 0.5}).staging_duty == 0.5
    assert UpConfig.load(None, {"spread_decodes": True}).spread_decodes and not UpConfig().spread_decodes
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="staging_duty must be in \\(0, 1\\]"):
            UpConfig.load(None, {"staging_duty": bad})
