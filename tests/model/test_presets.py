"""Built-in presets: deterministic, atomic, cached builds that transformers loads and decodes decisively."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from services.model import presets
from services.model.presets import PRESETS, ensure_preset, preset_param_count, resolve_model
from services.model.tokenizer import BOS_TOKEN_ID, NUM_TOKENS, PAD_TOKEN_ID, Tokenizer

# sha256 of tiny-llama-v1/model.safetensors: the bytes must not depend on machine, thread count or run.
TINY_LLAMA_SHA256 = "1bb60f3bdb3494eb396a9c8d1c90a67877dc0bc326f9f3a2258c13b8da4dbeee"
PROMPTS = ("Hello, world!", "The quick brown fox", "你好, 世界 😀")
NUM_GREEDY_STEPS = 16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_preset("tiny-llama", tmp_path_factory.mktemp("cache"))


def _file_hashes(directory: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.iterdir())}


def test_tiny_llama_checkpoint_files_and_config(tiny_dir: Path) -> None:
    assert tiny_dir.name == "tiny-llama-v1" and tiny_dir.parent.name == "models"
    assert sorted(path.name for path in tiny_dir.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]
    config = json.loads((tiny_dir / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": 320, "max_position_embeddings": 2048, "rope_theta": 10000.0,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "torch_dtype": "float32", "bos_token_id": 256, "eos_token_id": 257,
        "pad_token_id": None, "reconfig_preset": "tiny-llama", "reconfig_preset_version": 1,
    }
    assert {key: config[key] for key in expected} == expected
    with safe_open(tiny_dir / "model.safetensors", framework="pt") as checkpoint:
        shapes = {name: tuple(checkpoint.get_slice(name).get_shape()) for name in checkpoint.keys()}
        assert {checkpoint.get_slice(name).get_dtype() for name in checkpoint.keys()} == {"F32"}
    assert shapes == presets.preset_tensor_shapes(PRESETS["tiny-llama"])
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (2 * 32, 256)


def test_param_counts() -> None:
    assert 2_000_000 <= preset_param_count("tiny-llama") <= 6_000_000
    assert preset_param_count("llama-135m") >= 100_000_000
    with pytest.raises(ValueError, match="tiny-llama, llama-135m"):
        preset_param_count("gpt-5")


def test_param_count_matches_built_tensors(tiny_dir: Path) -> None:
    with safe_open(tiny_dir / "model.safetensors", framework="pt") as checkpoint:
        num_params = sum(checkpoint.get_tensor(name).numel() for name in checkpoint.keys())
    assert num_params == preset_param_count("tiny-llama")


def test_llama_135m_config_has_llama3_rope_and_bfloat16() -> None:
    from transformers import LlamaConfig

    config = presets.preset_config(PRESETS["llama-135m"])
    assert config["torch_dtype"] == "bfloat16" and config["num_key_value_heads"] == 4
    parsed = LlamaConfig.from_dict(config)
    rope = getattr(parsed, "rope_parameters", None) or parsed.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    assert rope["original_max_position_embeddings"] == 1024


def test_second_call_reuses_the_build(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = (tiny_dir / "model.safetensors").stat().st_mtime_ns

    def fail(*args: object) -> None:
        raise AssertionError("preset rebuilt")

    monkeypatch.setattr(presets, "_write_preset", fail)
    assert ensure_preset("tiny-llama", tiny_dir.parent.parent) == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == before


def test_builds_are_byte_identical_and_pinned(tiny_dir: Path, tmp_path: Path) -> None:
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a different thread count must not change a byte
    try:
        other = ensure_preset("tiny-llama", tmp_path)
    finally:
        torch.set_num_threads(num_threads)
    assert other != tiny_dir
    assert _file_hashes(other) == _file_hashes(tiny_dir)
    assert _file_hashes(tiny_dir)["model.safetensors"] == TINY_LLAMA_SHA256


def test_cache_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECONFIG_CACHE_DIR", str(tmp_path))
    assert ensure_preset("tiny-llama") == tmp_path / "models" / "tiny-llama-v1"


def test_lost_race_uses_the_winners_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = presets._write_preset
    target = tmp_path / "models" / "tiny-llama-v1"

    def write_while_another_process_finishes(spec: presets.PresetSpec, directory: Path) -> None:
        real_write(spec, directory)
        real_write(spec, target)  # the other process renames its build into place first
        (target / "winner").touch()

    monkeypatch.setattr(presets, "_write_preset", write_while_another_process_finishes)
    assert ensure_preset("tiny-llama", tmp_path) == target
    assert (target / "winner").exists()
    assert [path.name for path in (tmp_path / "models").iterdir()] == ["tiny-llama-v1"]  # staging removed


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(spec: presets.PresetSpec) -> dict[str, torch.Tensor]:
        raise RuntimeError("disk full")

    monkeypatch.setattr(presets, "preset_tensors", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_preset("tiny-llama", tmp_path)
    assert list((tmp_path / "models").iterdir()) == []


def test_unknown_preset_lists_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny-llama, llama-135m"):
        ensure_preset("llama-70b", tmp_path)


def test_resolve_model(tiny_dir: Path, tmp_path: Path) -> None:
    assert resolve_model("tiny-llama", tiny_dir.parent.parent) == tiny_dir
    assert resolve_model(str(tiny_dir)) == tiny_dir
    (tmp_path / "no_config").mkdir()
    for model in (str(tmp_path / "no_config"), str(tmp_path / "missing"), "llama-7b"):
        message = (f"model '{model}' is neither a preset (tiny-llama, llama-135m, tiny-moe, smollm2-135m) nor a directory "
                   "with config.json")
        with pytest.raises(ValueError) as error:
            resolve_model(model, tmp_path)
        assert str(error.value) == message


def test_write_checkpoint_round_trips(tmp_path: Path) -> None:
    tensors = {"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(), "b": torch.ones(4)}
    presets.write_checkpoint(tmp_path / "ckpt", {"model_type": "llama"}, tensors)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text()) == {"model_type": "llama"}
    with safe_open(tmp_path / "ckpt" / "model.safetensors", framework="pt") as checkpoint:
        assert torch.equal(checkpoint.get_tensor("a.weight"), tensors["a.weight"])
        assert torch.equal(checkpoint.get_tensor("b"), tensors["b"])


def _greedy(model: torch.nn.Module, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
    model.generation_config.eos_token_id = None  # generate(eos_token_id=None) is refilled from the config
    output = model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=NUM_GREEDY_STEPS, do_sample=False,
        pad_token_id=PAD_TOKEN_ID, output_logits=True, return_dict_in_generate=True,
    )
    top2 = torch.stack(output.logits)[:, 0].topk(2, dim=-1).values  # [steps, 2]
    return output.sequences[0, len(prompt_ids) :].tolist(), (top2[:, 0] - top2[:, 1]).tolist()


@pytest.fixture(scope="module")
def hf_model(tiny_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    return model.eval()


@torch.no_grad()
def test_transformers_greedy_decoding_is_decisive(hf_model: torch.nn.Module, tiny_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(tiny_dir)
    for prompt in PROMPTS:
        tokens, margins = _greedy(hf_model, tokenizer.encode(prompt))
        assert len(tokens) == NUM_GREEDY_STEPS
        assert min(margins) > 1e-3, (prompt, margins)
        # bos, pad and the vocabulary padding rows never win; real tokens do.
        assert all(token < NUM_TOKENS and token not in (BOS_TOKEN_ID, PAD_TOKEN_ID) for token in tokens)


@torch.no_grad()
def test_outputs_depend_on_earlier_context(hf_model: torch.nn.Module, tiny_dir: Path) -> None:
    # A wrong KV cache must show in the tokens: changing one early prompt byte changes the continuation.
    tokenizer = Tokenizer.from_dir(tiny_dir)
    num_changed = 0
    for prompt in PROMPTS:
        prompt_ids = tokenizer.encode(prompt)
        edited_ids = [prompt_ids[0], (prompt_ids[1] + 1) % 128, *prompt_ids[2:]]
        num_changed += _greedy(hf_model, prompt_ids)[0] != _greedy(hf_model, edited_ids)[0]
    assert num_changed == len(PROMPTS)
