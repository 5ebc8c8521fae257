"""Topology text form, field checks, validate() messages and candidate_topologies()."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.topology import ModelShape, Topology, TopologyError, candidate_topologies, degraded_topology, validate


def make_shape(**overrides: int) -> ModelShape:
    dims = dict(
        num_layers=4, num_heads=8, num_kv_heads=2, head_dim=16, hidden_size=128, intermediate_size=704, vocab_size=1000
    )
    return ModelShape(**(dims | overrides))


@pytest.mark.parametrize(
    ("text", "tp", "pp"),
    [
        ("tp2pp2", 2, 2),
        ("TP4PP1", 4, 1),
        ("tp2", 2, 1),
        ("pp3", 1, 3),
        ("tp1pp1", 1, 1),
        ("  tp2pp4\n", 2, 4),
        ("pp2tp8", 8, 2),
        ("Tp16Pp12", 16, 12),
    ],
)
def test_parse_accepts(text: str, tp: int, pp: int) -> None:
    assert Topology.parse(text) == Topology(tp=tp, pp=pp)


@pytest.mark.parametrize(
    "text", ["", "   ", "tp0pp1", "tp2pp", "tp-1", "tp2tp2", "foo", "tp2 pp2", "tp2pp0", "tp", "2", "tp2,pp2", "tp٢"]
)
def test_parse_rejects_with_input_and_expected_form(text: str) -> None:
    with pytest.raises(TopologyError) as raised:
        Topology.parse(text)
    message = str(raised.value)
    assert f"invalid topology {text!r}" in message
    assert "expected 'tpXppY' or 'epXppY' with X, Y >= 1, e.g. 'tp2pp2'" in message


def test_parse_exact_message() -> None:
    with pytest.raises(TopologyError, match=r"^invalid topology 'tp2pp': expected 'tpXppY' or 'epXppY' with X, Y >= 1, "
                                            r"e\.g\. 'tp2pp2'$"):
        Topology.parse("tp2pp")


def test_parse_reserved_degrees() -> None:
    assert Topology.parse("tp2dp1ep1") == Topology(tp=2)
    assert Topology.parse("ep1pp2") == Topology(pp=2)  # ep1 is tp1: no expert parallelism
    with pytest.raises(TopologyError) as raised:
        Topology.parse("tp2ep2")
    assert str(raised.value) == ("invalid topology 'tp2ep2': tp=2 with ep=2: tensor and expert parallelism in one "
                                 "stage is not supported yet (use tpXppY or epXppY)")
    with pytest.raises(TopologyError, match=r"^invalid topology 'ep2dp2': dp=2: data parallelism outside expert "
                                            r"parallelism is not supported yet$"):
        Topology.parse("ep2dp2")


@pytest.mark.parametrize(("text", "ep", "pp"), [("ep2pp1", 2, 1), ("EP4", 4, 1), ("pp2ep2", 2, 2), ("tp1ep8pp3", 8, 3)])
def test_parse_expert_parallel(text: str, ep: int, pp: int) -> None:
    topology = Topology.parse(text)
    assert topology == Topology(ep=ep, pp=pp)
    assert str(topology) == f"ep{ep}pp{pp}"
    assert topology.is_expert_parallel and topology.tp == 1
    assert topology.stage_size == ep and topology.num_workers == ep * pp


def test_tensor_parallel_is_not_expert_parallel() -> None:
    topology = Topology(tp=4, pp=2)
    assert not topology.is_expert_parallel and topology.stage_size == 4 and topology.num_workers == 8


def test_str_always_names_both_degrees() -> None:
    assert str(Topology(tp=2, pp=2)) == "tp2pp2"
    assert str(Topology()) == "tp1pp1"
    assert str(Topology.parse("pp3")) == "tp1pp3"


@given(tp=st.integers(1, 64), pp=st.integers(1, 64), expert_parallel=st.booleans())
@settings(max_examples=100, deadline=None)
def test_parse_str_round_trip(tp: int, pp: int, expert_parallel: bool) -> None:
    topology = Topology(ep=tp, pp=pp) if expert_parallel else Topology(tp=tp, pp=pp)
    assert Topology.parse(str(topology)) == topology
    assert topology.num_workers == tp * pp == topology.stage_size * pp


@pytest.mark.parametrize("degrees", [dict(tp=0), dict(pp=-1), dict(tp=2.0), dict(pp="2"), dict(tp=True)])
def test_fields_must_be_positive_ints(degrees: dict) -> None:
    with pytest.raises(TopologyError, match="must be an int >= 1"):
        Topology(**degrees)


@pytest.mark.parametrize(("degrees", "message"), [
    (dict(dp=2), "dp=2: data parallelism outside expert parallelism is not supported yet"),
    (dict(ep=2, dp=2), "dp=2: data parallelism outside expert parallelism is not supported yet"),
    (dict(tp=2, ep=4), "tp=2 with ep=4: tensor and expert parallelism in one stage is not supported yet "
                       "(use tpXppY or epXppY)"),
])
def test_tp_with_ep_and_dp_not_supported_yet(degrees: dict, message: str) -> None:
    with pytest.raises(TopologyError) as raised:
        Topology(**degrees)
    assert str(raised.value) == message


def test_topology_is_frozen_and_hashable() -> None:
    topology = Topology(tp=2, pp=2)
    with pytest.raises(AttributeError):
        topology.tp = 4  # type: ignore[misc]
    assert len({topology, Topology.parse("pp2tp2")}) == 1


def test_model_shape_rejects_bad_dimensions() -> None:
    with pytest.raises(ValueError, match="num_layers=0"):
        make_shape(num_layers=0)
    with pytest.raises(ValueError, match="num_kv_heads=3 does not divide num_heads=8"):
        make_shape(num_kv_heads=3)
    assert make_shape(num_heads=32, num_kv_heads=8).num_queries_per_kv == 4


def test_validate_accepts_runnable_topology() -> None:
    validate(Topology(tp=4, pp=2), make_shape(), num_workers=8)
    validate(Topology(tp=8), make_shape(num_heads=8, num_kv_heads=1), num_workers=8)  # MQA, replicated KV
    validate(Topology(tp=1, pp=2), make_shape(), num_workers=2, layer_partition=[3, 1])


def _reasons(error: TopologyError) -> str:
    """The reasons of a refusal, without the layouts it lists (test_a_refusal_lists_the_layouts_that_run)."""
    return str(error).partition(" (this model allows on ")[0]


def test_a_refusal_lists_the_layouts_that_run() -> None:
    smollm2 = make_shape(num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536)
    with pytest.raises(TopologyError) as raised:
        validate(Topology(tp=2, pp=2), smollm2, num_workers=4)
    assert str(raised.value) == ("tp=2 does not divide num_heads=9; num_kv_heads=3 and tp=2: one must divide the "
                                 "other (this model allows on 4 workers: tp1pp1, tp1pp2, tp1pp3, tp3pp1, tp1pp4)")
    with pytest.raises(TopologyError, match=r"\(this model allows on 1 workers: tp1pp1\)$"):
        validate(Topology(pp=2), smollm2, num_workers=1)


@pytest.mark.parametrize(
    ("topology", "overrides", "num_workers", "partition", "message"),
    [
        (Topology(tp=3), dict(num_kv_heads=1, intermediate_size=768), 4, None, "tp=3 does not divide num_heads=8"),
        (Topology(tp=4), dict(num_heads=24, num_kv_heads=6), 4, None, "num_kv_heads=6 and tp=4: one must divide the other"),
        (Topology(tp=4), dict(intermediate_size=706), 4, None, "tp=4 does not divide intermediate_size=706"),
        (Topology(pp=5), {}, 8, None, "pp=5 exceeds num_layers=4"),
        (Topology(tp=4, pp=2), {}, 4, None, "tp*pp=8 exceeds the 4 available workers"),
        (Topology(pp=2), {}, 2, [1, 1, 2], "layer_partition has 3 entries for pp=2"),
        (Topology(pp=2), {}, 2, [2, 3], "layer_partition sums to 5, model has 4 layers"),
        (Topology(pp=2), {}, 2, [4, 0], "layer_partition entries must be >= 1"),
    ],
)
def test_validate_each_message(
    topology: Topology, overrides: dict, num_workers: int, partition: list[int] | None, message: str
) -> None:
    with pytest.raises(TopologyError) as raised:
        validate(topology, make_shape(**overrides), num_workers, partition)
    assert _reasons(raised.value) == message


def test_validate_lists_every_failure() -> None:
    shape = make_shape(num_heads=24, num_kv_heads=6, intermediate_size=700)
    with pytest.raises(TopologyError) as raised:
        validate(Topology(tp=9, pp=5), shape, num_workers=16, layer_partition=[1, 2, 2])
    assert _reasons(raised.value) == "; ".join(
        [
            "tp=9 does not divide num_heads=24",
            "num_kv_heads=6 and tp=9: one must divide the other",
            "tp=9 does not divide intermediate_size=700",
            "pp=5 exceeds num_layers=4",
            "tp*pp=45 exceeds the 16 available workers",
            "layer_partition has 3 entries for pp=5",
            "layer_partition sums to 5, model has 4 layers",
        ]
    )


def test_candidate_topologies_example() -> None:
    candidates = candidate_topologies(make_shape(), num_workers=8)
    assert [str(t) for t in candidates] == [
        "tp1pp1",
        "tp1pp2",
        "tp2pp1",
        "tp1pp3",
        "tp1pp4",
        "tp2pp2",
        "tp4pp1",
        "tp2pp3",
        "tp2pp4",
        "tp4pp2",
        "tp8pp1",
    ]
    assert candidate_topologies(make_shape(), num_workers=0) == []


@given(
    num_kv_heads=st.integers(1, 12),
    group=st.integers(1, 6),
    num_layers=st.integers(1, 12),
    intermediate_size=st.integers(1, 512),
    num_workers=st.integers(0, 12),
)
@settings(max_examples=60, deadline=None)
def test_candidate_topologies_are_exactly_the_valid_ones(
    num_kv_heads: int, group: int, num_layers: int, intermediate_size: int, num_workers: int
) -> None:
    shape = make_shape(
        num_layers=num_layers,
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
    )
    candidates = candidate_topologies(shape, num_workers)
    assert candidates == sorted(candidates, key=lambda t: (t.tp * t.pp, t.tp))
    assert len(set(candidates)) == len(candidates)
    for tp in range(1, num_workers + 2):
        for pp in range(1, num_workers + 2):
            topology = Topology(tp=tp, pp=pp)
            try:
                validate(topology, shape, num_workers)
                is_valid = True
            except TopologyError:
                is_valid = False
            assert (topology in candidates) == is_valid
            if is_valid:
                assert tp * pp <= num_workers and pp <= num_layers


@given(num_heads=st.sampled_from([4, 6, 8, 12]), num_layers=st.integers(1, 12), world=st.integers(1, 8),
       lost=st.integers(1, 7), num_experts=st.sampled_from([0, 4, 6, 8]), data=st.data())
@settings(max_examples=200, deadline=None)
def test_degraded_topology_uses_the_most_survivors(num_heads, num_layers, world, lost, num_experts, data) -> None:
    """After losing workers: the live layout if it still fits, else a valid one using as many survivors as any,
    expert-parallel if the live one was and such a one uses as many."""
    moe = dict(num_experts=num_experts, num_experts_per_tok=1, moe_intermediate_size=64, moe_layers=(0,))
    shape = make_shape(num_heads=num_heads, num_kv_heads=2, num_layers=num_layers, **(moe if num_experts else {}))
    current = data.draw(st.sampled_from(candidate_topologies(shape, world)))
    survivors = world - min(lost, world - 1)
    chosen = degraded_topology(current, shape, survivors)
    validate(chosen, shape, survivors)
    if current.num_workers <= survivors:
        assert chosen == current
    else:
        fits = candidate_topologies(shape, survivors)
        most = max(t.num_workers for t in fits)
        assert chosen.num_workers == most
        same_kind = [t for t in fits if t.num_workers == most and t.is_expert_parallel == current.is_expert_parallel]
        assert chosen.is_expert_parallel == current.is_expert_parallel or not same_kind


def test_degraded_topology_examples() -> None:
    shape = make_shape(num_heads=4, num_kv_heads=2, num_layers=3)
    assert degraded_topology(Topology.parse("tp2pp2"), shape, 3) == Topology.parse("tp1pp3")  # tp3 splits no head
    assert degraded_topology(Topology.parse("tp4pp1"), shape, 2) == Topology.parse("tp2pp1")  # nearest tp
    assert degraded_topology(Topology.parse("tp2pp1"), shape, 3) == Topology.parse("tp2pp1")  # a standby stepped in
    with pytest.raises(TopologyError, match="fits 0 workers"):
        degraded_topology(Topology.parse("tp1pp1"), shape, 0)


# --- mixture of experts -------------------------------------------------------------------------------------------

def make_moe_shape(**overrides) -> ModelShape:
    """8 experts (top-2) of intermediate 96 in layers 1..3; layer 0 dense."""
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, moe_layers=(1, 2, 3))
    return make_shape(**(moe | overrides))


def test_model_shape_moe_fields() -> None:
    assert make_moe_shape().is_moe and not make_shape().is_moe
    with pytest.raises(ValueError, match=r"needs 1 <= num_experts_per_tok <= num_experts and moe_intermediate_size "
                                         r">= 1, got \(8, 9, 96\)"):
        make_moe_shape(num_experts_per_tok=9)
    with pytest.raises(ValueError, match=r"got \(8, 2, 0\)"):
        make_moe_shape(moe_intermediate_size=0)
    with pytest.raises(ValueError, match=r"moe_layers \(\) must be sorted distinct layer ids below 4"):
        make_moe_shape(moe_layers=())
    for bad in [(3, 1), (1, 1), (4,), (-1,)]:
        with pytest.raises(ValueError, match="must be sorted distinct layer ids below 4"):
            make_moe_shape(moe_layers=bad)
    with pytest.raises(ValueError, match="a MoE model needs"):
        make_shape(moe_layers=(0,))  # sparse layers without experts


def test_validate_accepts_expert_parallel_moe() -> None:
    validate(Topology(ep=8), make_moe_shape(), num_workers=8)
    validate(Topology(ep=4, pp=2), make_moe_shape(), num_workers=8)
    validate(Topology(ep=4), make_moe_shape(num_experts=6), num_workers=4, num_redundant_experts=2)
    validate(Topology(tp=4), make_moe_shape(), num_workers=4, num_redundant_experts=3)  # TP ignores redundancy


@pytest.mark.parametrize(
    ("topology", "shape", "redundant", "message"),
    [
        (Topology(ep=2), make_shape(), 0, "ep=2 needs a mixture-of-experts model (this one is dense)"),
        (Topology(ep=3), make_moe_shape(), 0, "ep=3 does not divide the 8 physical experts (8 + 0 redundant)"),
        (Topology(ep=4), make_moe_shape(), 2, "ep=4 does not divide the 10 physical experts (8 + 2 redundant)"),
        (Topology(tp=8), make_moe_shape(moe_intermediate_size=100), 0,
         "tp=8 does not divide the experts' moe_intermediate_size=100"),
        (Topology(ep=2), make_moe_shape(), -2, "num_redundant_experts=-2 must be >= 0"),
        (Topology(ep=8, pp=2), make_moe_shape(), 0, "ep*pp=16 exceeds the 8 available workers"),
    ],
)
def test_validate_moe_messages(topology: Topology, shape: ModelShape, redundant: int, message: str) -> None:
    with pytest.raises(TopologyError) as raised:
        validate(topology, shape, 8, num_redundant_experts=redundant)
    assert _reasons(raised.value) == message


def test_candidate_topologies_moe_example() -> None:
    candidates = candidate_topologies(make_moe_shape(), num_workers=4)
    assert [str(t) for t in candidates] == [
        "tp1pp1", "tp1pp2", "ep2pp1", "tp2pp1", "tp1pp3", "tp1pp4", "ep2pp2", "ep4pp1", "tp2pp2", "tp4pp1"]
    with_spares = candidate_topologies(make_moe_shape(), num_workers=4, num_redundant_experts=2)
    assert [str(t) for t in with_spares if t.is_expert_parallel] == ["ep2pp1", "ep2pp2"]  # 10 slots: not ep4
    assert all(not t.is_expert_parallel for t in candidate_topologies(make_shape(), num_workers=4))


@given(
    num_experts=st.integers(1, 12),
    moe_intermediate_size=st.integers(1, 64),
    redundant=st.integers(0, 6),
    num_layers=st.integers(1, 6),
    num_workers=st.integers(0, 9),
)
@settings(max_examples=60, deadline=None)
def test_moe_candidate_topologies_are_exactly_the_valid_ones(
    num_experts: int, moe_intermediate_size: int, redundant: int, num_layers: int, num_workers: int
) -> None:
    shape = make_moe_shape(num_layers=num_layers, num_experts=num_experts, num_experts_per_tok=1,
                           moe_intermediate_size=moe_intermediate_size, moe_layers=(num_layers - 1,))
    candidates = candidate_topologies(shape, num_workers, num_redundant_experts=redundant)
    assert candidates == sorted(candidates, key=lambda t: (t.num_workers, t.tp, t.ep))
    assert len(set(candidates)) == len(candidates)
    for width in range(1, num_workers + 2):
        for pp in range(1, num_workers + 2):
            for topology in {Topology(tp=width, pp=pp), Topology(ep=width, pp=pp)}:
                try:
                    validate(topology, shape, num_workers, num_redundant_experts=redundant)
                    is_valid = True
                except TopologyError:
                    is_valid = False
                assert (topology in candidates) == is_valid
                if is_valid and topology.is_expert_parallel:
                    assert (num_experts + redundant) % width == 0
                if is_valid:
                    assert moe_intermediate_size % topology.tp == 0


def test_degraded_topology_keeps_expert_parallelism() -> None:
    shape = make_moe_shape()
    assert degraded_topology(Topology.parse("ep4pp2"), shape, 7) == Topology.parse("ep2pp3")  # 6 workers, still EP
    assert degraded_topology(Topology.parse("tp4pp1"), shape, 3) == Topology.parse("tp1pp3")
    assert degraded_topology(Topology.parse("ep2pp1"), shape, 1) == Topology.parse("tp1pp1")
    # 8 experts + 4 spares: ep3 would not divide 8, but divides 12
    assert degraded_topology(Topology.parse("ep4pp1"), shape, 3, num_redundant_experts=4) == Topology.parse("ep3pp1")
    assert degraded_topology(Topology.parse("ep4pp1"), shape, 3) == Topology.parse("tp1pp3")
