"""What this process can share with others on its host: its shared-memory domain, and the network interface of an
address (gloo's, for a world whose members sit on several hosts).

Hosts are told apart by what matters for a KV or weight copy, not by their names: two processes can read each
other's POSIX shared memory when they see the same /dev/shm (one machine, one mount of it: containers that share an
IPC namespace do; network namespaces with their own /dev/shm mount, or two machines, do not).
"""

from __future__ import annotations

import fcntl
import functools
import ipaddress
import os
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


@functools.cache
def shm_domain() -> str:
    """An id every process that sees this /dev/shm shares, and no process outside it: the machine's boot id and the
    device number of the /dev/shm mount (each tmpfs mount has its own)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
    except OSError:  # not Linux: the host's name stands in for the machine
        boot = socket.gethostname()
    try:
        device = os.stat("/dev/shm").st_dev
    except OSError:
        device = 0
    return f"{boot}/{device}"


def peers_share_memory(domains: list[str], here: str | None = None) -> bool:
    """Whether every peer's shared memory is this process's (an empty domain: a peer that did not say, as before
    reconfig knew several hosts: taken as this host's)."""
    here = here or shm_domain()
    return all(domain in ("", here) for domain in domains)


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds the IPv4 `address` (None: not an IPv4 address of this
    host, or not Linux)."""
    try:
        wanted = ipaddress.IPv4Address(address)
    except ValueError:
        return None
    if wanted.is_unspecified:
        return None
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in names:
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(answer[20:24]) == str(wanted):
                return name
    return None


def address_host(address: str) -> str:
    """The host part of "host:port" (an IPv6 literal keeps its brackets off)."""
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host
