"""Shared test factories: small Hugging Face checkpoints of each supported style, and the transformers oracle."""

from __future__ import annotations

import os

import math
from pathlib import Path

import pytest
import torch

# Styles the core must reproduce: Llama (GQA), Qwen2 (qkv bias, tied embeddings), Qwen3 (q/k norm).
CHECKPOINT_STYLES = ("llama", "qwen2", "qwen3")


def _config(style: str):
    import transformers

    common = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=264, max_position_embeddings=256, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, pad_token_id=None,
    )
    if style == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False)
    if style == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False)
    if style == "mistral":  # a window shorter than the test sequences, so it actually masks
        return transformers.MistralConfig(**common, tie_word_embeddings=False, sliding_window=6)
    if style == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)
    raise ValueError(style)


def _decisive_init(model: torch.nn.Module, seed: int) -> None:
    """Re-initialize so logits are peaked: a 0.02-std init gives near-ties that float rounding flips."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.ndim == 1:
                noise = torch.randn(param.shape, generator=generator) * (0.1 if "norm" in name else 0.5)
                param.copy_((1.0 if "norm" in name else 0.0) + noise)
            elif "embed" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
            else:
                fan_in = param.shape[1]
                scale = 2.0 if "lm_head" in name else 1.0
                param.copy_(torch.randn(param.shape, generator=generator) * scale / math.sqrt(fan_in))


def make_checkpoint(directory: Path, style: str, seed: int = 0) -> Path:
    """Save a small random checkpoint of `style` in Hugging Face format (float32 safetensors)."""
    import transformers

    config = _config(style)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _decisive_init(model, seed)
    model.save_pretrained(directory, safe_serialization=True)
    from services.model.tokenizer import write_tokenizer_files

    write_tokenizer_files(directory, config.max_position_embeddings)  # a checkpoint directory has a tokenizer
    return directory


def process_running(pid: int) -> bool:
    """Whether `pid` runs (a zombie awaiting its parent's wait() does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shared_memory():
    """The suite as a whole leaves no weight-store segment behind: no new segment outlives its owner process.
    (Segments of live processes belong to stores still running, possibly outside this test run.)"""
    from services.weightstore.shm import is_process_alive, list_segments, owner_pid
    from services.worker.kv_cache import KV_SEGMENT_PREFIX

    def segments() -> set[tuple[str, str]]:
        return {(prefix, name) for prefix in ("reconfig-ws-", KV_SEGMENT_PREFIX) for name in list_segments(prefix)}

    before = segments()
    yield
    # Dead owners leaked; so did this process (an in-process cache a test never closed outlives the suite).
    leaked = [name for prefix, name in segments() - before
              if (pid := owner_pid(name, prefix)) is not None and (not is_process_alive(pid) or pid == os.getpid())]
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"


@pytest.fixture(scope="session", params=CHECKPOINT_STYLES)
def hf_checkpoint(request, tmp_path_factory) -> Path:
    """A checkpoint directory per style, made once per session."""
    return make_checkpoint(tmp_path_factory.mktemp(f"ckpt-{request.param}"), request.param)


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The oracle: transformers greedy generate per prompt; returns new tokens and the logits of each step."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    # No EOS: run exactly max_new_tokens without suppressing EOS (min_new_tokens would mask its logit, which
    # the engine under test does not do).
    model.generation_config.eos_token_id = None
    tokens, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )
            tokens.append(out.sequences[0, len(prompt):].tolist())
            logits.append(torch.stack([step[0] for step in out.logits]))  # [steps, vocab]
    return tokens, logits
