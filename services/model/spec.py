"""ModelSpec: the architecture of a checkpoint, read from its Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.topology import ModelShape

# model_type -> (qkv projections have a bias, o_proj has a bias, q/k RMSNorm per head)
_FAMILIES: dict[str, tuple[str, str, bool]] = {
    # values name the config key to read, "" = always False, "!" = always True
    "llama": ("attention_bias", "attention_bias", False),
    "mistral": ("", "", False),
    "qwen2": ("!", "", False),
    "qwen3": ("attention_bias", "attention_bias", True),
    "qwen3_moe": ("attention_bias", "attention_bias", True),
    "mixtral": ("", "", False),
}
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")  # also their moe_style (services/topology/experts.py names)
_MOE_DEFAULTS = {
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    "mixtral": {"num_experts": 8, "num_experts_per_tok": 2},
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelSpecError(ValueError):
    """A config.json this engine cannot run, with the reason."""


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Rotary embedding parameters (Hugging Face `rope_parameters` / `rope_scaling`)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A decoder-only transformer of the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3), dense or with sparse
    mixture-of-experts layers (Qwen3-MoE, Mixtral)."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeSpec
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Mixture of experts (zero / empty for a dense model). Sparse layers replace the MLP by a softmax router over
    # num_experts experts (each a SwiGLU MLP of moe_intermediate_size), of which the top num_experts_per_tok run.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize the top-k probabilities to sum to 1 (always so for Mixtral)
    moe_layers: tuple[int, ...] = ()  # global ids of the sparse layers; the others keep a dense MLP

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelSpecError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ModelSpecError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.moe_layers or self.num_experts:
            self._check_moe()

    def _check_moe(self) -> None:
        if self.model_type not in MOE_MODEL_TYPES:
            raise ModelSpecError(f"model_type {self.model_type!r} has no mixture-of-experts layers "
                                 f"(MoE model types: {', '.join(MOE_MODEL_TYPES)})")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ModelSpecError(f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                                 f"num_experts={self.num_experts}")
        if self.moe_intermediate_size < 1:
            raise ModelSpecError(f"moe_intermediate_size={self.moe_intermediate_size} must be >= 1")
        if not self.moe_layers:
            raise ModelSpecError("a mixture-of-experts model needs at least one sparse layer")
        if any(not 0 <= i < self.num_layers for i in self.moe_layers) or \
                list(self.moe_layers) != sorted(set(self.moe_layers)):
            raise ModelSpecError(f"moe_layers {self.moe_layers} must be sorted distinct layer ids below "
                                 f"num_layers={self.num_layers}")

    @property
    def moe_style(self) -> str:
        """Checkpoint naming and router flavour of the sparse layers: "" (dense), "qwen3_moe" or "mixtral"."""
        return self.model_type if self.moe_layers else ""

    @property
    def shape(self) -> ModelShape:
        """The dimensions placement needs."""
        return ModelShape(
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size,
            moe_layers=self.moe_layers,
        )

    @property
    def num_parameters(self) -> int:
        """Parameter count of the full (unsharded) model."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.o_bias:
            attn += h
        mlp = 3 * h * self.intermediate_size
        if self.mlp_bias:
            mlp += 2 * self.intermediate_size + h
        sparse = self.num_experts * h + self.num_experts * 3 * h * self.moe_intermediate_size  # router + experts
        norms = 2 * h + (2 * d if self.qk_norm else 0)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        num_sparse = len(self.moe_layers)
        return self.num_layers * (attn + norms) + (self.num_layers - num_sparse) * mlp + num_sparse * sparse \
            + embed + h

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelSpec:
        """Read `config.json` of a Hugging Face checkpoint directory."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelSpecError(f"{model_dir}: no config.json (not a Hugging Face checkpoint directory)")
        return cls.from_config(json.loads(path.read_text()))

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelSpec:
        """Build from a parsed config.json dict."""
        model_type = config.get("model_type", "")
        if model_type not in _FAMILIES:
            raise ModelSpecError(
                f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(_FAMILIES))})"
            )
        qkv_key, o_key, qk_norm = _FAMILIES[model_type]
        num_heads = int(config["num_attention_heads"])
        hidden_size = int(config["hidden_size"])
        head_dim = config.get("head_dim") or hidden_size // num_heads
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        sliding_window = config.get("sliding_window")
        if model_type in ("qwen2", "qwen3_moe") and not config.get("use_sliding_window", False):
            sliding_window = None
        num_layers = int(config["num_hidden_layers"])
        return cls(
            model_type=model_type,
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_config(config),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=_flag(config, qkv_key),
            o_bias=_flag(config, o_key),
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=qk_norm,
            sliding_window=int(sliding_window) if sliding_window else None,
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **_moe_from_config(model_type, config, num_layers),
        )


def _moe_from_config(model_type: str, config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The ModelSpec MoE fields of a config.json, as transformers builds the layers (Qwen3MoeDecoderLayer: layer i
    is sparse iff i is not in mlp_only_layers, num_experts > 0 and (i + 1) % decoder_sparse_step == 0; Mixtral:
    every layer, experts of intermediate_size, top-k always renormalized)."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    defaults = _MOE_DEFAULTS[model_type]  # transformers' config defaults, for keys a config.json leaves out
    num_experts = int(config.get("num_local_experts", config.get("num_experts", defaults["num_experts"])))
    num_experts_per_tok = int(config.get("num_experts_per_tok", defaults["num_experts_per_tok"]))
    if model_type == "mixtral":
        return dict(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                    moe_intermediate_size=int(config["intermediate_size"]), norm_topk_prob=True,
                    moe_layers=tuple(range(num_layers)))
    step = config.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ModelSpecError(f"decoder_sparse_step={step!r} must be an int >= 1")
    dense = set(config.get("mlp_only_layers") or ())
    if bad := sorted(i for i in dense if not (isinstance(i, int) and 0 <= i < num_layers)):
        raise ModelSpecError(f"mlp_only_layers {bad} are not layer ids below num_hidden_layers={num_layers}")
    moe_layers = tuple(i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    if not moe_layers:  # no sparse layer: a dense model in every respect
        return {}
    return dict(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                moe_intermediate_size=int(config.get("moe_intermediate_size", defaults["moe_intermediate_size"])),
                norm_topk_prob=bool(config.get("norm_topk_prob", False)), moe_layers=moe_layers)


def _flag(config: dict[str, Any], key: str) -> bool:
    if key == "!":
        return True
    return bool(config.get(key, False)) if key else False


def _rope_from_config(config: dict[str, Any]) -> RopeSpec:
    """Read rope parameters from transformers>=5 `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelSpecError(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return RopeSpec(
        theta=theta,
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            merged.get("original_max_position_embeddings", config.get("max_position_embeddings", 8192))
        ),
    )
