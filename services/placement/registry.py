"""The placement policies by name (`--policy`, `reconfig simulate --policy`): MELL and the baselines it is measured
against. Apart from services.placement.policy, which they all build on."""

from __future__ import annotations

from services.placement.baselines import BestFitPolicy, LoadBalancePolicy, WorstFitPolicy
from services.placement.mell import MellPolicy
from services.placement.policy import POLICY_NAMES, BasePolicy
from services.placement.types import KVSchedulerConfig

POLICIES: dict[str, type[BasePolicy]] = {
    "mell": MellPolicy, "bf": BestFitPolicy, "wf": WorstFitPolicy, "lb": LoadBalancePolicy}
assert tuple(POLICIES) == POLICY_NAMES


def make_policy(name: str, config: KVSchedulerConfig) -> BasePolicy:
    """A policy by name: "mell", "bf" (Best-Fit), "wf" (Worst-Fit) or "lb" (Llumnix-style load balancing)."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    return POLICIES[name](config)
