"""The interface the router calls per step, a base class that validates and batches, and the registry."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from services.placement.cluster import Cluster, instance_index, instance_name
from services.placement.types import (
    InstanceState, KVSchedulerConfig, Move, Placement, Request, SchedulerError, StepResult,
)

POLICY_NAMES = ("mell", "bf", "wf", "lb")


class KVPlacementPolicy(Protocol):
    """Online placement of requests' KV on instances, with live migration between them."""

    def allocate(self, request_id: str, kv_tokens: int) -> str:
        """Place a new request; return its instance id (a new instance may be opened)."""

    def update(self, request_id: str, kv_tokens: int) -> None:
        """A request's KV changed size (it grows by decoding)."""

    def depart(self, request_id: str) -> None:
        """A request finished; its KV is freed."""

    def step(self, departs: Iterable[str], updates: Iterable[Request], allocates: Iterable[Request]) -> StepResult:
        """A batch of operations: departs, then updates, then allocates; migrations coalesced."""

    def drain_migrations(self) -> list[Move]:
        """Moves decided since the last call, redundant ones cancelled, at most one per request."""

    def instances(self) -> Mapping[str, InstanceState]:
        """Instances in use (idle ones are released at once)."""


class BasePolicy:
    """Validation, per-operation accounting and batching shared by every policy; subclasses decide moves."""

    name = "base"

    def __init__(self, config: KVSchedulerConfig) -> None:
        self.config = config
        self.cluster = Cluster(config)
        self.max_operation_items = 0  # most item moves one operation ever made
        self.num_operations = 0
        self.in_step = False  # inside a batched step: work that can wait for its end waits

    # -- the interface ---------------------------------------------------------------------
    def allocate(self, request_id: str, kv_tokens: int) -> str:
        """Place a new request; return its instance id (a new instance may be opened)."""
        if request_id in self.cluster.location:
            raise SchedulerError(f"request {request_id!r} is already placed")
        self._check_size(request_id, kv_tokens)
        self._run(self._allocate, request_id, kv_tokens)
        self.cluster.forget_moves((request_id,))  # the caller learns the final place, not a path to it
        return instance_name(self.cluster.location[request_id])

    def update(self, request_id: str, kv_tokens: int) -> None:
        """A request's KV changed size (it grows by decoding)."""
        if request_id not in self.cluster.location:
            raise SchedulerError(f"unknown request {request_id!r}")
        self._check_size(request_id, kv_tokens)
        self._run(self._update, request_id, kv_tokens)

    def depart(self, request_id: str) -> None:
        """A request finished; its KV is freed."""
        if request_id not in self.cluster.location:
            raise SchedulerError(f"unknown request {request_id!r}")
        self._run(self._depart, request_id)

    def step(self, departs: Iterable[str], updates: Iterable[Request], allocates: Iterable[Request]) -> StepResult:
        """A batch of operations: departs, then updates, then allocates; migrations coalesced."""
        self.in_step = True
        try:
            for request_id in departs:
                self.depart(request_id)
            for request in updates:
                self.update(request.request_id, request.kv_tokens)
            new_ids = []
            for request in allocates:
                self.allocate(request.request_id, request.kv_tokens)
                new_ids.append(request.request_id)
        finally:
            self.in_step = False
        self._run(self._end_step)
        self.cluster.forget_moves(new_ids)  # placed after everything that moved them in this step
        placements = tuple(
            Placement(request_id, instance_name(self.cluster.location[request_id]))
            for request_id in new_ids if request_id in self.cluster.location
        )
        return StepResult(placements, tuple(self.drain_migrations()))

    def drain_migrations(self) -> list[Move]:
        """Moves decided since the last call, redundant ones cancelled, at most one per request."""
        return self.cluster.drain()

    def grow(self, updates: Sequence[Request]) -> list[Move]:
        """A period's growth of the requests as one step (a front router's policy tick); when a growth has no room
        (every instance in use under the cap) and the step raises, each update alone, those without room left
        where they are (their instance over capacity: the instance itself preempts). Returns the moves."""
        try:
            return list(self.step((), updates, ()).migrations)
        except SchedulerError:
            for update in updates:
                with contextlib.suppress(SchedulerError):
                    self.update(update.request_id, update.kv_tokens)
            return self.drain_migrations()

    def set_max_instances(self, max_instances: int | None) -> None:
        """Instances may be added or removed while it runs (the front router's operator): the cap from now on
        (instances already open stay, even past a lower cap)."""
        config = dataclasses.replace(self.config, max_instances=max_instances)  # validated again
        self.config = self.cluster.config = config

    def pin(self, request_id: str, instance_id: str | None) -> str:
        """Record where a request really is, with no migration: a move the caller could not carry out (it is still
        on the move's source), or one made outside the policy (an operator's). `instance_id` None: a new instance.
        Its slot is opened again if it had been released. Returns the request's instance id. The invariants may
        not hold afterwards; later operations repair them."""
        if request_id not in self.cluster.location:
            raise SchedulerError(f"unknown request {request_id!r}")
        index = self.cluster.open() if instance_id is None else instance_index(instance_id)
        if index != self.cluster.location[request_id]:
            self.cluster.reopen(index)
            self.cluster.move((request_id,), index, "pin")
            self.cluster.forget_moves((request_id,))
        return instance_name(index)

    def instances(self) -> Mapping[str, InstanceState]:
        """Instances in use (idle ones are released at once)."""
        return self.cluster.snapshot()

    @property
    def num_instances(self) -> int:
        """How many instances are in use now (cheap)."""
        return len(self.cluster.loads)

    @property
    def total_kv_tokens(self) -> int:
        """KV tokens held by all live requests."""
        return self.cluster.total_tokens

    # -- for subclasses --------------------------------------------------------------------
    def _allocate(self, request_id: str, kv_tokens: int) -> None:
        raise NotImplementedError

    def _update(self, request_id: str, kv_tokens: int) -> None:
        raise NotImplementedError

    def _depart(self, request_id: str) -> None:
        raise NotImplementedError

    def _end_step(self) -> None:
        """Work deferred to the end of a batched step (an operation of its own)."""

    def _run(self, operation, *args) -> None:
        self.cluster.op_items = 0
        operation(*args)
        self.num_operations += 1
        self.max_operation_items = max(self.max_operation_items, self.cluster.op_items)

    def _check_size(self, request_id: str, kv_tokens: int) -> None:
        if not 0 < kv_tokens <= self.config.capacity:
            raise SchedulerError(
                f"request {request_id!r}: {kv_tokens} KV tokens do not fit an instance of {self.config.capacity}")

    def _overflow_victim(self, index: int) -> str:
        """The request to move off an over-full instance: the smallest that alone ends the overflow."""
        members = self.cluster.members[index]
        overflow = self.cluster.loads[index] - self.config.capacity
        enough = [(tokens, request_id) for request_id, tokens in members.items() if tokens >= overflow]
        if enough:
            return min(enough)[1]
        return max((tokens, request_id) for request_id, tokens in members.items())[1]

