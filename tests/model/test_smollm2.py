"""smollm2-135m: our GGUF conversion equals transformers' GGUF loader, tensor for tensor and token for token."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from services.model.spec import ModelSpec
from services.model.tokenizer import Tokenizer
from services.topology import Topology, TopologyError, candidate_topologies, validate

TEXTS = (
    "Hello, world!", "What is the capital of France?", "  leading spaces\tand tabs\n\n\nnewlines  ",
    "1234567890 3.14159 2024-11-24 x^2+y=42", "你好, 世界 😀 🇫🇷", "don't can't we'll I'M they've",
    "def f(x):\n    return x**2  # comment", "Ünïcödé çàfé naïve Ωμέγα Привет",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "a<|im_end|>b <repo_name>c",
)
CONVERSATIONS = (
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "2+2?"}],
)


def test_tensors_equal_transformers_gguf_loader(smollm2, smollm2_gguf) -> None:
    import transformers

    model_dir, gguf = smollm2, smollm2_gguf
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32).state_dict()
    ours = load_file(model_dir / "model.safetensors")
    assert set(reference) - set(ours) == {"lm_head.weight"}  # tied: transformers shares the embedding
    assert set(ours) <= set(reference)
    assert torch.equal(reference["lm_head.weight"], ours["model.embed_tokens.weight"])
    differing = [name for name, tensor in ours.items()
                 if tensor.dtype != torch.float32 or not torch.equal(tensor, reference[name])]
    assert not differing, f"{len(differing)} tensors differ, e.g. {differing[:3]}"


def test_tokenizer_and_chat_template_equal_transformers_gguf_tokenizer(smollm2, smollm2_gguf) -> None:
    import transformers

    model_dir, gguf = smollm2, smollm2_gguf
    reference = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ours = Tokenizer.from_dir(model_dir)
    reloaded = transformers.AutoTokenizer.from_pretrained(model_dir)  # our files, read by transformers
    for text in TEXTS:
        ids = reference.encode(text, add_special_tokens=True)
        assert ours.encode(text) == ids == reloaded.encode(text, add_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids) == text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert reloaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == expected
    assert ours.chat_template == reference.chat_template
    assert (ours.bos_token_id, ours.is_bos_added, ours.eos_token_ids) == (1, False, frozenset({2}))  # <|im_end|>


def test_numeric_characters_split_as_the_file_declares(smollm2) -> None:
    """`tokenizer.ggml.pre = "smollm"`: llama.cpp (and the original tokenizer's Digits step) makes every \\p{N}
    character a word of its own. transformers' GGUF loader ignores that key, so only here may it differ from us:
    ASCII digits agree (the vocabulary has no multi-digit token), " ½" does not."""
    tokens = Tokenizer.from_dir(smollm2).backend.encode(" 12 ½ x²", add_special_tokens=False).tokens
    assert tokens == ["Ġ", "1", "2", "Ġ", "Â½", "Ġx", "Â²"]


def test_config_and_the_layouts_it_allows(smollm2) -> None:
    model_dir = smollm2
    config = json.loads((model_dir / "config.json").read_text())
    assert config["reconfig_source"]["gguf_sha256"].startswith("b179c952")
    spec = ModelSpec.from_dir(model_dir)
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.hidden_size) == (30, 9, 3, 576)
    assert spec.tie_word_embeddings and spec.rms_norm_eps == 1e-5 and spec.max_position_embeddings == 8192
    # The README's reason for the default: on 4 workers, tp must be 1 or 3; tp1pp4 is the one using all four.
    allowed = [str(topology) for topology in candidate_topologies(spec.shape, 4)]
    assert allowed == ["tp1pp1", "tp1pp2", "tp1pp3", "tp3pp1", "tp1pp4"]
    with pytest.raises(TopologyError, match="tp=2 does not divide num_heads=9"):
        validate(Topology.parse("tp2pp2"), spec.shape, 4)
