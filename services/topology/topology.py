"""Parallel layouts (tp × pp), their text form, and whether one can run a given model."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, fields

# One "<key><count>" token; a topology string is one or more of them with no separators.
_TOKEN = re.compile(r"(tp|pp|ep|dp)([0-9]+)", re.ASCII)
_EXPECTED_FORM = "expected 'tpXppY' with X, Y >= 1, e.g. 'tp2pp2'"


class TopologyError(ValueError):
    """A topology that cannot run (bad text, or invalid for the model / worker count)."""


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


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

    def __post_init__(self) -> None:
        bad = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if not _is_count(getattr(self, f.name))]
        if bad:
            raise ValueError(f"ModelShape dimensions must be ints >= 1: {', '.join(bad)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelShape: num_kv_heads={self.num_kv_heads} does not divide num_heads={self.num_heads}"
            )

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (1 for MHA, H/Hkv for GQA)."""
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True, slots=True)
class Topology:
    """A parallel layout: tp × pp (ep, dp reserved for MoE / data parallelism, must be 1 for now)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        bad = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if not _is_count(getattr(self, f.name))]
        if bad:
            raise TopologyError(f"invalid topology: {', '.join(bad)}; every degree must be an int >= 1")
        unsupported = [f"{name}={getattr(self, name)}" for name in ("ep", "dp") if getattr(self, name) != 1]
        if unsupported:
            raise TopologyError(f"{', '.join(unsupported)}: expert / data parallelism is not supported yet")

    @property
    def num_workers(self) -> int:
        """Active workers this layout uses."""
        return self.tp * self.pp * self.dp

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
        return f"tp{self.tp}pp{self.pp}"


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
) -> None:
    """Raise TopologyError listing every reason the topology cannot run this model on num_workers workers."""
    tp, pp = topology.tp, topology.pp
    errors = []
    if shape.num_heads % tp:
        errors.append(f"tp={tp} does not divide num_heads={shape.num_heads}")
    if shape.num_kv_heads % tp and tp % shape.num_kv_heads:
        errors.append(f"num_kv_heads={shape.num_kv_heads} and tp={tp}: one must divide the other")
    if shape.intermediate_size % tp:
        errors.append(f"tp={tp} does not divide intermediate_size={shape.intermediate_size}")
    if pp > shape.num_layers:
        errors.append(f"pp={pp} exceeds num_layers={shape.num_layers}")
    if topology.num_workers > num_workers:
        errors.append(f"tp*pp={topology.num_workers} exceeds the {num_workers} available workers")
    if layer_partition is not None:
        errors.extend(partition_errors(layer_partition, pp, shape.num_layers))
    if errors:
        raise TopologyError("; ".join(errors))


def candidate_topologies(shape: ModelShape, num_workers: int) -> list[Topology]:
    """Every (tp, pp) with tp*pp <= num_workers that validate() accepts, sorted by (tp*pp, tp)."""
    candidates = []
    for tp in range(1, num_workers + 1):
        for pp in range(1, num_workers // tp + 1):
            topology = Topology(tp=tp, pp=pp)
            try:
                validate(topology, shape, num_workers)
            except TopologyError:
                continue
            candidates.append(topology)
    return sorted(candidates, key=lambda t: (t.tp * t.pp, t.tp))


def degraded_topology(current: Topology, shape: ModelShape, num_workers: int) -> Topology:
    """The layout to serve on `num_workers` workers after losing some: `current` if it still fits (a standby
    took the lost worker's place); else the valid topology that uses the most workers, the nearest to current's
    tp (fewest head moves), then the larger tp (lower latency). TopologyError when none fits (no worker left)."""
    if num_workers >= current.num_workers:
        return current
    fits = candidate_topologies(shape, num_workers)
    if not fits:
        raise TopologyError(f"no topology of this model fits {num_workers} workers")
    return min(fits, key=lambda t: (-t.num_workers, abs(t.tp - current.tp), -t.tp))
