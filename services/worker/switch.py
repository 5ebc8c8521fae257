"""ApplySwitch on one worker: APPLYING_TOPOLOGY + MIGRATING, collective over the world and all or nothing.

The target's process groups are selected (built on the slow path), its KV pool allocated, and the KV moved layer by
layer (services/worker/kv_migration.py; a pre-copied switch copies only the delta into its staged pool) while the
target's shard is built beside it (or taken as staged). Every rank agrees after each layer; when any rank failed,
every rank moves the layers already done back (`_rollback`) and a shard that let experts go reads them back from the
weight store, so the old layout serves on. The caller (WorkerShard.apply_switch) owns what a cut-off leaves behind.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import structlog

from services.model.expert_reshard import ExpertLedger, ExpertSwitch
from services.rpc.reconfig.v1 import worker_pb2
from services.topology import Topology, plan_kv_migration
from services.weightstore.client import MappedCheckpoint
from services.worker.channel import DistChannel, KVChannel, channel_kind, peer_channel
from services.worker.faults import FAULTS
from services.worker.kv_cache import KVCache
from services.worker.kv_migration import (
    BlockMaps,
    MigrationAborted,
    MigrationStats,
    block_counts,
    block_maps_from_proto,
    identity_block_maps,
    migrate_kv,
    reverse_block_maps,
)
from services.worker.kv_precopy import finish_precopy
from services.worker.model_runner import ModelRunner
from services.worker.staging import active_ranks, check_precopied

if TYPE_CHECKING:
    from services.worker.shard import WorkerShard

log = structlog.get_logger(__name__)


class SwitchFailed(RuntimeError):
    """A switch that did not happen: every worker is back in (or never left) the old layout."""


def run_switch(shard: WorkerShard, request: worker_pb2.ApplySwitchRequest, target: Topology, partition,
               rank: int, old: ModelRunner | None) -> worker_pb2.ApplySwitchResponse:
    """Switch `shard` (world rank `rank`, live runner `old`) to `target`: every rank agrees it can before any KV
    moves, then the KV moves (or only its delta, pre-copied) beside the shard's build, then the shard takes the new
    runner and layout. SwitchFailed when any rank failed: the old layout is whole again on every rank."""
    started = time.perf_counter()
    built_groups = target not in shard.parallel.candidates
    if built_groups:
        shard.parallel.build_groups([target])  # slow path: every rank builds the same groups, in order
    error, plan, new_cache, channel, block_maps = "", None, None, None, None
    old_ranks = list(request.old_ranks) or active_ranks(shard.topology)  # renumbered by a regroup, LOST gaps
    staged = shard.staging.take(request.operation_id, target, partition, old)
    precopied = staged.kv if staged is not None and request.precopied else None
    staged_runner = staged.runner if precopied is not None else None  # over the pre-copied pool
    if staged is not None and not request.precopied:
        staged.free_pool()  # pre-copied into, maybe, but this switch moves all the KV in the freeze
    try:
        FAULTS.check("apply", rank=rank)
        if request.precopied:
            check_precopied(precopied, rank, target, request)
        old_placement = shard.placement(shard.topology, shard.layer_partition)
        new_placement = shard.placement(target, partition)
        if not request.drop_kv:
            plan = plan_kv_migration(old_placement, old_ranks, new_placement, active_ranks(target))
            block_maps = block_maps_from_proto(request.block_maps)  # None: blocks keep their ids
            if plan.renumbers_blocks and block_maps is None and request.used_block_ids:
                raise ValueError(f"{shard.topology} -> {target} renumbers KV blocks: it needs block maps")
        elif old is not None:
            old.kv_cache.close()  # the router dropped every request's KV: free it before allocating anew
        if precopied is not None:
            new_cache = shard.new_cache = precopied.cache  # holds the pre-copied blocks: the delta goes in
        elif rank < target.num_workers:
            wp = new_placement.workers[rank]
            new_cache = shard.new_cache = KVCache(
                wp.layers, len(wp.kv_heads), shard.spec.head_dim, shard.config.block_size, shard.dtype,
                shard.device, num_blocks=request.num_kv_blocks, allocate=bool(request.drop_kv))
        if plan is not None and not request.precopied:  # a pre-copied delta goes through the staged pool's
            channel = _channel(shard, request, plan, block_maps)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    if not shard.agree(not error):  # nothing has changed anywhere yet
        if precopied is not None:
            precopied.close()
        elif new_cache is not None:
            new_cache.close()
        raise SwitchFailed(f"switch to {target} refused before any KV moved: {error or 'another rank failed'}")
    apply_seconds = time.perf_counter() - started
    used = list(request.used_block_ids)
    # KV moves from here on (a dropped cache has nothing to lose; a pre-copy only reads the old pools)
    shard.kv_intact = bool(request.drop_kv) or request.precopied
    old_kv = old.kv_cache if old else None
    fault = lambda layer: FAULTS.check("migrate", rank=rank, layer=layer)  # noqa: E731
    # A sparse layer whose experts change lets the live ones go as the new ones arrive (one layer of extra
    # memory, not a second copy of the experts); a switch that does not happen brings them back from the store.
    ledger = ExpertLedger()
    experts = ExpertSwitch(in_place=True, ledger=ledger,
                           fault=lambda layer: FAULTS.check("reshard", rank=rank, layer=layer))
    with MappedCheckpoint(shard.manifest) as checkpoint, ThreadPoolExecutor(1, "reload") as pool:
        # The shard reload overlaps the KV migration (both copy memory; torch releases the GIL). A staged shard
        # only needs its runner over the new cache.
        reload = _resolved((staged_runner, 0.0)) if staged_runner is not None else pool.submit(
            shard.timed_build, target, partition, checkpoint, old, new_cache,
            staged.model if staged is not None else None, experts)
        try:
            if request.precopied:  # only the delta moves: the old pools stay whole until the commit
                # One agreement for the delta and the shard (staged: its runner is ready at once).
                delta = identity_block_maps(used) if block_maps is None else block_maps
                stats = finish_precopy(precopied, old_kv, delta, shard.agree, fault,
                                       ready=lambda: _result_or_none(reload) is not None)
            else:
                stats = MigrationStats() if plan is None else migrate_kv(
                    plan, rank, old_kv, new_cache, used, channel, shard.agree, fault=fault, block_maps=block_maps)
        except MigrationAborted as aborted:
            _result_or_none(reload)
            reload = None  # the new shard goes before the old one's experts come back
            if request.precopied:
                if precopied is not None:
                    precopied.close()
                raise SwitchFailed(f"{aborted}; rolled back (layers [] moved back: the KV was pre-copied, the "
                                   "old pools were only read)") from aborted
            _rollback(shard, plan, aborted.done_layers, old, new_cache, request)
            shard.restore_experts(old)
            raise SwitchFailed(f"{aborted}; rolled back (layers {aborted.done_layers} moved back)") from aborted
        built = _result_or_none(reload)
        if not request.precopied and not shard.agree(built is not None):  # a shard failed: undo the migration
            built = reload = None
            _rollback(shard, plan, plan.layers() if plan else [], old, new_cache, request)
            shard.restore_experts(old)
            raise SwitchFailed(f"switch to {target}: a worker failed to build its shard; rolled back")
    runner, reload_seconds = built
    finishing = time.perf_counter()
    if precopied is not None:
        shard.freeing.submit(precopied.channel.close)  # unmapping the peers' pools: ~10 ms, not in the freeze
        precopied.commit(old_kv)
    if old is not None:  # anything the migration did not move or keep; every peer is done reading it
        if shard.device.type == "cpu":  # unmapping a touched pool takes ~0.2 s/GiB: not in the freeze
            shard.freeing.submit(old.kv_cache.close)
        else:  # back to the caching allocator, on the model thread (it may capture decode graphs)
            old.kv_cache.close()
    kept = set(runner.model.parameter_tensors()) & set(old.model.parameter_tensors()) if runner and old else set()
    new_tensors = runner.model.parameter_tensors() if runner else {}
    reused = sum(t.numel() * t.element_size() for i, t in new_tensors.items() if i in kept)
    # Expert tensors that came from the stage's peers by all-to-all (TP <-> EP) were not read from the store.
    resharded = sum(block.resharded_bytes for block in runner.model.moe_blocks().values()) if runner else 0
    loaded = sum(t.numel() * t.element_size() for t in new_tensors.values()) - reused - resharded
    shard.runner, shard.topology, shard.layer_partition = runner, target, partition
    shard.kv_intact = True
    shard.bind_balancer()
    shard.prepare_steps()
    channel = precopied.channel if precopied is not None else channel
    log.info("worker.switched", operation_id=request.operation_id, topology=str(target),
             kv_channel=type(channel).__name__ if channel is not None else None,
             kv_received=stats.bytes_received, kv_local=stats.bytes_local, weights_loaded=loaded,
             weights_reused=reused, weights_resharded=resharded, expert_peak_extra=ledger.peak_beyond,
             migrate_s=round(stats.seconds, 4),
             reload_s=round(reload_seconds, 4), apply_s=round(apply_seconds, 4),
             finish_s=round(time.perf_counter() - finishing, 4), total_s=round(time.perf_counter() - started, 4))
    return worker_pb2.ApplySwitchResponse(
        kv_bytes_received=stats.bytes_received, kv_bytes_local=stats.bytes_local, weight_bytes_loaded=loaded,
        weight_bytes_reused=reused, migrate_seconds=stats.seconds, reload_seconds=reload_seconds,
        peak_extra_bytes=stats.peak_extra_bytes, built_groups=built_groups, info=shard.info(),
        apply_seconds=apply_seconds, weight_bytes_resharded=resharded, used_staged=staged is not None,
        used_precopy=precopied is not None, used_staged_runner=staged_runner is not None,
        staged_graphs=staged.staged_graphs if staged_runner is not None else 0,
        expert_peak_extra_bytes=ledger.peak_beyond,
    )


def _rollback(shard: WorkerShard, plan, layers: list[int], old: ModelRunner | None, new_cache: KVCache | None,
              request: worker_pb2.ApplySwitchRequest) -> None:
    """Replay the journal backwards: move `layers` from the new layout back to the old one (collective), with
    the request's block maps reversed. Without a plan (the KV was dropped) or with lost sources (nowhere to
    move back to) there is nothing to replay: the old cache was never touched, or the controller drops the KV
    anyway."""
    if plan is None or plan.has_lost_sources:
        if new_cache is not None:
            new_cache.close()
        if plan is None:
            shard.kv_intact = True
        return
    reverse = plan_kv_migration(plan.new, plan.new_ranks, plan.old, plan.old_ranks)
    back_maps = reverse_block_maps(block_maps_from_proto(request.block_maps))
    ipc = channel_kind(request.peers, shard.world_size, shard.device, request.kv_channel) == "ipc"
    pools = shard.parallel.all_gather_object(  # on the CPU group
        (new_cache.segment_names(), new_cache.cuda_ipc_handles() if ipc else {}) if new_cache else ({}, {}))
    back = worker_pb2.ApplySwitchRequest()
    back.CopyFrom(request)
    for peer, (segments, handles) in enumerate(pools):
        pool = back.peers[peer]
        pool.kv_segments.clear()
        pool.kv_segments.update(segments)
        pool.kv_cuda_ipc.clear()
        pool.kv_cuda_ipc.update(handles)
    migrate_kv(reverse, shard.rank, new_cache, old.kv_cache if old else None, list(request.used_block_ids),
               _channel(shard, back, reverse, back_maps), shard.agree, layers=list(layers), block_maps=back_maps)
    if new_cache is not None:
        new_cache.close()
    shard.kv_intact = True
    log.warning("worker.switch_rolled_back", operation_id=request.operation_id, layers=list(layers))


def _channel(shard: WorkerShard, request: worker_pb2.ApplySwitchRequest, plan, block_maps: BlockMaps | None = None
             ) -> KVChannel:
    """shm between CPU workers of one host (the default on CPU); CUDA IPC between GPU workers of one host that
    all can (the default there); torch.distributed otherwise (its receive buffers hold each pool pair's
    blocks: `block_maps`, or every used block when ids are kept). Every rank decides alike: from the same
    peers."""
    kind = channel_kind(request.peers, shard.world_size, shard.device, request.kv_channel)
    if kind in ("shm", "ipc"):
        return peer_channel(kind, request.peers, plan, shard.config.block_size, shard.spec.head_dim, shard.dtype,
                            shard.device)
    if kind == "dist":
        counts = block_counts(identity_block_maps(request.used_block_ids) if block_maps is None else block_maps)
        return DistChannel(shard.parallel, counts, shard.config.block_size, shard.spec.head_dim, shard.dtype,
                           shard.device)
    raise ValueError(f"kv_channel {kind!r} is not one of: shm, ipc, dist")


def _resolved(value) -> Future:
    """A future that already holds `value`."""
    future = Future()
    future.set_result(value)
    return future


def _result_or_none(future):
    try:
        return future.result()
    except Exception:
        log.exception("worker.shard_reload_failed")
        return None
