"""Hosts as Linux namespaces, for testing what crosses a network without a cluster (tests/multihost and
bench/multihost.py).

Each host is a network namespace (`ip netns`) with its own hostname (a UTS namespace) and its own /dev/shm (a mount
namespace with a fresh tmpfs there), all on one link: a bridge in the first host's namespace and a veth pair from
it to every other host. Addresses exist only inside the namespaces made here (10.77.0.0/24 by default: nothing
outside sees it); `close()` kills every process left in them and deletes them. A holder process keeps each host's UTS and mount
namespaces; a process runs "on" a host by entering its holder's namespaces (nsenter), so every process of a host
sees that host's /dev/shm and name, and the network of its netns. Needs root and iproute2; `unavailable()` says why
not (the tests skip saying so).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from dataclasses import dataclass, field


def unavailable() -> str:
    """Why namespace hosts cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "namespace hosts need root (ip netns, unshare, mount)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"namespace hosts need `{tool}` (iproute2, util-linux)"
    probe = f"rcprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


@dataclass
class Host:
    """One namespace host: its netns, address, hostname, and the holder of its UTS and mount namespaces."""

    name: str          # its hostname
    netns: str
    address: str
    interface: str
    holder: subprocess.Popen | None = None
    processes: list[subprocess.Popen] = field(default_factory=list)

    def command(self, argv: list[str], cwd: str | os.PathLike | None = None) -> list[str]:
        """`argv` run on this host (in its network, UTS and mount namespaces), in `cwd` (entering a mount namespace
        leaves the caller's directory behind: by default, this process's)."""
        if self.holder is None:
            raise RuntimeError(f"host {self.name} is not up")
        return ["nsenter", "-t", str(self.holder.pid), "--net", "--uts", "--mount", f"--wd={cwd or os.getcwd()}",
                "--", *argv]

    def popen(self, argv: list[str], cwd: str | os.PathLike | None = None, **kwargs) -> subprocess.Popen:
        process = subprocess.Popen(self.command(argv, cwd), **kwargs)
        self.processes.append(process)
        return process

    def run(self, argv: list[str], cwd: str | os.PathLike | None = None, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv, cwd), **kwargs)

    def pids(self) -> list[int]:
        """Every process in this host's network namespace (its holder too)."""
        listed = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True)
        return [int(pid) for pid in listed.stdout.split()]

    def kill_all(self, keep_holder: bool = False) -> list[int]:
        """SIGKILL every process of this host (the loss of the whole host); returns their pids."""
        holder = self.holder.pid if self.holder is not None else None
        killed = []
        for pid in self.pids():
            if keep_holder and pid == holder:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        return killed


class NamespaceHosts:
    """`count` hosts, the first linked to each of the others by a veth pair (use as a context manager)."""

    def __init__(self, count: int, prefix: str = "", subnet: str = "10.77.0", shm_mb: int = 1024) -> None:
        if not 2 <= count <= 9:
            raise ValueError(f"2..9 hosts, not {count}")
        tag = prefix or f"rc{uuid.uuid4().hex[:5]}"
        self.hosts = [Host(name=f"{tag}-host{i}", netns=f"{tag}-h{i}", address=f"{subnet}.{i + 1}",
                           interface=f"{tag}v{i}") for i in range(count)]
        self.subnet, self.shm_mb = subnet, shm_mb
        self._hosts_file: tempfile._TemporaryFileWrapper | None = None

    def __enter__(self) -> NamespaceHosts:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def start(self) -> None:
        first = self.hosts[0]
        for host in self.hosts:
            _ip("netns", "add", host.netns)
            _ip("-n", host.netns, "link", "set", "lo", "up")
        # One segment: a bridge in the first host's namespace (holding its address), a veth pair to each other host.
        _ip("-n", first.netns, "link", "add", first.interface, "type", "bridge")
        _ip("-n", first.netns, "addr", "add", f"{first.address}/24", "dev", first.interface)
        _ip("-n", first.netns, "link", "set", first.interface, "up")
        for host in self.hosts[1:]:
            near = f"{host.interface}p"
            _ip("link", "add", near, "netns", first.netns, "type", "veth", "peer", "name", host.interface,
                "netns", host.netns)
            _ip("-n", first.netns, "link", "set", near, "master", first.interface)
            _ip("-n", first.netns, "link", "set", near, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.netns, "link", "set", host.interface, "up")
        # Every host knows the others by name (its own /etc/hosts, bind-mounted in its mount namespace).
        self._hosts_file = tempfile.NamedTemporaryFile("w", prefix="reconfig-hosts-", suffix=".txt")
        self._hosts_file.write("127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in self.hosts))
        self._hosts_file.flush()
        for host in self.hosts:
            # The holder: a shell that names the host, mounts its own /dev/shm and hosts file and then waits on its
            # stdin (it ends when this process does, even killed).
            script = (f"hostname {host.name} && mount -t tmpfs -o size={self.shm_mb}m,mode=1777 tmpfs /dev/shm "
                      f"&& mount --bind {self._hosts_file.name} /etc/hosts && echo up && exec cat >/dev/null")
            host.holder = subprocess.Popen(
                ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--mount", "--propagation", "private",
                 "sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            line = host.holder.stdout.readline().strip()  # blocks until the holder is set up (or fails)
            if line != "up":
                raise RuntimeError(f"host {host.name}: its namespaces could not be set up "
                                   f"(exit code {host.holder.wait(5)})")

    def close(self) -> None:
        """Kill every process on every host, then delete the namespaces (and with them their links)."""
        for host in self.hosts:
            for process in host.processes:
                if process.poll() is None:
                    process.kill()
            host.kill_all()
            for process in [*host.processes, *([host.holder] if host.holder else [])]:
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    pass
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        if self._hosts_file is not None:
            self._hosts_file.close()


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
