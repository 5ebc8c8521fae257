"""Which active worker holds which layers, heads, MLP columns and vocabulary rows in a topology."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.topology.topology import ModelShape, Topology, TopologyError, partition_errors, topology_errors

VOCAB_PADDING = 64  # every TP rank's vocabulary slice is a multiple of this many rows


def layer_partition(num_layers: int, pp: int, partition: Sequence[int] | None = None) -> list[range]:
    """Layers of each pipeline stage: an even split as vLLM's get_pp_indices, or an explicit list of counts."""
    if not isinstance(num_layers, int) or num_layers < 1 or not isinstance(pp, int) or pp < 1:
        raise TopologyError(f"layer_partition needs num_layers >= 1 and pp >= 1, got {num_layers}, {pp}")
    if partition is not None:
        errors = partition_errors(partition, pp, num_layers)
        if errors:
            raise TopologyError("; ".join(errors))
        counts = list(partition)
    else:
        if pp > num_layers:
            raise TopologyError(f"pp={pp} exceeds num_layers={num_layers}")
        counts = [num_layers // pp] * pp
        # The first stage also embeds and the last also runs lm_head, so the remainder goes to
        # stages pp-2, pp-3, ..., 0 (the remainder is < pp, so the last stage never gets one).
        for i in range(num_layers % pp):
            counts[(pp - 2 - i) % pp] += 1
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """vocab_size rounded up to a multiple of 64 * tp (so every TP rank holds the same number of rows)."""
    if vocab_size < 1 or tp < 1:
        raise ValueError(f"padded_vocab_size needs vocab_size >= 1 and tp >= 1, got {vocab_size}, {tp}")
    multiple = VOCAB_PADDING * tp
    return -(-vocab_size // multiple) * multiple


def _slice(total: int, tp_size: int, tp_rank: int) -> range:
    per_rank = total // tp_size
    return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)


@dataclass(frozen=True, slots=True)
class WorkerPlacement:
    """What one active worker holds in a topology."""

    index: int  # position in the active worker list = pp_rank * stage size + tp_rank (or ep_rank)
    pp_rank: int
    tp_rank: int
    layers: range  # global layer ids held
    q_heads: range  # H/tp contiguous query heads
    kv_heads: range  # Hkv/tp contiguous KV heads, or the one (replicated) head its q_heads use when Hkv < tp
    intermediate: range  # columns of gate/up, rows of down: I/tp contiguous
    vocab_rows: range  # rows of embedding / lm_head in the padded vocabulary: padded/tp contiguous
    pp_size: int
    tp_size: int
    num_kv_replicas: int  # TP ranks holding the same KV head: tp // Hkv when Hkv < tp, else 1
    # Mixture of experts. TP: every expert, the tp_rank-th slice of its intermediate dimension. EP (ep_size > 1):
    # attention data-parallel (all heads, for this rank's own requests), whole experts in a range of slots.
    ep_rank: int = 0
    ep_size: int = 1
    expert_slots: range = range(0)  # physical expert slots held (EP: a contiguous range; TP: all of them)
    expert_intermediate: range = range(0)  # columns of each expert's gate/up, rows of its down

    @property
    def stage_rank(self) -> int:
        """Rank within the stage's group (its TP group, or its EP group)."""
        return self.ep_rank if self.ep_size > 1 else self.tp_rank

    @property
    def dp_rank(self) -> int:
        """The data-parallel rank whose requests this worker runs attention for (0 outside EP layouts)."""
        return self.ep_rank

    @property
    def is_first_stage(self) -> bool:
        """Whether this worker embeds the input tokens."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this worker runs the final norm and lm_head."""
        return self.pp_rank == self.pp_size - 1


@dataclass(frozen=True, slots=True)
class Placement:
    """Placement of a model on the active workers of a topology (one source of truth for who holds what)."""

    topology: Topology
    shape: ModelShape
    workers: tuple[WorkerPlacement, ...]  # indexed by active position
    padded_vocab_size: int
    num_physical_experts: int = 0  # expert slots per MoE layer: num_experts (+ redundant ones in an EP layout)

    def worker(self, pp_rank: int, tp_rank: int) -> WorkerPlacement:
        """The worker at stage pp_rank, rank tp_rank of the stage's group (its TP or EP rank)."""
        if not (0 <= pp_rank < self.topology.pp and 0 <= tp_rank < self.topology.stage_size):
            raise IndexError(f"no worker pp_rank={pp_rank}, tp_rank={tp_rank} in {self.topology}")
        return self.workers[pp_rank * self.topology.stage_size + tp_rank]

    def stage(self, pp_rank: int) -> tuple[WorkerPlacement, ...]:
        """The group of a stage (TP or EP), by rank."""
        return tuple(self.workers[index] for index in self.tp_group_indices(pp_rank))

    def tp_group_indices(self, pp_rank: int) -> list[int]:
        """Active indices of a stage's group (its TP group, or its EP group)."""
        if not 0 <= pp_rank < self.topology.pp:
            raise IndexError(f"no stage pp_rank={pp_rank} in {self.topology}")
        size = self.topology.stage_size
        return list(range(pp_rank * size, (pp_rank + 1) * size))

    def stage_of_layer(self, layer: int) -> int:
        """The pp_rank of the stage holding a global layer id."""
        for pp_rank in range(self.topology.pp):
            if layer in self.workers[pp_rank * self.topology.stage_size].layers:
                return pp_rank
        raise IndexError(f"layer {layer} not in a model of {self.shape.num_layers} layers")

    def owners_of_layer(self, layer: int) -> tuple[WorkerPlacement, ...]:
        """Every worker holding (a TP shard of) a layer: the TP group of its stage."""
        return self.stage(self.stage_of_layer(layer))

    def owners_of_kv_head(self, layer: int, kv_head: int) -> tuple[WorkerPlacement, ...]:
        """Workers holding one KV head of one layer (more than one when KV heads are replicated)."""
        if not 0 <= kv_head < self.shape.num_kv_heads:
            raise IndexError(f"kv_head {kv_head} not in a model of {self.shape.num_kv_heads} KV heads")
        return tuple(worker for worker in self.owners_of_layer(layer) if kv_head in worker.kv_heads)


def place(topology: Topology, shape: ModelShape, layer_partition: Sequence[int] | None = None,
          num_redundant_experts: int = 0) -> Placement:
    """Validate (num_workers = topology.num_workers) and compute the placement. num_redundant_experts: extra expert
    slots of an EP layout (ignored by TP layouts, where every rank holds a slice of every expert)."""
    # Not validate(): its list of the layouts that do run is for a person choosing one, on the stack's workers.
    if errors := topology_errors(topology, shape, topology.num_workers, layer_partition, num_redundant_experts):
        raise TopologyError("; ".join(errors))
    if topology.is_expert_parallel:
        return _expert_parallel_placement(topology, shape, layer_partition, num_redundant_experts)
    return _compute_placement(topology, shape, layer_partition)


def _expert_parallel_placement(topology: Topology, shape: ModelShape, partition: Sequence[int] | None,
                               num_redundant_experts: int) -> Placement:
    """ep × pp: each rank of a stage holds the stage's layers whole (attention for its own requests, the dense MLPs,
    the embedding / lm_head) and a contiguous range of the physical expert slots, each expert whole."""
    ep, pp = topology.ep, topology.pp
    stage_layers = layer_partition(shape.num_layers, pp, partition)
    num_physical = shape.num_experts + num_redundant_experts
    per_rank = num_physical // ep
    padded = padded_vocab_size(shape.vocab_size, 1)
    workers = tuple(
        WorkerPlacement(
            index=pp_rank * ep + ep_rank, pp_rank=pp_rank, tp_rank=0, layers=stage_layers[pp_rank],
            q_heads=range(shape.num_heads), kv_heads=range(shape.num_kv_heads),
            intermediate=range(shape.intermediate_size), vocab_rows=range(padded), pp_size=pp, tp_size=1,
            num_kv_replicas=1, ep_rank=ep_rank, ep_size=ep,
            expert_slots=range(ep_rank * per_rank, (ep_rank + 1) * per_rank),
            expert_intermediate=range(shape.moe_intermediate_size),
        )
        for pp_rank in range(pp) for ep_rank in range(ep)
    )
    return Placement(topology=topology, shape=shape, workers=workers, padded_vocab_size=padded,
                     num_physical_experts=num_physical)


def _compute_placement(topology: Topology, shape: ModelShape, partition: Sequence[int] | None) -> Placement:
    tp, pp = topology.tp, topology.pp
    stage_layers = layer_partition(shape.num_layers, pp, partition)
    padded = padded_vocab_size(shape.vocab_size, tp)
    num_kv_replicas = max(1, tp // shape.num_kv_heads)
    workers = []
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            if num_kv_replicas > 1:
                kv_head = tp_rank // num_kv_replicas
                kv_heads = range(kv_head, kv_head + 1)
            else:
                kv_heads = _slice(shape.num_kv_heads, tp, tp_rank)
            workers.append(
                WorkerPlacement(
                    index=pp_rank * tp + tp_rank,
                    pp_rank=pp_rank,
                    tp_rank=tp_rank,
                    layers=stage_layers[pp_rank],
                    q_heads=_slice(shape.num_heads, tp, tp_rank),
                    kv_heads=kv_heads,
                    intermediate=_slice(shape.intermediate_size, tp, tp_rank),
                    vocab_rows=_slice(padded, tp, tp_rank),
                    pp_size=pp,
                    tp_size=tp,
                    num_kv_replicas=num_kv_replicas,
                    expert_slots=range(shape.num_experts),
                    expert_intermediate=_slice(shape.moe_intermediate_size, tp, tp_rank),
                )
            )
    return Placement(topology=topology, shape=shape, workers=tuple(workers), padded_vocab_size=padded,
                     num_physical_experts=shape.num_experts)
