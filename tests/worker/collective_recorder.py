"""Records every torch.distributed collective a worker process calls: which group kind, which tensor devices, and
which code asked for it. On CPU every group is gloo, so only the group's kind (from its description, set by
ParallelState) tells an agreement sent on the device group from one sent on the CPU group."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# The collectives the worker may call through `torch.distributed`. isend/irecv stay unwrapped: P2POp checks its op
# against the originals; the worker batches them through batch_isend_irecv, recorded op by op.
RECORDED = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "barrier", "broadcast",
            "broadcast_object_list", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
            "send", "recv", "batch_isend_irecv", "gather", "scatter", "reduce", "monitored_barrier")
POINT_TO_POINT = ("send", "recv", "batch_isend_irecv")


def group_kind(group: dist.ProcessGroup | None) -> str:
    """'cpu' or 'device' from the group's description; the default group is the world's device group; 'implicit'
    when a call names no group at all (it falls back to the default one)."""
    if group is None:
        return "implicit"
    desc = group.group_desc
    if desc == "default_pg":
        return "device"
    return desc.split("/", 1)[0] if "/" in desc else f"unknown:{desc}"


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _caller() -> str:
    """The first frame of the project's code outside parallel.py: who meant the collective (`module:qualname`)."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("services.") and module != "services.worker.parallel":
            return f"{module}:{frame.f_code.co_qualname}"
        frame = frame.f_back
    return "unknown"


class Recorder:
    """Appends one JSON line per distinct (api, group kind, backend, tensor device types, caller) to `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: set[tuple] = set()

    def record(self, api: str, group, tensors: list[torch.Tensor], caller: str) -> None:
        backend = dist.get_backend(group)  # the default group's when None
        key = (api, group_kind(group), backend, tuple(sorted({t.device.type for t in tensors})), caller)
        if key in self.seen:
            return
        self.seen.add(key)
        with self.path.open("a") as file:  # each line at once: a worker may be stopped with SIGTERM or killed
            file.write(json.dumps(dict(zip(("api", "kind", "backend", "devices", "caller"), key))) + "\n")

    def wrap(self, api: str):
        original = getattr(dist, api)

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            if api == "batch_isend_irecv":
                for op in args[0]:
                    self.record(api, op.group, [op.tensor], _caller())
            else:
                self.record(api, kwargs.get("group"), _tensors(list(args) + list(kwargs.values())), _caller())
            return original(*args, **kwargs)

        return recorded

    def install(self) -> None:
        for api in RECORDED:
            if hasattr(dist, api):
                setattr(dist, api, self.wrap(api))


def run_recorded_worker(directory: str, config, ready) -> None:
    """Process target in place of the launcher's: record this worker's collectives into `directory`, then serve."""
    from services.worker.main import run_worker

    Recorder(Path(directory) / f"rank{config.rank}-{os.getpid()}.jsonl").install()
    run_worker(config, ready)


def read_records(directory: Path) -> list[dict]:
    """Every record of every worker."""
    records = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            records.append({**json.loads(line), "worker": path.stem})
    return records
