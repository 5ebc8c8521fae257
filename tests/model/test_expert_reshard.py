"""Expert weights between a stage's TP and EP forms by one all-to-all: the pure plan / pack / unpack against
checkpoint loads (the exchange simulated in-process), and the real thing across gloo processes, byte for byte."""

from __future__ import annotations

import gc
import os
import weakref
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from services.model.expert_reshard import (ExpertLedger, ExpertSwitch, ReshardFailed, ReshardPlan, can_reshard,
                                           ep_to_tp_plan, expert_bytes, expert_peak_extra_bytes, first_holders, pack,
                                           piece_numel, read_piece, slot_experts, tp_slice, tp_to_ep_plan,
                                           unpack_slices, unpack_whole, write_piece)
from services.model.layers import ShardLoader, SingleRankGroup
from services.model.llama import ShardedCausalLM
from services.model.moe import SparseMoeBlock, load_expert
from services.model.spec import ModelSpec
from services.topology import Topology, place
from services.topology.eplb import initial_expert_maps, initial_phy2log
from services.topology.experts import expert_tensor_names
from tests.conftest import make_checkpoint

CPU = torch.device("cpu")
HIDDEN = 6


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape, contiguous layout and bytes."""
    return (a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous() and b.is_contiguous()
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def _same_experts(got, expected) -> bool:
    return len(got) == len(expected) and all(
        len(g) == len(e) and all(_same_bytes(x, y) for x, y in zip(g, e)) for g, e in zip(got, expected))


# ---- pure: plans, pieces, and a simulated exchange ------------------------------------------------------------------
def _loader(num_experts: int, size: int, seed: int = 0) -> ShardLoader:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for expert in range(num_experts):
        gate, up, down = expert_tensor_names("mixtral", 0, expert)
        tensors[gate] = torch.randn(size, HIDDEN, generator=generator)
        tensors[up] = torch.randn(size, HIDDEN, generator=generator)
        tensors[down] = torch.randn(HIDDEN, size, generator=generator)
    return ShardLoader(tensors.__getitem__, set(tensors), torch.float32, CPU)


def _exchange(sends: list[torch.Tensor], plans: list[ReshardPlan], step: int) -> list[torch.Tensor]:
    """What one all-to-all delivers: rank p receives, in rank order, the part of each rank's buffer meant for p."""
    parts = [list(torch.split(send, plan.send_splits(step))) for send, plan in zip(sends, plans)]
    return [torch.cat([parts[r][p] for r in range(len(sends))]) for p in range(len(sends))]


def _ep_to_tp(ep_experts: list[dict[int, tuple]], phy2log, num_experts: int, width: int) -> list[list[tuple]]:
    """Every rank's EP experts (logical -> whole weights) to every rank's TP slices, in logical order."""
    size, step = len(ep_experts), piece_numel(width, HIDDEN)
    plans = [ep_to_tp_plan(phy2log, size, r) for r in range(size)]
    sends = [pack(held, plan.sends, [tp_slice(p, width) for p in range(size)], HIDDEN)
             for held, plan in zip(ep_experts, plans)]
    return [unpack_slices(recv, plan, num_experts, width, HIDDEN)
            for recv, plan in zip(_exchange(sends, plans, step), plans)]


def _tp_to_ep(tp_experts: list[list[tuple]], phy2log, width: int) -> list[dict[int, tuple]]:
    size, step = len(tp_experts), piece_numel(width, HIDDEN)
    plans = [tp_to_ep_plan(phy2log, size, r) for r in range(size)]
    sends = [pack(dict(enumerate(held)), plan.sends, [range(width)] * size, HIDDEN)
             for held, plan in zip(tp_experts, plans)]
    return [unpack_whole(recv, plan, width, HIDDEN) for recv, plan in zip(_exchange(sends, plans, step), plans)]


def test_first_holders_send_each_expert_once_and_a_rank_of_later_copies_sends_nothing():
    phy2log = (0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3)
    assert first_holders(phy2log, 4) == ((0, 1, 2), (3, 4, 5), (6, 7), ())
    plan = ep_to_tp_plan(phy2log, 4, 3)
    assert plan.sends == ((),) * 4 and plan.receives == ((0, 1, 2), (3, 4, 5), (6, 7), ())
    assert plan.send_splits(5) == [0] * 4 and plan.recv_splits(5) == [15, 15, 10, 0]
    assert first_holders((0, 1, 5, 2, 3, 4, 5, 6, 7, 5), 2) == ((0, 1, 5, 2, 3), (4, 6, 7))


def test_tp_to_ep_plan_sends_each_distinct_expert_of_a_peer_once():
    phy2log = (0, 1, 5, 2, 3, 4, 5, 6, 7, 5)
    assert slot_experts(phy2log, range(5, 10)) == (4, 5, 6, 7)
    plan = tp_to_ep_plan(phy2log, 2, 1)
    assert plan.sends == ((0, 1, 5, 2, 3), (4, 5, 6, 7)) and plan.receives == ((4, 5, 6, 7),) * 2


def test_a_piece_is_gate_rows_up_rows_down_columns_and_reads_back_as_the_slice():
    loader = _loader(1, 8)
    whole = load_expert(loader, "mixtral", 0, 0, range(8))
    out = torch.empty(piece_numel(3, HIDDEN))
    write_piece(out, whole, range(2, 5))
    assert _same_experts([read_piece(out, 3, HIDDEN)], [load_expert(loader, "mixtral", 0, 0, range(2, 5))])
    gate, up, down = expert_tensor_names("mixtral", 0, 0)
    assert torch.equal(out[:18].view(3, HIDDEN), loader.full(gate)[2:5])
    assert torch.equal(out[18:36].view(3, HIDDEN), loader.full(up)[2:5])
    with pytest.raises(ValueError, match="slice range"):
        write_piece(out, whole, range(6, 9))


@st.composite
def _layouts(draw):
    size = draw(st.integers(2, 4))
    num_experts = draw(st.integers(1, 6))
    per_rank = draw(st.integers(-(-num_experts // size), -(-num_experts // size) + 2))
    extra = draw(st.lists(st.integers(0, num_experts - 1), min_size=size * per_rank - num_experts,
                          max_size=size * per_rank - num_experts))
    old = tuple(draw(st.permutations(list(range(num_experts)) + extra)))
    extra = draw(st.lists(st.integers(0, num_experts - 1), min_size=size * per_rank - num_experts,
                          max_size=size * per_rank - num_experts))
    new = tuple(draw(st.permutations(list(range(num_experts)) + extra)))
    return size, num_experts, draw(st.integers(1, 3)), old, new


@settings(max_examples=60, deadline=None)
@given(_layouts())
def test_ep_to_tp_to_ep_round_trip_equals_checkpoint_loads(layout):
    size, num_experts, width, old, new = layout
    loader = _loader(num_experts, size * width)
    full = range(size * width)

    def ep_held(phy2log, rank):
        slots = range(rank * len(phy2log) // size, (rank + 1) * len(phy2log) // size)
        return {e: load_expert(loader, "mixtral", 0, e, full) for e in slot_experts(phy2log, slots)}

    tp = _ep_to_tp([ep_held(old, r) for r in range(size)], old, num_experts, width)
    for rank in range(size):
        expected = [load_expert(loader, "mixtral", 0, e, tp_slice(rank, width)) for e in range(num_experts)]
        assert _same_experts(tp[rank], expected)
    ep = _tp_to_ep(tp, new, width)
    for rank in range(size):
        expected = ep_held(new, rank)
        assert list(ep[rank]) == list(expected)
        assert _same_experts(list(ep[rank].values()), list(expected.values()))


# ---- who may reshard ------------------------------------------------------------------------------------------------
def test_can_reshard_only_between_tp_and_ep_of_one_stage_and_group_size():
    spec = ModelSpec.from_config({"model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 4,
                                  "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 64,
                                  "intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 16})

    def wp(topology: Topology, index: int, redundant: int = 0):
        return place(topology, spec.shape, num_redundant_experts=redundant).workers[index]

    for r in range(2):
        assert can_reshard(wp(Topology(tp=2), r), wp(Topology(ep=2), r))
        assert can_reshard(wp(Topology(ep=2), r), wp(Topology(tp=2), r))
        assert can_reshard(wp(Topology(tp=2), r), wp(Topology(ep=2), r, redundant=2))
    assert can_reshard(wp(Topology(tp=2, pp=2), 3), wp(Topology(ep=2, pp=2), 3))
    assert not can_reshard(wp(Topology(tp=2), 0), wp(Topology(ep=2), 1))  # another rank of the stage
    assert not can_reshard(wp(Topology(tp=2), 0), wp(Topology(tp=2), 0))  # same form
    assert not can_reshard(wp(Topology(ep=2), 0), wp(Topology(ep=2), 0, redundant=2))
    assert not can_reshard(wp(Topology(tp=4), 0), wp(Topology(ep=2), 0))  # another group size
    assert not can_reshard(wp(Topology(tp=2, pp=2), 0), wp(Topology(ep=2), 0))  # another pipeline
    assert not can_reshard(wp(Topology(tp=2, pp=2), 2), wp(Topology(ep=2, pp=2), 0))  # another stage
    assert not can_reshard(wp(Topology(tp=1), 0), wp(Topology(ep=2), 0))


# ---- across processes -----------------------------------------------------------------------------------------------
def _world_group(rank: int, world: int):
    from services.worker.parallel import DistTPGroup, GroupPair

    return DistTPGroup(GroupPair(dist.group.WORLD, dist.group.WORLD), tuple(range(world)), rank)


def _snapshot(block: SparseMoeBlock) -> list[tuple]:
    return [tuple(t.clone() for t in weights) for weights in block.experts]


def _sharing(block: SparseMoeBlock) -> list[list[int]]:
    """Per local slot: the local slots holding the very same weights."""
    return [[i for i, other in enumerate(block.experts) if other is weights] for weights in block.experts]


def _counting_loader(tensors, dtype: torch.dtype) -> tuple[ShardLoader, list[str]]:
    loaded: list[str] = []
    return ShardLoader(lambda name: loaded.append(name) or tensors[name], set(tensors), dtype, CPU), loaded


def _check_layer(rank: int, world: int, spec: ModelSpec, layer: int, tensors, dtype: torch.dtype,
                 over_sockets: bool = False) -> None:
    loader, loaded = _counting_loader(tensors, dtype)
    group = _world_group(rank, world)
    if over_sockets:  # as across hosts: gloo's all-to-all, not the shared-memory exchange
        group._bulk = False
    tp_wp = place(Topology(tp=world), spec.shape).workers[rank]
    tp_block = SparseMoeBlock(spec, tp_wp, layer, loader, group)
    assert tp_block.loaded_bytes == sum(t.numel() * t.element_size() for w in tp_block.experts for t in w)
    tp_before = _snapshot(tp_block)
    tp_tensors = list(tp_block.experts)
    x_same = torch.randn(7, spec.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    x_own = torch.randn(3 + 2 * rank, spec.hidden_size, generator=torch.Generator().manual_seed(rank)).to(dtype)
    tp_out = tp_block(x_same)
    redundant = world  # ep2: 10 slots, ep4: 12
    for extra in (0, redundant):
        ep_wp = place(Topology(ep=world), spec.shape, num_redundant_experts=extra).workers[rank]
        phy2log = initial_phy2log(spec.num_experts, spec.num_experts + extra, world)
        loaded.clear()
        ep_block = SparseMoeBlock(spec, ep_wp, layer, loader, group, phy2log, previous=tp_block)
        assert not loaded, f"TP -> EP read {loaded}"
        direct = SparseMoeBlock(spec, ep_wp, layer, loader, group, phy2log)
        assert _same_experts(ep_block.experts, direct.experts), f"ep{world}+{extra} layer {layer}"
        assert _sharing(ep_block) == _sharing(direct)  # local slots of one logical expert share its tensors
        assert ep_block.router is tp_block.router and ep_block.loaded_bytes == 0
        assert ep_block.resharded_bytes == direct.loaded_bytes > 0
        assert all(a is b for a, b in zip(tp_block.experts, tp_tensors, strict=True))  # the old block intact
        assert _same_experts(tp_block.experts, tp_before)
        assert torch.equal(ep_block(x_own), direct(x_own))
        # EP -> TP, from the resharded block and from the loaded one (duplicates: each expert sent by one holder)
        for source in (ep_block, direct):
            ep_before = _snapshot(source)
            loaded.clear()
            tp_again = SparseMoeBlock(spec, tp_wp, layer, loader, group, previous=source)
            assert not loaded, f"EP -> TP read {loaded}"
            assert _same_experts(tp_again.experts, tp_before)
            assert tp_again.resharded_bytes == tp_block.loaded_bytes and tp_again.loaded_bytes == 0
            assert _same_experts(source.experts, ep_before)
            assert torch.equal(tp_again(x_same), tp_out)


def _check_model_switch(rank: int, world: int, model_dir: Path) -> None:
    """tp{P} -> ep{P} -> tp{P} of a whole shard: no expert tensor read again; the same logits path."""
    spec = ModelSpec.from_dir(model_dir)
    loader, loaded = _counting_loader(load_file(model_dir / "model.safetensors"), torch.float32)
    group = _world_group(rank, world)
    tp_wp = place(Topology(tp=world), spec.shape).workers[rank]
    tp = ShardedCausalLM(spec, tp_wp, loader, group)
    loaded.clear()
    ep_wp = place(Topology(ep=world), spec.shape).workers[rank]
    ep = ShardedCausalLM(spec, ep_wp, loader, SingleRankGroup(), tp, ep_group=group)
    assert loaded and not [name for name in loaded if ".experts." in name]  # attention whole: loaded
    for layer, block in ep.moe_blocks().items():
        direct = SparseMoeBlock(spec, ep_wp, layer, loader, group)
        assert _same_experts(block.experts, direct.experts) and block.resharded_bytes == direct.loaded_bytes
    loaded.clear()
    back = ShardedCausalLM(spec, tp_wp, loader, group, ep)
    assert not [name for name in loaded if ".experts." in name]
    for layer, block in back.moe_blocks().items():
        assert _same_experts(block.experts, tp.moe_blocks()[layer].experts)


def _fault_at(rank: int, layer: int):
    """A fault hook that fails `layer` on `rank` only."""
    def fault(at: int) -> None:
        if at == layer and dist.get_rank() == rank:
            raise RuntimeError(f"injected at layer {at}")
    return fault


def _check_in_place(rank: int, world: int, model_dir: Path) -> None:
    """tp{P} -> ep{P} -> tp{P} in place: each sparse layer's old experts are let go (nothing keeps them alive), the
    ledger counts what the pure prediction says (one layer of experts without spare slots); a fault at a layer
    fails it on every rank, and the layers let go come back from the store byte-identical; by all-to-all and from
    the store alike."""
    spec = ModelSpec.from_dir(model_dir)
    loader, _ = _counting_loader(load_file(model_dir / "model.safetensors"), torch.float32)
    group = _world_group(rank, world)
    tp_wp = place(Topology(tp=world), spec.shape).workers[rank]
    identity = {layer: tuple(range(spec.num_experts)) for layer in spec.moe_layers}
    tp = ShardedCausalLM(spec, tp_wp, loader, group)
    before = {layer: _snapshot(block) for layer, block in tp.moe_blocks().items()}
    x = torch.randn(5, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    outputs = {layer: block(x.clone()) for layer, block in tp.moe_blocks().items()}
    last = spec.moe_layers[-1]
    ep_wp = place(Topology(ep=world), spec.shape).workers[rank]
    with pytest.raises(ReshardFailed, match=f"layer {last}"):
        ShardedCausalLM(spec, ep_wp, loader, SingleRankGroup(), tp, ep_group=group,
                        expert_switch=ExpertSwitch(in_place=True, fault=_fault_at(world - 1, last)))
    released = [layer for layer, block in tp.moe_blocks().items() if block.released]
    assert released == [layer for layer in spec.moe_layers if layer < last] and released
    with pytest.raises(RuntimeError, match="restore them first"):
        tp.moe_blocks()[released[0]](x)
    assert tp.restore_experts(loader) == released
    assert all(_same_experts(block.experts, before[layer]) for layer, block in tp.moe_blocks().items())
    for reshard, extra in ((True, 0), (False, 0), (True, world), (False, world)):
        placement = place(Topology(ep=world), spec.shape, num_redundant_experts=extra)
        ep_wp, maps = placement.workers[rank], initial_expert_maps(spec.shape, placement)
        ledger = ExpertLedger()
        old_tensors = [weakref.ref(t) for block in tp.moe_blocks().values() for w in block.experts for t in w]
        ep = ShardedCausalLM(spec, ep_wp, loader, SingleRankGroup(), tp, ep_group=group, expert_maps=maps,
                             expert_switch=ExpertSwitch(reshard=reshard, in_place=True, ledger=ledger))
        gc.collect()
        assert not [ref for ref in old_tensors if ref() is not None], "an old expert tensor is still alive"
        assert ledger.peak_beyond == expert_peak_extra_bytes(tp_wp, ep_wp, identity, maps, spec.hidden_size, 4,
                                                             reshard)
        layer_bytes = expert_bytes(next(iter(ep.moe_blocks().values())).experts)
        assert ledger.peak_beyond == layer_bytes or extra, (ledger, layer_bytes)
        for layer, block in ep.moe_blocks().items():
            direct = SparseMoeBlock(spec, ep_wp, layer, loader, group, maps[layer])
            assert _same_experts(block.experts, direct.experts), (reshard, extra, layer)
        ledger = ExpertLedger()
        tp = ShardedCausalLM(spec, tp_wp, loader, group, ep,
                             expert_switch=ExpertSwitch(reshard=reshard, in_place=True, ledger=ledger))
        assert ledger.peak_beyond == expert_peak_extra_bytes(ep_wp, tp_wp, maps, identity, spec.hidden_size, 4,
                                                             reshard)
        assert all(block.released for block in ep.moe_blocks().values())
        for layer, block in tp.moe_blocks().items():
            assert _same_experts(block.experts, before[layer]) and torch.equal(block(x.clone()), outputs[layer])


def _check_exchange(rank: int, world: int) -> None:
    """The shared-memory all-to-all delivers what gloo's all_to_all_single does, empty parts included; its
    segments are gone afterwards."""
    from services.weightstore.shm import list_segments
    from services.worker.shm_exchange import SEGMENT_PREFIX, ShmAllToAll

    exchange = ShmAllToAll(dist.group.WORLD, rank)
    for seed in range(4):
        splits = torch.randint(0, 5, (world, world), generator=torch.Generator().manual_seed(seed)).tolist()
        if seed == 0:
            splits[0] = [0] * world  # a rank that sends nothing (EP -> TP: one holding only spare copies)
        send_splits, recv_splits = splits[rank], [splits[p][rank] for p in range(world)]
        data = torch.arange(sum(send_splits), dtype=torch.float32) + 1000 * rank
        expected = torch.empty(sum(recv_splits))
        dist.all_to_all_single(expected, data, recv_splits, send_splits)
        send = exchange.send_buffer(data.numel(), data.dtype)
        send.copy_(data)
        got = torch.full_like(expected, -1.0)
        exchange.all_to_all(got, send, recv_splits, send_splits)
        del send
        assert torch.equal(got, expected), (seed, rank)
    dist.barrier()
    assert not [name for name in list_segments(SEGMENT_PREFIX) if f"-{os.getpid()}-" in name]


def _run(rank: int, world: int, store_path: str, model_dirs: dict[str, str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        for style, model_dir in model_dirs.items():
            spec = ModelSpec.from_dir(Path(model_dir))
            tensors = load_file(Path(model_dir) / "model.safetensors")
            dtypes = (torch.float32, torch.bfloat16) if world == 2 else (torch.float32,)
            for dtype in dtypes:
                for layer in spec.moe_layers:
                    _check_layer(rank, world, spec, layer, tensors, dtype, over_sockets=dtype == torch.bfloat16)
        _check_model_switch(rank, world, Path(model_dirs["mixtral"]))
        _check_in_place(rank, world, Path(model_dirs["qwen3_moe"]))
        _check_exchange(rank, world)
    finally:
        dist.destroy_process_group()


def test_reshard_wanted_follows_the_environment_and_else_nccl(monkeypatch):
    from services.model.expert_reshard import RESHARD_ENV, reshard_wanted
    from services.model.layers import SingleRankGroup

    monkeypatch.delenv(RESHARD_ENV, raising=False)
    assert not reshard_wanted(SingleRankGroup())  # auto: no NCCL group (the store is faster over gloo)
    monkeypatch.setenv(RESHARD_ENV, "on")
    assert reshard_wanted(SingleRankGroup())
    monkeypatch.setenv(RESHARD_ENV, "off")
    assert not reshard_wanted(SingleRankGroup())


@pytest.mark.parametrize("world", [2, 4])
def test_reshard_across_processes_equals_checkpoint_loads(tmp_path, world, monkeypatch):
    from services.model.expert_reshard import RESHARD_ENV

    monkeypatch.setenv(RESHARD_ENV, "on")  # the ranks inherit it: the all-to-all over gloo, not the store
    model_dirs = {style: str(make_checkpoint(tmp_path / style, style)) for style in ("qwen3_moe", "mixtral")}
    mp.spawn(_run, args=(world, str(tmp_path / "store"), model_dirs), nprocs=world, join=True)
