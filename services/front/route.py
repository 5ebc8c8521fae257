"""One request as the front router follows it: where it runs, and the calls carrying its tokens."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from services.front.instances import Instance
from services.router.contracts import GenerationRequest
from services.router.sequence import Sequence
from services.rpc.reconfig.v1 import router_pb2


@dataclass(eq=False)
class Route:
    """One request through the front: where it runs and the call streaming its tokens."""

    request: GenerationRequest
    wire: router_pb2.GenerateRequest   # what the instance runs (a re-placed request: prompt + outputs so far)
    seq: Sequence                      # the front's copy of its tokens (for the text stream)
    instance: Instance
    call: object = None                # the call whose responses are read now
    latest_call: object = None         # the call on `instance` (ahead of `call` while a move's source drains)
    moving: bool = False
    destination: Instance | None = None  # where it is moving (while `moving`; it runs on `instance` until then)
    started: float = 0.0               # when it was sent to its first instance (monotonic)
    # id(call) -> the call that continues it once its instance ends it with "migrated" (set by the move).
    successors: dict[int, asyncio.Future] = field(default_factory=dict)

    def start(self, instance: Instance) -> None:
        """Run the request (its wire form) on `instance` from here."""
        self.instance, self.started = instance, time.monotonic()
        self.call = self.latest_call = instance.generate(self.wire)

    def cancel(self) -> None:
        """Abort it wherever it runs (a stop string ended it, or the client left)."""
        for call in {id(c): c for c in (self.call, self.latest_call) if c is not None}.values():
            call.cancel()

    @property
    def kv_tokens(self) -> int:
        return self.seq.num_tokens
