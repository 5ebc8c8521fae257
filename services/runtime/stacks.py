"""The running stacks of this user, each under a name of its own: `run_dir()/stacks/NAME/` holds its lock (the
launcher's claim: pid and ports), its stack file, its control-plane token and its controller state.

A launcher claims its name and ports before it loads anything, and holds an exclusive `flock` on its lock file for
as long as it lives: the kernel drops the lock when the process ends however it ends, so a live stack is one whose
lock is held, and a directory whose lock is free is what a killed launcher left (cleaned by the next claim). Claims
and probes run under one registry lock (exclusive to claim, shared to look), so that a look never makes a starting
launcher think its own name is taken. Stdlib only: `reconfigctl` imports it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from services.runtime.stackfile import STACK_FILE_NAME, StackFile, StackNotFoundError, run_dir

STACKS_DIR = "stacks"
LOCK_FILE = "lock"
TOKEN_FILE = "token"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class StackConflict(RuntimeError):
    """A stack cannot start here: its name or one of its ports is taken (the message says by what)."""


def check_name(name: str) -> str:
    """A stack name: letters, digits, '.', '_' and '-', at most 64 characters, not starting with a symbol."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"invalid stack name {name!r}: use letters, digits, '.', '_' or '-' (at most 64)")
    return name


def stacks_dir() -> Path:
    return run_dir() / STACKS_DIR


@dataclass(frozen=True, slots=True)
class Claim:
    """What a launcher writes into its lock file once it holds it: who it is and where it will listen."""

    name: str
    pid: int
    host: str
    ports: dict[str, int] = field(default_factory=dict)  # flag ("http", "controller", ...) -> port; 0s left out
    started_at: float = 0.0


@dataclass(frozen=True, slots=True)
class RunningStack:
    """A stack whose launcher holds its lock: its claim, and its stack file once it is up (None while starting)."""

    claim: Claim
    directory: Path
    stack: StackFile | None

    @property
    def name(self) -> str:
        return self.claim.name

    def ports(self) -> set[int]:
        """Every port it claimed or listens on (an address of the stack file, ports chosen by the OS included)."""
        ports = set(self.claim.ports.values())
        if self.stack is not None:
            addresses = [self.stack.controller_address, self.stack.router_http_address,
                         self.stack.router_grpc_address, self.stack.front_grpc_address]
            ports.update(int(port) for address in addresses if (port := address.rpartition(":")[2]).isdigit())
        return ports

    def describe(self) -> str:
        """`launcher pid N, http :8000` (the first port it has)."""
        http = self.claim.ports.get("http")
        if http is None and self.stack is not None:
            http = self.stack.router_http_address.rpartition(":")[2]
        return f"launcher pid {self.claim.pid}" + (f", http :{http}" if http else "")

    def matches(self, selector: str) -> bool:
        """Whether `selector` names this stack: its name, or one of its ports."""
        return selector == self.name or (selector.isdigit() and int(selector) in self.ports())


@contextmanager
def _registry_lock(kind: int) -> Iterator[None]:
    directory = stacks_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(directory / ".registry", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, kind)
        yield
    finally:
        os.close(fd)  # releases the lock


def _is_held(lock: Path) -> bool:
    """Whether a launcher holds this lock file (probed with a shared lock, released at once)."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _read_claim(directory: Path) -> Claim | None:
    try:
        data = json.loads((directory / LOCK_FILE).read_text())
        return Claim(**{k: v for k, v in data.items() if k in Claim.__dataclass_fields__})
    except (OSError, ValueError, TypeError):
        return None  # being written, or not ours: a claim is written right after its lock is taken


def _scan() -> tuple[list[RunningStack], list[Path]]:
    """(the live stacks, the directories killed launchers left). Call under the registry lock."""
    live, stale = [], []
    root = stacks_dir()
    for directory in sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else ():
        if not _is_held(directory / LOCK_FILE):
            stale.append(directory)
            continue
        claim = _read_claim(directory) or Claim(name=directory.name, pid=0, host="")
        try:
            stack = StackFile.read(directory / STACK_FILE_NAME)
        except StackNotFoundError:
            stack = None
        live.append(RunningStack(claim, directory, stack))
    return live, stale


def list_stacks() -> list[RunningStack]:
    """The stacks running now, by name."""
    with _registry_lock(fcntl.LOCK_SH):
        return _scan()[0]


def _choices(stacks: list[RunningStack]) -> str:
    return "; ".join(f"{s.name} ({s.describe()})" for s in stacks)


def select_stack(selector: str | None = None) -> RunningStack:
    """The stack `selector` names (a name or a port), or the only one running; StackNotFoundError says why not
    and lists the running ones."""
    stacks = list_stacks()
    where = stacks_dir()
    if not stacks:
        raise StackNotFoundError(f"no running reconfig stack found (looked in {where}); start one with `reconfig up`")
    if selector:
        chosen = [s for s in stacks if s.matches(selector)]
        if not chosen:
            raise StackNotFoundError(f"no running stack is named {selector!r} or listens on that port; "
                                     f"running: {_choices(stacks)}")
        return chosen[0]
    if len(stacks) > 1:
        raise StackNotFoundError(f"{len(stacks)} stacks are running: {_choices(stacks)}; choose one with "
                                 "--stack NAME|PORT (or $RECONFIG_STACK)")
    return stacks[0]


def _reserve(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, not listening, that keeps the port for the stack until its service listens
    (OSError if it cannot be listened on). SO_REUSEADDR as the servers set it: a port a stopped stack left in
    TIME_WAIT counts as free, and the stack's own server binds and listens beside it (Linux lets two SO_REUSEADDR
    sockets share a port while neither listens; a second listener is refused). The point is the kernel's choice of
    ephemeral ports: it never gives an outgoing connection a port some socket is bound to. Without this, a port
    checked free could be handed to a connection of the stack's own processes (a worker dialling the weight store,
    say) before the service that is to listen on it starts: `reconfig up` then failed on a port it had found free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    return sock


def port_taken_message(host: str, port: int, flag: str, error: OSError) -> str:
    """The refusal for a port another program holds, naming the address and the flag that moves it."""
    why = "another program listens on it" if error.errno == errno.EADDRINUSE else error.strerror
    return f"cannot listen on {host}:{port} (--{flag.replace('_', '-')}-port): {why} — choose another port"


class StackClaim:
    """A launcher's hold on its name and ports, from before anything loads until its stack has stopped: the owner
    of the stack's directory, and the only one to remove what is in it."""

    def __init__(self, claim: Claim, directory: Path, fd: int, reserved: Iterable[socket.socket] = ()) -> None:
        self.claim, self.directory, self._fd = claim, directory, fd
        self._reserved = list(reserved)  # the ports' placeholders (_reserve), held as long as the claim

    @classmethod
    def take(cls, name: str, host: str, ports: dict[str, int]) -> StackClaim:
        """Claim `name` and `ports` on `host`: StackConflict when a running stack has the name or one of the ports
        ("a stack is running: launcher pid N, http :8000 — ..."), or another program holds one of the ports."""
        check_name(name)
        wanted = {flag: port for flag, port in ports.items() if port}
        with _registry_lock(fcntl.LOCK_EX):
            live, stale = _scan()
            for stack in live:
                clash = sorted(set(wanted.values()) & stack.ports())
                if stack.name == name or clash:
                    what = f"port {', '.join(map(str, clash))}" if clash else f"the name {name!r}"
                    raise StackConflict(f"a stack is running: {stack.describe()} (stack {stack.name!r}, holding "
                                        f"{what}) — stop it or choose other ports (and --name)")
            reserved: list[socket.socket] = []
            fd = None
            try:
                for flag, port in wanted.items():
                    try:
                        reserved.append(_reserve(host, port))
                    except OSError as error:
                        raise StackConflict(port_taken_message(host, port, flag, error)) from None
                for directory in stale:
                    shutil.rmtree(directory, ignore_errors=True)
                directory = stacks_dir() / name
                directory.mkdir(mode=0o700, exist_ok=True)
                fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: its directory was stale or new
                claim = Claim(name=name, pid=os.getpid(), host=host, ports=wanted, started_at=time.time())
                os.ftruncate(fd, 0)
                os.write(fd, json.dumps(asdict(claim)).encode())
            except BaseException:  # nothing claimed: the ports go back now, not when the sockets are collected
                if fd is not None:
                    os.close(fd)
                for sock in reserved:
                    sock.close()
                raise
        return cls(claim, directory, fd, reserved)

    @property
    def token_file(self) -> Path:
        return self.directory / TOKEN_FILE

    @property
    def stack_file(self) -> Path:
        return self.directory / STACK_FILE_NAME

    def state_file(self, suffix: str = "") -> Path:
        """The controller's state file (one per instance of a fronted stack: `suffix` is its name)."""
        return self.directory / (f"controller-state-{suffix}.json" if suffix else "controller-state.json")

    def __enter__(self) -> StackClaim:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def release(self) -> None:
        """Remove the stack's directory and drop the lock (the last thing the launcher does; once)."""
        if self._fd < 0:
            return
        shutil.rmtree(self.directory, ignore_errors=True)
        for sock in self._reserved:
            sock.close()
        self._reserved.clear()
        os.close(self._fd)
        self._fd = -1
