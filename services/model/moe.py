"""A sparse mixture-of-experts layer on one rank: the router's top-k, and the experts in their TP or EP form."""

from __future__ import annotations

import copy
from collections.abc import Container, Mapping, Sequence

import torch
import torch.nn.functional as F

from services.model.expert_reshard import (
    ALONGSIDE, ExpertLedger, ExpertSwitch, ExpertWeights, can_reshard, expert_bytes, reshard_experts, reshard_wanted,
)
from services.model.expert_table import ExpertTable
from services.model.kernels import TORCH, Kernels
from services.model.layers import ShardLoader, TPGroup
from services.model.numerics import FAST, Numerics, ordered_sum, reduction_pieces, whole_vectors
from services.model.spec import ModelSpec
from services.topology import WorkerPlacement
from services.topology.experts import expert_copies, expert_tensor_names, router_tensor_name


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool,
          cast_weights: bool, numerics: Numerics = FAST) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's router, in its order of operations: softmax in float32, top-k, optional renormalization;
    Qwen3-MoE casts the weights back to x's dtype (cast_weights), Mixtral keeps them in float32 (its weighted sum
    is then taken in float32). x [T, hidden] -> (weights [T, k], logical expert ids [T, k] int64). numerics:
    invariant mode's GEMM rule (services/model/numerics.py). Among equal probabilities (frequent with bfloat16
    logits) the lower expert id goes first: a stable sort, where torch.topk's order of ties is its own (it differs
    between a CPU and a GPU), so every device and triton_moe.route pick the same experts."""
    logits = numerics.linear(x, router) if numerics.is_invariant else F.linear(x, router)
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, experts = (t[:, :top_k] for t in torch.sort(probs, dim=-1, descending=True, stable=True))
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights.to(x.dtype) if cast_weights else weights), experts


def expert_mlp(x: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
    """SwiGLU of one expert (or its intermediate slice: then partial sums). x [N, hidden] -> [N, hidden]."""
    gate_up, down = weights
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def expert_mlp_pieces(x: torch.Tensor, weights: ExpertWeights, pieces: Sequence[range],
                      numerics: Numerics) -> torch.Tensor:
    """Invariant numerics: one expert's (slice's) SwiGLU with its down projection cut into `pieces` of its local
    intermediate, each piece's partial product apart. x [N, hidden] -> [N, len(pieces) * hidden]."""
    gate_up, down = weights
    gate, up = numerics.linear(x, gate_up).chunk(2, dim=-1)
    hidden = whole_vectors(F.silu, gate) * up  # [N, I_local]
    return numerics.linear_pieces(hidden, down, pieces).to(x.dtype)


def load_expert(loader: ShardLoader, style: str, layer: int, expert: int, intermediate: range) -> ExpertWeights:
    """One logical expert's weights from the checkpoint, cut to `intermediate` (gate/up rows, down columns)."""
    gate, up, down = expert_tensor_names(style, layer, expert)
    return (torch.cat([loader.rows(gate, intermediate), loader.rows(up, intermediate)]),  # [2 * I_local, hidden]
            loader.cols(down, intermediate))  # [hidden, I_local]


def copy_tables(phy2log: Sequence[int], num_experts: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per logical expert: its number of copies [E], and its slots in ascending order [E, max copies] (padded)."""
    slots = [list(held) for held in expert_copies(phy2log, num_experts)]
    width = max(len(s) for s in slots)
    table = torch.tensor([s + [s[0]] * (width - len(s)) for s in slots], dtype=torch.int64, device=device)
    counts = torch.tensor([len(s) for s in slots], dtype=torch.int64, device=device)
    return counts, table


def physical_slots(experts: torch.Tensor, num_copies: torch.Tensor, copy_slots: torch.Tensor) -> torch.Tensor:
    """The slot each (token, k) assignment goes to: copy (token row % copies) of its logical expert, copies in
    ascending slot order (the convention every rank shares). experts [T, k] -> slots [T, k]."""
    rows = torch.arange(experts.shape[0], device=experts.device)[:, None]  # [T, 1]
    return copy_slots[experts, rows % num_copies[experts]]


def check_expert_map(phy2log: Sequence[int], num_experts: int, num_physical: int) -> tuple[int, ...]:
    """The map as a tuple; ValueError unless it has num_physical slots, each a logical expert, and every logical
    expert has at least one slot."""
    phy2log = tuple(int(e) for e in phy2log)
    if len(phy2log) != num_physical:
        raise ValueError(f"expert map has {len(phy2log)} slots, the placement has {num_physical}")
    if any(not 0 <= e < num_experts for e in phy2log):
        raise ValueError(f"expert map {phy2log} names experts outside 0..{num_experts - 1}")
    if missing := sorted(set(range(num_experts)) - set(phy2log)):
        raise ValueError(f"expert map {phy2log} has no slot for logical experts {missing}")
    return phy2log


class SparseMoeBlock:
    """One sparse layer's router and this rank's experts.

    TP form (ep_size 1): every expert's `expert_intermediate` slice; the routed partial outputs are summed locally
    and reduced with ONE all-reduce over the TP group. EP form (ep_size > 1): whole experts of the physical slots
    `expert_slots`; each (token, k) assignment travels to the rank owning its slot and back by all-to-all, so a
    rank only ever computes the experts it holds. Both forms keep the router whole: routing is decided where the
    token lives, with no collective."""

    def __init__(self, spec: ModelSpec, wp: WorkerPlacement, layer_id: int, loader: ShardLoader, group: TPGroup,
                 phy2log: Sequence[int] | None = None, previous: SparseMoeBlock | None = None,
                 switch: ExpertSwitch = ALONGSIDE, numerics: Numerics = FAST, kernels: Kernels = TORCH) -> None:
        """group: the TP group (TP form) or the stage's EP group (EP form). phy2log: the logical expert of every
        physical slot (None: the identity; the TP form accepts only the identity). previous: this layer's block
        before a reconfiguration: the router and the experts it holds with the same intermediate slice are shared,
        not loaded again (an EP -> TP switch at full width reloads only the experts this rank lacked); when it is in
        the other form over the same stage (tp{P} <-> ep{P}, see `can_reshard`), the experts come from it by one
        all-to-all over `group` instead (every rank of the stage builds this layer at the same time), unless
        `switch.reshard` is False (a shard staged while steps use the same group) or RECONFIG_EXPERT_RESHARD says
        no. `switch.in_place`: `previous` lets go of its experts once this block has what it needs of them.
        resharded_bytes / loaded_bytes: this rank's expert bytes that came by that all-to-all / from `loader`.
        kernels: with a grouped `moe_experts` (Triton), the TP form runs its experts as two grouped GEMMs in fixed
        shapes (no host synchronisation: what a decode graph captures); the EP form and invariant numerics keep
        the product per expert."""
        self.placement = wp
        self.layer_id = layer_id
        self.num_experts = spec.num_experts
        self.top_k = spec.num_experts_per_tok
        self.renormalize = spec.norm_topk_prob
        self.cast_weights = spec.moe_style != "mixtral"
        self.is_expert_parallel = wp.ep_size > 1
        self.slots = wp.expert_slots
        self.intermediate = wp.expert_intermediate
        self.group = group
        self.moe_style = spec.moe_style
        # Invariant numerics: each expert's down projection in pieces cut at every TP degree's bounds; the TP
        # form gathers the pieces of every assignment and adds them in order, as one rank (TP1, EP) does.
        self.numerics = numerics
        self.pieces = reduction_pieces(numerics.expert_bounds, self.intermediate) if numerics.is_invariant else None
        self.released = False  # an in-place switch took its experts (restore_experts brings them back)
        num_physical = len(phy2log) if phy2log is not None else spec.num_experts
        if len(self.slots) * wp.ep_size != num_physical:
            raise ValueError(f"layer {layer_id}: {wp.ep_size} ranks of {len(self.slots)} slots do not hold the "
                             f"{num_physical} physical experts of the map")
        self.phy2log = check_expert_map(phy2log if phy2log is not None else range(num_physical), spec.num_experts,
                                        num_physical)
        if not self.is_expert_parallel and self.phy2log != tuple(range(spec.num_experts)):
            raise ValueError(f"layer {layer_id}: a TP layout holds every expert once; its map must be the identity")
        held: dict[int, ExpertWeights] = {}  # by logical expert
        self.resharded_bytes = self.loaded_bytes = 0
        if previous is not None:
            self.router = previous.router  # [E, hidden]
            if previous.intermediate == self.intermediate:
                held = {previous.phy2log[s]: w for s, w in zip(previous.slots, previous.experts, strict=True)}
        else:
            self.router = loader.full(router_tensor_name(spec.moe_style, layer_id))  # [E, hidden]
        if (previous is not None and previous.is_expert_parallel != self.is_expert_parallel
                and switch.reshard and can_reshard(previous, wp) and reshard_wanted(group)):
            self.experts = reshard_experts(previous, wp, self.phy2log, group, switch)  # by local slot
            self.resharded_bytes = expert_bytes(self.experts)
        else:
            kept = {id(t) for weights in held.values() for t in weights}
            if switch.fault is not None and previous is not None:
                switch.fault(layer_id)
            self.experts = self._load_experts(loader, spec.moe_style, held)  # by local slot
            self.loaded_bytes = expert_bytes([w for w in self.experts if id(w[0]) not in kept])
            ledger = switch.ledger or ExpertLedger()
            ledger.grow(self.loaded_bytes)
            if switch.in_place and previous is not None:
                ledger.shrink(previous.release_experts(keep={id(t) for w in self.experts for t in w}))
        device = self.router.device
        self.num_copies, self.copy_slots = copy_tables(self.phy2log, self.num_experts, device)
        self.load = torch.zeros(num_physical, dtype=torch.int64, device=device)  # (token, k) assignments per slot
        # In TP form every rank of the group routes the same tokens: only rank 0 counts them, so summing the
        # stage's counters gives the true load in both forms.
        self.counts_load = self.is_expert_parallel or wp.tp_rank == 0
        self.grouped = kernels.moe_experts if not self.is_expert_parallel and self.pieces is None else None
        self.routed = kernels.moe_route  # its router after the product (softmax, top-k, renormalisation), with them
        self.table = ExpertTable.build(self.experts) if self.grouped is not None else None
        if self.table is None:
            self.grouped = None  # experts the kernels cannot read in place (not contiguous): per expert

    def _load_experts(self, loader: ShardLoader, style: str, held: dict[int, ExpertWeights]) -> list[ExpertWeights]:
        """The weights of every local slot: `held` ones shared, the others loaded (two local slots of one logical
        expert share its tensors)."""
        experts = []
        for slot in self.slots:
            logical = self.phy2log[slot]
            if logical not in held:
                held[logical] = load_expert(loader, style, self.layer_id, logical, self.intermediate)
            experts.append(held[logical])
        return experts

    def release_experts(self, keep: Container[int] = frozenset()) -> int:
        """An in-place switch's old block: let go of every expert tensor (but those whose id is in `keep`: the new
        block shares them); returns the bytes let go. The block cannot run until `restore_experts`."""
        freed = expert_bytes([tuple(t for t in w if id(t) not in keep) for w in self.experts])
        self.experts, self.released = [], True
        return freed

    def restore_experts(self, loader: ShardLoader) -> int:
        """Load the experts an in-place switch took (its rollback) from `loader`, as this block's own first load
        did (the same slots, map and slice: the same bytes); returns the bytes loaded (0: nothing was taken)."""
        if not self.released:
            return 0
        self.experts, self.released = self._load_experts(loader, self.moe_style, {}), False
        if self.table is not None and not self.table.refresh(self.experts):  # a graph replays over the table
            raise RuntimeError(f"layer {self.layer_id}: the restored experts cannot be read through its table")
        return expert_bytes(self.experts)

    @property
    def num_physical(self) -> int:
        """Physical expert slots of this layer across the stage."""
        return len(self.phy2log)

    def regrouped(self, group: TPGroup) -> SparseMoeBlock:
        """The same weights (shared, not copied) over another group; a fresh load counter and expert table."""
        block = copy.copy(self)
        block.group = group
        block.experts = list(self.experts)
        block.load = torch.zeros_like(self.load)
        block.table = ExpertTable.build(block.experts) if self.table is not None else None  # its own, refreshed apart
        return block

    @property
    def graphable(self) -> bool:
        """Whether a step through this block has fixed shapes and no host synchronisation (a CUDA graph holds it)."""
        return self.grouped is not None

    def __call__(self, x: torch.Tensor, repeats: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] (T may be 0: the rank still joins the collectives) -> [T, hidden], reduced over the group.
        repeats: a padded step's write_rows (AttentionMetadata): rows that repeat another are not counted in the
        load."""
        if self.released:
            raise RuntimeError(f"layer {self.layer_id}: its experts went to an in-place switch; restore them first")
        if self.routed is not None and self.grouped is not None:  # the router after its product in one kernel
            weights, experts = self.routed(F.linear(x, self.router), self.top_k, self.renormalize,
                                           x.dtype if self.cast_weights else torch.float32)  # [T, k] each
        else:
            weights, experts = route(x, self.router, self.top_k, self.renormalize, self.cast_weights,
                                     self.numerics)  # [T, k] each
        if self.grouped is not None:  # TP form: slot == logical expert == local slot; the kernels count the load
            return self.group.all_reduce(self.grouped(x, weights, experts, self.table,
                                                      self.load if self.counts_load else None, repeats))
        slots = physical_slots(experts, self.num_copies, self.copy_slots)  # [T, k]
        if self.counts_load:
            self._count(slots, repeats)
        if self.is_expert_parallel:
            return self._expert_parallel(x, weights, slots)
        if self.pieces is not None:
            return self._combine_gathered(x, weights, slots)
        return self.group.all_reduce(self._combine_local(x, weights, slots))

    def _count(self, slots: torch.Tensor, repeats: torch.Tensor | None) -> None:
        """Add a step's assignments to the load, on the device (no synchronisation): slots [T, k]."""
        ones = torch.ones_like(slots)
        if repeats is not None:  # a padding row repeats a real row: only the rows that are themselves count
            ones *= (repeats == torch.arange(slots.shape[0], device=slots.device))[:, None]
        self.load.index_add_(0, slots.reshape(-1), ones.reshape(-1))

    def _combine_local(self, x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """TP form: sum of every assignment's weighted expert (slice) output, per token. -> [T, hidden] partial."""
        flat = slots.reshape(-1)  # [T * k]; TP: slot == logical expert
        order = torch.argsort(flat, stable=True)
        rows = order // self.top_k  # token of each sorted assignment
        outputs = self._run_experts(x.index_select(0, rows), flat[order], self.slots.start)  # [T * k, hidden]
        return self._weighted_sum(x, outputs, weights.reshape(-1)[order], rows)

    def _combine_gathered(self, x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """TP form, invariant numerics: every assignment's expert pieces from every rank (all-gathered, in piece
        order), added in order, then weighted in k order. -> [T, hidden], whole on every rank (no all-reduce)."""
        flat = slots.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = order // self.top_k
        pieces = self._run_experts(x.index_select(0, rows), flat[order], self.slots.start)  # [T*k, P_local * h]
        gathered = self.group.all_gather_last_dim(pieces)  # [T*k, P * hidden]
        outputs = ordered_sum(gathered, len(self.pieces) * self.group.size, x.dtype)
        return self._weighted_sum_in_k_order(x, outputs, weights, order)

    def _expert_parallel(self, x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """EP form: dispatch each assignment to its slot's rank, compute there, combine back. -> [T, hidden]."""
        flat = slots.reshape(-1)  # [T * k]
        order = torch.argsort(flat, stable=True)  # by slot, hence by destination rank (slots are contiguous)
        sorted_slots = flat[order]
        rows = order // self.top_k
        size = self.group.size
        send_counts = torch.bincount(sorted_slots // len(self.slots), minlength=size)  # [ep]
        recv_counts = torch.empty_like(send_counts)
        self.group.all_to_all(recv_counts, send_counts, [1] * size, [1] * size)
        sends, recvs = send_counts.tolist(), recv_counts.tolist()
        hidden = x.shape[1]
        received = x.new_empty((sum(recvs), hidden))
        self.group.all_to_all(received, x.index_select(0, rows), recvs, sends)  # dispatch
        received_slots = sorted_slots.new_empty(sum(recvs))
        self.group.all_to_all(received_slots, sorted_slots, recvs, sends)
        local_order = torch.argsort(received_slots, stable=True)
        computed = self._run_experts(received.index_select(0, local_order), received_slots[local_order],
                                     self.slots.start)
        if self.pieces is not None:  # whole experts here: their pieces added in order, as the TP form does
            computed = ordered_sum(computed, len(self.pieces), x.dtype)
        results = torch.empty_like(computed).index_copy_(0, local_order, computed)  # back in arrival order
        returned = x.new_empty((len(flat), hidden))
        self.group.all_to_all(returned, results, sends, recvs)  # combine: row j answers sorted assignment j
        if self.pieces is not None:
            return self._weighted_sum_in_k_order(x, returned, weights, order)
        return self._weighted_sum(x, returned, weights.reshape(-1)[order], rows)

    def _run_experts(self, inputs: torch.Tensor, slots: torch.Tensor, first_slot: int) -> torch.Tensor:
        """inputs [N, hidden] sorted by slot (all local) -> each row through its slot's expert, [N, hidden]."""
        counts = torch.bincount(slots - first_slot, minlength=len(self.experts)).tolist()
        width = len(self.pieces) if self.pieces is not None else 1  # invariant: [N, pieces * hidden]
        outputs = inputs.new_empty((inputs.shape[0], width * inputs.shape[1]))
        start = 0
        for local, count in enumerate(counts):
            if count:
                chunk = inputs[start:start + count]
                outputs[start:start + count] = (
                    expert_mlp(chunk, self.experts[local]) if self.pieces is None
                    else expert_mlp_pieces(chunk, self.experts[local], self.pieces, self.numerics))
                start += count
        return outputs

    @staticmethod
    def _weighted_sum(x: torch.Tensor, outputs: torch.Tensor, weights: torch.Tensor,
                      rows: torch.Tensor) -> torch.Tensor:
        """Sum over k of weight * expert output, per token (as transformers: the product in the weights' dtype,
        then cast to x's). outputs [T*k, hidden], weights [T*k], rows [T*k] -> [T, hidden]."""
        weighted = (outputs * weights[:, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, rows, weighted)

    def _weighted_sum_in_k_order(self, x: torch.Tensor, outputs: torch.Tensor, weights: torch.Tensor,
                                 order: torch.Tensor) -> torch.Tensor:
        """Invariant numerics: sum over k of weight * expert output, each token's k terms added in routing order
        (whatever slot holds each expert). outputs [T*k, hidden] in `order` (sorted assignments), weights [T, k]."""
        by_assignment = torch.empty_like(outputs).index_copy_(0, order, outputs).view(x.shape[0], self.top_k, x.shape[1])
        weighted = (by_assignment * weights[..., None]).to(x.dtype)  # [T, k, hidden]
        total = torch.zeros_like(x)
        for k in range(self.top_k):
            total += weighted[:, k]
        return total

    def take_load(self) -> torch.Tensor:
        """The assignments counted per physical slot since the last call; the counter restarts at zero."""
        load, self.load = self.load, torch.zeros_like(self.load)
        return load

    def slot_weights(self, slot: int) -> ExpertWeights:
        """The weights of a physical slot this rank holds (to copy to a peer): (gate_up, down)."""
        if slot not in self.slots:
            raise KeyError(f"layer {self.layer_id}: slot {slot} is not held here (slots {self.slots})")
        return self.experts[slot - self.slots.start]

    def remap(self, phy2log: Sequence[int], new_weights: Mapping[int, ExpertWeights]) -> None:
        """Install a new physical -> logical map and the weights of the local slots whose expert changed, in one
        go: everything is checked before anything changes. Slots not given keep their tensors (no copy)."""
        if not self.is_expert_parallel:
            raise ValueError("a TP layout has no expert map to change")
        phy2log = check_expert_map(phy2log, self.num_experts, self.num_physical)
        if foreign := sorted(set(new_weights) - set(self.slots)):
            raise ValueError(f"layer {self.layer_id}: slots {foreign} are not held here (slots {self.slots})")
        for slot, weights in new_weights.items():
            held = self.slot_weights(slot)
            if len(weights) != len(held) or any(w.shape != h.shape for w, h in zip(weights, held)):
                raise ValueError(f"layer {self.layer_id}: slot {slot}'s new weights have shapes "
                                 f"{[tuple(w.shape) for w in weights]}, expected {[tuple(h.shape) for h in held]}")
        if moved := [s for s in self.slots if phy2log[s] != self.phy2log[s] and s not in new_weights]:
            raise ValueError(f"layer {self.layer_id}: slots {moved} change expert but got no weights")
        for slot, weights in new_weights.items():
            self.experts[slot - self.slots.start] = tuple(weights)
        self.phy2log = phy2log
        self.num_copies, self.copy_slots = copy_tables(phy2log, self.num_experts, self.router.device)

    def parameter_tensors(self) -> list[torch.Tensor]:
        """The router and every expert tensor held (a logical expert in two local slots appears twice)."""
        return [self.router, *(t for weights in self.experts for t in weights)]
