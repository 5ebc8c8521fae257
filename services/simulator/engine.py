"""Discrete-event simulation of KV placement policies over a workload.

Time model: a request arrives, holds its prompt's KV blocks at once, is prefilled at
`prefill_tokens_per_s`, then decodes at `decode_tokens_per_s`; each time decoding needs a new KV
block the policy gets an update, and at its last token the request departs. Migrations cost no
time in this model: what they cost is counted (items, requests, bytes over links, re-prefilled tokens).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from services.router.kv_scheduler.migration_choice import MigrationBudgets, choose_migration_modes
from services.router.kv_scheduler.policy import make_policy
from services.router.kv_scheduler.types import KVSchedulerConfig, Request
from services.simulator.events import ALLOCATE, DEPART, UPDATE, Events, InstanceProfile, build_events

__all__ = ["InstanceProfile", "SimulationConfig", "SimulationResult", "build_events", "simulate"]


@dataclass(frozen=True, slots=True)
class SimulationConfig:
    """One simulation: the profile, the scheduler knobs, batching and the migration interval."""

    profile: InstanceProfile = field(default_factory=InstanceProfile)
    scheduler: KVSchedulerConfig | None = None  # None: defaults with the profile's capacity
    batch_interval_s: float = 0.0  # 0: each event is its own operation; > 0: one batched step per window
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
    mean_instances_lower_bound: float  # time-average of ceil(live KV / C): no policy can do better
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
        self.budgets = MigrationBudgets.from_profile(
            config.migration_interval_s, profile.link_bytes_per_s, profile.prefill_tokens_per_s,
            profile.kv_bytes_per_token, config.prefill_share)
        self.pending: list = []
        self.by_reason: dict[str, int] = {}
        self.migrations = self.items = self.migrated_bytes = self.reprefill_tokens = self.oversized = 0
        self.deferred: set[tuple[str, int]] = set()  # migrations that waited at least one interval

    def _collect(self, migrations: list) -> None:
        self.pending.extend(migrations)
        self.migrations += len(migrations)
        self.items += len({m.item for m in migrations})
        for migration in migrations:
            self.by_reason[migration.reason] = self.by_reason.get(migration.reason, 0) + 1

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
            plan = choose_migration_modes(fits, budgets)
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
        window = self.config.batch_interval_s
        batch, window_end = _Batch(), first_t + window
        for t, kind, request, kv_tokens in zip(events.time_s, events.kind, events.request, events.kv_tokens):
            if window > 0:
                if t >= window_end:
                    self._advance(window_end)
                    placed, gone, result = batch.apply(policy, ids)
                    allocated, departed = allocated + placed, departed + gone
                    self._observe(window_end, result.migrations)
                    window_end = first_t + (math.floor((t - first_t) / window) + 1) * window
                unplaced += batch.add(kind, request, kv_tokens)
                continue
            self._advance(t)
            if kind == UPDATE:
                policy.update(ids[request], kv_tokens)
            elif kind == DEPART:
                policy.depart(ids[request])
                departed += 1
            else:
                policy.allocate(ids[request], kv_tokens)
                allocated += 1
            self._observe(t, policy.drain_migrations())
        if window > 0:
            end = max(self.last_t, window_end if events.time_s else first_t)
            self._advance(end)
            placed, gone, result = batch.apply(policy, ids)
            allocated, departed = allocated + placed, departed + gone
            self._observe(end, result.migrations)
        self._plan(final=True)
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
        )


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
