"""ApplySwitch on one worker: APPLYING_TOPOLOGY + MIGRATING, collective over the world and all or nothing.

The target's process groups are selected (built on the slow path), its KV pool allocated, and the KV moved layer by
layer (services/worker/kv_migration.py; a pre-copied switch copies only the delta into its staged pool) while the
target's shard is built beside it (or taken as staged). Every rank agrees after each layer; when any rank failed,
every rank moves the layers already done back (`_rollback`) and a shard that let experts go reads them back from the
weight store, so the old layout serves on. `apply_switch` (the servicer's ApplySwitch) owns what a cut-off leaves
behind; `run_switch` is the switch itself, phase by phase (`_Switch`). The shard it switches is services.worker.shard's
WorkerShard: this module sits above it, the shard never calls in here.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import structlog

from services.model.expert_reshard import ExpertLedger, ExpertSwitch
from services.rpc.reconfig.v1 import worker_pb2
from services.topology import KVMigrationPlan, Topology, plan_kv_migration
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
from services.worker.kv_precopy import StagedKV, finish_precopy
from services.worker.model_runner import ModelRunner
from services.worker.staging import StagedShard, active_ranks, check_precopied

if TYPE_CHECKING:
    from services.worker.shard import WorkerShard

log = structlog.get_logger(__name__)


class SwitchFailed(RuntimeError):
    """A switch that did not happen: every worker is back in (or never left) the old layout."""


def apply_switch(shard: WorkerShard, request: worker_pb2.ApplySwitchRequest) -> worker_pb2.ApplySwitchResponse:
    """APPLYING_TOPOLOGY + MIGRATING (KV ‖ weights) on `shard`. Collective over the world; all or nothing: on any
    rank's failure every rank restores the old layout (the KV of layers already moved is moved back)."""
    target = Topology.parse(request.topology)
    partition = tuple(request.layer_partition) or None
    rank, old = shard.rank, shard.runner
    if not shard.parallel.in_world:
        raise ValueError("this worker is in no world yet: it needs a Regroup first")
    shard.is_waking = old is None and rank < target.num_workers
    shard.is_switching = True
    try:
        response = run_switch(shard, request, target, partition, rank, old)
    except SwitchFailed:
        raise  # every rank moved its KV back: the old layout is whole
    except Exception as exc:
        # Cut off mid-way (a peer died, a collective failed): what this worker holds is no layout any more,
        # but its old shard is whole again (a recovery may keep it).
        if shard.new_cache is not None:
            shard.new_cache.close()
        # Leave first: peers blocked on this worker fail now, and the frames holding the failed build go with
        # the traceback it drops, before the old experts come back.
        shard.leave_world(exc)
        try:
            shard.restore_experts(old)
        except Exception:  # noqa: BLE001 (the cut-off is what the caller must hear of)
            log.exception("worker.experts_restore_failed", rank=rank)
        raise
    finally:
        shard.is_waking = shard.is_switching = False
        shard.new_cache = None
    shard.needs_apply = False
    if old is not None and old is not shard.runner and shard.device.type == "cpu":
        # The old shard's own weights go back to the OS (~10-20 ms of munmap) there, after the answer. (A GPU
        # shard goes back to the caching allocator, at once, on the model thread: it may capture graphs.)
        shard.freeing.submit(_let_go, old)
        del old
    return response


def run_switch(shard: WorkerShard, request: worker_pb2.ApplySwitchRequest, target: Topology, partition,
               rank: int, old: ModelRunner | None) -> worker_pb2.ApplySwitchResponse:
    """Switch `shard` (world rank `rank`, live runner `old`) to `target`: every rank agrees it can before any KV
    moves, then the KV moves (or only its delta, pre-copied) beside the shard's build, then the shard takes the new
    runner and layout. SwitchFailed when any rank failed: the old layout is whole again on every rank."""
    switch = _Switch(shard, request, target, partition, rank, old)
    switch.select_groups()
    switch.take_staged()
    switch.apply_topology()  # SwitchFailed: refused on some rank, nothing has changed anywhere
    runner, reload_seconds = switch.migrate()  # SwitchFailed: every rank moved the KV back
    finishing = time.perf_counter()
    switch.commit_kv()
    weights = _weight_bytes(runner, old)
    switch.rebind(runner)
    return switch.report(weights, reload_seconds, finishing)


class _Switch:
    """One ApplySwitch on this rank as its phases hand it on: what was staged for it, the KV plan, the target's pool
    and the channel the KV moves over, and what the migration did."""

    def __init__(self, shard: WorkerShard, request: worker_pb2.ApplySwitchRequest, target: Topology, partition,
                 rank: int, old: ModelRunner | None) -> None:
        self.started = time.perf_counter()
        self.shard, self.request, self.target, self.partition, self.rank, self.old = (
            shard, request, target, partition, rank, old)
        self.built_groups = False
        self.old_ranks: list[int] = []
        self.staged: StagedShard | None = None
        self.precopied: StagedKV | None = None
        self.staged_runner: ModelRunner | None = None
        self.plan: KVMigrationPlan | None = None
        self.new_cache: KVCache | None = None
        self.channel: KVChannel | None = None
        self.block_maps: BlockMaps | None = None
        self.apply_seconds = 0.0
        self.used: list[int] = []
        self.old_kv: KVCache | None = None
        self.stats = MigrationStats()
        self.ledger = ExpertLedger()

    def select_groups(self) -> None:
        """The target's process groups: built now (the slow path) unless the world built them with the others."""
        self.built_groups = self.target not in self.shard.parallel.candidates
        if self.built_groups:
            self.shard.parallel.build_groups([self.target])  # slow path: every rank builds the same groups, in order

    def take_staged(self) -> None:
        """What was staged for this switch: its shard, and its pool (with its runner) when the KV was pre-copied."""
        request = self.request
        self.old_ranks = list(request.old_ranks) or active_ranks(self.shard.topology)  # renumbered, LOST gaps
        staged = self.staged = self.shard.staging.take(request.operation_id, self.target, self.partition, self.old)
        self.precopied = staged.kv if staged is not None and request.precopied else None
        self.staged_runner = staged.runner if self.precopied is not None else None  # over the pre-copied pool
        if staged is not None and not request.precopied:
            staged.free_pool()  # pre-copied into, maybe, but this switch moves all the KV in the freeze

    def apply_topology(self) -> None:
        """APPLYING_TOPOLOGY: this rank's KV plan, target pool and channel; then every rank agrees it can. SwitchFailed
        when any rank could not: the target's pool goes, and nothing has changed anywhere."""
        error = ""
        try:
            self._prepare_target()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        if not self.shard.agree(not error):  # nothing has changed anywhere yet
            if self.precopied is not None:
                self.precopied.close()
            elif self.new_cache is not None:
                self.new_cache.close()
            raise SwitchFailed(f"switch to {self.target} refused before any KV moved: {error or 'another rank failed'}")
        self.apply_seconds = time.perf_counter() - self.started

    def _prepare_target(self) -> None:
        """The KV plan (none when the KV is dropped), the target's pool (the pre-copied one, if any) and the
        channel the KV moves over (a pre-copied delta goes through the staged pool's)."""
        shard, request, target, rank, old = self.shard, self.request, self.target, self.rank, self.old
        FAULTS.check("apply", rank=rank)
        if request.precopied:
            check_precopied(self.precopied, rank, target, request)
        old_placement = shard.placement(shard.topology, shard.layer_partition)
        new_placement = shard.placement(target, self.partition)
        if not request.drop_kv:
            self.plan = plan = plan_kv_migration(old_placement, self.old_ranks, new_placement, active_ranks(target))
            self.block_maps = block_maps_from_proto(request.block_maps)  # None: blocks keep their ids
            if plan.renumbers_blocks and self.block_maps is None and request.used_block_ids:
                raise ValueError(f"{shard.topology} -> {target} renumbers KV blocks: it needs block maps")
        elif old is not None:
            old.kv_cache.close()  # the router dropped every request's KV: free it before allocating anew
        if self.precopied is not None:
            self.new_cache = shard.new_cache = self.precopied.cache  # holds the pre-copied blocks: the delta goes in
        elif rank < target.num_workers:
            wp = new_placement.workers[rank]
            self.new_cache = shard.new_cache = KVCache(
                wp.layers, len(wp.kv_heads), shard.spec.head_dim, shard.config.block_size, shard.dtype,
                shard.device, num_blocks=request.num_kv_blocks, allocate=bool(request.drop_kv))
        if self.plan is not None and not request.precopied:  # a pre-copied delta goes through the staged pool's
            self.channel = _channel(shard, request, self.plan, self.block_maps)

    def migrate(self) -> tuple[ModelRunner | None, float]:
        """MIGRATING: the KV moves (`_move_kv`) while the target's shard builds beside it (or is taken as staged).
        -> the new runner and its build's seconds. SwitchFailed when a layer or a shard failed on any rank: every
        rank moved the KV back, and the old shard has its experts again."""
        shard, request, old, rank = self.shard, self.request, self.old, self.rank
        self.used = list(request.used_block_ids)
        # KV moves from here on (a dropped cache has nothing to lose; a pre-copy only reads the old pools)
        shard.kv_intact = bool(request.drop_kv) or request.precopied
        self.old_kv = old.kv_cache if old else None
        fault = lambda layer: FAULTS.check("migrate", rank=rank, layer=layer)  # noqa: E731
        # A sparse layer whose experts change lets the live ones go as the new ones arrive (one layer of extra
        # memory, not a second copy of the experts); a switch that does not happen brings them back from the store.
        experts = ExpertSwitch(in_place=True, ledger=self.ledger,
                               fault=lambda layer: FAULTS.check("reshard", rank=rank, layer=layer))
        with MappedCheckpoint(shard.manifest) as checkpoint, ThreadPoolExecutor(1, "reload") as pool:
            # The shard reload overlaps the KV migration (both copy memory; torch releases the GIL). A staged shard
            # only needs its runner over the new cache.
            reload = _resolved((self.staged_runner, 0.0)) if self.staged_runner is not None else pool.submit(
                shard.timed_build, self.target, self.partition, checkpoint, old, self.new_cache,
                self.staged.model if self.staged is not None else None, experts)
            try:
                self.stats = self._move_kv(fault, ready=lambda: _result_or_none(reload) is not None)
            except MigrationAborted as aborted:
                _result_or_none(reload)
                reload = None  # the new shard goes before the old one's experts come back
                raise self._roll_back(aborted) from aborted
            built = _result_or_none(reload)
            if not request.precopied and not shard.agree(built is not None):  # a shard failed: undo the migration
                built = reload = None
                _rollback(shard, self.plan, self.plan.layers() if self.plan else [], old, self.new_cache, request)
                shard.restore_experts(old)
                raise SwitchFailed(f"switch to {self.target}: a worker failed to build its shard; rolled back")
        return built

    def _move_kv(self, fault, ready) -> MigrationStats:
        """The KV into the target's pool, layer by layer with every rank agreeing after each (services/worker/
        kv_migration.py); a pre-copied switch copies only the delta into its staged pool, with one agreement for
        the delta and the shard (`ready`: whether it is built)."""
        if self.request.precopied:  # only the delta moves: the old pools stay whole until the commit
            # One agreement for the delta and the shard (staged: its runner is ready at once).
            delta = identity_block_maps(self.used) if self.block_maps is None else self.block_maps
            return finish_precopy(self.precopied, self.old_kv, delta, self.shard.agree, fault, ready=ready)
        return MigrationStats() if self.plan is None else migrate_kv(
            self.plan, self.rank, self.old_kv, self.new_cache, self.used, self.channel, self.shard.agree, fault=fault,
            block_maps=self.block_maps)

    def _roll_back(self, aborted: MigrationAborted) -> SwitchFailed:
        """After a layer failed on some rank: move the layers done back (a pre-copy only read the old pools: its
        staged pool goes) and give the old shard its experts back. -> the failure to raise."""
        if self.request.precopied:
            if self.precopied is not None:
                self.precopied.close()
            return SwitchFailed(f"{aborted}; rolled back (layers [] moved back: the KV was pre-copied, the "
                                "old pools were only read)")
        _rollback(self.shard, self.plan, aborted.done_layers, self.old, self.new_cache, self.request)
        self.shard.restore_experts(self.old)
        return SwitchFailed(f"{aborted}; rolled back (layers {aborted.done_layers} moved back)")

    def commit_kv(self) -> None:
        """The target's pool holds the KV from here: a pre-copied one takes the kept layers, and the old pools go."""
        shard, old, precopied = self.shard, self.old, self.precopied
        if precopied is not None:
            shard.freeing.submit(precopied.channel.close)  # unmapping the peers' pools: ~10 ms, not in the freeze
            precopied.commit(self.old_kv)
        if old is not None:  # anything the migration did not move or keep; every peer is done reading it
            if shard.device.type == "cpu":  # unmapping a touched pool takes ~0.2 s/GiB: not in the freeze
                shard.freeing.submit(old.kv_cache.close)
            else:  # back to the caching allocator, on the model thread (it may capture decode graphs)
                old.kv_cache.close()

    def rebind(self, runner: ModelRunner | None) -> None:
        """The shard serves the target layout with the new runner (its EPLB window, threads and packed weights)."""
        shard = self.shard
        shard.runner, shard.topology, shard.layer_partition = runner, self.target, self.partition
        shard.kv_intact = True
        shard.bind_balancer()
        shard.prepare_steps()

    def report(self, weights: tuple[int, int, int], reload_seconds: float, finishing: float
               ) -> worker_pb2.ApplySwitchResponse:
        """Log the switch and answer it: `weights` (loaded, reused, resharded bytes), the build's seconds, and when
        the commit began (`finishing`)."""
        loaded, reused, resharded = weights
        stats, ledger, staged_runner = self.stats, self.ledger, self.staged_runner
        channel = self.precopied.channel if self.precopied is not None else self.channel
        log.info("worker.switched", operation_id=self.request.operation_id, topology=str(self.target),
                 kv_channel=type(channel).__name__ if channel is not None else None,
                 kv_received=stats.bytes_received, kv_local=stats.bytes_local, weights_loaded=loaded,
                 weights_reused=reused, weights_resharded=resharded, expert_peak_extra=ledger.peak_beyond,
                 migrate_s=round(stats.seconds, 4),
                 reload_s=round(reload_seconds, 4), apply_s=round(self.apply_seconds, 4),
                 finish_s=round(time.perf_counter() - finishing, 4),
                 total_s=round(time.perf_counter() - self.started, 4))
        return worker_pb2.ApplySwitchResponse(
            kv_bytes_received=stats.bytes_received, kv_bytes_local=stats.bytes_local, weight_bytes_loaded=loaded,
            weight_bytes_reused=reused, migrate_seconds=stats.seconds, reload_seconds=reload_seconds,
            peak_extra_bytes=stats.peak_extra_bytes, built_groups=self.built_groups, info=self.shard.info(),
            apply_seconds=self.apply_seconds, weight_bytes_resharded=resharded, used_staged=self.staged is not None,
            used_precopy=self.precopied is not None, used_staged_runner=staged_runner is not None,
            staged_graphs=self.staged.staged_graphs if staged_runner is not None else 0,
            expert_peak_extra_bytes=ledger.peak_beyond,
        )


def _weight_bytes(runner: ModelRunner | None, old: ModelRunner | None) -> tuple[int, int, int]:
    """The new shard's weight bytes: (loaded from the store, reused from the old shard, resharded from the stage's
    peers)."""
    kept = set(runner.model.parameter_tensors()) & set(old.model.parameter_tensors()) if runner and old else set()
    new_tensors = runner.model.parameter_tensors() if runner else {}
    reused = sum(t.numel() * t.element_size() for i, t in new_tensors.items() if i in kept)
    # Expert tensors that came from the stage's peers by all-to-all (TP <-> EP) were not read from the store.
    resharded = sum(block.resharded_bytes for block in runner.model.moe_blocks().values()) if runner else 0
    loaded = sum(t.numel() * t.element_size() for t in new_tensors.values()) - reused - resharded
    return loaded, reused, resharded


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


def _let_go(_: object) -> None:
    """Run on the freeing thread: the last reference to the argument dies there, with its memory."""
