"""A sparse layer's experts as two grouped GEMMs over the routed tokens, in fixed shapes (issue 38's MoE part).

The eager experts (SparseMoeBlock._run_experts) count each expert's tokens on the host and call it on its rows:
a host synchronisation and three small products per expert held, every layer, every step, and shapes a CUDA graph
cannot hold. Here every (token, k) assignment of a step goes through two kernels whose grid depends only on the
step's number of tokens:

- `_route_kernel` (`route`), a program per token: the router's softmax, top-k and renormalisation after its
  product (the lower expert id first among equal probabilities, as moe.route's stable sort);
- `_align_kernel`, one program: each slot's count of assignments (a histogram), its first sorted row and first
  tile (BLOCK_M rows a tile), and the slot of every tile (at most cdiv(N, BLOCK_M) + slots tiles: the programs
  past the last tile return at once); it also adds the step's assignments to the block's load. The assignments
  are sorted by slot on the device (torch.argsort, stable);
- `_gate_up_kernel`: a tile's token rows times its expert's gate and up rows, silu(gate) * up stored per sorted
  assignment (SwiGLU fused into the product; the expert's weights are read once per tile, not once per token);
- `_down_kernel`: those rows times the expert's down projection, scaled by the assignment's routing weight and
  stored in (token, k) order; the k outputs of a token are then added (one sum).

The experts' weights stay where SparseMoeBlock holds them (a tensor pair per slot): the kernels find a slot's
tensors through services/model/expert_table.py's offsets, which a graph reads when it replays.

Numerics: products accumulate in float32 and round to the tensor's dtype where the eager path rounds (the silu's
output, each product's output, the weighted output), so fp32 results match the eager ones to float rounding and
bf16 ones to an ulp or so; the sum over k is taken in k order instead of the eager path's slot order.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from services.model.expert_table import ExpertTable

# As in triton_kernels: the interpreter's tl.dot takes float32 operands (its bf16 path loses range).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def block_m(assignments: int) -> int:
    """Rows per tile: 16 (tl.dot's least) for decode-sized steps, 64 for prefills."""
    return 16 if assignments <= 1024 else 64


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, NUM_EXPERTS: tl.constexpr, EXPERTS_P2: tl.constexpr,
                  TOP_K: tl.constexpr, K_P2: tl.constexpr, RENORMALIZE: tl.constexpr):
    """One token's router: softmax of its logits in float32, its top-k (the first index among equal values),
    renormalised to sum to 1 where the model says so; the weights stored in their tensor's dtype."""
    t = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, EXPERTS_P2)
    inside = experts < NUM_EXPERTS
    logits = tl.load(logits_ptr + t * NUM_EXPERTS + experts, mask=inside, other=float("-inf")).to(tl.float32)
    exps = tl.exp(logits - tl.max(logits, axis=0))
    probs = tl.where(inside, exps / tl.sum(exps, axis=0), -1.0)
    picks = tl.arange(0, K_P2)
    chosen = tl.zeros((K_P2,), dtype=tl.float32)
    chosen_ids = tl.zeros((K_P2,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        best_id = tl.min(tl.where(probs == best, experts, EXPERTS_P2), axis=0)
        chosen = tl.where(picks == j, best, chosen)
        chosen_ids = tl.where(picks == j, best_id, chosen_ids)
        probs = tl.where(experts == best_id, -1.0, probs)
    if RENORMALIZE:
        chosen = chosen / tl.sum(tl.where(picks < TOP_K, chosen, 0.0), axis=0)
    tl.store(weights_ptr + t * TOP_K + picks, chosen.to(weights_ptr.dtype.element_ty), mask=picks < TOP_K)
    tl.store(ids_ptr + t * TOP_K + picks, chosen_ids, mask=picks < TOP_K)


def route(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """moe.route after its router product, in one launch: logits [T, E] -> (weights [T, k] in `dtype`, expert ids
    [T, k] int64)."""
    tokens, num_experts = logits.shape
    weights = torch.empty((tokens, top_k), dtype=dtype, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](logits.contiguous(), weights, ids, NUM_EXPERTS=num_experts,
                                 EXPERTS_P2=triton.next_power_of_2(num_experts), TOP_K=top_k,
                                 K_P2=triton.next_power_of_2(top_k), RENORMALIZE=renormalize)
    return weights, ids


@triton.jit
def _align_kernel(slots_ptr, repeats_ptr, counts_ptr, starts_ptr, tile_starts_ptr, tile_slot_ptr, load_ptr, n,
                  num_tiles, TOP_K: tl.constexpr, NUM_SLOTS: tl.constexpr, SLOTS_P2: tl.constexpr,
                  BLOCK_N: tl.constexpr, N_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, TILE_CHUNK: tl.constexpr,
                  MAX_TILES: tl.constexpr,
                  HAS_REPEATS: tl.constexpr, COUNT_LOAD: tl.constexpr):
    """One program: each slot's assignments (counts), its first sorted row (starts) and first tile (tile_starts),
    the slot of every tile (tile_slot: SLOTS_P2 or more past the last tile); with COUNT_LOAD the assignments of
    the rows that are not a padded step's repeats are added to the load."""
    bins = tl.arange(0, SLOTS_P2)
    counts = tl.zeros((SLOTS_P2,), dtype=tl.int32)
    counted_load = tl.zeros((SLOTS_P2,), dtype=tl.int32)
    for j0 in range(0, BLOCK_N, N_CHUNK):
        j = j0 + tl.arange(0, N_CHUNK)
        inside = j < n
        slots = tl.where(inside, tl.load(slots_ptr + j, mask=inside, other=0).to(tl.int32), 0)
        counts += tl.histogram(slots, SLOTS_P2, mask=inside)
        if COUNT_LOAD:
            counted = inside
            if HAS_REPEATS:
                row = j // TOP_K
                counted = inside & (tl.load(repeats_ptr + row, mask=inside, other=0) == row)
            counted_load += tl.histogram(slots, SLOTS_P2, mask=counted)
    if COUNT_LOAD:
        load = tl.load(load_ptr + bins, mask=bins < NUM_SLOTS, other=0)
        tl.store(load_ptr + bins, load + counted_load, mask=bins < NUM_SLOTS)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, 0)
    tl.store(counts_ptr + bins, counts, mask=bins < NUM_SLOTS)
    tl.store(starts_ptr + bins, tl.cumsum(counts, 0) - counts, mask=bins < NUM_SLOTS)
    tl.store(tile_starts_ptr + bins, tile_ends - tiles, mask=bins < NUM_SLOTS)
    for t0 in range(0, MAX_TILES, TILE_CHUNK):
        ids = t0 + tl.arange(0, TILE_CHUNK)
        slot = tl.sum((tile_ends[None, :] <= ids[:, None]).to(tl.int32), axis=1)  # tiles ending at or before it
        tl.store(tile_slot_ptr + ids, slot, mask=ids < num_tiles)


def _tile_table(local_slots: torch.Tensor, num_slots: int, rows_per_tile: int, top_k: int,
                load: torch.Tensor | None, repeats: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """local_slots [N] (0..num_slots-1) -> (counts [S]; starts [S]: each slot's first sorted row; tile_starts
    [S]: its first tile; tile_slot [max tiles]: the slot of every tile, num_slots or more past the last). One
    launch; `load` (int64 [S]) gains the step's assignments, `repeats`' padding rows left out."""
    n = local_slots.shape[0]
    device = local_slots.device
    counts, starts, tile_starts = (torch.empty(num_slots, dtype=torch.int32, device=device) for _ in range(3))
    num_tiles = -(-n // rows_per_tile) + num_slots
    tile_slot = torch.empty(num_tiles, dtype=torch.int32, device=device)
    block_n = max(16, triton.next_power_of_2(n))
    slots_p2 = max(16, triton.next_power_of_2(num_slots))
    _align_kernel[(1,)](local_slots, repeats if repeats is not None else local_slots, counts, starts, tile_starts,
                        tile_slot, load if load is not None else counts, n, num_tiles, TOP_K=top_k,
                        NUM_SLOTS=num_slots, SLOTS_P2=slots_p2, BLOCK_N=block_n, N_CHUNK=min(block_n, 4096),
                        BLOCK_M=rows_per_tile, TILE_CHUNK=64,
                        MAX_TILES=triton.cdiv(block_n // rows_per_tile + slots_p2, 64) * 64,
                        HAS_REPEATS=repeats is not None, COUNT_LOAD=load is not None)
    return counts, starts, tile_starts, tile_slot


@triton.jit
def _tile_rows(tile_slot_ptr, tile_starts_ptr, starts_ptr, counts_ptr, NUM_SLOTS: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """This program's tile -> (its slot, clamped; its sorted rows; which of them are real)."""
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile)
    used = slot < NUM_SLOTS
    slot = tl.minimum(slot, NUM_SLOTS - 1)
    local = tile - tl.load(tile_starts_ptr + slot)
    within = local * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(starts_ptr + slot) + within
    return slot, rows, (within < tl.load(counts_ptr + slot)) & used


@triton.jit
def _gate_up_kernel(x_ptr, order_ptr, tile_slot_ptr, tile_starts_ptr, starts_ptr, counts_ptr, gate_up_ptr,
                    offsets_ptr, out_ptr, TOP_K: tl.constexpr, NUM_SLOTS: tl.constexpr, HIDDEN: tl.constexpr,
                    INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    slot, rows, real = _tile_rows(tile_slot_ptr, tile_starts_ptr, starts_ptr, counts_ptr, NUM_SLOTS, BLOCK_M)
    if tl.max(real.to(tl.int32), axis=0) > 0:
        tokens = tl.load(order_ptr + rows, mask=real, other=0).to(tl.int64) // TOP_K  # each row's token
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < INTER
        weights = gate_up_ptr + tl.load(offsets_ptr + slot)
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < HIDDEN
            x = tl.load(x_ptr + tokens[:, None] * HIDDEN + ks[None, :], mask=real[:, None] & k_ok[None, :],
                        other=0.0)
            w_mask = col_ok[:, None] & k_ok[None, :]
            wg = tl.load(weights + cols[:, None].to(tl.int64) * HIDDEN + ks[None, :], mask=w_mask, other=0.0)
            wu = tl.load(weights + (cols[:, None].to(tl.int64) + INTER) * HIDDEN + ks[None, :], mask=w_mask,
                         other=0.0)
            if DOT_F32:
                x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            gate = tl.dot(x, tl.trans(wg), gate, input_precision=PRECISION)
            up = tl.dot(x, tl.trans(wu), up, input_precision=PRECISION)
        dtype = out_ptr.dtype.element_ty
        gate = gate.to(dtype).to(tl.float32)  # each product rounds, as F.linear's output does
        up = up.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # silu rounds before the product
        tl.store(out_ptr + rows[:, None].to(tl.int64) * INTER + cols[None, :], (silu * up).to(dtype),
                 mask=real[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, route_ptr, order_ptr, tile_slot_ptr, tile_starts_ptr, starts_ptr, counts_ptr, down_ptr,
                 offsets_ptr, out_ptr, NUM_SLOTS: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 DOT_F32: tl.constexpr):
    slot, rows, real = _tile_rows(tile_slot_ptr, tile_starts_ptr, starts_ptr, counts_ptr, NUM_SLOTS, BLOCK_M)
    if tl.max(real.to(tl.int32), axis=0) > 0:
        rows64 = rows.to(tl.int64)
        assignment = tl.load(order_ptr + rows, mask=real, other=0).to(tl.int64)  # its (token, k), flat
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < HIDDEN
        weights = down_ptr + tl.load(offsets_ptr + slot)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < INTER
            a = tl.load(act_ptr + rows64[:, None] * INTER + ks[None, :], mask=real[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(weights + cols[:, None].to(tl.int64) * INTER + ks[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if DOT_F32:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
        dtype = out_ptr.dtype.element_ty
        route = tl.load(route_ptr + assignment, mask=real, other=0.0).to(tl.float32)
        # The expert's output rounds, then its product with the routing weight (in the weight's dtype, as the
        # eager path's outputs * weights; a bf16 product of two bf16 values is exact in float32 before rounding).
        weighted = (acc.to(dtype).to(tl.float32) * route[:, None]).to(route_ptr.dtype.element_ty)
        tl.store(out_ptr + assignment[:, None] * HIDDEN + cols[None, :], weighted.to(dtype),  # in (token, k) order
                 mask=real[:, None] & col_ok[None, :])


def grouped_experts(x: torch.Tensor, route_weights: torch.Tensor, local_slots: torch.Tensor, table: ExpertTable,
                    load: torch.Tensor | None = None, repeats: torch.Tensor | None = None) -> torch.Tensor:
    """Every token through its k routed experts, weighted and added: x [T, hidden], route_weights [T, k] (x's dtype
    or float32), local_slots [T, k] (0..slots-1, this rank's slots) -> [T, hidden] (a TP slice's partial sums).
    load: int64 [slots], given the step's assignments (but those of `repeats`' padding rows: a padded step's
    write_rows)."""
    tokens, top_k = local_slots.shape
    hidden, inter, slots = table.hidden, table.intermediate, table.num_slots
    if x.shape[1] != hidden:
        raise ValueError(f"grouped_experts: x has {x.shape[1]} features, the experts {hidden}")
    x = x.contiguous()
    flat = local_slots.reshape(-1)
    n = flat.shape[0]
    if not n:
        return x.new_zeros((0, hidden))
    rows_per_tile = block_m(n)
    counts, starts, tile_starts, tile_slot = _tile_table(flat, slots, rows_per_tile, top_k, load, repeats)
    order = torch.argsort(flat, stable=True)  # assignments by slot: a slot's tile reads its rows together
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    act = x.new_empty((n, inter))  # by sorted row
    grid = (tile_slot.shape[0], triton.cdiv(inter, 64))
    _gate_up_kernel[grid](x, order, tile_slot, tile_starts, starts, counts, table.anchor, table.gate_up_offsets, act,
                          TOP_K=top_k, NUM_SLOTS=slots, HIDDEN=hidden, INTER=inter, BLOCK_M=rows_per_tile,
                          BLOCK_N=64, BLOCK_K=64, PRECISION=precision, DOT_F32=_INTERPRETED)
    out = x.new_empty((tokens, top_k, hidden))  # by assignment
    grid = (tile_slot.shape[0], triton.cdiv(hidden, 64))
    _down_kernel[grid](act, route_weights.contiguous(), order, tile_slot, tile_starts, starts, counts, table.anchor,
                       table.down_offsets, out, NUM_SLOTS=slots, HIDDEN=hidden, INTER=inter, BLOCK_M=rows_per_tile,
                       BLOCK_N=64, BLOCK_K=64, PRECISION=precision, DOT_F32=_INTERPRETED)
    return out.sum(dim=1)
