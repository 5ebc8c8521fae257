"""One sparse layer's router and experts, random, for the block's tests (tests/model/test_moe.py, test_triton_moe.py):
HIDDEN features, NUM_EXPERTS experts of EXPERT_SIZE, top-TOP_K."""

from __future__ import annotations

import torch

from services.model.spec import ModelSpec
from services.topology.experts import expert_tensor_names, router_tensor_name

HIDDEN, NUM_EXPERTS, TOP_K, EXPERT_SIZE = 32, 8, 2, 16


def block_spec(style: str) -> ModelSpec:
    config = {"model_type": style, "hidden_size": HIDDEN, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 64, "num_experts_per_tok": TOP_K}
    if style == "mixtral":
        return ModelSpec.from_config({**config, "intermediate_size": EXPERT_SIZE, "num_local_experts": NUM_EXPERTS})
    return ModelSpec.from_config({**config, "intermediate_size": 64, "num_experts": NUM_EXPERTS,
                                  "moe_intermediate_size": EXPERT_SIZE, "norm_topk_prob": True})


def block_tensors(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {router_tensor_name(spec.moe_style, 0): torch.randn(NUM_EXPERTS, HIDDEN, generator=generator)}
    for expert in range(NUM_EXPERTS):
        gate, up, down = expert_tensor_names(spec.moe_style, 0, expert)
        tensors[gate] = torch.randn(EXPERT_SIZE, HIDDEN, generator=generator) / HIDDEN**0.5
        tensors[up] = torch.randn(EXPERT_SIZE, HIDDEN, generator=generator) / HIDDEN**0.5
        tensors[down] = torch.randn(HIDDEN, EXPERT_SIZE, generator=generator) / EXPERT_SIZE**0.5
    return tensors


def tokens(spec: ModelSpec, tensors, count: int, seed: int, hot_expert: int | None) -> torch.Tensor:
    """count hidden rows; with hot_expert, pushed toward that expert's router row (a skewed load)."""
    x = torch.randn(count, HIDDEN, generator=torch.Generator().manual_seed(seed))
    if hot_expert is not None:
        row = tensors[router_tensor_name(spec.moe_style, 0)][hot_expert]
        x += 3 * row / row.norm()
    return x
