"""The stack file: where `reconfig up` tells `reconfigctl` (same user) how to reach a running stack (one per stack,
in its directory: services/runtime/stacks.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

STACK_FILE_NAME = "stack.json"


class StackNotFoundError(RuntimeError):
    """No running stack: no stack file, or an unreadable one."""


def _run_dir_path() -> Path:
    if configured := os.environ.get("RECONFIG_RUN_DIR"):
        return Path(configured)
    if runtime_dir := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(runtime_dir) / "reconfig"
    return Path.home() / ".local" / "state" / "reconfig"


def run_dir() -> Path:
    """Where this user's stacks keep their files, each stack in stacks/NAME/ (created 0700): $RECONFIG_RUN_DIR,
    else $XDG_RUNTIME_DIR/reconfig, else ~/.local/state/reconfig."""
    path = _run_dir_path()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def _not_found(path: Path, why: str = "") -> StackNotFoundError:
    where = f"{path}: {why}" if why else str(path)
    return StackNotFoundError(f"no running reconfig stack found (looked in {where}); start one with `reconfig up`")


@dataclass(frozen=True, slots=True)
class StackFile:
    """Addresses, credentials and processes of a running stack, saved as JSON (mode 0600)."""

    controller_address: str                # host:port of the Controller gRPC service
    router_http_address: str               # host:port of the OpenAI HTTP API
    router_grpc_address: str               # host:port of the Router gRPC service
    token_file: str                        # file holding the control-plane token (0600)
    pids: dict[str, int] = field(default_factory=dict)  # process name ("launcher", "worker-0", ...) → pid
    model: str = ""
    topology: str = ""
    started_at: float = 0.0                # unix seconds
    replacements: list[str] = field(default_factory=list)  # joining workers started for lost ones (add-worker)
    front_grpc_address: str = ""           # `reconfig up --instances N`: the front router's Front gRPC service
    instances: list[dict] = field(default_factory=list)  # ... and each instance: name, router, controller, topology
    name: str = ""                         # the stack's name (`reconfig up --name`; reconfigctl --stack)

    def write(self, path: Path) -> Path:
        """Save atomically with mode 0600 (its directory 0700); returns the path."""
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # created 0600
        try:
            with os.fdopen(fd, "w") as file:
                json.dump(dataclasses.asdict(self), file, indent=2)
                file.write("\n")
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
        return path

    @classmethod
    def read(cls, path: Path) -> StackFile:
        """Parse the file whatever the state of its processes; StackNotFoundError when missing or malformed."""
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            names = {f.name for f in dataclasses.fields(cls)}
            stack = cls(**{k: v for k, v in data.items() if k in names})
        except FileNotFoundError:
            raise _not_found(path) from None
        except (OSError, ValueError, TypeError) as exc:
            raise _not_found(path, f"unreadable stack file ({exc})") from exc
        if not isinstance(stack.pids, dict) or not all(isinstance(p, int) for p in stack.pids.values()):
            raise _not_found(path, "unreadable stack file (pids must map names to ints)")
        return stack
