"""Book-keeping shared by every policy: instances in use, their requests and loads, and the move log."""

from __future__ import annotations

import heapq

from services.placement.types import (
    InstanceState, KVSchedulerConfig, Move, SchedulerError, SizeClass, size_class,
)

Unit = tuple[tuple[str, ...], int]  # (request ids moved together, their KV tokens)


def instance_name(index: int) -> str:
    """The public id of instance slot `index`."""
    return f"instance-{index}"


def instance_index(instance_id: str) -> int:
    """The slot of a public instance id (ValueError for one this module did not make)."""
    prefix, _, number = instance_id.rpartition("-")
    if prefix != "instance" or not number.isdigit():
        raise ValueError(f"not an instance id: {instance_id!r}")
    return int(number)


def group_items(requests: list[tuple[str, int]], capacity: int) -> list[Unit]:
    """Requests leaving one instance as items: each above C/8 alone, tiny ones in multi-items up to C/4.

    Multi-items are filled in order, so every one except possibly the last exceeds C/8.
    """
    items: list[Unit] = []
    group: list[str] = []
    group_tokens = 0
    for request_id, tokens in requests:
        if tokens * 8 > capacity:
            items.append(((request_id,), tokens))
            continue
        if group and group_tokens + tokens > capacity // 4:
            items.append((tuple(group), group_tokens))
            group, group_tokens = [], 0
        group.append(request_id)
        group_tokens += tokens
    if group:
        items.append((tuple(group), group_tokens))
    return items


class Cluster:
    """Instances in use (an instance with no request is released at once) and every move made."""

    def __init__(self, config: KVSchedulerConfig) -> None:
        self.config = config
        self.capacity = config.capacity
        self.loads: dict[int, int] = {}  # instance index -> KV tokens in use
        self.members: dict[int, dict[str, int]] = {}  # instance index -> {request id: KV tokens}
        self.class_counts: dict[int, list[int]] = {}  # instance index -> requests per SizeClass
        self.location: dict[str, int] = {}  # request id -> instance index
        self.total_tokens = 0
        self._free_slots: list[int] = []  # released indices, reused smallest first
        self._next_slot = 0
        self._log: list[tuple[str, int, int, str, int]] = []  # (request, source, destination, reason, item)
        self._next_item = 0
        self.op_items = 0  # item moves made by the current operation
        self.dirty: set[int] = set()  # instances changed since the owner last looked

    # -- instances -------------------------------------------------------------------------
    def open(self) -> int:
        """Open a new (empty) instance and return its index."""
        self._check_room()
        if self._free_slots:
            index = heapq.heappop(self._free_slots)
        else:
            index, self._next_slot = self._next_slot, self._next_slot + 1
        self._activate(index)
        return index

    def reopen(self, index: int) -> None:
        """Open the released slot `index` again (a request the caller could not move is still there)."""
        if index in self.loads:
            return
        self._check_room()
        if index in self._free_slots:
            self._free_slots.remove(index)
            heapq.heapify(self._free_slots)
        elif index >= self._next_slot:
            self._free_slots.extend(range(self._next_slot, index))
            heapq.heapify(self._free_slots)
            self._next_slot = index + 1
        self._activate(index)

    def _check_room(self) -> None:
        if self.config.max_instances is not None and len(self.loads) >= self.config.max_instances:
            raise SchedulerError(f"all {self.config.max_instances} instances are in use")

    def _activate(self, index: int) -> None:
        self.loads[index] = 0
        self.members[index] = {}
        self.class_counts[index] = [0] * len(SizeClass)

    def _release_if_empty(self, index: int) -> None:
        if not self.members[index]:
            del self.loads[index], self.members[index], self.class_counts[index]
            heapq.heappush(self._free_slots, index)

    def node(self, index: int) -> int:
        """The node an instance slot lives on (for locality)."""
        return index // self.config.instances_per_node

    def largest_class(self, index: int) -> SizeClass:
        """Class of the largest request on an instance (bundles of tiny requests count as T)."""
        counts = self.class_counts[index]
        for size in (SizeClass.L, SizeClass.M, SizeClass.S):
            if counts[size]:
                return size
        return SizeClass.T

    def units(self, index: int) -> list[Unit]:
        """The movable items of an instance (see `group_items`), its requests in placement order."""
        return group_items(list(self.members[index].items()), self.capacity)

    # -- requests --------------------------------------------------------------------------
    def add(self, request_id: str, kv_tokens: int, index: int) -> None:
        """Place a new request on an instance (capacity is the caller's check)."""
        self.members[index][request_id] = kv_tokens
        self.loads[index] += kv_tokens
        self.class_counts[index][size_class(kv_tokens, self.capacity)] += 1
        self.location[request_id] = index
        self.total_tokens += kv_tokens
        self.dirty.add(index)

    def remove(self, request_id: str) -> int:
        """Drop a request; return the instance it was on (released if now empty)."""
        index = self.location.pop(request_id)
        kv_tokens = self.members[index].pop(request_id)
        self.loads[index] -= kv_tokens
        self.class_counts[index][size_class(kv_tokens, self.capacity)] -= 1
        self.total_tokens -= kv_tokens
        self.dirty.add(index)
        self._release_if_empty(index)
        return index

    def resize(self, request_id: str, kv_tokens: int) -> int:
        """Set a request's KV size; return its instance (which may now be over capacity)."""
        index = self.location[request_id]
        old = self.members[index][request_id]
        self.members[index][request_id] = kv_tokens
        self.loads[index] += kv_tokens - old
        self.total_tokens += kv_tokens - old
        counts = self.class_counts[index]
        counts[size_class(old, self.capacity)] -= 1
        counts[size_class(kv_tokens, self.capacity)] += 1
        self.dirty.add(index)
        return index

    def move(self, request_ids: tuple[str, ...], destination: int, reason: str) -> None:
        """Move requests (one item) to `destination`; the emptied source is released."""
        item, self._next_item = self._next_item, self._next_item + 1
        self.op_items += 1
        sources = set()
        for request_id in request_ids:
            source = self.location[request_id]
            kv_tokens = self.members[source].pop(request_id)
            self.loads[source] -= kv_tokens
            self.class_counts[source][size_class(kv_tokens, self.capacity)] -= 1
            self.members[destination][request_id] = kv_tokens
            self.loads[destination] += kv_tokens
            self.class_counts[destination][size_class(kv_tokens, self.capacity)] += 1
            self.location[request_id] = destination
            self._log.append((request_id, source, destination, reason, item))
            sources.add(source)
        self.dirty.update(sources)
        self.dirty.add(destination)
        for source in sources:
            self._release_if_empty(source)

    # -- outputs ---------------------------------------------------------------------------
    def drain(self) -> list[Move]:
        """Moves since the last drain, coalesced per request: A->B->C is A->C, A->B->A and departed vanish."""
        if not self._log:
            return []
        first: dict[str, tuple[int, int, str, int]] = {}  # request -> (source, destination, reason, item)
        for request_id, source, destination, reason, item in self._log:
            if request_id in first:
                source = first[request_id][0]
            first[request_id] = (source, destination, reason, item)
        self._log.clear()
        migrations = []
        for request_id, (source, destination, reason, item) in first.items():
            if source == destination or self.location.get(request_id) != destination:
                continue  # back where it started, or departed (its KV is gone)
            migrations.append(Move(
                request_id, self.members[destination][request_id], instance_name(source),
                instance_name(destination), reason, item,
            ))
        return migrations

    def forget_moves(self, request_ids) -> None:
        """Drop logged moves of these requests (they were placed after the moves, not before)."""
        request_ids = set(request_ids)
        if request_ids and self._log:
            self._log = [entry for entry in self._log if entry[0] not in request_ids]

    def snapshot(self) -> dict[str, InstanceState]:
        """Every instance in use, as immutable states keyed by instance id."""
        return {
            instance_name(index): InstanceState(instance_name(index), self.capacity, self.loads[index],
                                                dict(self.members[index]))
            for index in sorted(self.loads)
        }
