"""Pacing of background work beside the steps (a switch's staging and KV pre-copy).

Nice 19 gives the staging thread the cores only when the steps leave them, but every slice it does get delays a
step, and a tensor-parallel step waits for its slowest rank at every all-reduce: next to a TP3 decode on 2 cores
the staging windows measured +47% TPOT. A duty cycle spreads that work out: after each piece (a tensor copied, a
weight packed, a KV layer copied) the thread rests so that work / (work + rest) stays at `duty`. Sleeping here
limits a rate; it synchronises nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def check_duty(duty: float, name: str = "staging duty") -> None:
    """ValueError unless 0 < duty <= 1."""
    if not (math.isfinite(duty) and 0 < duty <= 1):
        raise ValueError(f"{name} must be in (0, 1], not {duty}")


class Pacer:
    """Keeps a thread's work to `duty` of its wall time, piece by piece (duty 1: no rest)."""

    def __init__(self, duty: float = 1.0, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        check_duty(duty)
        self.duty = duty
        self._sleep, self._clock = sleep, clock
        self.worked_s = self.rested_s = 0.0

    @contextmanager
    def piece(self) -> Iterator[None]:
        """One piece of work; the rest it earns follows it."""
        started = self._clock()
        try:
            yield
        finally:
            self.rest(self._clock() - started)

    def rest(self, worked_s: float) -> None:
        """After `worked_s` of work: rest worked_s * (1 - duty) / duty."""
        self.worked_s += worked_s
        if self.duty < 1 and worked_s > 0:
            seconds = worked_s * (1 - self.duty) / self.duty
            self.rested_s += seconds
            self._sleep(seconds)

    @classmethod
    def of_request(cls, duty: float) -> Pacer:
        """The pacer of a StageSwitch or PreCopyKV request's duty (0, the field's default: unpaced)."""
        return cls(duty or 1.0)


UNPACED = Pacer()
