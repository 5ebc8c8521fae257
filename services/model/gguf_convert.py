"""A Llama GGUF file → a Hugging Face checkpoint directory: fp32 safetensors, config.json, tokenizer files.

Quantized tensors are dequantized to float32, which holds every Q4/Q8 value (a float16 scale times a small integer
plus a float16 offset) exactly; bfloat16 would round them. The only layout change is the rotary one: llama.cpp
stores the rows of q_proj and k_proj permuted (below), which is undone here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# GGUF tensor name (without "blk.N.") → Hugging Face name (without "model.layers.N.").
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_CONTROL_TOKEN, _USER_DEFINED_TOKEN = 3, 4
# tokenizer.ggml.pre (llama.cpp's pre-tokenizer name) → splits applied before the byte-level GPT-2 regex.
_PRE_TOKENIZER_SPLITS: dict[str, list[pre_tokenizers.PreTokenizer]] = {
    "default": [],
    "gpt2": [],
    "smollm": [pre_tokenizers.Digits(individual_digits=True)],  # every digit is a word of its own
}

TensorCallback = Callable[[int, int, str], None]  # (tensors done, total, name of the last one)


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key-value field of the file as Python values (arrays as lists)."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row order of q_proj/k_proj: [heads * head_dim, hidden] in GGUF order → Hugging Face order.

    Hugging Face rotates row i of a head together with row i + head_dim/2 (rotate_half); ggml rotates adjacent
    rows 2i and 2i + 1, so llama.cpp's converter stores HF row j * head_dim/2 + i at 2i + j."""
    rows, hidden = weight.shape
    half = rows // num_heads // 2
    # [heads, half, 2, hidden] (GGUF: pair index i, then j) → [heads, 2, half, hidden] (HF: j, then i)
    return weight.reshape(num_heads, half, 2, hidden).transpose(1, 2).reshape(rows, hidden)


def hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` → `model.layers.3.self_attn.q_proj.weight`; unknown tensors are refused."""
    stem, _, kind = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 1 and stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{kind}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama counterpart (unsupported variant)")


def _float32_value(value: float) -> float:
    """A float32 metadata value as its shortest decimal (9.9999997e-06 → 1e-05), as the original config wrote it."""
    return float(str(np.float32(value)))


def hf_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """config.json (LlamaForCausalLM) from the file's `llama.*` and `tokenizer.ggml.*` keys."""
    architecture = metadata["general.architecture"]
    if architecture != "llama":
        raise ValueError(f"GGUF architecture {architecture!r} is not supported (llama only)")

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"llama.{name}", default)

    if key("rope.scaling.type", "none") not in ("none", "linear") or key("rope.scaling.factor", 1.0) != 1.0:
        raise ValueError("GGUF rope scaling is not supported")
    hidden_size, num_heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden_size // num_heads))
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("partial rotary embeddings are not supported")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "vocab_size": int(key("vocab_size", len(metadata["tokenizer.ggml.tokens"]))),
        "max_position_embeddings": int(key("context_length")),
        "rope_theta": _float32_value(key("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "hidden_act": "silu",
        "rms_norm_eps": _float32_value(key("attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": True,  # set by convert_gguf from whether output.weight exists
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }


def build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """The byte-level BPE tokenizer (`tokenizer.ggml.model == "gpt2"`) from the file's vocabulary and merges."""
    if metadata.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"GGUF tokenizer {metadata.get('tokenizer.ggml.model')!r} is not supported (gpt2 BPE only)")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZER_SPLITS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported ({', '.join(_PRE_TOKENIZER_SPLITS)})")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*_PRE_TOKENIZER_SPLITS[pre], byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    token_types = metadata.get("tokenizer.ggml.token_type", [])
    # Control and user-defined tokens match as whole strings before BPE (they keep their ids).
    tokenizer.add_tokens([
        AddedToken(tokens[i], special=kind == _CONTROL_TOKEN, normalized=False)
        for i, kind in enumerate(token_types) if kind in (_CONTROL_TOKEN, _USER_DEFINED_TOKEN)
    ])
    tokenizer.post_processor = _special_token_template(metadata, tokens)
    return tokenizer


def _special_token_template(metadata: dict[str, Any], tokens: list[str]) -> processors.PostProcessor | None:
    """bos/eos added around the text when the file asks for them (`tokenizer.ggml.add_{bos,eos}_token`)."""
    added = [(role, metadata[f"tokenizer.ggml.{role}_token_id"]) for role in ("bos", "eos")
             if metadata.get(f"tokenizer.ggml.add_{role}_token") and f"tokenizer.ggml.{role}_token_id" in metadata]
    if not added:
        return None
    by_role = {role: tokens[token_id] for role, token_id in added}
    single = " ".join(filter(None, [by_role.get("bos"), "$A", by_role.get("eos")]))
    pair = " ".join(filter(None, [single, "$B:1"]))
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=[(tokens[token_id], token_id) for _, token_id in added])


def tokenizer_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: special tokens by name, whether bos is added, and the chat template."""
    tokens = metadata["tokenizer.ggml.tokens"]

    def token(role: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{role}_token_id")
        return tokens[token_id] if token_id is not None else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(metadata.get("llama.context_length", 2048)),
        "chat_template": metadata.get("tokenizer.chat_template"),
    }


def convert_tensors(reader: GGUFReader, config: dict[str, Any],
                    on_tensor: TensorCallback | None = None) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32 under its Hugging Face name, rotary rows in Hugging Face order."""
    heads = {"self_attn.q_proj": config["num_attention_heads"], "self_attn.k_proj": config["num_key_value_heads"]}
    tensors = {}
    for index, tensor in enumerate(reader.tensors, start=1):
        name = hf_tensor_name(tensor.name)
        weight = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), np.float32))  # a copy
        for projection, num_heads in heads.items():
            if name.endswith(f"{projection}.weight"):
                weight = unpermute_rotary_rows(weight, num_heads)
        tensors[name] = weight.contiguous()
        if on_tensor is not None:
            on_tensor(index, len(reader.tensors), tensor.name)
    return tensors


def convert_gguf(gguf_path: Path, directory: Path, on_tensor: TensorCallback | None = None,
                 extra_config: dict[str, Any] | None = None) -> None:
    """Write a Hugging Face Llama checkpoint (config, fp32 model.safetensors, tokenizer) converted from `gguf_path`."""
    reader = GGUFReader(gguf_path)
    metadata = read_metadata(reader)
    config = hf_config(metadata)
    tensors = convert_tensors(reader, config, on_tensor)
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    config.update(extra_config or {})
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (directory / "generation_config.json").write_text(json.dumps({**generation, "do_sample": False}, indent=2) + "\n")
    build_tokenizer(metadata).save(str(directory / "tokenizer.json"), pretty=True)
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(metadata), indent=2) + "\n")

