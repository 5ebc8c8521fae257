"""KV migration plans: every (layer, KV head) slice from an old owner to each of its new owners, as a pure function.

A KV pool is a set of block ids with one meaning: a TP layout has one pool per stage, shared by its ranks (pool 0);
an EP layout has one pool per data-parallel rank (pool = `dp_rank`), each holding all KV heads of its own requests.
A slice is (layer, KV head, old pool); a switch that renumbers blocks (to or from an EP layout) copies each pool pair
with the router's block maps.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.topology.placement import Placement, WorkerPlacement


@dataclass(frozen=True, slots=True)
class KVTransfer:
    """Copy KV of `kv_heads` of one layer from src (its pool `src_pool`) to dst (into its pool `dst_pool`): the
    blocks the (src_pool, dst_pool) block map names, or every used block when blocks keep their ids."""

    layer: int
    kv_heads: range  # contiguous global KV heads
    src_rank: int
    dst_rank: int
    src_head_offset: int  # position of kv_heads.start among src's local KV heads in the OLD layout
    dst_head_offset: int  # position of kv_heads.start among dst's local KV heads in the NEW layout
    src_pool: int = 0  # src's KV pool in the OLD layout (its dp_rank in an EP layout, else 0)
    dst_pool: int = 0  # dst's KV pool in the NEW layout

    @property
    def is_local(self) -> bool:
        """A copy inside one worker: no bytes on the wire."""
        return self.src_rank == self.dst_rank

    @property
    def num_kv_heads(self) -> int:
        """KV heads this transfer copies."""
        return len(self.kv_heads)

    @property
    def pools(self) -> tuple[int, int]:
        """(src_pool, dst_pool): the block map this transfer copies with."""
        return self.src_pool, self.dst_pool

    def nbytes(self, num_blocks: int, block_size: int, head_dim: int, dtype_bytes: int) -> int:
        """Bytes copied for `num_blocks` blocks: K and V of each head."""
        return 2 * self.num_kv_heads * num_blocks * block_size * head_dim * dtype_bytes


LOST = -1  # in old ranks: the worker that ran this active index is gone (its KV with it)


class KVLostError(ValueError):
    """Some KV of the old layout lived only on lost workers: it cannot be migrated (the requests re-prefill)."""


def workers_by_rank(placement: Placement, ranks: Sequence[int], allow_lost: bool = False
                    ) -> dict[int, WorkerPlacement]:
    """World rank -> WorkerPlacement, where ranks[i] runs active index i; ValueError on bad ranks.
    With allow_lost, LOST entries are accepted and left out (their slices have no holder)."""
    ranks = tuple(ranks)
    if any(not isinstance(rank, int) or isinstance(rank, bool) or (rank < 0 and not (allow_lost and rank == LOST))
           for rank in ranks):
        raise ValueError(f"ranks must be ints >= 0{' or LOST' if allow_lost else ''}, got {ranks}")
    alive = [rank for rank in ranks if rank != LOST]
    if len(set(alive)) != len(alive):
        raise ValueError(f"ranks must be unique, got {ranks}")
    if len(ranks) != placement.topology.num_workers:
        raise ValueError(f"{placement.topology} needs {placement.topology.num_workers} ranks, got {len(ranks)}")
    return {rank: placement.workers[index] for index, rank in enumerate(ranks) if rank != LOST}


def lost_kv(old: Placement, old_ranks: Sequence[int]) -> list[tuple[int, int]]:
    """(layer, KV head) slices of the old layout that no surviving worker holds (old_ranks may hold LOST).
    In an expert-parallel layout each rank holds the KV of its own requests only, which no other rank has: a lost
    rank's stage reports all its (layer, KV head) slices."""
    survivors = list(workers_by_rank(old, old_ranks, allow_lost=True).values())
    if old.topology.is_expert_parallel:
        broken = {old.workers[index].pp_rank for index, rank in enumerate(old_ranks) if rank == LOST}
        survivors = [worker for worker in survivors if worker.pp_rank not in broken]
    held = {(layer, head) for worker in survivors for layer in worker.layers for head in worker.kv_heads}
    return [(layer, head) for layer in range(old.shape.num_layers) for head in range(old.shape.num_kv_heads)
            if (layer, head) not in held]


def kv_pool(placement: Placement, worker: WorkerPlacement) -> int:
    """The KV pool a worker's cache holds in a placement: its dp_rank (0, the stage's one pool, outside EP)."""
    return worker.dp_rank


def num_kv_pools(placement: Placement) -> int:
    """KV pools of a layout, per stage (Topology.num_kv_pools)."""
    return placement.topology.num_kv_pools


def renumbers_blocks(old: Placement, old_ranks: Sequence[int], new: Placement, new_ranks: Sequence[int]) -> bool:
    """Whether a switch gives blocks new ids (so no layer tensor can be kept as is): one to or from an EP layout,
    unless nothing changes (the same layout on the same ranks)."""
    if not (old.topology.is_expert_parallel or new.topology.is_expert_parallel):
        return False
    return not (old == new and tuple(old_ranks) == tuple(new_ranks))


def check_same_model(old: Placement, new: Placement) -> None:
    """ValueError unless both placements are of the same ModelShape."""
    if old.shape != new.shape:
        raise ValueError(f"placements of different models: {old.shape} vs {new.shape}")


@dataclass(frozen=True, slots=True)
class KVMigrationPlan:
    """Which KV slices move where when the layout changes from (old, old_ranks) to (new, new_ranks)."""

    old: Placement
    old_ranks: tuple[int, ...]  # LOST where the worker that held that active index is gone
    new: Placement
    new_ranks: tuple[int, ...]
    transfers: tuple[KVTransfer, ...]  # ordered by layer (execution order), then dst rank, then head
    layer_order: tuple[int, ...]  # every layer once, in the order the executor migrates them
    _old_workers: dict[int, WorkerPlacement] = field(init=False, repr=False, compare=False)
    _new_workers: dict[int, WorkerPlacement] = field(init=False, repr=False, compare=False)
    _by_layer: dict[int, tuple[KVTransfer, ...]] = field(init=False, repr=False, compare=False)
    _renumbers: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_same_model(self.old, self.new)
        if sorted(self.layer_order) != list(range(self.old.shape.num_layers)):
            raise ValueError(f"layer_order must hold every layer once, got {self.layer_order}")
        object.__setattr__(self, "_old_workers", workers_by_rank(self.old, self.old_ranks, allow_lost=True))
        object.__setattr__(self, "_new_workers", workers_by_rank(self.new, self.new_ranks))
        by_layer: dict[int, list[KVTransfer]] = {layer: [] for layer in self.layer_order}
        for transfer in self.transfers:
            by_layer[transfer.layer].append(transfer)
        object.__setattr__(self, "_by_layer", {layer: tuple(items) for layer, items in by_layer.items()})
        object.__setattr__(self, "_renumbers", renumbers_blocks(self.old, self.old_ranks, self.new, self.new_ranks))

    def layers(self) -> list[int]:
        """Every layer, in execution order."""
        return list(self.layer_order)

    def for_layer(self, layer: int) -> tuple[KVTransfer, ...]:
        """Transfers of one layer (local ones included)."""
        return self._by_layer[layer]

    def sends_of(self, rank: int) -> tuple[KVTransfer, ...]:
        """Transfers `rank` sources (local ones included)."""
        return tuple(t for t in self.transfers if t.src_rank == rank)

    def receives_of(self, rank: int) -> tuple[KVTransfer, ...]:
        """Transfers `rank` writes into its new layer tensors (local ones included)."""
        return tuple(t for t in self.transfers if t.dst_rank == rank)

    def ranks(self) -> list[int]:
        """Every rank active before or after, sorted."""
        return sorted((set(self.old_ranks) - {LOST}) | set(self.new_ranks))

    @property
    def has_lost_sources(self) -> bool:
        """Whether a worker of the old layout is gone (such a plan cannot be reversed onto the old layout)."""
        return LOST in self.old_ranks

    def old_local_layers(self, rank: int) -> range:
        """Layers `rank` holds in the old layout (empty if it was not active)."""
        worker = self._old_workers.get(rank)
        return worker.layers if worker is not None else range(0)

    def new_local_layers(self, rank: int) -> range:
        """Layers `rank` holds in the new layout (empty if it is not active)."""
        worker = self._new_workers.get(rank)
        return worker.layers if worker is not None else range(0)

    def old_local_kv_heads(self, rank: int) -> range:
        """Global KV heads of each local layer tensor of `rank` in the old layout."""
        worker = self._old_workers.get(rank)
        return worker.kv_heads if worker is not None else range(0)

    def new_local_kv_heads(self, rank: int) -> range:
        """Global KV heads of each local layer tensor of `rank` in the new layout."""
        worker = self._new_workers.get(rank)
        return worker.kv_heads if worker is not None else range(0)

    def old_pool(self, rank: int) -> int:
        """KV pool of `rank`'s cache in the old layout (0 if it was not active)."""
        worker = self._old_workers.get(rank)
        return kv_pool(self.old, worker) if worker is not None else 0

    def new_pool(self, rank: int) -> int:
        """KV pool of `rank`'s cache in the new layout (0 if it is not active)."""
        worker = self._new_workers.get(rank)
        return kv_pool(self.new, worker) if worker is not None else 0

    @property
    def renumbers_blocks(self) -> bool:
        """Whether blocks get new ids (a switch to or from an EP layout): the executor needs the block maps."""
        return self._renumbers

    def is_identity_for(self, rank: int, layer: int) -> bool:
        """Whether `rank` may keep its old tensor of `layer` as is (same local heads, blocks keep their ids; block
        count unchanged)."""
        return (
            not self._renumbers
            and layer in self.old_local_layers(rank)
            and layer in self.new_local_layers(rank)
            and self.old_local_kv_heads(rank) == self.new_local_kv_heads(rank)
        )

    def bytes_moved(self, num_used_blocks: int, block_size: int, head_dim: int, dtype_bytes: int,
                    blocks_per_pools: dict[tuple[int, int], int] | None = None) -> dict[tuple[int, int], int]:
        """(src, dst) -> bytes sent over the wire for `num_used_blocks` live blocks (remote transfers only); with
        `blocks_per_pools` ((src_pool, dst_pool) -> blocks its map moves) each transfer counts its own pair's."""
        moved: Counter[tuple[int, int]] = Counter()
        for transfer in self.transfers:
            if not transfer.is_local:
                blocks = num_used_blocks if blocks_per_pools is None else blocks_per_pools.get(transfer.pools, 0)
                moved[transfer.src_rank, transfer.dst_rank] += transfer.nbytes(
                    blocks, block_size, head_dim, dtype_bytes
                )
        return dict(moved)

    def layer_bytes(self, rank: int, num_blocks: int, block_size: int, head_dim: int, dtype_bytes: int,
                    new_layout: bool = True) -> int:
        """Bytes of one local layer tensor [2, num_blocks, block_size, local_kv_heads, head_dim] of `rank`."""
        heads = self.new_local_kv_heads(rank) if new_layout else self.old_local_kv_heads(rank)
        return 2 * num_blocks * block_size * len(heads) * head_dim * dtype_bytes

    def peak_extra_bytes(self, rank: int, num_blocks: int, block_size: int, head_dim: int, dtype_bytes: int,
                         new_num_blocks: int | None = None) -> int:
        """Peak KV memory of `rank` during the migration above max(before, after).

        Executing layer by layer in `layer_order`: allocate the new layer tensor, copy into it, free the old one
        right after (a layer that `is_identity_for` keeps its tensor when the block count is unchanged).
        """
        new_num_blocks = num_blocks if new_num_blocks is None else new_num_blocks
        old_size = self.layer_bytes(rank, num_blocks, block_size, head_dim, dtype_bytes, new_layout=False)
        new_size = self.layer_bytes(rank, new_num_blocks, block_size, head_dim, dtype_bytes)
        keeps = new_num_blocks == num_blocks
        allocated, peak = 0, 0  # bytes above the start of the migration
        for layer in self.layer_order:
            if keeps and self.is_identity_for(rank, layer):
                continue
            if layer in self.new_local_layers(rank):
                allocated += new_size
                peak = max(peak, allocated)
            if layer in self.old_local_layers(rank):
                allocated -= old_size
        return max(0, peak - max(0, allocated))


def plan_kv_migration(old: Placement, old_ranks: Sequence[int], new: Placement, new_ranks: Sequence[int]
                      ) -> KVMigrationPlan:
    """The KV migration from (old, old_ranks) to (new, new_ranks); ranks[i] is the world rank of active index i.
    old_ranks may hold LOST (a worker gone): its slices come from replicas, or KVLostError says which have none.

    Every new holder of (layer, KV head) gets it from every pool of the old layout (one in a TP layout, one per
    data-parallel rank in an EP one): each (layer, head, old pool) from one old worker holding it in that pool
    (itself if it does, else the one that sent least), into the new holder's own pool. Which blocks a pool pair
    moves is the executor's block map (the router's), not the plan's."""
    check_same_model(old, new)
    old_workers, new_workers = workers_by_rank(old, old_ranks, allow_lost=True), workers_by_rank(new, new_ranks)
    if LOST in old_ranks and (missing := lost_kv(old, old_ranks)):
        raise KVLostError(f"{len(missing)} (layer, KV head) slices lived only on lost workers, e.g. {missing[0]}")
    order = _layer_order(old_workers, new_workers, old.shape.num_layers,
                         renumbers_blocks(old, old_ranks, new, new_ranks))
    sent_total: Counter[int] = Counter()  # heads sent by each rank over all layers
    transfers: list[KVTransfer] = []
    for layer in order:
        sent_in_layer: Counter[int] = Counter()
        old_stage = [(rank, w) for rank, w in old_workers.items() if layer in w.layers]
        for dst in sorted(rank for rank, w in new_workers.items() if layer in w.layers):
            dst_heads, dst_pool = new_workers[dst].kv_heads, kv_pool(new, new_workers[dst])
            for src_pool in range(num_kv_pools(old)):
                pieces = []
                for head in dst_heads:
                    owners = [rank for rank, w in old_stage if head in w.kv_heads and kv_pool(old, w) == src_pool]
                    src = dst if dst in owners else min(owners, key=lambda r: (sent_in_layer[r], sent_total[r], r))
                    if src != dst:
                        sent_in_layer[src] += 1
                        sent_total[src] += 1
                    src_heads = old_workers[src].kv_heads
                    pieces.append(KVTransfer(layer, range(head, head + 1), src, dst, head - src_heads.start,
                                             head - dst_heads.start, src_pool, dst_pool))
                transfers.extend(_merge(pieces))
    return KVMigrationPlan(old, tuple(old_ranks), new, tuple(new_ranks), tuple(transfers), tuple(order))


def _merge(pieces: list[KVTransfer]) -> list[KVTransfer]:
    """Join consecutive transfers of contiguous heads between the same ranks and pools into one large copy."""
    merged: list[KVTransfer] = []
    for piece in pieces:
        last = merged[-1] if merged else None
        if (last is not None and last.src_rank == piece.src_rank and last.dst_rank == piece.dst_rank
                and last.pools == piece.pools and last.kv_heads.stop == piece.kv_heads.start
                and last.src_head_offset + last.num_kv_heads == piece.src_head_offset):
            merged[-1] = KVTransfer(last.layer, range(last.kv_heads.start, piece.kv_heads.stop), last.src_rank,
                                    last.dst_rank, last.src_head_offset, last.dst_head_offset, last.src_pool,
                                    last.dst_pool)
        else:
            merged.append(piece)
    return merged


def _layer_order(old_workers: dict[int, WorkerPlacement], new_workers: dict[int, WorkerPlacement],
                 num_layers: int, renumbered: bool = False) -> list[int]:
    """Greedy layer order keeping every rank's KV memory near max(before, after): interleave freeing and filling.

    Memory is counted in KV heads per layer (every tensor has the same block count). Layers with the same owners
    behave alike, so the greedy picks among those classes, taking each class's layers in ascending order. When
    blocks are `renumbered` no layer is kept as is.
    """
    ranks = sorted(set(old_workers) | set(new_workers))

    def change(layer: int) -> tuple[tuple[int, int], ...]:  # per rank: (heads allocated, heads freed)
        steps = []
        for rank in ranks:
            old, new = old_workers.get(rank), new_workers.get(rank)
            holds_old = old is not None and layer in old.layers
            holds_new = new is not None and layer in new.layers
            if holds_old and holds_new and old.kv_heads == new.kv_heads and not renumbered:
                steps.append((0, 0))  # kept as is
            else:
                steps.append((len(new.kv_heads) if holds_new else 0, len(old.kv_heads) if holds_old else 0))
        return tuple(steps)

    classes: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for layer in range(num_layers):
        classes.setdefault(change(layer), []).append(layer)
    cap = [max(0, sum((key[i][0] - key[i][1]) * len(layers) for key, layers in classes.items()))
           for i in range(len(ranks))]
    held = [0] * len(ranks)  # heads above the start, per rank

    def score(key: tuple[tuple[int, int], ...]) -> tuple[int, list[int], int]:
        # the worst rank during the step, then every rank's excess after it, worst first (leximax)
        peak = max(held[i] + alloc - cap[i] for i, (alloc, _) in enumerate(key))
        after = sorted((held[i] + alloc - free - cap[i] for i, (alloc, free) in enumerate(key)), reverse=True)
        return (peak, after, classes[key][0])

    order: list[int] = []
    while len(order) < num_layers:
        key = min((k for k in classes if classes[k]), key=score)
        order.append(classes[key].pop(0))
        held = [held[i] + alloc - free for i, (alloc, free) in enumerate(key)]
    return order
