"""Helpers of the end-to-end tests over a `reconfig up` process: start it and wait until it serves, stop it, wait
for its processes to exit, and the openai client and tokenizer that check what it serves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

from tests.conftest import process_running, wait_for_stack_file, wait_until


def launch_up(args: list[str], run_dir, extra_env: dict[str, str] | None = None):
    """Start `reconfig up ARGS` (in `run_dir`) and wait until its stack file exists and its API is ready; returns
    the process, the stack file's content and the environment reconfigctl needs."""
    env = {**os.environ, "RECONFIG_RUN_DIR": str(run_dir), **(extra_env or {})}
    process = subprocess.Popen([sys.executable, "-m", "services.cli", "up", *args], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    info = json.loads(wait_for_stack_file(process, run_dir).read_text())
    wait_ready(info["router_http_address"], process=process)
    return process, info, env


def stop_up(process) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def wait_ready(base: str, timeout_s: float = 60.0, process: subprocess.Popen | None = None) -> None:
    """Wait until the router at `base` answers /ready with 200 (failing at once if `process`, the launcher, exits)."""
    def ready() -> bool:
        assert process is None or process.poll() is None, f"reconfig up exited with {process.returncode}"
        try:
            with urllib.request.urlopen(f"{base}/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    wait_until(ready, timeout_s, what=f"the router at {base} to be ready", interval_s=0.2)


def wait_for_exit(pids: list[int], what: str, timeout_s: float = 30.0) -> None:
    """Wait until none of `pids` runs (they exit on their own: no fixed delay); past `timeout_s`, fail naming the
    ones still running."""
    try:
        wait_until(lambda: not any(process_running(pid) for pid in pids), timeout_s, what=what, interval_s=0.05)
    except AssertionError as error:
        raise AssertionError(f"{error}; still running: {[pid for pid in pids if process_running(pid)]}") from None


def openai_client(info, cls=None):
    """An openai client (`cls`: openai.OpenAI by default) of the stack whose stack file holds `info`."""
    import openai

    cls = cls or openai.OpenAI
    return cls(base_url=info["router_http_address"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def tokenizer_of(checkpoint):
    from services.model.tokenizer import Tokenizer

    return Tokenizer.from_dir(checkpoint)
