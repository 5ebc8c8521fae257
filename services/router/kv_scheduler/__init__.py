"""Multi-instance KV scheduling: MELL and baselines behind one interface, and the adaptive migration choice."""

from services.router.kv_scheduler.invariants import deficient_instances, invariant_violations
from services.router.kv_scheduler.policy import POLICY_NAMES, BasePolicy, KVPlacementPolicy, make_policy
from services.router.kv_scheduler.types import (
    InstanceState, KVSchedulerConfig, Migration, Placement, Request, SchedulerError, SizeClass, StepResult,
    size_class,
)

__all__ = [
    "POLICY_NAMES", "BasePolicy", "InstanceState", "KVPlacementPolicy", "KVSchedulerConfig", "Migration",
    "Placement", "Request", "SchedulerError", "SizeClass", "StepResult", "deficient_instances",
    "invariant_violations", "make_policy", "size_class",
]
