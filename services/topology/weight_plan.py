"""Weight shard reload plans: the checkpoint slices each worker needs in a layout, and what it must newly load."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from math import prod

from services.topology.eplb import initial_phy2log
from services.topology.experts import MOE_STYLES, check_expert_map, expert_tensor_names, router_tensor_name
from services.topology.migration_plan import check_same_model, workers_by_rank
from services.topology.placement import Placement, WorkerPlacement
from services.topology.topology import ModelShape

ExpertMaps = Mapping[int, Sequence[int]]  # MoE layer id -> phy2log (the logical expert of each physical slot)


@dataclass(frozen=True, slots=True)
class WeightFlags:
    """Optional tensors of a checkpoint (the same flags as services.model.ModelSpec)."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False  # also True when the checkpoint has no lm_head.weight
    moe_style: str = ""  # checkpoint names of the experts (services.topology.experts.MOE_STYLES); "" for dense

    @classmethod
    def of(cls, spec: object) -> WeightFlags:
        """The flags of any object with these attributes (a ModelSpec; one without moe_style is dense)."""
        flags = {name: bool(getattr(spec, name)) for name in cls.__slots__ if name != "moe_style"}
        return cls(**flags, moe_style=str(getattr(spec, "moe_style", "") or ""))


@dataclass(frozen=True, slots=True, order=True)
class WeightSlice:
    """Indices [start, stop) along `dim` of one Hugging Face checkpoint tensor."""

    tensor: str
    dim: int
    start: int
    stop: int
    full_shape: tuple[int, ...]  # the whole checkpoint tensor's shape

    def __post_init__(self) -> None:
        if not 0 <= self.dim < len(self.full_shape) or not 0 <= self.start < self.stop <= self.full_shape[self.dim]:
            raise ValueError(f"bad slice {self}")

    @property
    def numel(self) -> int:
        """Elements in the slice."""
        return (self.stop - self.start) * prod(self.full_shape) // self.full_shape[self.dim]

    def nbytes(self, dtype_bytes: int) -> int:
        """Bytes of the slice in a dtype of `dtype_bytes` bytes per element."""
        return self.numel * dtype_bytes

    def with_bounds(self, start: int, stop: int) -> WeightSlice:
        """The same tensor and dim, indices [start, stop)."""
        return WeightSlice(self.tensor, self.dim, start, stop, self.full_shape)


def shard_slices(wp: WorkerPlacement, shape: ModelShape, flags: WeightFlags,
                 expert_maps: ExpertMaps | None = None) -> frozenset[WeightSlice]:
    """Every checkpoint slice worker `wp` loads (names and cuts as services/model loads them).

    A sparse layer (shape.moe_layers) has no dense MLP: its router whole and, for each slot in wp.expert_slots, the
    gate/up rows and down columns wp.expert_intermediate of the slot's logical expert (expert_maps[layer][slot];
    a layer missing from expert_maps has the initial map, see initial_phy2log). A rank holding two copies of one
    expert needs its slices once.
    """
    hidden, head_dim = shape.hidden_size, shape.head_dim
    q_size, kv_size = shape.num_heads * head_dim, shape.num_kv_heads * head_dim
    q_cut = (wp.q_heads.start * head_dim, wp.q_heads.stop * head_dim)
    kv_cut = (wp.kv_heads.start * head_dim, wp.kv_heads.stop * head_dim)
    slices: list[WeightSlice] = []

    def add(name: str, full_shape: tuple[int, ...], dim: int = 0, cut: tuple[int, int] | None = None) -> None:
        start, stop = cut if cut is not None else (0, full_shape[dim])
        stop = min(stop, full_shape[dim])  # vocabulary rows past the real vocabulary are padding (zeros)
        if start < stop:
            slices.append(WeightSlice(name, dim, start, stop, full_shape))

    vocab_cut = (wp.vocab_rows.start, wp.vocab_rows.stop)
    if wp.is_first_stage:
        add("model.embed_tokens.weight", (shape.vocab_size, hidden), 0, vocab_cut)
    sparse = _sparse_layers(wp, shape, flags, expert_maps)
    for layer in wp.layers:
        prefix = f"model.layers.{layer}."
        add(prefix + "input_layernorm.weight", (hidden,))
        add(prefix + "post_attention_layernorm.weight", (hidden,))
        for name, size, cut in (("q", q_size, q_cut), ("k", kv_size, kv_cut), ("v", kv_size, kv_cut)):
            add(f"{prefix}self_attn.{name}_proj.weight", (size, hidden), 0, cut)
            if flags.qkv_bias:
                add(f"{prefix}self_attn.{name}_proj.bias", (size,), 0, cut)
        if flags.qk_norm:
            add(prefix + "self_attn.q_norm.weight", (head_dim,))
            add(prefix + "self_attn.k_norm.weight", (head_dim,))
        add(prefix + "self_attn.o_proj.weight", (hidden, q_size), 1, q_cut)
        if flags.o_bias:
            add(prefix + "self_attn.o_proj.bias", (hidden,))
        if layer in sparse:
            _add_experts(add, wp, shape, flags.moe_style, layer, sparse[layer])
        else:
            _add_dense_mlp(add, wp, shape, flags, prefix)
    if wp.is_last_stage:
        add("model.norm.weight", (hidden,))
        head = "model.embed_tokens.weight" if flags.tie_word_embeddings else "lm_head.weight"
        add(head, (shape.vocab_size, hidden), 0, vocab_cut)
    return frozenset(slices)


def _sparse_layers(wp: WorkerPlacement, shape: ModelShape, flags: WeightFlags,
                   expert_maps: ExpertMaps | None) -> dict[int, tuple[int, ...]]:
    """The held sparse layers -> their phy2log; ValueError on an unknown moe_style or a bad map."""
    held = [layer for layer in shape.moe_layers if layer in wp.layers]
    if not held:
        return {}
    if flags.moe_style not in MOE_STYLES:
        raise ValueError(f"a mixture-of-experts model needs WeightFlags.moe_style in {MOE_STYLES}, "
                         f"got {flags.moe_style!r}")
    num_physical = len(wp.expert_slots) * wp.ep_size
    maps = dict(expert_maps or {})
    if any(layer not in maps for layer in held):
        initial = initial_phy2log(shape.num_experts, num_physical, wp.ep_size)
        maps.update({layer: initial for layer in held if layer not in maps})
    return {layer: check_expert_map(maps[layer], shape.num_experts, num_physical) for layer in held}


def _add_experts(add: Callable[..., None], wp: WorkerPlacement, shape: ModelShape, style: str, layer: int,
                 phy2log: tuple[int, ...]) -> None:
    """The router (every rank routes its own tokens) and the held slots' experts, cut by wp.expert_intermediate."""
    hidden, inter = shape.hidden_size, shape.moe_intermediate_size
    cut = (wp.expert_intermediate.start, wp.expert_intermediate.stop)
    add(router_tensor_name(style, layer), (shape.num_experts, hidden))
    for logical in sorted({phy2log[slot] for slot in wp.expert_slots}):
        gate, up, down = expert_tensor_names(style, layer, logical)
        add(gate, (inter, hidden), 0, cut)
        add(up, (inter, hidden), 0, cut)
        add(down, (hidden, inter), 1, cut)


def _add_dense_mlp(add: Callable[..., None], wp: WorkerPlacement, shape: ModelShape, flags: WeightFlags,
                   prefix: str) -> None:
    """gate/up split by columns (rows of the checkpoint tensor), down by its columns; a row-parallel bias whole."""
    hidden, inter = shape.hidden_size, shape.intermediate_size
    mlp_cut = (wp.intermediate.start, wp.intermediate.stop)
    for name in ("gate", "up"):
        add(f"{prefix}mlp.{name}_proj.weight", (inter, hidden), 0, mlp_cut)
        if flags.mlp_bias:
            add(f"{prefix}mlp.{name}_proj.bias", (inter,), 0, mlp_cut)
    add(prefix + "mlp.down_proj.weight", (hidden, inter), 1, mlp_cut)
    if flags.mlp_bias:
        add(prefix + "mlp.down_proj.bias", (hidden,))


@dataclass(frozen=True, slots=True)
class WeightReload:
    """One rank's shard reload: parts of its new shard it already holds, parts to load, parts to free."""

    keep: frozenset[WeightSlice]  # held in the old shard: cut from the worker's own tensors, not reloaded
    load: frozenset[WeightSlice]  # read from the weight store
    drop: frozenset[WeightSlice]  # held in the old shard and unused by the new one: freed

    def load_bytes(self, dtype_bytes: int) -> int:
        """Bytes read from the weight store."""
        return sum(piece.nbytes(dtype_bytes) for piece in self.load)

    def keep_bytes(self, dtype_bytes: int) -> int:
        """Bytes of the new shard that are already resident."""
        return sum(piece.nbytes(dtype_bytes) for piece in self.keep)

    def drop_bytes(self, dtype_bytes: int) -> int:
        """Bytes of the old shard freed."""
        return sum(piece.nbytes(dtype_bytes) for piece in self.drop)


def plan_weight_reload(old: Placement, old_ranks: Sequence[int], new: Placement, new_ranks: Sequence[int],
                       flags: WeightFlags, old_expert_maps: ExpertMaps | None = None,
                       new_expert_maps: ExpertMaps | None = None) -> dict[int, WeightReload]:
    """Rank -> its reload, for every rank active before or after (a leaving rank drops all, a joining one loads all).
    Expert maps: each layout's phy2log per MoE layer (default: its initial map), as in shard_slices."""
    check_same_model(old, new)
    old_workers, new_workers = workers_by_rank(old, old_ranks), workers_by_rank(new, new_ranks)
    plans = {}
    for rank in sorted(set(old_workers) | set(new_workers)):
        before = _by_tensor(old_workers.get(rank), old.shape, flags, old_expert_maps)
        after = _by_tensor(new_workers.get(rank), new.shape, flags, new_expert_maps)
        keep, load, drop = [], [], []
        for name, piece in after.items():
            held = before.get(name)
            if held is None:
                load.append(piece)
                continue
            overlap = (max(piece.start, held.start), min(piece.stop, held.stop))
            if overlap[0] < overlap[1]:
                keep.append(piece.with_bounds(*overlap))
            load.extend(_minus(piece, held))
        for name, piece in before.items():
            drop.extend(_minus(piece, after[name]) if name in after else [piece])
        plans[rank] = WeightReload(frozenset(keep), frozenset(load), frozenset(drop))
    return plans


def _by_tensor(wp: WorkerPlacement | None, shape: ModelShape, flags: WeightFlags,
               expert_maps: ExpertMaps | None) -> dict[str, WeightSlice]:
    """A shard as tensor name -> its one slice (a shard holds at most one slice of any tensor)."""
    return {} if wp is None else {piece.tensor: piece for piece in shard_slices(wp, shape, flags, expert_maps)}


def _minus(piece: WeightSlice, other: WeightSlice) -> list[WeightSlice]:
    """The parts of `piece` outside `other` (same tensor and dim): at most one below, one above."""
    parts = []
    if piece.start < min(piece.stop, other.start):
        parts.append(piece.with_bounds(piece.start, min(piece.stop, other.start)))
    if max(piece.start, other.stop) < piece.stop:
        parts.append(piece.with_bounds(max(piece.start, other.stop), piece.stop))
    return parts
