"""GPU placement before start: one NCCL rank per GPU unless the GPUs are shared on purpose."""

from __future__ import annotations

import pytest

from services.topology import DevicePlacementError, assign_gpus, parse_gpus


@pytest.mark.parametrize("spec,parsed", [
    (None, None), ("2", 2), (3, 3), ("0,1", (0, 1)), ("3,", (3,)), (" 1, 0 ", (1, 0)), ([2, 3], (2, 3)),
])
def test_parse_gpus(spec, parsed):
    assert parse_gpus(spec) == parsed


def test_parse_gpus_refuses_words():
    with pytest.raises(DevicePlacementError, match="count"):
        parse_gpus("first")


@pytest.mark.parametrize("num_workers,visible,gpus,sharing,placed", [
    (4, 4, None, False, (0, 1, 2, 3)),       # the default: one rank per visible GPU
    (2, 4, None, False, (0, 1)),
    (2, 4, (3, 1), False, (3, 1)),           # ordinals among the visible GPUs, in rank order
    (2, 4, 2, False, (0, 1)),                # a count: the first ones
    (4, 1, None, True, (0, 0, 0, 0)),        # shared: rank i on gpus[i % n]
    (3, 2, None, True, (0, 1, 0)),
    (2, 2, (1, 1), True, (1, 1)),
])
def test_assign_gpus(num_workers, visible, gpus, sharing, placed):
    assert assign_gpus(num_workers, visible, gpus, sharing) == placed


def test_two_nccl_ranks_on_one_gpu_are_refused_with_the_way_out():
    """The issue's case: `reconfig up --device cuda` with its 4 workers on a one-GPU machine."""
    with pytest.raises(DevicePlacementError) as refused:
        assign_gpus(4, 1)
    message = str(refused.value)
    assert "4 workers on 1 GPU" in message and "Duplicate GPU detected" in message
    assert "--workers 1" in message and "--gpu-sharing" in message and "--gpus" in message


@pytest.mark.parametrize("num_workers,visible,gpus,match", [
    (2, 0, None, "no GPU is visible"),
    (2, 2, (0, 0), "more than once"),
    (2, 2, (0, 2), "no GPU 2 among the 2 GPUs visible"),
    (1, 2, 3, "between 1 and"),
    (1, 2, (), "names no GPU"),
    (3, 4, 2, "3 workers on 2 GPUs"),
])
def test_refusals(num_workers, visible, gpus, match):
    with pytest.raises(DevicePlacementError, match=match):
        assign_gpus(num_workers, visible, gpus)


def test_no_gpu_is_refused_even_when_shared():
    with pytest.raises(DevicePlacementError, match="--device cpu"):
        assign_gpus(1, 0, gpu_sharing=True)
