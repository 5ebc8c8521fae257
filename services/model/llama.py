"""The Llama-family decoder, sharded by a WorkerPlacement: this worker's layers, heads, MLP columns or experts,
vocab rows."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F

from services.model.attention import AttentionMetadata, paged_attention
from services.model.invariant_attention import invariant_attention
from services.model.expert_reshard import ALONGSIDE, ExpertSwitch
from services.model.kernels import TORCH, Kernels
from services.model.layers import (
    Linear,
    ParallelLMHead,
    RotaryEmbedding,
    RowParallelLinear,
    ShardLoader,
    TPGroup,
    VocabParallelEmbedding,
)
from services.model.moe import SparseMoeBlock
from services.model.numerics import FAST, Numerics, reduction_pieces, whole_vectors
from services.model.spec import ModelSpec
from services.topology import WorkerPlacement

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"


def _head_rows(heads: range, head_dim: int) -> range:
    return range(heads.start * head_dim, heads.stop * head_dim)


class DenseMLP:
    """A SwiGLU MLP holding this TP rank's intermediate columns (gate/up) and rows (down); one all-reduce."""

    def __init__(self, spec: ModelSpec, wp: WorkerPlacement, prefix: str, loader: ShardLoader, group: TPGroup,
                 numerics: Numerics = FAST, kernels: Kernels = TORCH) -> None:
        gate_up = [prefix + "mlp.gate_proj", prefix + "mlp.up_proj"]
        self.gate_up = Linear(
            torch.cat([loader.rows(n + ".weight", wp.intermediate) for n in gate_up]),  # [2 * I_local, h]
            torch.cat([loader.rows(n + ".bias", wp.intermediate) for n in gate_up]) if spec.mlp_bias else None,
            numerics=numerics,
        )
        self.down_proj = RowParallelLinear(
            Linear(loader.cols(prefix + "mlp.down_proj.weight", wp.intermediate), numerics=numerics),
            loader.full(prefix + "mlp.down_proj.bias") if spec.mlp_bias else None,
            group,
            reduction_pieces(numerics.intermediate_bounds, wp.intermediate) if numerics.is_invariant else None,
        )
        silu = functools.partial(whole_vectors, F.silu) if numerics.is_invariant else F.silu
        self.silu_mul = functools.partial(kernels.silu_mul, silu=silu) if not kernels.fused else kernels.silu_mul

    def regrouped(self, group: TPGroup) -> DenseMLP:
        """The same weights reducing over another TP group."""
        mlp = copy.copy(self)
        mlp.down_proj = self.down_proj.regrouped(group)
        return mlp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.silu_mul(self.gate_up(x)))


class DecoderLayer:
    """One transformer block holding only this rank's slice: q/kv heads, and the MLP columns or (sparse layer) the
    experts' slices or slots."""

    def __init__(self, spec: ModelSpec, wp: WorkerPlacement, layer_id: int, loader: ShardLoader, group: TPGroup,
                 mlp: DenseMLP | SparseMoeBlock | None = None, numerics: Numerics = FAST,
                 kernels: Kernels = TORCH) -> None:
        """mlp: an MLP already built (kept from a previous shard, or a sparse block); None builds the dense one.
        kernels: what computes the norms, rotary + KV write, decode attention and SwiGLU (services/model/kernels.py)."""
        p = f"model.layers.{layer_id}."
        d = spec.head_dim
        q_rows, kv_rows = _head_rows(wp.q_heads, d), _head_rows(wp.kv_heads, d)
        self.spec = spec
        self.num_q_heads, self.num_kv_heads = len(wp.q_heads), len(wp.kv_heads)
        self.input_norm = loader.full(p + "input_layernorm.weight")
        self.post_norm = loader.full(p + "post_attention_layernorm.weight")
        qkv = [(p + f"self_attn.{n}_proj", r) for n, r in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))]
        self.qkv = Linear(torch.cat([loader.rows(n + ".weight", r) for n, r in qkv]),  # [(Hq+2Hkv)_local*D, h]
                          torch.cat([loader.rows(n + ".bias", r) for n, r in qkv]) if spec.qkv_bias else None,
                          numerics=numerics)
        self.q_norm = loader.full(p + "self_attn.q_norm.weight") if spec.qk_norm else None
        self.k_norm = loader.full(p + "self_attn.k_norm.weight") if spec.qk_norm else None
        self.o_proj = RowParallelLinear(
            Linear(loader.cols(p + "self_attn.o_proj.weight", q_rows), numerics=numerics),
            loader.full(p + "self_attn.o_proj.bias") if spec.o_bias else None,
            group,
            reduction_pieces(numerics.head_bounds, wp.q_heads, d) if numerics.is_invariant else None,
        )
        self.kernels = kernels
        if numerics.is_invariant:
            self.attend = invariant_attention
        elif kernels.fused:
            self.attend = functools.partial(paged_attention, decode=kernels.decode_attention,
                                            prefill=kernels.prefill_attention)
        else:
            self.attend = paged_attention
        self.mlp = mlp if mlp is not None else DenseMLP(spec, wp, p, loader, group, numerics, kernels)

    def regrouped(self, group: TPGroup, mlp: DenseMLP | SparseMoeBlock | None = None) -> DecoderLayer:
        """The same attention weights (shared, not copied) reducing over another TP group; the dense MLP regrouped
        too, or the MLP replaced by `mlp` (required for a sparse layer: its group may be the EP group)."""
        if mlp is None and isinstance(self.mlp, SparseMoeBlock):
            raise ValueError("a sparse layer is regrouped with its new block (SparseMoeBlock.regrouped(moe_group))")
        layer = copy.copy(self)
        layer.o_proj = self.o_proj.regrouped(group)
        layer.mlp = mlp if mlp is not None else self.mlp.regrouped(group)
        return layer

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this step's K/V into `cache`."""
        x, delta = self.step(x, None, cos, sin, cache, meta)
        return x + delta

    def step(self, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
             cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on hidden state x + delta (delta: the previous layer's MLP output, not yet added, so that the
        add and this layer's first norm are one kernel; None: x alone) -> (its input x + delta, its MLP output).
        With T == 0 (an EP rank without requests this step) only the MLP runs: a sparse block must still join its
        stage's all-to-alls."""
        eps = self.spec.rms_norm_eps
        if not x.shape[0]:
            if isinstance(self.mlp, SparseMoeBlock):
                self.mlp(x)  # it may receive, compute and return peers' tokens
            return x, x
        x, h = self.kernels.add_rms_norm(x, delta, self.input_norm, eps)
        x, h = self.kernels.add_rms_norm(x, self._attention(h, cos, sin, cache, meta), self.post_norm, eps)
        return x, self.mlp(h, meta.write_rows) if isinstance(self.mlp, SparseMoeBlock) else self.mlp(h)

    def _attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
        """h: the normed hidden state [T, hidden] -> the attention block's output [T, hidden]."""
        spec, d, t = self.spec, self.spec.head_dim, h.shape[0]
        q = self.kernels.rotary_write_kv(self.qkv(h), self.num_q_heads, self.num_kv_heads, d, cos, sin, cache,
                                         meta.slot_mapping, meta.write_rows, self.q_norm, self.k_norm,
                                         spec.rms_norm_eps)  # [T, Hq_local, D]; K/V now in the cache
        attn = self.attend(q, cache, meta, d**-0.5, spec.sliding_window)  # [T, Hq_local, D]
        return self.o_proj(attn.reshape(t, self.num_q_heads * d))


class ShardedCausalLM:
    """This worker's part of the model: embedding (first stage), its layers, final norm + lm_head (last stage)."""

    def __init__(self, spec: ModelSpec, wp: WorkerPlacement, loader: ShardLoader, group: TPGroup,
                 previous: ShardedCausalLM | None = None, *, ep_group: TPGroup | None = None,
                 expert_maps: Mapping[int, Sequence[int]] | None = None,
                 expert_switch: ExpertSwitch = ALONGSIDE, numerics: Numerics = FAST,
                 kernels: Kernels = TORCH) -> None:
        """Build this worker's shard. With `previous` (a live reconfiguration), parts whose slice is unchanged —
        a layer's heads, its MLP columns, an expert slice held before, the same vocabulary rows — are kept, not
        copied again. In an EP layout `group` is a single-rank group (attention and dense MLPs are whole here) and
        `ep_group`, over the stage's ranks, carries the experts' all-to-alls. expert_maps: {sparse layer: phy2log}
        (None or a layer left out: the identity, possible only without redundant slots). expert_switch: how a
        sparse layer whose view changes gets its experts (by all-to-all with the stage's peers, a collective of the
        stage's ranks, or from `loader`) and whether `previous` lets go of them layer by layer (in place: then
        `previous` serves again only after its `restore_experts`). numerics: services/model/numerics.py (the
        mode must be the one `previous` was built with). kernels: services/model/kernels.py (likewise)."""
        if wp.ep_size > 1 and ep_group is None:
            raise ValueError(f"an EP layout (ep_size={wp.ep_size}) needs the stage's ep_group")
        self.spec = spec
        self.numerics = numerics
        self.kernels = kernels
        self.placement = wp
        self.dtype = loader.dtype
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim, loader.device, whole_vectors=numerics.is_invariant)
        self.expert_maps = _local_expert_maps(spec, wp, expert_maps)
        old = previous.placement if previous is not None else None
        same_vocab = old is not None and old.vocab_rows == wp.vocab_rows
        self.embed = None
        if wp.is_first_stage:
            if same_vocab and previous.embed is not None:  # same rows: share the tensor, new group
                self.embed = VocabParallelEmbedding(previous.embed.weight, wp.vocab_rows, group)
            else:
                self.embed = VocabParallelEmbedding(loader.rows(EMBED, wp.vocab_rows), wp.vocab_rows, group)
        # Kept parts share their tensors but get new wrappers (the new groups): the previous shard stays intact,
        # so a rolled-back switch can go on serving with it (but for the experts an in-place expert_switch took:
        # `restore_experts` first).
        old_layers = dict(zip(old.layers, previous.layers)) if old is not None else {}
        same_attention = old is not None and (old.q_heads, old.kv_heads) == (wp.q_heads, wp.kv_heads)
        same_dense = old is not None and old.intermediate == wp.intermediate
        moe_group = ep_group if wp.ep_size > 1 else group
        self.layers = [self._layer(i, loader, group, moe_group, old_layers.get(i), same_attention, same_dense,
                                   expert_switch) for i in wp.layers]
        self.final_norm = self.lm_head = None
        if wp.is_last_stage:
            kept_norm = previous.final_norm if previous is not None else None
            self.final_norm = kept_norm if kept_norm is not None else loader.full(FINAL_NORM)
            tied = spec.tie_word_embeddings or not loader.has(LM_HEAD)
            if same_vocab and previous.lm_head is not None:
                head = previous.lm_head.linear  # same rows: reuse them as they are (packed, maybe)
            elif tied and self.embed is not None:  # on this worker already: do not load it twice
                head = Linear(self.embed.weight, keep_weight=True, numerics=numerics)
            else:
                head = Linear(loader.rows(EMBED if tied else LM_HEAD, wp.vocab_rows), numerics=numerics)
            self.lm_head = ParallelLMHead(head, spec.vocab_size, group)

    def _layer(self, layer_id: int, loader: ShardLoader, group: TPGroup, moe_group: TPGroup,
               kept: DecoderLayer | None, same_attention: bool, same_dense: bool,
               expert_switch: ExpertSwitch = ALONGSIDE) -> DecoderLayer:
        """Layer `layer_id`, reusing what `kept` (the previous shard's same layer, if any) holds of it."""
        mlp: DenseMLP | SparseMoeBlock | None = None  # None: DecoderLayer builds the dense MLP
        if layer_id in self.spec.moe_layers:
            old_block = kept.mlp if kept is not None and isinstance(kept.mlp, SparseMoeBlock) else None
            mlp = SparseMoeBlock(self.spec, self.placement, layer_id, loader, moe_group,
                                 self.expert_maps[layer_id], previous=old_block, switch=expert_switch,
                                 numerics=self.numerics, kernels=self.kernels)
        elif kept is not None and same_dense:
            mlp = kept.mlp.regrouped(group)
        elif kept is not None and same_attention:
            mlp = DenseMLP(self.spec, self.placement, f"model.layers.{layer_id}.", loader, group, self.numerics,
                           self.kernels)
        if kept is not None and same_attention:
            return kept.regrouped(group, mlp)
        return DecoderLayer(self.spec, self.placement, layer_id, loader, group, mlp, self.numerics, self.kernels)

    def moe_blocks(self) -> dict[int, SparseMoeBlock]:
        """This shard's sparse layers, by global layer id (for the worker's load window and EPLB remaps)."""
        return {i: layer.mlp for i, layer in zip(self.placement.layers, self.layers)
                if isinstance(layer.mlp, SparseMoeBlock)}

    def restore_experts(self, loader: ShardLoader) -> list[int]:
        """Bring back the experts an in-place switch took from this shard (its rollback), from `loader`; returns
        the layers restored."""
        return [layer for layer, block in self.moe_blocks().items() if block.restore_experts(loader)]

    def forward(self, inputs: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """inputs: token ids [T] on the first stage, else hidden states [T, hidden]. Returns hidden [T, hidden].
        T may be 0 (an EP rank with no request this step): the sparse layers still join the stage's collectives."""
        x = self.embed(inputs) if self.embed is not None else inputs.to(self.dtype)
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        delta = None  # each layer's MLP output, added by the next layer's first kernel
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x, delta = layer.step(x, delta, cos, sin, cache, meta)
        return x + delta if delta is not None else x

    def forward_empty(self) -> torch.Tensor:
        """A step with no token on this rank while its stage has some (EP): run every sparse layer on nothing, so
        the all-to-alls of the stage match; returns hidden [0, hidden]."""
        x = torch.empty((0, self.spec.hidden_size), dtype=self.dtype, device=self.rotary.inv_freq.device)
        for block in self.moe_blocks().values():
            block(x)
        return x

    def pack_weights(self, piece: Callable[[], AbstractContextManager] = nullcontext) -> None:
        """Pack every linear layer's weight for MKL's GEMM, on the thread that runs the steps (Linear.pack), each
        inside `piece` (a staging build paces itself by them). The experts stay unpacked: EPLB hands their tensors
        to peers and replaces them between steps. Invariant numerics packs nothing: MKL's packed GEMM reduces in
        another order than F.linear, and one path keeps every product of a token's the same."""
        if self.numerics.is_invariant:
            return
        for linear in self._linears():
            with piece():
                linear.pack()

    def _linears(self) -> list[Linear]:
        linears = [self.lm_head.linear] if self.lm_head is not None else []
        for layer in self.layers:
            linears += [layer.qkv, layer.o_proj.linear]
            if isinstance(layer.mlp, DenseMLP):
                linears += [layer.mlp.gate_up, layer.mlp.down_proj.linear]
        return linears

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (last stage) -> float32 logits [N, vocab_size]."""
        assert self.lm_head is not None and self.final_norm is not None, "logits only on the last stage"
        normed = self.kernels.add_rms_norm(hidden, None, self.final_norm, self.spec.rms_norm_eps)[1]
        return self.lm_head(normed).float()

    def parameter_bytes(self) -> int:
        """Bytes of every parameter tensor this shard holds (a tensor shared by two layers counted once)."""
        return sum(t.numel() * t.element_size() for t in self.parameter_tensors().values())

    def parameter_tensors(self) -> dict[int, torch.Tensor]:
        """Every parameter tensor, by id (shared tensors once)."""
        tensors: dict[int, torch.Tensor] = {}
        modules: list[object] = [self, self.embed, self.lm_head, *self.layers, *self._linears()]
        for layer in self.layers:
            modules.append(layer.o_proj)
            if isinstance(layer.mlp, DenseMLP):
                modules.append(layer.mlp.down_proj)
            else:
                tensors.update({id(t): t for t in layer.mlp.parameter_tensors()})
        for module in filter(None, modules):  # a packed copy is the same parameter in another layout: not counted
            tensors.update({id(v): v for name, v in vars(module).items() if isinstance(v, torch.Tensor)
                            and name != "packed"})
        return tensors


def _local_expert_maps(spec: ModelSpec, wp: WorkerPlacement,
                       expert_maps: Mapping[int, Sequence[int]] | None) -> dict[int, tuple[int, ...]]:
    """The physical -> logical map of each sparse layer held here; the identity where none is given, which only
    fits a layout without redundant slots."""
    num_physical = len(wp.expert_slots) * wp.ep_size
    maps = {}
    for layer in (i for i in wp.layers if i in spec.moe_layers):
        if expert_maps is not None and layer in expert_maps:
            maps[layer] = tuple(expert_maps[layer])
        elif num_physical == spec.num_experts:
            maps[layer] = tuple(range(spec.num_experts))
        else:
            raise ValueError(f"layer {layer}: {num_physical} physical expert slots for {spec.num_experts} experts "
                             "need an expert map (phy2log)")
    return maps
