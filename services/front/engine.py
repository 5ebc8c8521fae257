"""The front router's engine: one OpenAI API over several instances, MELL placement, live moves between them.

Each request is placed by the placement policy (`mell`, `bf`, `wf`, `lb`: the same pure code `reconfig simulate`
runs) and forwarded to that instance's router as token ids; the text (detokenization, stop strings) is made here,
so a request keeps one text stream whichever instance computes it. Every `interval_s` the policy sees each
request's KV size and may ask for moves; each runs live (services.front.mover) and the request's stream goes on
from the target. Policy instances are slots bound to real instances while they hold requests: an instance the
policy empties is released (standby), and one is bound again when the policy opens one.

Failures: a move that fails leaves the request where it was; an instance that dies loses only its own requests'
KV: they are placed again on a live instance with their prompt plus what they generated (a re-prefill), and
their streams go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
import structlog

from services.contracts.step import TokenLogprob
from services.front.instance_admin import InstanceAdmin, MoveRefused
from services.front.instances import Instance, request_to_pb
from services.front.metrics import front_metrics
from services.front.move_order import Outgoing, free_tokens, leaving_first
from services.front.mover import MoveResult, MoveSettings, move_request
from services.front.rates import FrontTotals, average, choose_modes
from services.front.route import Route
from services.front.slots import Slots
from services.model.tokenizer import Tokenizer
from services.placement import KVSchedulerConfig, Request, SchedulerError, make_policy
from services.router.block_manager import num_blocks_for
from services.router.contracts import (
    EngineDrainingError, EngineStats, GenerationDelta, GenerationRequest, QueueFullError, RequestError, SwitchTotals,
)
from services.router.instance_moves import MIGRATED
from services.router.output import RequestStream
from services.router.sequence import Sequence, SequenceStatus
from services.rpc.reconfig.v1 import router_pb2

log = structlog.get_logger(__name__)

_STATUS = {"stop": SequenceStatus.FINISHED_STOPPED, "length": SequenceStatus.FINISHED_LENGTH}
_LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)  # the instance's router is gone
PROBE_INTERVAL_S = 2.0  # how often an instance found down is asked whether it is back


@dataclass(frozen=True, slots=True)
class FrontSettings:
    policy: str = "mell"               # mell | bf | wf | lb
    interval_s: float = 0.05           # how often the policy sees the requests' KV sizes
    max_concurrent_moves: int = 4
    move: MoveSettings = MoveSettings()
    migrate: bool = True               # false: place only, never move (the policy's moves are dropped)
    adaptive: bool = True              # move KV or re-prefill, whichever the measured rates make cheaper (MELL V)
    migration_window_s: float = 1.0    # the horizon of the link and prefill budgets of that choice
    queue_timeout_s: float = 300.0     # a request no instance can take waits this long for room, then 429
    max_waiting: int = 1024            # requests waiting for room at once; more get 429 at once


def not_started(route: Route, target: Instance | None, settings: FrontSettings, moves_under_way: int) -> str:
    """Why a move the policy asked for is not started now ("" when it can start): disabled (migrate off), no_room
    (no instance for its target slot), moving (a move of it is under way), busy (max_concurrent_moves under way).
    A request moves whatever its phase: decoding with its KV, before its first token by starting on the target."""
    return ("disabled" if not settings.migrate else "no_room" if target is None else "moving" if route.moving
            else "busy" if moves_under_way >= settings.max_concurrent_moves else "")


class FrontEngine(InstanceAdmin):
    """EngineProtocol over instances: the HTTP API (services.router.api) serves it unchanged."""

    def __init__(self, instances: list[Instance], tokenizer: Tokenizer, model_name: str,
                 settings: FrontSettings = FrontSettings()) -> None:
        if not instances:
            raise ValueError("the front router needs at least one instance")
        self.instances = instances
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.settings = settings
        self.max_model_len = 0
        self.context_note = ""  # the API's context-length error adds it (a router's says what limits its KV)
        self.policy = None
        self.totals = FrontTotals()
        self.is_draining = False
        self._routes: dict[str, Route] = {}
        self.slots = Slots(instances)  # policy instance ids -> the instances they are bound to
        self._moves: set[asyncio.Task] = set()
        self._outgoing = Outgoing()  # moves in flight by the instance they leave
        self._kv_unreachable: set[tuple[str, str]] = set()  # (source, target) whose KV moves were refused
        self._task: asyncio.Task | None = None
        self._last_tick = time.monotonic()
        self._room = asyncio.Event()  # set when a request left (room for one waiting to be placed)
        self.num_waiting = 0
        self.autoscaler = None  # services.front.autoscale.Autoscaler where the front starts and stops instances

    # ---- lifecycle -----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        stats = await asyncio.gather(*(instance.connect() for instance in self.instances))
        capacity = min(instance.capacity_tokens for instance in self.instances)
        self.max_model_len = min(s.max_model_len for s in stats)
        self.policy = make_policy(self.settings.policy, KVSchedulerConfig(capacity=capacity,
                                                                          max_instances=len(self.instances)))
        self._last_tick = time.monotonic()  # the time-average counts from here
        self._task = asyncio.create_task(self._policy_loop(), name="front-policy")
        log.info("front.started", instances=[f"{i.name}={i.address} {i.topology}" for i in self.instances],
                 policy=self.settings.policy, capacity_tokens=capacity)

    async def drain(self, grace_s: float) -> int:
        self.is_draining = True
        deadline = time.monotonic() + grace_s
        while self._routes and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # noqa: ASYNC110 (a shutdown grace, not synchronization)
        return len(self._routes)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        moves = list(self._moves)
        for task in moves:
            task.cancel()
        # Each move gives back what it reserved on its target before the instances' channels close.
        await asyncio.gather(*moves, return_exceptions=True)
        for route in list(self._routes.values()):
            route.cancel()
        await asyncio.gather(*(instance.close() for instance in self.instances))

    @property
    def is_ready(self) -> bool:
        return self._task is not None and not self._task.done() and not self.is_draining and any(
            i.is_up for i in self.instances)

    # ---- requests ------------------------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        if self.is_draining:
            raise EngineDrainingError("the front router is shutting down and takes no new requests")
        if request.prompt_logprobs:
            raise RequestError("prompt logprobs (echo with logprobs) are not served by the front router")
        if len(request.prompt_token_ids) + request.max_tokens > self.max_model_len:
            raise RequestError(f"the prompt ({len(request.prompt_token_ids)} tokens) plus max_tokens "
                               f"({request.max_tokens}) is more than the context of {self.max_model_len} tokens")
        if request.request_id in self._routes:
            raise RequestError(f"request id {request.request_id!r} is already in use")
        route = Route(request, request_to_pb(request), Sequence.from_request(request), self.instances[0])
        route.instance = await self._place(route)
        stream = RequestStream(request, self.tokenizer)
        self._routes[request.request_id] = route
        try:
            route.start(route.instance)
            while True:
                response = await self._next_response(route)
                if response is None:  # the instance was lost: placed again, read on
                    continue
                for delta in self._apply(route, stream, response):
                    yield delta
                    if delta.finish_reason is not None:
                        return
        finally:
            self._routes.pop(request.request_id, None)
            route.cancel()  # a stop string ended it here, or the client left: abort it there
            with contextlib.suppress(SchedulerError):
                self.policy.depart(request.request_id)
            self._room.set()

    async def _place(self, route: Route) -> Instance:
        """Where the policy puts the request; while no instance has room it waits (FIFO by wakeups) for a
        request to leave, up to queue_timeout_s (then QueueFullError, HTTP 429)."""
        request_id, kv_tokens = route.request.request_id, self._policy_tokens(route)
        deadline = time.monotonic() + self.settings.queue_timeout_s
        waiting = False
        try:
            while True:
                try:
                    return self.slots.bind(self.policy.allocate(request_id, kv_tokens))
                except (SchedulerError, QueueFullError) as exc:
                    with contextlib.suppress(SchedulerError):
                        self.policy.depart(request_id)  # placed on a slot no instance can take: undo
                    if not waiting and self.num_waiting >= self.settings.max_waiting:
                        raise QueueFullError(f"{self.num_waiting} requests wait for room already") from None
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise QueueFullError(f"no instance had room within {self.settings.queue_timeout_s:g} s: "
                                             f"{exc}") from None
                    if not waiting:
                        waiting, self.num_waiting = True, self.num_waiting + 1
                    self._room.clear()
                    waiter = asyncio.ensure_future(self._room.wait())
                    await asyncio.wait([waiter], timeout=remaining)
                    waiter.cancel()
        finally:
            if waiting:
                self.num_waiting -= 1

    async def _next_response(self, route: Route) -> router_pb2.GenerateResponse | None:
        """The next response of the request wherever it runs; None after a lost instance made it start again."""
        try:
            response = await route.call.read()
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _LOST or self.is_draining:  # the instance failed this request: say so, end it
                return router_pb2.GenerateResponse(finish_reason="error", error=f"instance {route.instance.name}: "
                                                   f"{exc.code().name}: {exc.details()}")
            await self._replace(route, f"{exc.code().name}: {exc.details()}")
            return None
        if response is grpc.aio.EOF:
            await self._replace(route, "its stream ended without a finish")
            return None
        if response.finish_reason == MIGRATED:  # it moved: read on from the target
            route.call = await route.successors.pop(id(route.call))
            return None
        return response

    def _apply(self, route: Route, stream: RequestStream, response) -> Iterator[GenerationDelta]:
        """Turn an instance's response into the client's deltas (text and stop strings made here)."""
        seq = route.seq
        if response.finish_reason in ("error", "abort"):
            stream.finish(response.finish_reason, error=response.error or None)
        else:
            if response.token_ids and not seq.output_token_ids:  # its first token: a sample of the prefill rate
                elapsed = time.monotonic() - route.started
                if elapsed > 0:
                    totals = self.totals
                    totals.prefill_tokens_per_s = average(totals.prefill_tokens_per_s, seq.num_prompt_tokens / elapsed)
            seq.output_token_ids.extend(response.token_ids)
            if response.finish_reason:
                seq.status = _STATUS.get(response.finish_reason, SequenceStatus.FINISHED_STOPPED)
            logprobs = tuple(TokenLogprob.from_pb(lp) for lp in response.logprobs)
            if response.token_ids or response.finish_reason:
                stream.push(tuple(response.token_ids), seq, logprobs)
        yield from stream.drain()

    async def _replace(self, route: Route, why: str) -> None:
        """The request's instance is gone with its KV: place it again with its prompt and what it generated."""
        lost = route.instance
        lost.is_up = False
        self.totals.replaced += 1
        with contextlib.suppress(SchedulerError):
            self.policy.depart(route.request.request_id)
        if not any(i.is_up for i in self.instances):
            raise RequestError(f"instance {lost.name} was lost ({why}) and no other is up")
        seq = route.seq
        route.wire = request_to_pb(route.request, tuple(seq.all_token_ids),
                                   route.request.max_tokens - len(seq.output_token_ids))
        route.wire.min_tokens = max(0, route.request.min_tokens - len(seq.output_token_ids))
        route.start(await self._place(route))
        log.warning("front.request_replaced", request_id=route.request.request_id, lost=lost.name,
                    instance=route.instance.name, why=why, generated=len(seq.output_token_ids))

    # ---- instances: what runs where (drain, add, remove: services.front.instance_admin) --------------------------
    def _unbind_released(self) -> None:
        self.slots.release_unused(self.policy.instances(), {id(instance) for instance in self.in_use()})

    def requests_on(self, instance: Instance) -> list[Route]:
        """The requests running on an instance now."""
        return [route for route in self._routes.values() if route.instance is instance]

    def in_use(self) -> list[Instance]:
        """Instances holding at least one request now."""
        busy = {id(route.instance) for route in self._routes.values()}
        return [i for i in self.instances if id(i) in busy]

    # ---- the policy loop -----------------------------------------------------------------------------------------
    async def _policy_loop(self) -> None:
        next_probe = time.monotonic()
        while True:
            await asyncio.sleep(self.settings.interval_s)  # noqa: ASYNC110 (the policy's period)
            try:
                self._tick()
            except Exception:  # noqa: BLE001 (one bad tick must not end placement and moves)
                log.exception("front.policy_tick_failed")
            if time.monotonic() >= next_probe:
                next_probe = time.monotonic() + PROBE_INTERVAL_S
                await asyncio.gather(*(self._probe(i) for i in self.instances if not i.is_up))

    async def _probe(self, instance: Instance) -> None:
        """An instance found down takes requests again once its router answers."""
        try:
            await instance.refresh(timeout_s=1.0)
        except grpc.aio.AioRpcError:
            return
        instance.is_up = True
        log.info("front.instance_back", instance=instance.name, topology=instance.topology)

    def _tick(self) -> None:
        now = time.monotonic()
        elapsed, self._last_tick = now - self._last_tick, now
        self.totals.instance_seconds += elapsed * len(self.in_use())
        self.totals.seconds += elapsed
        updates = [Request(rid, self._policy_tokens(route)) for rid, route in self._routes.items()
                   if rid in self.policy.cluster.location]
        migrations = self.policy.grow(updates)
        startable = []
        for migration in migrations:
            route = self._routes.get(migration.request_id)
            if route is None:
                continue  # it left; the policy hears of it from generate()
            target = self.slots.get(migration.destination)
            if target is None and self.slots.standby():
                target = self.slots.bind(migration.destination)
            if target is route.instance:
                continue  # the policy now has it where it runs
            if why := not_started(route, target, self.settings, len(self._moves) + len(startable)):
                self.totals.drops[why] = self.totals.drops.get(why, 0) + 1
                self._drop(migration, "dropped")
                continue
            startable.append((migration, route, target))
        reprefill = self._choose_modes([m for m, _, _ in startable])
        order = leaving_first([(id(route.instance), id(target)) for _, route, target in startable])
        for migration, route, target in (startable[i] for i in order):
            if migration.request_id in reprefill and reprefill[migration.request_id] is None:
                self._drop(migration, "deferred")
                continue
            route.moving = True
            task = asyncio.create_task(self._move(route, target, migration.source,
                                                  reprefill.get(migration.request_id, False)))
            self._moves.add(task)
            task.add_done_callback(self._moves.discard)
        self._unbind_released()

    async def move(self, request_id: str, target: Instance, reprefill: bool = False) -> MoveResult:
        """Move a running request to `target` now (an operator's or a test's move; the policy's go through _tick).
        KeyError: no such request here; MoveRefused: it is moving already, or runs on `target`."""
        route = self._routes[request_id]
        if route.moving or route.instance is target or not target.in_service:
            raise MoveRefused(f"{request_id} is moving already, runs on {target.name}, or {target.name} is out of "
                              "service")
        route.moving = True
        return await self._move(route, target, reprefill=reprefill)

    def _by_reprefill(self, source: Instance, target: Instance, chosen: bool) -> bool:
        """A move goes by re-prefill where chosen, or where the target could not read the source's KV before."""
        return chosen or (source.name, target.name) in self._kv_unreachable

    async def _move(self, route: Route, target: Instance, policy_source: str | None = None,
                    reprefill: bool = False) -> MoveResult:
        """Move the request; keep the policy's view true: a policy move that failed is pinned back on its
        source slot (`policy_source`), an operator's move that worked onto the target's slot."""
        source, source_call = route.instance, route.latest_call
        successor = route.successors[id(source_call)] = asyncio.get_running_loop().create_future()
        leaving_target, this = self._outgoing.from_(target), asyncio.get_running_loop().create_future()
        route.destination = target
        self._outgoing.begin(source, this)
        try:
            if leaving_target and free_tokens(target, self._routes.values(), self._policy_tokens, route) \
                    < self._policy_tokens(route):  # its room comes as those moves commit (services/front/move_order.py)
                self.totals.waited_for_room += 1
                await asyncio.wait(leaving_target, timeout=self.settings.move.stop_timeout_s)
            result = await move_request(route.wire, source, target, self.settings.move,
                                        self._by_reprefill(source, target, reprefill))
        except BaseException:
            route.successors.pop(id(source_call), None)
            raise
        finally:
            route.moving, route.destination = False, None
            this.set_result(None)
            self._outgoing.end(source, this)
        request_id = route.request.request_id
        if result.kv_unreachable:
            self._kv_unreachable.add((source.name, target.name))
        if result.moved:
            route.instance, route.latest_call = target, result.call
            if result.started_over:  # its first prefill runs there: so does the prefill-rate sample
                route.started = time.monotonic()
            successor.set_result(result.call)
            if policy_source is None:
                slot = self._pin(request_id, self.slots.slot_of(target))
                if slot is not None:
                    self.slots.bind_to(slot, target)
            totals = self.totals
            totals.moves["moved"] += 1
            totals.move_downtime_s += result.downtime_s
            moved_bytes = result.kv_bytes_precopied + result.kv_bytes_delta
            totals.kv_bytes_moved += moved_bytes
            if result.reprefilled:
                totals.reprefilled += 1
            elif moved_bytes and result.kv_tokens and result.seconds > 0:
                totals.link_bytes_per_s = average(totals.link_bytes_per_s, moved_bytes / result.seconds)
                totals.kv_bytes_per_token = average(totals.kv_bytes_per_token, moved_bytes / result.kv_tokens)
        else:
            route.successors.pop(id(source_call), None)  # the source goes on: it never says "migrated"
            self.totals.moves["finished" if result.finished else "failed"] += 1
            if policy_source is not None:
                self._pin(request_id, policy_source)
        return result

    def _choose_modes(self, migrations: list) -> dict[str, bool | None]:
        return choose_modes(migrations, self.totals, self.settings.migration_window_s) if self.settings.adaptive \
            else {}

    def _drop(self, migration, outcome: str) -> None:
        """A move of the policy's that is not made now: the policy has the request back on its source."""
        self._pin(migration.request_id, migration.source)
        self.totals.moves[outcome] += 1

    def _pin(self, request_id: str, slot: str | None) -> str | None:
        """Tell the policy where a request really is (None: on a new slot); None when it has left."""
        try:
            return self.policy.pin(request_id, slot)
        except SchedulerError:
            return None

    def _policy_tokens(self, route: Route) -> int:
        """The KV an instance holds for the request: whole blocks, with room for its next token."""
        block_size = self.instances[0].block_size or 1
        return min(num_blocks_for(route.kv_tokens + 1, block_size) * block_size, self.policy.config.capacity)

    # ---- reporting -----------------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self._routes), num_waiting=self.num_waiting,
                           topology=",".join(i.topology for i in self.instances),
                           max_model_len=self.max_model_len,
                           extra={"instances_in_use": float(len(self.in_use())),
                                  "moves": float(self.totals.moves["moved"]),
                                  "time_average_instances": self.time_average_instances()})

    def time_average_instances(self) -> float:
        return self.totals.instance_seconds / self.totals.seconds if self.totals.seconds else 0.0

    def switch_totals(self) -> SwitchTotals:
        return SwitchTotals()

    def collect_metrics(self, labels: list[str], label_names: tuple[str, ...]) -> Iterator:
        """The front's own metrics (services.router.api.metrics calls it on every scrape)."""
        return front_metrics(self, labels, label_names)
