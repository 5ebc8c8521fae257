"""Executes this worker's part of a KV migration plan.

Layer by layer, in the plan's order: allocate the new layer tensor, fill every (layer, KV head range) it receives —
from its own old tensor, or through the KV channel from a peer (the shared-memory channel reads straight out of the
peer's pool) — for the used blocks only; then a world barrier (every receiver of the layer is done reading), then
free the old layer. A layer whose slice does not change is kept as it is. The extra memory stays near one layer.

Which blocks move is given per pair of KV pools (old pool, new pool) by block maps: the old ids and the new ids in
matching order (the router renumbers blocks in a switch to or from an EP layout). Without maps every used block
keeps its id in the one pool 0, and each run of consecutive ids is copied with one strided slice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from services.topology import KVMigrationPlan, KVTransfer
from services.worker.channel import KVChannel, Source
from services.worker.kv_cache import KVCache, KVLayer

BlockMaps = dict[tuple[int, int], tuple[list[int], list[int]]]  # (src_pool, dst_pool) -> (src ids, dst ids)


@dataclass(slots=True)
class MigrationStats:
    """What one worker's migration did."""

    bytes_received: int = 0     # from peers
    bytes_local: int = 0        # copied inside this worker (head offsets changed)
    layers_kept: int = 0        # layer tensors kept as they were (no copy)
    peak_extra_bytes: int = 0   # most bytes held above the old layout at once (new layers allocated - old freed)
    seconds: float = 0.0


class MigrationAborted(RuntimeError):
    """A rank failed during a layer; every rank stopped after the same layer. `done_layers` are in the new
    layout (their old storage freed); every other layer is still in the old layout."""

    def __init__(self, layer: int, done_layers: list[int], cause: str) -> None:
        super().__init__(f"KV migration aborted at layer {layer}: {cause}")
        self.layer = layer
        self.done_layers = done_layers


@dataclass(frozen=True, slots=True)
class PoolBlocks:
    """The blocks one (src_pool, dst_pool) pair moves: block `src[i]` of the source pool lands in block `dst[i]`
    of the destination pool (pairs sorted by source id). `runs`: when every block keeps its id, the ids as runs of
    consecutive ids (see block_runs), each copied with one strided slice instead of a gather and a scatter."""

    src: torch.Tensor  # int64 [n]
    dst: torch.Tensor  # int64 [n]
    runs: tuple[tuple[int, int, int], ...] | None

    def __len__(self) -> int:
        return len(self.src)


def identity_block_maps(used_block_ids: Iterable[int]) -> BlockMaps:
    """The maps of a switch that keeps block ids: every used block of the one pool 0 stays where it is."""
    used = sorted(used_block_ids)
    return {(0, 0): (used, list(used))}


def check_block_maps(block_maps: Mapping[tuple[int, int], tuple[list[int], list[int]]]) -> None:
    """ValueError unless every pair's id lists match in length, ids are >= 0 and no destination block of a pool is
    written twice (over all pairs into it)."""
    written: dict[int, set[int]] = {}
    for (src_pool, dst_pool), (src_ids, dst_ids) in block_maps.items():
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"block map {src_pool} -> {dst_pool}: {len(src_ids)} source ids for {len(dst_ids)} "
                             "destination ids")
        if any(block < 0 for block in (*src_ids, *dst_ids)):
            raise ValueError(f"block map {src_pool} -> {dst_pool}: block ids must be >= 0")
        seen = written.setdefault(dst_pool, set())
        if len(set(dst_ids)) != len(dst_ids) or seen & set(dst_ids):
            raise ValueError(f"block map {src_pool} -> {dst_pool}: a block of pool {dst_pool} is written twice")
        seen.update(dst_ids)


def reverse_block_maps(block_maps: BlockMaps | None) -> BlockMaps | None:
    """The maps that move blocks back: (dst_pool, src_pool) -> (dst ids, src ids) (None stays None: identity).
    An old block copied to several new ones (a shared block) is moved back once, from its first copy."""
    if block_maps is None:
        return None
    reverse: BlockMaps = {}
    restored: dict[int, set[int]] = {}  # old pool -> old ids already moved back
    for (src_pool, dst_pool), (src_ids, dst_ids) in block_maps.items():
        done = restored.setdefault(src_pool, set())
        back_src, back_dst = reverse.setdefault((dst_pool, src_pool), ([], []))
        for old_id, new_id in zip(src_ids, dst_ids):
            if old_id not in done:
                done.add(old_id)
                back_src.append(new_id)
                back_dst.append(old_id)
    return reverse


def block_maps_from_proto(messages: Iterable) -> BlockMaps | None:
    """ApplySwitchRequest.block_maps (BlockMap messages) as a dict; None when there are none (blocks keep their
    ids); ValueError on a pair given twice or maps check_block_maps refuses."""
    maps: BlockMaps = {}
    for message in messages:
        pair = (int(message.src_pool), int(message.dst_pool))
        if pair in maps:
            raise ValueError(f"block map {pair[0]} -> {pair[1]} given twice")
        maps[pair] = (list(message.src_block_ids), list(message.dst_block_ids))
    if not maps:
        return None
    check_block_maps(maps)
    return maps


def merge_block_maps(*maps: BlockMaps | None) -> BlockMaps:
    """Several maps as one (a pair's ids concatenated; None adds nothing): a pre-copy round's full and warm blocks."""
    merged: BlockMaps = {}
    for block_maps in maps:
        for pair, (src_ids, dst_ids) in (block_maps or {}).items():
            src, dst = merged.setdefault(pair, ([], []))
            src.extend(src_ids)
            dst.extend(dst_ids)
    return merged


def block_counts(block_maps: Mapping[tuple[int, int], tuple[list[int], list[int]]]) -> dict[tuple[int, int], int]:
    """(src_pool, dst_pool) -> blocks the pair moves (what a receive buffer holds; plan.bytes_moved's input)."""
    return {pair: len(src_ids) for pair, (src_ids, _) in block_maps.items()}


def pool_blocks(block_maps: Mapping[tuple[int, int], tuple[list[int], list[int]]]
                ) -> dict[tuple[int, int], PoolBlocks]:
    """Each pair's blocks as index tensors, sorted by source id, with runs where the ids stay the same."""
    check_block_maps(block_maps)
    blocks = {}
    for pair, (src_ids, dst_ids) in block_maps.items():
        ordered = sorted(zip(src_ids, dst_ids))
        src, dst = [a for a, _ in ordered], [b for _, b in ordered]
        blocks[pair] = PoolBlocks(torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64),
                                  tuple(block_runs(src)) if src == dst else None)
    return blocks


def migrate_kv(plan: KVMigrationPlan, rank: int, old_cache: KVCache | None, new_cache: KVCache | None,
               used_block_ids: list[int], channel: KVChannel, agree: Callable[[bool], bool],
               layers: list[int] | None = None, fault: Callable[[int], None] | None = None,
               block_maps: BlockMaps | None = None) -> MigrationStats:
    """Move this rank's KV to the new layout (all layers, or `layers`, in the plan's order).

    Collective: every rank of the world calls it with the same plan and maps. After each layer the ranks agree
    (`agree` is an all-reduce of "my part succeeded"); only then is the old layer freed. If any rank failed, every
    rank raises MigrationAborted at the same layer, with the same done layers: the journal a rollback replays.
    block_maps: (src_pool, dst_pool) -> (src ids, dst ids), what each transfer of that pool pair copies (a pair
    not there copies nothing); None: every used block keeps its id in pool 0.
    """
    started = time.perf_counter()
    stats = MigrationStats()
    maps = pool_blocks(identity_block_maps(used_block_ids) if block_maps is None else block_maps)
    keeps_ids = all(blocks.runs is not None for blocks in maps.values())

    def moves(transfer: KVTransfer) -> bool:  # its pool pair has blocks to copy (senders and receivers agree)
        return len(maps.get(transfer.pools, ())) > 0

    extra = 0  # bytes allocated for the new layout minus bytes of the old one freed so far
    same_blocks = old_cache is not None and new_cache is not None and old_cache.num_blocks == new_cache.num_blocks
    done: list[int] = []
    order = plan.layers() if layers is None else [layer for layer in plan.layers() if layer in set(layers)]
    for layer in order:
        transfers = plan.for_layer(layer)
        fresh: KVLayer | None = None
        kept = False
        error = ""
        try:
            outgoing = []
            if channel.needs_outgoing:
                outgoing = [(t, _slice(old_cache.layer(layer).tensor, maps[t.pools].src, t.src_head_offset,
                                       t.num_kv_heads))
                            for t in transfers if t.src_rank == rank and not t.is_local and moves(t)]
            incoming = [t for t in transfers if t.dst_rank == rank and not t.is_local and moves(t)]
            if new_cache is not None and layer in plan.new_local_layers(rank):
                if same_blocks and keeps_ids and plan.is_identity_for(rank, layer):
                    kept = True  # nothing changes for this layer: the old tensor is moved over as is
                else:
                    fresh = new_cache.new_layer()
                    extra += _nbytes(fresh.tensor)
                    stats.peak_extra_bytes = max(stats.peak_extra_bytes, extra)
            received = channel.exchange(layer, outgoing, incoming)
            if fault is not None:
                fault(layer)
            if fresh is not None:
                fill_layer(fresh, [t for t in transfers if moves(t)], rank, old_cache, received, maps, layer, stats)
            channel.settle()
        except Exception as exc:  # this rank's part failed: tell the others instead of leaving them waiting
            error = f"{type(exc).__name__}: {exc}"
        broken: BaseException | None = None
        try:
            agreed = agree(not error)  # every receiver of this layer has read it, or someone failed
        except BaseException as exc:  # the world itself broke (a peer died): nobody can agree any more
            agreed, broken = False, exc
        if not agreed:
            channel.close()
            if fresh is not None:
                fresh.free()
            if broken is not None:
                raise broken
            raise MigrationAborted(layer, done, error or "another rank failed")
        if kept:
            new_cache.set_layer(layer, old_cache.pop_layer(layer))
            stats.layers_kept += 1
        if fresh is not None:
            new_cache.set_layer(layer, fresh)
        if old_cache is not None and old_cache.has_layer(layer):
            old_layer = old_cache.pop_layer(layer)
            extra -= _nbytes(old_layer.tensor)
            old_layer.free()
        done.append(layer)
    channel.close()
    stats.seconds = time.perf_counter() - started
    return stats


def fill_layer(fresh: KVLayer, transfers, rank: int, old_cache: KVCache | None, received: dict[KVTransfer, Source],
               maps: dict[tuple[int, int], PoolBlocks], layer: int, stats: MigrationStats) -> None:
    """Copy every transfer into `fresh`, with its pool pair's blocks."""
    for t in transfers:
        if t.dst_rank != rank:
            continue
        source = (Source(old_cache.layer(layer).tensor, t.src_head_offset, by_block_id=True) if t.is_local
                  else received[t])
        nbytes = copy_blocks(fresh.tensor, source, maps[t.pools], t.dst_head_offset, t.num_kv_heads)
        if t.is_local:
            stats.bytes_local += nbytes
        else:
            stats.bytes_received += nbytes


def copy_blocks(target: torch.Tensor, source: Source, blocks: PoolBlocks, head_offset: int, num_heads: int) -> int:
    """Copy `num_heads` heads of `blocks` from `source` into `target` (a layer tensor, at `head_offset` among its
    heads); the source is indexed by block id, or by position among the pair's blocks (a packed receive buffer).
    Blocks that keep their ids: one strided slice copy per run; else a gather and an indexed assignment. Returns
    the bytes copied."""
    s0, d0 = source.head_offset, head_offset
    if blocks.runs is not None:
        nbytes = 0
        for first, stop, position in blocks.runs:  # ids [first, stop) are positions [position, ...) of the pair
            a, b = (first, stop) if source.by_block_id else (position, position + stop - first)
            part = source.tensor[:, a:b, :, s0:s0 + num_heads]
            target[:, first:stop, :, d0:d0 + num_heads] = part
            nbytes += part.numel() * part.element_size()
        return nbytes
    if source.by_block_id:
        part = source.tensor[:, blocks.src.to(source.tensor.device), :, s0:s0 + num_heads]
    else:
        part = source.tensor[:, :len(blocks), :, s0:s0 + num_heads]
    target[:, blocks.dst.to(target.device), :, d0:d0 + num_heads] = part
    return part.numel() * part.element_size()


def block_runs(used_block_ids: list[int]) -> list[tuple[int, int, int]]:
    """Sorted block ids as runs (first, stop, position of first among them): few, since ids are given lowest
    first; a run is copied with one strided slice instead of a gather and a scatter."""
    runs: list[tuple[int, int, int]] = []
    for position, block in enumerate(used_block_ids):
        if runs and runs[-1][1] == block:
            first, _, start = runs[-1]
            runs[-1] = (first, block + 1, start)
        else:
            runs.append((block, block + 1, position))
    return runs


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _slice(cache: torch.Tensor, blocks: torch.Tensor, head_offset: int, num_heads: int) -> torch.Tensor:
    """K/V of some blocks and a head range: [2, blocks, block_size, heads, D] (a copy: advanced indexing)."""
    return cache[:, blocks.to(cache.device), :, head_offset:head_offset + num_heads]
