"""How EPLB reads to an operator: `reconfigctl eplb status|rebalance` and the experts line of `reconfigctl status`.

Pure functions of the router's responses (router.proto ExpertStatusResponse / RebalanceExpertsResponse).
Balancedness is mean / max load over the EP ranks (1.0: every rank gets the same number of tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf.message import Message

from services.controller.progress import format_bytes
from services.rpc.reconfig.v1 import router_pb2


def _eplb_mode(status: router_pb2.ExpertStatusResponse) -> str:
    return f"automatic every {status.step_interval} steps" if status.eplb_enabled else "automatic off"


def balance_line(status: router_pb2.ExpertStatusResponse) -> str:
    """One line for `reconfigctl status`: the overall balancedness and where EPLB stands."""
    if not status.expert_parallel:
        return "experts: not an expert-parallel layout (no expert map to balance)"
    return (f"experts: balancedness {status.balancedness:.3f} over {len(status.layers)} sparse layers "
            f"(window {status.window_steps} steps)    EPLB epoch {status.epoch}, {status.num_rebalances} "
            f"rebalances, {_eplb_mode(status)}")


def slots_by_rank(phy2log: Sequence[int], ep_size: int) -> str:
    """The physical -> logical map, one group per EP rank (rank r holds the r-th contiguous run of slots):
    [0, 1, 2, 3, 0, 5] on 2 ranks -> '0 1 2 | 3 0 5'."""
    per_rank = len(phy2log) // ep_size if ep_size > 0 and len(phy2log) % ep_size == 0 else len(phy2log)
    groups = [phy2log[start:start + per_rank] for start in range(0, len(phy2log), per_rank or 1)]
    return " | ".join(" ".join(str(expert) for expert in group) for group in groups)


def format_expert_status(status: router_pb2.ExpertStatusResponse) -> str:
    """`reconfigctl eplb status`: the header, then per sparse layer its balancedness, rank loads and map."""
    eplb = f"EPLB: {'on' if status.eplb_enabled else 'off'}"
    if status.eplb_enabled:
        eplb += f", every {status.step_interval} steps"
    eplb += f"    epoch {status.epoch} ({status.num_rebalances} rebalances)"
    if not status.expert_parallel:
        return "\n".join([eplb, "not an expert-parallel layout: no expert map to balance (EPLB needs epXppY)"])
    lines = [f"{eplb}    window {status.window_steps} steps    EP {status.ep_size}, "
             f"{status.num_physical_experts} physical experts",
             f"balancedness: {status.balancedness:.3f} overall (mean / max rank load)", ""]
    header = ("LAYER", "BALANCEDNESS", "RANK LOADS", "PHYSICAL -> LOGICAL (per rank)")
    rows = [header] + [(str(layer.layer), f"{layer.balancedness:.3f}", " ".join(str(x) for x in layer.rank_load),
                        slots_by_rank(layer.phy2log, status.ep_size)) for layer in status.layers]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def format_rebalance(response: router_pb2.RebalanceExpertsResponse) -> str:
    """`reconfigctl eplb rebalance`: what the rebalance changed and how long each part took."""
    return (f"rebalanced: epoch {response.epoch}    balancedness {response.balancedness_before:.3f} -> "
            f"{response.balancedness_after:.3f} (predicted on the window's load)\n"
            f"  moved {format_bytes(response.bytes_moved)} of expert weights, {response.slots_changed} slots changed;"
            f" prepare {response.prepare_seconds:.3f} s (while serving), commit {response.commit_seconds:.3f} s")


def message_to_json(message: Message) -> dict:
    """JSON-ready form of a response: integers stay integers (json_format would quote 64-bit ones), repeated
    fields become lists, nested messages dicts."""
    out: dict = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None:
            out[field.name] = ([message_to_json(item) for item in value] if _is_repeated(field)
                               else message_to_json(value))
        else:
            out[field.name] = list(value) if _is_repeated(field) else value
    return out


def _is_repeated(field) -> bool:
    is_repeated = getattr(field, "is_repeated", None)  # protobuf >= 6; `label` is gone in 7
    return is_repeated if is_repeated is not None else field.label == field.LABEL_REPEATED
