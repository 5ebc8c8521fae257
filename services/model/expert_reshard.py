"""Expert weights moved between a stage's TP form and its EP form by one all-to-all per sparse layer, not re-read.

Under `tp{P}` every rank of a stage holds one intermediate slice (width w = I / P) of every expert; under `ep{P}` it
holds whole experts of a range of physical slots. Either way a rank holds E * 2I * H / P expert elements (plus the
copies of redundant slots), so one all-to-all over the stage's ranks turns one view into the other (Moebius, §3):

- EP -> TP: rank r sends peer p the p-th slice of each logical expert it is the FIRST holder of (its lowest slot in
  the old map: with redundant slots every expert still travels once), and p lays the received slices out in
  logical order 0..E-1, the TP form's identity map.
- TP -> EP: rank r sends peer p its own slice of each distinct logical expert of p's slots (new map), and p
  interleaves the P slices of each into the whole expert.

The unit on the wire is a `piece`: the slice `cols` of one expert, flattened as [gate rows | up rows | down columns]
(w*H + w*H + H*w elements), so a piece of a whole slice is exactly a TP expert's (gate_up, down) bytes. Buffers
are 1-D: the splits are element counts that every rank computes from the two placements and the maps it already
shares, with no metadata exchange. The pure functions below plan, pack and unpack; `reshard_experts` adds the one
collective (and a one-element agreement before it, so that a rank that cannot pack fails the layer on every rank
instead of leaving its peers in the all-to-all). Host tensors of one host go through shared memory, not gloo's
sockets (the group's `bulk_exchange`, services/worker/shm_exchange.py).

In place (`ExpertSwitch.in_place`, the worker's in-freeze switch): each layer's old experts are let go as soon as
they are packed, so a shard changes view with one layer of extra memory (Moebius' bound), not a second copy of its
experts; `ExpertLedger` counts it. A rollback then re-reads the layers let go from the weight store
(`SparseMoeBlock.restore_experts`): it needs no peer, and the store is the bytes every view was cut from.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from services.model.layers import TPGroup
from services.topology import WorkerPlacement

ExpertWeights = tuple[torch.Tensor, ...]  # (gate_up [2 * I_local, hidden], down [hidden, I_local]) of one slot


class ExpertBlock(Protocol):
    """What a reshard reads of a layer's block: services.model.moe.SparseMoeBlock (which imports this module)."""

    layer_id: int
    placement: WorkerPlacement
    num_experts: int
    is_expert_parallel: bool
    router: torch.Tensor
    phy2log: tuple[int, ...]
    slots: range
    intermediate: range
    experts: list[ExpertWeights]

    def release_experts(self, keep: Container[int] = frozenset()) -> int: ...

# How a TP <-> EP switch moves experts: "on" (all-to-all), "off" (re-cut from the weight store), "auto" (default:
# all-to-all over NCCL; on CPU the shared-memory store is faster: its build copies each byte once, the all-to-all
# packs, exchanges and lays out: bench/moe_switch.py measured its shard build at 2-3x the store's through shared
# memory, 5-7x over gloo's sockets). The same in the environment of every worker of a stack.
RESHARD_ENV = "RECONFIG_EXPERT_RESHARD"


def reshard_wanted(group: TPGroup) -> bool:
    """Whether this stage moves experts by all-to-all when it can (RESHARD_ENV; auto: its device group is NCCL).
    The same answer on every rank of the stage: one environment, one group."""
    mode = os.environ.get(RESHARD_ENV, "auto")
    if mode in ("on", "off"):
        return mode == "on"
    device_group = getattr(group, "device_group", None)
    return device_group is not None and torch.distributed.get_backend(device_group) == "nccl"


class ReshardFailed(RuntimeError):
    """A layer's experts could not change view on some rank of the stage; every rank of it raises this."""


@dataclass(slots=True)
class ExpertLedger:
    """Expert bytes allocated minus let go while a shard is built from a live one (buffers included): `extra` now,
    `peak` the most it reached (both relative to the build's start)."""

    extra: int = 0
    peak: int = 0

    def grow(self, num_bytes: int) -> None:
        self.extra += num_bytes
        self.peak = max(self.peak, self.extra)

    def shrink(self, num_bytes: int) -> None:
        self.extra -= num_bytes

    @property
    def peak_beyond(self) -> int:
        """The peak beyond the larger of the two shards' experts (before: 0, after: `extra`)."""
        return self.peak - max(0, self.extra)


@dataclass(frozen=True, slots=True)
class ExpertSwitch:
    """How a shard built from a live one gets the experts of a sparse layer whose view changes."""

    reshard: bool = True  # from the stage's peers by all-to-all where it can (can_reshard, reshard_wanted); else store
    in_place: bool = False  # let the live layer's experts go as the new ones arrive (a rollback restores them)
    ledger: ExpertLedger | None = None  # counts the experts' extra memory
    fault: Callable[[int], None] | None = None  # called with the layer id before its experts change (fault tests)


ALONGSIDE = ExpertSwitch()  # the live shard stays whole (a build beside it, or a test's)
FROM_STORE = ExpertSwitch(reshard=False)  # no collective: a shard staged while steps use the groups


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    """One rank's side of one layer's all-to-all: the logical experts whose piece goes to / comes from each peer,
    in buffer order (the same lists on both ends of every pair)."""

    sends: tuple[tuple[int, ...], ...]  # per peer: logical experts of the pieces sent there
    receives: tuple[tuple[int, ...], ...]  # per peer: logical experts of the pieces received from there

    def send_splits(self, piece_numel: int) -> list[int]:
        """Elements sent to each peer."""
        return [len(experts) * piece_numel for experts in self.sends]

    def recv_splits(self, piece_numel: int) -> list[int]:
        """Elements received from each peer."""
        return [len(experts) * piece_numel for experts in self.receives]


def piece_numel(width: int, hidden: int) -> int:
    """Elements of one piece: gate and up rows [width, hidden] each, down columns [hidden, width]."""
    return 3 * width * hidden


def tp_slice(rank: int, width: int) -> range:
    """The intermediate slice of TP rank `rank` when each holds `width` rows (the placement's contiguous split)."""
    return range(rank * width, (rank + 1) * width)


def rank_slots(num_physical: int, num_ranks: int, rank: int) -> range:
    """The physical slots of EP rank `rank` (the placement's contiguous split)."""
    if num_physical % num_ranks:
        raise ValueError(f"{num_physical} physical slots do not split over {num_ranks} ranks")
    per_rank = num_physical // num_ranks
    return range(rank * per_rank, (rank + 1) * per_rank)


def slot_experts(phy2log: Sequence[int], slots: range) -> tuple[int, ...]:
    """The distinct logical experts of `slots`, in slot order (two slots of one expert share one piece)."""
    seen: dict[int, None] = {}
    for slot in slots:
        seen.setdefault(phy2log[slot], None)
    return tuple(seen)


def first_holders(phy2log: Sequence[int], num_ranks: int) -> tuple[tuple[int, ...], ...]:
    """Per EP rank: the logical experts it is the first holder of (their lowest slot is on it), in slot order.
    Every logical expert appears exactly once over all ranks; a rank holding only later copies sends nothing."""
    first: dict[int, int] = {}
    for slot, logical in enumerate(phy2log):
        first.setdefault(logical, slot)
    return tuple(tuple(phy2log[s] for s in rank_slots(len(phy2log), num_ranks, rank) if first[phy2log[s]] == s)
                 for rank in range(num_ranks))


def ep_to_tp_plan(old_phy2log: Sequence[int], num_ranks: int, rank: int) -> ReshardPlan:
    """EP -> TP (Alg. 1): send every peer a slice of each expert first held here; receive from every peer the
    experts it first holds (together: every logical expert once)."""
    holders = first_holders(old_phy2log, num_ranks)
    return ReshardPlan(sends=(holders[rank],) * num_ranks, receives=holders)


def tp_to_ep_plan(new_phy2log: Sequence[int], num_ranks: int, rank: int) -> ReshardPlan:
    """TP -> EP (Alg. 2): send every peer this rank's slice of each distinct expert of its slots (new map);
    receive every peer's slice of each distinct expert of this rank's slots."""
    wanted = [slot_experts(new_phy2log, rank_slots(len(new_phy2log), num_ranks, p)) for p in range(num_ranks)]
    return ReshardPlan(sends=tuple(wanted), receives=(wanted[rank],) * num_ranks)


def write_piece(out: torch.Tensor, weights: ExpertWeights, cols: range) -> None:
    """Copy the slice `cols` of one expert into `out` (1-D, piece_numel(len(cols), hidden) elements). weights:
    (gate_up [2n, hidden], down [hidden, n]) with `cols` inside 0..n-1."""
    gate_up, down = weights
    n, width, hidden = down.shape[1], len(cols), down.shape[0]
    if gate_up.shape != (2 * n, hidden) or not (0 <= cols.start and cols.stop <= n) or cols.step != 1:
        raise ValueError(f"slice {cols} of an expert of shapes {tuple(gate_up.shape)}, {tuple(down.shape)}")
    block = width * hidden
    out[:block].view(width, hidden).copy_(gate_up[cols.start:cols.stop])
    out[block:2 * block].view(width, hidden).copy_(gate_up[n + cols.start:n + cols.stop])
    out[2 * block:3 * block].view(hidden, width).copy_(down[:, cols.start:cols.stop])


def pack(held: Mapping[int, ExpertWeights], sends: Sequence[Sequence[int]], cols: Sequence[range],
         hidden: int, alloc: Callable[[int, torch.dtype], torch.Tensor] | None = None) -> torch.Tensor:
    """The send buffer: for each peer p in rank order, the pieces `cols[p]` of its experts `sends[p]` (logical ids,
    looked up in `held`), in list order. -> 1-D, sum(len(sends[p]) * piece_numel(len(cols[p]), hidden)), from
    `alloc(numel, dtype)` when given (a shared-memory send buffer), else a new tensor on the experts' device."""
    sample = next(iter(held.values()))[0]
    total = sum(len(experts) * piece_numel(len(c), hidden) for experts, c in zip(sends, cols, strict=True))
    out = alloc(total, sample.dtype) if alloc is not None else torch.empty(total, dtype=sample.dtype,
                                                                           device=sample.device)
    offset = 0
    for experts, c in zip(sends, cols):
        step = piece_numel(len(c), hidden)
        for logical in experts:
            write_piece(out[offset:offset + step], held[logical], c)
            offset += step
    return out


def read_piece(piece: torch.Tensor, width: int, hidden: int) -> ExpertWeights:
    """A piece as (gate_up [2 * width, hidden], down [hidden, width]): views of `piece`, no copy (both contiguous,
    the layout `load_expert` produces)."""
    block = width * hidden
    return piece[:2 * block].view(2 * width, hidden), piece[2 * block:3 * block].view(hidden, width)


def unpack_slices(recv: torch.Tensor, plan: ReshardPlan, num_experts: int, width: int,
                  hidden: int) -> list[ExpertWeights]:
    """EP -> TP: the received pieces as every logical expert's slice, in logical order 0..num_experts-1 (views of
    `recv`: the buffer becomes the layer's storage)."""
    step = piece_numel(width, hidden)
    by_logical: dict[int, ExpertWeights] = {}
    offset = 0
    for experts in plan.receives:
        for logical in experts:
            if logical in by_logical:
                raise ValueError(f"logical expert {logical} received twice")
            by_logical[logical] = read_piece(recv[offset:offset + step], width, hidden)
            offset += step
    if offset != recv.numel() or sorted(by_logical) != list(range(num_experts)):
        raise ValueError(f"received experts {sorted(by_logical)} ({offset} of {recv.numel()} elements), expected "
                         f"0..{num_experts - 1}")
    return [by_logical[e] for e in range(num_experts)]


def unpack_whole(recv: torch.Tensor, plan: ReshardPlan, width: int, hidden: int) -> dict[int, ExpertWeights]:
    """TP -> EP: the received pieces interleaved into whole experts (peer p's piece is intermediate slice p),
    logical expert -> (gate_up [2I, hidden], down [hidden, I]) with I = width * peers, new contiguous tensors."""
    num_ranks = len(plan.receives)
    wanted = plan.receives[0]
    if any(experts != wanted for experts in plan.receives):
        raise ValueError("every peer must send the same experts' slices")
    step, size = piece_numel(width, hidden), width * num_ranks
    if recv.numel() != num_ranks * len(wanted) * step:
        raise ValueError(f"received {recv.numel()} elements, expected {num_ranks * len(wanted) * step}")
    whole: dict[int, ExpertWeights] = {}
    for index, logical in enumerate(wanted):
        gate_up = recv.new_empty((2 * size, hidden))
        down = recv.new_empty((hidden, size))
        for peer in range(num_ranks):
            offset = (peer * len(wanted) + index) * step
            part_gate_up, part_down = read_piece(recv[offset:offset + step], width, hidden)
            cols = tp_slice(peer, width)
            gate_up[cols.start:cols.stop] = part_gate_up[:width]  # gate rows
            gate_up[size + cols.start:size + cols.stop] = part_gate_up[width:]  # up rows
            down[:, cols.start:cols.stop] = part_down
        whole[logical] = (gate_up, down)
    return whole


def _placement(previous: WorkerPlacement | ExpertBlock) -> WorkerPlacement:
    return previous if isinstance(previous, WorkerPlacement) else previous.placement


def can_reshard(previous: WorkerPlacement | ExpertBlock, new_wp: WorkerPlacement) -> bool:
    """Whether a layer's experts can go from `previous` (a placement, or the block built with it) to `new_wp` by
    one all-to-all: one is TP, the other EP, over the same stage (pp_rank of the same pp), the same group size
    P > 1 (tp == ep) and the same rank in it; the TP slices tile the EP experts' whole intermediate dimension.
    Reads only fields shared by the whole stage (and the rank's position, unchanged on every rank when the stage's
    workers keep their order), so every rank of the stage gets the same answer."""
    old = _placement(previous)
    if (old.ep_size > 1) == (new_wp.ep_size > 1):
        return False
    ep, tp = (old, new_wp) if old.ep_size > 1 else (new_wp, old)
    size = ep.ep_size
    if size < 2 or tp.tp_size != size or tp.ep_size != 1:
        return False
    if (old.pp_rank, old.pp_size, old.stage_rank) != (new_wp.pp_rank, new_wp.pp_size, new_wp.stage_rank):
        return False
    width = len(tp.expert_intermediate)
    return (width > 0 and tp.expert_intermediate == tp_slice(tp.tp_rank, width)
            and ep.expert_intermediate == range(size * width)
            and ep.expert_slots == rank_slots(len(ep.expert_slots) * size, size, ep.ep_rank))


def reshard_experts(previous: ExpertBlock, new_wp: WorkerPlacement, new_phy2log: Sequence[int],
                    group: TPGroup, switch: ExpertSwitch = ALONGSIDE) -> list[ExpertWeights]:
    """The new block's experts by local slot, from `previous` (the other form, same stage) by ONE all-to-all over
    `group` (the stage's ranks, in the same order: every rank of the stage must call this for the same layer).
    new_phy2log: the new map (EP target: e.g. `initial_phy2log`; TP target: the identity). The result is new
    tensors (two local slots of one logical expert share them), byte-identical to `load_expert` from the
    checkpoint. `previous` is left intact, unless `switch.in_place`: then its experts are let go once packed.
    Extra memory while it runs: this layer's send and receive buffers (in place: about one layer's experts).
    ReshardFailed on every rank of the stage when one could not pack (nothing is exchanged then)."""
    if not can_reshard(previous, new_wp):
        raise ValueError(f"layer {previous.layer_id}: no all-to-all reshard from {_placement(previous)} to {new_wp}")
    size, rank = group.size, group.rank
    if (size, rank) != (new_wp.tp_size * new_wp.ep_size, new_wp.stage_rank):
        raise ValueError(f"layer {previous.layer_id}: group rank {rank} of {size} is not the placement's "
                         f"{new_wp.stage_rank} of {new_wp.tp_size * new_wp.ep_size}")
    new_phy2log = tuple(int(e) for e in new_phy2log)
    if len(new_phy2log) != len(new_wp.expert_slots) * new_wp.ep_size:
        raise ValueError(f"layer {previous.layer_id}: a map of {len(new_phy2log)} slots for "
                         f"{new_wp.ep_size} ranks of {len(new_wp.expert_slots)}")
    hidden = previous.router.shape[1]
    ledger = switch.ledger or ExpertLedger()
    if previous.is_expert_parallel:  # EP -> TP
        if new_phy2log != tuple(range(previous.num_experts)):
            raise ValueError(f"layer {previous.layer_id}: a TP layout's map must be the identity")
        width = len(new_wp.expert_intermediate)
        plan = ep_to_tp_plan(previous.phy2log, size, rank)
        cols = [tp_slice(p, width) for p in range(size)]
    else:  # TP -> EP
        width = len(previous.intermediate)
        plan = tp_to_ep_plan(new_phy2log, size, rank)
        cols = [range(width)] * size
    step = piece_numel(width, hidden)
    # One host, host tensors: through shared memory, not gloo's sockets (the same on every rank of the stage).
    bulk = group.bulk_exchange() if previous.router.device.type == "cpu" and hasattr(group, "bulk_exchange") \
        else None
    send, failure = None, None
    try:
        if switch.fault is not None:
            switch.fault(previous.layer_id)
        held = {previous.phy2log[s]: w for s, w in zip(previous.slots, previous.experts, strict=True)}
        send = pack(held, plan.sends, cols, hidden, bulk.send_buffer if bulk is not None else None)
        del held
    except Exception as exc:  # noqa: BLE001 (told to the stage below, raised on every rank)
        failure = exc
    if not stage_agrees(group, failure is None, previous.router.device):
        send = None
        if bulk is not None:
            bulk.discard()
        raise ReshardFailed(f"layer {previous.layer_id}: experts could not change view "
                            f"({type(failure).__name__}: {failure} here)" if failure else
                            f"layer {previous.layer_id}: a peer of the stage could not pack its experts") from failure
    ledger.grow(send.nbytes)
    if switch.in_place:
        ledger.shrink(previous.release_experts())
    recv = send.new_empty(sum(plan.recv_splits(step)))
    ledger.grow(recv.nbytes)
    (bulk or group).all_to_all(recv, send, plan.recv_splits(step), plan.send_splits(step))
    ledger.shrink(send.nbytes)
    del send
    if previous.is_expert_parallel:  # the receive buffer becomes the layer's storage
        slices = unpack_slices(recv, plan, previous.num_experts, width, hidden)
        return [slices[new_phy2log[s]] for s in new_wp.expert_slots]
    whole = unpack_whole(recv, plan, width, hidden)
    ledger.grow(expert_bytes(list(whole.values())))
    ledger.shrink(recv.nbytes)
    return [whole[new_phy2log[s]] for s in new_wp.expert_slots]


def expert_peak_extra_bytes(old: WorkerPlacement, new: WorkerPlacement, old_maps: Mapping[int, Sequence[int]],
                            new_maps: Mapping[int, Sequence[int]], hidden: int, dtype_bytes: int,
                            reshard: bool = True) -> int:
    """What `ExpertLedger.peak_beyond` of an in-place build of `new` from `old` on one rank will be: the same steps
    as `reshard_experts` and `SparseMoeBlock`'s load, counted. old_maps / new_maps: each sparse layer's physical ->
    logical map (of the layers each placement holds); reshard: a view change goes by all-to-all where it can."""
    extra = peak = 0

    def step(num_bytes: int) -> None:
        nonlocal extra, peak
        extra += num_bytes
        peak = max(peak, extra)

    def whole(num_experts: int, width: int) -> int:
        return num_experts * piece_numel(width, hidden) * dtype_bytes

    for layer in (i for i in new.layers if i in new_maps):
        new_held = slot_experts(new_maps[layer], new.expert_slots)
        new_width = len(new.expert_intermediate)
        if layer not in old.layers:  # new to this rank: loaded whole, nothing let go
            step(whole(len(new_held), new_width))
            continue
        old_map, old_width = old_maps[layer], len(old.expert_intermediate)
        old_held = slot_experts(old_map, old.expert_slots)
        size = new.tp_size * new.ep_size
        if (old.ep_size > 1) != (new.ep_size > 1) and reshard and can_reshard(old, new):
            plan = (ep_to_tp_plan(old_map, size, new.stage_rank) if old.ep_size > 1
                    else tp_to_ep_plan(new_maps[layer], size, new.stage_rank))
            width = new_width if old.ep_size > 1 else old_width
            sent = sum(plan.send_splits(piece_numel(width, hidden))) * dtype_bytes
            received = sum(plan.recv_splits(piece_numel(width, hidden))) * dtype_bytes
            step(sent)
            step(-whole(len(old_held), old_width))
            step(received)
            step(-sent)
            if old.ep_size == 1:  # TP -> EP: the slices interleaved into whole experts, then the buffer goes
                step(whole(len(new_held), new_width))
                step(-received)
            continue
        kept = set(old_held) & set(new_held) if old_width == new_width else set()
        step(whole(len(set(new_held) - kept), new_width))
        step(-whole(len(set(old_held) - kept), old_width))
    return peak - max(0, extra)


def stage_agrees(group: TPGroup, ok: bool, device: torch.device) -> bool:
    """True when every rank of `group` says ok: one float summed on the group's device (an NCCL group reduces
    only GPU tensors)."""
    flag = torch.tensor([1.0 if ok else 0.0], device=device)
    return int(group.all_reduce(flag).item()) == group.size


def expert_bytes(experts: Sequence[ExpertWeights]) -> int:
    """Bytes of distinct expert tensors (slots sharing a logical expert's tensors count them once)."""
    tensors = {id(t): t for weights in experts for t in weights}
    return sum(t.numel() * t.element_size() for t in tensors.values())
