"""Bootstrap shared by every service process: logging, never outliving the launcher, the event loop."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Coroutine
from multiprocessing.connection import Connection

import structlog

from services.logs import configure_logging

log = structlog.get_logger(__name__)
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None) -> None:
    """SIGTERM ourselves when our parent process dies, and when the launcher pid disappears (no orphans)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if parent_pid is None:
        return

    def watch() -> None:
        while True:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.5)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def run_service(name: str, main: Coroutine, ready: Connection | None, parent_pid: int | None = None) -> None:
    """Run a service's main coroutine on uvloop; a startup failure is reported over `ready` and exits 1."""
    configure_logging(name)
    parent = mp.parent_process()
    die_with_parent(parent_pid if parent_pid is not None else (parent.pid if parent else None))
    try:
        try:
            import uvloop

            uvloop.run(main)
        except ImportError:
            asyncio.run(main)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise SystemExit(0) from None
        log.exception(f"{name}.failed")
        if ready is not None:
            try:
                ready.send({"error": f"{type(exc).__name__}: {exc}"})
            except (OSError, ValueError):
                pass
        raise SystemExit(1) from exc


def settle_heap() -> None:
    """Once a service has loaded what it keeps for its life (model, tokenizer, gRPC stubs): collect, then move every
    object left into the garbage collector's permanent generation, so that no later full collection walks them
    (one such walk took 157 ms in the router mid-stream: a stall of every request). Not in workers: a frozen
    object in a reference cycle is never collected, and a switch drops the old shard's tensors."""
    gc.collect()
    gc.freeze()
