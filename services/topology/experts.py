"""Mixture-of-experts checkpoint names and the physical expert map (which logical expert each slot holds)."""

from __future__ import annotations

from collections.abc import Sequence

# moe_style -> (router weight, per-expert (gate, up, down) weights), relative to "model.layers.{layer}."
_MOE_NAMES: dict[str, tuple[str, tuple[str, str, str]]] = {
    "qwen3_moe": ("mlp.gate.weight", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                                      "mlp.experts.{e}.down_proj.weight")),
    "mixtral": ("block_sparse_moe.gate.weight", ("block_sparse_moe.experts.{e}.w1.weight",
                                                  "block_sparse_moe.experts.{e}.w3.weight",
                                                  "block_sparse_moe.experts.{e}.w2.weight")),
}
MOE_STYLES = tuple(_MOE_NAMES)


def _names(style: str) -> tuple[str, tuple[str, str, str]]:
    if style not in _MOE_NAMES:
        raise ValueError(f"unknown moe_style {style!r}: expected one of {', '.join(MOE_STYLES)}")
    return _MOE_NAMES[style]


def router_tensor_name(style: str, layer: int) -> str:
    """The router (gate) weight [num_experts, hidden] of a sparse layer."""
    return f"model.layers.{layer}." + _names(style)[0]


def expert_tensor_names(style: str, layer: int, expert: int) -> tuple[str, str, str]:
    """(gate [I, hidden], up [I, hidden], down [hidden, I]) weights of one logical expert of a sparse layer."""
    prefix = f"model.layers.{layer}."
    gate, up, down = _names(style)[1]
    return (prefix + gate.format(e=expert), prefix + up.format(e=expert), prefix + down.format(e=expert))


def identity_map(num_experts: int) -> tuple[int, ...]:
    """The physical expert map without replicas: slot e holds logical expert e (every TP layout, EP at start)."""
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    return tuple(range(num_experts))


def check_expert_map(phy2log: Sequence[int], num_experts: int, num_physical: int | None = None) -> tuple[int, ...]:
    """phy2log as a tuple; ValueError unless every slot names a logical expert below num_experts and every logical
    expert has a slot (a token routed to an expert without one would have nowhere to go)."""
    slots = tuple(phy2log)
    if num_physical is not None and len(slots) != num_physical:
        raise ValueError(f"expert map has {len(slots)} slots, expected {num_physical}")
    if any(not isinstance(e, int) or isinstance(e, bool) or not 0 <= e < num_experts for e in slots):
        raise ValueError(f"expert map entries must be logical expert ids in [0, {num_experts}), got {slots}")
    missing = sorted(set(range(num_experts)) - set(slots))
    if missing:
        raise ValueError(f"logical experts {missing} have no physical slot in {slots}")
    return slots


def expert_copies(phy2log: Sequence[int], num_experts: int) -> tuple[tuple[int, ...], ...]:
    """logical expert -> its physical slots, ascending (the order tokens are spread over its copies)."""
    slots = check_expert_map(phy2log, num_experts)
    copies: list[list[int]] = [[] for _ in range(num_experts)]
    for slot, logical in enumerate(slots):
        copies[logical].append(slot)
    return tuple(tuple(held) for held in copies)


def physical_slot(copies: Sequence[Sequence[int]], logical: int, row: int) -> int:
    """The slot serving token row `row` routed to `logical`: copy row % copies, so every rank picks the same one
    without talking to the others, and a hot expert's tokens split evenly over its copies."""
    held = copies[logical]
    return held[row % len(held)]
