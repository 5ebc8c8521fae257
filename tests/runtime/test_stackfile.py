"""The stack file: its 0600 JSON, and how a missing or malformed one is reported."""

from __future__ import annotations

import json
import os
import stat

import pytest

from services.runtime.stackfile import StackFile, StackNotFoundError, run_dir


def _stack(**overrides) -> StackFile:
    values = dict(controller_address="127.0.0.1:50051", router_http_address="http://127.0.0.1:8000",
                  router_grpc_address="127.0.0.1:50052", token_file="/run/token",
                  pids={"launcher": os.getpid()}, model="tiny-llama", topology="tp2pp2", started_at=1700000000.5,
                  name="8000")
    return StackFile(**{**values, **overrides})


def test_run_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RECONFIG_RUN_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert run_dir() == tmp_path / "home" / ".local" / "state" / "reconfig"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    assert run_dir() == tmp_path / "xdg" / "reconfig"
    monkeypatch.setenv("RECONFIG_RUN_DIR", str(tmp_path / "run"))
    assert run_dir() == tmp_path / "run" and stat.S_IMODE((tmp_path / "run").stat().st_mode) == 0o700


def test_write_and_load(tmp_path):
    stack = _stack()
    path = stack.write(tmp_path / "stacks" / "8000" / "stack.json")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text())["pids"] == {"launcher": os.getpid()}
    assert StackFile.read(path) == stack


def test_missing_file_says_how_to_start_one(tmp_path):
    with pytest.raises(StackNotFoundError) as error:
        StackFile.read(tmp_path / "stack.json")
    assert str(error.value) == (f"no running reconfig stack found (looked in {tmp_path / 'stack.json'}); "
                                "start one with `reconfig up`")


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"controller_address": "a"}',
                                     json.dumps({"controller_address": "a", "router_http_address": "b",
                                                 "router_grpc_address": "c", "token_file": "t",
                                                 "pids": {"x": "nope"}})])
def test_malformed_file_is_reported(tmp_path, content):
    path = tmp_path / "stack.json"
    path.write_text(content)
    with pytest.raises(StackNotFoundError, match="unreadable stack file"):
        StackFile.read(path)
