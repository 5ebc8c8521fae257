"""The tiny-moe preset: a Qwen3-MoE checkpoint that transformers loads, decoding and routing decisively, and that
the engine's tp1 model reproduces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from services.model import presets
from services.model.attention import AttentionMetadata
from services.model.layers import ShardLoader, SingleRankGroup
from services.model.llama import ShardedCausalLM
from services.model.presets import PRESETS, ensure_preset, preset_param_count
from services.model.spec import ModelSpec
from services.model.tokenizer import BOS_TOKEN_ID, NUM_TOKENS, PAD_TOKEN_ID, Tokenizer
from services.topology import Topology, place

PROMPTS = ("Hello, world!", "The quick brown fox", "你好, 世界 😀")
NUM_STEPS = 12


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_preset("tiny-moe", tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def hf_model(moe_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.dtype == torch.float32
    model.generation_config.eos_token_id = None
    return model.eval()


def test_config_shapes_and_parameter_count(moe_dir: Path) -> None:
    spec = ModelSpec.from_dir(moe_dir)
    assert spec.moe_style == "qwen3_moe" and spec.moe_layers == (1, 2, 3) and spec.norm_topk_prob
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (8, 2, 256)
    assert json.loads((moe_dir / "config.json").read_text())["reconfig_preset"] == "tiny-moe"
    with safe_open(moe_dir / "model.safetensors", framework="pt") as checkpoint:
        shapes = {name: tuple(checkpoint.get_slice(name).get_shape()) for name in checkpoint.keys()}
    assert shapes == presets.preset_tensor_shapes(PRESETS["tiny-moe"])
    assert sum(torch.Size(s).numel() for s in shapes.values()) == preset_param_count("tiny-moe") \
        == spec.num_parameters


def test_builds_are_byte_identical(moe_dir: Path, tmp_path: Path) -> None:
    other = ensure_preset("tiny-moe", tmp_path)
    assert (other / "model.safetensors").read_bytes() == (moe_dir / "model.safetensors").read_bytes()


@torch.no_grad()
def test_greedy_decoding_and_routing_are_decisive(hf_model: torch.nn.Module, moe_dir: Path) -> None:
    gaps: list[torch.Tensor] = []  # per token and sparse layer: k-th minus (k+1)-th router probability

    def record(module, args, output) -> None:
        probs = output[0].float().softmax(dim=-1).topk(module.top_k + 1, dim=-1).values
        gaps.append(probs[:, -2] - probs[:, -1])

    hooks = [layer.mlp.gate.register_forward_hook(record) for layer in hf_model.model.layers
             if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "top_k")]
    assert len(hooks) == 3
    tokenizer = Tokenizer.from_dir(moe_dir)
    try:
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt)
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=NUM_STEPS, do_sample=False,
                                    pad_token_id=PAD_TOKEN_ID, output_logits=True, return_dict_in_generate=True)
            top2 = torch.stack(out.logits)[:, 0].topk(2, dim=-1).values
            assert (top2[:, 0] - top2[:, 1]).min() > 1e-3, prompt
            tokens = out.sequences[0, len(ids):].tolist()
            assert all(t < NUM_TOKENS and t not in (BOS_TOKEN_ID, PAD_TOKEN_ID) for t in tokens)
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.cat(gaps).min() > 1e-4  # no top-k choice that rounding could flip


@torch.no_grad()
def test_tp1_logits_equal_transformers(hf_model: torch.nn.Module, moe_dir: Path) -> None:
    spec = ModelSpec.from_dir(moe_dir)
    tensors = load_file(moe_dir / "model.safetensors")
    loader = ShardLoader(tensors.__getitem__, set(tensors), torch.float32, torch.device("cpu"))
    model = ShardedCausalLM(spec, place(Topology(1, 1), spec.shape).workers[0], loader, SingleRankGroup())
    ids = Tokenizer.from_dir(moe_dir).encode(PROMPTS[1])
    caches = [torch.zeros(2, 8, 16, spec.num_kv_heads, spec.head_dim) for _ in range(spec.num_layers)]
    meta = AttentionMetadata.build([0], [len(ids)], [[4, 1]], 16, torch.device("cpu"))
    hidden = model.forward(torch.tensor(ids), torch.arange(len(ids)), caches, meta)
    expected = hf_model(torch.tensor([ids])).logits[0]  # [T, vocab]
    torch.testing.assert_close(model.compute_logits(hidden), expected, atol=1e-4, rtol=0)
