"""Adaptive migration choice (MELL section V): move a request's KV blocks, or its tokens to re-prefill.

Each scheduling interval has two kinds of bins: a transfer budget per directed link (bytes) and a
prefill budget per destination instance (tokens). Every migration goes into one of its two bins or
waits for the next interval. Greedy two-bin packing: largest migrations first, each into the option
that uses the smaller fraction of what is left of its bin.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from services.placement.types import Move


@dataclass(frozen=True, slots=True)
class MoveBudgets:
    """What one interval may spend on migrations: bytes per directed link, prefill tokens per instance."""

    kv_bytes_per_token: int
    link_bytes: int  # default budget of a (source, destination) link
    prefill_tokens: int  # default re-prefill budget of a destination instance
    link_overrides: Mapping[tuple[str, str], int] = field(default_factory=dict)  # e.g. slower cross-node links
    prefill_overrides: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token < 1:
            raise ValueError("kv_bytes_per_token must be >= 1")
        if self.link_bytes < 0 or self.prefill_tokens < 0:
            raise ValueError("budgets must be >= 0")

    @classmethod
    def from_profile(cls, interval_s: float, link_bytes_per_s: float, prefill_tokens_per_s: float,
                     kv_bytes_per_token: int, prefill_share: float = 0.25) -> MoveBudgets:
        """Budgets of an interval from bandwidth and prefill throughput; re-prefill may use `prefill_share`."""
        if interval_s <= 0 or not 0 <= prefill_share <= 1:
            raise ValueError("need interval_s > 0 and prefill_share in [0, 1]")
        return cls(kv_bytes_per_token, int(link_bytes_per_s * interval_s),
                   int(prefill_tokens_per_s * interval_s * prefill_share))

    def link_budget(self, source: str, destination: str) -> int:
        """Transfer bytes the link source -> destination may carry this interval."""
        return self.link_overrides.get((source, destination), self.link_bytes)

    def prefill_budget(self, instance_id: str) -> int:
        """Tokens an instance may re-prefill for migrated requests this interval."""
        return self.prefill_overrides.get(instance_id, self.prefill_tokens)

    def can_carry(self, migration: Move) -> bool:
        """Whether an interval with nothing else to do could carry the migration either way."""
        return (migration.kv_tokens * self.kv_bytes_per_token <= self.link_budget(migration.source,
                                                                                 migration.destination)
                or migration.kv_tokens <= self.prefill_budget(migration.destination))


@dataclass(frozen=True, slots=True)
class MigrationPlan:
    """How each migration of an interval is carried out; deferred ones wait for the next interval."""

    kv_transfers: tuple[Move, ...]
    reprefills: tuple[Move, ...]
    deferred: tuple[Move, ...]
    kv_bytes_per_token: int

    @property
    def transferred_bytes(self) -> int:
        """KV bytes sent over links."""
        return sum(m.kv_tokens for m in self.kv_transfers) * self.kv_bytes_per_token

    @property
    def reprefill_tokens(self) -> int:
        """Tokens recomputed at destinations."""
        return sum(m.kv_tokens for m in self.reprefills)


def choose_move_modes(migrations: Iterable[Move], budgets: MoveBudgets) -> MigrationPlan:
    """Assign each migration to KV transfer, re-prefill or deferral within the interval's budgets."""
    link_left: dict[tuple[str, str], int] = {}
    prefill_left: dict[str, int] = {}
    transfers, reprefills, deferred = [], [], []
    for migration in sorted(migrations, key=lambda m: (-m.kv_tokens, m.request_id)):
        link = (migration.source, migration.destination)
        link_room = link_left.setdefault(link, budgets.link_budget(*link))
        prefill_room = prefill_left.setdefault(migration.destination, budgets.prefill_budget(migration.destination))
        transfer_cost = migration.kv_tokens * budgets.kv_bytes_per_token
        prefill_cost = migration.kv_tokens
        fits_transfer = transfer_cost <= link_room
        fits_prefill = prefill_cost <= prefill_room
        if fits_transfer and fits_prefill:
            # The option taking the smaller share of what its bin has left (ties keep compute free).
            fits_prefill = prefill_cost * link_room < transfer_cost * prefill_room
            fits_transfer = not fits_prefill
        if fits_transfer:
            link_left[link] = link_room - transfer_cost
            transfers.append(migration)
        elif fits_prefill:
            prefill_left[migration.destination] = prefill_room - prefill_cost
            reprefills.append(migration)
        else:
            deferred.append(migration)
    return MigrationPlan(tuple(transfers), tuple(reprefills), tuple(deferred), budgets.kv_bytes_per_token)
