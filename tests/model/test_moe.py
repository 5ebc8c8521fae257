"""Mixture of experts: config parsing, the whole model against transformers, and the sparse block's TP and EP forms
across gloo processes against the single-rank block."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from safetensors.torch import load_file

from services.model.attention import AttentionMetadata
from services.model.layers import ShardLoader, SingleRankGroup
from services.model.llama import ShardedCausalLM
from services.model.moe import SparseMoeBlock, copy_tables, expert_mlp, load_expert, physical_slots, route
from services.model.spec import ModelSpec, ModelSpecError
from services.topology import Topology, place
from services.topology.experts import router_tensor_name
from tests.conftest import hf_greedy, make_checkpoint
from tests.model.moe_blocks import EXPERT_SIZE, HIDDEN, NUM_EXPERTS, TOP_K, block_spec, block_tensors, tokens

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=100)
CPU = torch.device("cpu")


def _spec(config: transformers.PretrainedConfig) -> ModelSpec:
    return ModelSpec.from_config(json.loads(config.to_json_string()))


# ---- spec ------------------------------------------------------------------------------------------------------------
def test_qwen3_moe_sparse_layers_follow_mlp_only_layers_and_sparse_step():
    spec = _spec(transformers.Qwen3MoeConfig(**SMALL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                             mlp_only_layers=[2], norm_topk_prob=True))
    assert spec.moe_layers == (0, 1, 3) and spec.moe_style == "qwen3_moe" and spec.norm_topk_prob and spec.qk_norm
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (8, 2, 32)
    shape = spec.shape
    assert shape.is_moe and shape.moe_layers == (0, 1, 3) and shape.moe_intermediate_size == 32
    stepped = _spec(transformers.Qwen3MoeConfig(**SMALL, num_experts=8, decoder_sparse_step=2))
    assert stepped.moe_layers == (1, 3) and not stepped.norm_topk_prob and stepped.num_experts_per_tok == 8


def test_qwen3_moe_without_sparse_layers_is_dense():
    spec = _spec(transformers.Qwen3MoeConfig(**SMALL, num_experts=8, mlp_only_layers=[0, 1, 2, 3]))
    assert spec.moe_style == "" and spec.moe_layers == () and not spec.shape.is_moe


def test_mixtral_every_layer_sparse_experts_of_intermediate_size():
    spec = _spec(transformers.MixtralConfig(**SMALL, num_local_experts=4, sliding_window=32))
    assert spec.moe_layers == (0, 1, 2, 3) and spec.moe_style == "mixtral" and spec.norm_topk_prob
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (4, 2, 128)
    assert spec.sliding_window == 32 and not spec.qk_norm and not spec.qkv_bias


def test_num_parameters_counts_router_and_experts():
    for config in (transformers.Qwen3MoeConfig(**SMALL, num_experts=8, num_experts_per_tok=2,
                                               moe_intermediate_size=32, mlp_only_layers=[1]),
                   transformers.MixtralConfig(**SMALL, num_local_experts=4)):
        model = transformers.AutoModelForCausalLM.from_config(config)
        assert _spec(config).num_parameters == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("patch,message", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be between 1 and num_experts=8"),
    ({"mlp_only_layers": [1, 7]}, r"mlp_only_layers \[7\] are not layer ids below num_hidden_layers=4"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be an int >= 1"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size=0 must be >= 1"),
])
def test_bad_moe_configs_say_why(patch, message):
    config = {"model_type": "qwen3_moe", **SMALL, "num_experts": 8, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32, **patch}
    with pytest.raises(ModelSpecError, match=message):
        ModelSpec.from_config(config)


def test_moe_fields_on_a_dense_model_type_are_refused():
    spec = ModelSpec.from_config({"model_type": "llama", **SMALL})
    fields = {f: getattr(spec, f) for f in spec.__slots__}
    with pytest.raises(ModelSpecError, match="model_type 'llama' has no mixture-of-experts layers"):
        ModelSpec(**{**fields, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                     "moe_layers": (0,)})


# ---- the whole model against transformers ---------------------------------------------------------------------------
BLOCK = 4


def _tp1_model(model_dir: Path) -> tuple[ModelSpec, ShardedCausalLM]:
    spec = ModelSpec.from_dir(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    loader = ShardLoader(tensors.__getitem__, set(tensors), torch.float32, CPU)
    return spec, ShardedCausalLM(spec, place(Topology(1, 1), spec.shape).workers[0], loader, SingleRankGroup())


def _step(model: ShardedCausalLM, caches, starts: list[int], token_lists: list[list[int]],
          tables: list[list[int]]) -> torch.Tensor:
    """One step of several sequences; the logits of each sequence's last token [S, vocab]."""
    meta = AttentionMetadata.build(starts, [len(t) for t in token_lists], tables, BLOCK, CPU)
    positions = torch.tensor([s + i for s, t in zip(starts, token_lists) for i in range(len(t))])
    hidden = model.forward(torch.tensor([t for ts in token_lists for t in ts]), positions, caches, meta)
    last = torch.tensor([s.token_start + s.num_new_tokens - 1 for s in meta.sequences])
    return model.compute_logits(hidden.index_select(0, last))


def test_tp1_equals_transformers_on_prefill_and_cached_decode(hf_moe_checkpoint):
    model_dir = hf_moe_checkpoint
    spec, model = _tp1_model(model_dir)
    assert set(model.moe_blocks()) == set(spec.moe_layers) and spec.moe_layers
    prompts, num_steps = [[5, 9, 13, 200, 17, 42, 8], [101, 7, 33]], 5
    expected_tokens, expected_logits = hf_greedy(model_dir, prompts, num_steps)
    caches = [torch.zeros(2, 16, BLOCK, spec.num_kv_heads, spec.head_dim) for _ in range(spec.num_layers)]
    tables = [[3, 0, 7, 1], [5, 2, 6]]  # scattered blocks
    with torch.inference_mode():
        logits = _step(model, caches, [0, 0], prompts, tables)
        for step in range(num_steps):
            for i in range(len(prompts)):
                torch.testing.assert_close(logits[i], expected_logits[i][step], atol=1e-4, rtol=0)
            if step + 1 < num_steps:
                tokens = [[expected_tokens[i][step]] for i in range(len(prompts))]
                logits = _step(model, caches, [len(p) + step for p in prompts], tokens, tables)
    assert [logits[i].argmax().item() for i in range(2)] == [t[-1] for t in expected_tokens]
    load = sum(block.take_load().sum().item() for block in model.moe_blocks().values())
    num_tokens = sum(len(p) + num_steps - 1 for p in prompts)
    assert load == num_tokens * spec.num_experts_per_tok * len(spec.moe_layers)


def test_a_rank_with_no_tokens_runs_only_the_sparse_layers(tmp_path):
    _, model = _tp1_model(make_checkpoint(tmp_path / "m", "qwen3_moe"))
    meta = AttentionMetadata.build([], [], [], BLOCK, CPU)
    with torch.inference_mode():
        hidden = model.forward(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64),
                               [torch.zeros(0)] * 3, meta)  # caches are never touched
        assert hidden.shape == (0, 64) and model.forward_empty().shape == (0, 64)
    assert all(block.take_load().sum() == 0 for block in model.moe_blocks().values())


def test_rebuild_with_previous_keeps_every_tensor(tmp_path):
    model_dir = make_checkpoint(tmp_path / "m", "mixtral")
    spec, model = _tp1_model(model_dir)
    loaded: list[str] = []
    tensors = load_file(model_dir / "model.safetensors")
    loader = ShardLoader(lambda name: loaded.append(name) or tensors[name], set(tensors), torch.float32, CPU)
    again = ShardedCausalLM(spec, model.placement, loader, SingleRankGroup(), model)
    assert not [name for name in loaded if "block_sparse_moe" in name or "self_attn" in name]
    assert set(again.parameter_tensors()) == set(model.parameter_tensors())
    padding = 2 * (len(model.placement.vocab_rows) - spec.vocab_size) * spec.hidden_size  # embed + lm_head rows
    assert again.parameter_bytes() == 4 * (sum(t.numel() for t in tensors.values()) + padding)


def test_ep_to_tp1_keeps_attention_and_the_experts_it_held(tmp_path):
    model_dir = make_checkpoint(tmp_path / "m", "qwen3_moe")
    spec = ModelSpec.from_dir(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    loaded: list[str] = []
    loader = ShardLoader(lambda name: loaded.append(name) or tensors[name], set(tensors), torch.float32, CPU)
    ep_rank1 = place(Topology(ep=2), spec.shape).workers[1]  # slots 4..7, attention whole
    ep = ShardedCausalLM(spec, ep_rank1, loader, SingleRankGroup(), ep_group=SingleRankGroup())
    assert {layer: block.slots for layer, block in ep.moe_blocks().items()} == {0: range(4, 8), 2: range(4, 8)}
    loaded.clear()
    tp = ShardedCausalLM(spec, place(Topology(1, 1), spec.shape).workers[0], loader, SingleRankGroup(), ep)
    assert sorted({name.split(".experts.")[1].split(".")[0] for name in loaded if ".experts." in name}) == \
        ["0", "1", "2", "3"]  # only the experts rank 1 lacked
    assert not [name for name in loaded if "self_attn" in name or "mlp.gate.weight" in name]
    for layer, block in tp.moe_blocks().items():
        assert all(block.slot_weights(e) is ep.moe_blocks()[layer].slot_weights(e) for e in range(4, 8))


def test_redundant_slots_need_an_expert_map(tmp_path):
    spec = ModelSpec.from_dir(make_checkpoint(tmp_path / "m", "qwen3_moe"))
    wp = place(Topology(ep=2), spec.shape, num_redundant_experts=2).workers[0]
    with pytest.raises(ValueError, match="layer 0: 10 physical expert slots for 8 experts need an expert map"):
        ShardedCausalLM(spec, wp, ShardLoader(None, set(), torch.float32, CPU), SingleRankGroup(),
                        ep_group=SingleRankGroup())


# ---- the sparse block alone ----------------------------------------------------------------------------------------
def _expected_load(spec: ModelSpec, tensors, xs: list[torch.Tensor], phy2log: tuple[int, ...]) -> torch.Tensor:
    """The convention, written out: (token, k) goes to copy (row % copies) of its expert, copies in slot order."""
    load = torch.zeros(len(phy2log), dtype=torch.int64)
    router = tensors[router_tensor_name(spec.moe_style, 0)]
    for x in xs:
        _, experts = route(x, router, TOP_K, True, True)
        for row, chosen in enumerate(experts.tolist()):
            for expert in chosen:
                copies = [slot for slot, logical in enumerate(phy2log) if logical == expert]
                load[copies[row % len(copies)]] += 1
    return load


@st.composite
def _maps_and_routing(draw):
    num_experts = draw(st.integers(1, 6))
    extra = draw(st.lists(st.integers(0, num_experts - 1), max_size=6))
    phy2log = draw(st.permutations(list(range(num_experts)) + extra))
    top_k = draw(st.integers(1, num_experts))
    num_tokens = draw(st.integers(0, 12))
    rows = [draw(st.permutations(range(num_experts)))[:top_k] for _ in range(num_tokens)]
    return tuple(phy2log), num_experts, top_k, rows


@settings(max_examples=200, deadline=None)
@given(_maps_and_routing())
def test_assignments_spread_over_copies_by_token_row(case):
    phy2log, num_experts, top_k, rows = case
    num_copies, table = copy_tables(phy2log, num_experts, CPU)
    experts = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), top_k)
    slots = physical_slots(experts, num_copies, table).tolist()
    for row, (chosen, got) in enumerate(zip(rows, slots)):
        for expert, slot in zip(chosen, got):
            copies = [s for s, e in enumerate(phy2log) if e == expert]
            assert slot == copies[row % len(copies)]


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["qwen3_moe", "mixtral"]), st.integers(0, 9), st.integers(0, 2**16))
def test_tp1_block_equals_a_per_token_sum_over_its_top_k(style, num_tokens, seed):
    spec = block_spec(style)
    tensors = block_tensors(spec, seed % 3)
    loader = ShardLoader(tensors.__getitem__, set(tensors), torch.float32, CPU)
    block = SparseMoeBlock(spec, place(Topology(1, 1), spec.shape).workers[0], 0, loader, SingleRankGroup())
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))
    logits = x @ tensors[router_tensor_name(style, 0)].T
    expected = torch.zeros_like(x)
    for t in range(num_tokens):
        probs = logits[t].softmax(-1)
        top = probs.topk(TOP_K)
        for weight, expert in zip(top.values / top.values.sum(), top.indices.tolist()):
            expected[t] += weight * expert_mlp(x[t:t + 1], block.slot_weights(expert))[0]
    torch.testing.assert_close(block(x), expected, atol=1e-5, rtol=1e-5)


def _ep_block(redundant: int = 2, phy2log=(0, 1, 5, 2, 3, 4, 5, 6, 7, 5)) -> tuple[SparseMoeBlock, ShardLoader]:
    spec = block_spec("qwen3_moe")
    tensors = block_tensors(spec)
    loader = ShardLoader(tensors.__getitem__, set(tensors), torch.float32, CPU)
    wp = place(Topology(ep=2), spec.shape, num_redundant_experts=redundant).workers[0]
    return SparseMoeBlock(spec, wp, 0, loader, SingleRankGroup(), phy2log), loader  # never called: no peers


def test_remap_installs_given_slots_and_keeps_the_others():
    block, loader = _ep_block()
    assert block.slots == range(0, 5) and block.slot_weights(2) is block.slot_weights(2)
    kept = [block.slot_weights(s) for s in (0, 1, 3, 4)]
    new = load_expert(loader, "qwen3_moe", 0, 7, range(EXPERT_SIZE))
    block.remap((0, 1, 7, 2, 3, 4, 5, 6, 7, 5), {2: new})
    assert block.phy2log == (0, 1, 7, 2, 3, 4, 5, 6, 7, 5) and block.slot_weights(2) is new
    assert all(block.slot_weights(s) is w for s, w in zip((0, 1, 3, 4), kept))
    assert block.num_copies.tolist() == [1, 1, 1, 1, 1, 2, 1, 2]


@pytest.mark.parametrize("phy2log,weights,message", [
    ((0, 1, 5, 2, 3, 4, 5, 6, 5, 5), {}, r"no slot for logical experts \[7\]"),
    ((0, 1, 5, 2, 3, 4, 5, 6, 7), {}, "expert map has 9 slots, the placement has 10"),
    ((0, 1, 5, 2, 3, 4, 5, 6, 7, 5), {6: None}, r"slots \[6\] are not held here \(slots range\(0, 5\)\)"),
    ((0, 1, 5, 2, 3, 4, 5, 6, 7, 5), {2: (torch.zeros(2, 2), torch.zeros(2, 2))}, "slot 2's new weights have"),
    ((0, 1, 7, 2, 3, 4, 5, 6, 7, 5), {}, r"slots \[2\] change expert but got no weights"),
])
def test_remap_refuses_bad_maps_and_changes_nothing(phy2log, weights, message):
    block, _ = _ep_block()
    before = [block.slot_weights(s) for s in block.slots]
    with pytest.raises(ValueError, match=message):
        block.remap(phy2log, weights)
    assert block.phy2log == (0, 1, 5, 2, 3, 4, 5, 6, 7, 5)
    assert all(block.slot_weights(s) is w for s, w in zip(block.slots, before))


def test_tp_blocks_hold_every_expert_once():
    spec = block_spec("mixtral")
    tensors = block_tensors(spec)
    loader = ShardLoader(tensors.__getitem__, set(tensors), torch.float32, CPU)
    wp = place(Topology(tp=2), spec.shape).workers[1]
    with pytest.raises(ValueError, match="layer 0: a TP layout holds every expert once; its map must be the identity"):
        SparseMoeBlock(spec, wp, 0, loader, SingleRankGroup(), (1, 0, 2, 3, 4, 5, 6, 7))
    block = SparseMoeBlock(spec, wp, 0, loader, SingleRankGroup())
    gate_up, down = block.slot_weights(3)
    assert gate_up.shape == (EXPERT_SIZE, HIDDEN) and down.shape == (HIDDEN, EXPERT_SIZE // 2)
    torch.testing.assert_close(down, tensors["model.layers.0.block_sparse_moe.experts.3.w2.weight"][:, 8:])
    with pytest.raises(ValueError, match="a TP layout has no expert map to change"):
        block.remap(tuple(range(8)), {})


# (name, style, topology, num_redundant, phy2log or None, tokens per rank (None: the same batch on every rank),
#  hot expert, a map to remap to afterwards or None)
SCENARIOS = {
    2: [("tp2", "qwen3_moe", Topology(tp=2), 0, None, None, None, None),
        ("ep2", "mixtral", Topology(ep=2), 0, None, [6, 0], None, None),
        ("ep2-redundant", "qwen3_moe", Topology(ep=2), 2, (0, 1, 5, 2, 3, 4, 5, 6, 7, 5), [9, 4], 5,
         (0, 1, 2, 5, 3, 4, 5, 6, 7, 1))],
    4: [("tp4", "mixtral", Topology(tp=4), 0, None, None, None, None),
        ("ep4", "qwen3_moe", Topology(ep=4), 0, None, [0, 3, 9, 1], None, None)],
}


def _check_scenario(rank: int, world: int, scenario) -> None:
    name, style, topology, redundant, phy2log, counts, hot, new_map = scenario
    spec = block_spec(style)
    tensors = block_tensors(spec)
    loader = ShardLoader(tensors.__getitem__, set(tensors), torch.float32, CPU)
    from services.worker.parallel import DistTPGroup, GroupPair

    group = DistTPGroup(GroupPair(dist.group.WORLD, dist.group.WORLD), tuple(range(world)), rank)
    wp = place(topology, spec.shape, num_redundant_experts=redundant).workers[rank]
    block = SparseMoeBlock(spec, wp, 0, loader, group, phy2log)
    reference = SparseMoeBlock(spec, place(Topology(1, 1), spec.shape).workers[0], 0, loader, SingleRankGroup())
    xs = [tokens(spec, tensors, 5 if counts is None else counts[r], seed=0 if counts is None else r, hot_expert=hot)
          for r in range(world)]
    maps = [phy2log or tuple(range(NUM_EXPERTS))] + ([new_map] if new_map else [])
    for step, current in enumerate(maps):
        if step:  # EPLB: install the new map, with the weights of the local slots whose expert changed
            moved = {s: load_expert(loader, style, 0, current[s], wp.expert_intermediate)
                     for s in wp.expert_slots if current[s] != block.phy2log[s]}
            block.remap(current, moved)
        out = block(xs[rank])
        torch.testing.assert_close(out, reference(xs[rank]), atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
        load = block.take_load()
        dist.all_reduce(load, group=dist.group.WORLD)
        expected = _expected_load(spec, tensors, xs if counts is not None else xs[:1], current)  # TP: rank 0 counts
        assert torch.equal(load, expected), f"{name}: load {load.tolist()} != {expected.tolist()}"
        assert block.take_load().sum() == 0


def _run_block_scenarios(rank: int, world: int, store_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        for scenario in SCENARIOS[world]:
            _check_scenario(rank, world, scenario)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", sorted(SCENARIOS))
def test_tp_and_ep_blocks_across_processes_equal_one_rank(tmp_path, world):
    mp.spawn(_run_block_scenarios, args=(world, str(tmp_path / "store")), nprocs=world, join=True)
