"""The step loop's wakeup (services.router.engine)."""

from __future__ import annotations

import asyncio


class Doorbell:
    """The step loop's wakeup: set() by whoever gives it work; the loop waits for it, or for it or a step, on one
    plain future (an asyncio.Event waited beside a step costs a task per loop turn, and its cancellation a turn
    more: tens of microseconds a step)."""

    __slots__ = ("_set", "_waiter")

    def __init__(self) -> None:
        self._set = False
        self._waiter: asyncio.Future | None = None

    def set(self) -> None:
        self._set = True
        self._ring()

    def clear(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    async def wait(self, or_done: asyncio.Future | None = None) -> None:
        """Until set() is called, or `or_done` completes."""
        if self._set or (or_done is not None and or_done.done()):
            return
        self._waiter = asyncio.get_running_loop().create_future()
        if or_done is not None:
            or_done.add_done_callback(self._ring)
        try:
            await self._waiter
        finally:
            self._waiter = None
            if or_done is not None:
                or_done.remove_done_callback(self._ring)

    def _ring(self, _: object = None) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
