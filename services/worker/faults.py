"""Fault injection for tests: off unless RECONFIG_FAULTS is set.

RECONFIG_FAULTS is a ';'-separated list of rules `point:key=value:...`, e.g.
    migrate:rank=2:layer=1:action=raise     rank 2 fails while migrating layer 1 (the switch rolls back)
    apply:rank=0:action=crash               rank 0 dies (kill -9 of itself) as ApplySwitch starts
    rpc:method=ApplySwitch:rank=1:delay=3   rank 1 sleeps 3 s before serving ApplySwitch
    precopy:rank=1:layer=2:once=1          rank 1 fails pre-copying layer 2 (a round while serving: no freeze yet)
    forward:rank=1:slow=3                  rank 1's model work takes 3x as long (a slower device)
Points: apply (ApplySwitch, before any KV moves), migrate (per layer; with a pre-copy, the delta's layers at the
cutover), precopy (per layer of a pre-copy round), rpc (any worker RPC, by method), forward (a step's layers and
its lm_head, `slowdown` only).
Actions: raise (an exception the switch handles), crash (SIGKILL to itself), delay=SECONDS, slow=FACTOR (see
`slowdown`). A rule fires every time its point is reached with matching keys; `once=1` makes it fire only the first
time.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

ENV = "RECONFIG_FAULTS"


class InjectedFault(RuntimeError):
    """A failure raised on purpose by a fault rule."""


@dataclass(slots=True)
class FaultRule:
    point: str
    match: dict[str, str]
    action: str = "raise"
    delay_s: float = 0.0
    factor: float = 1.0      # slow: how much longer the work takes
    once: bool = False
    fired: bool = field(default=False)

    @classmethod
    def parse(cls, text: str) -> FaultRule:
        point, *pairs = text.strip().split(":")
        values = dict(pair.split("=", 1) for pair in pairs if pair)
        action = values.pop("action", "delay" if "delay" in values else "slow" if "slow" in values else "raise")
        if action not in ("raise", "crash", "delay", "slow"):
            raise ValueError(f"fault rule {text!r}: action must be raise, crash, delay or slow")
        delay = float(values.pop("delay", 0.0))
        factor = float(values.pop("slow", 1.0))
        if factor < 1.0:
            raise ValueError(f"fault rule {text!r}: slow must be >= 1")
        once = values.pop("once", "0") == "1"
        return cls(point, values, action, delay, factor, once)


class Faults:
    """The rules of this process (parsed once from the environment)."""

    def __init__(self, spec: str | None = None) -> None:
        self.configure(os.environ.get(ENV, "") if spec is None else spec)

    def configure(self, spec: str) -> None:
        """Replace the rules (a worker applies its WorkerConfig.faults at start)."""
        self.rules = [FaultRule.parse(part) for part in spec.split(";") if part.strip()]

    def _matching(self, point: str, context: dict[str, object], slow: bool):
        """The rules that fire now (slow ones for `slowdown`, the others for `check`), marked fired."""
        for rule in self.rules:
            if rule.point != point or (rule.once and rule.fired) or (rule.action == "slow") != slow:
                continue
            if any(str(context.get(key)) != value for key, value in rule.match.items()):
                continue
            rule.fired = True
            yield rule

    def slowdown(self, point: str, seconds: float, **context: object) -> float:
        """`slow` rules of `point`: sleep so that work that took `seconds` takes `factor` times as long (a slower
        device, for the heterogeneous-worker tests); returns the seconds it slept."""
        extra = sum((rule.factor - 1.0) * seconds for rule in self._matching(point, context, slow=True))
        if extra > 0:
            time.sleep(extra)
        return extra

    def check(self, point: str, **context: object) -> None:
        """Fire every rule of `point` whose keys all match `context` (`slow` rules are `slowdown`'s)."""
        for rule in self._matching(point, context, slow=False):
            if rule.action == "crash":  # as kill -9: no cleanup, no exit handlers
                os.kill(os.getpid(), signal.SIGKILL)
            if rule.action == "delay":
                time.sleep(rule.delay_s)
                continue
            raise InjectedFault(f"injected fault at {point} {context}")


FAULTS = Faults()
