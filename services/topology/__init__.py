"""Topologies (tp × pp), their validation for a model, the placement of a model on workers and of workers on GPUs,
migration plans."""

from services.topology.devices import DevicePlacementError, assign_gpus, parse_gpus
from services.topology.migration_plan import (
    LOST,
    KVLostError,
    KVMigrationPlan,
    KVTransfer,
    lost_kv,
    plan_kv_migration,
    workers_by_rank,
)
from services.topology.placement import (
    Placement,
    WorkerPlacement,
    layer_partition,
    padded_vocab_size,
    place,
)
from services.topology.topology import (
    ModelShape,
    Topology,
    TopologyError,
    candidate_topologies,
    degraded_topology,
    validate,
)
from services.topology.weight_plan import (
    WeightFlags,
    WeightReload,
    WeightSlice,
    plan_weight_reload,
    shard_slices,
)

__all__ = [
    "DevicePlacementError",
    "LOST",
    "KVLostError",
    "KVMigrationPlan",
    "KVTransfer",
    "ModelShape",
    "Placement",
    "Topology",
    "TopologyError",
    "WeightFlags",
    "WeightReload",
    "WeightSlice",
    "WorkerPlacement",
    "assign_gpus",
    "candidate_topologies",
    "degraded_topology",
    "layer_partition",
    "lost_kv",
    "padded_vocab_size",
    "parse_gpus",
    "place",
    "plan_kv_migration",
    "plan_weight_reload",
    "shard_slices",
    "validate",
    "workers_by_rank",
]
