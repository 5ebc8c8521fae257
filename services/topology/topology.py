"""Parallel layouts (tp × pp), their text form, and whether one can run a given model."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, fields

# One "<key><count>" token; a topology string is one or more of them with no separators.
_TOKEN = re.compile(r"(tp|pp|ep|dp)([0-9]+)", re.ASCII)
_EXPECTED_FORM = "expected 'tpXppY' or 'epXppY' with X, Y >= 1, e.g. 'tp2pp2'"


class TopologyError(ValueError):
    """A topology that cannot run (bad text, or invalid for the model / worker count)."""


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_layers")


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The dimensions of a model that placement needs (built by services.model.ModelSpec.shape)."""

    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    # Mixture of experts (all zero / empty for a dense model): the sparse layers' routed experts.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()  # global ids of the sparse layers; the others have a dense MLP

    def __post_init__(self) -> None:
        dense = [f for f in fields(self) if f.name not in _MOE_FIELDS]
        bad = [f"{f.name}={getattr(self, f.name)!r}" for f in dense if not _is_count(getattr(self, f.name))]
        if bad:
            raise ValueError(f"ModelShape dimensions must be ints >= 1: {', '.join(bad)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelShape: num_kv_heads={self.num_kv_heads} does not divide num_heads={self.num_heads}"
            )
        if self.num_experts or self.moe_layers:
            moe = (self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size)
            if not all(_is_count(v) for v in moe) or self.num_experts_per_tok > self.num_experts:
                raise ValueError(f"ModelShape: a MoE model needs 1 <= num_experts_per_tok <= num_experts and "
                                 f"moe_intermediate_size >= 1, got {moe}")
            if not self.moe_layers or any(not 0 <= i < self.num_layers for i in self.moe_layers) \
                    or list(self.moe_layers) != sorted(set(self.moe_layers)):
                raise ValueError(f"ModelShape: moe_layers {self.moe_layers} must be sorted distinct layer ids "
                                 f"below {self.num_layers}")

    @property
    def is_moe(self) -> bool:
        """Whether some layers are sparse mixture-of-experts blocks."""
        return self.num_experts > 0

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (1 for MHA, H/Hkv for GQA)."""
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True, slots=True)
class Topology:
    """A parallel layout: tp × pp, or ep × pp for a mixture-of-experts model (each stage's ranks run attention
    data-parallel, each on its own requests, and split the experts between them). dp is reserved (must be 1)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        bad = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if not _is_count(getattr(self, f.name))]
        if bad:
            raise TopologyError(f"invalid topology: {', '.join(bad)}; every degree must be an int >= 1")
        if self.dp != 1:
            raise TopologyError(f"dp={self.dp}: data parallelism outside expert parallelism is not supported yet")
        if self.tp > 1 and self.ep > 1:
            raise TopologyError(f"tp={self.tp} with ep={self.ep}: tensor and expert parallelism in one stage is "
                                "not supported yet (use tpXppY or epXppY)")

    @property
    def num_workers(self) -> int:
        """Active workers this layout uses."""
        return self.tp * self.pp * self.ep * self.dp

    @property
    def num_kv_pools(self) -> int:
        """KV pools per stage: one per rank of an EP stage (data-parallel attention, each rank its own requests'
        KV, its dp_rank naming its pool), one shared by the TP ranks of a stage otherwise (ep == 1)."""
        return self.ep

    @property
    def stage_size(self) -> int:
        """Workers per pipeline stage: its TP group, or its EP group."""
        return self.tp * self.ep

    @property
    def is_expert_parallel(self) -> bool:
        """Whether the experts are split by expert (ep > 1) instead of by their intermediate dimension."""
        return self.ep > 1

    @classmethod
    def parse(cls, text: str) -> Topology:
        """Parse 'tp2pp2' (case-insensitive, any order, a missing degree is 1)."""
        if not isinstance(text, str):
            raise TopologyError(f"invalid topology {text!r}: {_EXPECTED_FORM}")
        normalized = text.strip().lower()
        degrees: dict[str, int] = {}
        position = 0
        while position < len(normalized):
            match = _TOKEN.match(normalized, position)
            if match is None or match.group(1) in degrees:
                raise TopologyError(f"invalid topology {text!r}: {_EXPECTED_FORM}")
            degrees[match.group(1)] = int(match.group(2))
            position = match.end()
        if not degrees or any(value < 1 for value in degrees.values()):
            raise TopologyError(f"invalid topology {text!r}: {_EXPECTED_FORM}")
        try:
            return cls(**degrees)
        except TopologyError as error:
            raise TopologyError(f"invalid topology {text!r}: {error}") from None

    def __str__(self) -> str:
        return f"ep{self.ep}pp{self.pp}" if self.ep > 1 else f"tp{self.tp}pp{self.pp}"


def partition_errors(partition: Sequence[int], pp: int, num_layers: int) -> list[str]:
    """Reasons an explicit per-stage layer count list cannot split num_layers layers over pp stages."""
    errors = []
    if len(partition) != pp:
        errors.append(f"layer_partition has {len(partition)} entries for pp={pp}")
    if not all(_is_count(count) for count in partition):
        errors.append("layer_partition entries must be >= 1")
    elif sum(partition) != num_layers:
        errors.append(f"layer_partition sums to {sum(partition)}, model has {num_layers} layers")
    return errors


def validate(
    topology: Topology,
    shape: ModelShape,
    num_workers: int,
    layer_partition: Sequence[int] | None = None,
    num_redundant_experts: int = 0,
) -> None:
    """Raise TopologyError listing every reason the topology cannot run this model on num_workers workers, and the
    layouts that can. num_redundant_experts: extra physical expert slots of an EP layout (EPLB replicas)."""
    errors = topology_errors(topology, shape, num_workers, layer_partition, num_redundant_experts)
    if errors:
        valid = candidate_topologies(shape, num_workers, num_redundant_experts)
        allowed = ", ".join(map(str, valid)) if valid else "none"
        raise TopologyError(f"{'; '.join(errors)} (this model allows on {num_workers} workers: {allowed})")


def topology_errors(topology: Topology, shape: ModelShape, num_workers: int,
                    layer_partition: Sequence[int] | None = None, num_redundant_experts: int = 0) -> list[str]:
    """Every reason the topology cannot run this model on num_workers workers ([]: it can)."""
    tp, pp, ep = topology.tp, topology.pp, topology.ep
    errors = []
    if shape.num_heads % tp:
        errors.append(f"tp={tp} does not divide num_heads={shape.num_heads}")
    if shape.num_kv_heads % tp and tp % shape.num_kv_heads:
        errors.append(f"num_kv_heads={shape.num_kv_heads} and tp={tp}: one must divide the other")
    if shape.intermediate_size % tp:
        errors.append(f"tp={tp} does not divide intermediate_size={shape.intermediate_size}")
    if shape.is_moe and shape.moe_intermediate_size % tp:
        errors.append(f"tp={tp} does not divide the experts' moe_intermediate_size={shape.moe_intermediate_size}")
    if num_redundant_experts < 0:
        errors.append(f"num_redundant_experts={num_redundant_experts} must be >= 0")
    if ep > 1 and not shape.is_moe:
        errors.append(f"ep={ep} needs a mixture-of-experts model (this one is dense)")
    elif ep > 1 and (shape.num_experts + num_redundant_experts) % ep:
        errors.append(f"ep={ep} does not divide the {shape.num_experts + num_redundant_experts} physical experts "
                      f"({shape.num_experts} + {num_redundant_experts} redundant)")
    if pp > shape.num_layers:
        errors.append(f"pp={pp} exceeds num_layers={shape.num_layers}")
    if topology.num_workers > num_workers:
        errors.append(f"{'ep' if ep > 1 else 'tp'}*pp={topology.num_workers} exceeds the {num_workers} available "
                      "workers")
    if layer_partition is not None:
        errors.extend(partition_errors(layer_partition, pp, shape.num_layers))
    return errors


def candidate_topologies(shape: ModelShape, num_workers: int, num_redundant_experts: int = 0) -> list[Topology]:
    """Every (tp, pp) with tp*pp <= num_workers that validate() accepts, and for a MoE model every (ep, pp) with
    ep >= 2; sorted by (workers, tp, ep)."""
    candidates = []
    for width in range(1, num_workers + 1):
        for pp in range(1, num_workers // width + 1):
            layouts = [Topology(tp=width, pp=pp)] + ([Topology(ep=width, pp=pp)] if width > 1 else [])
            candidates += [t for t in layouts if not topology_errors(t, shape, num_workers, None, num_redundant_experts)]
    return sorted(candidates, key=lambda t: (t.num_workers, t.tp, t.ep))


def degraded_topology(current: Topology, shape: ModelShape, num_workers: int, num_redundant_experts: int = 0,
                      hosts: Sequence[str] = ()) -> Topology:
    """The layout to serve on `num_workers` workers after losing some: `current` if it still fits (a standby
    took the lost worker's place); else the valid topology that uses the most workers, of current's kind (EP or TP)
    if one does, with the fewest stage groups across hosts (`hosts`: each worker's, by rank; none: one host), the
    nearest to current's tp (fewest head moves), then the larger tp (lower latency). TopologyError when none fits
    (no worker left).
    num_redundant_experts: the EP layouts' spare expert slots (an EP candidate must divide experts + spares)."""
    if num_workers >= current.num_workers:
        return current
    fits = candidate_topologies(shape, num_workers, num_redundant_experts)
    if not fits:
        raise TopologyError(f"no topology of this model fits {num_workers} workers")

    return min(fits, key=lambda t: (-t.num_workers, t.is_expert_parallel != current.is_expert_parallel,
                                   groups_across_hosts(t, hosts) if hosts else 0, abs(t.tp - current.tp), -t.tp))


def groups_across_hosts(topology: Topology, hosts: Sequence[str]) -> int:
    """How many of `topology`'s stage groups (TP or EP: ranks s*size .. s*size+size-1) span more than one host, for
    workers on `hosts` by rank (each collective of such a stage crosses the network; services/topology/hosts.py)."""
    size = topology.stage_size
    if topology.num_workers > len(hosts):
        raise ValueError(f"{topology} needs {topology.num_workers} workers, the hosts list {len(hosts)}")
    return sum(1 for stage in range(topology.pp) if len(set(hosts[stage * size:(stage + 1) * size])) > 1)
