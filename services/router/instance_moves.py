"""The instance side of live request moves between instances (MELL): what a source and a target router do
when the front router moves a running request.

Source: `export` (serving goes on) tells where the request's KV lives and which of its blocks are full, for a
pre-copy round; `stop` parks it at the end of its step in flight (its KV stays, nothing is scheduled for it);
`commit` frees it and ends its stream with finish_reason "migrated"; `abort` schedules it again, its stream going
on as if nothing happened. Target: `reserve` takes blocks for it, `pull` has every worker copy KV blocks out of the
source's workers into them (serving goes on), `release` gives them back; Engine.generate(..., migrated=...) then
adopts it with no prefill (`admit`; or, moved without its KV, it re-prefills here). A layout switch ends every
move in progress (RequestMoves.cancel_all), and a freeze waits for pulls in flight, so no worker writes a block the
switch moves or hands to another request.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from services.router.contracts import GenerationRequest, RequestError
from services.router.sequence import Sequence, SequenceStatus
from services.rpc.reconfig.v1 import worker_pb2

if TYPE_CHECKING:
    from services.router.driver import Driver
    from services.router.scheduler import Scheduler
    from services.topology import Topology


class _Freezes(Protocol):
    num_freezes: int  # a switch may give the workers new pools: a move out copies again


class MoveHost(Protocol):
    """What InstanceMoves uses of the engine that owns it (services.router.engine.Engine)."""

    scheduler: Scheduler
    driver: Driver
    topology: Topology
    switch_ops: _Freezes  # services.router.switch_ops.SwitchOps

    async def wait_step(self, timeout_s: float) -> None: ...
    def end_stream(self, request_id: str, reason: str) -> None: ...
    def wake(self) -> None: ...

MIGRATED = "migrated"  # the finish_reason of a request's stream on the instance it left


class MoveRefused(RuntimeError):
    """The request cannot move now (not decoding, frozen for a switch, several KV pools): FAILED_PRECONDITION."""


class RouterFrozen(MoveRefused):
    """A layout switch holds the router: UNAVAILABLE, retry after it."""


@dataclass(frozen=True, slots=True)
class RequestKV:
    """A request's KV as its source router sees it."""

    block_table: tuple[int, ...]       # block ids in token order (covering its cached tokens, and maybe the step's)
    num_computed_tokens: int           # tokens whose KV is in the blocks
    output_token_ids: tuple[int, ...]  # what it generated so far
    finished: bool = False             # it finished before it could stop
    kv_epoch: int = 0                  # its prefills so far: a preemption drops the KV and changes it
    pool_epoch: int = 0                # the instance's freezes so far: a switch may give the workers new pools

    def full_blocks(self, block_size: int) -> tuple[int, ...]:
        """The blocks no later step changes (full of cached tokens): what a pre-copy round may copy."""
        return self.block_table[:self.num_computed_tokens // block_size]


@dataclass(frozen=True, slots=True)
class PullStats:
    kv_bytes: int
    seconds: float


class InstanceMoves:
    """The engine's part in moving requests between instances; the front router (services.front) drives it."""

    def __init__(self, engine: MoveHost) -> None:
        self.engine = engine
        self._pulls = 0
        self._no_pulls = asyncio.Event()
        self._no_pulls.set()
        self._pulling: dict[str, set[asyncio.Future]] = {}  # request_id -> its workers' copies under way
        self._source: tuple[int, worker_pb2.KVSource] | None = None  # (the freeze count it was read at, it)
        self.num_out = 0          # moves committed out of / adopted into this instance
        self.num_in = 0
        self.kv_bytes_in = 0

    # ---- source ------------------------------------------------------------------------------------------------
    async def export(self, request_id: str) -> tuple[RequestKV, worker_pb2.KVSource]:
        """The request's blocks and where they live, while it keeps decoding. KeyError: unknown."""
        self._check_not_frozen()
        seq = self._sequence(request_id)
        if request_id in self.engine.scheduler.moves.parked:
            raise MoveRefused(f"{request_id} is already moving")
        return self._state(seq), await self.kv_source()

    async def stop(self, request_id: str, timeout_s: float) -> tuple[RequestKV, worker_pb2.KVSource]:
        """Park the request at the end of its step in flight (TimeoutError past timeout_s: it goes on here);
        returns its final state, `finished` when a step ended it first."""
        self._check_not_frozen()
        scheduler = self.engine.scheduler
        seq = self._sequence(request_id)
        try:
            parked = scheduler.moves.park(request_id)
        except ValueError as exc:
            raise MoveRefused(str(exc)) from None
        deadline = time.monotonic() + timeout_s
        while not parked and request_id not in scheduler.moves.parked and not seq.is_finished:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.engine.scheduler.is_frozen:
                self._unpark_quietly(request_id)
                raise TimeoutError(f"{request_id} did not reach a step boundary within {timeout_s:g} s")
            await self.engine.wait_step(remaining)
        return self._state(seq, finished=request_id not in scheduler.moves.parked), await self.kv_source()

    def commit(self, request_id: str) -> None:
        """The request runs on another instance now: free its blocks and end its stream here ("migrated").
        Refused while frozen: a switch under way may have given the workers new pools after the last pull."""
        self._check_not_frozen()
        moves = self.engine.scheduler.moves
        if request_id not in moves.parked or moves.is_moving_in(request_id):
            raise KeyError(request_id)
        self.engine.scheduler.finish(request_id, SequenceStatus.FINISHED_ABORTED)
        self.engine.end_stream(request_id, MIGRATED)
        self.num_out += 1

    def abort(self, request_id: str) -> None:
        """The move failed: the parked request is scheduled again here (KeyError: not parked)."""
        self.engine.scheduler.moves.unpark(request_id)
        self.engine.wake()

    # ---- target ------------------------------------------------------------------------------------------------
    def reserve(self, request: GenerationRequest, num_tokens: int) -> list[int]:
        """Blocks for the KV of the request's first `num_tokens` tokens (again: grow them); their ids."""
        self._check_not_frozen()
        if request.stop_strings:
            raise RequestError("a request moving in carries no stop strings (the front router applies them)")
        return self.engine.scheduler.moves.reserve(Sequence.from_request(request), num_tokens)

    def admit(self, request: GenerationRequest, output_token_ids: list[int], num_computed_tokens: int) -> Sequence:
        """A request moving in starts here: with its KV reserved and filled (`num_computed_tokens` of it), from its
        next token; with none (0: a move by re-prefill, cheaper than the transfer when the link is slow), it
        re-prefills its prompt and what it generated, as a preempted request does, and goes on with the same
        sampling state; one moved before its first token starts here as a new request does. KeyError: KV cached
        but nothing reserved under its id."""
        if num_computed_tokens:
            seq = self.engine.scheduler.moves.adopt(request.request_id, output_token_ids, num_computed_tokens)
        else:
            if not 0 <= len(output_token_ids) < request.max_tokens:
                raise RequestError(f"{len(output_token_ids)} generated tokens cannot continue a request of "
                                   f"max_tokens {request.max_tokens}")
            seq = Sequence.from_request(request)
            seq.output_token_ids = list(output_token_ids)
            self.engine.scheduler.add(seq)
        self.num_in += 1
        return seq

    async def release(self, request_id: str) -> None:
        """Give back a reservation whose move failed (nothing if there is none), once no worker writes into it any
        more (a pull whose caller gave up runs on to its end)."""
        await asyncio.gather(*self._pulling.get(request_id, ()), return_exceptions=True)
        if self.engine.scheduler.moves.is_moving_in(request_id):
            self.engine.scheduler.finish(request_id, SequenceStatus.FINISHED_ABORTED)

    async def pull(self, request_id: str, source: worker_pb2.KVSource, src_block_ids: Sequence_[int],
                   dst_block_ids: Sequence_[int]) -> PullStats:
        """Every active worker copies `src_block_ids` of the source's pools into `dst_block_ids` here (ids the
        request reserved), between its steps."""
        self._check_not_frozen()
        scheduler = self.engine.scheduler
        if not scheduler.moves.is_moving_in(request_id):
            raise KeyError(request_id)
        reserved = set(scheduler.get(request_id).block_ids)
        if stray := [b for b in dst_block_ids if b not in reserved]:
            raise RequestError(f"blocks {stray[:4]} are not reserved for {request_id}")
        started = time.perf_counter()
        # The workers' copy runs to its end even when the caller gives up (a cancelled call, a deadline): until it
        # has, a freeze waits for it and a release of the request's blocks too.
        importing = asyncio.ensure_future(self.engine.driver.import_kv(worker_pb2.ImportKVRequest(
            source=source, src_block_ids=src_block_ids, dst_block_ids=dst_block_ids)))
        self._pulls += 1
        self._no_pulls.clear()
        self._pulling.setdefault(request_id, set()).add(importing)
        importing.add_done_callback(lambda done: self._pulled(request_id, done))
        kv_bytes = await asyncio.shield(importing)
        self.kv_bytes_in += kv_bytes
        return PullStats(kv_bytes, time.perf_counter() - started)

    def _pulled(self, request_id: str, importing: asyncio.Future) -> None:
        pulling = self._pulling.get(request_id, set())
        pulling.discard(importing)
        if not pulling:
            self._pulling.pop(request_id, None)
        self._pulls -= 1
        if not self._pulls:
            self._no_pulls.set()
        if not importing.cancelled():
            importing.exception()  # retrieved: the pull that awaits it (if its caller is still there) raises it

    async def wait_no_pulls(self) -> None:
        """Until no pull is in flight (a freeze waits for them: the switch must not move blocks being filled)."""
        await self._no_pulls.wait()

    # ---- helpers -----------------------------------------------------------------------------------------------
    async def kv_source(self) -> worker_pb2.KVSource:
        """Where this instance's KV lives (read again after every freeze: a switch, even a rolled-back one, may give
        the workers new pools, and with them new segments and IPC handles; the driver itself changes only in a
        rebind, which needs a freeze)."""
        driver, read_at = self.engine.driver, self.engine.switch_ops.num_freezes
        if self._source is None or self._source[0] != read_at:
            pools = await driver.kv_pools()
            self._source = (read_at, worker_pb2.KVSource(
                topology=str(self.engine.topology), layer_partition=driver.layer_partition(), pools=pools,
                block_size=driver.block_size, hostname=socket.gethostname()))
        return self._source[1]

    def _state(self, seq: Sequence, finished: bool = False) -> RequestKV:
        return RequestKV(tuple(seq.block_ids), seq.num_computed_tokens, tuple(seq.output_token_ids),
                         finished or seq.is_finished, seq.num_prefills, self.engine.switch_ops.num_freezes)

    def _sequence(self, request_id: str) -> Sequence:
        seq = self.engine.scheduler.get(request_id)
        if seq is None:
            raise KeyError(request_id)
        if self.engine.scheduler.block_manager.num_ranks > 1:
            raise MoveRefused("moving a request needs one KV pool: this layout is expert parallel")
        return seq

    def _check_not_frozen(self) -> None:
        if self.engine.scheduler.is_frozen:
            raise RouterFrozen("the router is frozen (a layout switch or a recovery): retry after it")

    def _unpark_quietly(self, request_id: str) -> None:
        scheduler = self.engine.scheduler
        if request_id in scheduler.moves.parked:
            scheduler.moves.unpark(request_id)
        else:
            scheduler.moves.cancel_park(request_id)
        self.engine.wake()
