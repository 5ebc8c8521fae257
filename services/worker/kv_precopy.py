"""KV pre-copy on one worker: fill the staged pool of a switch's target while the live layout serves, then, in
the freeze, copy only the delta and hand the pool to the new runner.

The staged pool is allocated at the first round: a layer tensor for every local layer of the target, except the
layers this rank keeps as they are (same heads, same block count: the live tensor moves over at the cutover,
nothing to copy). Each round copies full blocks (the router's PreCopyBlocks: they never change while their
request holds them; as block maps, to the same ids with one KV pool on both sides, else to the ids the router
reserved for their requests in the target's pools) from the peers' live pools (shared memory on CPU, CUDA IPC
between the GPU workers of a host) and from this worker's own, on the stage thread, beside the steps; and the
partly filled last blocks too, to warm them: their pages are then mapped on both sides when the freeze copies
them again (first-touch page faults were two thirds of a cutover's copy on CPU). The peers' pools stay mapped from
the first round to the end of the switch (one channel). Nothing here touches the live pools, so a failed or
abandoned pre-copy only drops the staged pool. The cutover (`finish`) copies the delta the same way, then every
rank of the world agrees once; the kept layers move over only when the whole switch has succeeded (`commit`). A
failure before leaves the old layout exactly as it was (no layer to move back). Since the pool exists before the
freeze, so can the target runner over it, and on a GPU its decode graphs (`future_layers`: the tensors the pool
will hold once the kept layers moved over).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.topology import KVMigrationPlan
from services.worker.channel import CudaIpcChannel, ShmChannel
from services.worker.kv_cache import KVCache
from services.worker.kv_migration import BlockMaps, MigrationAborted, MigrationStats, fill_layer, pool_blocks
from services.worker.pacing import UNPACED, Pacer


@dataclass(slots=True)
class StagedKV:
    """The target's KV pool of this rank while a switch pre-copies into it."""

    plan: KVMigrationPlan
    rank: int
    cache: KVCache             # the target's capacity; its layers: the ones this rank fills (kept ones added last)
    kept_layers: list[int]     # local layers whose live tensor moves over as is at the cutover
    channel: ShmChannel | CudaIpcChannel  # the peers' live pools, mapped until the switch ends (keep_open)

    @classmethod
    def allocate(cls, plan: KVMigrationPlan, rank: int, live: KVCache | None, target: KVCache,
                 channel: ShmChannel | CudaIpcChannel) -> StagedKV:
        """A layer tensor of `target` (which holds none yet) for every local layer of the target this rank must
        fill; the identity layers are left to move over at the cutover. Takes `channel` over (close() closes it; after
        commit() the caller does)."""
        same_blocks = live is not None and live.num_blocks == target.num_blocks
        kept = [layer for layer in plan.new_local_layers(rank) if same_blocks and plan.is_identity_for(rank, layer)]
        for layer in plan.new_local_layers(rank):
            if layer not in kept:
                target.set_layer(layer, target.new_layer())
        return cls(plan, rank, target, kept, channel)

    @property
    def num_bytes(self) -> int:
        return self.cache.num_bytes

    def copy(self, live: KVCache | None, block_maps: BlockMaps, fault: Callable[[int], None] | None = None,
             pacer: Pacer = UNPACED) -> MigrationStats:
        """Copy the blocks of `block_maps` ((live pool, target pool) -> (live ids, target ids)) of every layer this
        rank fills: from the peers' live pools (the channel) and from `live` (its own), a layer per piece of
        `pacer` (a pre-copy round; the freeze does not pace). No collective; the live pools are only read."""
        started = time.perf_counter()
        stats = MigrationStats()
        maps = pool_blocks({pair: ids for pair, ids in block_maps.items() if ids[0]})
        if maps:
            for layer in self.plan.layers():
                if not self.cache.has_layer(layer) or layer in self.kept_layers:
                    continue
                transfers = [t for t in self.plan.for_layer(layer) if t.dst_rank == self.rank and t.pools in maps]
                received = self.channel.exchange(layer, [], [t for t in transfers if not t.is_local])
                if fault is not None:
                    fault(layer)
                with pacer.piece():
                    fill_layer(self.cache.layer(layer), transfers, self.rank, live, received, maps, layer, stats)
            self.channel.settle()  # a GPU's copies are queued: done before the round (or the cutover) reports
        stats.seconds = time.perf_counter() - started
        return stats

    def future_layers(self, live: KVCache | None) -> list[torch.Tensor]:
        """The KV tensors of the target's layers, in layer order, as the pool will hold them after commit(): its own,
        and the kept ones still in the live pool (what decode graphs captured ahead of the cutover must address)."""
        return [live.layer(layer).tensor if layer in self.kept_layers else self.cache.layer(layer).tensor
                for layer in self.cache.layer_ids]

    def commit(self, live: KVCache | None) -> None:
        """The switch is done: the kept layers move from the live pool into this one (no copy). The caller closes
        the channel (unmapping what the rounds touched takes a while: off the cutover's path)."""
        for layer in self.kept_layers:
            self.cache.set_layer(layer, live.pop_layer(layer))

    def close(self) -> None:
        """Drop the pool (the switch failed or moves all its KV in the freeze) and unmap the peers' pools."""
        self.channel.close()
        self.cache.close()


def finish_precopy(staged: StagedKV | None, live: KVCache | None, delta: BlockMaps, agree: Callable[[bool], bool],
                   fault: Callable[[int], None] | None = None, ready: Callable[[], bool] = lambda: True
                   ) -> MigrationStats:
    """The cutover of a pre-copied switch (collective, the router frozen): copy the delta into this rank's staged
    pool (None: a rank on standby in the target, it only agrees), then agree with every rank once, on the copy and
    on `ready` (the rest of this rank's switch: its new runner). MigrationAborted (no done layer: nothing to move
    back) when any rank failed."""
    error = ""
    stats = MigrationStats()
    try:
        if staged is not None:
            stats = staged.copy(live, delta, fault)
            stats.layers_kept = len(staged.kept_layers)
    except Exception as exc:  # this rank's part failed: tell the others instead of leaving them waiting
        error = f"{type(exc).__name__}: {exc}"
    if not error and not ready():
        error = "its new runner failed to build"
    if not agree(not error):
        raise MigrationAborted(-1, [], error or "another rank failed")
    return stats
