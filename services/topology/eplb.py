"""Expert-parallel load balancing (EPLB): which logical expert each physical slot holds, decided from observed load.

The policy of vLLM's EPLB (adapted from DeepSeek's): replicate the hottest experts into the redundant slots, pack the
copies onto ranks so their loads come out even, and keep every expert that stays on a rank in its old slot so its
weights do not move. Pure: the worker records loads and applies maps, the controller decides when to call this.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.topology.experts import check_expert_map, identity_map


@dataclass(frozen=True, slots=True)
class EplbConfig:
    """When and how EPLB rebalances (defaults are vLLM's EPLBConfig)."""

    enabled: bool = False
    window_size: int = 1000  # steps of load the decision looks at: old traffic ages out
    step_interval: int = 3000  # steps between two rebalances: reacts to sustained skew, not to noise
    num_redundant_experts: int = 0  # extra physical slots per MoE layer, for replicas of hot experts

    def __post_init__(self) -> None:
        errors = [] if isinstance(self.enabled, bool) else [f"enabled={self.enabled!r} must be a bool"]
        for name, low in (("window_size", 1), ("step_interval", 1), ("num_redundant_experts", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                errors.append(f"{name}={value!r} must be an int >= {low}")
        if errors:
            raise ValueError("invalid EPLB config: " + "; ".join(errors))


def _check_loads(loads: Sequence[float], what: str) -> list[float]:
    values = [float(load) for load in loads]
    if not values:
        raise ValueError(f"{what} must not be empty")
    if any(not math.isfinite(load) or load < 0 for load in values):
        raise ValueError(f"{what} must be finite and >= 0, got {values}")
    return values


def balancedness(rank_loads: Sequence[float]) -> float:
    """mean / max of the ranks' loads: 1.0 is perfect, 1/num_ranks is all load on one rank.

    Every load 0 gives 1.0 (nothing is imbalanced, so nothing should trigger a rebalance), where vLLM logs 0.0.
    """
    loads = _check_loads(rank_loads, "rank loads")
    peak = max(loads)
    return 1.0 if peak == 0 else min(1.0, sum(loads) / len(loads) / peak)


def _slots_per_rank(num_physical: int, num_ranks: int) -> int:
    if not isinstance(num_ranks, int) or num_ranks < 1 or not isinstance(num_physical, int) or num_physical < 1:
        raise ValueError(f"num_ranks and num_physical must be ints >= 1, got {num_ranks}, {num_physical}")
    if num_physical % num_ranks:
        raise ValueError(f"{num_ranks} ranks do not divide {num_physical} physical expert slots")
    return num_physical // num_ranks


def rank_loads(physical_loads: Sequence[float], num_ranks: int) -> list[float]:
    """Load of each rank: the sum over its contiguous num_physical / num_ranks slots."""
    loads = _check_loads(physical_loads, "physical loads")
    per_rank = _slots_per_rank(len(loads), num_ranks)
    return [sum(loads[rank * per_rank:(rank + 1) * per_rank]) for rank in range(num_ranks)]


def physical_loads(logical_loads: Sequence[float], phy2log: Sequence[int]) -> list[float]:
    """Expected load of each slot: its expert's load split evenly over the expert's copies (tokens go round-robin)."""
    loads = _check_loads(logical_loads, "logical loads")
    slots = check_expert_map(phy2log, len(loads))
    copies = Counter(slots)
    return [loads[logical] / copies[logical] for logical in slots]


def logical_loads(physical_loads: Sequence[float], phy2log: Sequence[int], num_experts: int) -> list[float]:
    """Load of each logical expert: the sum over its slots (what the window counted, per slot, under phy2log)."""
    loads = _check_loads(physical_loads, "physical loads")
    slots = check_expert_map(phy2log, num_experts, len(loads))
    totals = [0.0] * num_experts
    for slot, logical in enumerate(slots):
        totals[logical] += loads[slot]
    return totals


def replicate(logical_loads: Sequence[float], num_physical: int, max_copies: int | None = None) -> list[int]:
    """Copies per logical expert: one each, then every spare slot to the expert with the highest load per copy.

    Ties go to the expert with fewer copies, then the lowest id (so a zero load spreads spares round-robin instead
    of piling them on expert 0). max_copies (rebalance passes the number of ranks: a second copy on one rank splits
    nothing) caps an expert's copies while another expert is below the cap.
    """
    loads = _check_loads(logical_loads, "logical loads")
    if not isinstance(num_physical, int) or num_physical < len(loads):
        raise ValueError(f"num_physical={num_physical} must be an int >= the {len(loads)} logical experts")
    if max_copies is not None and (not isinstance(max_copies, int) or max_copies < 1):
        raise ValueError(f"max_copies={max_copies!r} must be an int >= 1")
    copies = [1] * len(loads)
    capped = max_copies is not None
    heap = [(-load, 1, e) for e, load in enumerate(loads) if not capped or 1 < max_copies]  # max load per copy first
    heapq.heapify(heap)
    for _ in range(num_physical - len(loads)):
        if not heap:  # every expert at the cap: the cap gives way
            capped = False
            heap = [(-loads[e] / copies[e], copies[e], e) for e in range(len(loads))]
            heapq.heapify(heap)
        _, _, hottest = heapq.heappop(heap)
        copies[hottest] += 1
        if not capped or copies[hottest] < max_copies:
            heapq.heappush(heap, (-loads[hottest] / copies[hottest], copies[hottest], hottest))
    return copies


def _pack(loads: list[float], copies: list[int], num_ranks: int, per_rank: int) -> list[list[int]]:
    """Balanced packing: copies heaviest first onto the lightest rank with a free slot, preferring a rank that does
    not hold the expert yet (two copies on one rank split nothing). Returns each rank's experts."""
    items = sorted(((loads[e] / copies[e], e) for e in range(len(loads)) for _ in range(copies[e])),
                   key=lambda item: (-item[0], item[1]))
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    heap = [(0.0, 0, rank) for rank in range(num_ranks)]  # ranks with a free slot: (load, slots used, rank)
    for weight, expert in items:
        skipped = []  # lighter ranks that already hold the expert, lightest first
        while heap and expert in held[heap[0][2]]:
            skipped.append(heapq.heappop(heap))
        load, used, rank = heapq.heappop(heap) if heap else skipped.pop(0)
        for entry in skipped:
            heapq.heappush(heap, entry)
        held[rank].append(expert)
        if used + 1 < per_rank:
            heapq.heappush(heap, (load + weight, used + 1, rank))
    return held


def _refine(held: list[list[int]], weights: dict[int, float]) -> list[list[int]]:
    """Local search after the greedy packing: swap a copy of the heaviest rank with a lighter copy of another rank
    while that lowers both below the heaviest rank's load (each swap lowers the sorted load vector, so it ends).
    weights: expert -> load per copy. A swap may put two copies of an expert on one rank when that lowers the max."""
    held = [list(experts) for experts in held]
    load = [sum(weights[e] for e in experts) for experts in held]
    for _ in range(4 * sum(len(experts) for experts in held)):
        top = max(range(len(held)), key=lambda r: (load[r], -r))
        swap = _improving_swap(held, load, weights, top)
        if swap is None:
            break
        other, x, y = swap
        held[top][held[top].index(x)] = y
        held[other][held[other].index(y)] = x
        delta = weights[x] - weights[y]
        load[top] -= delta
        load[other] += delta
    return held


def _improving_swap(held: list[list[int]], load: list[float], weights: dict[int, float], top: int
                    ) -> tuple[int, int, int] | None:
    """(other rank, expert leaving top, expert coming back) lowering both below load[top], or None."""
    margin = 1e-12 * load[top]
    leaving = sorted(set(held[top]), key=lambda e: (-weights[e], e))
    for other in sorted(range(len(held)), key=lambda r: (load[r], r)):
        gap = load[top] - load[other]
        if gap <= margin:
            break
        coming = sorted(set(held[other]), key=lambda e: (weights[e], e))
        for x in leaving:
            for y in coming:
                delta = weights[x] - weights[y]
                if delta <= margin:
                    break  # the rest of `coming` is heavier still
                if delta < gap - margin:
                    return other, x, y
    return None


def _assign_slots(held: list[list[int]], per_rank: int, old_phy2log: tuple[int, ...] | None) -> tuple[int, ...]:
    """Slot preservation: on each rank an expert it already held keeps its old slot; the rest fill the free slots
    in ascending slot and expert order."""
    phy2log: list[int] = []
    for rank, experts in enumerate(held):
        remaining = Counter(experts)
        slots: list[int | None] = [None] * per_rank
        if old_phy2log is not None:
            for offset, logical in enumerate(old_phy2log[rank * per_rank:(rank + 1) * per_rank]):
                if remaining[logical] > 0:
                    slots[offset] = logical
                    remaining[logical] -= 1
        rest = iter(sorted(remaining.elements()))
        phy2log.extend(logical if logical is not None else next(rest) for logical in slots)
    return tuple(phy2log)


def _balanced(loads: list[float], num_ranks: int, num_physical: int) -> list[list[int]]:
    """Each rank's experts: replicate, pack, refine; the best over a few caps on an expert's copies.

    Why several caps: replication does not see ranks. 2 hot experts, 8 ranks and 8 spare slots give each hot expert
    5 copies, 10 hot copies on 8 ranks, so 2 ranks carry two; with at most 4 copies each, every rank carries one.
    """
    caps = sorted({num_ranks} | {-(-num_ranks * i // 8) for i in range(1, 8)}, reverse=True)  # ceil(R * i / 8)
    candidates = []
    for cap in caps if num_physical > len(loads) else [num_ranks]:
        copies = replicate(loads, num_physical, max_copies=cap)
        weights = {e: loads[e] / copies[e] for e in range(len(loads))}
        candidates.append(_refine(_pack(loads, copies, num_ranks, num_physical // num_ranks), weights))
    return min(candidates, key=lambda held: _max_load(held, loads))  # ties: the highest cap


def _max_load(held: list[list[int]], loads: list[float]) -> float:
    copies = Counter(e for experts in held for e in experts)
    return max(sum(loads[e] / copies[e] for e in experts) for experts in held)


def _never_worse(held: list[list[int]], loads: list[float], num_ranks: int, num_physical: int) -> list[list[int]]:
    """`held`, unless the placement without replicas has a lower max rank load (greedy packing is not monotone in
    the number of items); then that one with each rank's spare slots holding copies of its own experts (which
    moves no load), refined."""
    if num_physical == len(loads) or len(loads) % num_ranks:
        return held
    base = _balanced(loads, num_ranks, len(loads))
    if _max_load(held, loads) <= _max_load(base, loads):
        return held
    spare = (num_physical - len(loads)) // num_ranks
    padded = [experts + [experts[i % len(experts)] for i in range(spare)] for experts in base]
    copies = Counter(e for experts in padded for e in experts)
    refined = _refine(padded, {e: loads[e] / copies[e] for e in copies})
    return refined if _max_load(refined, loads) <= _max_load(held, loads) else held


def rebalance(logical_loads: Sequence[float], num_ranks: int, num_physical: int,
              old_phy2log: Sequence[int] | None = None) -> tuple[int, ...]:
    """The new phy2log of one MoE layer for these per-expert loads: replicate, pack, preserve slots. Deterministic.

    Packing puts two copies of one expert on one rank only when no other rank has room; the refinement after it
    may, where that lowers the max rank load. The max rank load is never above that of
    rebalance(logical_loads, num_ranks, num_experts) (no replicas), nor above old_phy2log's: when the old map is at
    least as good under these loads, it is returned and nothing moves.
    """
    loads = _check_loads(logical_loads, "logical loads")
    per_rank = _slots_per_rank(num_physical, num_ranks)
    old = None if old_phy2log is None else check_expert_map(old_phy2log, len(loads), num_physical)
    held = _never_worse(_balanced(loads, num_ranks, num_physical), loads, num_ranks, num_physical)
    if old is not None:
        old_held = [list(old[rank * per_rank:(rank + 1) * per_rank]) for rank in range(num_ranks)]
        if _max_load(old_held, loads) <= _max_load(held, loads):
            return old
    return _assign_slots(held, per_rank, old)


def initial_phy2log(num_experts: int, num_physical: int, num_ranks: int) -> tuple[int, ...]:
    """The map every rank starts with: the identity without redundant slots, else the rebalance of a uniform load
    (each spare slot a replica of a different expert, spread over the ranks)."""
    _slots_per_rank(num_physical, num_ranks)
    if num_physical == num_experts:
        return identity_map(num_experts)
    return rebalance([1.0] * num_experts, num_ranks, num_physical)


@dataclass(frozen=True, slots=True, order=True)
class ExpertMove:
    """Copy the weights of `logical` from `source_slot` (in the OLD map) into `slot` (of the new map)."""

    slot: int
    logical: int
    source_slot: int
    src_rank: int
    dst_rank: int

    @property
    def is_local(self) -> bool:
        """A copy between two slots of one rank: no bytes on the wire."""
        return self.src_rank == self.dst_rank


def expert_moves(old: Sequence[int], new: Sequence[int], num_ranks: int) -> list[ExpertMove]:
    """Every slot whose logical expert changes, with a slot holding that expert in the OLD map to copy it from (one
    on the destination rank if any, else the lowest). Sources are read before any slot is overwritten: the copies go
    to a staging buffer and the new map is committed after all of them, so a source may itself be a destination."""
    old_map, new_map = tuple(old), tuple(new)
    if len(old_map) != len(new_map):
        raise ValueError(f"old map has {len(old_map)} slots, new map {len(new_map)}")
    num_experts = max(old_map, default=-1) + 1
    check_expert_map(old_map, num_experts)
    check_expert_map(new_map, num_experts)
    per_rank = _slots_per_rank(len(old_map), num_ranks)
    holders: dict[int, list[int]] = {}
    for slot, logical in enumerate(old_map):
        holders.setdefault(logical, []).append(slot)
    moves = []
    for slot, (before, after) in enumerate(zip(old_map, new_map)):
        if before == after:
            continue
        rank = slot // per_rank
        source = min(holders[after], key=lambda s: (s // per_rank != rank, s))
        moves.append(ExpertMove(slot, after, source, source // per_rank, rank))
    return moves


def layer_balancedness(totals: np.ndarray, num_ranks: int) -> tuple[list[float], float]:
    """Per layer and overall balancedness of [layers, physical] load totals. Overall is vLLM's: the sum over layers
    of the mean rank load over the sum of the max rank load (a layer with more traffic weighs more)."""
    counts = np.asarray(totals, dtype=np.float64)
    if counts.ndim != 2 or (counts < 0).any():
        raise ValueError(f"totals must be a [layers, physical] array of loads >= 0, got shape {counts.shape}")
    per_rank = _slots_per_rank(counts.shape[1], num_ranks)
    by_rank = counts.reshape(counts.shape[0], num_ranks, per_rank).sum(axis=2)  # [layers, ranks]
    per_layer = [balancedness(row) for row in by_rank.tolist()]
    peak = by_rank.max(axis=1).sum()
    return per_layer, 1.0 if peak == 0 else float(by_rank.mean(axis=1).sum() / peak)


class LoadWindow:
    """Tokens routed to each physical expert slot over the last `window_size` steps, per MoE layer (a ring buffer).

    Counts are per slot under the map live when they were recorded: reset() after committing a new map.
    """

    def __init__(self, num_layers: int, num_physical: int, window_size: int = 1000) -> None:
        for name, value in (("num_layers", num_layers), ("num_physical", num_physical), ("window_size", window_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LoadWindow: {name}={value!r} must be an int >= 1")
        self.window_size = window_size
        # [window, layers, physical]; int32 halves the buffer (a step routes far fewer than 2**31 tokens to a slot)
        self._steps = np.zeros((window_size, num_layers, num_physical), dtype=np.int32)
        self._totals = np.zeros((num_layers, num_physical), dtype=np.int64)  # sum over the rows in the window
        self._next = 0
        self._count = 0

    @property
    def shape(self) -> tuple[int, int]:
        """(num_layers, num_physical) of one step's counts."""
        return self._totals.shape  # type: ignore[return-value]

    @property
    def num_steps(self) -> int:
        """Steps in the window (at most window_size)."""
        return self._count

    def record(self, counts: np.ndarray | Sequence[Sequence[int]]) -> None:
        """Add one step's [layers, physical] token counts; the oldest step leaves a full window."""
        step = np.asarray(counts)
        if step.shape != self.shape or not np.issubdtype(step.dtype, np.integer) or (step < 0).any() \
                or (step >= 2**31).any():
            raise ValueError(f"a step's counts must be integers in [0, 2**31) of shape {self.shape}, got "
                             f"{step.dtype} {step.shape}")
        self._totals -= self._steps[self._next]
        self._steps[self._next] = step
        self._totals += self._steps[self._next]
        self._next = (self._next + 1) % self.window_size
        self._count = min(self._count + 1, self.window_size)

    def totals(self) -> np.ndarray:
        """[layers, physical] tokens over the window (a copy)."""
        return self._totals.copy()

    def reset(self) -> None:
        """Forget every step (after a new map: slot counts of the old one mean other experts now)."""
        self._steps[:] = 0
        self._totals[:] = 0
        self._next = 0
        self._count = 0


def initial_expert_maps(shape, placement) -> dict[int, tuple[int, ...]]:
    """Every sparse layer's physical -> logical map at load (shape: a ModelShape; placement: its Placement): the
    identity, or with redundant slots (an EP layout) `initial_phy2log` (EPLB's rebalances change it at runtime)."""
    phy2log = initial_phy2log(shape.num_experts, placement.num_physical_experts, placement.topology.ep)
    return {layer: phy2log for layer in shape.moe_layers}
