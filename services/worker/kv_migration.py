"""Executes this worker's part of a KV migration plan.

Layer by layer, in the plan's order: allocate the new layer tensor, fill every (layer, KV head range) it receives —
from its own old tensor, or through the KV channel from a peer (the shared-memory channel reads straight out of the
peer's pool) — for the used blocks only; then a world barrier (every receiver of the layer is done reading), then
free the old layer. A layer whose slice does not change is kept as it is. The extra memory stays near one layer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.topology import KVMigrationPlan, KVTransfer
from services.worker.channel import KVChannel, Source
from services.worker.kv_cache import KVCache, KVLayer


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


def migrate_kv(plan: KVMigrationPlan, rank: int, old_cache: KVCache | None, new_cache: KVCache | None,
               used_block_ids: list[int], channel: KVChannel, agree: Callable[[bool], bool],
               layers: list[int] | None = None, fault: Callable[[int], None] | None = None) -> MigrationStats:
    """Move this rank's KV to the new layout (all layers, or `layers`, in the plan's order).

    Collective: every rank of the world calls it with the same plan. After each layer the ranks agree (`agree`
    is an all-reduce of "my part succeeded"); only then is the old layer freed. If any rank failed, every rank
    raises MigrationAborted at the same layer, with the same done layers: the journal a rollback replays.
    """
    started = time.perf_counter()
    stats = MigrationStats()
    used = torch.tensor(sorted(used_block_ids), dtype=torch.int64)
    runs = block_runs(sorted(used_block_ids))
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
                outgoing = [(t, _slice(old_cache.layer(layer).tensor, used, t.src_head_offset, t.num_kv_heads))
                            for t in transfers if t.src_rank == rank and not t.is_local]
            incoming = [t for t in transfers if t.dst_rank == rank and not t.is_local]
            if new_cache is not None and layer in plan.new_local_layers(rank):
                if same_blocks and plan.is_identity_for(rank, layer):
                    kept = True  # nothing changes for this layer: the old tensor is moved over as is
                else:
                    fresh = new_cache.new_layer()
                    extra += _nbytes(fresh.tensor)
                    stats.peak_extra_bytes = max(stats.peak_extra_bytes, extra)
            received = channel.exchange(layer, outgoing, incoming)
            if fault is not None:
                fault(layer)
            if fresh is not None:
                _fill(fresh, transfers, rank, old_cache, received, runs, layer, stats)
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


def _fill(fresh: KVLayer, transfers, rank: int, old_cache: KVCache | None, received: dict[KVTransfer, Source],
          runs: list[tuple[int, int, int]], layer: int, stats: MigrationStats) -> None:
    """Copy every transfer into `fresh`, one strided slice copy per run of consecutive used block ids."""
    for t in transfers:
        if t.dst_rank != rank:
            continue
        source = (Source(old_cache.layer(layer).tensor, t.src_head_offset, by_block_id=True) if t.is_local
                  else received[t])
        heads, d0, s0 = t.num_kv_heads, t.dst_head_offset, source.head_offset
        nbytes = 0
        for first, stop, position in runs:  # block ids [first, stop) are positions [position, ...) among used
            a, b = (first, stop) if source.by_block_id else (position, position + stop - first)
            part = source.tensor[:, a:b, :, s0:s0 + heads]
            fresh.tensor[:, first:stop, :, d0:d0 + heads] = part
            nbytes += part.numel() * part.element_size()
        if t.is_local:
            stats.bytes_local += nbytes
        else:
            stats.bytes_received += nbytes


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


def _slice(cache: torch.Tensor, used: torch.Tensor, head_offset: int, num_heads: int) -> torch.Tensor:
    """K/V of the used blocks and a head range: [2, used, block_size, heads, D] (a copy: advanced indexing)."""
    return cache[:, used, :, head_offset:head_offset + num_heads]
