"""Moving one running request from one instance to another, live (Llumnix's multi-stage migration over
reconfig's 2D KV plan, so the two instances may run different layouts).

1. Pre-copy (the request keeps decoding on the source): rounds copy the blocks that are full (they never change),
   into blocks the target reserved, until what is left is at most `delta_blocks` or `max_rounds` ran.
2. Stop: the source parks the request at the end of its step in flight; the rest of its KV (the blocks filled
   since, the partial last one) is copied.
3. Resume: the target adopts it (Generate with its state; no prefill) and answers once it runs there; the source
   then frees it, ending its stream with "migrated". The downtime is stop to commit.
A failure anywhere gives the reservation back and, once stopped, lets the request go on at the source: a move
that does not complete leaves the request running where it was. A move by re-prefill skips 1 and the copy of 2:
the target recomputes the request's prompt and what it generated (as after a preemption), with its sampling state.
A request in the source's waiting queue (not started yet, or preempted back to it), or stopped between chunks of a
prefill, has no KV to carry: it moves by re-prefill (one that had not generated yet simply starts on the target).
So does one whose KV the target cannot read (FAILED_PRECONDITION on the first pull: another host, a GPU pool); the
result says so (`kv_unreachable`), and the front sends that pair's later moves by re-prefill from the start.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
import structlog

from services.front.instances import Instance
from services.router.block_manager import num_blocks_for
from services.rpc.reconfig.v1 import router_pb2

log = structlog.get_logger(__name__)

OUT, IN = router_pb2.MigrateOutRequest, router_pb2.MigrateInRequest


@dataclass(frozen=True, slots=True)
class MoveSettings:
    max_rounds: int = 3          # pre-copy rounds at most before the stop
    delta_blocks: int = 2        # stop once at most this many full blocks are left to copy
    stop_timeout_s: float = 30.0


@dataclass(slots=True)
class MoveResult:
    """How a move went: `moved` (the request runs on the target now) or why not."""

    moved: bool = False
    error: str = ""
    finished: bool = False        # it finished on the source before it could stop (nothing to move)
    rounds: int = 0               # pre-copy rounds
    kv_bytes_precopied: int = 0
    kv_bytes_delta: int = 0
    downtime_s: float = 0.0       # stop to commit: the request made no progress meanwhile
    reprefilled: bool = False     # moved without its KV: the target re-prefilled it
    kv_tokens: int = 0            # the tokens whose KV the move carried (or the target re-prefilled)
    kv_unreachable: bool = False  # the target could not read the source's KV: it moved by re-prefill instead
    started_over: bool = False    # it had generated nothing on the source: the target runs it from its prompt
    seconds: float = 0.0
    call: object = None           # the target's Generate stream (its first response read) when moved


class _Failed(Exception):
    pass


class _Finished(_Failed):
    """The source no longer has the request: it ended before the front read its end."""


class _Unreachable(Exception):
    """The target cannot read the source's KV pools (FAILED_PRECONDITION): the move goes on by re-prefill."""


async def _source_state(source: Instance, request_id: str, action: int, timeout_s: float = 30.0):
    try:
        return await source.migrate_out(request_id, action, timeout_s)
    except grpc.aio.AioRpcError as exc:
        if exc.code() is grpc.StatusCode.NOT_FOUND:
            raise _Finished(exc.details()) from None
        raise


async def move_request(request: router_pb2.GenerateRequest, source: Instance, target: Instance,
                       settings: MoveSettings = MoveSettings(), reprefill: bool = False) -> MoveResult:
    """Move `request` (as the source runs it) from `source` to `target`; never raises for a failed move.
    reprefill: move it without its KV (no pre-copy, no delta): the target recomputes its prompt and what it
    generated, with the same sampling state (MELL's alternative when the link is slower than the prefill)."""
    started = time.perf_counter()
    move = _Move(request, source, target, settings, reprefill)
    result = move.result
    try:
        await move.export()            # the source's state of it
        await move.precopy()           # 1. pre-copy, while it decodes on at the source
        stop_at = time.perf_counter()  # the downtime: from the stop to the commit
        await move.stop()              # 2. stop, then the rest of its KV (or none: a re-prefill)
        await move.copy_rest()
        await move.resume()            # 3. it runs on the target, then the source frees it
        await move.commit()
        result.downtime_s = time.perf_counter() - stop_at
        result.moved, result.call = True, move.call
    except (_Failed, grpc.aio.AioRpcError) as exc:
        result.error = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        result.finished = result.finished or isinstance(exc, _Finished)
        await move.undo()
    except asyncio.CancelledError:  # the front is stopping: the move holds nothing anywhere once it ends
        if not result.moved:
            await move.undo()
        raise
    result.seconds = time.perf_counter() - started
    log.info("front.move", request_id=move.request_id, source=source.name, target=target.name, moved=result.moved,
             reprefill=move.reprefill,
             error=result.error or None, rounds=result.rounds, kv_bytes_precopied=result.kv_bytes_precopied,
             kv_bytes_delta=result.kv_bytes_delta, downtime_ms=round(result.downtime_s * 1e3, 2),
             seconds=round(result.seconds, 4))
    return result


class _Move:
    """One move as its phases hand it on: the source's latest state of the request, the blocks the target reserved
    and those copied into them, whether the source holds it stopped, the target's call once it runs there."""

    def __init__(self, request: router_pb2.GenerateRequest, source: Instance, target: Instance,
                 settings: MoveSettings, reprefill: bool) -> None:
        self.request, self.source, self.target, self.settings = request, source, target, settings
        self.request_id = request.request_id
        self.result = MoveResult(reprefilled=reprefill)
        self.reprefill = reprefill    # set once the move goes on without its KV
        self.stopped = False          # the source may hold it parked (undo: it runs there again)
        self.call = None              # the target's Generate, once started
        self.state: router_pb2.MigrateOutResponse | None = None  # the source's latest answer
        self.block_size = 0
        self.limit = 0                # the most KV the request ever holds
        self.copied = 0               # leading blocks of the request already copied
        self.reserved: list[int] = []
        self.epoch: tuple[int, int] = (0, 0)  # the source's (kv_epoch, pool_epoch) the copied blocks came from

    async def export(self) -> None:
        """The source's state of the request (its block table), once the two instances can carry its KV at all."""
        source, target = self.source, self.target
        if source.block_size != target.block_size:
            raise _Failed(f"block sizes differ ({source.block_size} vs {target.block_size})")
        self.block_size = source.block_size
        self.limit = len(self.request.prompt_token_ids) + self.request.max_tokens - 1
        self.state = state = await _source_state(source, self.request_id, OUT.EXPORT)
        self.epoch = (state.kv_epoch, state.pool_epoch)

    async def precopy(self) -> None:
        """1. Rounds that copy the full blocks while the request decodes on at the source, until what is left is at
        most `delta_blocks` or `max_rounds` ran (none for a move by re-prefill)."""
        result, settings = self.result, self.settings
        while result.rounds < settings.max_rounds and not self.reprefill:
            state = self.state
            full = state.num_computed_tokens // self.block_size
            if full - self.copied <= settings.delta_blocks and result.rounds:
                break
            # Reserve what the policy counted (its KV and room for the next token): more could overfill a target
            # the policy filled exactly; the rounds and the delta grow the reservation as the request decodes on.
            try:
                result.kv_bytes_precopied += await self.copy(list(state.block_table), full,
                                                             state.num_computed_tokens + 1)
            except _Unreachable as exc:
                await self.carry_no_kv(str(exc), unreachable=True)
                break
            result.rounds += 1
            self.state = await _source_state(self.source, self.request_id, OUT.EXPORT)

    async def stop(self) -> None:
        """2. The source parks the request at the end of its step in flight (_Finished: it ended there first)."""
        self.stopped = True  # from the stop on, the source may hold it parked (an abort lets it run there again)
        self.state = state = await _source_state(self.source, self.request_id, OUT.STOP, self.settings.stop_timeout_s)
        self.stopped = not state.finished
        if state.finished:
            raise _Finished("it finished on the source first")

    async def copy_rest(self) -> None:
        """2. The rest of its KV (the blocks filled since the pre-copy, the partial last one); none where the source
        holds none or the target cannot read it: then the target re-prefills it."""
        state, result = self.state, self.result
        if not state.num_computed_tokens and not self.reprefill:  # waiting or prefilling on the source: no KV
            await self.carry_no_kv("no KV on the source (waiting or prefilling)")
        if not self.reprefill:
            needed = num_blocks_for(state.num_computed_tokens, self.block_size)
            try:
                result.kv_bytes_delta = await self.copy(list(state.block_table), needed, state.num_computed_tokens)
            except _Unreachable as exc:
                await self.carry_no_kv(str(exc), unreachable=True)
        result.kv_tokens = (len(self.request.prompt_token_ids) + len(state.output_token_ids) - 1 if self.reprefill
                            else state.num_computed_tokens)

    async def resume(self) -> None:
        """3. The target adopts it (Generate with its state; no prefill, or a re-prefill) and answers once it runs
        there."""
        state = self.state
        resumed = router_pb2.GenerateRequest()
        resumed.CopyFrom(self.request)
        self.result.started_over = not state.output_token_ids
        resumed.migrated.SetInParent()  # present even when empty: a request moved before its first token
        resumed.migrated.output_token_ids[:] = state.output_token_ids
        resumed.migrated.num_computed_tokens = 0 if self.reprefill else state.num_computed_tokens
        self.call = self.target.generate(resumed)
        first = await self.call.read()  # no tokens: it runs on the target now
        if first is grpc.aio.EOF or first.finish_reason:
            raise _Failed(f"the target ended it at once ({getattr(first, 'error', '') or 'no reason'})")

    async def commit(self) -> None:
        """The source frees the request, ending its stream with "migrated"."""
        await self.source.migrate_out(self.request_id, OUT.COMMIT)

    async def copy(self, table, upto: int, num_tokens: int) -> int:
        """Copy the request's blocks [copied, upto) of the source's `table` into blocks the target reserved (grown
        to `upto` blocks first, for `num_tokens`); -> the bytes pulled. _Unreachable: the target cannot read the
        source's KV."""
        state, target = self.state, self.target
        # Preempted on the source since, or the source froze (a switch may have replaced the pools a pull read
        # from): what was copied is stale.
        if (state.kv_epoch, state.pool_epoch) != self.epoch:
            self.copied, self.epoch = 0, (state.kv_epoch, state.pool_epoch)
        if len(self.reserved) < upto:
            grown = await target.migrate_in(IN(request_id=self.request_id, action=IN.RESERVE, request=self.request,
                                               num_tokens=min(self.limit, max(num_tokens, upto * self.block_size))))
            self.reserved = list(grown.block_ids)
        copied = self.copied
        if upto <= copied:
            return 0
        try:
            pulled = await target.migrate_in(IN(request_id=self.request_id, action=IN.PULL, source=state.source,
                                                src_block_ids=table[copied:upto],
                                                dst_block_ids=self.reserved[copied:upto]))
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.FAILED_PRECONDITION and not copied:
                raise _Unreachable(exc.details()) from None
            raise
        self.copied = upto
        return pulled.kv_bytes

    async def carry_no_kv(self, why: str, unreachable: bool = False) -> None:
        """From here on, a move by re-prefill: the target gives back what it reserved."""
        if self.reserved:
            await self.target.migrate_in(IN(request_id=self.request_id, action=IN.RELEASE))
        self.reprefill = self.result.reprefilled = True
        self.result.kv_unreachable = unreachable
        log.info("front.move_by_reprefill", request_id=self.request_id, source=self.source.name,
                 target=self.target.name, why=why)

    async def undo(self) -> None:
        """A move that did not happen: the target aborts what it started and gives back the blocks it reserved; a
        source that stopped the request parks it no longer (it runs there again)."""
        if self.call is not None:
            self.call.cancel()  # the target aborts it there and frees its blocks
        await _quietly(self.target.migrate_in(IN(request_id=self.request_id, action=IN.RELEASE)))
        if self.stopped:
            await _quietly(self.source.migrate_out(self.request_id, OUT.ABORT))


async def _quietly(awaitable) -> None:
    try:
        await awaitable
    except grpc.aio.AioRpcError as exc:
        log.warning("front.move_cleanup_failed", error=exc.details())
