"""GGUF → Hugging Face checkpoint, offline: a tiny GGUF written here round-trips to the state dict it encodes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from services.model.gguf_convert import convert_gguf, hf_tensor_name, unpermute_rotary_rows
from services.model.spec import ModelSpec
from services.model.tokenizer import Tokenizer
from tests.conftest import TINY_GGUF_CHAT_TEMPLATE, llama_cpp_rotary_order, write_tiny_gguf


@pytest.mark.parametrize("num_heads,head_dim", [(1, 2), (9, 64), (3, 64), (4, 16)])
def test_unpermute_inverts_llama_cpp_rotary_order(num_heads: int, head_dim: int) -> None:
    weight = torch.randn(num_heads * head_dim, 5)
    assert torch.equal(unpermute_rotary_rows(llama_cpp_rotary_order(weight, num_heads), num_heads), weight)


def test_tensor_names() -> None:
    assert hf_tensor_name("blk.17.attn_q.weight") == "model.layers.17.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    for unknown in ("rope_freqs.weight", "blk.0.ffn_gate_exps.weight", "blk.x.attn_q.weight"):
        with pytest.raises(ValueError, match="no Llama counterpart"):
            hf_tensor_name(unknown)


def test_tiny_gguf_converts_to_the_checkpoint_it_encodes(tmp_path) -> None:
    expected = write_tiny_gguf(tmp_path / "tiny.gguf")
    progress = []
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", lambda done, total, name: progress.append((done, total)),
                 extra_config={"reconfig_preset": "tiny-gguf"})
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[name], expected[name]) for name in expected)
    assert progress == [(done, len(expected)) for done in range(1, len(expected) + 1)]

    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["reconfig_preset"] == "tiny-gguf"
    assert (config["rope_theta"], config["rms_norm_eps"], config["max_position_embeddings"]) == (50000.0, 1e-6, 512)
    spec = ModelSpec.from_dir(tmp_path / "out")
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (2, 4, 2, 16, 259)

    tokenizer = Tokenizer.from_dir(tmp_path / "out")
    bos, eos = 257, 258
    assert (tokenizer.bos_token_id, tokenizer.is_bos_added, tokenizer.eos_token_ids) == (bos, True, frozenset({eos}))
    ids = tokenizer.encode("a test</s>")
    assert ids == [bos, ord("a"), 256, ord("e"), ord("s"), ord("t"), eos]  # " t" merged; </s> is one token
    assert tokenizer.decode(ids) == "a test" and tokenizer.chat_template == TINY_GGUF_CHAT_TEMPLATE


def test_other_architectures_are_refused(tmp_path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'mamba' is not supported"):
        convert_gguf(tmp_path / "mamba.gguf", tmp_path / "out")
