"""ModelSpec reads every supported config.json style and refuses the rest with a reason."""

from __future__ import annotations

import json

import pytest
import transformers

from services.model.spec import ModelSpec, ModelSpecError

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=100)


def _spec(config) -> ModelSpec:
    return ModelSpec.from_config(json.loads(config.to_json_string()))


def test_llama_gqa_and_llama3_rope():
    config = transformers.LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 1024})
    spec = _spec(config)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (4, 2, 16)
    assert spec.rope.rope_type == "llama3" and spec.rope.theta == 500000.0 and spec.rope.factor == 8.0
    assert not spec.qkv_bias and not spec.qk_norm


def test_legacy_rope_scaling_keys():
    spec = ModelSpec.from_config({**{"model_type": "llama", "num_attention_heads": 4}, **SMALL,
                                  "rope_theta": 1234.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert spec.rope.theta == 1234.0 and spec.rope.rope_type == "linear" and spec.rope.factor == 2.0


def test_qwen2_has_qkv_bias_and_no_o_bias():
    spec = _spec(transformers.Qwen2Config(**SMALL, tie_word_embeddings=True))
    assert spec.qkv_bias and not spec.o_bias and spec.tie_word_embeddings and spec.sliding_window is None


def test_qwen3_has_qk_norm_and_explicit_head_dim():
    spec = _spec(transformers.Qwen3Config(**SMALL, head_dim=32))
    assert spec.qk_norm and spec.head_dim == 32


def test_mistral_sliding_window():
    spec = _spec(transformers.MistralConfig(**SMALL, sliding_window=64))
    assert spec.model_type == "mistral" and spec.sliding_window == 64


def test_num_parameters_matches_transformers():
    for config in (transformers.LlamaConfig(**SMALL), transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),
                   transformers.Qwen3Config(**SMALL)):
        model = transformers.AutoModelForCausalLM.from_config(config)
        assert _spec(config).num_parameters == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("patch,message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope type 'yarn' is not supported"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
])
def test_unsupported_configs_say_why(patch, message):
    config = {"model_type": "llama", **SMALL, **patch}
    with pytest.raises(ModelSpecError, match=message):
        ModelSpec.from_config(config)


def test_missing_config_json(tmp_path):
    with pytest.raises(ModelSpecError, match="no config.json"):
        ModelSpec.from_dir(tmp_path)
