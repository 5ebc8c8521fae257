"""Starting and stopping instances' processes at runtime: the front router asks the process that owns them
(`reconfig up --instances N`, services/launch/instances.py) over a pipe, one request at a time.

Request: {"id": n, "op": "start", "topology": "tp1pp2"} or {"id": n, "op": "stop", "name": "i2"}.
Reply: {"id": n, "name": ..., "address": ...} (start), {"id": n} (stop), or {"id": n, "error": "..."}.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Protocol

from services.topology import Topology

START_TIMEOUT_S = 300.0  # workers load their shards and build their groups; a cold host can be slow
STOP_TIMEOUT_S = 60.0


class LaunchError(RuntimeError):
    """The launcher could not start or stop the instance (its message says why)."""


@dataclass(frozen=True, slots=True)
class Launched:
    name: str
    address: str  # the instance router's gRPC address


class InstanceLauncher(Protocol):
    async def start(self, topology: str) -> Launched:
        """Start an instance of that layout (empty: the stack's first layout); LaunchError if it cannot."""
        ...

    async def stop(self, name: str) -> None:
        """Stop the processes of an instance this launcher started; LaunchError if it cannot."""
        ...


class PipeLauncher:
    """InstanceLauncher over the launcher process's end of a pipe (one request in flight; a reply that comes after
    its request timed out is skipped by id)."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)

    async def start(self, topology: str) -> Launched:
        reply = await self._ask({"op": "start", "topology": topology}, START_TIMEOUT_S)
        return Launched(reply["name"], reply["address"])

    async def stop(self, name: str) -> None:
        await self._ask({"op": "stop", "name": name}, STOP_TIMEOUT_S)

    async def _ask(self, message: dict, timeout_s: float) -> dict:
        async with self._lock:
            message = {"id": next(self._ids), **message}
            loop = asyncio.get_running_loop()
            answer = loop.create_future()

            def round_trip() -> None:  # a daemon thread: a front shutting down never waits for the launcher
                try:
                    result, error = self._round_trip(message, timeout_s), None
                except LaunchError as exc:
                    result, error = None, exc
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
                    loop.call_soon_threadsafe(_settle, answer, result, error)

            threading.Thread(target=round_trip, name="front-launcher", daemon=True).start()
            return await answer

    def _round_trip(self, message: dict, timeout_s: float) -> dict:
        try:
            self._connection.send(message)
            while self._connection.poll(timeout_s):
                reply = self._connection.recv()
                if reply.get("id") == message["id"]:
                    if "error" in reply:
                        raise LaunchError(reply["error"])
                    return reply
        except (EOFError, OSError) as exc:
            raise LaunchError(f"the launcher is gone ({type(exc).__name__})") from None
        raise LaunchError(f"the launcher did not answer {message['op']} within {timeout_s:.0f} s")


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if not future.done():  # its caller may have been cancelled meanwhile
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


class Launches:
    """Instances whose processes start and stop at runtime: `start` launches one and serves it (on standby), `stop`
    stops serving a drained, empty one and then its processes."""

    def __init__(self, engine, launcher: InstanceLauncher, keep: tuple[str, ...] = ()) -> None:
        self.engine = engine        # the FrontEngine
        self.launcher = launcher
        self.keep = set(keep)       # instances whose processes others need (the one hosting the weight store)

    async def start(self, topology: str = ""):
        """The new instance (served, on standby). LaunchError: it did not start; ValueError: a bad layout, or it
        cannot serve this front's requests (its processes are stopped again)."""
        if topology:
            Topology.parse(topology)  # ValueError before anything starts
        launched = await self.launcher.start(topology)
        try:
            return await self.engine.add_instance(launched.address, launched.name)
        except BaseException:
            with contextlib.suppress(LaunchError):
                await self.launcher.stop(launched.name)
            raise

    async def stop(self, name: str) -> None:
        """KeyError: no such instance; MoveRefused: not drained, requests run there, or its processes are kept;
        LaunchError: it is not served any more, but its processes did not stop."""
        from services.front.instance_admin import MoveRefused

        self.engine.instance(name)  # KeyError first
        if name in self.keep:
            raise MoveRefused(f"{name} hosts the weight store every instance reads: drain it instead")
        await self.engine.remove_instance(name)
        await self.launcher.stop(name)
