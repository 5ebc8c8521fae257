"""MELL's packing invariants (the Theorem 1 analogue this implementation keeps), as pure checks.

An instance's category is the class of its largest request, with tiny requests counting as T (they are
packed as multi-items of at most C/4). An instance is *deficient* when its load is at or below the
threshold of its category:

    category   largest request      deficient when load <=
    T          <= C/4               3/4 C
    S          (C/4, C/3]           2/3 C
    M          (C/3, C/2]           1/2 C   (two M requests already exceed 2/3 C)
    L          (C/2, C]             never   (every packing needs one instance per L request)

Invariant, for a constant K (`max_deficient_per_category`, default 2): no instance exceeds C, and each
of T, S and M has at most K deficient instances. So all instances but at most 3K are more than half
full, all T-instances but K more than 3/4 full, and all S-instances but K more than 2/3 full.
"""

from __future__ import annotations

from collections.abc import Mapping

from services.placement.types import InstanceState, SizeClass, size_class

REPAIRED_CATEGORIES = (SizeClass.M, SizeClass.S, SizeClass.T)


def is_deficient(category: SizeClass, kv_tokens: int, capacity: int) -> bool:
    """Whether an instance of `category` holding `kv_tokens` is at or below its category's threshold."""
    if category == SizeClass.L:
        return False
    if category == SizeClass.M:
        return kv_tokens * 2 <= capacity
    if category == SizeClass.S:
        return kv_tokens * 3 <= 2 * capacity
    return kv_tokens * 4 <= 3 * capacity


def deficient_instances(instances: Mapping[str, InstanceState]) -> dict[SizeClass, list[str]]:
    """Deficient instance ids per category (T, S, M)."""
    found: dict[SizeClass, list[str]] = {size: [] for size in REPAIRED_CATEGORIES}
    for instance_id, state in instances.items():
        category = max((size_class(tokens, state.capacity) for tokens in state.requests.values()),
                       default=SizeClass.T)
        category = max(category, SizeClass.T)
        if is_deficient(category, state.kv_tokens, state.capacity):
            found[category].append(instance_id)
    return found


def invariant_violations(instances: Mapping[str, InstanceState], max_deficient_per_category: int) -> list[str]:
    """Every broken invariant, in words (empty when all hold)."""
    problems = []
    for instance_id, state in instances.items():
        if state.kv_tokens != sum(state.requests.values()):
            problems.append(f"{instance_id}: load {state.kv_tokens} != sum of its requests")
        if state.kv_tokens > state.capacity:
            problems.append(f"{instance_id}: {state.kv_tokens} tokens over capacity {state.capacity}")
        if not state.requests:
            problems.append(f"{instance_id}: idle but not released")
    for category, ids in deficient_instances(instances).items():
        if len(ids) > max_deficient_per_category:
            problems.append(f"{len(ids)} deficient {category.name}-instances: {sorted(ids)}")
    return problems
