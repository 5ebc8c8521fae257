"""Topologies (tp × pp), their validation for a model, and the placement of a model on workers."""

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
    validate,
)

__all__ = [
    "ModelShape",
    "Placement",
    "Topology",
    "TopologyError",
    "WorkerPlacement",
    "candidate_topologies",
    "layer_partition",
    "padded_vocab_size",
    "place",
    "validate",
]
