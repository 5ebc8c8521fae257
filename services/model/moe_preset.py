"""The mixture-of-experts part of a generated preset: a Qwen3-MoE layout (softmax router, top-k, q/k norm, dense
layers through mlp_only_layers), its config.json keys and its tensors' shapes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from services.topology.experts import expert_tensor_names, router_tensor_name

STYLE = "qwen3_moe"
# Router weights of std _ROUTER_GAIN/sqrt(hidden) give router logits of std ~_ROUTER_GAIN: the top-k choice is
# clear-cut (no near-ties for float rounding to flip) while the second expert still gets a real share.
_ROUTER_GAIN = 2.0


@dataclass(slots=True, frozen=True)
class MoePreset:
    """The sparse layers of a preset: every layer but mlp_only_layers routes each token to num_experts_per_tok of
    num_experts SwiGLU experts of moe_intermediate_size."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size < 1:
            raise ValueError(f"MoePreset needs 1 <= num_experts_per_tok <= num_experts and moe_intermediate_size "
                             f">= 1, got {self.num_experts_per_tok}, {self.num_experts}, {self.moe_intermediate_size}")

    def is_sparse(self, layer: int) -> bool:
        """Whether a layer has the routed experts (else the dense MLP of intermediate_size)."""
        return layer not in self.mlp_only_layers

    def config_fields(self) -> dict[str, Any]:
        """The config.json keys of Qwen3MoeForCausalLM on top of the Llama ones."""
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": STYLE,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "mlp_only_layers": list(self.mlp_only_layers),
            "decoder_sparse_step": 1,
            "norm_topk_prob": self.norm_topk_prob,
            "use_sliding_window": False,
            "sliding_window": None,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        }

    def layer_shapes(self, layer: int, hidden_size: int, head_dim: int) -> dict[str, tuple[int, ...]]:
        """Shapes of a layer's q/k norms and, if sparse, its router and experts (checkpoint names)."""
        prefix = f"model.layers.{layer}."
        shapes: dict[str, tuple[int, ...]] = {prefix + "self_attn.q_norm.weight": (head_dim,),
                                              prefix + "self_attn.k_norm.weight": (head_dim,)}
        if self.is_sparse(layer):
            shapes[router_tensor_name(STYLE, layer)] = (self.num_experts, hidden_size)
            for expert in range(self.num_experts):
                gate, up, down = expert_tensor_names(STYLE, layer, expert)
                shapes |= {gate: (self.moe_intermediate_size, hidden_size),
                           up: (self.moe_intermediate_size, hidden_size),
                           down: (hidden_size, self.moe_intermediate_size)}
        return shapes


def router_std(tensor_name: str, hidden_size: int) -> float | None:
    """The init std of a router weight; None for any other tensor."""
    return _ROUTER_GAIN / math.sqrt(hidden_size) if tensor_name.endswith(".mlp.gate.weight") else None
