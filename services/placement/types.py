"""Contracts of the multi-instance KV scheduler: size classes, config, requests, instances, migrations."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum


class SchedulerError(RuntimeError):
    """A request cannot be placed (too large, unknown, duplicate, or no instance may be opened)."""


class SizeClass(IntEnum):
    """MELL's request classes by KV size relative to the instance capacity C."""

    TINY = 0  # (0, C/8]: grouped into multi-items of size <= C/4
    T = 1  # (C/8, C/4]
    S = 2  # (C/4, C/3]
    M = 3  # (C/3, C/2]
    L = 4  # (C/2, C]


def size_class(kv_tokens: int, capacity: int) -> SizeClass:
    """The class of a request holding `kv_tokens` on an instance of `capacity` tokens (exact integer test)."""
    if kv_tokens * 2 > capacity:
        return SizeClass.L
    if kv_tokens * 3 > capacity:
        return SizeClass.M
    if kv_tokens * 4 > capacity:
        return SizeClass.S
    if kv_tokens * 8 > capacity:
        return SizeClass.T
    return SizeClass.TINY


@dataclass(frozen=True, slots=True)
class KVSchedulerConfig:
    """Knobs of every placement policy; capacity is the KV tokens one instance holds."""

    capacity: int
    max_migrations_per_op: int = 10  # item moves (a request or a multi-item of tiny requests) per operation
    # Priority of a target instance: load_weight * fullness after placement
    #   - free_memory_weight * (shortfall of its growth headroom, as a fraction of that headroom)
    #   + locality_weight * (on the source's node). Headroom: growth_headroom * C plus
    #   growth_reserve_per_request per request the target would hold.
    load_weight: float = 1.0
    free_memory_weight: float = 1.0
    locality_weight: float = 0.05
    growth_headroom: float = 1 / 32  # fraction of C a target should keep free for decode growth
    max_deficient_per_category: int = 2  # MELL: the constant number of exceptions to the fill invariant
    consolidation_max_load: float = 0.75  # MELL drains an instance only when it is at most this full
    consolidation_headroom: float = 1 / 16  # free fraction each receiver keeps after a drain
    consolidation_slack: float = 0.25  # free capacity (in instances) the others must keep after a drain
    consolidation_max_utilization: float = 0.9  # ... and the utilization they may reach
    growth_reserve_per_request: int = 16  # headroom tokens a target keeps per request (about a KV block)
    balance_threshold: float = 0.2  # LB: migrate when max - min utilization exceeds this
    instances_per_node: int = 8  # instance i lives on node i // instances_per_node (locality)
    max_instances: int | None = None  # None: open instances on demand without limit

    def __post_init__(self) -> None:
        if self.capacity < 8:
            raise ValueError(f"capacity must be >= 8 tokens, got {self.capacity}")
        if self.max_migrations_per_op < 1:
            raise ValueError("max_migrations_per_op must be >= 1 (an overflow always needs one move)")
        for name in ("load_weight", "free_memory_weight", "locality_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("growth_headroom", "consolidation_headroom", "balance_threshold"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1)")
        for name in ("consolidation_max_load", "consolidation_max_utilization"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1]")
        if self.growth_reserve_per_request < 0:
            raise ValueError("growth_reserve_per_request must be >= 0")
        if self.max_deficient_per_category < 1:
            raise ValueError("max_deficient_per_category must be >= 1")
        if self.consolidation_slack < 0:
            raise ValueError("consolidation_slack must be >= 0")
        if self.instances_per_node < 1:
            raise ValueError("instances_per_node must be >= 1")
        if self.max_instances is not None and self.max_instances < 1:
            raise ValueError("max_instances must be >= 1 or None")


@dataclass(frozen=True, slots=True)
class Request:
    """A live request and the KV tokens it holds now."""

    request_id: str
    kv_tokens: int


@dataclass(frozen=True, slots=True)
class InstanceState:
    """A snapshot of one instance in use: its capacity, KV load and requests."""

    instance_id: str
    capacity: int
    kv_tokens: int
    requests: Mapping[str, int] = field(default_factory=dict)  # request id -> KV tokens

    @property
    def free_tokens(self) -> int:
        """KV tokens still free."""
        return self.capacity - self.kv_tokens

    @property
    def utilization(self) -> float:
        """Fraction of the capacity in use."""
        return self.kv_tokens / self.capacity


@dataclass(frozen=True, slots=True)
class Move:
    """Move one request's KV from `source` to `destination`; requests moved together share `item`."""

    request_id: str
    kv_tokens: int
    source: str
    destination: str
    reason: str  # "overflow" (growth over capacity), "repair" (invariant), "consolidate", "balance"
    item: int  # id of the item move (a request or a multi-item of tiny requests) this belongs to


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a newly allocated request went."""

    request_id: str
    instance_id: str


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one batched scheduler step decided: new placements and the coalesced migrations."""

    placements: tuple[Placement, ...]
    migrations: tuple[Move, ...]
