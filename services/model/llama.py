"""The Llama-family decoder, sharded by a WorkerPlacement: this worker's layers, heads, MLP columns, vocab rows."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from services.model.attention import AttentionMetadata, paged_attention, write_kv
from services.model.layers import (
    Linear,
    ParallelLMHead,
    RotaryEmbedding,
    RowParallelLinear,
    ShardLoader,
    TPGroup,
    VocabParallelEmbedding,
    apply_rotary,
    rms_norm,
)
from services.model.spec import ModelSpec
from services.topology import WorkerPlacement

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"


def _head_rows(heads: range, head_dim: int) -> range:
    return range(heads.start * head_dim, heads.stop * head_dim)


class DecoderLayer:
    """One transformer block holding only this TP rank's slice (q/kv heads, MLP columns)."""

    def __init__(self, spec: ModelSpec, wp: WorkerPlacement, layer_id: int, loader: ShardLoader,
                 group: TPGroup) -> None:
        p = f"model.layers.{layer_id}."
        d = spec.head_dim
        q_rows, kv_rows = _head_rows(wp.q_heads, d), _head_rows(wp.kv_heads, d)
        self.spec = spec
        self.num_q_heads, self.num_kv_heads = len(wp.q_heads), len(wp.kv_heads)
        self.input_norm = loader.full(p + "input_layernorm.weight")
        self.post_norm = loader.full(p + "post_attention_layernorm.weight")
        qkv = [(p + f"self_attn.{n}_proj", r) for n, r in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))]
        self.qkv = Linear(torch.cat([loader.rows(n + ".weight", r) for n, r in qkv]),  # [(Hq+2Hkv)_local*D, h]
                          torch.cat([loader.rows(n + ".bias", r) for n, r in qkv]) if spec.qkv_bias else None)
        self.q_norm = loader.full(p + "self_attn.q_norm.weight") if spec.qk_norm else None
        self.k_norm = loader.full(p + "self_attn.k_norm.weight") if spec.qk_norm else None
        self.o_proj = RowParallelLinear(
            Linear(loader.cols(p + "self_attn.o_proj.weight", q_rows)),
            loader.full(p + "self_attn.o_proj.bias") if spec.o_bias else None,
            group,
        )
        gate_up = [p + "mlp.gate_proj", p + "mlp.up_proj"]
        self.gate_up = Linear(
            torch.cat([loader.rows(n + ".weight", wp.intermediate) for n in gate_up]),  # [2 * I_local, h]
            torch.cat([loader.rows(n + ".bias", wp.intermediate) for n in gate_up]) if spec.mlp_bias else None,
        )
        self.down_proj = RowParallelLinear(
            Linear(loader.cols(p + "mlp.down_proj.weight", wp.intermediate)),
            loader.full(p + "mlp.down_proj.bias") if spec.mlp_bias else None,
            group,
        )

    def regrouped(self, group: TPGroup) -> DecoderLayer:
        """The same weights (shared, not copied) reducing over another TP group."""
        layer = copy.copy(self)
        layer.o_proj = self.o_proj.regrouped(group)
        layer.down_proj = self.down_proj.regrouped(group)
        return layer

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this step's K/V into `cache`."""
        spec, d, t = self.spec, self.spec.head_dim, x.shape[0]
        num_q, num_qk = self.num_q_heads, self.num_q_heads + self.num_kv_heads
        h = rms_norm(x, self.input_norm, spec.rms_norm_eps)
        qkv = self.qkv(h)  # [T, (Hq + 2 Hkv) * D]
        qk = qkv[:, : num_qk * d].view(t, num_qk, d)  # q and k heads side by side: one rotary for both
        v = qkv[:, num_qk * d:].view(t, self.num_kv_heads, d)
        if self.q_norm is not None:
            qk = torch.cat((rms_norm(qk[:, :num_q], self.q_norm, spec.rms_norm_eps),
                            rms_norm(qk[:, num_q:], self.k_norm, spec.rms_norm_eps)), dim=1)
        qk = apply_rotary(qk, cos, sin)
        q, k = qk[:, :num_q], qk[:, num_q:]
        write_kv(cache, k, v, meta.slot_mapping)
        attn = paged_attention(q, cache, meta, d**-0.5, spec.sliding_window)  # [T, Hq_local, D]
        x = x + self.o_proj(attn.reshape(t, num_q * d))
        h = rms_norm(x, self.post_norm, spec.rms_norm_eps)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class ShardedCausalLM:
    """This worker's part of the model: embedding (first stage), its layers, final norm + lm_head (last stage)."""

    def __init__(self, spec: ModelSpec, wp: WorkerPlacement, loader: ShardLoader, group: TPGroup,
                 previous: ShardedCausalLM | None = None) -> None:
        """Build this worker's shard. With `previous` (a live reconfiguration), parts whose slice is unchanged —
        a layer with the same heads and MLP columns, the same vocabulary rows — are kept, not copied again."""
        self.spec = spec
        self.placement = wp
        self.dtype = loader.dtype
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim, loader.device)
        old = previous.placement if previous is not None else None
        same_vocab = old is not None and old.vocab_rows == wp.vocab_rows
        self.embed = None
        if wp.is_first_stage:
            if same_vocab and previous.embed is not None:  # same rows: share the tensor, new group
                self.embed = VocabParallelEmbedding(previous.embed.weight, wp.vocab_rows, group)
            else:
                self.embed = VocabParallelEmbedding(loader.rows(EMBED, wp.vocab_rows), wp.vocab_rows, group)
        kept = {}
        if old is not None and (old.q_heads, old.kv_heads, old.intermediate) == (wp.q_heads, wp.kv_heads,
                                                                                   wp.intermediate):
            kept = dict(zip(old.layers, previous.layers))
        # Kept layers share their tensors but get new row-parallel wrappers (the new TP group): the previous
        # shard stays intact, so a rolled-back switch can go on serving with it.
        self.layers = [kept[i].regrouped(group) if i in kept else DecoderLayer(spec, wp, i, loader, group)
                       for i in wp.layers]
        self.final_norm = self.lm_head = None
        if wp.is_last_stage:
            self.final_norm = loader.full(FINAL_NORM)
            tied = spec.tie_word_embeddings or not loader.has(LM_HEAD)
            if same_vocab and previous.lm_head is not None:
                head = previous.lm_head.linear  # same rows: reuse them as they are (packed, maybe)
            elif tied and self.embed is not None:
                head = Linear(self.embed.weight, keep_weight=True)  # on this worker already: do not load it twice
            else:
                head = Linear(loader.rows(EMBED if tied else LM_HEAD, wp.vocab_rows))
            self.lm_head = ParallelLMHead(head, spec.vocab_size, group)

    def forward(self, inputs: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """inputs: token ids [T] on the first stage, else hidden states [T, hidden]. Returns hidden [T, hidden]."""
        x = self.embed(inputs) if self.embed is not None else inputs.to(self.dtype)
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, cache, meta)
        return x

    def pack_weights(self) -> None:
        """Pack every linear layer's weight for MKL's GEMM, on the thread that runs the steps (Linear.pack)."""
        for linear in self._linears():
            linear.pack()

    def _linears(self) -> list[Linear]:
        linears = [self.lm_head.linear] if self.lm_head is not None else []
        for layer in self.layers:
            linears += [layer.qkv, layer.o_proj.linear, layer.gate_up, layer.down_proj.linear]
        return linears

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (last stage) -> float32 logits [N, vocab_size]."""
        assert self.lm_head is not None and self.final_norm is not None, "logits only on the last stage"
        return self.lm_head(rms_norm(hidden, self.final_norm, self.spec.rms_norm_eps)).float()

    def parameter_bytes(self) -> int:
        """Bytes of every parameter tensor this shard holds (a tensor shared by two layers counted once)."""
        return sum(t.numel() * t.element_size() for t in self.parameter_tensors().values())

    def parameter_tensors(self) -> dict[int, torch.Tensor]:
        """Every parameter tensor, by id (shared tensors once)."""
        tensors: dict[int, torch.Tensor] = {}
        modules: list[object] = [self, self.embed, self.lm_head, *self.layers, *self._linears()]
        for layer in self.layers:
            modules += [layer.o_proj, layer.down_proj]
        for module in filter(None, modules):  # a packed copy is the same parameter in another layout: not counted
            tensors.update({id(v): v for name, v in vars(module).items() if isinstance(v, torch.Tensor)
                            and name != "packed"})
        return tensors
