"""Helpers the `reconfig up` tests share: a run directory's environment, free ports, reconfigctl as a process."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path


def run_dir_env(tmp_path) -> dict[str, str]:
    """The environment of a stack whose run directory is tmp_path/run."""
    return {**os.environ, "RECONFIG_RUN_DIR": str(tmp_path / "run")}


def free_ports(count: int) -> list[int]:
    """Ports no program holds, below the kernel's ephemeral range: a port-0 bind anywhere (the stack's own workers make
    several) can never be handed one of them between this probe and the stack's bind (it was, once in CI)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng, ports = random.Random(), []
    while len(ports) < count:
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


def reconfigctl(env, *args: str) -> subprocess.CompletedProcess:
    """`reconfigctl ARGS` in `env` (a stack's run directory tells it where the stack is)."""
    return subprocess.run([sys.executable, "-m", "services.ctl", *args], env=env, capture_output=True,
                          text=True, timeout=120)
