"""`reconfig up` supervision: a dying child is named, the stack stops, nothing is left behind; config errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from services.launch.up import UpConfig
from services.weightstore.shm import list_segments
from services.worker.kv_cache import KV_SEGMENT_PREFIX
from tests.conftest import make_checkpoint, process_running


def _start_up(tmp_path, *flags: str):
    """`reconfig up` on a small checkpoint; returns the process, its environment and the stack file's content."""
    model = make_checkpoint(tmp_path / "llama-up", "llama", seed=2)
    env = {**os.environ, "RECONFIG_RUN_DIR": str(tmp_path / "run")}
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--model", str(model), "--http-port", "0", "--grpc-port", "0",
         "--controller-port", "0", "--controller-metrics-port", "0", "--kv-cache-mb", "2", *flags],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stack_file = tmp_path / "run" / "stack.json"
    deadline = time.monotonic() + 120
    while not stack_file.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-2000:]
        time.sleep(0.2)
    return process, env, stack_file


def _reconfigctl(env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.controller.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := predicate()):
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


@pytest.mark.multiprocess
def test_a_killed_worker_is_recovered_replaced_and_added_back(tmp_path):
    process, env, stack_file = _start_up(tmp_path, "--workers", "2", "--topology", "tp1pp2")
    try:
        # A killed controller is started again; the new one finds the stack as it was (and does the recovery).
        first_controller = json.loads(stack_file.read_text())["pids"]["controller"]
        os.kill(first_controller, signal.SIGKILL)
        _wait_for(lambda: json.loads(stack_file.read_text())["pids"]["controller"] != first_controller, 60,
                  "a new controller")
        restarted = json.loads(_wait_for(lambda: _reconfigctl(env, "status", "--json").stdout, 30, "its status"))
        assert restarted["topology"] == "tp1pp2" and restarted["state"] == "SERVING", restarted["reason"]
        pids = json.loads(stack_file.read_text())["pids"]
        victim = pids["worker-1"]
        kv_segments = [s for s in list_segments(KV_SEGMENT_PREFIX) if f"-{victim}-" in s]
        assert kv_segments  # the worker's KV pool lives in shared memory
        os.kill(victim, signal.SIGKILL)
        # The launcher starts a joining worker; the controller moves the stack onto the survivor meanwhile.
        replacement = _wait_for(lambda: json.loads(stack_file.read_text()).get("replacements"), 60, "a replacement")[0]

        def degraded():
            status = json.loads(_reconfigctl(env, "status", "--json").stdout or "{}")
            return status if status.get("topology") == "tp1pp1" and status.get("lost_workers") else None

        status = _wait_for(degraded, 60, "the recovery onto the survivor")
        assert status["state"] == "DEGRADED" and len(status["workers"]) == 1
        assert status["last_operation"]["kind"] == "recover" and status["last_operation"]["state"] == "SUCCEEDED"
        assert not [s for s in kv_segments if s in list_segments(KV_SEGMENT_PREFIX)]  # the dead worker's KV pool
        added = _reconfigctl(env, "add-worker", replacement, "--topology", "tp1pp2")
        assert added.returncode == 0, added.stderr
        assert "SUCCEEDED" in added.stdout
        status = json.loads(_reconfigctl(env, "status", "--json").stdout)
        assert status["topology"] == "tp1pp2" and status["state"] == "SERVING", status["reason"]
        assert [w["state"] for w in status["workers"]] == ["ACTIVE", "ACTIVE"]
        assert status["workers"][1]["address"] == replacement and not status["lost_workers"]
        refused = _reconfigctl(env, "add-worker", replacement)
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
