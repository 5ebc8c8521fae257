"""The worker's side of EPLB: the load window of its sparse layers, and a new expert map staged while serving.

Observe: after every step the model thread moves each sparse layer's routed-token counts (per physical slot, this
rank's own tokens) into a sliding window. Prepare (PrepareExpertMap, on its own thread while steps go on): the ranks
of the stage sum their windows over the stage's CPU group (gloo; the steps use the device group), every rank runs
the same pure policy (services/topology/eplb.py) on the same numbers, so all get the same map without sending it;
then the experts that land in a new slot are copied into staging buffers, from a peer over the same CPU group or
locally. Commit: the step carrying the epoch installs the staged weights and map before it runs, on every rank of
every stage at once. Abort, a switch or a failure drops the staged map; the live one never changed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import structlog
import torch
import torch.distributed as dist

from services.rpc.reconfig.v1 import worker_pb2
from services.topology.eplb import LoadWindow, expert_moves, logical_loads, rebalance
from services.worker.faults import FAULTS

log = structlog.get_logger(__name__)


class ExpertMapError(RuntimeError):
    """A rebalance this worker cannot take part in (not an EP layout, nothing staged for an epoch)."""


@dataclass(slots=True)
class StagedMap:
    """A prepared rebalance: per sparse layer the new map and the weights of this rank's slots that change."""

    epoch: int
    maps: dict[int, tuple[int, ...]]
    weights: dict[int, dict[int, tuple[torch.Tensor, ...]]]  # layer -> slot -> weights


class ExpertBalancer:
    """Load window and staged map of one worker's sparse layers. record/commit run on the model thread, prepare on
    the caller's thread; the lock guards the window and the staged map between them."""

    def __init__(self, window_size: int) -> None:
        self.window_size = window_size
        self.epoch = 0  # the committed map's epoch
        self._lock = threading.Lock()
        self._blocks: dict = {}  # layer -> SparseMoeBlock of the live runner
        self._wp = None
        self._cpu_group = None
        self._stage_ranks: tuple[int, ...] = ()
        self._num_physical = 0
        self._window: LoadWindow | None = None
        self._staged: StagedMap | None = None

    def bind(self, runner, stage_group) -> None:
        """A new runner (load, switch): its sparse layers, a fresh window; anything staged is dropped."""
        blocks = runner.model.moe_blocks() if runner is not None else {}
        with self._lock:
            self._blocks = dict(sorted(blocks.items()))
            self._wp = runner.wp if runner is not None else None
            self._cpu_group = getattr(stage_group, "cpu_group", None)
            self._stage_ranks = tuple(getattr(stage_group, "ranks", ()))
            self._num_physical = runner.placement.num_physical_experts if runner is not None else 0
            self._window = LoadWindow(len(self._blocks), self._num_physical, self.window_size) if self._blocks \
                else None
            self._staged = None
            self.epoch = 0

    @property
    def is_expert_parallel(self) -> bool:
        return self._wp is not None and self._wp.ep_size > 1 and bool(self._blocks)

    def record(self) -> None:
        """After a step (model thread): move the step's routed-token counts into the window."""
        if self._window is None:
            return
        counts = torch.stack([block.take_load() for block in self._blocks.values()]).cpu().numpy()  # GPU: to host
        with self._lock:
            self._window.record(counts)

    def load(self, rank: int) -> worker_pb2.ExpertLoad:
        """What GetExpertLoad answers: this rank's window and the live maps."""
        with self._lock:
            wp, window = self._wp, self._window
            totals = window.totals() if window is not None else None
            reply = worker_pb2.ExpertLoad(rank=rank, epoch=self.epoch,
                                          num_steps=window.num_steps if window is not None else 0)
            if wp is not None:
                reply.pp_rank, reply.ep_rank, reply.ep_size = wp.pp_rank, wp.ep_rank, wp.ep_size
            for i, (layer, block) in enumerate(self._blocks.items()):
                reply.layers.add(layer=layer, phy2log=block.phy2log, load=[int(x) for x in totals[i]])
        return reply

    def prepare(self, epoch: int, rank: int = -1) -> worker_pb2.PrepareExpertMapResponse:
        """Stage the map of `epoch` (collective over the stage's ranks, on their CPU group; serving goes on)."""
        started = time.perf_counter()
        if not self.is_expert_parallel:
            raise ExpertMapError("EPLB needs an expert-parallel layout (epXppY) of a MoE model")
        with self._lock:
            blocks, wp, group, ranks = dict(self._blocks), self._wp, self._cpu_group, self._stage_ranks
            totals = torch.from_numpy(self._window.totals()).to(torch.float64)
            self._staged = None
        dist.all_reduce(totals, group=group)  # the stage's load: every rank computes the same map from it
        num_ranks, per_rank = wp.ep_size, self._num_physical // wp.ep_size
        maps, weights, reply = {}, {}, worker_pb2.PrepareExpertMapResponse()
        sends, receives = [], []  # (tensor, world rank), (layer, slot, buffers, world rank)
        for i, (layer, block) in enumerate(blocks.items()):
            old = tuple(block.phy2log)
            new = rebalance(logical_loads(totals[i].tolist(), old, block.num_experts), num_ranks,
                            self._num_physical, old)
            maps[layer] = new
            weights[layer] = {}
            reply.layers.add(layer=layer, phy2log=new, load=[int(x) for x in totals[i].tolist()])
            for move in expert_moves(old, new, num_ranks):
                source_rank, dest_rank = move.source_slot // per_rank, move.slot // per_rank
                if dest_rank == wp.ep_rank:
                    reply.slots_changed += 1
                    if source_rank == wp.ep_rank:  # a local copy: from a slot of this rank
                        weights[layer][move.slot] = tuple(t.clone() for t in block.slot_weights(move.source_slot))
                    else:
                        buffers = tuple(torch.empty_like(t) for t in block.slot_weights(wp.expert_slots.start))
                        receives.append((layer, move.slot, buffers, ranks[source_rank]))
                elif source_rank == wp.ep_rank:
                    sends += [(t, ranks[dest_rank]) for t in block.slot_weights(move.source_slot)]
        ops = [dist.P2POp(dist.isend, t.contiguous().cpu(), dst, group) for t, dst in sends]
        host = [(layer, slot, buffers, tuple(b.cpu() if b.device.type != "cpu" else b for b in buffers), src)
                for layer, slot, buffers, src in receives]
        ops += [dist.P2POp(dist.irecv, b, src, group) for _, _, _, bs, src in host for b in bs]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for layer, slot, buffers, staged, _ in host:
            weights[layer][slot] = tuple(b.copy_(s) if b is not s else b for b, s in zip(buffers, staged))
        # Tests: a rank that fails after the copies (peers are never left inside a collective) -> the rebalance
        # aborts everywhere and the live map stays.
        FAULTS.check("eplb", rank=rank, epoch=epoch)
        reply.bytes_received = sum(t.numel() * t.element_size() for per_layer in weights.values()
                                   for ws in per_layer.values() for t in ws)
        with self._lock:
            if self._blocks == blocks:  # still the same runner (no switch meanwhile)
                self._staged = StagedMap(epoch, maps, weights)
        reply.seconds = time.perf_counter() - started
        log.info("worker.expert_map_staged", epoch=epoch, slots_changed=reply.slots_changed,
                 bytes_received=reply.bytes_received, seconds=round(reply.seconds, 4))
        return reply

    def abort(self, epoch: int) -> None:
        with self._lock:
            if self._staged is not None and self._staged.epoch == epoch:
                self._staged = None

    def commit(self, epoch: int) -> None:
        """Before the step carrying `epoch` (model thread): install the staged map on every sparse layer."""
        with self._lock:
            staged, self._staged = self._staged, None
            if staged is None or staged.epoch != epoch:
                raise ExpertMapError(f"no expert map staged for epoch {epoch}")
            for layer, block in self._blocks.items():
                block.remap(staged.maps[layer], staged.weights[layer])
            self._window.reset()  # the window counted tokens per slot of the old map
            self.epoch = epoch
        log.info("worker.expert_map_committed", epoch=epoch)
