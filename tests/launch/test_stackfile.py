"""The stack file: where it lives, its 0600 JSON, and how a stale or missing one is reported."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from services.launch.stackfile import StackFile, StackNotFoundError, run_dir, stack_file_path


def _stack(**overrides) -> StackFile:
    values = dict(controller_address="127.0.0.1:50051", router_http_address="http://127.0.0.1:8000",
                  router_grpc_address="127.0.0.1:50052", token_file="/run/token",
                  pids={"launcher": os.getpid()}, model="tiny-llama", topology="tp2pp2", started_at=1700000000.5)
    return StackFile(**{**values, **overrides})


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_path_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RECONFIG_RUN_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert stack_file_path() == tmp_path / "home" / ".local" / "state" / "reconfig" / "stack.json"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    assert stack_file_path() == tmp_path / "xdg" / "reconfig" / "stack.json"
    monkeypatch.setenv("RECONFIG_RUN_DIR", str(tmp_path / "run"))
    assert stack_file_path() == tmp_path / "run" / "stack.json"
    assert not (tmp_path / "run").exists(), "looking up the path creates nothing"
    assert run_dir() == tmp_path / "run" and stat.S_IMODE((tmp_path / "run").stat().st_mode) == 0o700


def test_write_load_remove(monkeypatch, tmp_path):
    monkeypatch.setenv("RECONFIG_RUN_DIR", str(tmp_path / "run"))
    stack = _stack()
    path = stack.write()
    assert path == stack_file_path()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text())["pids"] == {"launcher": os.getpid()}
    assert StackFile.load() == stack
    assert stack.dead_processes() == []
    newer = _stack(started_at=1800000000.0)
    newer.write()
    assert not stack.remove(), "an older stack must not delete a newer stack's file"
    assert newer.remove() and not path.exists()
    assert not newer.remove()


def test_missing_file_says_how_to_start_one(monkeypatch, tmp_path):
    monkeypatch.setenv("RECONFIG_RUN_DIR", str(tmp_path))
    with pytest.raises(StackNotFoundError) as error:
        StackFile.load()
    assert str(error.value) == (f"no running reconfig stack found (looked in {tmp_path / 'stack.json'}); "
                                "start one with `reconfig up`")


def test_stack_whose_processes_are_gone_is_not_running(tmp_path):
    path = tmp_path / "stack.json"
    dead = _dead_pid()
    _stack(pids={"launcher": dead, "worker-0": dead}).write(path)
    with pytest.raises(StackNotFoundError, match="its processes are gone"):
        StackFile.load(path)
    assert StackFile.read(path).pids["launcher"] == dead  # read() still parses it
    partly = _stack(pids={"launcher": os.getpid(), "worker-0": dead})
    partly.write(path)
    assert StackFile.load(path) == partly, "a stack with a live process is running (maybe degraded)"
    assert partly.dead_processes() == ["worker-0"]


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"controller_address": "a"}',
                                     json.dumps({"controller_address": "a", "router_http_address": "b",
                                                 "router_grpc_address": "c", "token_file": "t",
                                                 "pids": {"x": "nope"}})])
def test_malformed_file_is_reported(tmp_path, content):
    path = tmp_path / "stack.json"
    path.write_text(content)
    with pytest.raises(StackNotFoundError, match="unreadable stack file"):
        StackFile.load(path)
