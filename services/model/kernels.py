"""Which kernels compute a decoder layer's norms, rotary + KV write, decode attention and SwiGLU: `torch` (eager
ops, the default everywhere) or `triton` (services/model/triton_kernels.py: fused, for CUDA; on a CPU they run in
Triton's interpreter, for tests only). A worker chooses once, at its start (WorkerConfig.kernels); the linear
layers stay torch's in both, and a TP layout's MoE experts become two grouped GEMMs (triton_moe.py) under `triton`."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.contracts.numerics import KERNELS
from services.model.attention import DecodeAttention, PrefillAttention, write_kv
from services.model.layers import apply_rotary, rms_norm


def torch_add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)); delta None: (x, rms_norm(x))."""
    total = x if delta is None else x + delta
    return total, rms_norm(total, weight, eps)


def torch_rotary_write_kv(qkv: torch.Tensor, num_q: int, num_kv: int, head_dim: int, cos: torch.Tensor,
                          sin: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                          write_rows: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
                          k_norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """triton_kernels.rotary_write_kv in eager ops: the rotated queries [T, Hq, D]; keys and values into `cache`."""
    tokens, num_qk = qkv.shape[0], num_q + num_kv
    qk = qkv[:, : num_qk * head_dim].view(tokens, num_qk, head_dim)  # q and k heads side by side: one rotary
    v = qkv[:, num_qk * head_dim:].view(tokens, num_kv, head_dim)
    if q_norm is not None:
        qk = torch.cat((rms_norm(qk[:, :num_q], q_norm, eps), rms_norm(qk[:, num_q:], k_norm, eps)), dim=1)
    qk = apply_rotary(qk, cos, sin)
    write_kv(cache, qk[:, num_q:], v, slot_mapping, write_rows)
    return qk[:, :num_q]


def torch_silu_mul(gate_up: torch.Tensor, silu: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return silu(gate) * up


@dataclass(frozen=True, slots=True)
class Kernels:
    """One choice of the layer's non-GEMM kernels (the functions' signatures: triton_kernels')."""

    name: str
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_write_kv: Callable[..., torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    decode_attention: DecodeAttention | None = None  # None: paged_attention's padded SDPA
    prefill_attention: PrefillAttention | None = None  # None: SDPA (AttentionMetadata.build's prefill_kernel: set)
    # (x, route weights, local slots, ExpertTable, load, repeats) -> the routed experts' weighted sum (the load
    # counted); None: a product per expert
    moe_experts: Callable[..., torch.Tensor] | None = None
    # (router logits [T, E], k, renormalize, weights' dtype) -> (weights, expert ids), beside moe_experts
    moe_route: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def fused(self) -> bool:
        return self.name != "torch"


TORCH = Kernels("torch", torch_add_rms_norm, torch_rotary_write_kv, torch_silu_mul)


def choose(name: str, device: torch.device) -> Kernels:
    """The kernels named `name` (KERNELS) for `device`. `triton` imports Triton here: ImportError saying so where
    it is not installed; on a CPU its interpreter runs the kernels (TRITON_INTERPRET=1, set before the import:
    Triton reads it when a kernel is defined)."""
    if name not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, not {name!r}")
    if name == "torch":
        return TORCH
    if device.type == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("kernels 'triton' on a CPU run in Triton's interpreter, which TRITON_INTERPRET=1 "
                               "turns on before triton is first imported; it was imported without it")
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        from services.model import triton_kernels, triton_moe
    except ImportError as e:
        raise ImportError(f"kernels 'triton' need the triton package ({e}); pip install triton, or kernels 'torch'") \
            from e
    return Kernels("triton", triton_kernels.add_rms_norm, triton_kernels.rotary_write_kv, triton_kernels.silu_mul,
                   triton_kernels.decode_attention, triton_kernels.prefill_attention, triton_moe.grouped_experts,
                   triton_moe.route)
