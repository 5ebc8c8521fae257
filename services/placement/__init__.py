"""Multi-instance KV scheduling: MELL and baselines behind one interface, and the adaptive move choice (KV copy or re-prefill)."""

from services.placement.invariants import deficient_instances, invariant_violations
from services.placement.policy import POLICY_NAMES, BasePolicy, KVPlacementPolicy
from services.placement.registry import make_policy
from services.placement.types import (
    InstanceState, KVSchedulerConfig, Move, Placement, Request, SchedulerError, SizeClass, StepResult,
    size_class,
)

__all__ = [
    "POLICY_NAMES", "BasePolicy", "InstanceState", "KVPlacementPolicy", "KVSchedulerConfig", "Move",
    "Placement", "Request", "SchedulerError", "SizeClass", "StepResult", "deficient_instances",
    "invariant_violations", "make_policy", "size_class",
]
