"""MELL: online placement of requests' KV on instances with bounded live migration (Liu et al.).

Requests are classed by KV size against the instance capacity C (L > C/2 >= M > C/3 >= S > C/4 >= T >
C/8 >= tiny); tiny requests move as multi-items of at most C/4, every one but the last above C/8 (so an
instance at most 3/4 full leaves in at most six item moves). An *item move* is one request, or one
multi-item of tiny requests, going from one instance to another. Operations:

- Allocate: the instance with the best priority (fullness after placement, minus a penalty for eating
  into its growth headroom, which grows with the requests it holds, plus locality) among those with
  room; a new instance only when none has.
- Update: a request's KV grew and its class may rise. While its instance is over C, move off the item
  that leaves the instance non-deficient, then restores the growth headroom, with the fewest requests
  and tokens: one request, or the smallest tiny requests together (< C/4 while growth <= C/8).
- Depart: drop the request, then consolidate: drain the least loaded instance (at most
  `consolidation_max_load` full) into the others when its items fit the move budget, every receiver
  keeps `consolidation_headroom` free, the others keep `consolidation_slack` instances of free room in
  all and stay at most `consolidation_max_utilization` full (else arrivals soon reopen an instance),
  and the invariants still hold afterwards. In a batched step this runs once, after the allocations.
- After every operation, repair: while a category (T, S or M, see `invariants`) has more than K
  deficient instances, move requests from its lightest to its heaviest deficient instance, lower
  classes first and then largest first, until the heavier is no longer deficient.

Guarantees after every operation (property-tested):
  G1 no instance holds more than C tokens;
  G2 an operation makes at most `max_migrations_per_op` item moves;
  G3 when `max_migrations_per_op >= 7` and no update grows a request by more than C/8: each of T, S and M
     has at most K = `max_deficient_per_category` deficient instances (`invariant_violations` is empty).
Why G3: an operation leaves at most one instance newly deficient (the one it shrank or grew, or a new
instance opened for an overflow, since the overflow item leaves its source non-deficient) and raising
a category never makes a non-deficient instance deficient (thresholds fall as categories rise); so at
most one category reaches K + 1, and one repair fixes it in <= 6 item moves: the lighter instance holds
<= 3/4 C, hence <= 6 items, and each fits the heavier while that one is still deficient (items of a
T-, S-, M-instance are <= C/4, C/3, C/2 against free room >= C/4, C/3, C/2). The overflow takes 1 move.
"""

from __future__ import annotations

from services.placement.cluster import Unit, group_items, instance_name
from services.placement.invariants import REPAIRED_CATEGORIES, is_deficient
from services.placement.policy import BasePolicy
from services.placement.types import KVSchedulerConfig, SizeClass, size_class


class MellPolicy(BasePolicy):
    """The MELL online algorithm: priority placement, overflow moves, consolidation, invariant repair."""

    name = "mell"

    def __init__(self, config: KVSchedulerConfig) -> None:
        super().__init__(config)
        self._deficient: dict[SizeClass, set[int]] = {size: set() for size in REPAIRED_CATEGORIES}
        self._registered: dict[int, SizeClass] = {}  # instance index -> category it is deficient in
        self._consolidation_due = False

    def deficient(self) -> dict[SizeClass, frozenset[str]]:
        """Deficient instance ids per category, as the policy tracks them."""
        return {size: frozenset(instance_name(i) for i in ids) for size, ids in self._deficient.items()}

    # -- operations ------------------------------------------------------------------------
    def _allocate(self, request_id: str, kv_tokens: int) -> None:
        target = self._target(kv_tokens, exclude=None, source=None)
        self.cluster.add(request_id, kv_tokens, self.cluster.open() if target is None else target)
        self._finish(consolidate=False)

    def _update(self, request_id: str, kv_tokens: int) -> None:
        cluster = self.cluster
        shrank = kv_tokens < cluster.members[cluster.location[request_id]][request_id]
        index = cluster.resize(request_id, kv_tokens)
        while index in cluster.loads and cluster.loads[index] > self.config.capacity:
            ids, tokens = self._overflow_item(index)
            target = self._target(tokens, exclude=index, source=index)
            cluster.move(ids, cluster.open() if target is None else target, "overflow")
        self._finish(consolidate=shrank)

    def _depart(self, request_id: str) -> None:
        self.cluster.remove(request_id)
        self._finish(consolidate=True)

    def _end_step(self) -> None:
        if self._consolidation_due:
            self._consolidation_due = False
            self._consolidate()
            self._refresh()

    def _finish(self, consolidate: bool) -> None:
        self._refresh()
        if consolidate and self.in_step:  # a batched step consolidates once, after its allocations
            self._consolidation_due, consolidate = True, False
        if consolidate:  # first: a drain that releases an instance may make the repair unnecessary
            self._consolidate()
            self._refresh()
        limit = self.config.max_deficient_per_category
        for category in REPAIRED_CATEGORIES:
            while len(self._deficient[category]) > limit and self._budget() > 0:
                moves_before = self.cluster.op_items
                self._repair(category)
                self._refresh()
                if self.cluster.op_items == moves_before:
                    break

    # -- invariant book-keeping and repair -------------------------------------------------
    def _budget(self) -> int:
        return self.config.max_migrations_per_op - self.cluster.op_items

    def _refresh(self) -> None:
        """Re-file every changed instance under the category it is deficient in, if any."""
        cluster, capacity = self.cluster, self.config.capacity
        for index in cluster.dirty:
            old = self._registered.pop(index, None)
            if old is not None:
                self._deficient[old].discard(index)
            if index in cluster.loads:
                category = cluster.largest_class(index)
                if is_deficient(category, cluster.loads[index], capacity):
                    self._deficient[category].add(index)
                    self._registered[index] = category
        cluster.dirty.clear()

    def _repair(self, category: SizeClass) -> None:
        """Move requests from the lightest deficient instance of `category` to the heaviest one."""
        cluster, capacity, loads = self.cluster, self.config.capacity, self.cluster.loads
        members = self._deficient[category]
        receiver = max(members, key=lambda index: (loads[index], -index))
        donor = min(members - {receiver}, key=lambda index: (loads[index], index))
        # Lower classes before `category`'s own (a donor left non-empty keeps its category), largest
        # first (fewest requests moved); stop as soon as the receiver is no longer deficient.
        order = sorted(cluster.members[donor].items(),
                       key=lambda item: (size_class(item[1], capacity) >= category, -item[1], item[0]))
        chosen, added = [], 0
        for request_id, tokens in order:
            if not is_deficient(category, loads[receiver] + added, capacity):
                break
            if loads[receiver] + added + tokens <= capacity:
                chosen.append((request_id, tokens))
                added += tokens
        for ids, _ in group_items(chosen, capacity):
            if self._budget() == 0:
                return
            cluster.move(ids, receiver, "repair")

    def _consolidate(self) -> None:
        """Drain the least loaded instance into the others when that is cheap and keeps the invariants."""
        cluster, config, loads = self.cluster, self.config, self.cluster.loads
        capacity = config.capacity
        if self._budget() == 0 or len(loads) < 2:
            return
        candidate = min(loads, key=lambda index: (loads[index], -index))
        if loads[candidate] > config.consolidation_max_load * capacity:
            return
        if (len(loads) - 1) * capacity - cluster.total_tokens < config.consolidation_slack * capacity:
            return  # the others would be left too full: the next arrivals would open an instance again
        if cluster.total_tokens > config.consolidation_max_utilization * (len(loads) - 1) * capacity:
            return  # the same, measured as the utilization the others would reach
        units = cluster.units(candidate)
        if len(units) > self._budget():
            return
        limit = capacity - int(config.consolidation_headroom * capacity)
        planned: dict[int, int] = {}  # receiver -> tokens it would get
        plan: list[tuple[tuple[str, ...], int]] = []
        for ids, tokens in sorted(units, key=lambda unit: -unit[1]):
            target = self._target(tokens, exclude=candidate, source=candidate, planned=planned, limit=limit)
            if target is None:
                return
            planned[target] = planned.get(target, 0) + tokens
            plan.append((ids, target))
        if self._plan_keeps_invariant(candidate, plan, planned):
            for ids, target in plan:
                cluster.move(ids, target, "consolidate")

    def _plan_keeps_invariant(self, candidate: int, plan: list[tuple[tuple[str, ...], int]],
                              planned: dict[int, int]) -> bool:
        cluster, capacity = self.cluster, self.config.capacity
        new_class = {target: cluster.largest_class(target) for target in planned}
        for ids, target in plan:
            for request_id in ids:
                moved = size_class(cluster.members[candidate][request_id], capacity)
                new_class[target] = max(new_class[target], moved)
        touched = set(planned) | {candidate}
        for category in REPAIRED_CATEGORIES:
            count = len(self._deficient[category] - touched) + sum(
                1 for target, added in planned.items()
                if new_class[target] == category and is_deficient(category, cluster.loads[target] + added, capacity))
            if count > self.config.max_deficient_per_category:
                return False
        return True

    # -- choices ---------------------------------------------------------------------------
    def _target(self, kv_tokens: int, exclude: int | None, source: int | None,
                planned: dict[int, int] | None = None, limit: int | None = None) -> int | None:
        """The instance with the best priority that fits `kv_tokens` (up to `limit`), or None."""
        config, capacity = self.config, self.config.capacity
        limit = capacity if limit is None else limit
        base_headroom = config.growth_headroom * capacity
        per_request = config.growth_reserve_per_request
        members = self.cluster.members
        source_node = None if source is None else self.cluster.node(source)
        best, best_score = None, float("-inf")
        for index, load in self.cluster.loads.items():
            after = load + kv_tokens + (planned.get(index, 0) if planned else 0)
            if after > limit or index == exclude:
                continue
            headroom = base_headroom + per_request * (len(members[index]) + 1)
            score = config.load_weight * after / capacity
            if headroom and capacity - after < headroom:
                score -= config.free_memory_weight * (headroom - (capacity - after)) / headroom
            if source_node is not None and index // config.instances_per_node == source_node:
                score += config.locality_weight
            if score > best_score:
                best, best_score = index, score
        return best

    def _overflow_item(self, index: int) -> Unit:
        """What to move off an over-full instance (see the module docstring)."""
        cluster, capacity = self.cluster, self.config.capacity
        members = cluster.members[index]
        overflow = cluster.loads[index] - capacity
        wanted = overflow + int(self.config.growth_headroom * capacity)  # also restores the headroom
        options = [
            (self._leaves_deficient(index, (tokens,)), tokens < wanted, 1, tokens, (request_id,))
            for request_id, tokens in members.items() if tokens >= overflow
        ]
        group, group_tokens = [], 0
        for tokens, request_id in sorted((t, r) for r, t in members.items() if t * 8 <= capacity):
            if group_tokens >= wanted or group_tokens + tokens > capacity // 4:
                break
            group.append(request_id)
            group_tokens += tokens
        if len(group) > 1 and group_tokens >= overflow:
            removed = [members[request_id] for request_id in group]
            options.append((self._leaves_deficient(index, removed), group_tokens < wanted, len(group),
                            group_tokens, tuple(group)))
        if options:
            *_, tokens, ids = min(options)
            return ids, tokens
        request_id = max(members, key=lambda r: (members[r], r))  # nothing ends it alone: shed the largest
        return (request_id,), members[request_id]

    def _leaves_deficient(self, index: int, removed: tuple[int, ...] | list[int]) -> bool:
        counts = list(self.cluster.class_counts[index])
        for tokens in removed:
            counts[size_class(tokens, self.config.capacity)] -= 1
        category = next((size for size in (SizeClass.L, SizeClass.M, SizeClass.S) if counts[size]), SizeClass.T)
        return is_deficient(category, self.cluster.loads[index] - sum(removed), self.config.capacity)
