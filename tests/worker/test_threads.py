"""Torch threads per worker: its share of the usable cores while active, one on standby."""

from __future__ import annotations

import pytest

from services.worker.config import WorkerConfig
from services.worker.threads import threads_per_worker, usable_cores


@pytest.mark.parametrize("num_cores,num_active,is_active,expected", [
    (2, 1, True, 2),    # tp1pp1 on a 2-core machine: both cores
    (2, 4, True, 1),    # more active workers than cores: never 0
    (16, 4, True, 4),
    (16, 3, True, 5),   # the remainder stays free (the router, gRPC)
    (16, 1, False, 1),  # standby: computes nothing
    (1, 1, True, 1),
])
def test_threads_per_worker(num_cores, num_active, is_active, expected):
    assert threads_per_worker(num_cores, num_active, is_active) == expected


def test_usable_cores_and_the_override():
    assert usable_cores() >= 1
    base = dict(rank=0, world_size=1, store_host="127.0.0.1", store_port=1, weightstore_address="x", topology="tp1pp1")
    assert WorkerConfig(**base).num_threads is None  # the default: cores // active workers
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        WorkerConfig(**base, num_threads=0)
