"""What every flavour of `reconfig up` (one instance, or several behind a front router) does around its stack: the
claim of its name and ports (before anything loads), the control-plane token file, Ctrl-C/SIGTERM turned into
StopRequested while the stack runs, the stack file, and on the way out (further signals ignored) the stack's own
stop, then its files — only its own: they live in the directory its claim holds."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable

from services.launch.cluster import ClusterError
from services.rpc.auth import generate_token, write_token_file
from services.runtime.stackfile import StackFile
from services.runtime.stacks import StackClaim


class StopRequested(Exception):
    """Ctrl-C or SIGTERM reached the launcher (raise_stop is its signal handler)."""


def raise_stop(signum, frame) -> None:
    raise StopRequested(signal.Signals(signum).name)


class StackSession:
    """One run of a stack: its claim (taken and released by the caller), its token (made now, written when it
    runs) and stack file (`publish`)."""

    def __init__(self, claim: StackClaim, token: str | None = None) -> None:
        self.claim = claim
        self.name = claim.claim.name
        self.token = token or generate_token()  # given: the operator's (--token-file), shared with other nodes
        self.token_file = claim.token_file
        self.stack_file: StackFile | None = None

    def publish(self, stack_file: StackFile) -> StackFile:
        """Write the stack file (again, when it changed); removed with the claim's directory on the way out."""
        stack_file.write(self.claim.stack_file)
        self.stack_file = stack_file
        return stack_file

    def run(self, serve: Callable[[], int], stop: Callable[[], None]) -> int:
        """`serve()` (start and supervise; its exit code), then `stop()` however it ended. 0 after Ctrl-C/SIGTERM,
        1 when a process could not start."""
        write_token_file(self.token_file, self.token)
        previous = {sig: signal.signal(sig, raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = _serve_until_stopped(serve)
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the cleanup
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        print(f"reconfig up: stack {self.name!r} stopped" + (f" (exit code {code})" if code else ""),
              file=sys.stderr, flush=True)
        return code


def _serve_until_stopped(serve: Callable[[], int]) -> int:
    try:
        return serve()
    except StopRequested as stop_signal:
        print(f"reconfig up: {stop_signal} received; stopping the stack", file=sys.stderr, flush=True)
        return 0
    except ClusterError as exc:
        print(f"reconfig up: {exc}", file=sys.stderr, flush=True)
        return 1
