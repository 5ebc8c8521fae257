"""Discrete-event simulation of KV placement policies over a workload.

Time model: a request arrives, holds its prompt's KV blocks at once, is prefilled at
`prefill_tokens_per_s`, then decodes at `decode_tokens_per_s`; each time decoding needs a new KV
block the policy gets an update, and at its last token the request departs. Migrations cost no
time in this model: what they cost is counted (items, requests, bytes over links, re-prefilled tokens).
With an instance cap (the scheduler's max_instances, as a live front router has), a request no
instance has room for waits, is retried at each departure (oldest first), and everything it does
later happens that much later; a growth no instance has room for leaves its instance over
capacity (live, the instance router would preempt a request there).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field

from services.placement.move_choice import MoveBudgets, choose_move_modes
from services.placement.registry import make_policy
from services.placement.types import KVSchedulerConfig, Request, SchedulerError
from services.simulator.events import ALLOCATE, DEPART, UPDATE, Events, InstanceProfile, build_events

__all__ = ["InstanceProfile", "SimulationConfig", "SimulationResult", "build_events", "simulate"]


@dataclass(frozen=True, slots=True)
class SimulationConfig:
    """One simulation: the profile, the scheduler knobs, batching and the migration interval."""

    profile: InstanceProfile = field(default_factory=InstanceProfile)
    scheduler: KVSchedulerConfig | None = None  # None: defaults with the profile's capacity
    batch_interval_s: float = 0.0  # 0: each event is its own operation; > 0: one batched step per window
    # > 0: the policy sees the requests' growth once per this period (the latest size of each, as one step: the live
    # front router's policy period), arrivals and departures at once, and the moves it decided meanwhile are made at
    # the period's end, coalesced (at most one per request, none back where it was), as the front's tick drains
    # them; 0: every growth when it happens, every move at once
    update_interval_s: float = 0.0
    # > 0: a move takes this long from the policy's decision to its commit (a live front's pre-copy and stop), as in
    # the front: one of a request that departs sooner is not made, and one is not started (the policy has the request
    # back on its source) while a move of the same request is under way, or max_concurrent_moves are; 0: moves are
    # instant
    move_s: float = 0.0
    max_concurrent_moves: int = 0  # with move_s: moves under way at once (0: any number)
    migration_interval_s: float = 1.0  # the adaptive migration choice packs each interval's moves
    prefill_share: float = 0.25  # share of an instance's prefill throughput re-prefill may use

    def scheduler_config(self) -> KVSchedulerConfig:
        """The scheduler config, its capacity always the profile's."""
        if self.scheduler is None:
            return KVSchedulerConfig(capacity=self.profile.kv_capacity_tokens)
        if self.scheduler.capacity != self.profile.kv_capacity_tokens:
            raise ValueError("scheduler capacity differs from the profile's kv_capacity_tokens")
        return self.scheduler


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """What one policy did over one workload."""

    policy: str
    duration_s: float
    num_admitted: int
    num_rejected: int
    num_allocated: int
    num_departed: int
    num_unplaced: int  # batched runs: arrived and finished inside one window, so never placed
    final_instances: int
    peak_instances: int
    mean_instances: float
    mean_instances_lower_bound: float  # time-average of ceil(live KV / C): no policy can do better (under an
    # instance cap it also counts growth no instance had room for, which live instances would preempt)
    memory_utilization: float  # live KV over the capacity of the instances in use, time-averaged
    migrations: int  # requests moved (after coalescing)
    migration_items: int  # item moves (a request or a multi-item of tiny requests)
    migrations_by_reason: dict[str, int]
    max_items_per_operation: int
    migrated_bytes: int  # KV bytes sent over links
    reprefill_tokens: int  # tokens recomputed at destinations instead of transferred
    deferred_migrations: int  # migrations that waited at least one interval for budget
    oversized_migrations: int  # migrations beyond one interval's budgets, sent as KV over several
    wall_s: float
    timeline: tuple[tuple[float, int], ...] = ()  # (time, instances in use) at every change
    finished_first: int = 0  # with move_s: moves not made, their request departed before the move could commit
    not_started: dict[str, int] = field(default_factory=dict)  # with move_s: moves not started, by why (moving, busy)
    num_waited: int = 0  # with an instance cap: requests that waited for room (their later events shift with them)
    mean_wait_s: float = 0.0  # ... their mean wait

    @property
    def migrations_per_s(self) -> float:
        """Requests migrated per simulated second."""
        return self.migrations / self.duration_s if self.duration_s > 0 else 0.0


def simulate(policy_name: str, events: Events, config: SimulationConfig) -> SimulationResult:
    """Run one policy over the events; deterministic for the same inputs."""
    return _Run(policy_name, events, config).run()


class _Run:
    """Mutable state of one simulation run."""

    def __init__(self, policy_name: str, events: Events, config: SimulationConfig) -> None:
        self.policy = make_policy(policy_name, config.scheduler_config())
        self.events, self.config = events, config
        profile = config.profile
        self.budgets = MoveBudgets.from_profile(
            config.migration_interval_s, profile.link_bytes_per_s, profile.prefill_tokens_per_s,
            profile.kv_bytes_per_token, config.prefill_share)
        self.pending: list = []
        self.by_reason: dict[str, int] = {}
        self.migrations = self.items = self.migrated_bytes = self.reprefill_tokens = self.oversized = 0
        self.deferred: set[tuple[str, int]] = set()  # migrations that waited at least one interval
        # An instance cap (max_instances): a request no instance can take waits (FIFO retries at each departure),
        # and everything it does later happens that much later.
        self.capped = self.policy.config.max_instances is not None
        if self.capped and config.batch_interval_s > 0:
            raise ValueError("an instance cap (max_instances) is simulated event by event: batch_interval_s must be 0")
        if config.batch_interval_s > 0 and config.update_interval_s > 0:
            raise ValueError("batch_interval_s batches every event already: update_interval_s must be 0")
        self.grown: dict[int, int] = {}  # with update_interval_s: request -> its latest size, not seen by the policy
        self.waiting: dict[int, tuple[float, int]] = {}  # request -> (arrived at, prompt KV tokens), in order
        self.held: dict[int, list[tuple[float, int, int]]] = {}  # a waiting request's events (t, kind, kv tokens)
        self.delay: dict[int, float] = {}  # a placed request that waited -> its wait
        self.shifted: list[tuple[float, int, int, int, int]] = []  # heap of (t, kind, order, request, kv tokens)
        self._order = itertools.count()
        if not (math.isfinite(config.move_s) and config.move_s >= 0) or config.max_concurrent_moves < 0:
            raise ValueError(f"move_s must be a finite number >= 0 and max_concurrent_moves >= 0, not "
                             f"{config.move_s}, {config.max_concurrent_moves}")
        self.departs_at = {request: t for t, kind, request in zip(events.time_s, events.kind, events.request)
                           if kind == DEPART} if config.move_s > 0 else {}
        self.finished_first = 0
        self.not_started: dict[str, int] = {}
        self.under_way: list[float] = []  # heap: when each move under way ends
        self.moving_until: dict[int, float] = {}  # request -> when its move under way ends

    def _collect(self, migrations: list) -> None:
        self.pending.extend(migrations)
        self.migrations += len(migrations)
        self.items += len({m.item for m in migrations})
        for migration in migrations:
            self.by_reason[migration.reason] = self.by_reason.get(migration.reason, 0) + 1

    def _made(self, t: float, migrations) -> list:
        """The moves the front router would make of those decided at t, each taking move_s. Not started: a move of
        the same request under way ("moving"), or max_concurrent_moves under way ("busy"); the policy gets the
        request back on its source, as the front pins it. Not made: the request departs before the move commits;
        the policy keeps it on the target until then, as the front's does (the move fails after the departure)."""
        while self.under_way and self.under_way[0] <= t:
            heapq.heappop(self.under_way)
        limit, made = self.config.max_concurrent_moves, []
        for migration in migrations:
            request = int(migration.request_id[1:])
            why = "moving" if self.moving_until.get(request, -math.inf) > t else \
                "busy" if limit and len(self.under_way) >= limit else ""
            if why:
                self.not_started[why] = self.not_started.get(why, 0) + 1
                with contextlib.suppress(SchedulerError):
                    self.policy.pin(migration.request_id, migration.source)
                continue
            departs, commits = self.departs_at[request] + self.delay.get(request, 0.0), t + self.config.move_s
            ends = min(departs, commits)
            heapq.heappush(self.under_way, ends)
            self.moving_until[request] = ends
            if departs <= commits:
                self.finished_first += 1
            else:
                made.append(migration)
        return made

    def _plan(self, final: bool = False) -> None:
        """Choose KV transfer or re-prefill for the pending migrations within this interval's budgets."""
        budgets, bytes_per_token = self.budgets, self.budgets.kv_bytes_per_token
        while self.pending:
            fits = []
            for migration in self.pending:
                if budgets.can_carry(migration):
                    fits.append(migration)
                else:  # beyond one interval's budgets either way: its KV streams over several intervals
                    self.migrated_bytes += migration.kv_tokens * bytes_per_token
                    self.oversized += 1
            plan = choose_move_modes(fits, budgets)
            self.migrated_bytes += plan.transferred_bytes
            self.reprefill_tokens += plan.reprefill_tokens
            self.pending = list(plan.deferred)
            self.deferred.update((m.request_id, m.item) for m in plan.deferred)
            if not final:
                return  # otherwise loop: every round places at least one (each fits a fresh budget)

    def _advance(self, t: float) -> None:
        """Integrate the metrics up to time t (state is constant since the last change)."""
        if t <= self.last_t:
            return
        dt = t - self.last_t
        self.area_instances += self.count * dt
        self.area_tokens += self.total * dt
        self.area_bound += -(-self.total // self.capacity) * dt
        self.last_t = t
        if t >= self.next_plan:
            self._plan()
            interval = self.config.migration_interval_s
            self.next_plan = self.first_t + (math.floor((t - self.first_t) / interval) + 1) * interval

    def _observe(self, t: float, migrations) -> None:
        if migrations and self.config.move_s > 0:
            migrations = self._made(t, migrations)
        if migrations:
            self._collect(migrations)
        self.count, self.total = self.policy.num_instances, self.policy.total_kv_tokens
        if self.count != self.timeline[-1][1]:
            self.timeline.append((t, self.count))
            self.peak = max(self.peak, self.count)

    def run(self) -> SimulationResult:
        started = time.perf_counter()
        policy, events = self.policy, self.events
        self.capacity = policy.config.capacity
        ids = [f"r{i}" for i in range(max(events.request, default=-1) + 1)]
        first_t = self.last_t = events.time_s[0] if events.time_s else 0.0
        self.first_t = first_t
        self.next_plan = first_t + self.config.migration_interval_s
        self.area_instances = self.area_tokens = self.area_bound = 0.0
        self.count = self.total = self.peak = 0
        self.timeline = [(first_t, 0)]
        allocated = departed = unplaced = 0
        window, period = self.config.batch_interval_s, self.config.update_interval_s
        batch, window_end, next_update = _Batch(), first_t + window, first_t + period
        for t, kind, request, kv_tokens in self._in_order(events):
            if period > 0 and t >= next_update:
                self._apply_growth(next_update, ids)  # with the moves decided since the last period's end
                next_update = first_t + (math.floor((t - first_t) / period) + 1) * period
            if window > 0:
                if t >= window_end:
                    self._advance(window_end)
                    placed, gone, result = batch.apply(policy, ids)
                    allocated, departed = allocated + placed, departed + gone
                    self._observe(window_end, result.migrations)
                    window_end = first_t + (math.floor((t - first_t) / window) + 1) * window
                unplaced += batch.add(kind, request, kv_tokens)
                continue
            if request < 0:  # an event of a request that waited, at its shifted time
                request = -1 - request
            elif self.capped and self._wait_or_shift(t, kind, request, kv_tokens):
                continue
            self._advance(t)
            if kind == UPDATE and period > 0:
                self.grown[request] = kv_tokens  # seen at the end of the period
                continue
            if kind == UPDATE:
                self._update(ids[request], kv_tokens)
            elif kind == DEPART:
                self.grown.pop(request, None)
                policy.depart(ids[request])
                departed += 1
                allocated += self._admit_waiting(t, ids)
            elif self._allocate(ids[request], kv_tokens):
                allocated += 1
            else:
                self.waiting[request], self.held[request] = (t, kv_tokens), []
            if period <= 0:
                self._observe(t, policy.drain_migrations())
        if period > 0:  # what the last period decided (its end is past the last event: no time added)
            self._apply_growth(self.last_t, ids)
        if window > 0:
            end = max(self.last_t, window_end if events.time_s else first_t)
            self._advance(end)
            placed, gone, result = batch.apply(policy, ids)
            allocated, departed = allocated + placed, departed + gone
            self._observe(end, result.migrations)
        self._plan(final=True)
        if self.waiting:
            raise RuntimeError(f"{len(self.waiting)} requests never found room under the instance cap")
        duration = self.last_t - first_t
        area = self.area_instances
        return SimulationResult(
            policy=policy.name, duration_s=duration, num_admitted=events.num_admitted,
            num_rejected=events.num_rejected, num_allocated=allocated, num_departed=departed,
            num_unplaced=unplaced, final_instances=self.count, peak_instances=self.peak,
            mean_instances=area / duration if duration else 0.0,
            mean_instances_lower_bound=self.area_bound / duration if duration else 0.0,
            memory_utilization=self.area_tokens / (area * self.capacity) if area else 0.0,
            migrations=self.migrations, migration_items=self.items, migrations_by_reason=dict(self.by_reason),
            max_items_per_operation=policy.max_operation_items, migrated_bytes=self.migrated_bytes,
            reprefill_tokens=self.reprefill_tokens, deferred_migrations=len(self.deferred),
            oversized_migrations=self.oversized,
            wall_s=time.perf_counter() - started, timeline=tuple(self.timeline),
            num_waited=len(self.delay), mean_wait_s=sum(self.delay.values()) / len(self.delay) if self.delay else 0.0,
            finished_first=self.finished_first, not_started=dict(self.not_started),
        )

    # ---- an instance cap: requests wait for room ------------------------------------------------------------
    def _in_order(self, events: Events):
        """The events by time, with the shifted events of requests that waited merged in (as (t, kind) order)."""
        shifted = self.shifted
        for event in zip(events.time_s, events.kind, events.request, events.kv_tokens):
            while shifted and (shifted[0][0], shifted[0][1]) <= (event[0], event[1]):
                t, kind, _, request, kv_tokens = heapq.heappop(shifted)
                yield t, kind, -1 - request, kv_tokens  # negative: already shifted
            yield event
        while shifted:
            t, kind, _, request, kv_tokens = heapq.heappop(shifted)
            yield t, kind, -1 - request, kv_tokens

    def _wait_or_shift(self, t: float, kind: int, request: int, kv_tokens: int) -> bool:
        """True when the event is not for now: its request waits for room (held), or waited and the event
        happens later by its wait (queued again, shifted)."""
        if request in self.held:
            self.held[request].append((t, kind, kv_tokens))
            return True
        if request in self.delay:
            heapq.heappush(self.shifted, (t + self.delay[request], kind, next(self._order), request, kv_tokens))
            return True
        return False

    def _allocate(self, request_id: str, kv_tokens: int) -> bool:
        try:
            self.policy.allocate(request_id, kv_tokens)
        except SchedulerError:
            if not self.capped:
                raise
            with contextlib.suppress(SchedulerError):
                self.policy.depart(request_id)  # placed on an instance it could not open: undo
            return False
        return True

    def _apply_growth(self, t: float, ids: list[str]) -> None:
        """The period's growth as one step, as the front router hands it to its policy (`grow`: one by one when a
        growth has no instance under the cap; without a cap every growth has one, and an error is raised), and the
        moves decided since the last period's end with it, coalesced."""
        self._advance(t)
        updates, self.grown = [Request(ids[r], tokens) for r, tokens in self.grown.items()], {}
        migrations = self.policy.grow(updates) if self.capped else self.policy.step((), updates, ()).migrations
        self._observe(t, migrations)

    def _update(self, request_id: str, kv_tokens: int) -> None:
        try:
            self.policy.update(request_id, kv_tokens)
        except SchedulerError:  # its growth needs an instance the cap does not allow: its instance stays overfull
            if not self.capped:
                raise

    def _admit_waiting(self, t: float, ids: list[str]) -> int:
        """Place the waiting requests that fit now, oldest first; their held events happen later by their wait."""
        placed = 0
        for request, (arrived, kv_tokens) in list(self.waiting.items()):
            if not self._allocate(ids[request], kv_tokens):
                continue
            del self.waiting[request]
            wait = self.delay[request] = t - arrived
            for at, kind, tokens in self.held.pop(request):
                heapq.heappush(self.shifted, (at + wait, kind, next(self._order), request, tokens))
            placed += 1
        return placed


class _Batch:
    """Operations of one batching window, with redundant ones cancelled before the step."""

    def __init__(self) -> None:
        self.departs: list[int] = []
        self.updates: dict[int, int] = {}
        self.allocates: dict[int, int] = {}

    def add(self, kind: int, request: int, kv_tokens: int) -> int:
        """Queue one event; return 1 when a request arrived and finished inside the window (never placed)."""
        if kind == ALLOCATE:
            self.allocates[request] = kv_tokens
        elif kind == UPDATE:
            (self.allocates if request in self.allocates else self.updates)[request] = kv_tokens
        elif request in self.allocates:
            del self.allocates[request]
            return 1
        else:
            self.updates.pop(request, None)
            self.departs.append(request)
        return 0

    def apply(self, policy, ids: list[str]):
        """Run the window as one step; return (requests placed, requests departed, the step result)."""
        result = policy.step([ids[r] for r in self.departs], [Request(ids[r], t) for r, t in self.updates.items()],
                             [Request(ids[r], t) for r, t in self.allocates.items()])
        counts = (len(result.placements), len(self.departs))
        self.departs, self.updates, self.allocates = [], {}, {}
        return counts[0], counts[1], result
