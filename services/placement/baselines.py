"""Baselines behind the same interface: Best-Fit, Worst-Fit (no migration) and Llumnix-style balancing.

None of them plans moves, but KV grows while a request decodes: when growth takes an instance past its
capacity, every policy must move something off it (an engine without migration would preempt and
re-prefill it elsewhere). The victim is the smallest request whose removal ends the overflow, and it goes
where the policy's own placement rule sends it; these forced moves are counted as migrations for all.
"""

from __future__ import annotations

from services.placement.policy import BasePolicy


class _FitPolicy(BasePolicy):
    """Place on the instance chosen by `_choose` among those with room; open one when none has."""

    def _choose(self, kv_tokens: int, exclude: int | None) -> int | None:
        raise NotImplementedError

    def _allocate(self, request_id: str, kv_tokens: int) -> None:
        index = self._choose(kv_tokens, None)
        self.cluster.add(request_id, kv_tokens, self.cluster.open() if index is None else index)

    def _update(self, request_id: str, kv_tokens: int) -> None:
        index = self.cluster.resize(request_id, kv_tokens)
        self._resolve_overflow(index)

    def _depart(self, request_id: str) -> None:
        self.cluster.remove(request_id)

    def _resolve_overflow(self, index: int) -> None:
        while index in self.cluster.loads and self.cluster.loads[index] > self.config.capacity:
            victim = self._overflow_victim(index)
            target = self._choose(self.cluster.members[index][victim], index)
            self.cluster.move((victim,), self.cluster.open() if target is None else target, "overflow")


class BestFitPolicy(_FitPolicy):
    """Best-Fit: the fullest instance that still fits the request; no planned migration."""

    name = "bf"

    def _choose(self, kv_tokens: int, exclude: int | None) -> int | None:
        limit = self.config.capacity - kv_tokens
        best, best_load = None, -1
        for index, load in self.cluster.loads.items():
            if load <= limit and load > best_load and index != exclude:
                best, best_load = index, load
        return best


class WorstFitPolicy(_FitPolicy):
    """Worst-Fit: the emptiest instance that fits the request; no planned migration."""

    name = "wf"

    def _choose(self, kv_tokens: int, exclude: int | None) -> int | None:
        limit = self.config.capacity - kv_tokens
        best, best_load = None, self.config.capacity + 1
        for index, load in self.cluster.loads.items():
            if load <= limit and load < best_load and index != exclude:
                best, best_load = index, load
        return best


class LoadBalancePolicy(WorstFitPolicy):
    """Llumnix-style: place on the least loaded instance; after each operation, when the most and least
    loaded instances differ by more than `balance_threshold` of C, migrate one request between them."""

    name = "lb"

    def _allocate(self, request_id: str, kv_tokens: int) -> None:
        super()._allocate(request_id, kv_tokens)
        self._balance()

    def _update(self, request_id: str, kv_tokens: int) -> None:
        super()._update(request_id, kv_tokens)
        self._balance()

    def _depart(self, request_id: str) -> None:
        super()._depart(request_id)
        self._balance()

    def _balance(self) -> None:
        loads = self.cluster.loads
        if len(loads) < 2:
            return
        source = max(loads, key=lambda index: (loads[index], -index))
        target = min(loads, key=lambda index: (loads[index], index))
        gap = loads[source] - loads[target]
        if gap <= self.config.balance_threshold * self.config.capacity:
            return
        room = self.config.capacity - loads[target]
        # The move leaves the pair |gap - 2 * tokens| apart: pick the request that closes the gap most.
        candidates = [
            (abs(gap - 2 * tokens), request_id)
            for request_id, tokens in self.cluster.members[source].items() if tokens < gap and tokens <= room
        ]
        if candidates:
            self.cluster.move((min(candidates)[1],), target, "balance")
