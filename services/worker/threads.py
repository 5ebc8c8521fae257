"""How many torch threads a worker computes with: the cores it can use, shared by the live topology's active
workers (a standby computes nothing and keeps one).

torch.set_num_threads sets OpenMP's thread count of the *calling* thread (a thread that has already run an op
keeps its own), so the count is applied on the model thread, where steps run.
"""

from __future__ import annotations

import os

import torch


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask: taskset, cgroup cpusets), not the host's count."""
    return len(os.sched_getaffinity(0))


def threads_per_worker(num_cores: int, num_active_workers: int, is_active: bool) -> int:
    """Torch threads of one worker: its share of the cores when active, 1 on standby; at least 1."""
    if not is_active:
        return 1
    return max(1, num_cores // max(1, num_active_workers))


def set_threads(num_threads: int) -> None:
    """Apply on the calling thread (the model thread) and as the default of threads that run their first op."""
    torch.set_num_threads(num_threads)
