"""A skewed-routing workload for EPLB tests and benches: rewrite a MoE checkpoint's routers so that a few experts
take most tokens, as routers trained on other traffic do in production (the vLLM EPLB chapter's motivation).

Each sparse layer's router rows of the hot experts get a push along the mean direction of that layer's router
inputs, measured with transformers on sample prompts, until the hot experts win the top-k for most tokens. Layers
are rewritten in order, each measured after the ones before it changed. Needs transformers (the dev extra).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from services.model.spec import ModelSpec
from services.topology.experts import router_tensor_name


def skew_router(model_dir: str | Path, hot_experts: Sequence[int], prompts: Sequence[Sequence[int]],
                target_share: float = 0.9) -> dict[int, float]:
    """Rewrite `model_dir` in place; returns, per sparse layer, the share of (token, k) routing choices that go to
    `hot_experts` on `prompts` afterwards (each at least `target_share` where a push of up to 1024 times the logits' spread reaches it)."""
    import transformers

    model_dir = Path(model_dir)
    spec = ModelSpec.from_dir(model_dir)
    if not spec.moe_style:
        raise ValueError(f"{model_dir} is not a MoE checkpoint")
    files = sorted(model_dir.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"{model_dir}: expected one safetensors file, found {len(files)}")
    tensors = load_file(files[0])
    hot = torch.tensor(sorted(set(hot_experts)))
    shares: dict[int, float] = {}
    for layer in spec.moe_layers:
        name = router_tensor_name(spec.moe_style, layer)
        inputs = _router_inputs(transformers, model_dir, tensors, spec, layer, prompts)  # [tokens, hidden]
        mean = inputs.mean(0)
        direction = mean / mean.norm().clamp_min(1e-12)
        weight = tensors[name]
        scale = 0.0
        for step in range(17):  # 0, then 1/64 ... 1024 times the spread of the logits
            pushed = weight.clone()
            pushed[hot] += scale * direction.to(weight.dtype)
            share = _hot_share(inputs @ pushed.float().T, hot, spec.num_experts_per_tok)
            if share >= target_share:
                break
            spread = (inputs @ weight.float().T).std().item()
            scale = spread / (mean.norm().item() + 1e-12) * 2.0 ** (step - 6)
        tensors[name] = pushed.contiguous()
        shares[layer] = share
        save_file(tensors, files[0], metadata={"format": "pt"})
    return shares


def _router_inputs(transformers, model_dir: Path, tensors, spec: ModelSpec, layer: int,
                   prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """The router input (post-attention RMSNorm output) of sparse layer `layer` on every prompt token."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    captured: list[torch.Tensor] = []
    norm = model.model.layers[layer].post_attention_layernorm
    handle = norm.register_forward_hook(lambda _m, _i, out: captured.append(out.reshape(-1, out.shape[-1])))
    try:
        with torch.no_grad():
            for prompt in prompts:
                model(torch.tensor([list(prompt)]))
    finally:
        handle.remove()
    return torch.cat(captured).float()


def _hot_share(logits: torch.Tensor, hot: torch.Tensor, top_k: int) -> float:
    chosen = logits.topk(top_k, dim=-1).indices
    return torch.isin(chosen, hot).float().mean().item()
