"""`reconfig up` as a subprocess on loopback, for the benches that drive it over HTTP (serve, load, evaluate).

Stdlib only at import time, so a bench can import it before its heavy dependencies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


class Stack:
    """A `reconfig up` subprocess with ephemeral ports and its own run directory; stopped with SIGTERM on exit."""

    def __init__(self, model: str, topology: str | None = None, num_workers: int | None = None,
                 kv_cache_mb: int | None = None, startup_timeout: float = 180.0, extra_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        """`extra_args` are appended to the `reconfig up` command; `env` overrides variables of its environment."""
        self._run_dir = tempfile.TemporaryDirectory(prefix="reconfig-bench-")
        self._log = open(Path(self._run_dir.name) / "up.log", "w+")
        command = [sys.executable, "-m", "services.cli", "up", "--model", model, "--http-port", "0",
                   "--grpc-port", "0", "--controller-port", "0", "--controller-metrics-port", "0"]
        for flag, value in (("--topology", topology), ("--workers", num_workers), ("--kv-cache-mb", kv_cache_mb)):
            if value is not None:
                command += [flag, str(value)]
        command += list(extra_args)
        environment = {**os.environ, "RECONFIG_RUN_DIR": self._run_dir.name, **(env or {})}
        self.process = subprocess.Popen(command, cwd=REPO_ROOT, env=environment, stdout=self._log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.base_url = self._wait_ready(startup_timeout)
        self.info = json.loads(self._stack_file().read_text())

    def _stack_file(self) -> Path | None:
        """stacks/NAME/stack.json in its run directory, once the stack is up."""
        return next(Path(self._run_dir.name).glob("stacks/*/stack.json"), None)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        base_url = None
        while time.monotonic() < deadline and self.process.poll() is None:
            if base_url is None and (stack_file := self._stack_file()) is not None:
                base_url = json.loads(stack_file.read_text())["router_http_address"]
            if base_url is not None:
                try:
                    with urllib.request.urlopen(f"{base_url}/ready", timeout=2) as response:
                        if response.status == 200:
                            return base_url
                except OSError:
                    pass
            time.sleep(0.2)
        tail = self.log_tail()
        self.close()
        raise RuntimeError(f"reconfig up did not become ready:\n{tail}")

    def log_tail(self, num_chars: int = 3000) -> str:
        self._log.flush()
        return (Path(self._run_dir.name) / "up.log").read_text()[-num_chars:]

    def scrape(self) -> dict:
        """The router's reconfig:* counters and latency sums from /metrics."""
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=5) as response:
            text = response.read().decode()
        wanted = ("num_preemptions", "time_to_first_token_seconds_sum", "time_to_first_token_seconds_count",
                  "generation_tokens", "prompt_tokens")
        values = {}
        for line in text.splitlines():
            name, value = line.partition("{")[0].partition(" ")[0], line.rsplit(" ", 1)[-1]
            if any(name.startswith(f"reconfig:{w}") for w in wanted):
                values[name.removeprefix("reconfig:")] = float(value)
        return values

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:  # the launcher hung: end its whole session (its children)
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        if not self._log.closed:
            self._log.close()
        self._run_dir.cleanup()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
