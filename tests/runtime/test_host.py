"""What a process shares with others on its host: its shared-memory domain, the interface of an address, and which
KV channel a switch picks from its peers' domains."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

from services.rpc.reconfig.v1 import worker_pb2
from services.runtime.host import address_host, interface_of, peers_share_memory, shm_domain
from services.worker.channel import channel_kind


def test_processes_that_see_one_dev_shm_share_a_domain():
    here = shm_domain()
    other = subprocess.run([sys.executable, "-c", "from services.runtime.host import shm_domain; print(shm_domain())"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert other == here
    assert peers_share_memory([here, "", here])  # "": a peer that did not say (taken as this host's)
    assert not peers_share_memory([here, "another-boot/27"])


def test_the_interface_of_an_address():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") is None  # TEST-NET-1: no interface of this host holds it
    assert interface_of("0.0.0.0") is None and interface_of("not-an-ip") is None
    assert address_host("10.0.0.2:50100") == "10.0.0.2" and address_host("[::1]:5") == "::1"


def _peers(*domains: str) -> dict[int, worker_pb2.PeerPool]:
    return {rank: worker_pb2.PeerPool(hostname=socket.gethostname(), shm_domain=domain)
            for rank, domain in enumerate(domains)}


@pytest.mark.parametrize("domains, kind", [
    (("here", "here", "here"), "shm"),
    (("here", "", "here"), "shm"),
    (("here", "here", "elsewhere"), "dist"),  # one worker on another host: every rank moves KV over the world
])
def test_cpu_workers_read_each_others_pools_only_on_one_host(domains, kind):
    peers = _peers(*(shm_domain() if d == "here" else d for d in domains))
    assert channel_kind(peers, len(peers), torch.device("cpu")) == kind
    assert channel_kind(peers, len(peers), torch.device("cpu"), kv_channel="dist") == "dist"  # forced
