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


@pytest.mark.multiprocess
def test_a_killed_worker_stops_the_stack_and_is_named(tmp_path):
    model = make_checkpoint(tmp_path / "llama-up", "llama", seed=2)
    env = {**os.environ, "RECONFIG_RUN_DIR": str(tmp_path / "run")}
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--model", str(model), "--workers", "2", "--topology", "tp1pp2",
         "--http-port", "0", "--grpc-port", "0", "--controller-port", "0", "--kv-cache-mb", "2"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stack_file = tmp_path / "run" / "stack.json"
    deadline = time.monotonic() + 120
    while not stack_file.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-2000:]
        time.sleep(0.2)
    pids = json.loads(stack_file.read_text())["pids"]
    victim = pids["worker-1"]
    kv_segments = [s for s in list_segments(KV_SEGMENT_PREFIX) if f"-{victim}-" in s]
    assert kv_segments  # the worker's KV pool lives in shared memory
    os.kill(victim, signal.SIGKILL)
    assert process.wait(60) == 1
    stderr = process.stderr.read()
    assert f"worker-1 (pid {victim}, exit code -9) exited; stopping the stack" in stderr
    alive = [pid for name, pid in pids.items() if name != "launcher" and process_running(pid)]
    assert not alive, f"left running: {alive}"
    assert not [s for s in kv_segments if s in list_segments(KV_SEGMENT_PREFIX)]
    assert not stack_file.exists()


def test_config_file_and_flags(tmp_path):
    config = tmp_path / "stack.toml"
    config.write_text('workers = 2\ntopology = "tp2pp1"\nhttp_port = 9000\n')
    loaded = UpConfig.load(config, {"http_port": 9100, "model": None})
    assert (loaded.workers, loaded.topology, loaded.http_port, loaded.model) == (2, "tp2pp1", 9100, "tiny-llama")
    config.write_text("wrokers = 2\n")
    with pytest.raises(ValueError, match="unknown setting\\(s\\) wrokers"):
        UpConfig.load(config, {})
    with pytest.raises(ValueError, match="workers must be >= 1"):
        UpConfig.load(None, {"workers": 0})
